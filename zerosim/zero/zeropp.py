"""ZeRO++'s pure part: which switches turn it on, and the block quantizers its collectives use.

ZeRO++ (Wang et al. 2023, "ZeRO++: Extremely Efficient Collective Communication for Giant Model
Training", arXiv:2306.10209) cuts stage 3's cross-node traffic (3M per step: forward all-gather,
backward all-gather, gradient reduce-scatter) to 0.75M with three independent changes, run by
``zerosim/zero/stage3_zeropp.py``: qwZ (``zero_quantized_weights``) all-gathers the forward's
weights as int8 codes, hpZ (``zero_hpz_partition_size``) runs the backward all-gather inside
groups of ranks on secondary chunks, qgZ (``zero_quantized_gradients``) reduces gradients by a
two-hop all-to-all of int4 codes.

Symmetric block quantization (the paper's and DeepSpeed's scheme, written here afresh): for a
block x of at most B elements and q_max = 2^(bits−1) − 1 (127 for int8, 7 for int4),

    s = max|x| / q_max          q = clip(rint(x / s), −q_max, q_max)          x̂ = q · s

so |x − x̂| ≤ s / 2 = max|x| / (2 q_max) element by element (a block of zeros has s = 0 and comes
back exact). int4 codes are packed two per byte (low nibble first, two's complement). A block
holding inf or nan gets a nan scale, so an fp16 overflow still reaches the overflow check.
DeepSpeed runs each quantize and dequantize as one CUDA kernel (``csrc/quantization/``); a dry
run standing for PyTorch's kernels counts them so (``meta.fusion``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from zerosim.backend import array_module
from zerosim.meta.fusion import fused

WEIGHT_BITS = 8
GRADIENT_BITS = 4
WEIGHT_BLOCK_SIZE = 256  # elements per scale for qwZ
GRADIENT_BLOCK_SIZE = 256  # elements per scale for qgZ
SCALE_DTYPE = np.dtype(np.float32)


def zeropp_enabled(zero: Any) -> bool:
    """Whether a ``zero_optimization`` section turns any of qwZ, qgZ or hpZ on."""
    return bool(
        zero.zero_quantized_weights
        or zero.zero_quantized_gradients
        or zero.zero_hpz_partition_size > 1
    )


def q_max(bits: int) -> int:
    """Largest code of a symmetric ``bits``-bit quantizer: 2^(bits−1) − 1."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    return 2 ** (bits - 1) - 1


def pack_int4(q: Any) -> Any:
    """Pack int8 codes in [−8, 7] two per byte along the last axis (low nibble first)."""
    xp = array_module(q)
    if q.shape[-1] % 2:
        q = xp.concatenate([q, xp.zeros((*q.shape[:-1], 1), dtype=q.dtype)], axis=-1)
    nibbles = xp.astype(xp.astype(q, np.int16) & 0xF, np.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(packed: Any, width: int) -> Any:
    """The int8 codes ``pack_int4`` packed: ``width`` per row (the last axis)."""
    xp = array_module(packed)
    out = xp.empty((*packed.shape[:-1], 2 * packed.shape[-1]), dtype=np.int8)
    out[..., 0::2] = xp.astype(packed & 0xF, np.int8)
    out[..., 1::2] = xp.astype(packed >> 4, np.int8)
    out = xp.where(out >= 8, out - 16, out)  # the nibbles 8..15 are the codes −8..−1
    return out[..., :width]


def _blocks(x: Any, block_size: int) -> Any:
    """Rows of x (float32) zero-padded to whole blocks: shape (rows, blocks, block_size)."""
    xp = array_module(x)
    rows, width = x.shape
    nblocks = math.ceil(width / block_size)
    padded = xp.zeros((rows, nblocks * block_size), dtype=np.float32)
    padded[:, :width] = x if xp is np else xp.astype(x, np.float32)
    return xp.reshape(padded, (rows, nblocks, block_size))


@fused("quantize")
def quantize(x: Any, bits: int, block_size: int) -> tuple[Any, Any]:
    """Block-wise symmetric quantization of each row of ``x`` (1-D: one row).

    Returns ``(codes, scales)``: codes int8 of shape (rows, width) for 8 bits or uint8 of shape
    (rows, ceil(width / 2)) for 4 bits, and float32 scales of shape (rows, ceil(width / B)).
    """
    qm = q_max(bits)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int ≥ 1, got {block_size!r}")
    xp = array_module(x)
    rows = xp.reshape(x, (-1, x.shape[-1]) if x.ndim else (1, 1))
    width = rows.shape[1]
    blocks = _blocks(xp.astype(rows, np.float32), block_size)
    absmax = xp.max(xp.abs(blocks), axis=2)
    finite = xp.isfinite(absmax)
    # Python floats keep float32 arithmetic (NEP 50) and are what the standard takes
    scales = xp.astype(xp.where(finite, absmax / float(qm), float("nan")), SCALE_DTYPE)
    divisor = xp.where(finite & (scales > 0), scales, 1.0)[:, :, None]
    ratio = xp.where(finite[:, :, None], blocks / divisor, 0.0)
    rounded = xp.rint(ratio) if xp is np else xp.round(ratio)  # both: halves to even
    codes = xp.reshape(xp.astype(xp.clip(rounded, -qm, qm), np.int8), (rows.shape[0], -1))
    codes = codes[:, :width]
    return (pack_int4(codes) if bits == 4 else codes), scales


@fused("dequantize")
def dequantize(codes: Any, scales: Any, width: int, bits: int, block_size: int) -> Any:
    """float32 rows of ``width`` values from ``quantize``'s codes and scales."""
    q = unpack_int4(codes, width) if bits == 4 else codes[..., :width]
    xp = array_module(q)
    q = xp.reshape(q, (-1, width))
    blocks = _blocks(q, block_size) * xp.reshape(scales, (q.shape[0], -1, 1))
    return xp.reshape(blocks, (q.shape[0], -1))[:, :width]
