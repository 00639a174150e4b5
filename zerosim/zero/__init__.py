"""ZeRO strategies (stages 0-3, Megatron's layout), the partition math they share, and
``Init`` / ``GatheredParameters`` for models built partitioned."""

from zerosim.zero.init import GatheredParameters, Init, ParamChunk, is_partitioned
from zerosim.zero.partition import (
    Layout,
    Range,
    deepspeed_layout,
    megatron_layout,
    megatron_range_maps,
    piece_counts,
    reduction_buckets,
)
from zerosim.zero.stage0 import Stage0
from zerosim.zero.stage1 import Stage1
from zerosim.zero.stage2 import Stage2
from zerosim.zero.stage3 import Stage3
from zerosim.zero.stage3_select import make_stage3
from zerosim.zero.strategy import Segment, Shard, Strategy

STRATEGIES = {0: Stage0, 1: Stage1, 2: Stage2, 3: make_stage3}

__all__ = [
    "GatheredParameters",
    "Init",
    "ParamChunk",
    "is_partitioned",
    "STRATEGIES",
    "Segment",
    "Layout",
    "Range",
    "Shard",
    "Stage0",
    "Stage1",
    "Stage2",
    "Stage3",
    "Strategy",
    "deepspeed_layout",
    "megatron_layout",
    "megatron_range_maps",
    "piece_counts",
    "reduction_buckets",
]
