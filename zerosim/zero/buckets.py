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
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from zerosim.backend import assign, flat, nbytes, np_dtype, xp_of
from zerosim.nn import GradReadyTracker, Parameter
from zerosim.zero.partition import Range, piece_counts, reduction_buckets
from zerosim.zero.reducer import GradReducer

MAX_IN_FLIGHT = 2  # launched reductions in flight at once (double buffering)


class BufferPool:
    """Flat buffers, lent out as zero-filled views and given back when done.

    ``dtype`` is the default; ``take`` may ask for another (a buffer serves only its own dtype).
    """

    def __init__(self, xp: Any, dtype: Any) -> None:
        self.xp: Any = xp  # the array module buffers are made with
        self.dtype: np.dtype = np.dtype(dtype)  # the dtype a take() without one gets
        self.free: dict[np.dtype, list[Any]] = {}  # per dtype, the buffers not lent out
        self.lent: dict[int, Any] = {}  # id(view) -> the buffer it is a view of
        self.nbytes: int = 0  # bytes of every buffer made, lent or free
        self.allocations: int = 0  # buffers made (a pool that works makes few)

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
    """Launched bucket reductions, oldest first: (handle, out, land, pooled views) each.

    ``complete`` waits for a reduction (``handle`` None: already done), calls ``land(out)`` (where
    the stage says the result goes: ``Strategy.land`` of a piece, or an object that places
    several: ``stage3_deepspeed.ShardPieces``, ``ipg.Delivery``; None when the bucket holds
    nothing for this rank or was reduced where it lies) and gives the bucket's pooled ``views``
    back through ``give``. Every stage's and ``IpgBuckets``' reductions in flight go through one
    of these.
    """

    def __init__(self, give: Callable[[Any], None]) -> None:
        self.items: list[tuple[Any, Any, Any, tuple]] = []  # oldest first
        self.give: Callable[[Any], None] = give  # gives a pooled view back (``BufferPool.give``)

    def add(self, handle: Any, out: Any, land: Callable[[Any], None] | None, views: tuple) -> None:
        self.items.append((handle, out, land, views))
        if handle is None:  # already reduced: land it now and give its buffers back
            self.complete()

    def complete(self, leave: int = 0) -> None:
        """Complete reductions, oldest first, until ``leave`` remain in flight."""
        while len(self.items) > leave:
            handle, out, land, views = self.items.pop(0)
            if handle is not None:
                handle.wait()
            if land is not None:
                land(out)
            for view in views:
                self.give(view)


class ReduceSequence:
    """The reduce sequence every reducer runs, written once: a bucket in the dtype gradients
    travel in (``wire_buffer``, from the pool), scaled (``strategy.before_reduction``), its
    collective started or run (``strategy.start_or_run``), then queued in ``pending``, which lands
    the result where the stage says (``land``) and gives the buffers back."""

    def __init__(self, strategy: Any, pool: BufferPool) -> None:
        self.strategy: Any = strategy  # its scaling, its wire dtype, overlap or block, its comm
        self.pool: BufferPool = pool  # bucket buffers, lent and given back
        # started reductions, oldest first
        self.pending: PendingReductions = PendingReductions(pool.give)

    def take(self, shape: int | tuple[int, ...], dtype: Any = None) -> Any:
        """A zero-filled bucket buffer from the pool; its bytes are the pool's
        (``bucket_buffers``), not transient."""
        return self.pool.take(shape, dtype)

    def wire_buffer(self, shape: int | tuple[int, ...]) -> Any:
        """A zero-filled pooled bucket buffer in the dtype gradients travel in (``wire_dtype``)."""
        s = self.strategy
        return self.pool.take(shape, s.wire_dtype(s.dtype))

    def reduce(
        self,
        bucket: Any,
        land: Callable[[Any], None] | None,
        collective: Callable[[Any, Any], Any],
        out_numel: int | None = None,
        pooled: tuple | None = None,
    ) -> None:
        """Reduce a filled bucket: scale it (``before_reduction``), start
        ``collective(out, bucket)`` (a handle, or None once done) and queue it in ``pending``,
        which calls ``land(out)`` once it completes (where the stage says the result lands;
        None: nowhere on this rank) and gives the pooled buffers back: the bucket (a
        ``wire_buffer``), or the views ``pooled`` names (``()``: gradients reduced where they
        lie). ``out``: the bucket (in place) or, with ``out_numel``, a pooled buffer of that
        many elements."""
        self.strategy.before_reduction(bucket)
        out = bucket if out_numel is None else self.pool.take(out_numel, bucket.dtype)
        handle = collective(out, bucket)
        views = (bucket,) if pooled is None else pooled
        self.pending.add(handle, out, land, views if out is bucket else (*views, out))

    def all_reduce(self, out: Any, bucket: Any) -> Any:
        """A ``reduce`` collective: the bucket all-reduced in place (``out`` is it)."""
        s = self.strategy
        return s.start_or_run(s.comm.iall_reduce, s.comm.all_reduce, bucket)


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
        self.members: list[list[int]] = members  # per bucket, the ids of its parameters
        self.launch: Callable[[int], None] = launch  # the stage's reduction of bucket b
        self.waiting: list[set[int]] = []  # per bucket, the parameters not ready yet
        self.next: int = 0  # the first bucket not launched yet
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


