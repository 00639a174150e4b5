"""Gradient buckets, shared by the stages that reduce during backward (0, 2 and 3, and the IPG
buckets of DeepSpeed's schedule).

A stage's backward path, hop by hop:

1. ``zerosim.nn.GradReadyTracker`` (module hooks) says when a parameter's gradient is final;
   the stage's callback moves it into its bucket.

2. ``BucketQueue`` collects ready parameters into buckets and *launches* a bucket (the stage's
   reduction: all-reduce, reduce-scatter, …) once all its parameters are ready, strictly in bucket
   order, so every rank issues the same collectives in the same order.

3. Bucket memory comes from a ``BufferPool``: ZeRO-R's constant-size buffers (Rajbhandari et al.
   2020, section 6.2). DeepSpeed fuses gradients into preallocated buckets of
   ``reduce_bucket_size`` elements and reuses them instead of allocating one per bucket per
   backward; the pool lends the smallest free buffer that is large enough and allocates only when
   none is, so after the first step a training step allocates no bucket memory.

4. ``PendingReductions`` completes launched non-blocking reductions oldest first: wait, add the
   reduced piece into this rank's gradient shard, give the buffers back. At most
   ``MAX_IN_FLIGHT`` are in flight (double buffering, as DeepSpeed alternates two buffers), so
   the pool holds at most a bucket being filled plus ``MAX_IN_FLIGHT`` launched ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from zerosim.backend import nbytes, np_dtype
from zerosim.nn import Parameter
from zerosim.zero.partition import Range

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
        dtype = self.dtype if dtype is None else np_dtype(dtype)
        numel = 1
        for d in shape if isinstance(shape, tuple) else (shape,):
            numel *= d
        free = self.free.setdefault(dtype, [])
        fits = [i for i, b in enumerate(free) if b.size >= numel]
        if fits:  # the smallest free buffer that is large enough
            buf = free.pop(min(fits, key=lambda i: free[i].size))
        else:
            buf = self.xp.empty(max(numel, 1), dtype=dtype)
            self.nbytes += nbytes(buf)
            self.allocations += 1
        view = self.xp.reshape(buf[:numel], shape if isinstance(shape, tuple) else (shape,))
        view[...] = 0
        self.lent[id(view)] = buf
        return view

    def give(self, view: Any) -> None:
        """Return a view obtained from ``take``; its memory may be lent again."""
        buf = self.lent.pop(id(view))
        self.free[np_dtype(buf.dtype)].append(buf)


class PendingReductions:
    """Launched bucket reductions, oldest first: (handle, out, dest, pooled views) each.

    ``complete`` waits for a reduction (``handle`` None: already done), adds ``out`` into
    ``dest`` (this rank's gradient shard, or an object that takes ``+=`` and places the pieces:
    stage 3's ``ShardPieces``, ``ipg.Delivery``; None when the bucket holds nothing for this rank)
    and gives the bucket's pooled ``views`` back through ``give``. Every stage's and
    ``IpgBuckets``' reductions in flight go through one of these.
    """

    def __init__(self, give: Callable[[Any], None]) -> None:
        self.items: list[tuple[Any, Any, Any, tuple]] = []
        self.give = give

    def add(self, handle: Any, out: Any, dest: Any, views: tuple) -> None:
        self.items.append((handle, out, dest, views))
        if handle is None:  # already reduced: add it in now and give its buffers back
            self.complete()

    def complete(self, leave: int = 0) -> None:
        """Complete reductions, oldest first, until ``leave`` remain in flight."""
        while len(self.items) > leave:
            handle, out, dest, views = self.items.pop(0)
            if handle is not None:
                handle.wait()
            if dest is not None:
                dest += out
            for view in views:
                self.give(view)


def bucket_members(named_params: list, slots: list, buckets: list[Range]) -> list[list[int]]:
    """For each bucket of a flat layout, the ids of the parameters overlapping it."""
    return [
        [
            id(p)
            for (_, p), slot in zip(named_params, slots, strict=True)
            if slot.range.intersect(b) is not None
        ]
        for b in buckets
    ]


class BucketQueue:
    """Buckets that become ready as their parameters do, launched strictly in bucket order.

    ``members[b]`` are the ids of bucket b's parameters; ``launch(b)`` is the stage's reduction.
    Every rank launches the same buckets in the same order, so their collectives match even when
    the parameters become ready in another order.
    """

    def __init__(self, members: list[list[int]], launch: Callable[[int], None]) -> None:
        self.members = members
        self.launch = launch
        self.waiting: list[set[int]] = []  # per bucket, the parameters not ready yet
        self.next = 0  # the first bucket not launched yet
        self.start()

    def start(self) -> None:
        """A new backward: every bucket waits for all its parameters again."""
        self.waiting = [set(m) for m in self.members]
        self.next = 0

    def ready(self, p: Parameter) -> None:
        for waiting in self.waiting[self.next :]:
            waiting.discard(id(p))
        while self.next < len(self.members) and not self.waiting[self.next]:
            self.next += 1
            self.launch(self.next - 1)

    def flush(self) -> None:
        """Launch every bucket not launched yet (parameters without gradients count as zero)."""
        while self.next < len(self.members):
            self.next += 1
            self.launch(self.next - 1)
