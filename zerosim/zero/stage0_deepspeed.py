"""Stage 0 under DeepSpeed 0.19.8's schedule: one all-reduce of the whole gradient after backward.

What it changes relative to the paper's stage 0 (``stage0.py``) and why: DeepSpeed's engine
installs no gradient hooks at stage 0. After the boundary backward it all-reduces the unpadded
gradients Ψ in definition order, in messages closed once they exceed 5e8 elements
(``engine.allreduce_gradients`` → ``buffered_allreduce_fallback`` → ``allreduce_no_retain``,
``MEMORY_OPT_ALLREDUCE_SIZE``, whatever ``reduce_bucket_size`` says): 2(N−1)/N · Ψ per step, one
message below 5e8 parameters, and nothing overlaps backward. With several parameter groups
(Muon's two) one message holds gradients of each: DeepSpeed flattens every gradient of the model
together. The flat buffers stay zerosim's (padded to N); DeepSpeed's stage 0 has none. So the
class is the paper's stage 0 given another reducer (``AllReduceAfterBackward``) and DeepSpeed's
boundary checks.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from zerosim.backend import assign, flat
from zerosim.zero.buckets import all_reduce_range
from zerosim.zero.partition import Range
from zerosim.zero.reducer import GradReducer
from zerosim.zero.schedule import deepspeed_stage0_checks
from zerosim.zero.stage0 import Stage0

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


class AllReduceAfterBackward(GradReducer):
    """DeepSpeed's stage-0 reducer: no hooks; after the boundary backward, the gradients
    all-reduced in DeepSpeed's messages (``allreduce_messages``)."""

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy)
        # per group, the messages over its unpadded gradients (one group: its own flat buffer's
        # runs; several: ``reduce_across_groups``)
        self.messages: list[list[Range]] = [
            allreduce_messages([s.range.size for s in g.slots]) for g in strategy.groups
        ]

    def after_backward(self, boundary: bool) -> None:
        if not boundary:
            return
        s = self.strategy
        if len(s.groups) > 1:
            self.reduce_across_groups()
        else:
            for gi, runs in enumerate(self.messages):
                for run in runs:
                    all_reduce_range(s, gi, run)
        s.reduction.pending.complete()

    def reduce_across_groups(self) -> None:
        """DeepSpeed flattens every gradient of the model into its messages
        (``buffered_allreduce_fallback``), so with several groups one message holds parameters
        of each: their gradients are copied into a pooled buffer, all-reduced, copied back."""
        s = self.strategy
        views = [g.param_view(i, g.flat_grad) for g in s.groups for i in range(len(g.slots))]
        at = 0
        for run in allreduce_messages([v.size for v in views]):
            buf = s.reduction.wire_buffer(run.size)
            members, offset = [], 0
            while at < len(views) and offset < run.size:
                members.append((views[at], offset))
                assign(buf[offset : offset + views[at].size], flat(views[at]))
                offset += views[at].size
                at += 1
            s.reduction.reduce(buf, partial(copy_back, members), self.all_reduce_now)

    def all_reduce_now(self, out: Any, bucket: Any) -> None:
        """A ``ReduceSequence.reduce`` collective: the bucket all-reduced in place, blocking."""
        self.strategy.comm.all_reduce(bucket)


def copy_back(members: list[tuple[Any, int]], buf: Any) -> None:
    """Where a message reduced across groups lands: each gradient's run of ``buf`` copied back
    into the gradient (``members``: (gradient view, its start in the message))."""
    for view, start in members:
        assign(flat(view), buf[start : start + view.size])


class Stage0DeepSpeed(Stage0):
    """Full replicas; DeepSpeed's gradient all-reduce after the boundary backward."""

    boundary_rule = staticmethod(deepspeed_stage0_checks)
    reducer_cls = AllReduceAfterBackward
