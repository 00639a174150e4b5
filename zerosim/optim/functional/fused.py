"""The fused path of the update rules: the switch, when it applies, and how a kernel is called.

A rule in NumPy is a chain of ufunc calls (Adam: twelve per block), each a pass over a
block in the cache (``common.blocks``). The kernels in ``kernels.py``, compiled by numba,
do the whole step for one element before moving to the next, so each array goes through
the CPU once per step, in registers: one pass over memory. Each kernel follows torch's
single-tensor order of operations (written in its docstring), so results stay within the
last bits of torch.optim, like the NumPy path's.

numba is optional (``pip install zerosim[fast]``). A rule takes the fused path when

- numba can be imported and the path is not switched off: ``ZEROSIM_FUSED=0`` in the
  environment, or ``set_fused(False)`` (which wins over the environment);
- ``param``, ``grad`` and every state array are NumPy arrays (not CuPy or array_api_strict)
  and C-contiguous (a strided view takes the NumPy path). CuPy arrays take the
  ElementwiseKernels of ``cupy_kernels.py`` under the same switch (numba not needed there).

float32 and float64 parameters are updated in one kernel call over the whole arrays. A
float16/bfloat16 parameter (or a gradient of another dtype) is walked in blocks as on the
NumPy path, each block upcast into a float32 work buffer, stepped by the same float32
kernel and rounded back; so a 16-bit parameter steps exactly like its float32 copy.
Keras's Adam variant (``variant="keras"``) always takes the NumPy path.

numba is imported at the first fused call, not at ``import zerosim``; compiled kernels are
cached on disk (``cache=True``: ``__pycache__`` beside ``kernels.py``, or NUMBA_CACHE_DIR),
so only the first run on a machine pays the compile time (docs/install.md has the numbers).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from zerosim.backend import is_host_array, xp_of
from zerosim.optim.functional.common import blocks, lerp_scale, state_dtype

ENV_VAR = "ZEROSIM_FUSED"  # "0": NumPy path; "1" or unset: fused when numba is importable
_setting: bool | None = None  # set_fused(); None follows the environment


@functools.cache
def numba_available() -> bool:
    """True when numba can be imported (it is not imported here)."""
    return importlib.util.find_spec("numba") is not None


def set_fused(enabled: bool | None) -> None:
    """Choose the path of every rule: True fused, False NumPy, None as ``ZEROSIM_FUSED`` says.

    Raises ImportError for True when numba is not installed.
    """
    global _setting
    if enabled not in (True, False, None):
        raise ValueError(f"set_fused(enabled={enabled!r}): allowed values are True, False, None")
    if enabled and not numba_available():
        raise ImportError("set_fused(True) needs numba: pip install 'zerosim[fast]'")
    _setting = enabled


@contextlib.contextmanager
def use_fused(enabled: bool | None) -> Iterator[None]:
    """``with use_fused(False): ...`` runs the block on the chosen path, then restores the last."""
    before = _setting
    set_fused(enabled)
    try:
        yield
    finally:
        set_fused(before)


def switched_off() -> bool:
    """Whether the fused path is switched off (``set_fused(False)``, else ``ZEROSIM_FUSED=0``);
    the CuPy kernels (``cupy_kernels.py``) follow the same switch."""
    if _setting is not None:
        return not _setting
    value = os.environ.get(ENV_VAR, "1")
    if value not in ("0", "1", ""):
        raise ValueError(f"{ENV_VAR}={value!r} is not supported; allowed: '0' (NumPy) or '1'")
    return value == "0"


def fused_enabled() -> bool:
    """Whether the rules take the fused path now (numba importable and not switched off)."""
    return not switched_off() and numba_available()


def applies(param: Any, grad: Any, *states: Any) -> bool:
    """True when a rule should call its kernel on these arrays (None states are skipped)."""
    if not fused_enabled():
        return False
    arrays = (param, grad, *(s for s in states if s is not None))
    return all(is_host_array(a) and a.flags.c_contiguous for a in arrays)


def kernels() -> ModuleType:
    """The compiled kernels (``zerosim.optim.functional.kernels``); imports numba on first use."""
    from zerosim.optim.functional import kernels as module

    return module


def run(
    kernel: Callable[..., None],
    param: Any,
    grad: Any,
    states: Sequence[Any],
    coefficients: tuple,
    scratch: Any = None,
) -> None:
    """``kernel(param, grad, *states, coefficients)`` on flat views, or block by block.

    None entries of ``states`` (unused state arrays) are left out.

    Flat when param and grad have the state dtype (float32/float64); otherwise the blocks
    of ``common.blocks`` (16-bit values upcast into ``scratch``, then rounded back).
    """
    states = [s for s in states if s is not None]
    if not isinstance(param, np.ndarray):  # a dry run standing for NumPy: the call is counted
        kernel = shape_only_kernel(xp_of(param))
    want = state_dtype(param.dtype)
    if param.dtype == want and grad.dtype == want:
        flat = [a.reshape(-1) for a in (param, grad, *states)]
        kernel(*flat, coefficients)
        return
    for p, g, state_blocks, _ in blocks(param, grad, states, 0, scratch):
        kernel(p, g, *state_blocks, coefficients)


def shape_only_kernel(xp: Any) -> Callable[..., None]:
    """A kernel's stand-in on the dry run's shape-only arrays: counts the call (in place, it
    allocates nothing)."""

    def call(*arrays_and_coefficients: Any) -> None:
        xp.kernel(*arrays_and_coefficients[:-1])

    return call


def rounder(param: Any) -> Callable[[float], Any]:
    """The function that rounds a Python float to the state dtype of ``param`` (np.float32 …).

    The kernels do their arithmetic in the type of their coefficients, so a float32
    parameter's step is float32 arithmetic throughout, as on the NumPy path and in torch.
    """
    return state_dtype(param.dtype).type


# --- the coefficients of each kernel, made once per step --------------------------------------
# Floats are rounded to the state dtype (``rounder``), flags are Python bools. Every rule
# starts from the gradient g' = (−g if maximize else g) + weight_decay·θ (coupled decay,
# skipped when 0); the decoupled decay θ ← decay·θ with decay = 1 − lr·λ comes first.


def adam_family(step: Any, r: Callable[[float], Any]) -> dict[str, Any]:
    """The coefficients every Adam-family kernel (Adam, NAdam, RAdam) starts with, from a step
    record with lr, beta1, beta2, weight_decay, decoupled_weight_decay and maximize: the
    gradient's sign and coupled decay, the decoupled decay, m's lerp toward g and v's β₂.
    ``r`` rounds to the state dtype (``rounder``)."""
    decoupled = step.decoupled_weight_decay
    return {
        "weight_decay": r(0.0 if decoupled else step.weight_decay),
        "maximize": step.maximize,
        "decay": r(1.0 - step.lr * step.weight_decay),
        "decoupled": decoupled and step.weight_decay != 0,
        "lerp_scale": r(lerp_scale(1.0 - step.beta1)),
        "lerp_upper": 1.0 - step.beta1 >= 0.5,
        "beta2": r(step.beta2),
        "one_minus_beta2": r(1.0 - step.beta2),
    }


class AdamCoefficients(NamedTuple):
    """Adam and AdamW (torch's variant)."""

    weight_decay: Any  # coupled (0 when decoupled)
    maximize: bool
    decay: Any
    decoupled: bool
    lerp_scale: Any  # m ← lerp(m, g, 1 − β₁): the factor of (g − m), see common.lerp_
    lerp_upper: bool  # 1 − β₁ ≥ 0.5: torch's second form, g − (1 − w)·(g − m)
    beta2: Any
    one_minus_beta2: Any
    bias_correction2_sqrt: Any  # √(1 − β₂ᵗ)
    eps: Any
    neg_step_size: Any  # −lr/(1 − β₁ᵗ)


class NAdamCoefficients(NamedTuple):
    weight_decay: Any
    maximize: bool
    decay: Any
    decoupled: bool
    lerp_scale: Any
    lerp_upper: bool
    beta2: Any
    one_minus_beta2: Any
    bias_correction2: Any  # 1 − β₂ᵗ
    eps: Any
    grad_coef: Any  # −lr·(1 − μ_t)/(1 − Π μ)
    avg_coef: Any  # −lr·μ_{t+1}/(1 − Π μ·μ_{t+1})


class RAdamCoefficients(NamedTuple):
    weight_decay: Any
    maximize: bool
    decay: Any
    decoupled: bool
    lerp_scale: Any
    lerp_upper: bool
    beta2: Any
    one_minus_beta2: Any
    bias_correction1: Any  # 1 − β₁ᵗ
    lr: Any
    rectified: bool  # ρ_t > 5
    bias_correction2_sqrt: Any
    eps: Any
    rect: Any  # r_t


class SGDCoefficients(NamedTuple):
    weight_decay: Any
    maximize: bool
    neg_lr: Any
    momentum: Any
    one_minus_dampening: Any
    dampened: bool  # dampening ≠ 0
    nesterov: bool
    first_step: bool  # the momentum buffer starts as the gradient


class AdagradCoefficients(NamedTuple):
    weight_decay: Any
    maximize: bool
    neg_clr: Any  # −lr/(1 + (t − 1)·lr_decay)
    eps: Any


class RMSpropCoefficients(NamedTuple):
    weight_decay: Any
    maximize: bool
    alpha: Any
    one_minus_alpha: Any
    lerp_scale: Any  # ḡ ← lerp(ḡ, g, 1 − α) (centered)
    lerp_upper: bool
    eps: Any
    momentum: Any
    neg_lr: Any


class AdamaxCoefficients(NamedTuple):
    weight_decay: Any
    maximize: bool
    lerp_scale: Any
    lerp_upper: bool
    beta2: Any
    eps: Any
    neg_clr: Any  # −lr/(1 − β₁ᵗ)
    keras: bool  # ε added to the denominator instead of inside the max


class LionCoefficients(NamedTuple):
    maximize: bool
    decay: Any
    decays: bool  # λ ≠ 0
    beta1: Any
    one_minus_beta1: Any
    beta2: Any
    one_minus_beta2: Any
    lr: Any
