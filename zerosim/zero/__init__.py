"""ZeRO strategies (stages 0-3 and DeepSpeed's schedule of each, Megatron's layout, ZeRO++),
the registry that picks one, the partition math they share, and ``Init`` /
``GatheredParameters`` for models built partitioned."""

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
from zerosim.zero.registry import STRATEGIES, strategy_class
from zerosim.zero.segments import Segment
from zerosim.zero.sharded_step import ShardedStep, Tile
from zerosim.zero.stage0 import Stage0
from zerosim.zero.stage0_deepspeed import Stage0DeepSpeed
from zerosim.zero.stage1 import Stage1
from zerosim.zero.stage1_deepspeed import Stage1DeepSpeed
from zerosim.zero.stage1_megatron import Stage1Megatron, Stage1MegatronDeepSpeed
from zerosim.zero.stage2 import Stage2
from zerosim.zero.stage2_deepspeed import Stage2DeepSpeed
from zerosim.zero.stage3 import Stage3
from zerosim.zero.stage3_deepspeed import Stage3DeepSpeed
from zerosim.zero.stage3_zeropp import Stage3ZeroPP, Stage3ZeroPPDeepSpeed
from zerosim.zero.strategy import Strategy

__all__ = [
    "GatheredParameters",
    "Init",
    "ParamChunk",
    "is_partitioned",
    "STRATEGIES",
    "Segment",
    "Layout",
    "Range",
    "Tile",
    "Stage0",
    "Stage0DeepSpeed",
    "Stage1",
    "Stage1DeepSpeed",
    "Stage1Megatron",
    "Stage1MegatronDeepSpeed",
    "Stage2",
    "Stage2DeepSpeed",
    "Stage3",
    "Stage3DeepSpeed",
    "Stage3ZeroPP",
    "Stage3ZeroPPDeepSpeed",
    "ShardedStep",
    "Strategy",
    "deepspeed_layout",
    "megatron_layout",
    "megatron_range_maps",
    "piece_counts",
    "reduction_buckets",
    "strategy_class",
]
