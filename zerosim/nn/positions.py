"""Positions inside attention: rotary embedding (Llama) and ALiBi's linear biases (MPT, BLOOM).

Neither has a parameter; both are fixed functions of the position, so a model that uses them has
no position table to train, shard or send.

**Rotary position embedding** (Su et al. 2021, "RoFormer", eq. 34), in Llama's half-split layout
(HF ``transformers``' ``rotate_half`` / ``apply_rotary_pos_emb``): a head vector x of even size d
is cut into halves x₁ = x[:d/2], x₂ = x[d/2:], and at position t pair i (x₁ᵢ, x₂ᵢ) is turned by
the angle t·θᵢ, θᵢ = base^(−2i/d):

    rope(x) = x·cos + rotate_half(x)·sin,   rotate_half(x) = [−x₂, x₁],
    cos = [cos tθ, cos tθ],  sin = [sin tθ, sin tθ]   (each angle twice: once per half)

A rotation is orthogonal, so backward turns the gradient back by −tθ:

    dx = g·cos + rotate_halfᵀ(g·sin),   rotate_halfᵀ(u) = [u₂, −u₁].

q·k after rotation depends on the two positions only through their difference. Llama 2 uses
base 10,000, Llama 3 500,000 (HF ``config.json``'s ``rope_theta``). The cos and sin tables of
every position up to the model's sequence are buffers (not parameters, not in the state dict, as
HF's ``inv_freq``), computed in float64 and stored in float32.

**ALiBi** (Press et al. 2022, "Train Short, Test Long", §3): no position enters the embedding;
head h adds −m_h·(i − j) to the score of query i on key j ≤ i. With n heads a power of two,
m_h = 2^(−8h/n), h = 1 … n. Otherwise (their code, and BLOOM's ``build_alibi_tensor``): the
slopes of the largest power of two p < n, then every other slope of 2p, 2^(−8h/2p) for odd h,
until there are n. MPT's ``gen_slopes`` (llm-foundry, ``alibi_bias_max`` = 8) reaches the same
list another way: the 2^⌈log₂n⌉ slopes, the odd-numbered ones first, then the even-numbered
ones, cut at n. BLOOM adds m_h·j and MPT −m_h·(T − 1 − j); both differ from −m_h·(i − j) by a
constant per query row, which the softmax removes.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from zerosim.backend import from_host, xp_of
from zerosim.nn.functional import compute_dtype
from zerosim.nn.init import check_positive_int
from zerosim.nn.module import Module


def rotate_half(x: Any) -> Any:
    """[−x₂, x₁] for the halves x₁, x₂ of the last axis (HF Llama's ``rotate_half``)."""
    xp = xp_of(x)
    half = x.shape[-1] // 2
    return xp.concat([-x[..., half:], x[..., :half]], axis=-1)


def rotate_half_transposed(u: Any) -> Any:
    """[u₂, −u₁]: the transpose (and inverse) of ``rotate_half``."""
    xp = xp_of(u)
    half = u.shape[-1] // 2
    return xp.concat([u[..., half:], -u[..., :half]], axis=-1)


def rotary_tables(seq: int, head_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), each (seq, head_dim) float32: angle t·base^(−2i/d) at row t, columns i and
    i + d/2 (module docstring)."""
    inv_freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.outer(np.arange(seq, dtype=np.float64), inv_freq)
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


class RotaryEmbedding(Module):
    """The rotary tables of one attention layer: buffers ``cos`` and ``sin`` of shape
    (seq, head_dim), not saved in the state dict. ``rotate(x)`` turns (…, T, head_dim) vectors
    to their positions 0 … T−1; ``rotate_backward(g)`` turns their gradient back. It is called
    by its attention layer, not as a module of its own (no saved state, no hooks)."""

    def __init__(self, head_dim: int, seq: int, base: float = 10000.0) -> None:
        super().__init__()
        self.head_dim = check_positive_int("head_dim", head_dim)
        self.seq = check_positive_int("seq", seq)
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim; got {head_dim}")
        if not base > 1:
            raise ValueError(f"rotary base must be a number > 1; got {base!r}")
        self.base = float(base)
        cos, sin = rotary_tables(self.seq, self.head_dim, self.base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, x: Any) -> tuple[Any, Any]:
        t = x.shape[-2]
        if t > self.seq:
            raise ValueError(f"rotary tables cover {self.seq} positions; got T={t}")
        dtype = compute_dtype(x.dtype)
        xp = xp_of(x)
        cos, sin = self.cos[:t], self.sin[:t]
        return xp.astype(cos, dtype, copy=False), xp.astype(sin, dtype, copy=False)

    def rotate(self, x: Any) -> Any:
        """x·cos + rotate_half(x)·sin over (…, T, head_dim), in x's compute dtype."""
        cos, sin = self._tables(x)
        return x * cos + rotate_half(x) * sin

    def rotate_backward(self, grad: Any) -> Any:
        """g·cos + rotate_halfᵀ(g·sin): the gradient of ``rotate``'s input."""
        cos, sin = self._tables(grad)
        return grad * cos + rotate_half_transposed(grad * sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, seq={self.seq}, base={self.base:g}"


def alibi_slopes(n_heads: int) -> np.ndarray:
    """m_1 … m_n of Press et al. (module docstring), float64."""
    n = check_positive_int("n_heads", n_heads)

    def power_of_two(k: int) -> list[float]:
        return [2.0 ** (-8.0 * h / k) for h in range(1, k + 1)]

    p = 2 ** math.floor(math.log2(n))
    slopes = power_of_two(p)
    if p < n:
        slopes += power_of_two(2 * p)[0::2][: n - p]
    return np.array(slopes)


def alibi_bias(slopes: np.ndarray, rows: range, cols: int, like: Any) -> Any:
    """(h, len(rows), cols) additive scores −m_h·(i − j) for query rows i, key columns j < cols
    (positive for j > i: the causal mask hides those), in ``like``'s dtype and place: computed
    in float64 where ``like`` lives (only the h slopes cross from the host; a dry run's
    shape-only arrays compute nothing)."""
    xp = xp_of(like)
    m = from_host(-np.asarray(slopes, dtype=np.float64), like=like)
    i = xp.arange(rows.start, rows.stop, dtype=xp.float64)[:, None]
    j = xp.arange(cols, dtype=xp.float64)[None, :]
    bias = m[:, None, None] * (i - j)[None, :, :]
    return xp.astype(bias, like.dtype)
