"""Stage 2 (P_os+g): optimizer state and gradients are partitioned.

Each rank keeps only the gradient of its owned shard (``grad_shard``, P = Ψ_pad / N elements,
accumulated across micro-steps). During every backward, as soon as all parameters of a bucket
(``reduce_bucket_size`` elements, last parameters first) have their final gradients, they are
copied into a bucket buffer, the module gradients are dropped, and the bucket is reduce-scattered
in bucket order: each rank receives the sum over ranks of the part of the bucket it owns.
Ownership is DeepSpeed's contiguous [r·P, (r+1)·P), so a bucket's parts are uneven; this is a
true reduce-scatter with uneven pieces (MPI_Reduce_scatter). Over a step's buckets rank r sends
Σ_b (|b| − c_{b,r}) = Ψ_pad − P = (N−1)/N · Ψ_pad, the same as one even reduce-scatter.

That is the ``paper`` schedule. With accumulation k every micro-step reduces, so a step sends
k·(N−1)/N · Ψ_pad in reduce-scatters plus (N−1)/N · Ψ_pad in the all-gather: (k+1)(N−1)/N · Ψ_pad.

The ``deepspeed`` schedule (the default) reduces as DeepSpeed 0.19.8 does (``zerosim/zero/ipg.py``):
gradients join IPG buckets in the order backward finishes them, and with DeepSpeed's default
switches each bucket is *all-reduced*, after which every rank keeps the part it owns
(``use_multi_rank_bucket_allreduce: false`` reduces each owner's part to it instead). The flat
buffer pads to a multiple of 2·N. A step then sends k·2(N−1)/N · Ψ + (N−1)/N · Ψ_pad: about
3(N−1)/N · Ψ at k = 1, 1.5× the paper's.
"""

from __future__ import annotations

from typing import Any

from zerosim.backend import assign, flat, nbytes
from zerosim.nn import GradReadyTracker, Parameter
from zerosim.zero.buckets import MAX_IN_FLIGHT, BucketQueue, bucket_members
from zerosim.zero.ipg import IpgBuckets
from zerosim.zero.partition import Range, piece_counts, reduction_buckets
from zerosim.zero.strategy import FlatGroup, Strategy


