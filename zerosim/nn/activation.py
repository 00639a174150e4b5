"""Elementwise layers: ``ReLU``, ``Tanh``, ``GELU`` (exact or tanh form) and ``Dropout``.

Each saves one array for backward: ReLU and Tanh their output (which the next layer
usually saves anyway, so it costs no extra memory), GELU its input, Dropout its mask. Tanh's
and GELU's passes are each one kernel in PyTorch (``meta.fusion``).
"""

from __future__ import annotations

from typing import Any

from zerosim.backend import from_host, is_host_array, xp_of
from zerosim.meta.fusion import fused
from zerosim.nn.functional import downcast, gelu, gelu_backward, upcast
from zerosim.nn.init import RngLike, as_generator
from zerosim.nn.module import Module

GELU_APPROXIMATIONS = ("none", "tanh")


def _times_mask(x: Any, mask: Any) -> Any:
    """x · mask for a boolean ``mask`` (a new array); the standard multiplies numbers only,
    so off NumPy the mask becomes 0/1 in x's dtype first (the same products)."""
    if is_host_array(x):  # a dry run standing for NumPy too
        return x * mask
    xp = xp_of(x)
    return x * xp.astype(mask, x.dtype)


class ReLU(Module):
    """y = max(x, 0);  dx = g · [y > 0]."""

    def forward(self, x: Any) -> Any:
        y = xp_of(x).maximum(x, 0)
        self.save_for_backward(y)
        return y

    def _backward(self, grad: Any) -> Any:
        (y,) = self.pop_saved()
        return _times_mask(grad, y > 0)


class Tanh(Module):
    """y = tanh(x);  dx = g · (1 − y²)."""

    @fused("tanh")
    def forward(self, x: Any) -> Any:
        y = downcast(xp_of(x).tanh(upcast(x)), x.dtype)
        self.save_for_backward(y)
        return y

    def _backward(self, grad: Any) -> Any:
        (y,) = self.pop_saved()
        return _tanh_backward(y, grad)


class GELU(Module):
    """y = x·Φ(x) (``approximate="none"``) or its tanh form (``"tanh"``); see functional.gelu."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in GELU_APPROXIMATIONS:
            raise ValueError(
                f"approximate must be one of {GELU_APPROXIMATIONS}; got {approximate!r}"
            )
        self.approximate = approximate

    @fused("gelu")
    def forward(self, x: Any) -> Any:
        self.save_for_backward(x)
        return downcast(gelu(x, self.approximate), x.dtype)

    def _backward(self, grad: Any) -> Any:
        (x,) = self.pop_saved()
        return _gelu_backward(x, grad, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


@fused("tanh_backward")
def _tanh_backward(y: Any, grad: Any) -> Any:
    yc = upcast(y)
    return downcast(upcast(grad) * (1 - yc * yc), y.dtype)


@fused("gelu_backward")
def _gelu_backward(x: Any, grad: Any, approximate: str) -> Any:
    return downcast(gelu_backward(x, grad, approximate), x.dtype)


class Dropout(Module):
    """Training: y = x · m / (1 − p) with m ~ Bernoulli(1 − p) drawn from ``self.rng``;
    evaluation (or p = 0): y = x. Backward: dx = g · m / (1 − p).

    The mask is drawn on the host from a seeded numpy Generator (then crossed to the
    array's device with ``from_host``), whatever the grad mode and the backend, so a
    recomputation that restores ``rng``'s state (activation checkpointing) and a run on
    another backend draw the same mask.
    """

    def __init__(self, p: float = 0.5, *, rng: RngLike = None) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability p must be in [0, 1]; got {p!r}")
        self.p = float(p)
        self.rng = as_generator(rng)

    def forward(self, x: Any) -> Any:
        if not self.training or self.p == 0.0:
            self.save_for_backward(None)
            return x
        keep = from_host(self.rng.random(x.shape) >= self.p, like=x)
        scale = 0.0 if self.p == 1.0 else 1.0 / (1.0 - self.p)
        self.save_for_backward(keep)
        y = _times_mask(x, keep)
        y *= scale
        return y

    def _backward(self, grad: Any) -> Any:
        (keep,) = self.pop_saved()
        if keep is None:
            return grad
        scale = 0.0 if self.p == 1.0 else 1.0 / (1.0 - self.p)
        dx = _times_mask(grad, keep)
        dx *= scale
        return dx

    def extra_repr(self) -> str:
        return f"p={self.p}"
