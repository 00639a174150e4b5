"""Which strategy class runs a config: the one place a stage number, schedule name or layout
name becomes code.

Keyed by (``zero_optimization.stage``, ``zerosim.schedule``, ``zerosim.layout``). The paper's
classes (``stage0.py`` … ``stage3.py``) run the ``paper`` schedule; DeepSpeed 0.19.8's schedule
is a subclass of each beside it (``stage0_deepspeed.py`` …), and Megatron's layout (stage 1 only,
``stage1_megatron.py``) one of stage 1's. ZeRO++ (``stage3_zeropp.py``) subclasses the paper's
stage 3 and is picked whenever one of its switches is on, whatever the schedule.
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
from zerosim.zero.stage3_zeropp import Stage3ZeroPP, Stage3ZeroPPDeepSpeed
from zerosim.zero.strategy import Strategy

STRATEGIES: dict[tuple[int, str, str], type[Strategy]] = {
    (0, "paper", "deepspeed"): Stage0,
    (0, "deepspeed", "deepspeed"): Stage0DeepSpeed,
    (1, "paper", "deepspeed"): Stage1,
    (1, "deepspeed", "deepspeed"): Stage1DeepSpeed,
    (1, "paper", "megatron"): Stage1Megatron,
    (1, "deepspeed", "megatron"): Stage1MegatronDeepSpeed,
    (2, "paper", "deepspeed"): Stage2,
    (2, "deepspeed", "deepspeed"): Stage2DeepSpeed,
    (3, "paper", "deepspeed"): Stage3,
    (3, "deepspeed", "deepspeed"): Stage3DeepSpeed,
}
ZEROPP: dict[tuple[int, str], type[Strategy]] = {  # qwZ, hpZ or qgZ on
    (3, "paper"): Stage3ZeroPP,
    (3, "deepspeed"): Stage3ZeroPPDeepSpeed,
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
