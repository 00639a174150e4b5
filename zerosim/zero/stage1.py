"""Stage 1 (P_os): the optimizer state is partitioned; DeepSpeed's or Megatron's layout.

Every rank keeps full parameters and full gradients (module ``.grad`` are views of one flat
buffer, accumulated across micro-steps), but the optimizer state exists only for the rank's owned
shard, and only the owner updates it. At the end of the boundary backward each partition unit of
the gradient buffer is reduce-scattered *in place*: rank r's owned piece of the buffer then holds
the sum, which it divides by N. After the optimizer step every unit of the parameter buffer is
all-gathered in place, so every rank has the updated parameters again. Per step:
(N−1)/N · Ψ_pad reduce-scatter + (N−1)/N · Ψ_pad all-gather = 2(N−1)/N · Ψ_pad. That is the
``paper`` schedule.

The ``deepspeed`` schedule (the default) reduces as DeepSpeed 0.19.8 does at the boundary
(``zerosim/zero/ipg.py``): the gradients join IPG buckets in definition order after backward (in
the order backward finishes them with ``overlap_comm``) and, with DeepSpeed's default switches,
each bucket is all-reduced and every rank keeps the part it owns; the flat buffer pads to a
multiple of 2·N. Per step: 2(N−1)/N · Ψ all-reduced + (N−1)/N · Ψ_pad all-gathered, about
3(N−1)/N · Ψ: 1.5× the paper's.

With ``zerosim.layout = "megatron"`` the units are Megatron's buckets (reverse parameter order,
each padded to lcm(N, 128), split evenly across ranks): Megatron-LM's distributed optimizer, which
has ZeRO-1 semantics. ``range_maps()`` gives its four range maps for this rank.
"""

from __future__ import annotations

from typing import Any

from zerosim.backend import assign, nbytes, np_dtype
from zerosim.nn import GradReadyTracker, Parameter
from zerosim.zero.ipg import IpgBuckets
from zerosim.zero.partition import (
    Layout,
    MegatronRanges,
    Range,
    deepspeed_layout,
    megatron_layout,
    megatron_range_maps,
)
from zerosim.zero.strategy import FlatGroup, Strategy


class Stage1(Strategy):
    """Partitioned optimizer state; in-place reduce-scatter at the boundary; all-gather."""

    stage = 1
    partitions_optimizer_states = True
    reported_norm = "before_scale_update"  # DeepSpeed's stage_1_and_2.py

    def make_layout(self, named: list[tuple[str, Parameter]]) -> Layout:
        shapes = [(n, p.shape) for n, p in named]
        if self.layout_kind == "megatron":
            return megatron_layout(shapes, self.comm.size, self.zero.reduce_bucket_size)
        return deepspeed_layout(shapes, self.comm.size, self.alignment, self.round_robin)

    @property
    def deepspeed_reduction(self) -> bool:
        """DeepSpeed's IPG buckets (its schedule and layout); Megatron's layout reduce-scatters
        its own buckets in either schedule."""
        return self.schedule == "deepspeed" and self.layout_kind == "deepspeed"

    def setup_gradients(self) -> None:
        """Full gradient buffers; under mixed precision with Megatron's layout, its choices.

        Megatron-LM with bf16 accumulates and reduces gradients in an fp32 buffer (so the
        optimizer uses the owned piece of it directly: 6 + 12/d bytes per parameter); with fp16
        it keeps fp16 gradients and a persistent fp32 "main grad" shard (4 + 16/d).
        """
        megatron_bf16 = (
            self.layout_kind == "megatron"
            and self.master_dtype is not None
            and self.dtype.name == "bfloat16"
        )
        for g in self.groups:
            dtype = self.master_dtype if megatron_bf16 else self.dtype
            g.flat_grad = g.xp.zeros(g.flat_param.size, dtype=dtype)
            for i, (_, p) in enumerate(g.named_params):
                p.grad = g.param_view(i, g.flat_grad)
            if (
                self.layout_kind == "megatron"
                and self.master_dtype is not None
                and not megatron_bf16
            ):
                g.master_grads = g.xp.zeros(sum(r.size for r in g.owned), dtype=self.master_dtype)
        self.ipg: IpgBuckets | None = None  # deepspeed: DeepSpeed's IPG bucket
        self.reducing = False  # deepspeed with overlap_comm: only the boundary backward reduces
        self.added: set[int] = set()  # id(param) of gradients added in this boundary backward
        if self.deepspeed_reduction:
            starts = [[slot.range.start for slot in g.slots] for g in self.groups]
            sizes = [g.layout.shard_numel for g in self.groups]
            self.ipg = IpgBuckets(self, starts, sizes, self._deliver)

    def attach(self, model: Any) -> None:
        if self.ipg is not None and self.zero.overlap_comm:  # reduce as backward finishes
            self.tracker = GradReadyTracker(model, self._ready)
            self.where = {
                id(p): (gi, i)
                for gi, g in enumerate(self.groups)
                for i, (_, p) in enumerate(g.named_params)
            }

    def _ready(self, p: Parameter) -> None:
        if self.reducing:
            gi, i = self.where[id(p)]
            self._add(gi, i)

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
        if self.ipg is not None and self.zero.overlap_comm:
            self.tracker.reset()
        if not boundary:
            return
        if self.ipg is not None:
            self.reducing = False
            for gi, g in enumerate(self.groups):  # definition order (all of them, or the
                for i, (_, p) in enumerate(g.named_params):  # ones backward did not finish)
                    if id(p) not in self.added:
                        self._add(gi, i)
            self.added.clear()
            self.ipg.finish()
            for g in self.groups:
                for own in g.owned:
                    self.average(g.flat_grad[own.start : own.stop])
            return
        for g in self.groups:
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

    def range_maps(self) -> list[dict[str, MegatronRanges]]:
        """Megatron's (world, world_in_bucket, local, param) ranges per group for this rank."""
        return [megatron_range_maps(g.layout, self.comm.rank) for g in self.groups]
