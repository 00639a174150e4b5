"""Which stage-3 class a config runs, until one registry keyed by (stage, schedule, layout) does.

ZeRO++ whenever any of its switches is on, whatever the schedule; otherwise the paper's stage 3
or DeepSpeed's, as ``zerosim.schedule`` says.
"""

from __future__ import annotations

from typing import Any

from zerosim.zero.stage3 import Stage3
from zerosim.zero.stage3_deepspeed import DeepSpeedStage3
from zerosim.zero.stage3_zeropp import ZeroPPStage3
from zerosim.zero.zeropp import zeropp_enabled


def stage3_class(schedule: str, zeropp_on: bool) -> type[Stage3]:
    """The class of stage 3 for this schedule ("deepspeed" or "paper") and ZeRO++ switch."""
    if zeropp_on:
        return ZeroPPStage3
    return DeepSpeedStage3 if schedule == "deepspeed" else Stage3


def make_stage3(**kwargs: Any) -> Stage3:
    """Build the stage-3 strategy the keyword arguments (``Strategy``'s) select."""
    cls = stage3_class(kwargs.get("schedule", "deepspeed"), zeropp_enabled(kwargs["zero"]))
    return cls(**kwargs)