class Stage2(Strategy):
    """Partitioned gradients: bucketed reduction during every backward."""

    stage = 2
    partitions_optimizer_states = True
    reported_norm = "before_scale_update"  # DeepSpeed's stage_1_and_2.py

    def setup_gradients(self) -> None:
        self.queues: list[BucketQueue] = []  # paper: per group, its buckets in order
        self.ipg: IpgBuckets | None = None  # deepspeed: DeepSpeed's IPG bucket
        self.added: set[int] = set()  # deepspeed: id(param) of gradients added this backward
        self.where: dict[int, tuple[int, int]] = {}  # id(param) -> (group, index)
        for gi, g in enumerate(self.groups):
            (own,) = g.owned
            g.grad_shard = g.xp.zeros(own.size, dtype=self.dtype)
            for i, (_, p) in enumerate(g.named_params):
                p.grad = None
                self.where[id(p)] = (gi, i)
        if self.schedule == "deepspeed":
            starts = [[slot.range.start for slot in g.slots] for g in self.groups]
            sizes = [g.layout.shard_numel for g in self.groups]
            self.ipg = IpgBuckets(self, starts, sizes, self._deliver)
            return
        for g in self.groups:
            g.buckets = reduction_buckets(g.layout, self.zero.reduce_bucket_size)
            g.bucket_counts = [piece_counts(b, g.layout) for b in g.buckets]
            g.bucket_of = [  # parameter index -> its bucket (buckets cut at parameter starts)
                next(b for b, r in enumerate(g.buckets) if r.start <= slot.range.start < r.stop)
                for slot in g.slots
            ]
            g.bucket_params = [
                [i for i, b in enumerate(g.bucket_of) if b == k] for k in range(len(g.buckets))
            ]
            members = bucket_members(g.named_params, g.slots, g.buckets)
            self.queues.append(BucketQueue(members, self._launcher(g)))

    def attach(self, model: Any) -> None:
        self.tracker = GradReadyTracker(model, self._ready)

    def _buffer(self, g: FlatGroup, b: int) -> Any:
        if b not in g.buffers:
            g.buffers[b] = self.take_buffer(g.buckets[b].size, self.wire_dtype(self.dtype))
        return g.buffers[b]

    def _move_grad(self, p: Parameter) -> None:
        """Copy a finished module gradient into its bucket buffer and drop it."""
        if p.grad is None:
            return
        gi, i = self.where[id(p)]
        g = self.groups[gi]
        b = g.bucket_of[i]
        slot = g.slots[i].range
        start = slot.start - g.buckets[b].start
        assign(self._buffer(g, b)[start : start + slot.size], flat(p.grad))
        p.grad = None

    def _ready(self, p: Parameter) -> None:
        if self.ipg is not None:
            self._add(p)
            return
        self._move_grad(p)
        self.queues[self.where[id(p)][0]].ready(p)

    def _add(self, p: Parameter) -> None:
        """DeepSpeed's schedule: the gradient joins the IPG bucket; the module's copy goes."""
        if p.grad is None:
            return
        gi, i = self.where[id(p)]
        self.ipg.add(gi, i, p.grad)
        self.added.add(id(p))
        p.grad = None

    def _deliver(self, gi: int, flat_start: int, values: Any) -> None:
        """A reduced piece this rank owns: add it into the gradient shard."""
        g = self.groups[gi]
        (own,) = g.owned
        g.grad_shard[flat_start - own.start : flat_start - own.start + values.size] += values

    def _launcher(self, g: FlatGroup) -> Any:
        def launch(b: int) -> None:
            bucket, counts = g.buckets[b], g.bucket_counts[b]
            (own,) = g.owned
            for i in g.bucket_params[b]:  # parameters whose uses never completed
                self._move_grad(g.named_params[i][1])
            buf = self._buffer(g, b)
            self.pending.complete(leave=MAX_IN_FLIGHT - 1)  # free a buffer
            self.before_reduction(buf)
            out = self.take_buffer(counts[self.comm.rank], buf.dtype)
            part = bucket.intersect(own)
            dest = (
                None
                if part is None
                else g.grad_shard[part.start - own.start : part.stop - own.start]
            )
            if self.zero.overlap_comm:
                handle = self.comm.ireduce_scatter_v(out, buf, counts)
            else:
                self.comm.reduce_scatter_v(out, buf, counts)
                handle = None
            del g.buffers[b]  # given back to the pool once the reduction completes
            self.pending.add(handle, out, dest, (buf, out))

        return launch

    def before_backward(self, boundary: bool) -> None:
        for q in self.queues:
            q.start()

    def after_backward(self, boundary: bool) -> None:
        self.tracker.reset()
        if self.ipg is not None:
            for g in self.groups:  # parameters whose uses never completed, last first
                for _, p in reversed(g.named_params):
                    if id(p) not in self.added:
                        self._add(p)
            self.added.clear()
            self.ipg.finish()
        for q in self.queues:
            q.flush()
        self.pending.complete()
        if boundary:
            for g in self.groups:
                self.average(g.grad_shard)

    def grad_view(self, group: FlatGroup, rng: Range) -> Any:
        (own,) = group.owned
        return group.grad_shard[rng.start - own.start : rng.stop - own.start]

    def gather(self) -> None:
        for g in self.groups:
            (own,) = g.owned
            self.comm.all_gather(g.flat_param, g.flat_param[own.start : own.stop])

    def zero_grad(self) -> None:
        for g in self.groups:
            g.grad_shard[...] = 0
            for _, p in g.named_params:
                p.grad = None

    def grad_bytes(self) -> int:
        return sum(nbytes(g.grad_shard) for g in self.groups)