def all_reduce_range(strategy: Any, gi: int, rng: Range) -> None:
    """All-reduce flat gradient range ``rng`` of group ``gi`` in place (a cast copy of it under
    ``communication_data_type``, landed back with ``strategy.land``); the strategy's ``pending``
    completes it."""
    s = strategy
    view = s.groups[gi].flat_grad[rng.start : rng.stop]
    if s.wire_dtype(view.dtype) == np_dtype(view.dtype):  # reduced where it lies
        s.reduction.reduce(view, None, s.reduction.all_reduce, pooled=())
        return
    s.reduction.pending.complete(leave=MAX_IN_FLIGHT - 1)  # free a buffer
    buf = s.reduction.wire_buffer(view.size)
    assign(buf, view)
    view[...] = 0  # the reduced copy is added back into it
    s.reduction.reduce(buf, partial(s.land, gi, rng.start), s.reduction.all_reduce)


class BucketAllReduce(GradReducer):
    """The paper's stage 0: fixed buckets of the gradient buffer (``reduce_bucket_size``
    elements, cut at multiples of N), each all-reduced in place as soon as the boundary backward
    has finished its parameters, in bucket order."""

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy)
        self.reducing: bool = False  # only the boundary backward reduces
        # per group, its buckets, launched in order as backward finishes their parameters
        self.queues: list[BucketQueue] = [
            self.bucket_queue(gi, g) for gi, g in enumerate(strategy.groups)
        ]
        self.tracker: GradReadyTracker | None = None  # attach(): says when a gradient is final

    def bucket_queue(self, gi: int, g: Any) -> BucketQueue:
        """Group ``g``'s buckets (``reduce_bucket_size`` elements, cut at multiples of N)."""
        s = self.strategy
        buckets = reduction_buckets(g.layout, s.zero.reduce_bucket_size, s.comm.size)
        members = bucket_members(g.named_params, g.slots, buckets)
        return BucketQueue(members, lambda b: all_reduce_range(s, gi, buckets[b]))

    def attach(self, model: Any) -> None:
        self.tracker = GradReadyTracker(model, self._ready)

    def _ready(self, p: Parameter) -> None:
        if self.reducing:
            self.queues[self.strategy.where[id(p)][0]].ready(p)

    def before_backward(self, boundary: bool) -> None:
        self.reducing = boundary
        for q in self.queues:
            q.start()

    def after_backward(self, boundary: bool) -> None:
        self.tracker.reset()
        if boundary:
            for q in self.queues:
                q.flush()
            self.reducing = False
            self.strategy.reduction.pending.complete()


@dataclass
class BucketPlan:
    """The reduction buckets of one group's flat buffer (cut at parameter starts)."""

    ranges: list[Range]  # bucket -> its range of the flat buffer
    counts: list[list[int]]  # bucket -> each rank's piece of it
    of_param: list[int]  # parameter index -> its bucket
    params: list[list[int]]  # bucket -> its parameter indices
    filling: dict[int, Any] = field(default_factory=dict)  # bucket -> its buffer while filled

    @classmethod
    def plan(cls, g: Any, bucket_size: int) -> BucketPlan:
        ranges = reduction_buckets(g.layout, bucket_size)
        of_param = [
            next(b for b, r in enumerate(ranges) if r.start <= slot.range.start < r.stop)
            for slot in g.slots
        ]
        params = [[i for i, b in enumerate(of_param) if b == k] for k in range(len(ranges))]
        return cls(ranges, [piece_counts(b, g.layout) for b in ranges], of_param, params)


