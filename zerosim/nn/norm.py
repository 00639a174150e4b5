"""``LayerNorm``, ``RMSNorm`` and ``BatchNorm1d``: normalise, then scale (and shift), with
hand-written backward.

Both compute their statistics in float32 (or float64) even for 16-bit inputs. Backward,
with x̂ = (x − μ)·rstd, rstd = 1/√(σ² + ε), and m values per statistic (Ioffe & Szegedy 2015):

    dx̂ = g·w,   dx = rstd · (dx̂ − mean(dx̂) − x̂ · mean(dx̂ · x̂)),   dw = Σ g·x̂,   db = Σ g.

RMSNorm (Zhang & Sennrich 2019) leaves the mean in: x̂ = x·rstd, rstd = 1/√(mean(x²) + ε), and
its backward drops the mean(dx̂) term: dx = rstd · (dx̂ − x̂ · mean(dx̂ · x̂)).

On a GPU PyTorch runs each pass of LayerNorm and RMSNorm as one kernel (``meta.fusion``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zerosim.backend import resolve_dtype, xp_of
from zerosim.meta.fusion import fused
from zerosim.nn.functional import downcast, host_ints, reduce, reshape, rowdot, upcast
from zerosim.nn.init import check_last_axis, check_positive_int
from zerosim.nn.module import Module
from zerosim.nn.parameter import Parameter, accumulate_grad


def _normalized_grad(dxhat: Any, xhat: Any, rstd: Any, axes: tuple[int, ...]) -> Any:
    """dx = rstd · (dx̂ − mean(dx̂) − x̂ · mean(dx̂ · x̂)), means over ``axes``."""
    dx = dxhat - reduce("mean", dxhat, axis=axes, keepdims=True)
    dx -= xhat * reduce("mean", dxhat * xhat, axis=axes, keepdims=True)
    dx *= rstd
    return dx


class LayerNorm(Module):
    """y = (x − mean) / √(var + ε) · w + b over the last axis (biased variance), like torch."""

    def __init__(
        self,
        normalized_shape: int,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        *,
        dtype: Any = "float32",
    ) -> None:
        super().__init__()
        self.normalized_shape = check_positive_int("normalized_shape", normalized_shape)
        self.eps = float(eps)
        dt = resolve_dtype(dtype)
        affine = elementwise_affine
        self.weight = Parameter(np.ones(self.normalized_shape, dt)) if affine else None
        self.bias = Parameter(np.zeros(self.normalized_shape, dt)) if affine and bias else None

    @fused("layer_norm")
    def forward(self, x: Any) -> Any:
        check_last_axis("LayerNorm", x, self.normalized_shape)
        xp = xp_of(x)
        xc = upcast(x)
        mean = reduce("mean", xc, axis=-1, keepdims=True)
        y = xc - mean  # the only new (…, C) array: x − μ, then x̂, then the output
        var = rowdot(y, y)[..., None]  # Σ (x − μ)², no temporary
        var *= 1.0 / self.normalized_shape
        var += self.eps
        rstd = 1 / xp.sqrt(var, out=var)
        y *= rstd
        self.save_for_backward(x, mean, rstd)
        if self.weight is not None:
            y *= upcast(self.weight.data)
        if self.bias is not None:
            y += upcast(self.bias.data)
        return downcast(y, x.dtype)

    def _backward(self, grad: Any) -> Any:
        return self._gradients(grad, *self.pop_saved())

    @fused("layer_norm_backward")
    def _gradients(self, grad: Any, x: Any, mean: Any, rstd: Any) -> Any:
        xp = xp_of(grad)
        xhat = upcast(x) - mean  # recomputed from x, which is kept anyway (the caller's)
        xhat *= rstd
        g = upcast(grad)
        if self.weight is not None:
            g_rows = reshape(g, (-1, self.normalized_shape))
            accumulate_grad(self.weight, _column_dot(g_rows, reshape(xhat, g_rows.shape)))
            if self.bias is not None:
                accumulate_grad(self.bias, reduce("sum", g_rows, axis=0))
            dx = g * upcast(self.weight.data)  # dx̂, turned into dx in place below
        else:
            dx = xp.asarray(g, copy=True)
        # dx = rstd · (dx̂ − mean(dx̂) − x̂ · mean(dx̂ · x̂)), without further (…, C) arrays
        mean_dxhat_xhat = rowdot(dx, xhat)[..., None]
        mean_dxhat_xhat *= 1.0 / self.normalized_shape
        dx -= reduce("mean", dx, axis=-1, keepdims=True)
        xhat *= mean_dxhat_xhat
        dx -= xhat
        dx *= rstd
        return downcast(dx, x.dtype)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


class RMSNorm(Module):
    """y = x / √(mean(x²) + ε) · w over the last axis (no mean subtracted, no bias), as Llama's
    ``LlamaRMSNorm`` and ``torch.nn.functional.rms_norm``. Llama 2 and 3 use ε = 1e-5."""

    def __init__(self, normalized_shape: int, eps: float = 1e-5, *, dtype: Any = "float32") -> None:
        super().__init__()
        self.normalized_shape = check_positive_int("normalized_shape", normalized_shape)
        if not eps > 0:
            raise ValueError(f"eps must be a positive float; got {eps!r}")
        self.eps = float(eps)
        self.weight = Parameter(np.ones(self.normalized_shape, resolve_dtype(dtype)))

    @fused("rms_norm")
    def forward(self, x: Any) -> Any:
        check_last_axis("RMSNorm", x, self.normalized_shape)
        xp = xp_of(x)
        xc = upcast(x)
        ms = rowdot(xc, xc)[..., None]  # Σ x², then mean(x²) + ε, then rstd, in place
        ms *= 1.0 / self.normalized_shape
        ms += self.eps
        rstd = 1 / xp.sqrt(ms, out=ms)
        self.save_for_backward(x, rstd)
        y = xc * rstd
        y *= upcast(self.weight.data)
        return downcast(y, x.dtype)

    def _backward(self, grad: Any) -> Any:
        return self._gradients(grad, *self.pop_saved())

    @fused("rms_norm_backward")
    def _gradients(self, grad: Any, x: Any, rstd: Any) -> Any:
        xhat = upcast(x) * rstd
        g = upcast(grad)
        g_rows = reshape(g, (-1, self.normalized_shape))
        accumulate_grad(self.weight, _column_dot(g_rows, reshape(xhat, g_rows.shape)))
        dx = g * upcast(self.weight.data)  # dx̂, turned into dx in place below
        # dx = rstd · (dx̂ − x̂ · mean(dx̂ · x̂))
        mean_dxhat_xhat = rowdot(dx, xhat)[..., None]
        mean_dxhat_xhat *= 1.0 / self.normalized_shape
        xhat *= mean_dxhat_xhat
        dx -= xhat
        dx *= rstd
        return downcast(dx, x.dtype)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


def _column_dot(g_rows: Any, xhat_rows: Any) -> Any:
    """Σ_rows g·x̂ per column: a norm's weight gradient (on NumPy without a (rows, C) temporary)."""
    if xp_of(g_rows) is np:
        return np.einsum("ij,ij->j", g_rows, xhat_rows)
    return reduce("sum", g_rows * xhat_rows, axis=0)


