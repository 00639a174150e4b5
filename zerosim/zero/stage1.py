"""Stage 1 (P_os): the optimizer state is partitioned.

Every rank keeps full parameters and full gradients (module ``.grad`` are views of one flat
buffer, accumulated across micro-steps), but the optimizer state exists only for the rank's owned
shard, and only the owner updates it. At the end of the boundary backward each partition unit of
the gradient buffer is reduce-scattered *in place*: rank r's owned piece of the buffer then holds
the sum, which it divides by N. After the optimizer step every unit of the parameter buffer is
all-gathered in place, so every rank has the updated parameters again. Per step:
(N−1)/N · Ψ_pad reduce-scatter + (N−1)/N · Ψ_pad all-gather = 2(N−1)/N · Ψ_pad.

The reduce-scatter is the reducer this stage is given (``UnitReduceScatter``); beside it:
DeepSpeed 0.19.8's schedule (``stage1_deepspeed.py``: IPG buckets all-reduced, about
3(N−1)/N · Ψ per step) and Megatron-LM's distributed optimizer (``stage1_megatron.py``: the same
reduce-scatter over Megatron's buckets, the layout part ``layouts.MegatronLayout``).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from zerosim.backend import assign, nbytes, np_dtype
from zerosim.zero.partition import Range
from zerosim.zero.reducer import GradReducer
from zerosim.zero.strategy import FlatGroup, FullGradGroup, Strategy


class UnitReduceScatter(GradReducer):
    """The paper's stage-1 reducer: at the boundary, after backward, each partition unit of the
    gradient buffer reduce-scattered in place (blocking), so that this rank's piece of the unit
    holds the sum; under ``communication_data_type`` a cast copy of the unit is reduced and its
    piece lands through ``strategy.land``."""

    def after_backward(self, boundary: bool) -> None:
        if not boundary:
            return
        s = self.strategy
        for gi, g in enumerate(s.groups):
            wire = s.wire_dtype(g.flat_grad.dtype)
            for unit, own in zip(g.layout.units, g.owned, strict=True):
                piece = Range(own.start - unit.start, own.stop - unit.start)  # ours, in the unit
                collective = partial(self.reduce_scatter, piece)
                full = g.flat_grad[unit.start : unit.stop]
                if wire == np_dtype(full.dtype):  # reduced where it lies: our piece is ours
                    s.reduction.reduce(full, None, collective, pooled=())
                else:  # communication_data_type: reduce a cast copy in place, keep our piece
                    buf = s.reduction.take(full.size, wire)
                    assign(buf, full)
                    s.reduction.reduce(
                        buf, partial(self.land_piece, gi, own.start, piece), collective
                    )

    def reduce_scatter(self, piece: Range, out: Any, unit: Any) -> None:
        """A reduce-sequence collective (blocking): the unit reduce-scattered in place, the
        sum of this rank's ``piece`` into that piece of it."""
        self.strategy.comm.reduce_scatter(unit[piece.start : piece.stop], unit)

    def land_piece(self, gi: int, start: int, piece: Range, unit: Any) -> None:
        """Where a cast copy's reduced unit lands: this rank's ``piece`` of it, through the
        stage's ``land`` at flat position ``start``."""
        self.strategy.land(gi, start, unit[piece.start : piece.stop])


class Stage1(Strategy):
    """Partitioned optimizer state; in-place reduce-scatter at the boundary; all-gather."""

    stage = 1
    partitions_optimizer_states = True
    reported_norm = "before_scale_update"  # DeepSpeed's stage_1_and_2.py
    group_cls = FullGradGroup
    reducer_cls = UnitReduceScatter  # the paper's in-place reduce-scatter of each unit

    def setup_gradients(self) -> None:
        """Full gradient buffers in the dtype the layout says (the model dtype; Megatron's under
        bf16: fp32); module ``.grad`` are views of them. The layout adds any fp32 gradient shard
        it keeps (Megatron's under fp16)."""
        for g in self.groups:
            g.flat_grad = g.xp.zeros(g.flat_param.size, dtype=self.layout.grad_dtype)
            for i, (_, p) in enumerate(g.named_params):
                p.grad = g.param_view(i, g.flat_grad)
        self.layout.keep_master_grads(self.groups)

    def land(self, group: int, start: int, values: Any) -> None:
        """A reduced piece this rank owns replaces the local sum in the gradient buffer."""
        assign(self.groups[group].flat_grad[start : start + values.size], values)

    def before_backward(self, boundary: bool) -> None:
        self.reducer.before_backward(boundary)

    def after_backward(self, boundary: bool) -> None:
        """At the boundary the reducer sums the owned shard over ranks; it becomes the mean."""
        self.reducer.after_backward(boundary)
        if boundary:
            for g in self.groups:
                for own in g.owned:
                    self.average(g.flat_grad[own.start : own.stop])

    def grad_view(self, group: FlatGroup, rng: Range) -> Any:
        return group.flat_grad[rng.start : rng.stop]

    def gather(self) -> None:
        """After the step: every unit of the parameter buffer all-gathered in place from the
        owners' updated pieces."""
        for g in self.groups:
            for unit, own in zip(g.layout.units, g.owned, strict=True):
                self.comm.all_gather(
                    g.flat_param[unit.start : unit.stop], g.flat_param[own.start : own.stop]
                )

    def zero_grad(self) -> None:
        for g in self.groups:
            g.flat_grad[...] = 0

    def grad_bytes(self) -> int:
        return sum(nbytes(g.flat_grad) for g in self.groups)
