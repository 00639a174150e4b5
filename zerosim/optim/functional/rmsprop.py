"""RMSprop (Hinton, lecture 6e), with torch's centered variant and momentum.

Updates ``param`` and its state arrays in place, block by block (``common.blocks``).
Hyperparameters are trusted here; the optimizer classes validate them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from zerosim.optim.functional import fused
from zerosim.optim.functional.common import (
    add_ratio_,
    add_square_,
    blocks,
    check_arrays,
    effective_grad,
    lerp_,
    lerp_scale,
    xp_of,
)


class RMSpropStep(NamedTuple):
    """One RMSprop step's hyperparameters (α = smoothing constant, μ = momentum)."""

    lr: float
    alpha: float
    eps: float
    weight_decay: float
    momentum: float
    centered: bool
    maximize: bool

    def fused(self, param: Any) -> fused.RMSpropCoefficients:
        """The coefficients of the fused kernels, rounded to ``param``'s state dtype."""
        r = fused.rounder(param)
        return fused.RMSpropCoefficients(
            weight_decay=r(self.weight_decay),
            maximize=self.maximize,
            alpha=r(self.alpha),
            one_minus_alpha=r(1.0 - self.alpha),
            lerp_scale=r(lerp_scale(1.0 - self.alpha)),
            lerp_upper=1.0 - self.alpha >= 0.5,
            eps=r(self.eps),
            momentum=r(self.momentum),
            neg_lr=r(-self.lr),
        )

    def kernel(self) -> Any:
        """The fused kernel for this step's momentum and centering."""
        kernels = fused.kernels()
        return {
            (False, False): kernels.rmsprop,
            (True, False): kernels.rmsprop_momentum,
            (False, True): kernels.rmsprop_centered,
            (True, True): kernels.rmsprop_centered_momentum,
        }[self.momentum > 0, self.centered]


def rmsprop(
    param: Any,
    grad: Any,
    square_avg: Any,
    momentum_buffer: Any = None,
    grad_avg: Any = None,
    *,
    lr: float,
    alpha: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    centered: bool = False,
    maximize: bool = False,
    scratch: Any = None,
) -> None:
    """One RMSprop step (Hinton, Coursera lecture 6e, 2012), as torch.optim.RMSprop computes it.

    With ``g = ±∇ + λ·θ``, v = ``square_avg``, ḡ = ``grad_avg`` (centered, Graves 2013,
    "Generating Sequences With Recurrent Neural Networks", eq. 38) and b = ``momentum_buffer``::

        v ← α·v + (1 − α)·g²
        ḡ ← α·ḡ + (1 − α)·g                        (centered only)
        d = √(v − ḡ²) + ε  if centered  else  √v + ε
        b ← μ·b + g/d;   θ ← θ − lr·b             (momentum μ > 0)
        θ ← θ − lr·g/d                             (μ = 0)

    ``momentum_buffer`` is required when μ > 0, ``grad_avg`` when centered.
    """
    hyper = RMSpropStep(
        *map(float, (lr, alpha, eps, weight_decay, momentum)),
        centered=bool(centered),
        maximize=bool(maximize),
    )
    if hyper.momentum > 0 and momentum_buffer is None:
        raise ValueError(f"momentum={hyper.momentum} needs a momentum_buffer array; got None")
    if centered and grad_avg is None:
        raise ValueError("centered=True needs a grad_avg array; got None")
    momentum_buffer = momentum_buffer if hyper.momentum > 0 else None
    grad_avg = grad_avg if centered else None
    check_arrays(
        param, grad, square_avg=square_avg, momentum_buffer=momentum_buffer, grad_avg=grad_avg
    )
    states = [square_avg, momentum_buffer, grad_avg]
    if fused.applies(param, grad, *states):
        fused.run(hyper.kernel(), param, grad, states, hyper.fused(param), scratch)
    else:
        _rmsprop_blocks(param, grad, states, hyper, scratch)


def _rmsprop_blocks(
    param: Any, grad: Any, states: list[Any], hyper: RMSpropStep, scratch: Any
) -> None:
    """RMSprop's update in ufunc calls, block by block (``common.blocks``)."""
    xp = xp_of(param)
    alpha, eps, momentum, lr = hyper.alpha, hyper.eps, hyper.momentum, hyper.lr
    for p, g, (v, b, gbar), (g_buf, d) in blocks(param, grad, states, 2, scratch):
        g = effective_grad(
            g, p, maximize=hyper.maximize, weight_decay=hyper.weight_decay, out=g_buf
        )
        add_square_(v, g, alpha, tmp=d)
        if hyper.centered:
            lerp_(gbar, g, 1.0 - alpha, tmp=d)
            xp.multiply(gbar, gbar, out=d)
            xp.subtract(v, d, out=d)
            xp.sqrt(d, out=d)
        else:
            xp.sqrt(v, out=d)
        d += eps
        if momentum > 0:
            b *= momentum
            xp.divide(g, d, out=g_buf)
            b += g_buf
            xp.multiply(b, -lr, out=g_buf)
            p += g_buf
        else:
            add_ratio_(p, g, d, -lr, tmp=g_buf)
