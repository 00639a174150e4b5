"""Stage 1 (P_os): the optimizer state is partitioned.

Every rank keeps full parameters and full gradients (module ``.grad`` are views of one flat
buffer, accumulated across micro-steps), but the optimizer state exists only for the rank's owned
shard, and only the owner updates it. At the end of the boundary backward each partition unit of
the gradient buffer is reduce-scattered *in place*: rank r's owned piece of the buffer then holds
the sum, which it divides by N. After the optimizer step every unit of the parameter buffer is
all-gathered in place, so every rank has the updated parameters again. Per step:
(N−1)/N · Ψ_pad reduce-scatter + (N−1)/N · Ψ_pad all-gather = 2(N−1)/N · Ψ_pad.

Beside it: DeepSpeed 0.19.8's schedule (``stage1_deepspeed.py``: IPG buckets all-reduced, about
3(N−1)/N · Ψ per step) and Megatron-LM's distributed optimizer (``stage1_megatron.py``: the same
reduce-scatter over Megatron's buckets).
"""

from __future__ import annotations

from typing import Any

from zerosim.backend import assign, nbytes, np_dtype
from zerosim.zero.partition import Range
from zerosim.zero.strategy import FlatGroup, FullGradGroup, Strategy


class Stage1(Strategy):
    """Partitioned optimizer state; in-place reduce-scatter at the boundary; all-gather."""

    stage = 1
    partitions_optimizer_states = True
    reported_norm = "before_scale_update"  # DeepSpeed's stage_1_and_2.py
    group_cls = FullGradGroup

    def setup_gradients(self) -> None:
        """Full gradient buffers in the model dtype; module ``.grad`` are views of them."""
        for g in self.groups:
            g.flat_grad = g.xp.zeros(g.flat_param.size, dtype=self.dtype)
            for i, (_, p) in enumerate(g.named_params):
                p.grad = g.param_view(i, g.flat_grad)

    def after_backward(self, boundary: bool) -> None:
        if boundary:
            for g in self.groups:
                self.reduce_scatter_units(g)

    def reduce_scatter_units(self, g: FullGradGroup) -> None:
        """Reduce-scatter every partition unit of the gradient buffer in place and average this
        rank's piece (a cast copy of the unit under ``communication_data_type``)."""
        wire = self.wire_dtype(g.flat_grad.dtype)
        for unit, own in zip(g.layout.units, g.owned, strict=True):
            mine = g.flat_grad[own.start : own.stop]
            full = g.flat_grad[unit.start : unit.stop]
            if wire == np_dtype(full.dtype):
                self.before_reduction(full)
                self.comm.reduce_scatter(mine, full)
            else:  # communication_data_type: reduce a cast copy in place, keep our piece
                buf = self.take_buffer(full.size, wire)
                assign(buf, full)
                self.before_reduction(buf)
                piece = buf[own.start - unit.start : own.stop - unit.start]
                self.comm.reduce_scatter(piece, buf)
                assign(mine, piece)
                self.give_buffer(buf)
            self.average(mine)

    def grad_view(self, group: FlatGroup, rng: Range) -> Any:
        return group.flat_grad[rng.start : rng.stop]

    def gather(self) -> None:
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
