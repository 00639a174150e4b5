"""Reusable flat buffers for gradient buckets, so a training step allocates no bucket memory.

ZeRO-R's constant-size buffers (Rajbhandari et al. 2020, §6.2): DeepSpeed fuses gradients into
preallocated buckets of ``reduce_bucket_size`` elements and reuses them, instead of allocating a
fresh buffer for every bucket of every backward. ``BufferPool`` does the same. A bucket takes the
smallest free buffer that is large enough (a new one is allocated only when none is), and gives it
back once its reduce-scatter has completed. Every step asks for the same sizes in the same order,
so after the first step the pool has what it needs and later steps allocate nothing here.

What the pool may hold is bounded by the buckets open at once: a bucket being filled, plus at
most ``MAX_IN_FLIGHT`` launched reductions (the strategies complete the oldest one before
launching another, as DeepSpeed alternates between two buffers). ``nbytes`` is what the pool
holds; ``allocations`` counts the buffers it ever allocated, which the tests hold constant
after the first step.
"""

from __future__ import annotations

from typing import Any

import numpy as np

MAX_IN_FLIGHT = 2  # launched reductions in flight at once (double buffering)


class BufferPool:
    """Flat buffers, lent out as zero-filled views and given back when done.

    ``dtype`` is the default; ``take`` may ask for another (a buffer serves only its own dtype).
    """

    def __init__(self, xp: Any, dtype: Any) -> None:
        self.xp = xp
        self.dtype = np.dtype(dtype)
        self.free: dict[np.dtype, list[Any]] = {}
        self.lent: dict[int, Any] = {}  # id(view) -> the buffer it is a view of
        self.nbytes = 0
        self.allocations = 0

    def take(self, shape: int | tuple[int, ...], dtype: Any = None) -> Any:
        """A zero-filled array of this shape (and dtype), a view of a pooled buffer."""
        dtype = self.dtype if dtype is None else np.dtype(dtype)
        numel = 1
        for d in shape if isinstance(shape, tuple) else (shape,):
            numel *= d
        free = self.free.setdefault(dtype, [])
        fits = [i for i, b in enumerate(free) if b.size >= numel]
        if fits:  # the smallest free buffer that is large enough
            buf = free.pop(min(fits, key=lambda i: free[i].size))
        else:
            buf = self.xp.empty(max(numel, 1), dtype=dtype)
            self.nbytes += buf.nbytes
            self.allocations += 1
        view = buf[:numel].reshape(shape)
        view.fill(0)
        self.lent[id(view)] = buf
        return view

    def give(self, view: Any) -> None:
        """Return a view obtained from ``take``; its memory may be lent again."""
        buf = self.lent.pop(id(view))
        self.free[buf.dtype].append(buf)

    def lent_nbytes(self) -> int:
        return sum(b.nbytes for b in self.lent.values())
