"""RAdam (Liu et al. 2020): Adam whose adaptive step is rectified while the variance of the
second moment is intractable (torch's threshold, rho_t > 5).

Updates ``param`` and its state arrays in place, block by block (``common.blocks``).
Hyperparameters are trusted here; the optimizer classes validate them.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from zerosim.optim.functional import fused
from zerosim.optim.functional.adam import Moments
from zerosim.optim.functional.common import (
    blocks,
    check_arrays,
    coupled_weight_decay,
    effective_grad,
    xp_of,
)


def rectification(step: float, beta2: float) -> tuple[float, float]:
    """(ρ_t, r_t): the length of the approximated SMA and the variance rectification term
    (Liu et al. 2020, eq. 5 and Alg. 2); r_t = 0 while ρ_t ≤ 5 (the variance is intractable)."""
    rho_inf = 2.0 / (1.0 - beta2) - 1.0
    rho_t = rho_inf - 2.0 * step * beta2**step / (1.0 - beta2**step)
    if rho_t <= 5.0:
        return rho_t, 0.0
    return rho_t, math.sqrt(
        (rho_t - 4.0) * (rho_t - 2.0) * rho_inf / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho_t)
    )


class RAdamStep(NamedTuple):
    """One RAdam step's hyperparameters, bias corrections and rectification."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled_weight_decay: bool
    maximize: bool
    bias_correction1: float  # 1 − β₁ᵗ
    bias_correction2: float  # 1 − β₂ᵗ
    rectified: bool  # ρ_t > 5
    rect: float  # r_t

    coupled_decay = property(coupled_weight_decay)

    def fused(self, param: Any) -> fused.RAdamCoefficients:
        """The coefficients of the fused kernel, rounded to ``param``'s state dtype."""
        r = fused.rounder(param)
        return fused.RAdamCoefficients(
            **fused.adam_family(self, r),
            bias_correction1=r(self.bias_correction1),
            lr=r(self.lr),
            rectified=self.rectified,
            bias_correction2_sqrt=r(math.sqrt(self.bias_correction2)),
            eps=r(self.eps),
            rect=r(self.rect),
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
    rho_t, rect = rectification(step, beta2)
    hyper = RAdamStep(
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        decoupled_weight_decay=bool(decoupled_weight_decay),
        maximize=bool(maximize),
        bias_correction1=1.0 - beta1**step,
        bias_correction2=1.0 - beta2**step,
        rectified=rho_t > 5.0,
        rect=rect,
    )
    states = [exp_avg, exp_avg_sq]
    if fused.applies(param, grad, *states):
        fused.run(fused.kernels().radam, param, grad, states, hyper.fused(param), scratch)
    else:
        _radam_blocks(param, grad, states, hyper, scratch)


def _radam_blocks(param: Any, grad: Any, states: list[Any], hyper: RAdamStep, scratch: Any) -> None:
    """RAdam's update in ufunc calls, block by block (``common.blocks``)."""
    xp = xp_of(param)
    lr, weight_decay = hyper.lr, hyper.weight_decay
    moments = Moments(states[0], hyper.beta1, hyper.beta2)
    for p, g, (m, v), (g_buf, tmp) in blocks(param, grad, states, 2, scratch):
        if hyper.decoupled_weight_decay and weight_decay != 0:
            p *= 1.0 - lr * weight_decay
        g = effective_grad(
            g, p, maximize=hyper.maximize, weight_decay=hyper.coupled_decay, out=g_buf
        )
        moments.update_(m, v, g, tmp=tmp)
        xp.divide(m, hyper.bias_correction1, out=g_buf)
        g_buf *= lr
        if hyper.rectified:
            xp.sqrt(v, out=tmp)
            tmp += hyper.eps
            if xp is np:
                xp.reciprocal(tmp, out=tmp)
            else:  # the standard has no reciprocal; 1/x rounds the same (IEEE division)
                xp.divide(1.0, tmp, out=tmp)
            tmp *= math.sqrt(hyper.bias_correction2)
            g_buf *= tmp
            g_buf *= hyper.rect
        p -= g_buf
