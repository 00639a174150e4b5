"""``Linear`` (y = x Wᵀ + b) and ``Embedding`` (a row lookup), with hand-written backward.

16-bit models: the matmuls run on float32 copies and the result is rounded back to the
parameter dtype (float32 accumulation, as tensor cores and torch's CPU kernels do). On a GPU,
cuBLAS reads and writes the 16-bit arrays itself and adds the bias in its epilogue: a dry run
standing for PyTorch counts the casts and the bias add as the products' (``meta.fusion``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zerosim.backend import add_at, np_dtype, resolve_dtype, xp_of
from zerosim.meta.fusion import fused
from zerosim.nn.functional import (
    compute_dtype,
    downcast,
    host_ints,
    reduce,
    reshape,
    upcast,
)
from zerosim.nn.init import RngLike, as_generator, check_positive_int, linear_default, normal
from zerosim.nn.module import Module
from zerosim.nn.parameter import Parameter, accumulate_grad


class Linear(Module):
    """y = x Wᵀ + b over the last axis; W is (out_features, in_features), b is (out_features,).

    Backward, with x and g flattened to (rows, features):
    dW = gᵀ x,  db = Σ_rows g,  dx = g W.
    Initialised like torch: W, b ~ U(−1/√in_features, 1/√in_features).
    """

    # The order torch's autograd finishes the gradients (addmm's bias gradient needs no
    # transpose, so its hook fires first): DeepSpeed's gradient buckets fill in this order.
    grad_ready_order = ("bias", "weight")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        rng: RngLike = None,
        dtype: Any = "float32",
    ) -> None:
        super().__init__()
        self.in_features = check_positive_int("in_features", in_features)
        self.out_features = check_positive_int("out_features", out_features)
        rng = as_generator(rng)
        shape = (self.out_features, self.in_features)
        self.weight = Parameter(linear_default(rng, shape, self.in_features, dtype))
        bias_data = linear_default(rng, (self.out_features,), self.in_features, dtype)
        self.bias = Parameter(bias_data) if bias else None

    @fused("linear", epilogue=True)
    def forward(self, x: Any) -> Any:
        if x.ndim == 0 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"Linear expects input whose last axis is in_features={self.in_features}; "
                f"got shape {tuple(x.shape)}"
            )
        w = self.weight.data
        y = reshape(upcast(x), (-1, self.in_features)) @ upcast(w).T
        if self.bias is not None:
            y += upcast(self.bias.data)
        self.save_for_backward(x)
        return downcast(reshape(y, (*x.shape[:-1], self.out_features)), w.dtype)

    def _backward(self, grad: Any) -> Any:
        (x,) = self.pop_saved()
        return self._gradients(grad, x)

    @fused("linear_backward", epilogue=True)
    def _gradients(self, grad: Any, x: Any) -> Any:
        g = reshape(upcast(grad), (-1, self.out_features))
        accumulate_grad(self.weight, g.T @ reshape(upcast(x), (-1, self.in_features)))
        if self.bias is not None:
            accumulate_grad(self.bias, _bias_grad(g))
        dx = g @ upcast(self.weight.data)
        return downcast(reshape(dx, x.shape), x.dtype)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}"


@fused("bias_grad")
def _bias_grad(g: Any) -> Any:
    """db = Σ_rows g: on a GPU a reduction kernel of its own, beside the backward's products."""
    return reduce("sum", g, axis=0)


class Embedding(Module):
    """y[...] = W[idx[...]]: row lookup of integer ids; W is (num_embeddings, embedding_dim).

    Backward scatters the output gradient back onto the looked-up rows:
    dW[i] = Σ_{positions p with idx[p] = i} g[p]. Initialised like torch: W ~ N(0, 1).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        rng: RngLike = None,
        dtype: Any = "float32",
        std: float = 1.0,
    ) -> None:
        super().__init__()
        self.num_embeddings = check_positive_int("num_embeddings", num_embeddings)
        self.embedding_dim = check_positive_int("embedding_dim", embedding_dim)
        shape = (self.num_embeddings, self.embedding_dim)
        self.weight = Parameter(normal(as_generator(rng), shape, std, resolve_dtype(dtype)))

    def forward(self, idx: Any) -> Any:
        if np_dtype(idx.dtype).kind not in "iu":
            raise TypeError(f"Embedding expects integer ids; got dtype {idx.dtype}")
        xp = xp_of(idx)
        low, high = host_ints(reduce("min", idx), reduce("max", idx)) if idx.size else (0, 0)
        if low < 0 or high >= self.num_embeddings:
            raise IndexError(
                f"Embedding ids must lie in [0, {self.num_embeddings}); got min {low}, max {high}"
            )
        self.save_for_backward(idx)
        w = self.weight.data
        if xp is np:
            return w[idx]
        # the standard indexes with one integer array per axis only: take rows, then shape
        rows = xp.take(w, reshape(idx, (-1,)), axis=0)
        return reshape(rows, (*idx.shape, self.embedding_dim))

    def _backward(self, grad: Any) -> None:
        (idx,) = self.pop_saved()
        p = self.weight
        if not p.requires_grad:
            return None
        xp = xp_of(grad)
        rows = reshape(upcast(grad), (-1, self.embedding_dim))
        ids = reshape(idx, (-1,))
        if p.grad is not None and np_dtype(p.grad.dtype) == np_dtype(rows.dtype):
            add_at(p.grad, ids, rows)  # straight into the gradient
        else:
            dw = xp.zeros(p.shape, dtype=compute_dtype(p.dtype))
            add_at(dw, ids, rows)
            accumulate_grad(p, dw)
        return None

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"