class BatchNorm1d(Module):
    """Normalise each channel of (N, C) or (N, C, L) input over the batch (and length) axes.

    Training: batch mean and biased variance normalise; the running statistics are updated
    with the unbiased variance, r ← (1 − f)·r + f·s, where f = momentum, or
    f = 1 / num_batches_tracked (a cumulative average) when momentum is None.
    Evaluation (with track_running_stats): the running statistics normalise.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        *,
        dtype: Any = "float32",
    ) -> None:
        super().__init__()
        self.num_features = check_positive_int("num_features", num_features)
        if momentum is not None and not 0.0 <= momentum <= 1.0:
            raise ValueError(f"momentum must be None or in [0, 1]; got {momentum!r}")
        self.eps, self.momentum = float(eps), momentum
        dt = resolve_dtype(dtype)
        c = self.num_features
        self.weight = Parameter(np.ones(c, dt)) if affine else None
        self.bias = Parameter(np.zeros(c, dt)) if affine else None
        self.track_running_stats = track_running_stats
        if track_running_stats:
            self.register_buffer("running_mean", np.zeros(c, dt))
            self.register_buffer("running_var", np.ones(c, dt))
            self.register_buffer("num_batches_tracked", np.zeros((), np.int64))

    def _layout(self, x: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if x.ndim not in (2, 3) or x.shape[1] != self.num_features:
            raise ValueError(
                f"BatchNorm1d expects (N, {self.num_features}) or "
                f"(N, {self.num_features}, L) input; got shape {tuple(x.shape)}"
            )
        return ((0,), (1, -1)) if x.ndim == 2 else ((0, 2), (1, -1, 1))

    def forward(self, x: Any) -> Any:
        axes, shape = self._layout(x)
        xp = xp_of(x)
        xc = upcast(x)
        use_batch = self.training or not self.track_running_stats
        if use_batch:
            m = x.size // self.num_features
            if m <= 1:
                raise ValueError(
                    f"BatchNorm1d needs more than 1 value per channel when "
                    f"training; got input shape {tuple(x.shape)}"
                )
            mean = reduce("mean", xc, axis=axes)
            var = reduce("mean", (xc - reshape(mean, shape)) ** 2, axis=axes)
            if self.training and self.track_running_stats:
                self._update_running(mean, var * (m / (m - 1)))
        else:
            mean, var = upcast(self.running_mean), upcast(self.running_var)
        rstd = reshape(1 / xp.sqrt(var + self.eps), shape)
        xhat = (xc - reshape(mean, shape)) * rstd
        self.save_for_backward(xhat, rstd, use_batch, x.dtype)
        y = xhat
        if self.weight is not None:
            weight = reshape(upcast(self.weight.data), shape)
            y = y * weight + reshape(upcast(self.bias.data), shape)
        return downcast(y, x.dtype)

    def _update_running(self, mean: Any, unbiased_var: Any) -> None:
        self.num_batches_tracked += 1
        if self.momentum is None:
            f = 1.0 / host_ints(self.num_batches_tracked)[0]
        else:
            f = self.momentum
        for buffer, stat in ((self.running_mean, mean), (self.running_var, unbiased_var)):
            buffer *= 1 - f
            buffer += downcast(f * stat, buffer.dtype)

    def _backward(self, grad: Any) -> Any:
        xhat, rstd, use_batch, dtype = self.pop_saved()
        axes, shape = ((0,), (1, -1)) if xhat.ndim == 2 else ((0, 2), (1, -1, 1))
        g = upcast(grad)
        dxhat = g
        if self.weight is not None:
            accumulate_grad(self.weight, reduce("sum", g * xhat, axis=axes))
            accumulate_grad(self.bias, reduce("sum", g, axis=axes))
            dxhat = g * reshape(upcast(self.weight.data), shape)
        dx = _normalized_grad(dxhat, xhat, rstd, axes) if use_batch else dxhat * rstd
        return downcast(dx, dtype)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}"
