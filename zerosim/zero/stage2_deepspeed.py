"""Stage 2 under DeepSpeed 0.19.8's schedule: IPG buckets, all-reduced, during every backward.

What it changes relative to the paper's stage 2 (``stage2.py``) and why: DeepSpeed's stage 2
(``deepspeed/runtime/zero/stage_1_and_2.py``) has no static buckets. Gradients join an IPG bucket
in the order backward finishes them (``reduce_independent_p_g_buckets_and_remove_grads``, from its
hooks), the bucket being reduced when the next gradient would overflow ``reduce_bucket_size`` and
at the end of backward (``overlapping_partition_gradients_reduce_epilogue`` →
``independent_gradient_partition_epilogue``). With DeepSpeed's default switches each bucket is
*all-reduced* (``reduce_ipg_grads`` → ``average_tensor``), after which every rank keeps the part
it owns; ``use_multi_rank_bucket_allreduce: false`` reduces each owner's part to it instead
(``zerosim/zero/ipg.py``). Its flat buffers pad to a multiple of 2·N, optionally round robin,
and its norm is all-reduced per group (``ds_schedule.py``). A step then sends
k·2(N−1)/N · Ψ + (N−1)/N · Ψ_pad: about 3(N−1)/N · Ψ at k = 1, 1.5× the paper's.
"""

from __future__ import annotations

from typing import Any

from zerosim.nn import Parameter
from zerosim.zero.ds_schedule import DeepSpeedFlatBuffers
from zerosim.zero.ipg import IpgBuckets
from zerosim.zero.schedule import deepspeed_stage12_checks
from zerosim.zero.stage2 import Stage2


class Stage2DeepSpeed(DeepSpeedFlatBuffers, Stage2):
    """Partitioned gradients: DeepSpeed's IPG buckets during every backward."""

    boundary_rule = staticmethod(deepspeed_stage12_checks)

    def bucket_pieces(self) -> list[list[int]]:
        return []  # IPG buckets are cut as gradients arrive: no per-rank cut is known before

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        starts = [[slot.range.start for slot in g.slots] for g in self.groups]
        sizes = [g.layout.shard_numel for g in self.groups]
        self.ipg = IpgBuckets(self, starts, sizes, self._deliver)  # the bucket being filled
        self.added: set[int] = set()  # id(param) of gradients added in this backward

    def _ready(self, p: Parameter) -> None:
        """The gradient joins the IPG bucket; the module's copy goes."""
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

    def before_backward(self, boundary: bool) -> None:
        """Nothing to prepare: the IPG bucket fills as gradients arrive."""

    def after_backward(self, boundary: bool) -> None:
        self.tracker.reset()
        for g in self.groups:  # parameters whose uses never completed, last first
            for _, p in reversed(g.named_params):
                if id(p) not in self.added:
                    self._ready(p)
        self.added.clear()
        self.ipg.finish()
        self.finish_reduction(boundary)
