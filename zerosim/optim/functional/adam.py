"""Adam and AdamW (with AMSGrad; Kingma & Ba 2015, Loshchilov & Hutter 2019), and Keras's variant.

``adam`` updates ``param`` and its state arrays in place, block by block (see
``common.blocks``). Hyperparameters are trusted here; the optimizer classes validate them.

``variant="keras"`` selects Keras/TensorFlow's arithmetic where it differs from torch's:
Adam adds ε to the *uncorrected* root and folds both bias corrections into the step size
(the "more efficient order" below Algorithm 1 of Kingma & Ba). (Adamax's Keras variant: adamax.py.)
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from zerosim.optim.functional import cupy_kernels, fused
from zerosim.optim.functional.common import (
    add_square_,
    blocks,
    check_arrays,
    check_variant,
    coupled_weight_decay,
    effective_grad,
    lerp_,
    lerp_scale,
    scalar,
    xp_of,
)


class Moments:
    """Adam's biased first and second moment estimates (Kingma & Ba, Alg. 1), in place::

        m ← β₁·m + (1 − β₁)·g      as torch.lerp computes it (see ``lerp_``)
        v ← β₂·v + (1 − β₂)·g²     as torch's addcmul computes it: ((1 − β₂)·g)·g

    The coefficients are rounded to the state dtype once per step (``scalar``); ``update_``
    then makes 7 ufunc calls per block.
    """

    def __init__(self, param: Any, beta1: float, beta2: float) -> None:
        self.weight = 1.0 - beta1
        self.lerp_scale = scalar(lerp_scale(self.weight), param)
        self.beta2 = scalar(beta2, param)
        self.one_minus_beta2 = scalar(1.0 - beta2, param)

    def update_(self, m: Any, v: Any, g: Any, tmp: Any) -> None:
        lerp_(m, g, self.weight, tmp, scale=self.lerp_scale)
        add_square_(v, g, self.beta2, tmp, one_minus_beta=self.one_minus_beta2)


class AdamStep(NamedTuple):
    """One Adam step's hyperparameters and the scalars both of ``adam``'s paths derive."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: float
    decoupled_weight_decay: bool
    maximize: bool

    @property
    def bias_correction1(self) -> float:
        return 1.0 - self.beta1**self.step

    @property
    def bias_correction2_sqrt(self) -> float:
        return math.sqrt(1.0 - self.beta2**self.step)

    coupled_decay = property(coupled_weight_decay)

    @property
    def decoupled(self) -> bool:
        """AdamW with a decay that changes θ."""
        return self.decoupled_weight_decay and self.weight_decay != 0

    def fused(self, param: Any) -> fused.AdamCoefficients:
        """The coefficients of the fused kernels, rounded to ``param``'s state dtype."""
        r = fused.rounder(param)
        return fused.AdamCoefficients(
            **fused.adam_family(self, r),
            bias_correction2_sqrt=r(self.bias_correction2_sqrt),
            eps=r(self.eps),
            neg_step_size=r(-self.lr / self.bias_correction1),
        )


