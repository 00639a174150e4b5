"""The boundary's overflow and norm collectives of each schedule (zerosim/zero/schedule.py),
against what DeepSpeed 0.19.8's comms logger printed per step on CPU/gloo (fp32: the
all-reduces of 4 bytes at stages 1-2, of 4 bytes at stage 0 only with clipping, of 8 at stage 3;
fp16 and bf16: a 1-byte flag at stages 1-2, only under fp16 at stage 3, never at stage 0)."""

from __future__ import annotations

import numpy as np
import pytest

from zerosim.analysis import boundary_messages
from zerosim.zero.registry import strategy_class


def boundary_checks(schedule, stage, **settings):
    """The boundary checks of the strategy the registry picks for (stage, schedule)."""
    return strategy_class(stage, schedule).boundary_checks(**settings)


CASES = [  # (stage, precision, clip) -> DeepSpeed's (flag bytes, norm bytes), None: not sent
    (0, "fp32", 1.0, None, 4),
    (0, "fp32", 0.0, None, None),
    (0, "bf16", 1.0, None, None),
    (0, "fp16", 1.0, None, None),
    (1, "fp32", 0.0, None, 4),
    (1, "bf16", 1.0, 1, 4),
    (2, "fp16", 1.0, 1, 4),
    (3, "fp32", 1.0, None, 8),
    (3, "bf16", 1.0, None, 8),
    (3, "fp16", 0.0, 1, 8),
]


@pytest.mark.parametrize("stage, precision, clip, flag, norm", CASES)
def test_deepspeeds_flag_and_norm_messages(stage, precision, clip, flag, norm):
    checks = boundary_checks(
        "deepspeed", stage, fp16=precision == "fp16", bf16=precision == "bf16", clip=clip
    )
    sent_flag = checks.flag_dtype.itemsize if checks.overflow == "all_reduce" else None
    sent_norm = checks.norm_dtype.itemsize if checks.norm in ("sum_sq", "mean") else None
    assert (sent_flag, sent_norm) == (flag, norm)
    # the analysis module's own table says the same
    want = {k: v for k, v in (("overflow", flag), ("clip", norm)) if v is not None}
    assert boundary_messages(stage, schedule="deepspeed", precision=precision, clip=clip) == want


def test_the_papers_schedule_sends_a_float64_norm_and_an_fp16_flag_at_every_stage():
    for stage in (0, 1, 2, 3):
        for fp16 in (False, True):
            checks = boundary_checks("paper", stage, fp16=fp16, bf16=False, clip=0.0)
            assert checks.norm == "sum_sq" and checks.norm_dtype == np.float64
            assert checks.overflow == ("all_reduce" if fp16 else "none")
            assert checks.flag_dtype == np.float64


def test_switches_that_turn_checks_off_and_the_reference_precision():
    off = boundary_checks(
        "deepspeed", 2, fp16=False, bf16=True, clip=0.0, bf16_overflow=False,
        compute_grad_norm=False,
    )  # fmt: skip
    assert (off.overflow, off.norm) == ("none", "none")
    exact = boundary_checks("deepspeed", 1, fp16=False, bf16=False, clip=1.0,
                            reference_precision=True)  # fmt: skip
    assert exact.norm_dtype == np.float64  # zerosim's float64 mode keeps its norm exact
    with pytest.raises(ValueError, match="compute_grad_norm=false requires gradient_clipping=0"):
        boundary_checks("deepspeed", 2, fp16=False, bf16=False, clip=1.0, compute_grad_norm=False)
