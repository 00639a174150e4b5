"""Causal grouped-query attention (Ainslie et al. 2023), Llama's layout, with a hand-written
backward; multi-head attention when every head has its own keys and values, multi-query
attention (Shazeer 2019) when all share one.

h query heads of size d share g = h / h_kv key/value heads: query head i reads key/value head
⌊i / g⌋ (HF Llama's ``repeat_kv``). The heads are laid out (B, h_kv, g, T, d) so that the g
queries of a group multiply the same (B, h_kv, 1, T, d) keys and values by broadcasting, never
copied g times. Per group, with q, k optionally rotated (``zerosim.nn.positions``):

    S = q kᵀ / √d + M (+ ALiBi),   P = softmax(S),   Y = P v

Backward, summing over the g queries that read the same key/value head:

    dP = dY vᵀ,  dS = P ⊙ (dP − Σ_j P ⊙ dP),  dq = dS k / √d,
    dk = Σ_g dSᵀ q / √d,  dv = Σ_g Pᵀ dY,

then the rotation is undone on dq and dk. For 16-bit models all of it runs in float32. There is
no attention dropout (Llama, MPT and BLOOM train without it).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from zerosim.backend import xp_of
from zerosim.nn.functional import (
    downcast,
    permute,
    reduce,
    reshape,
    scaled_masked_softmax_,
    softmax_backward_,
    upcast,
)
from zerosim.nn.init import RngLike, as_generator, check_last_axis, check_positive_int
from zerosim.nn.linear import Linear
from zerosim.nn.module import Module
from zerosim.nn.positions import RotaryEmbedding, alibi_bias, alibi_slopes

ATTENTION_POSITIONS = ("none", "rotary", "alibi")


class GroupedQueryAttention(Module):
    """Children ``q_proj`` (C → h·d), ``k_proj`` and ``v_proj`` (C → h_kv·d), ``o_proj``
    (h·d → C), HF Llama's names; and ``rotary`` (its tables) when ``positions="rotary"``.

    ``n_kv_head`` must divide ``n_head`` (None: = n_head). ``positions``: "none" (the model adds
    them to the embedding, or has none), "rotary" (tables for ``seq`` positions, base
    ``rotary_base``) or "alibi".
    """

    def __init__(
        self,
        n_embd: int,
        n_head: int,
        n_kv_head: int | None = None,
        bias: bool = False,
        positions: str = "none",
        seq: int | None = None,
        rotary_base: float = 10000.0,
        *,
        rng: RngLike = None,
        dtype: Any = "float32",
    ) -> None:
        super().__init__()
        self.n_embd = check_positive_int("n_embd", n_embd)
        self.n_head = check_positive_int("n_head", n_head)
        self.n_kv_head = check_positive_int("n_kv_head", n_head if n_kv_head is None else n_kv_head)
        if n_embd % n_head:
            raise ValueError(
                f"n_embd must be divisible by n_head; got n_embd={n_embd}, n_head={n_head}"
            )
        if n_head % self.n_kv_head:
            raise ValueError(
                f"n_kv_head must divide n_head; got n_kv_head={self.n_kv_head}, n_head={n_head}"
            )
        if positions not in ATTENTION_POSITIONS:
            raise ValueError(f"positions must be one of {ATTENTION_POSITIONS}; got {positions!r}")
        self.head_dim = n_embd // n_head
        rng = as_generator(rng)
        kv_width = self.n_kv_head * self.head_dim
        self.q_proj = Linear(n_embd, n_embd, bias, rng=rng, dtype=dtype)
        self.k_proj = Linear(n_embd, kv_width, bias, rng=rng, dtype=dtype)
        self.v_proj = Linear(n_embd, kv_width, bias, rng=rng, dtype=dtype)
        self.o_proj = Linear(n_embd, n_embd, bias, rng=rng, dtype=dtype)
        self.positions = positions
        if positions == "rotary":
            if seq is None:
                raise ValueError("positions='rotary' needs seq, the positions its tables cover")
            self.rotary = RotaryEmbedding(self.head_dim, seq, rotary_base)
        self.alibi_slopes = alibi_slopes(n_head) if positions == "alibi" else None

    def forward(self, x: Any) -> Any:
        check_last_axis("GroupedQueryAttention", x, self.n_embd, ndim=3)
        xp = xp_of(x)
        b, t, _ = x.shape
        kv, d = self.n_kv_head, self.head_dim
        g = self.n_head // kv
        q = permute(reshape(upcast(self.q_proj(x)), (b, t, kv, g, d)), (0, 2, 3, 1, 4))
        k = permute(reshape(upcast(self.k_proj(x)), (b, t, kv, 1, d)), (0, 2, 3, 1, 4))
        v = permute(reshape(upcast(self.v_proj(x)), (b, t, kv, 1, d)), (0, 2, 3, 1, 4))
        if self.positions == "rotary":
            q, k = self.rotary.rotate(q), self.rotary.rotate(k)
        scores = xp.matmul(q, k.mT)  # (B, h_kv, g, T, T)
        alibi = None
        if self.alibi_slopes is not None:
            alibi = reshape(alibi_bias(self.alibi_slopes, range(t), t, like=scores), (kv, g, t, t))
        mask = xp.triu(xp.full((t, t), -np.inf, dtype=scores.dtype), k=1)
        probs = scaled_masked_softmax_(scores, 1.0 / math.sqrt(d), mask, alibi)
        y = xp.matmul(probs, v)  # (B, h_kv, g, T, d)
        self.save_for_backward(q, k, v, probs, x.dtype)
        y = reshape(permute(y, (0, 3, 1, 2, 4)), (b, t, self.n_embd))
        return self.o_proj(downcast(y, x.dtype))

    def _backward(self, grad: Any) -> Any:
        q, k, v, probs, dtype = self.pop_saved()
        xp = xp_of(q)
        b, kv, g, t, d = q.shape
        dy = upcast(self.o_proj.backward(grad))
        dy = permute(reshape(dy, (b, t, kv, g, d)), (0, 2, 3, 1, 4))
        dv = reduce("sum", xp.matmul(probs.mT, dy), axis=2)  # Σ_g Pᵀ dY: (B, h_kv, T, d)
        dscores = softmax_backward_(probs, xp.matmul(dy, v.mT))  # dS
        dscores *= 1.0 / math.sqrt(d)
        dq = xp.matmul(dscores, k)
        dk = reduce("sum", xp.matmul(dscores.mT, q), axis=2)
        del dscores, probs
        if self.positions == "rotary":
            dq, dk = self.rotary.rotate_backward(dq), self.rotary.rotate_backward(dk)

        def rows(a: Any, heads: int) -> Any:  # (B, heads_kv, [g,] T, d) → (B, T, heads·d)
            a = permute(a, (0, 3, 1, 2, 4)) if a.ndim == 5 else permute(a, (0, 2, 1, 3))
            return downcast(reshape(a, (b, t, heads * d)), dtype)

        dx = upcast(self.v_proj.backward(rows(dv, kv)))  # torch's order: v, k, then q
        dx = dx + upcast(self.k_proj.backward(rows(dk, kv)))
        dx += upcast(self.q_proj.backward(rows(dq, kv * g)))
        return downcast(dx, dtype)

    def extra_repr(self) -> str:
        return (
            f"n_embd={self.n_embd}, n_head={self.n_head}, n_kv_head={self.n_kv_head}, "
            f"positions={self.positions!r}"
        )
