"""Fused update kernels for CuPy arrays: Adam/AdamW (with AMSGrad) and SGD (momentum, Nesterov).

The GPU's counterpart of ``kernels.py`` (numba, CPU): one ``cupy.ElementwiseKernel`` per rule,
one pass over memory per step, each element computed in torch's order of operations, the same
expressions as ``kernels.py`` (see there for which torch line each one mirrors). The
coefficients are ``fused.AdamCoefficients`` / ``fused.SGDCoefficients``, made by the rules in
``adam.py`` and ``sgd.py`` exactly as for the CPU kernels.

Used for float32 and float64 CuPy arrays (parameter, gradient and states of one dtype,
contiguous); 16-bit parameters, whose state is float32, take the rules' element-wise path.
CuPy compiles a kernel on its first call and caches it. This module imports CuPy on first use
only; it runs where CuPy sees a GPU (tests/test_gpu.py). A dry run standing for CuPy takes the
same branch and counts each call as the one kernel it is (``fused.shape_only_kernel``), so its
time model prices the step as one pass over memory, not as the rules' ufunc calls.
"""

from __future__ import annotations

import functools
from typing import Any

from zerosim.backend import is_cupy, stands_for_gpu, xp_of
from zerosim.optim.functional import fused

_ADAM_IN = (
    "T g, T weight_decay, bool maximize, T decay, bool decoupled, T lerp_scale, "
    "bool lerp_upper, T beta2, T one_minus_beta2, T bias_correction2_sqrt, T eps, "
    "T neg_step_size"
)
_ADAM_MOMENTS = """
    T pp = decoupled ? p * decay : p;
    T gg = maximize ? -g : g;
    if (weight_decay != 0) gg = gg + weight_decay * pp;
    T d = (gg - m) * lerp_scale;
    T mm = lerp_upper ? gg - d : m + d;
    T vv = v * beta2 + (one_minus_beta2 * gg) * gg;
    m = mm;
    v = vv;
"""
_ADAM_PARAM = "p = pp + (neg_step_size * mm) / (sqrt({v}) / bias_correction2_sqrt + eps);"

_SGD_IN = (
    "T g, T weight_decay, bool maximize, T neg_lr, T momentum, T one_minus_dampening, "
    "bool dampened, bool nesterov, bool first_step"
)
_SGD_GRAD = """
    T gg = maximize ? -g : g;
    if (weight_decay != 0) gg = gg + weight_decay * p;
"""


@functools.cache
def _kernels() -> dict[str, Any]:
    import cupy  # noqa: PLC0415  (GPU-only)

    # no fused multiply-add contraction: each product is rounded before its sum, as NumPy and
    # torch's CPU path round it, so the kernels agree with them to the bit
    k = functools.partial(cupy.ElementwiseKernel, options=("--fmad=false",))
    return {
        "adam": k(_ADAM_IN, "T p, T m, T v", _ADAM_MOMENTS + _ADAM_PARAM.format(v="vv"), "zs_adam"),
        "adam_amsgrad": k(
            _ADAM_IN,
            "T p, T m, T v, T v_max",
            _ADAM_MOMENTS
            + "T vm = (v_max > vv || v_max != v_max) ? v_max : vv;\nv_max = vm;\n"
            + _ADAM_PARAM.format(v="vm"),
            "zs_adam_amsgrad",
        ),
        "sgd": k(_SGD_IN, "T p", _SGD_GRAD + "p = p + neg_lr * gg;", "zs_sgd"),
        "sgd_momentum": k(
            _SGD_IN,
            "T p, T b",
            _SGD_GRAD
            + """
            T bb = first_step ? gg : (dampened ? b * momentum + one_minus_dampening * gg
                                               : b * momentum + gg);
            b = bb;
            T d = nesterov ? gg + momentum * bb : bb;
            p = p + neg_lr * d;
            """,
            "zs_sgd_momentum",
        ),
    }


def applies(param: Any, grad: Any, *states: Any) -> bool:
    """True for CuPy arrays of one float32/float64 dtype, all contiguous (None states skipped),
    unless the fused path is switched off (``fused.switched_off``)."""
    arrays = (param, grad, *(s for s in states if s is not None))
    if not _stands_for_cupy(param) or fused.switched_off():
        return False
    return all(
        type(a) is type(param)
        and a.dtype == param.dtype
        and a.dtype.name in ("float32", "float64")
        and a.flags.c_contiguous
        for a in arrays
    )


def _stands_for_cupy(x: Any) -> bool:
    """A CuPy array, or a dry run's shape-only array standing for one (``meta.Values.backend``
    "cupy")."""
    return is_cupy(x) or stands_for_gpu(x)


def adam(param: Any, grad: Any, states: list[Any], c: Any, amsgrad: bool) -> None:
    """Adam/AdamW in one kernel call; ``c`` is ``fused.AdamCoefficients``."""
    m, v, v_max = states
    if not is_cupy(param):  # a dry run: the one call counted
        fused.shape_only_kernel(xp_of(param))(param, grad, *(s for s in states if s is not None), c)
        return
    scalars = (
        c.weight_decay,
        c.maximize,
        c.decay,
        c.decoupled,
        c.lerp_scale,
        c.lerp_upper,
        c.beta2,
        c.one_minus_beta2,
        c.bias_correction2_sqrt,
        c.eps,
        c.neg_step_size,
    )
    if amsgrad:
        _kernels()["adam_amsgrad"](grad, *scalars, param, m, v, v_max)
    else:
        _kernels()["adam"](grad, *scalars, param, m, v)


def sgd(param: Any, grad: Any, buffer: Any, c: Any) -> None:
    """SGD in one kernel call; ``c`` is ``fused.SGDCoefficients``; ``buffer`` None without
    momentum."""
    scalars = (
        c.weight_decay,
        c.maximize,
        c.neg_lr,
        c.momentum,
        c.one_minus_dampening,
        c.dampened,
        c.nesterov,
        c.first_step,
    )
    if not is_cupy(param):  # a dry run: the one call counted
        fused.shape_only_kernel(xp_of(param))(
            param, grad, *(b for b in (buffer,) if b is not None), c
        )
        return
    if buffer is None:
        _kernels()["sgd"](grad, *scalars, param)
    else:
        _kernels()["sgd_momentum"](grad, *scalars, param, buffer)
