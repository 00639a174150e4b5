"""RAdam (Liu et al. 2020): Adam whose adaptive step is rectified while the variance of the
second moment is intractable (torch's threshold, rho_t > 5).

Updates ``param`` and its state arrays in place, block by block (``common.blocks``).
Hyperparameters are trusted here; the optimizer classes validate them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from zerosim.optim.functional import fused
from zerosim.optim.functional.adam import Moments
from zerosim.optim.functional.common import (
    blocks,
    check_arrays,
    effective_grad,
    lerp_scale,
    xp_of,
)


def radam(
    param: Any,
    grad: Any,
    exp_avg: Any,
    exp_avg_sq: Any,
    *,
    step: float,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    decoupled_weight_decay: bool = False,
    maximize: bool = False,
    scratch: Any = None,
) -> None:
    """One RAdam step (Liu et al. 2020, "On the Variance of the Adaptive Learning Rate and
    Beyond", Algorithm 2).

    With g = ±∇ (plus λ·θ unless decoupled), t = ``step``::

        θ ← θ·(1 − lr·λ)                            (decoupled)
        m ← β₁·m + (1 − β₁)·g;   v ← β₂·v + (1 − β₂)·g²
        ρ_∞ = 2/(1 − β₂) − 1,   ρ_t = ρ_∞ − 2t·β₂ᵗ/(1 − β₂ᵗ)
        if ρ_t > 5:  r_t = √((ρ_t − 4)(ρ_t − 2)ρ_∞ / ((ρ_∞ − 4)(ρ_∞ − 2)ρ_t))
                     θ ← θ − lr · m/(1 − β₁ᵗ) · r_t·√(1 − β₂ᵗ)/(√v + ε)
        else:        θ ← θ − lr · m/(1 − β₁ᵗ)     (variance intractable yet: momentum SGD)
    """
    lr, beta1, beta2, eps = float(lr), float(beta1), float(beta2), float(eps)
    weight_decay, step = float(weight_decay), float(step)
    check_arrays(param, grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    xp = xp_of(param)
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    rho_inf = 2.0 / (1.0 - beta2) - 1.0
    rho_t = rho_inf - 2.0 * step * beta2**step / bias_correction2
    rect = 0.0
    if rho_t > 5.0:
        rect = math.sqrt(
            (rho_t - 4.0) * (rho_t - 2.0) * rho_inf / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho_t)
        )
    coupled_decay = 0.0 if decoupled_weight_decay else weight_decay
    states = [exp_avg, exp_avg_sq]
    if fused.applies(param, grad, *states):
        r = fused.rounder(param)
        coefficients = fused.RAdamCoefficients(
            weight_decay=r(coupled_decay),
            maximize=bool(maximize),
            decay=r(1.0 - lr * weight_decay),
            decoupled=bool(decoupled_weight_decay and weight_decay != 0),
            lerp_scale=r(lerp_scale(1.0 - beta1)),
            lerp_upper=1.0 - beta1 >= 0.5,
            beta2=r(beta2),
            one_minus_beta2=r(1.0 - beta2),
            bias_correction1=r(bias_correction1),
            lr=r(lr),
            rectified=rho_t > 5.0,
            bias_correction2_sqrt=r(math.sqrt(bias_correction2)),
            eps=r(eps),
            rect=r(rect),
        )
        fused.run(fused.kernels().radam, param, grad, states, coefficients, scratch)
        return
    moments = Moments(exp_avg, beta1, beta2)
    for p, g, (m, v), (g_buf, tmp) in blocks(param, grad, states, 2, scratch):
        if decoupled_weight_decay and weight_decay != 0:
            p *= 1.0 - lr * weight_decay
        g = effective_grad(g, p, maximize=maximize, weight_decay=coupled_decay, out=g_buf)
        moments.update_(m, v, g, tmp=tmp)
        xp.divide(m, bias_correction1, out=g_buf)
        g_buf *= lr
        if rho_t > 5.0:
            xp.sqrt(v, out=tmp)
            tmp += eps
            if xp is np:
                xp.reciprocal(tmp, out=tmp)
            else:  # the standard has no reciprocal; 1/x rounds the same (IEEE division)
                xp.divide(1.0, tmp, out=tmp)
            tmp *= math.sqrt(bias_correction2)
            g_buf *= tmp
            g_buf *= rect
        p -= g_buf
