"""Causal multi-head self-attention (GPT-2 / nanoGPT layout) with a hand-written backward.

All heads at once, as batched matmuls over (batch, head). With q, k, v of shape
(B, h, T, d) (Vaswani et al. 2017):

    S = q kᵀ / √d + M      (M_ij = −∞ for j > i: a position sees only the past)
    P = softmax(S),  P̃ = dropout(P),  Y = P̃ v

Backward: dv = P̃ᵀ dY,  dP̃ = dY vᵀ,  dP = dropout⁻¹(dP̃),  dS = P ⊙ (dP − Σ_j P ⊙ dP),
dq = dS k / √d,  dk = dSᵀ q / √d. For 16-bit models all of this runs in float32.

Causality also saves work. The positions are cut into blocks of ``QUERY_BLOCK``; the
queries of block [a, e) see only keys < e, so S, P, Y, dP and dq are computed for
rows a:e on columns :e only, and dv, dk for key block [a, e) from query rows a: only.
The blocks above the diagonal, where P = 0, are never multiplied: with n blocks that
skips (n − 1)/2n of the attention matmuls and softmax (1/4 for n = 2, 3/8 for n = 4).
P is kept as one (B, h, T, T) array with zeros there, so dropout draws its mask for
the whole matrix, as without blocks. q, k, v and their gradients stay in c_attn's
(B, T, 3, h, d) layout; the matmuls read and write (B, h, T, d) views of it (``out=``
writes into a view of the bigger array, on NumPy directly, on the other backends
through ``view[...] = result``).

With ``alibi`` (MPT, BLOOM), each head h adds −m_h·(i − j) to S before the softmax
(``zerosim.nn.positions``); the bias is a constant, so backward is unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from zerosim.backend import xp_of
from zerosim.nn.activation import Dropout
from zerosim.nn.functional import (
    downcast,
    permute,
    reshape,
    scaled_masked_softmax_,
    softmax_backward_,
    upcast,
)
from zerosim.nn.init import RngLike, as_generator, check_last_axis, check_positive_int
from zerosim.nn.linear import Linear
from zerosim.nn.module import Module
from zerosim.nn.positions import alibi_bias, alibi_slopes

QUERY_BLOCK = 64  # positions per block; shorter blocks make batched matmuls too small


def causal_mask(xp: Any, t: int, dtype: Any) -> Any:
    """(T, T) additive mask: 0 on and below the diagonal, −∞ above it."""
    return xp.triu(xp.full((t, t), -np.inf, dtype=dtype), k=1)


def query_blocks(t: int) -> Iterator[tuple[int, int]]:
    """[a, e) for consecutive blocks of ``QUERY_BLOCK`` positions covering range(t)."""
    for a in range(0, t, QUERY_BLOCK):
        yield a, min(a + QUERY_BLOCK, t)


def split_heads(qkv: Any) -> tuple[Any, Any, Any]:
    """q, k, v as (B, h, T, d) views of a (B, T, 3, h, d) array (c_attn's output layout)."""
    return tuple(permute(qkv[:, :, i, ...], (0, 2, 1, 3)) for i in range(3))


def transposed(a: Any) -> Any:
    """The last two axes swapped (a view)."""
    return a.mT


class CausalSelfAttention(Module):
    """Children: ``c_attn`` (C → 3C, packs q, k, v), ``attn_dropout`` (on P),
    ``c_proj`` (C → C) and ``resid_dropout`` (on the output); nanoGPT's names. ``alibi``: add
    ALiBi's biases to the scores (MPT's ``Wqkv``/``out_proj``, BLOOM's ``query_key_value``/
    ``dense`` are these two matrices under other names)."""

    def __init__(
        self,
        n_embd: int,
        n_head: int,
        dropout: float = 0.0,
        bias: bool = True,
        *,
        alibi: bool = False,
        rng: RngLike = None,
        dtype: Any = "float32",
    ) -> None:
        super().__init__()
        self.n_embd = check_positive_int("n_embd", n_embd)
        self.n_head = check_positive_int("n_head", n_head)
        if n_embd % n_head:
            raise ValueError(
                f"n_embd must be divisible by n_head; got n_embd={n_embd}, n_head={n_head}"
            )
        rng = as_generator(rng)
        self.alibi_slopes = alibi_slopes(n_head) if alibi else None
        self.c_attn = Linear(n_embd, 3 * n_embd, bias, rng=rng, dtype=dtype)
        self.attn_dropout = Dropout(dropout, rng=rng.spawn(1)[0])
        self.c_proj = Linear(n_embd, n_embd, bias, rng=rng, dtype=dtype)
        self.resid_dropout = Dropout(dropout, rng=rng.spawn(1)[0])

    def forward(self, x: Any) -> Any:
        check_last_axis("CausalSelfAttention", x, self.n_embd, ndim=3)
        xp = xp_of(x)
        b, t, c = x.shape
        h, d = self.n_head, c // self.n_head
        qkv = reshape(upcast(self.c_attn(x)), (b, t, 3, h, d))
        q, k, v = split_heads(qkv)
        mask = causal_mask(xp, t, qkv.dtype)
        probs = xp.empty((b, h, t, t), dtype=qkv.dtype)
        for a, e in query_blocks(t):  # rows a:e of P; columns e: stay 0
            s = probs[:, :, a:e, :e]
            xp.matmul(q[:, :, a:e, ...], transposed(k[:, :, :e, ...]), out=s)
            alibi = None
            if self.alibi_slopes is not None:
                alibi = alibi_bias(self.alibi_slopes, range(a, e), e, like=s)
            scaled_masked_softmax_(s, 1.0 / math.sqrt(d), mask[a:e, :e], alibi)
            probs[:, :, a:e, e:] = 0
        dropped = self.attn_dropout(probs)
        y = xp.empty((b, t, h, d), dtype=qkv.dtype)  # heads side by side, as c_proj reads
        y_heads = permute(y, (0, 2, 1, 3))
        for a, e in query_blocks(t):
            xp.matmul(dropped[:, :, a:e, :e], v[:, :, :e, ...], out=y_heads[:, :, a:e, ...])
        self.save_for_backward(qkv, probs, dropped, x.dtype)
        return self.resid_dropout(self.c_proj(downcast(reshape(y, (b, t, c)), x.dtype)))

    def _backward(self, grad: Any) -> Any:
        qkv, probs, dropped, dtype = self.pop_saved()
        xp = xp_of(qkv)
        b, t, _, h, d = qkv.shape
        q, k, v = split_heads(qkv)
        dy = upcast(self.c_proj.backward(self.resid_dropout.backward(grad)))
        dy = permute(reshape(dy, (b, t, h, d)), (0, 2, 1, 3))  # (B, h, T, d)
        dqkv = xp.empty(qkv.shape, dtype=qkv.dtype)  # laid out as c_attn's output
        dq, dk, dv = split_heads(dqkv)
        dscores = xp.empty_like(probs)
        for a, e in query_blocks(t):
            dp = dscores[:, :, a:e, :e]
            xp.matmul(dy[:, :, a:e, ...], transposed(v[:, :, :e, ...]), out=dp)
            dv_block = dv[:, :, a:e, ...]
            xp.matmul(transposed(dropped[:, :, a:, a:e]), dy[:, :, a:, ...], out=dv_block)
            dscores[:, :, a:e, e:] = 0
        del dropped
        dscores = self.attn_dropout.backward(dscores)  # dP
        for a, e in query_blocks(t):
            softmax_backward_(probs[:, :, a:e, :e], dscores[:, :, a:e, :e])  # dS
        del probs
        for a, e in query_blocks(t):
            xp.matmul(dscores[:, :, a:e, :e], k[:, :, :e, ...], out=dq[:, :, a:e, ...])
            xp.matmul(transposed(dscores[:, :, a:, a:e]), q[:, :, a:, ...], out=dk[:, :, a:e, ...])
        del dscores
        dqkv[:, :, :2, ...] *= 1.0 / math.sqrt(d)  # dq = dS k / √d,  dk = dSᵀ q / √d
        return self.c_attn.backward(downcast(reshape(dqkv, (b, t, 3 * h * d)), dtype))

    def extra_repr(self) -> str:
        alibi = ", alibi=True" if self.alibi_slopes is not None else ""
        return f"n_embd={self.n_embd}, n_head={self.n_head}{alibi}"
