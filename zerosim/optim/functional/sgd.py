"""SGD with heavy-ball or Nesterov momentum, dampening and weight decay, as torch.optim.SGD.

Each function updates ``param`` and its state arrays in place, block by block (see
``common.blocks``). Hyperparameters are trusted here; the optimizer classes validate them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from zerosim.optim.functional import cupy_kernels, fused
from zerosim.optim.functional.common import (
    blocks,
    check_arrays,
    effective_grad,
    scalar,
    xp_of,
)


class SGDStep(NamedTuple):
    """One SGD step's hyperparameters (μ = momentum, τ = dampening, λ = weight decay)."""

    lr: float
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    maximize: bool
    first_step: bool

    def fused(self, param: Any) -> fused.SGDCoefficients:
        """The coefficients of the fused kernels, rounded to ``param``'s state dtype."""
        r = fused.rounder(param)
        return fused.SGDCoefficients(
            weight_decay=r(self.weight_decay),
            maximize=self.maximize,
            neg_lr=r(-self.lr),
            momentum=r(self.momentum),
            one_minus_dampening=r(1.0 - self.dampening),
            dampened=self.dampening != 0,
            nesterov=self.nesterov,
            first_step=self.first_step,
        )


def sgd(
    param: Any,
    grad: Any,
    momentum_buffer: Any = None,
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
    first_step: bool = False,
    scratch: Any = None,
) -> None:
    """One SGD step, as torch.optim.SGD computes it.

    With ``g = ±∇ + λ·θ`` (sign by ``maximize``, λ = ``weight_decay``), μ = ``momentum``,
    τ = ``dampening`` (Sutskever et al. 2013, "On the importance of initialization and
    momentum in deep learning", in torch's form)::

        b ← g                       on the first step (first_step=True)
        b ← μ·b + (1 − τ)·g         afterwards
        d = g + μ·b  if nesterov  else  b          (d = g when μ = 0)
        θ ← θ − lr·d

    ``momentum_buffer`` is required when μ ≠ 0 and ignored otherwise. With numba the
    step is one kernel call (``fused.py``).
    """
    hyper = SGDStep(
        *map(float, (lr, momentum, dampening, weight_decay)),
        nesterov=bool(nesterov),
        maximize=bool(maximize),
        first_step=bool(first_step),
    )
    if hyper.momentum != 0 and momentum_buffer is None:
        raise ValueError(f"momentum={hyper.momentum} needs a momentum_buffer array; got None")
    buffers = [momentum_buffer if hyper.momentum != 0 else None]
    check_arrays(param, grad, momentum_buffer=buffers[0])
    if cupy_kernels.applies(param, grad, *buffers):
        cupy_kernels.sgd(param, grad, buffers[0], hyper.fused(param))
    elif fused.applies(param, grad, *buffers):
        kernels = fused.kernels()
        kernel = kernels.sgd_momentum if hyper.momentum != 0 else kernels.sgd
        fused.run(kernel, param, grad, buffers, hyper.fused(param), scratch)
    else:
        _sgd_blocks(param, grad, buffers, hyper, scratch)


def _sgd_blocks(param: Any, grad: Any, buffers: list[Any], hyper: SGDStep, scratch: Any) -> None:
    """SGD's update in ufunc calls, block by block (``common.blocks``)."""
    xp = xp_of(param)
    momentum, dampening = hyper.momentum, hyper.dampening
    mu, neg_lr = scalar(momentum, param), scalar(-hyper.lr, param)
    one_minus_dampening = scalar(1.0 - dampening, param)
    for p, g, (b,), (g_buf, tmp) in blocks(param, grad, buffers, 2, scratch):
        g = effective_grad(
            g, p, maximize=hyper.maximize, weight_decay=hyper.weight_decay, out=g_buf
        )
        d = g
        if momentum != 0:
            if hyper.first_step:
                xp.copyto(b, g)
            else:
                xp.multiply(b, mu, out=b)
                if dampening == 0:
                    xp.add(b, g, out=b)
                else:
                    xp.multiply(g, one_minus_dampening, out=tmp)
                    xp.add(b, tmp, out=b)
            if hyper.nesterov:
                xp.multiply(b, mu, out=tmp)
                d = xp.add(g, tmp, out=tmp)
            else:
                d = b
        xp.multiply(d, neg_lr, out=tmp)
        xp.add(p, tmp, out=p)
