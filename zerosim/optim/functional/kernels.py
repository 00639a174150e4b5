"""The update rules as fused loops, compiled by numba: one pass over memory per step.

Each kernel walks flat, contiguous arrays once and does the whole update of an element in
registers: read θ, g and the state, write θ and the state. The order of operations is
torch.optim's single-tensor code, op by op (written beside each line), so a float64 step
agrees with torch to the last bits and a float32 step is float32 arithmetic throughout
(the coefficients come rounded to the state dtype; see ``fused.py``, which also decides
when a rule calls these). Compiled with

- ``error_model="numpy"``: x/0 is inf or nan, as in NumPy, instead of a Python exception
  (whose check in the loop stops LLVM from vectorizing it);
- no fastmath: no reassociation, no fused multiply-add contraction, IEEE sqrt (``_sqrt``);
- no ``parallel``: one thread, the same result on every machine and every run;
- ``nogil``: ranks of a ``LocalWorld`` (threads) step their shards at the same time;
- ``cache=True``: compiled once per machine, then loaded from ``__pycache__``.

A flag that only changes arithmetic (maximize, weight decay, the lerp form) is a branch
LLVM turns into a select; a flag that changes which arrays are touched (amsgrad, momentum,
centered) selects another kernel, since LLVM vectorizes a loop only when it can check at
entry that its arrays do not overlap, which needs every array it touches to be real.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

JIT = {"cache": True, "nogil": True, "error_model": "numpy"}
INLINE = {"inline": "always", "error_model": "numpy"}


@intrinsic  # numba calls an intrinsic with its typing context first, a codegen with four
def _sqrt(typingctx: Any, x: Any) -> Any:  # noqa: V107
    """IEEE square root (LLVM's ``llvm.sqrt``), correctly rounded like NumPy's and torch's.

    numba's ``math.sqrt`` calls libm's ``sqrt``, which may set errno, so LLVM cannot
    vectorize a loop around it; the intrinsic gives the same value and vectorizes.
    """
    if not isinstance(x, types.Float):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:  # noqa: V107
        fn = builder.module.declare_intrinsic("llvm.sqrt", [args[0].type])
        return builder.call(fn, args)

    return x(x), codegen


@njit(**INLINE)
def _grad(g: Any, p: Any, weight_decay: Any, maximize: bool) -> Any:
    """torch: ``grad = -grad if maximize``; ``grad = grad.add(param, alpha=weight_decay)``."""
    if maximize:
        g = -g
    if weight_decay != 0:
        g = g + weight_decay * p
    return g


@njit(**INLINE)
def _lerp(start: Any, end: Any, scale: Any, upper: bool) -> Any:
    """torch.lerp(start, end, w): start + w·(end − start), or end − (1 − w)·(end − start)."""
    d = (end - start) * scale
    return end - d if upper else start + d


@njit(**INLINE)
def _square_avg(avg: Any, g: Any, beta: Any, one_minus_beta: Any) -> Any:
    """torch: ``avg.mul_(beta).addcmul_(g, g, value=1 - beta)``: β·avg + ((1 − β)·g)·g."""
    return avg * beta + (one_minus_beta * g) * g


@njit(**INLINE)
def _maximum(a: Any, b: Any) -> Any:
    """``np.maximum``/``torch.maximum`` of two numbers: nan if either is nan."""
    return a if (a > b or a != a) else b


@njit(**INLINE)
def _adam_moments(p: Any, g: Any, m: Any, v: Any, c: Any) -> tuple[Any, Any, Any, Any]:
    """Adam's first lines (also NAdam's and RAdam's): decay, gradient, m and v; returns
    (θ, g, m, v)."""
    if c.decoupled:
        p = p * c.decay  # param.mul_(1 - lr * weight_decay)
    g = _grad(g, p, c.weight_decay, c.maximize)
    m = _lerp(m, g, c.lerp_scale, c.lerp_upper)  # exp_avg.lerp_(grad, 1 - beta1)
    v = _square_avg(v, g, c.beta2, c.one_minus_beta2)
    return p, g, m, v


@njit(**INLINE)
def _adam_param(p: Any, m: Any, v: Any, c: Any) -> Any:
    """torch: ``denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)``;
    ``param.addcdiv_(exp_avg, denom, value=-step_size)``: θ + ((−step_size)·m)/denom."""
    denom = _sqrt(v) / c.bias_correction2_sqrt + c.eps
    return p + (c.neg_step_size * m) / denom


@njit(**JIT)
def adam(param: Any, grad: Any, exp_avg: Any, exp_avg_sq: Any, c: Any) -> None:
    """Adam/AdamW, torch variant (``fused.AdamCoefficients``)."""
    for i in range(param.size):
        p, _, m, v = _adam_moments(param[i], grad[i], exp_avg[i], exp_avg_sq[i], c)
        exp_avg[i] = m
        exp_avg_sq[i] = v
        param[i] = _adam_param(p, m, v, c)


@njit(**JIT)
def adam_amsgrad(
    param: Any, grad: Any, exp_avg: Any, exp_avg_sq: Any, max_exp_avg_sq: Any, c: Any
) -> None:
    """Adam/AdamW with AMSGrad: v̂ ← max(v̂, v) (torch.maximum) and v̂ in the denominator."""
    for i in range(param.size):
        p, _, m, v = _adam_moments(param[i], grad[i], exp_avg[i], exp_avg_sq[i], c)
        exp_avg[i] = m
        exp_avg_sq[i] = v
        v_max = _maximum(max_exp_avg_sq[i], v)
        max_exp_avg_sq[i] = v_max
        param[i] = _adam_param(p, m, v_max, c)


@njit(**JIT)
def nadam(param: Any, grad: Any, exp_avg: Any, exp_avg_sq: Any, c: Any) -> None:
    """NAdam (``fused.NAdamCoefficients``); torch: ``denom = v.div(bias_correction2).sqrt()
    .add(eps)``, then ``param.addcdiv_(grad, denom, value=grad_coef)`` and
    ``param.addcdiv_(exp_avg, denom, value=avg_coef)``."""
    for i in range(param.size):
        p, g, m, v = _adam_moments(param[i], grad[i], exp_avg[i], exp_avg_sq[i], c)
        exp_avg[i] = m
        exp_avg_sq[i] = v
        denom = _sqrt(v / c.bias_correction2) + c.eps
        p = p + (c.grad_coef * g) / denom
        param[i] = p + (c.avg_coef * m) / denom


@njit(**JIT)
def radam(param: Any, grad: Any, exp_avg: Any, exp_avg_sq: Any, c: Any) -> None:
    """RAdam (``fused.RAdamCoefficients``); torch: ``param.add_(bias_corrected_exp_avg * lr
    * adaptive_lr * rect, alpha=-1.0)`` with ``adaptive_lr = bias_correction2**0.5 /
    v.sqrt().add_(eps)``, or without the last two factors while ρ_t ≤ 5."""
    for i in range(param.size):
        p, _, m, v = _adam_moments(param[i], grad[i], exp_avg[i], exp_avg_sq[i], c)
        exp_avg[i] = m
        exp_avg_sq[i] = v
        update = (m / c.bias_correction1) * c.lr
        if c.rectified:
            update = update * (c.bias_correction2_sqrt / (_sqrt(v) + c.eps)) * c.rect
        param[i] = p - update


@njit(**JIT)
def sgd(param: Any, grad: Any, c: Any) -> None:
    """SGD without momentum (``fused.SGDCoefficients``): ``param.add_(grad, alpha=-lr)``."""
    for i in range(param.size):
        p = param[i]
        param[i] = p + c.neg_lr * _grad(grad[i], p, c.weight_decay, c.maximize)


@njit(**JIT)
def sgd_momentum(param: Any, grad: Any, momentum_buffer: Any, c: Any) -> None:
    """SGD with momentum; torch: ``buf.mul_(momentum).add_(grad, alpha=1 - dampening)``
    (``buf = grad.clone()`` on the first step), Nesterov ``grad.add(buf, alpha=momentum)``."""
    for i in range(param.size):
        p = param[i]
        g = _grad(grad[i], p, c.weight_decay, c.maximize)
        if c.first_step:
            b = g
        elif c.dampened:
            b = momentum_buffer[i] * c.momentum + c.one_minus_dampening * g
        else:
            b = momentum_buffer[i] * c.momentum + g
        momentum_buffer[i] = b
        d = g + c.momentum * b if c.nesterov else b
        param[i] = p + c.neg_lr * d


@njit(**JIT)
def adagrad(param: Any, grad: Any, state_sum: Any, c: Any) -> None:
    """Adagrad (``fused.AdagradCoefficients``); torch: ``state_sum.addcmul_(grad, grad,
    value=1)``, ``std = state_sum.sqrt().add_(eps)``, ``param.addcdiv_(grad, std, value=-clr)``."""
    for i in range(param.size):
        p = param[i]
        g = _grad(grad[i], p, c.weight_decay, c.maximize)
        s = state_sum[i] + g * g
        state_sum[i] = s
        param[i] = p + (c.neg_clr * g) / (_sqrt(s) + c.eps)


@njit(**INLINE)
def _rmsprop_grad(p: Any, g: Any, v: Any, c: Any) -> tuple[Any, Any]:
    """torch: ``square_avg.mul_(alpha).addcmul_(grad, grad, value=1 - alpha)``; returns (g, v)."""
    g = _grad(g, p, c.weight_decay, c.maximize)
    return g, _square_avg(v, g, c.alpha, c.one_minus_alpha)


@njit(**JIT)
def rmsprop(param: Any, grad: Any, square_avg: Any, c: Any) -> None:
    """RMSprop (``fused.RMSpropCoefficients``); torch: ``avg = square_avg.sqrt().add_(eps)``,
    ``param.addcdiv_(grad, avg, value=-lr)``."""
    for i in range(param.size):
        p = param[i]
        g, v = _rmsprop_grad(p, grad[i], square_avg[i], c)
        square_avg[i] = v
        param[i] = p + (c.neg_lr * g) / (_sqrt(v) + c.eps)


@njit(**JIT)
def rmsprop_momentum(param: Any, grad: Any, square_avg: Any, momentum_buffer: Any, c: Any) -> None:
    """RMSprop with momentum; torch: ``buf.mul_(momentum).addcdiv_(grad, avg)``,
    ``param.add_(buf, alpha=-lr)``."""
    for i in range(param.size):
        p = param[i]
        g, v = _rmsprop_grad(p, grad[i], square_avg[i], c)
        square_avg[i] = v
        b = momentum_buffer[i] * c.momentum + g / (_sqrt(v) + c.eps)
        momentum_buffer[i] = b
        param[i] = p + c.neg_lr * b


@njit(**INLINE)
def _centered_avg(v: Any, gbar: Any, c: Any) -> Any:
    """torch: ``avg = square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt_().add_(eps)``."""
    return _sqrt(v - gbar * gbar) + c.eps


@njit(**JIT)
def rmsprop_centered(param: Any, grad: Any, square_avg: Any, grad_avg: Any, c: Any) -> None:
    """Centered RMSprop; torch: ``grad_avg.lerp_(grad, 1 - alpha)``."""
    for i in range(param.size):
        p = param[i]
        g, v = _rmsprop_grad(p, grad[i], square_avg[i], c)
        square_avg[i] = v
        gbar = _lerp(grad_avg[i], g, c.lerp_scale, c.lerp_upper)
        grad_avg[i] = gbar
        param[i] = p + (c.neg_lr * g) / _centered_avg(v, gbar, c)


@njit(**JIT)
def rmsprop_centered_momentum(
    param: Any, grad: Any, square_avg: Any, momentum_buffer: Any, grad_avg: Any, c: Any
) -> None:
    """Centered RMSprop with momentum."""
    for i in range(param.size):
        p = param[i]
        g, v = _rmsprop_grad(p, grad[i], square_avg[i], c)
        square_avg[i] = v
        gbar = _lerp(grad_avg[i], g, c.lerp_scale, c.lerp_upper)
        grad_avg[i] = gbar
        b = momentum_buffer[i] * c.momentum + g / _centered_avg(v, gbar, c)
        momentum_buffer[i] = b
        param[i] = p + c.neg_lr * b


@njit(**JIT)
def adamax(param: Any, grad: Any, exp_avg: Any, exp_inf: Any, c: Any) -> None:
    """Adamax (``fused.AdamaxCoefficients``); torch: ``exp_avg.lerp_(grad, 1 - beta1)``,
    ``torch.maximum(exp_inf.mul_(beta2), grad.abs().add_(eps), out=exp_inf)``,
    ``param.addcdiv_(exp_avg, exp_inf, value=-clr)``; Keras adds ε after the max instead."""
    for i in range(param.size):
        p = param[i]
        g = _grad(grad[i], p, c.weight_decay, c.maximize)
        m = _lerp(exp_avg[i], g, c.lerp_scale, c.lerp_upper)
        exp_avg[i] = m
        norm = abs(g) if c.keras else abs(g) + c.eps
        u = _maximum(exp_inf[i] * c.beta2, norm)
        exp_inf[i] = u
        denom = u + c.eps if c.keras else u
        param[i] = p + (c.neg_clr * m) / denom


@njit(**INLINE)
def _sign(x: Any) -> Any:
    """np.sign: −1, +1, +0 for ±0 (numba's gives −0 for −0), nan for nan."""
    return x - x if x == 0 else np.sign(x)


@njit(**JIT)
def lion(param: Any, grad: Any, exp_avg: Any, c: Any) -> None:
    """Lion (``fused.LionCoefficients``), in the order of ``functional.lion``'s NumPy path."""
    for i in range(param.size):
        g = -grad[i] if c.maximize else grad[i]
        m = exp_avg[i]
        direction = _sign(m * c.beta1 + g * c.one_minus_beta1)
        p = param[i] * c.decay if c.decays else param[i]
        param[i] = p - direction * c.lr
        exp_avg[i] = m * c.beta2 + g * c.one_minus_beta2