class BucketReduceScatter(GradReducer):
    """The paper's stage 2: fixed buckets (cut at the first parameter start that gives a bucket
    ``reduce_bucket_size`` elements or more), each filled as backward finishes its parameters
    (whose module gradients are then dropped) and reduce-scattered in bucket order, in uneven
    pieces: this rank's piece lands through ``strategy.land``."""

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy)
        size = strategy.zero.reduce_bucket_size
        # per group, its fixed buckets and each bucket's pieces
        self.plans: list[BucketPlan] = [BucketPlan.plan(g, size) for g in strategy.groups]
        # per group, its buckets, launched in order as backward finishes their parameters
        self.queues: list[BucketQueue] = [
            BucketQueue(
                bucket_members(g.named_params, g.slots, plan.ranges),
                partial(self._launch_bucket, gi),
            )
            for gi, (g, plan) in enumerate(zip(strategy.groups, self.plans, strict=True))
        ]
        self.tracker: GradReadyTracker | None = None  # attach(): says when a gradient is final

    def bucket_pieces(self) -> list[list[int]]:
        return [counts for plan in self.plans for counts in plan.counts]

    def attach(self, model: Any) -> None:
        self.tracker = GradReadyTracker(model, self._ready)

    def _ready(self, p: Parameter) -> None:
        self._move_grad(p)
        self.queues[self.strategy.where[id(p)][0]].ready(p)

    def _buffer(self, plan: BucketPlan, b: int) -> Any:
        if b not in plan.filling:
            plan.filling[b] = self.strategy.reduction.wire_buffer(plan.ranges[b].size)
        return plan.filling[b]

    def _move_grad(self, p: Parameter) -> None:
        """Copy a finished module gradient into its bucket buffer and drop it."""
        if p.grad is None:
            return
        gi, i = self.strategy.where[id(p)]
        plan = self.plans[gi]
        b = plan.of_param[i]
        slot = self.strategy.groups[gi].slots[i].range
        start = slot.start - plan.ranges[b].start
        assign(self._buffer(plan, b)[start : start + slot.size], flat(p.grad))
        p.grad = None

    def _launch_bucket(self, gi: int, b: int) -> None:
        """Reduce-scatter bucket ``b`` of group ``gi``: this rank's piece lands in the stage."""
        s, g, plan = self.strategy, self.strategy.groups[gi], self.plans[gi]
        bucket, counts = plan.ranges[b], plan.counts[b]
        for i in plan.params[b]:  # parameters whose uses never completed
            self._move_grad(g.named_params[i][1])
        buf = self._buffer(plan, b)
        del plan.filling[b]  # given back to the pool once the reduction completes
        s.reduction.pending.complete(leave=MAX_IN_FLIGHT - 1)  # free a buffer
        (own,) = g.owned
        part = bucket.intersect(own)  # this rank's piece of the bucket
        land = None if part is None else partial(s.land, gi, part.start)
        s.reduction.reduce(buf, land, partial(self.reduce_scatter, counts), counts[s.comm.rank])

    def reduce_scatter(self, counts: list[int], out: Any, buf: Any) -> Any:
        """A reduce-sequence collective: the bucket reduce-scattered in pieces of ``counts``
        elements, this rank's into ``out``."""
        comm = self.strategy.comm
        return self.strategy.start_or_run(
            comm.ireduce_scatter_v, comm.reduce_scatter_v, out, buf, counts
        )

    def before_backward(self, boundary: bool) -> None:
        for q in self.queues:
            q.start()

    def after_backward(self, boundary: bool) -> None:
        self.tracker.reset()
        for q in self.queues:
            q.flush()
        self.strategy.reduction.pending.complete()


def static_buckets(chunks: list[int], world_size: int, bucket_size: int) -> list[list[int]]:
    """The paper's gradient buckets of one group: consecutive parameter indices, taken from the
    last parameter back, each bucket closed once it holds ≥ ``bucket_size`` padded elements
    (Σ chunk_i · N). Returns the buckets in launch order, each in ascending index order."""
    buckets, current, size = [], [], 0
    for i in reversed(range(len(chunks))):
        current.insert(0, i)
        size += chunks[i] * world_size
        if size >= bucket_size:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def pack_rank_major(block: Any, grad: Any) -> None:
    """Write a flat gradient into an (N, chunk) block, chunk r in row r: what rank r will own.

    The last chunk is partly padding (and a small parameter may leave whole rows of it), which
    stays as it was: zero in a freshly taken bucket buffer."""
    chunk = block.shape[1]
    rows, rest = divmod(grad.size, chunk) if chunk else (0, 0)
    assign(block[:rows, :], xp_of(block).reshape(grad[: rows * chunk], (rows, chunk)))
    if rest:
        assign(block[rows, :rest], grad[rows * chunk :])


def pack_chunks(
    strategy: Any, params: list[Any], grads: list[Any]
) -> tuple[Any, list[tuple[int, int, int, int]], int]:
    """Stage 3's input to one reduce-scatter of several parameters' gradients: a pooled
    (N, width) buffer holding each gradient padded to N · chunk_i, rank-major (rank r's chunks
    end to end in row r), with the slots (group, chunk offset in the shard, chunk, column in the
    row) that say where each piece of the reduced row lands, and the width."""
    s = strategy
    slots, width = [], 0
    for p in params:
        gi, i = s.where[id(p)]
        part = s.groups[gi].partition
        slots.append((gi, part.offsets[i], part.chunks[i], width))
        width += part.chunks[i]
    s.reduction.pending.complete(leave=MAX_IN_FLIGHT - 1)  # free a buffer
    buf = s.reduction.wire_buffer((s.comm.size, width))
    for grad, (_, _, chunk, column) in zip(grads, slots, strict=True):
        pack_rank_major(buf[:, column : column + chunk], flat(grad))
    return buf, slots, width