def adam(
    param: Any,
    grad: Any,
    exp_avg: Any,
    exp_avg_sq: Any,
    max_exp_avg_sq: Any = None,
    *,
    step: float,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    maximize: bool = False,
    decoupled_weight_decay: bool = False,
    variant: str = "torch",
    scratch: Any = None,
) -> None:
    """One Adam step (Kingma & Ba 2015, "Adam: A Method for Stochastic Optimization", Alg. 1).

    With g = ±∇ (plus λ·θ unless decoupled), m = ``exp_avg``, v = ``exp_avg_sq`` and
    t = ``step`` (1 on the first update)::

        θ ← θ·(1 − lr·λ)                            (decoupled: AdamW, Loshchilov & Hutter 2019)
        m ← β₁·m + (1 − β₁)·g
        v ← β₂·v + (1 − β₂)·g²
        v̂ ← max(v̂, v), use v̂ for v below          (amsgrad: Reddi, Kale & Kumar 2018)
        torch:  θ ← θ − lr/(1 − β₁ᵗ) · m / (√v / √(1 − β₂ᵗ) + ε)
        keras:  θ ← θ − lr·√(1 − β₂ᵗ)/(1 − β₁ᵗ) · m / (√v + ε)

    ``max_exp_avg_sq`` is required when amsgrad is True. With numba (``fused.py``) or on
    CuPy, the torch variant is one kernel call, one pass over memory, in torch's order: the
    denominator √v/√(1 − β₂ᵗ) + ε, then θ + (−lr/(1 − β₁ᵗ)·m)/denominator. Otherwise the
    update is a sequence of ufunc calls per block (``_adam_blocks``).
    """
    check_variant(variant)
    if amsgrad and max_exp_avg_sq is None:
        raise ValueError("amsgrad=True needs a max_exp_avg_sq array; got None")
    states = [exp_avg, exp_avg_sq, max_exp_avg_sq if amsgrad else None]
    check_arrays(param, grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, max_exp_avg_sq=states[2])
    hyper = AdamStep(
        *map(float, (lr, beta1, beta2, eps, weight_decay, step)),
        decoupled_weight_decay=bool(decoupled_weight_decay),
        maximize=bool(maximize),
    )
    if variant == "torch" and cupy_kernels.applies(param, grad, *states):
        cupy_kernels.adam(param, grad, states, hyper.fused(param), amsgrad)  # one ElementwiseKernel
    elif variant == "torch" and fused.applies(param, grad, *states):
        kernels = fused.kernels()
        kernel = kernels.adam_amsgrad if amsgrad else kernels.adam
        fused.run(kernel, param, grad, states, hyper.fused(param), scratch)
    else:
        _adam_blocks(param, grad, states, hyper, variant, scratch)


def _adam_blocks(
    param: Any, grad: Any, states: list[Any], hyper: AdamStep, variant: str, scratch: Any
) -> None:
    """Adam's update in ufunc calls, block by block (``common.blocks``): 12 per block
    (7 for the moments, then √v, + ε, m ÷ denominator, × −step size, + θ), one more for
    AdamW's decay; each call is one arithmetic operation, and none of them can be folded into
    another without a call to scale a stored state. torch's form is Keras's with ε scaled by
    √(1 − β₂ᵗ); computing it so saves a pass."""
    xp = xp_of(param)
    exp_avg, amsgrad = states[0], states[2] is not None
    root = hyper.bias_correction2_sqrt
    neg_step_size = scalar(-hyper.lr * root / hyper.bias_correction1, exp_avg)
    eps_hat = scalar(hyper.eps * root if variant == "torch" else hyper.eps, exp_avg)
    decay = scalar(1.0 - hyper.lr * hyper.weight_decay, exp_avg)
    moments = Moments(exp_avg, hyper.beta1, hyper.beta2)
    for p, g, (m, v, v_max), (g_buf, tmp) in blocks(param, grad, states, 2, scratch):
        # g_buf holds the gradient only when it is negated or decayed: a plain step touches
        # five block-sized arrays (θ, g, m, v, tmp), the fewer the better for the cache.
        g = effective_grad(
            g, p, maximize=hyper.maximize, weight_decay=hyper.coupled_decay, out=g_buf
        )
        moments.update_(m, v, g, tmp=tmp)
        if amsgrad:
            xp.maximum(v_max, v, out=v_max)
            v = v_max
        xp.sqrt(v, out=tmp)
        xp.add(tmp, eps_hat, out=tmp)
        xp.divide(m, tmp, out=tmp)
        xp.multiply(tmp, neg_step_size, out=tmp)
        if hyper.decoupled:  # torch scales θ first; nothing above reads θ: the same result
            xp.multiply(p, decay, out=p)
        xp.add(p, tmp, out=p)
