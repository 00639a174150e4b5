"""Momentum rules without a per-element step size: SGD (heavy-ball or Nesterov) and Lion.

Each function updates ``param`` and its state arrays in place, block by block (see
``_rules_common``). Hyperparameters are trusted here; the optimizer classes validate them.
"""

from __future__ import annotations

from typing import Any

from zerosim.optim._rules_common import blocks, check_arrays, effective_grad, scalar, xp_of


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

    ``momentum_buffer`` is required when μ ≠ 0 and ignored otherwise.
    """
    lr, momentum, dampening = float(lr), float(momentum), float(dampening)
    weight_decay = float(weight_decay)
    if momentum != 0 and momentum_buffer is None:
        raise ValueError(f"momentum={momentum} needs a momentum_buffer array; got None")
    check_arrays(param, grad, momentum_buffer=momentum_buffer if momentum != 0 else None)
    xp = xp_of(param)
    mu, neg_lr = scalar(momentum, param), scalar(-lr, param)
    one_minus_dampening = scalar(1.0 - dampening, param)
    buffers = [momentum_buffer if momentum != 0 else None]
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
