"""Stage 1 under DeepSpeed 0.19.8's schedule: IPG buckets at the boundary, all-reduced.

What it changes relative to the paper's stage 1 (``stage1.py``) and why: DeepSpeed's stage 1
(``deepspeed/runtime/zero/stage_1_and_2.py``) does not reduce-scatter the gradient buffer. At the
boundary the gradients join IPG buckets (``reduce_independent_p_g_buckets_and_remove_grads``) in
definition order after backward (``reduce_gradients``), or in the order backward finishes them
with ``overlap_comm`` (its hooks); each full bucket is reduced (``reduce_ipg_grads`` →
``average_tensor``) and, with DeepSpeed's default switches, *all-reduced*, after which every rank
keeps the part it owns (``zerosim/zero/ipg.py``). Its flat buffers pad to a multiple of 2·N and
its norm is all-reduced per group (``ds_schedule.py``). Per step: 2(N−1)/N · Ψ all-reduced +
(N−1)/N · Ψ_pad all-gathered, about 3(N−1)/N · Ψ: 1.5× the paper's.
"""

from __future__ import annotations

from typing import Any

from zerosim.backend import assign
from zerosim.nn import GradReadyTracker, Parameter
from zerosim.zero.ds_schedule import DeepSpeedFlatBuffers
from zerosim.zero.ipg import IpgBuckets
from zerosim.zero.schedule import deepspeed_stage12_checks
from zerosim.zero.stage1 import Stage1


class Stage1DeepSpeed(DeepSpeedFlatBuffers, Stage1):
    """Partitioned optimizer state; DeepSpeed's IPG buckets at the boundary; all-gather."""

    boundary_rule = staticmethod(deepspeed_stage12_checks)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        starts = [[slot.range.start for slot in g.slots] for g in self.groups]
        sizes = [g.layout.shard_numel for g in self.groups]
        self.ipg = IpgBuckets(self, starts, sizes, self._deliver)  # the bucket being filled
        self.reducing = False  # with overlap_comm: only the boundary backward reduces
        self.added: set[int] = set()  # id(param) of gradients added in this boundary backward
        self.tracker: GradReadyTracker | None = None  # attach(), with overlap_comm

    def attach(self, model: Any) -> None:
        if self.zero.overlap_comm:  # reduce as backward finishes each gradient
            self.tracker = GradReadyTracker(model, self._ready)

    def _ready(self, p: Parameter) -> None:
        if self.reducing:
            self._add(*self.where[id(p)])

    def _add(self, gi: int, i: int) -> None:
        g = self.groups[gi]
        self.ipg.add(gi, i, g.param_view(i, g.flat_grad))
        self.added.add(id(g.named_params[i][1]))

    def _deliver(self, gi: int, flat_start: int, values: Any) -> None:
        """A reduced piece this rank owns: it replaces the local sum in the gradient buffer."""
        assign(self.groups[gi].flat_grad[flat_start : flat_start + values.size], values)

    def before_backward(self, boundary: bool) -> None:
        self.reducing = boundary

    def after_backward(self, boundary: bool) -> None:
        if self.zero.overlap_comm:
            self.tracker.reset()
        if not boundary:
            return
        self.reducing = False
        for gi, g in enumerate(self.groups):  # definition order (all of them, or the ones
            for i, (_, p) in enumerate(g.named_params):  # backward did not finish)
                if id(p) not in self.added:
                    self._add(gi, i)
        self.added.clear()
        self.ipg.finish()
        for g in self.groups:
            for own in g.owned:
                self.average(g.flat_grad[own.start : own.stop])
