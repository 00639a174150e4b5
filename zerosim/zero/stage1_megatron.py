"""Stage 1 with Megatron-LM's layout (``zerosim.layout = "megatron"``): its distributed optimizer.

What it changes relative to the paper's stage 1 (``stage1.py``) and why: Megatron-LM's
distributed optimizer has ZeRO-1 semantics but its own layout. Its partition units are buckets
(``megatron_layout``: reverse parameter order, each padded to lcm(N, 128), split evenly across
ranks), each reduce-scattered in place and all-gathered as the paper's stage 1 does with its
units. Under mixed precision it keeps its own gradient buffers: with bf16 it accumulates and
reduces gradients in an fp32 buffer (so the optimizer uses the owned piece of it directly: 6 +
12/d bytes per parameter); with fp16 it keeps fp16 gradients and a persistent fp32 "main grad"
shard (4 + 16/d). ``range_maps()`` gives its four range maps for this rank.

Under ``zerosim.schedule = "deepspeed"`` the reduction stays Megatron's; only the norm follows
DeepSpeed (one all-reduce per group: ``Stage1MegatronDeepSpeed``).
"""

from __future__ import annotations

from typing import Any

from zerosim.nn import Parameter
from zerosim.zero.ds_schedule import DeepSpeedNormGroups
from zerosim.zero.partition import Layout, MegatronRanges, megatron_layout, megatron_range_maps
from zerosim.zero.schedule import deepspeed_stage12_checks
from zerosim.zero.stage1 import Stage1
from zerosim.zero.strategy import FullGradGroup


class MegatronGroup(FullGradGroup):
    """A parameter group in Megatron's layout: Stage 1's, plus fp16's fp32 gradient shard."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.master_grads: Any = None  # fp16 training: the persistent fp32 gradient shard


class Stage1Megatron(Stage1):
    """Stage 1 over Megatron's buckets and its mixed-precision gradient buffers."""

    group_cls = MegatronGroup

    def make_layout(self, named: list[tuple[str, Parameter]]) -> Layout:
        shapes = [(n, p.shape) for n, p in named]
        return megatron_layout(shapes, self.comm.size, self.zero.reduce_bucket_size)

    def setup_gradients(self) -> None:
        """Gradient buffers in fp32 under bf16; fp16 ones and an fp32 gradient shard under fp16."""
        mixed = self.master_dtype is not None
        bf16 = mixed and self.dtype.name == "bfloat16"
        for g in self.groups:
            dtype = self.master_dtype if bf16 else self.dtype
            g.flat_grad = g.xp.zeros(g.flat_param.size, dtype=dtype)
            for i, (_, p) in enumerate(g.named_params):
                p.grad = g.param_view(i, g.flat_grad)
            if mixed and not bf16:
                g.master_grads = g.xp.zeros(sum(r.size for r in g.owned), dtype=self.master_dtype)

    def master_grad_shard(self, group: MegatronGroup) -> Any:
        return group.master_grads

    def range_maps(self) -> list[dict[str, MegatronRanges]]:
        """Megatron's (world, world_in_bucket, local, param) ranges per group for this rank."""
        return [megatron_range_maps(g.layout, self.comm.rank) for g in self.groups]


class Stage1MegatronDeepSpeed(DeepSpeedNormGroups, Stage1Megatron):
    """Megatron's layout under DeepSpeed's boundary checks: one norm all-reduce per group."""

    boundary_rule = staticmethod(deepspeed_stage12_checks)
