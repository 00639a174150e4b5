"""Stage 1 with Megatron-LM's layout (``zerosim.layout = "megatron"``): its distributed optimizer.

What it changes relative to the paper's stage 1 (``stage1.py``) and why: Megatron-LM's
distributed optimizer has ZeRO-1 semantics but its own layout, so the class is the paper's stage 1
given Megatron's layout part (``layouts.MegatronLayout``): its partition units are buckets
(reverse parameter order, each padded to lcm(N, 128), split evenly across ranks), each
reduce-scattered in place and all-gathered as the paper's stage 1 does with its units; under
bf16 the gradient buffers are fp32, under fp16 an fp32 gradient shard is kept beside them;
``strategy.layout.range_maps()`` gives Megatron's four range maps for this rank.

Under ``zerosim.schedule = "deepspeed"`` the reduction stays Megatron's; only the norm follows
DeepSpeed (one all-reduce per group: ``Stage1MegatronDeepSpeed``).
"""

from __future__ import annotations

from zerosim.zero.ds_schedule import DeepSpeedNormGroups
from zerosim.zero.layouts import MegatronLayout
from zerosim.zero.schedule import deepspeed_stage12_checks
from zerosim.zero.stage1 import Stage1


class Stage1Megatron(Stage1):
    """Stage 1 over Megatron's buckets and its mixed-precision gradient buffers."""

    layout_cls = MegatronLayout  # Megatron's buckets, its fp32 gradient buffers or shard


class Stage1MegatronDeepSpeed(DeepSpeedNormGroups, Stage1Megatron):
    """Megatron's layout under DeepSpeed's boundary checks: one norm all-reduce per group."""

    boundary_rule = staticmethod(deepspeed_stage12_checks)
