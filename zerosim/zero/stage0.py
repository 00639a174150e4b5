"""Stage 0: plain data parallelism (DeepSpeed's ZeRO disabled), for reference.

Every rank holds the full parameters, the full gradients and the full optimizer state, and steps
all of it. Gradients live in one flat buffer (module ``.grad`` are views of it), padded to a
multiple of N so that the norm can be summed over owned shards (DeepSpeed's stage 0 has no flat
buffer). They are all-reduced once per optimizer step, in the backward of the accumulation
boundary:

- ``deepspeed`` schedule: after backward, the unpadded gradients Ψ in definition order, in
  messages closed once they exceed 5e8 elements (DeepSpeed's ``allreduce_gradients`` with
  ``MEMORY_OPT_ALLREDUCE_SIZE``, whatever ``reduce_bucket_size`` says): 2(N−1)/N · Ψ per step,
  one message below 5e8 parameters.
- ``paper`` schedule: buckets of ``reduce_bucket_size`` elements, all-reduced as soon as every
  parameter in them has its final gradient, in bucket order (non-blocking when ``overlap_comm``,
  then waited on at the end of backward). Bucket boundaries fall on multiples of N, so each
  all-reduce sends exactly 2(N−1)/N of its bytes: 2(N−1)/N · Ψ_pad per step in all.
"""

from __future__ import annotations

from typing import Any

from zerosim.backend import assign, flat, nbytes, np_dtype
from zerosim.nn import GradReadyTracker, Parameter
from zerosim.zero.buckets import (
    MAX_IN_FLIGHT,
    BucketQueue,
    PendingReductions,
    bucket_members,
)
from zerosim.zero.partition import Range, reduction_buckets
from zerosim.zero.strategy import FlatGroup, Strategy

DEEPSPEED_ALLREDUCE_SIZE = 500_000_000  # DeepSpeed's MEMORY_OPT_ALLREDUCE_SIZE (elements)


def allreduce_messages(numels: list[int], limit: int = DEEPSPEED_ALLREDUCE_SIZE) -> list[Range]:
    """DeepSpeed's stage-0 messages over parameters laid end to end: runs of whole parameters,
    each closed once it holds more than ``limit`` elements (``allreduce_no_retain``)."""
    runs, start, at = [], 0, 0
    for numel in numels:
        at += numel
        if at - start > limit:
            runs.append(Range(start, at))
            start = at
    if at > start:
        runs.append(Range(start, at))
    return runs


class Stage0(Strategy):
    """Full replicas; gradient all-reduce in the boundary backward."""

    stage = 0
    alignment = 1  # zerosim's own padding (to N), in both schedules

    def setup_gradients(self) -> None:
        self.handles: list[Any] = []  # in-place all-reduces in flight (overlap_comm)
        self.cast = PendingReductions(self.give_buffer)  # reductions of cast copies
        self.reducing = False  # only the boundary backward reduces
        self.queues: list[BucketQueue] = []  # paper: per group, its buckets during backward
        self.messages: list[tuple[FlatGroup, list[Range]]] = []  # deepspeed: after backward
        self.owner_of: dict[int, int] = {}  # id(param) -> its group
        # deepspeed, several groups (Muon's two): one flat message over all of them
        self.across = self.schedule == "deepspeed" and len(self.groups) > 1
        for gi, g in enumerate(self.groups):
            g.flat_grad = g.xp.zeros_like(g.flat_param)
            for i, (_, p) in enumerate(g.named_params):
                p.grad = g.param_view(i, g.flat_grad)
                self.owner_of[id(p)] = gi
            if self.schedule == "deepspeed":
                if not self.across:
                    self.messages.append((g, allreduce_messages([s.range.size for s in g.slots])))
                continue
            buckets = reduction_buckets(g.layout, self.zero.reduce_bucket_size, self.comm.size)
            members = bucket_members(g.named_params, g.slots, buckets)
            self.queues.append(BucketQueue(members, self._launcher(g, buckets)))

    def attach(self, model: Any) -> None:
        if self.schedule == "paper":  # DeepSpeed's schedule reduces after backward: no hooks
            self.tracker = GradReadyTracker(model, self._ready)

    def _launcher(self, g: FlatGroup, buckets: list[Range]) -> Any:
        def launch(i: int) -> None:
            view = g.flat_grad[buckets[i].start : buckets[i].stop]
            wire = self.wire_dtype(view.dtype)
            if wire != np_dtype(view.dtype):  # communication_data_type: reduce a cast copy
                self.cast.complete(leave=MAX_IN_FLIGHT - 1)
                buf = self.take_buffer(view.size, wire)
                assign(buf, view)
                view[...] = 0
                self.before_reduction(buf)
                handle = self.comm.iall_reduce(buf) if self.zero.overlap_comm else None
                if handle is None:
                    self.comm.all_reduce(buf)
                self.cast.add(handle, buf, view, (buf,))
            elif self.zero.overlap_comm:
                self.before_reduction(view)
                self.handles.append(self.comm.iall_reduce(view))
            else:
                self.before_reduction(view)
                self.comm.all_reduce(view)

        return launch

    def _ready(self, p: Parameter) -> None:
        if self.reducing:
            self.queues[self.owner_of[id(p)]].ready(p)

    def before_backward(self, boundary: bool) -> None:
        self.reducing = boundary
        for q in self.queues:
            q.start()

    def after_backward(self, boundary: bool) -> None:
        if self.schedule == "paper":
            self.tracker.reset()
        if not boundary:
            return
        for q in self.queues:
            q.flush()
        for g, runs in self.messages:
            launch = self._launcher(g, runs)
            for i in range(len(runs)):
                launch(i)
        if self.across:
            self._reduce_across_groups()
        for h in self.handles:
            h.wait()
        self.handles.clear()
        self.cast.complete()
        self.reducing = False
        for g in self.groups:
            self.average(g.flat_grad)

    def _reduce_across_groups(self) -> None:
        """DeepSpeed flattens every gradient of the model into its messages
        (``buffered_allreduce_fallback``), so with several groups one message holds parameters
        of each: their gradients are copied into a pooled buffer, all-reduced, copied back."""
        views = [g.param_view(i, g.flat_grad) for g in self.groups for i in range(len(g.slots))]
        at = 0
        for run in allreduce_messages([v.size for v in views]):
            buf = self.take_buffer(run.size, self.wire_dtype(self.dtype))
            members, offset = [], 0
            while at < len(views) and offset < run.size:
                members.append((views[at], offset))
                assign(buf[offset : offset + views[at].size], flat(views[at]))
                offset += views[at].size
                at += 1
            self.before_reduction(buf)
            self.comm.all_reduce(buf)
            for view, start in members:
                assign(flat(view), buf[start : start + view.size])
            self.give_buffer(buf)

    def grad_view(self, group: FlatGroup, rng: Range) -> Any:
        return group.flat_grad[rng.start : rng.stop]

    def step_ranges(self, group: FlatGroup) -> list[Range]:
        return [Range(0, group.layout.padded_numel)]  # every rank steps everything

    def zero_grad(self) -> None:
        for g in self.groups:
            g.flat_grad[...] = 0

    def grad_bytes(self) -> int:
        return sum(nbytes(g.flat_grad) for g in self.groups)
