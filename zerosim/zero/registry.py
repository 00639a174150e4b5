"""Which strategy class runs a config: the one place a stage number, schedule name or layout
name becomes code.

Keyed by (``zero_optimization.stage``, ``zerosim.schedule``, ``zerosim.layout``). A class is a
stage's algorithm (``stage0.py`` … ``stage3.py``, the paper's, with the paper's parts) or that
stage given other parts, and sets nothing else: a gradient reducer (``reducer_cls``,
``reducer.py``), at stage 3 a parameter fetcher (``fetcher_cls``, ``fetcher.py``), at stages 0-2
a flat-buffer layout (``layout_cls``, ``layouts.py``), and the boundary's checks and norm
(``boundary_rule``, ``DeepSpeedNormGroups``). DeepSpeed 0.19.8's schedule is each stage with
DeepSpeed's parts (``stage0_deepspeed.py`` …; its layout at stages 1-2); Megatron's layout
(stage 1 only, ``stage1_megatron.py``) is stage 1 with Megatron's layout part; PyTorch FSDP2's
schedule (stage 3 only, ``stage3_fsdp2.py``) is stage 3 with FSDP2's dim-0 shards and its
per-FSDP-module collectives; ZeRO++
(``stage3_zeropp.py``) is the paper's stage 3 with ZeRO++'s reducer and fetcher, picked whenever
one of its switches is on, whatever the schedule. The comments below name each entry's reducer
and fetcher; the layout is the paper's unless a comment says otherwise.
"""

from __future__ import annotations

from zerosim.analysis.volume import SCHEDULES
from zerosim.zero.stage0 import Stage0
from zerosim.zero.stage0_deepspeed import Stage0DeepSpeed
from zerosim.zero.stage1 import Stage1
from zerosim.zero.stage1_deepspeed import Stage1DeepSpeed
from zerosim.zero.stage1_megatron import Stage1Megatron, Stage1MegatronDeepSpeed
from zerosim.zero.stage2 import Stage2
from zerosim.zero.stage2_deepspeed import Stage2DeepSpeed
from zerosim.zero.stage3 import Stage3
from zerosim.zero.stage3_deepspeed import Stage3DeepSpeed
from zerosim.zero.stage3_fsdp2 import Stage3FSDP2
from zerosim.zero.stage3_zeropp import Stage3ZeroPP, Stage3ZeroPPDeepSpeed
from zerosim.zero.strategy import Strategy

STRATEGIES: dict[tuple[int, str, str], type[Strategy]] = {
    (0, "paper", "deepspeed"): Stage0,  # BucketAllReduce
    (0, "deepspeed", "deepspeed"): Stage0DeepSpeed,  # AllReduceAfterBackward
    (1, "paper", "deepspeed"): Stage1,  # UnitReduceScatter
    (1, "deepspeed", "deepspeed"): Stage1DeepSpeed,  # IpgAtBoundary, DeepSpeedLayout
    (1, "paper", "megatron"): Stage1Megatron,  # UnitReduceScatter, MegatronLayout
    (1, "deepspeed", "megatron"): Stage1MegatronDeepSpeed,  # the same, DeepSpeed's norm
    (2, "paper", "deepspeed"): Stage2,  # BucketReduceScatter
    (2, "deepspeed", "deepspeed"): Stage2DeepSpeed,  # IpgInBackward, DeepSpeedLayout
    (3, "paper", "deepspeed"): Stage3,  # RankMajorReduceScatter, GatherEach
    (3, "deepspeed", "deepspeed"): Stage3DeepSpeed,  # OpenBucket, CoalescedFetcher
    (3, "fsdp2", "deepspeed"): Stage3FSDP2,  # ModuleReduceScatter, ModuleGather (PyTorch FSDP2's)
}
ZEROPP: dict[tuple[int, str], type[Strategy]] = {  # qwZ, hpZ or qgZ on
    (3, "paper"): Stage3ZeroPP,  # QuantizedBuckets, ZeroPPFetcher
    (3, "deepspeed"): Stage3ZeroPPDeepSpeed,  # QuantizedOpenBucket, ZeroPPCoalescedFetcher
}


def strategy_class(
    stage: int, schedule: str = "deepspeed", layout: str = "deepspeed", zeropp: bool = False
) -> type:
    """The strategy class for ``stage`` under ``schedule`` with flat buffers in ``layout``; with
    ``zeropp`` (a ZeRO++ switch on) ZeRO++'s."""
    if zeropp and (stage, schedule) in ZEROPP and layout == "deepspeed":
        return ZEROPP[stage, schedule]
    found = STRATEGIES.get((stage, schedule, layout))
    if found is None:
        raise ValueError(
            f"no ZeRO strategy for stage={stage!r}, schedule={schedule!r}, layout={layout!r}: "
            f"stages 0-3, schedules {SCHEDULES}, layout 'megatron' at stage 1 only"
        )
    return found