def reduce_rows(strategy: Any, out: Any, buf: Any) -> Any:
    """A ``ReduceSequence.reduce`` collective: a rank-major (N, width) bucket summed over ranks into
    ``out`` (this rank's row); the reduce-scatter's handle, or None once it is done."""
    comm = strategy.comm
    return strategy.start_or_run(comm.ireduce_scatter, comm.reduce_scatter, out, flat(buf))


class RankMajorGroup:
    """One group's gradient buckets under the paper's stage 3: fixed at start-up, filled as the
    gradients arrive, launched by ``queue`` strictly in bucket order."""

    def __init__(self, g: Any, world_size: int, bucket_size: int, launch: Callable) -> None:
        # indices
        self.members: list[list[int]] = static_buckets(g.partition.chunks, world_size, bucket_size)
        # parameter index -> its bucket
        self.bucket_of: dict[int, int] = {
            i: k for k, members in enumerate(self.members) for i in members
        }
        self.buffers: dict[int, Any] = {}  # bucket -> its (N, width) buffer while being filled
        ids = [[id(g.named_params[i][1]) for i in members] for members in self.members]
        self.queue: BucketQueue = BucketQueue(ids, launch)  # launches the buckets in order


class RankMajorReduceScatter(GradReducer):
    """The paper's stage-3 reducer: as soon as a gradient is final it is packed into its fixed
    bucket rank-major (its module copy dropped), so that one even reduce-scatter of a full
    bucket hands each rank the sum of its own chunks, which land through ``strategy.land``."""

    collective = staticmethod(reduce_rows)  # a bucket's collective (ZeRO++'s qgZ swaps it)

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy)
        s = strategy
        self.buckets: list[RankMajorGroup] = [  # per group, its static gradient buckets
            RankMajorGroup(
                g, s.comm.size, s.zero.reduce_bucket_size, partial(self._launch_bucket, gi)
            )
            for gi, g in enumerate(s.groups)
        ]
        self.tracker: GradReadyTracker | None = None  # attach(): says when a gradient is final

    def attach(self, model: Any) -> None:
        self.tracker = GradReadyTracker(model, self._ready)

    def _ready(self, p: Parameter) -> None:
        gi, i = self.strategy.where[id(p)]
        self._pack(gi, i, p)
        self.buckets[gi].queue.ready(p)

    def _pack(self, gi: int, i: int, p: Parameter) -> None:
        """Copy p's gradient into its bucket's buffer, rank-major, and drop it."""
        if p.grad is None:
            return
        part, buckets = self.strategy.groups[gi].partition, self.buckets[gi]
        b = buckets.bucket_of[i]
        column = part.offsets[i] - part.offsets[buckets.members[b][0]]
        block = self._bucket_buffer(gi, b)[:, column : column + part.chunks[i]]
        pack_rank_major(block, flat(p.grad))
        p.grad = None

    def _bucket_buffer(self, gi: int, b: int) -> Any:
        """Bucket b's (N, width) buffer, rank-major: taken from the pool when first needed."""
        s = self.strategy
        part, buckets = s.groups[gi].partition, self.buckets[gi]
        if b not in buckets.buffers:
            width = sum(part.chunks[j] for j in buckets.members[b])
            buckets.buffers[b] = s.reduction.wire_buffer((s.comm.size, width))
        return buckets.buffers[b]

    def _launch_bucket(self, gi: int, b: int) -> None:
        """Reduce-scatter bucket b of group gi; its reduced row lands in the gradient shard."""
        s = self.strategy
        g, members = s.groups[gi], self.buckets[gi].members[b]
        for j in members:  # gradients of parameters whose uses never completed
            self._pack(gi, j, g.named_params[j][1])
        width = sum(g.partition.chunks[j] for j in members)
        buf = self._bucket_buffer(gi, b)
        del self.buckets[gi].buffers[b]
        s.reduction.pending.complete(leave=MAX_IN_FLIGHT - 1)  # free a buffer
        start = g.partition.offsets[members[0]]  # this rank's row: shard positions start…
        s.reduction.reduce(buf, partial(s.land, gi, start), partial(self.collective, s), width)

    def before_backward(self, boundary: bool) -> None:
        for buckets in self.buckets:
            buckets.queue.start()

    def after_backward(self, boundary: bool) -> None:
        """End of backward: launch every bucket not launched yet and wait for them all."""
        self.tracker.reset()
        for buckets in self.buckets:
            buckets.queue.flush()
        self.strategy.reduction.pending.complete()
