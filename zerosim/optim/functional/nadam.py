"""NAdam (Dozat 2016): Adam with Nesterov momentum and torch's momentum-decay schedule.

Updates ``param`` and its state arrays in place, block by block (``common.blocks``).
Hyperparameters are trusted here; the optimizer classes validate them.
"""

from __future__ import annotations

from typing import Any

from zerosim.optim.functional import fused
from zerosim.optim.functional.adam import Moments
from zerosim.optim.functional.common import (
    add_ratio_,
    blocks,
    check_arrays,
    effective_grad,
    lerp_scale,
    state_dtype,
    xp_of,
)


def nadam(
    param: Any,
    grad: Any,
    exp_avg: Any,
    exp_avg_sq: Any,
    *,
    step: float,
    mu_product: float,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    momentum_decay: float = 4e-3,
    decoupled_weight_decay: bool = False,
    maximize: bool = False,
    scratch: Any = None,
) -> float:
    """One NAdam step (Dozat 2016, "Incorporating Nesterov Momentum into Adam"); returns Π μ.

    ``mu_product`` is Π_{i<t} μ_i from the previous step (1.0 before the first); with
    ψ = ``momentum_decay``, g = ±∇ (plus λ·θ unless decoupled), t = ``step``::

        μ_t = β₁·(1 − ½·0.96^(t·ψ)),   μ_{t+1} = β₁·(1 − ½·0.96^((t+1)·ψ))
        θ ← θ·(1 − lr·λ)                            (decoupled)
        m ← β₁·m + (1 − β₁)·g;   v ← β₂·v + (1 − β₂)·g²
        d = √(v/(1 − β₂ᵗ)) + ε
        θ ← θ − lr·(1 − μ_t)/(1 − Π_{i≤t} μ_i) · g/d − lr·μ_{t+1}/(1 − Π_{i≤t+1} μ_i) · m/d

    The returned product Π_{i≤t} μ_i is rounded to the state dtype, as torch keeps it
    in a tensor of the default dtype; store it for the next step.
    """
    lr, beta1, beta2, eps = float(lr), float(beta1), float(beta2), float(eps)
    weight_decay, momentum_decay, step = float(weight_decay), float(momentum_decay), float(step)
    check_arrays(param, grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    xp = xp_of(param)
    rounded = state_dtype(param.dtype).type
    bias_correction2 = 1.0 - beta2**step
    mu = beta1 * (1.0 - 0.5 * 0.96 ** (step * momentum_decay))
    mu_next = beta1 * (1.0 - 0.5 * 0.96 ** ((step + 1.0) * momentum_decay))
    mu_product = float(rounded(mu_product) * rounded(mu))
    grad_coef = -lr * (1.0 - mu) / (1.0 - mu_product)
    avg_coef = -lr * mu_next / (1.0 - mu_product * mu_next)
    coupled_decay = 0.0 if decoupled_weight_decay else weight_decay
    states = [exp_avg, exp_avg_sq]
    if fused.applies(param, grad, *states):
        r = fused.rounder(param)
        coefficients = fused.NAdamCoefficients(
            weight_decay=r(coupled_decay),
            maximize=bool(maximize),
            decay=r(1.0 - lr * weight_decay),
            decoupled=bool(decoupled_weight_decay and weight_decay != 0),
            lerp_scale=r(lerp_scale(1.0 - beta1)),
            lerp_upper=1.0 - beta1 >= 0.5,
            beta2=r(beta2),
            one_minus_beta2=r(1.0 - beta2),
            bias_correction2=r(bias_correction2),
            eps=r(eps),
            grad_coef=r(grad_coef),
            avg_coef=r(avg_coef),
        )
        fused.run(fused.kernels().nadam, param, grad, states, coefficients, scratch)
        return mu_product
    moments = Moments(exp_avg, beta1, beta2)
    for p, g, (m, v), (g_buf, denom, tmp) in blocks(param, grad, states, 3, scratch):
        if decoupled_weight_decay and weight_decay != 0:
            p *= 1.0 - lr * weight_decay
        g = effective_grad(g, p, maximize=maximize, weight_decay=coupled_decay, out=g_buf)
        moments.update_(m, v, g, tmp=tmp)
        xp.divide(v, bias_correction2, out=denom)
        xp.sqrt(denom, out=denom)
        denom += eps
        add_ratio_(p, g, denom, grad_coef, tmp=tmp)
        add_ratio_(p, m, denom, avg_coef, tmp=tmp)
    return mu_product
