"""Adamax (Kingma & Ba 2015, section 7.1): Adam with the infinity norm as its second moment.

``variant="keras"`` adds ε to the denominator instead of inside the max, as Keras does.

Updates ``param`` and its state arrays in place, block by block (``common.blocks``).
Hyperparameters are trusted here; the optimizer classes validate them.
"""

from __future__ import annotations

from typing import Any

from zerosim.optim.functional import fused
from zerosim.optim.functional.common import (
    add_ratio_,
    blocks,
    check_arrays,
    check_variant,
    effective_grad,
    lerp_,
    lerp_scale,
    xp_of,
)


def adamax(
    param: Any,
    grad: Any,
    exp_avg: Any,
    exp_inf: Any,
    *,
    step: float,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    maximize: bool = False,
    variant: str = "torch",
    scratch: Any = None,
) -> None:
    """One Adamax step (Kingma & Ba 2015, Algorithm 2), Adam with an infinity-norm denominator.

    With ``g = ±∇ + λ·θ``, m = ``exp_avg``, u = ``exp_inf``, t = ``step``::

        m ← β₁·m + (1 − β₁)·g
        torch:  u ← max(β₂·u, |g| + ε);   θ ← θ − lr/(1 − β₁ᵗ) · m / u
        keras:  u ← max(β₂·u, |g|);       θ ← θ − lr/(1 − β₁ᵗ) · m / (u + ε)
    """
    check_variant(variant)
    lr, beta1, beta2, eps = float(lr), float(beta1), float(beta2), float(eps)
    weight_decay, step = float(weight_decay), float(step)
    check_arrays(param, grad, exp_avg=exp_avg, exp_inf=exp_inf)
    clr = lr / (1.0 - beta1**step)
    if fused.applies(param, grad, exp_avg, exp_inf):
        r = fused.rounder(param)
        coefficients = fused.AdamaxCoefficients(
            weight_decay=r(weight_decay),
            maximize=bool(maximize),
            lerp_scale=r(lerp_scale(1.0 - beta1)),
            lerp_upper=1.0 - beta1 >= 0.5,
            beta2=r(beta2),
            eps=r(eps),
            neg_clr=r(-clr),
            keras=variant == "keras",
        )
        kernel = fused.kernels().adamax
        fused.run(kernel, param, grad, [exp_avg, exp_inf], coefficients, scratch)
        return
    xp = xp_of(param)
    for p, g, (m, u), (g_buf, tmp) in blocks(param, grad, [exp_avg, exp_inf], 2, scratch):
        g = effective_grad(g, p, maximize=maximize, weight_decay=weight_decay, out=g_buf)
        lerp_(m, g, 1.0 - beta1, tmp=tmp)
        xp.absolute(g, out=tmp)
        if variant == "torch":
            tmp += eps
        u *= beta2
        xp.maximum(u, tmp, out=u)
        denom = u
        if variant == "keras":
            denom = xp.add(u, eps, out=tmp)
        add_ratio_(p, m, denom, -clr, tmp=g_buf)
