"""Stage 0: plain data parallelism (ZeRO disabled), for reference.

Every rank holds the full parameters, the full gradients and the full optimizer state, and steps
all of it. Gradients live in one flat buffer (module ``.grad`` are views of it), padded to a
multiple of N so that the norm can be summed over owned shards. They are all-reduced once per
optimizer step, in the backward of the accumulation boundary: in buckets of
``reduce_bucket_size`` elements, each all-reduced as soon as every parameter in it has its final
gradient, in bucket order (non-blocking with ``overlap_comm``, then waited on at the end of
backward). Bucket boundaries fall on multiples of N, so each all-reduce sends exactly 2(N−1)/N of
its bytes: 2(N−1)/N · Ψ_pad per step in all.

DeepSpeed 0.19.8 all-reduces after backward instead, in messages of its own size:
``stage0_deepspeed.py``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from zerosim.backend import assign, nbytes, np_dtype
from zerosim.nn import GradReadyTracker, Parameter
from zerosim.zero.buckets import MAX_IN_FLIGHT, BucketQueue, bucket_members
from zerosim.zero.partition import Range, reduction_buckets
from zerosim.zero.strategy import FlatGroup, FullGradGroup, Strategy


class Stage0(Strategy):
    """Full replicas; gradient all-reduce in the boundary backward."""

    stage = 0
    partitions_optimizer_states = False  # every rank steps the whole buffer (sharded_step.py)
    reported_norm = "none_in_one_precision"  # the client's torch optimizer keeps none
    group_cls = FullGradGroup

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reducing = False  # only the boundary backward reduces
        # per group, its buckets, launched in order as backward finishes their parameters
        self.queues: list[BucketQueue] = [self.bucket_queue(g) for g in self.groups]
        self.tracker: GradReadyTracker | None = None  # attach(): says when a gradient is final

    def setup_gradients(self) -> None:
        for g in self.groups:
            g.flat_grad = g.xp.zeros_like(g.flat_param)
            for i, (_, p) in enumerate(g.named_params):
                p.grad = g.param_view(i, g.flat_grad)

    def bucket_queue(self, g: FullGradGroup) -> BucketQueue:
        """Group ``g``'s buckets (``reduce_bucket_size`` elements, cut at multiples of N)."""
        buckets = reduction_buckets(g.layout, self.zero.reduce_bucket_size, self.comm.size)
        members = bucket_members(g.named_params, g.slots, buckets)
        return BucketQueue(members, partial(self._launch_bucket, g, buckets))

    def attach(self, model: Any) -> None:
        self.tracker = GradReadyTracker(model, self._ready)

    def _ready(self, p: Parameter) -> None:
        if self.reducing:
            self.queues[self.where[id(p)][0]].ready(p)

    def _launch_bucket(self, g: FullGradGroup, buckets: list[Range], b: int) -> None:
        self.reduce_range(g, buckets[b])

    def reduce_range(self, g: FullGradGroup, rng: Range) -> None:
        """All-reduce flat gradient range ``rng`` in place (a cast copy of it under
        ``communication_data_type``); ``finish_reduction`` waits for it."""
        view = g.flat_grad[rng.start : rng.stop]
        if self.wire_dtype(view.dtype) == np_dtype(view.dtype):  # reduced where it lies
            self.before_reduction(view)
            self.pending.add(self.all_reduce(view, view), view, None, ())
            return
        self.pending.complete(leave=MAX_IN_FLIGHT - 1)  # free a buffer
        buf = self.wire_buffer(view.size)
        assign(buf, view)
        view[...] = 0  # the reduced copy is added back into it
        self.reduce_bucket(buf, view, self.all_reduce)

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
            self.finish_reduction()

    def finish_reduction(self) -> None:
        """Wait for every launched all-reduce; the sums over ranks become means."""
        self.pending.complete()
        for g in self.groups:
            self.average(g.flat_grad)

    def grad_view(self, group: FlatGroup, rng: Range) -> Any:
        return group.flat_grad[rng.start : rng.stop]

    def zero_grad(self) -> None:
        for g in self.groups:
            g.flat_grad[...] = 0

    def grad_bytes(self) -> int:
        return sum(nbytes(g.flat_grad) for g in self.groups)
