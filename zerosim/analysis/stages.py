"""The registry of the ZeRO stages zerosim runs, by the names commands, reports and notebooks use.

One entry per name: the DeepSpeed ``zero_optimization.stage`` it runs, the ``zerosim.layout`` of
its flat buffers, and its name in the ZeRO paper (Rajbhandari et al. 2020, Figure 1). The engine's
strategy classes are keyed by the same stage numbers and layouts, with the schedule
(``zerosim.zero.registry``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageInfo:
    name: str  # "0" … "3", "megatron"
    stage: int  # zero_optimization.stage
    layout: str  # zerosim.layout: "deepspeed" or "megatron"
    paper_name: str  # the ZeRO paper's name of what is partitioned


STAGES: dict[str, StageInfo] = {
    s.name: s
    for s in (
        StageInfo("0", 0, "deepspeed", "baseline"),
        StageInfo("1", 1, "deepspeed", "P_os"),
        StageInfo("2", 2, "deepspeed", "P_os+g"),
        StageInfo("3", 3, "deepspeed", "P_os+g+p"),
        StageInfo("megatron", 1, "megatron", "megatron"),
    )
}
ZERO_STAGES = (0, 1, 2, 3)  # the values of zero_optimization.stage


def stage_info(name: str) -> StageInfo:
    """The registry entry of ``name``, or a ValueError naming the allowed names."""
    if name not in STAGES:
        raise ValueError(f"stage must be one of {list(STAGES)}, got {name!r}")
    return STAGES[name]
