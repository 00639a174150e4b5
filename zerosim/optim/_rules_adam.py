"""The Adam family: Adam/AdamW (with AMSGrad), Adamax, NAdam and RAdam, plus Keras's variants.

Each function updates ``param`` and its state arrays in place, block by block (see
``_rules_common``). Hyperparameters are trusted here; the optimizer classes validate them.

``variant="keras"`` selects Keras/TensorFlow's arithmetic where it differs from torch's:
Adam adds ε to the *uncorrected* root and folds both bias corrections into the step size
(the "more efficient order" below Algorithm 1 of Kingma & Ba), and Adamax adds ε to the
denominator instead of inside the max.
"""

from __future__ import annotations

import math
from typing import Any

from zerosim.optim._rules_common import (
    add_ratio_,
    add_square_,
    blocks,
    check_arrays,
    effective_grad,
    lerp_,
    lerp_scale,
    scalar,
    state_dtype,
    xp_of,
)

VARIANTS = ("torch", "keras")


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is not supported; allowed: {list(VARIANTS)}")


class _Moments:
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

    ``max_exp_avg_sq`` is required when amsgrad is True. A block takes 12 ufunc calls
    (7 for the moments, then √v, + ε, m ÷ denominator, × −step size, + θ), one more for
    AdamW's decay; each call is one arithmetic operation, and none of them can be folded
    into another without a call to scale a stored state.
    """
    _check_variant(variant)
    lr, beta1, beta2, eps = float(lr), float(beta1), float(beta2), float(eps)
    weight_decay, step = float(weight_decay), float(step)
    if amsgrad and max_exp_avg_sq is None:
        raise ValueError("amsgrad=True needs a max_exp_avg_sq array; got None")
    max_exp_avg_sq = max_exp_avg_sq if amsgrad else None
    check_arrays(param, grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, max_exp_avg_sq=max_exp_avg_sq)
    xp = xp_of(param)
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    # torch's form is Keras's with ε scaled by √(1 − β₂ᵗ); computing it so saves a pass.
    neg_step_size = scalar(-lr * bias_correction2_sqrt / bias_correction1, exp_avg)
    eps_hat = scalar(eps * bias_correction2_sqrt if variant == "torch" else eps, exp_avg)
    decay = scalar(1.0 - lr * weight_decay, exp_avg)
    decoupled = decoupled_weight_decay and weight_decay != 0
    coupled_decay = 0.0 if decoupled_weight_decay else weight_decay
    moments = _Moments(exp_avg, beta1, beta2)
    states = [exp_avg, exp_avg_sq, max_exp_avg_sq]
    for p, g, (m, v, v_max), (g_buf, tmp) in blocks(param, grad, states, 2, scratch):
        # g_buf holds the gradient only when it is negated or decayed: a plain step touches
        # five block-sized arrays (θ, g, m, v, tmp), the fewer the better for the cache.
        g = effective_grad(g, p, maximize=maximize, weight_decay=coupled_decay, out=g_buf)
        moments.update_(m, v, g, tmp=tmp)
        if amsgrad:
            xp.maximum(v_max, v, out=v_max)
            v = v_max
        xp.sqrt(v, out=tmp)
        xp.add(tmp, eps_hat, out=tmp)
        xp.divide(m, tmp, out=tmp)
        xp.multiply(tmp, neg_step_size, out=tmp)
        if decoupled:  # torch scales θ first; nothing above reads θ, so the result is the same
            xp.multiply(p, decay, out=p)
        xp.add(p, tmp, out=p)


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
    _check_variant(variant)
    lr, beta1, beta2, eps = float(lr), float(beta1), float(beta2), float(eps)
    weight_decay, step = float(weight_decay), float(step)
    check_arrays(param, grad, exp_avg=exp_avg, exp_inf=exp_inf)
    xp = xp_of(param)
    clr = lr / (1.0 - beta1**step)
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
    moments = _Moments(exp_avg, beta1, beta2)
    states = [exp_avg, exp_avg_sq]
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
    moments = _Moments(exp_avg, beta1, beta2)
    states = [exp_avg, exp_avg_sq]
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
            xp.reciprocal(tmp, out=tmp)
            tmp *= math.sqrt(bias_correction2)
            g_buf *= tmp
            g_buf *= rect
        p -= g_buf
