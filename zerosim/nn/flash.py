"""Causal self-attention as FlashAttention computes it (Dao et al. 2022, "FlashAttention: Fast and
Memory-Efficient Exact Attention with IO-Awareness", arXiv 2205.14135, Algorithms 1 and 2): the
same outputs and gradients as ``CausalSelfAttention``, without keeping the s × s probabilities.

Forward, per block of queries [a, e) (keys :e, as causality allows), with S the block's scores:

    m = max_j S,   ℓ = Σ_j exp(S − m),   Y = exp(S − m) v / ℓ,   L = m + log ℓ

and only q, k, v, the output Y and the per-row log-sum-exp L (B·h·s numbers) are kept for
backward. Backward recomputes each block's probabilities from them, P = exp(S − L), and uses
that Σ_j P ⊙ dP = Σ_d dY ⊙ Y (= D, one number per row), so no row of P is needed twice:

    dv += Pᵀ dY,   dP = dY vᵀ,   dS = P ⊙ (dP − D),   dq = dS k / √d,   dk += dSᵀ q / √d

The price is the recomputation: backward multiplies q kᵀ again, 2·B·h·d per (query, key) pair
under the diagonal, one more matrix product beside forward's two and backward's four (the dry
run counts it; a model-FLOP count such as MFU does not). The memory a layer keeps is that of the
standard layer less its B·h·s² probabilities (and their dropout copy): q, k, v in the model's
dtype, Y in the model's dtype (the same array ``c_proj`` keeps as its input) and L in fp32.

Only the queries are tiled here (tiles of ``QUERY_BLOCK``), so a block's (B, h, tile, e) scores
are the largest temporary; FlashAttention also tiles the keys to stay in on-chip memory, which
changes where the numbers live on a GPU, not what is computed. The dry run of a GPU therefore
runs each pass as one fused kernel (``gpu_kernel``): the same matrix FLOPs as the tiles, the
device memory read and written once (q, k, v, Y, L; in backward also dY and dq, dk, dv), and no
tile in device memory. There is no dropout on the
probabilities (MPT trains with ``attn_pdrop: 0``); ALiBi's biases are added as in the standard
layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from zerosim.backend import nbytes, stands_for_gpu, xp_of
from zerosim.nn.attention import (
    CausalSelfAttention,
    causal_mask,
    query_blocks,
    split_heads,
    transposed,
)
from zerosim.nn.functional import (
    compute_dtype,
    downcast,
    permute,
    reduce,
    reshape,
    rowdot,
    upcast,
)
from zerosim.nn.positions import alibi_bias

FORWARD_PRODUCTS = 2  # S = q kᵀ, Y = P v
BACKWARD_PRODUCTS = 5  # S again, dv = Pᵀ dY, dP = dY vᵀ, dq = dS k, dk = dSᵀ q


def causal_pairs(t: int) -> int:
    """The (query, key) pairs the blocks of queries multiply: Σ over blocks [a, e) of (e − a)·e,
    each product 2·d FLOPs per head."""
    return sum((e - a) * e for a, e in query_blocks(t))


def gpu_kernel(x: Any) -> Callable[[int, int], None] | None:
    """Where the dry run stands for a GPU, FlashAttention's fused kernel: ``kernel(flops,
    bytes)`` counts its products and the device memory it reads and writes, and nothing of the
    tiles, which live in on-chip memory. None elsewhere: the tiles are computed (NumPy, the
    dry run of a host, every other backend)."""
    return xp_of(x).fused_matmul_kernel if stands_for_gpu(x) else None


class FlashSelfAttention(CausalSelfAttention):
    """``CausalSelfAttention``'s children and names (``c_attn``, ``c_proj``, ``resid_dropout``),
    computed block by block as FlashAttention does (module docstring). ``dropout`` applies to the
    output only; attention dropout is not supported (it must be 0.0 where it applies)."""

    def __init__(
        self, n_embd: int, n_head: int, dropout: float = 0.0, *args: Any, **kw: Any
    ) -> None:
        """``CausalSelfAttention``'s arguments (``bias``, ``alibi``, ``rng``, ``dtype``)."""
        if dropout != 0.0:
            raise ValueError(
                "attention='flash' keeps no probabilities to drop out: dropout must be 0.0 "
                f"(MPT trains with attn_pdrop 0); got dropout={dropout!r}"
            )
        super().__init__(n_embd, n_head, dropout, *args, **kw)

    def _scores(self, q: Any, k: Any, a: int, e: int, mask: Any) -> Any:
        """S for queries a:e and keys :e, in fp32: q kᵀ / √d + causal mask (+ ALiBi)."""
        xp = xp_of(q)
        s = xp.matmul(q[:, :, a:e, ...], transposed(k[:, :, :e, ...]))
        s *= 1.0 / math.sqrt(q.shape[-1])
        s += mask[a:e, :e]
        if self.alibi_slopes is not None:
            s += alibi_bias(self.alibi_slopes, range(a, e), e, like=s)
        return s

    def forward(self, x: Any) -> Any:
        b, t, c = x.shape
        h, d = self.n_head, c // self.n_head
        qkv_kept = reshape(self.c_attn(x), (b, t, 3, h, d))  # kept in the model's dtype
        kernel = gpu_kernel(qkv_kept)
        if kernel is None:
            y, lse = self._tiled_forward(qkv_kept)
        else:  # the dry run of a GPU: one kernel, S and P in on-chip memory
            xp = xp_of(x)
            y = xp.empty((b, t, h, d), dtype=qkv_kept.dtype)
            lse = xp.empty((b, h, t), dtype=compute_dtype(qkv_kept.dtype))
            moved = 4 * nbytes(y) + nbytes(lse)  # reads q, k, v; writes Y and L
            kernel(2 * FORWARD_PRODUCTS * b * h * d * causal_pairs(t), moved)
        y = downcast(reshape(y, (b, t, c)), x.dtype)  # the array c_proj keeps, kept once
        self.save_for_backward(qkv_kept, y, lse)
        return self.resid_dropout(self.c_proj(y))

    def _tiled_forward(self, qkv_kept: Any) -> tuple[Any, Any]:
        """Y (B, T, h, d) and L (B, h, T), one block of queries at a time."""
        xp = xp_of(qkv_kept)
        b, t, _, h, d = qkv_kept.shape
        q, k, v = split_heads(upcast(qkv_kept))
        mask = causal_mask(xp, t, q.dtype)
        y = xp.empty((b, t, h, d), dtype=q.dtype)  # heads side by side, as c_proj reads
        y_heads = permute(y, (0, 2, 1, 3))
        lse = xp.empty((b, h, t), dtype=q.dtype)
        for a, e in query_blocks(t):
            s = self._scores(q, k, a, e, mask)
            m = reduce("max", s, axis=-1, keepdims=True)
            s -= m
            xp.exp(s, out=s)  # exp(S − m)
            ell = reduce("sum", s, axis=-1, keepdims=True)
            xp.matmul(s, v[:, :, :e, ...], out=y_heads[:, :, a:e, ...])
            y_heads[:, :, a:e, ...] *= 1.0 / ell
            lse[:, :, a:e] = reshape(m + xp.log(ell), (b, h, e - a))
        return y, lse

    def _backward(self, grad: Any) -> Any:
        qkv_kept, y, lse = self.pop_saved()
        b, t, _, h, d = qkv_kept.shape
        dy = self.c_proj.backward(self.resid_dropout.backward(grad))
        kernel = gpu_kernel(qkv_kept)
        if kernel is None:
            dqkv = self._tiled_backward(qkv_kept, y, lse, dy)
        else:  # reads q, k, v, Y, dY and L; writes dq, dk, dv
            dqkv = xp_of(dy).empty((b, t, 3 * h * d), dtype=qkv_kept.dtype)
            moved = nbytes(qkv_kept) + nbytes(y) + nbytes(dy) + nbytes(lse) + nbytes(dqkv)
            kernel(2 * BACKWARD_PRODUCTS * b * h * d * causal_pairs(t), moved)
        return self.c_attn.backward(dqkv)

    def _tiled_backward(self, qkv_kept: Any, y: Any, lse: Any, dy: Any) -> Any:
        """dq, dk, dv laid out as c_attn's output, (B, T, 3·h·d) in the model's dtype."""
        xp = xp_of(lse)
        b, t, _, h, d = qkv_kept.shape
        q, k, v = split_heads(upcast(qkv_kept))
        dy = permute(reshape(upcast(dy), (b, t, h, d)), (0, 2, 1, 3))  # (B, h, T, d)
        delta = rowdot(dy, permute(reshape(upcast(y), (b, t, h, d)), (0, 2, 1, 3)))  # D
        mask = causal_mask(xp, t, q.dtype)
        dqkv = xp.zeros((b, t, 3, h, d), dtype=q.dtype)  # laid out as c_attn's output
        dq, dk, dv = split_heads(dqkv)
        for a, e in query_blocks(t):
            p = self._scores(q, k, a, e, mask)  # recomputed: P = exp(S − L)
            p -= reshape(lse[:, :, a:e], (b, h, e - a, 1))
            xp.exp(p, out=p)
            dy_rows = dy[:, :, a:e, ...]
            dv[:, :, :e, ...] += xp.matmul(transposed(p), dy_rows)
            ds = xp.matmul(dy_rows, transposed(v[:, :, :e, ...]))  # dP
            ds -= reshape(delta[:, :, a:e], (b, h, e - a, 1))
            ds *= p  # dS = P ⊙ (dP − D)
            del p
            xp.matmul(ds, k[:, :, :e, ...], out=dq[:, :, a:e, ...])
            dk[:, :, :e, ...] += xp.matmul(transposed(ds), q[:, :, a:e, ...])
            del ds
        dqkv[:, :, :2, ...] *= 1.0 / math.sqrt(d)  # dq = dS k / √d,  dk = dSᵀ q / √d
        return downcast(reshape(dqkv, (b, t, 3 * h * d)), qkv_kept.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", flash=True"
