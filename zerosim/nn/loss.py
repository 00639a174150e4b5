"""Losses as modules: ``CrossEntropyLoss`` (mean over non-ignored targets) and ``MSELoss``.

``loss_fn(prediction, target)`` returns a 0-d array in float32 for 16-bit predictions
(the reduction accumulates in float32), else in the prediction's dtype.
``loss_fn.backward(g)`` takes the gradient of the loss (the seed, e.g. a loss scale) and
returns ``(d prediction, None)``: targets are data and get no gradient. On a GPU each pass of
the softmax cross-entropy is one kernel (``meta.fusion``: llm-foundry's runs used
flash-attn's fused cross-entropy).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zerosim.backend import np_dtype, xp_of
from zerosim.meta.fusion import fused
from zerosim.nn.functional import downcast, host_ints, reduce, upcast
from zerosim.nn.module import Module

REDUCTIONS = ("mean", "sum")


def _check_reduction(reduction: str) -> str:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}; got {reduction!r}")
    return reduction


class CrossEntropyLoss(Module):
    """ℓ_i = logsumexp(z_i) − z_i[t_i]; loss = Σ_{valid i} ℓ_i / #valid (or the sum).

    logits z are (N, C), targets t are (N,) integers; rows with t_i == ignore_index
    count neither in the sum nor in #valid. d z_i = (softmax(z_i) − onehot(t_i)) · g / #valid.
    When every target is ignored the mean is NaN, as in torch, and the gradient is zero.

    Forward keeps the softmax probabilities in float32 for backward. With
    ``recompute_softmax`` it keeps the logits and each row's log-sum-exp instead and backward
    recomputes softmax(z) = exp(z − lse): flash-attn's fused cross-entropy (``xentropy``, which
    llm-foundry's runs used), whose memory is the logits' own, in their dtype.
    """

    def __init__(
        self, ignore_index: int = -100, reduction: str = "mean", recompute_softmax: bool = False
    ) -> None:
        super().__init__()
        self.ignore_index = int(ignore_index)
        self.reduction = _check_reduction(reduction)
        self.recompute_softmax = bool(recompute_softmax)

    @fused("cross_entropy")
    def forward(self, logits: Any, target: Any) -> Any:
        if logits.ndim != 2 or target.shape != logits.shape[:1]:
            raise ValueError(
                f"CrossEntropyLoss expects logits (N, C) and targets (N,); got "
                f"{tuple(logits.shape)} and {tuple(target.shape)}"
            )
        if np_dtype(target.dtype).kind not in "iu":
            raise TypeError(f"CrossEntropyLoss targets must be integers; got dtype {target.dtype}")
        xp = xp_of(logits)
        n, c = logits.shape
        valid = target != self.ignore_index
        t = xp.where(valid, target, 0)
        low, high, count = (0, 0, 0)
        if n:
            low, high, count = host_ints(
                reduce("min", t), reduce("max", t), xp.count_nonzero(valid)
            )
        if low < 0 or high >= c:
            given = host_ints(reduce("min", target), reduce("max", target))
            raise IndexError(
                f"CrossEntropyLoss targets must lie in [0, {c}) or equal "
                f"ignore_index={self.ignore_index}; got min {given[0]}, max {given[1]}"
            )
        z = upcast(logits)
        zmax = reduce("max", z, axis=1, keepdims=True)
        e = z - zmax
        xp.exp(e, out=e)
        s = reduce("sum", e, axis=1, keepdims=True)
        lse = (xp.log(s) + zmax)[:, 0]
        if xp is np:
            z_target = z[np.arange(n), t]
            total = ((lse - z_target) * valid).sum()
        else:  # the standard: one index array per axis only with take_along_axis; no bool·float
            z_target = xp.take_along_axis(z, t[:, None], axis=1)[:, 0]
            total = reduce("sum", (lse - z_target) * xp.astype(valid, z.dtype))
        denom = count if self.reduction == "mean" else 1
        if self.recompute_softmax:
            self.save_for_backward(logits, lse, t, valid, denom, logits.dtype)
        else:
            e /= s  # softmax probabilities, kept for backward
            self.save_for_backward(e, t, valid, denom, logits.dtype)
        if denom == 0:
            return xp.asarray(float("nan"), dtype=z.dtype)
        return total / denom

    def _backward(self, grad: Any) -> tuple[Any, None]:
        if self.recompute_softmax:
            return _cross_entropy_backward_recomputed(*self.pop_saved(), grad), None
        probs, t, valid, denom, dtype = self.pop_saved()
        return _cross_entropy_backward(probs, t, valid, denom, dtype, grad), None

    def extra_repr(self) -> str:
        recompute = ", recompute_softmax=True" if self.recompute_softmax else ""
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}{recompute}"


@fused("cross_entropy_backward")
def _cross_entropy_backward_recomputed(
    logits: Any, lse: Any, t: Any, valid: Any, denom: int, dtype: Any, grad: Any
) -> Any:
    """The backward from the logits and log-sum-exp: softmax(z) = exp(z − lse) in a new array
    (the logits stay as they were: a trainer may still read them), then as from the kept
    probabilities; one kernel on a GPU, reading the logits and writing their gradient."""
    probs = upcast(logits) - lse[:, None]  # a new array: the logits are not written
    xp_of(probs).exp(probs, out=probs)
    return _cross_entropy_backward(probs, t, valid, denom, dtype, grad)


@fused("cross_entropy_backward")
def _cross_entropy_backward(
    probs: Any, t: Any, valid: Any, denom: int, dtype: Any, grad: Any
) -> Any:
    """d z = (softmax(z) − onehot(t)) · g / #valid, in ``probs``' place, rounded to ``dtype``."""
    xp = xp_of(probs)
    d = probs  # reused in place: this entry is never read again
    scale = xp.asarray(grad, dtype=d.dtype) / max(denom, 1)
    if xp is np:
        d[np.arange(d.shape[0]), t] -= 1
        d *= (valid * scale)[:, None]
    else:  # no fancy-index assignment in the standard: subtract the one-hot rows
        classes = xp.arange(d.shape[1], dtype=t.dtype)
        d -= xp.astype(t[:, None] == classes[None, :], d.dtype)
        d *= (xp.astype(valid, d.dtype) * scale)[:, None]
    return downcast(d, dtype)


class MSELoss(Module):
    """loss = Σ (x − y)² / numel (or the sum);  dx = 2 (x − y) · g / numel."""

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self.reduction = _check_reduction(reduction)

    def forward(self, prediction: Any, target: Any) -> Any:
        if prediction.shape != target.shape:
            raise ValueError(
                f"MSELoss expects prediction and target of the same shape; got "
                f"{tuple(prediction.shape)} and {tuple(target.shape)}"
            )
        diff = upcast(prediction) - upcast(target)
        denom = diff.size if self.reduction == "mean" else 1
        self.save_for_backward(diff, denom, prediction.dtype)
        return reduce("sum", diff * diff) / denom

    def _backward(self, grad: Any) -> tuple[Any, None]:
        diff, denom, dtype = self.pop_saved()
        d = diff * (2 * xp_of(diff).asarray(grad, dtype=diff.dtype) / denom)
        return downcast(d, dtype), None

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}"
