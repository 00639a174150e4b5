"""Lion (Chen et al. 2023, 'Symbolic Discovery of Optimization Algorithms'): the sign of an
interpolated momentum.

Updates ``param`` and its state arrays in place, block by block (``common.blocks``).
Hyperparameters are trusted here; the optimizer classes validate them.
"""

from __future__ import annotations

from typing import Any

from zerosim.optim.functional import fused
from zerosim.optim.functional.common import (
    blocks,
    check_arrays,
    effective_grad,
    xp_of,
)


def lion(
    param: Any,
    grad: Any,
    exp_avg: Any,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float = 0.0,
    maximize: bool = False,
    scratch: Any = None,
) -> None:
    """One Lion step (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Alg. 2).

    With g = ±∇ (sign by ``maximize``), m = ``exp_avg`` and decoupled weight decay λ::

        c = β₁·m + (1 − β₁)·g
        θ ← θ − lr·(sign(c) + λ·θ)
        m ← β₂·m + (1 − β₂)·g

    The update has the same size lr in every coordinate; only its sign comes from c.
    """
    lr, beta1, beta2, weight_decay = float(lr), float(beta1), float(beta2), float(weight_decay)
    check_arrays(param, grad, exp_avg=exp_avg)
    if fused.applies(param, grad, exp_avg):
        r = fused.rounder(param)
        coefficients = fused.LionCoefficients(
            maximize=bool(maximize),
            decay=r(1.0 - lr * weight_decay),
            decays=weight_decay != 0,
            beta1=r(beta1),
            one_minus_beta1=r(1.0 - beta1),
            beta2=r(beta2),
            one_minus_beta2=r(1.0 - beta2),
            lr=r(lr),
        )
        fused.run(fused.kernels().lion, param, grad, [exp_avg], coefficients, scratch)
        return
    xp = xp_of(param)
    for p, g, (m,), (g_buf, c, tmp) in blocks(param, grad, [exp_avg], 3, scratch):
        g = effective_grad(g, p, maximize=maximize, weight_decay=0.0, out=g_buf)
        xp.multiply(m, beta1, out=c)
        xp.multiply(g, 1.0 - beta1, out=tmp)
        c += tmp
        xp.sign(c, out=c)
        if weight_decay != 0:
            p *= 1.0 - lr * weight_decay
        c *= lr
        p -= c
        m *= beta2
        xp.multiply(g, 1.0 - beta2, out=tmp)
        m += tmp
