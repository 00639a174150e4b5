"""Adagrad (Duchi et al. 2011): per-element step sizes from the running sum of squared gradients.

Each function updates ``param`` and its state arrays in place, block by block (see
``common.blocks``). Hyperparameters are trusted here; the optimizer classes validate them.
"""

from __future__ import annotations

from typing import Any

from zerosim.optim.functional import fused
from zerosim.optim.functional.common import (
    add_ratio_,
    blocks,
    check_arrays,
    effective_grad,
    xp_of,
)


def adagrad(
    param: Any,
    grad: Any,
    state_sum: Any,
    *,
    step: float,
    lr: float,
    lr_decay: float = 0.0,
    weight_decay: float = 0.0,
    eps: float = 1e-10,
    maximize: bool = False,
    scratch: Any = None,
) -> None:
    """One Adagrad step (Duchi, Hazan & Singer 2011, JMLR 12), as torch.optim.Adagrad computes it.

    With ``g = ±∇ + λ·θ``, s = ``state_sum`` and t = ``step`` (1 on the first update)::

        η_t = lr / (1 + (t − 1)·lr_decay)
        s ← s + g²
        θ ← θ − η_t·g / (√s + ε)
    """
    lr, lr_decay, weight_decay, eps = float(lr), float(lr_decay), float(weight_decay), float(eps)
    check_arrays(param, grad, state_sum=state_sum)
    clr = lr / (1.0 + (float(step) - 1.0) * lr_decay)
    if fused.applies(param, grad, state_sum):
        r = fused.rounder(param)
        coefficients = fused.AdagradCoefficients(
            weight_decay=r(weight_decay), maximize=bool(maximize), neg_clr=r(-clr), eps=r(eps)
        )
        fused.run(fused.kernels().adagrad, param, grad, [state_sum], coefficients, scratch)
        return
    xp = xp_of(param)
    for p, g, (s,), (g_buf, std) in blocks(param, grad, [state_sum], 2, scratch):
        g = effective_grad(g, p, maximize=maximize, weight_decay=weight_decay, out=g_buf)
        xp.multiply(g, g, out=std)
        s += std
        xp.sqrt(s, out=std)
        std += eps
        add_ratio_(p, g, std, -clr, tmp=g_buf)
