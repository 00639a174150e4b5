"""NAdam (Dozat 2016): Adam with Nesterov momentum and torch's momentum-decay schedule.

Updates ``param`` and its state arrays in place, block by block (``common.blocks``).
Hyperparameters are trusted here; the optimizer classes validate them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from zerosim.optim.functional import fused
from zerosim.optim.functional.adam import Moments
from zerosim.optim.functional.common import (
    add_ratio_,
    blocks,
    check_arrays,
    coupled_weight_decay,
    effective_grad,
    state_dtype,
    xp_of,
)


class NAdamStep(NamedTuple):
    """One NAdam step's hyperparameters and the two step sizes of its momentum schedule."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled_weight_decay: bool
    maximize: bool
    bias_correction2: float  # 1 − β₂ᵗ
    grad_coef: float  # −lr·(1 − μ_t)/(1 − Π_{i≤t} μ_i)
    avg_coef: float  # −lr·μ_{t+1}/(1 − Π_{i≤t+1} μ_i)

    coupled_decay = property(coupled_weight_decay)

    def fused(self, param: Any) -> fused.NAdamCoefficients:
        """The coefficients of the fused kernel, rounded to ``param``'s state dtype."""
        r = fused.rounder(param)
        return fused.NAdamCoefficients(
            **fused.adam_family(self, r),
            bias_correction2=r(self.bias_correction2),
            eps=r(self.eps),
            grad_coef=r(self.grad_coef),
            avg_coef=r(self.avg_coef),
        )


def momentum_schedule(
    step: float, mu_product: float, beta1: float, momentum_decay: float, rounded: Any
) -> tuple[float, float, float]:
    """(μ_t, μ_{t+1}, Π_{i≤t} μ_i) from Π_{i<t} μ_i: torch's momentum decay, the product
    rounded to the state dtype (``rounded``) as torch keeps it in a tensor."""
    mu = beta1 * (1.0 - 0.5 * 0.96 ** (step * momentum_decay))
    mu_next = beta1 * (1.0 - 0.5 * 0.96 ** ((step + 1.0) * momentum_decay))
    return mu, mu_next, float(rounded(mu_product) * rounded(mu))


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
    rounded = state_dtype(param.dtype).type
    mu, mu_next, mu_product = momentum_schedule(step, mu_product, beta1, momentum_decay, rounded)
    hyper = NAdamStep(
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        decoupled_weight_decay=bool(decoupled_weight_decay),
        maximize=bool(maximize),
        bias_correction2=1.0 - beta2**step,
        grad_coef=-lr * (1.0 - mu) / (1.0 - mu_product),
        avg_coef=-lr * mu_next / (1.0 - mu_product * mu_next),
    )
    states = [exp_avg, exp_avg_sq]
    if fused.applies(param, grad, *states):
        fused.run(fused.kernels().nadam, param, grad, states, hyper.fused(param), scratch)
    else:
        _nadam_blocks(param, grad, states, hyper, scratch)
    return mu_product


def _nadam_blocks(param: Any, grad: Any, states: list[Any], hyper: NAdamStep, scratch: Any) -> None:
    """NAdam's update in ufunc calls, block by block (``common.blocks``)."""
    xp = xp_of(param)
    lr, weight_decay = hyper.lr, hyper.weight_decay
    moments = Moments(states[0], hyper.beta1, hyper.beta2)
    for p, g, (m, v), (g_buf, denom, tmp) in blocks(param, grad, states, 3, scratch):
        if hyper.decoupled_weight_decay and weight_decay != 0:
            p *= 1.0 - lr * weight_decay
        g = effective_grad(
            g, p, maximize=hyper.maximize, weight_decay=hyper.coupled_decay, out=g_buf
        )
        moments.update_(m, v, g, tmp=tmp)
        xp.divide(v, hyper.bias_correction2, out=denom)
        xp.sqrt(denom, out=denom)
        denom += hyper.eps
        add_ratio_(p, g, denom, hyper.grad_coef, tmp=tmp)
        add_ratio_(p, m, denom, hyper.avg_coef, tmp=tmp)
