"""SGD with heavy-ball or Nesterov momentum, dampening and weight decay, as torch.optim.SGD.

Each function updates ``param`` and its state arrays in place, block by block (see
``common.blocks``). Hyperparameters are trusted here; the optimizer classes validate them.
"""

from __future__ import annotations

from typing import Any

from zerosim.optim.functional import cupy_kernels, fused
from zerosim.optim.functional.common import (
    blocks,
    check_arrays,
    effective_grad,
    scalar,
    xp_of,
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
    lr, momentum, dampening = float(lr), float(momentum), float(dampening)
    weight_decay = float(weight_decay)
    if momentum != 0 and momentum_buffer is None:
        raise ValueError(f"momentum={momentum} needs a momentum_buffer array; got None")
    check_arrays(param, grad, momentum_buffer=momentum_buffer if momentum != 0 else None)
    buffers = [momentum_buffer if momentum != 0 else None]
    on_gpu = cupy_kernels.applies(param, grad, *buffers)
    if on_gpu or fused.applies(param, grad, *buffers):
        r = fused.rounder(param)
        coefficients = fused.SGDCoefficients(
            weight_decay=r(weight_decay),
            maximize=bool(maximize),
            neg_lr=r(-lr),
            momentum=r(momentum),
            one_minus_dampening=r(1.0 - dampening),
            dampened=dampening != 0,
            nesterov=bool(nesterov),
            first_step=bool(first_step),
        )
        if on_gpu:
            cupy_kernels.sgd(param, grad, buffers[0], coefficients)
            return
        kernels = fused.kernels()
        kernel = kernels.sgd_momentum if momentum != 0 else kernels.sgd
        fused.run(kernel, param, grad, buffers, coefficients, scratch)
        return
    xp = xp_of(param)
    mu, neg_lr = scalar(momentum, param), scalar(-lr, param)
    one_minus_dampening = scalar(1.0 - dampening, param)
    for p, g, (b,), (g_buf, tmp) in blocks(param, grad, buffers, 2, scratch):
        g = effective_grad(g, p, maximize=maximize, weight_decay=weight_decay, out=g_buf)
        d = g
        if momentum != 0:
            if first_step:
                xp.copyto(b, g)
            else:
                xp.multiply(b, mu, out=b)
                if dampening == 0:
                    xp.add(b, g, out=b)
                else:
                    xp.multiply(g, one_minus_dampening, out=tmp)
                    xp.add(b, tmp, out=b)
            if nesterov:
                xp.multiply(b, mu, out=tmp)
                d = xp.add(g, tmp, out=tmp)
            else:
                d = b
        xp.multiply(d, neg_lr, out=tmp)
        xp.add(p, tmp, out=p)
