"""The two collective schedules, and the small collectives of the accumulation boundary.

``zerosim.schedule`` chooses which collectives carry ZeRO's data (config key, docs/config.md):

- ``"deepspeed"`` (the default): the collectives DeepSpeed 0.19.8 issues for the same config.
  Stage 0 all-reduces the unpadded gradients at the boundary in messages of at most 5e8 elements
  (``stage0.py``); stages 1-2 pad flat buffers to a multiple of 2·N and reduce gradient buckets
  as its switches say (``ipg.py``: all-reduces by default); stage 3 fetches as DeepSpeed's
  coordinator does (``ds_coordinator.py``: one coalesced all-gather per module fetch and per
  prefetch, which follow the module trace) and buckets gradients in its hook order.
- ``"paper"``: the ZeRO paper's schedule: flat buffers padded to a multiple of N, gradients
  reduce-scattered (stages 1-2), 2(N−1)/N · Ψ_pad per step at stages 0-2.

At the boundary a step may also all-reduce one overflow flag (fp16: skip the step when any rank
saw inf/nan) and the gradient norm. ``boundary_checks`` says which, in which dtype:

    schedule   stage  overflow flag                         norm
    paper      any    fp16: float64 max                     float64 sum of Σg² partials
    deepspeed  0      fp16, bf16: checked locally (every    fp32 without fp16/bf16 and with
                      rank holds every reduced gradient)    gradient_clipping > 0: sum of ‖g‖/N
                                                            (runtime/utils.clip_grad_norm_);
                                                            else computed locally, not sent
    deepspeed  1, 2   uint8 max under fp16, and under bf16  fp32 sum of Σg² partials; none with
                      with bf16.check_grad_overflow         zero_optimization.compute_grad_norm
                                                            false
    deepspeed  3      uint8 max under fp16                  float64 sum of Σg² partials

DeepSpeed's fp32 messages are float64 in zerosim's float64 reference mode (``zerosim.dtype``),
which DeepSpeed does not have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

SCHEDULES = ("deepspeed", "paper")


@dataclass(frozen=True)
class BoundaryChecks:
    """The overflow and norm collectives of one optimizer step.

    ``overflow``: "all_reduce" (a one-element max of ``flag_dtype``), "local" (this rank's own
    gradients decide: they are the reduced ones everywhere) or "none" (never skipped).
    ``norm``: "sum_sq" (all-reduce of this rank's Σg² over what it owns), "mean" (all-reduce of
    the locally computed ‖g‖ / N), "local" (‖g‖ of this rank's gradients, no collective) or
    "none" (no norm). ``norm_dtype``: the dtype of the norm message.
    """

    overflow: str
    flag_dtype: np.dtype
    norm: str
    norm_dtype: np.dtype


def boundary_checks(
    schedule: str,
    stage: int,
    *,
    fp16: bool,
    bf16: bool,
    clip: float,
    reference_precision: bool = False,
    bf16_overflow: bool = True,
    compute_grad_norm: bool = True,
) -> BoundaryChecks:
    """The table of the module docstring. ``reference_precision``: zerosim's float64 mode."""
    if schedule == "deepspeed" and stage in (1, 2) and not compute_grad_norm and clip > 0:
        raise ValueError(
            "zero_optimization.compute_grad_norm=false requires gradient_clipping=0 "
            f"(DeepSpeed's rule at stages 1 and 2); got gradient_clipping={clip}"
        )
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    f64 = np.dtype(np.float64)
    if schedule == "paper":
        return BoundaryChecks("all_reduce" if fp16 else "none", f64, "sum_sq", f64)
    u8 = np.dtype(np.uint8)
    f32 = f64 if reference_precision else np.dtype(np.float32)
    if stage == 0:
        mean = clip > 0 and not (fp16 or bf16)
        flag = "local" if fp16 or bf16 else "none"
        return BoundaryChecks(flag, u8, "mean" if mean else "local", f32)
    if stage in (1, 2):
        flag = fp16 or (bf16 and bf16_overflow)
        norm = "sum_sq" if compute_grad_norm else "none"
        return BoundaryChecks("all_reduce" if flag else "none", u8, norm, f32)
    return BoundaryChecks("all_reduce" if fp16 else "none", u8, "sum_sq", f64)


def stage3_backward_gathers(
    schedule: str, zero: Any, gathered_numel: int, recorded: bool = True
) -> bool | None:
    """Whether stage 3 all-gathers its non-persistent parameters (``gathered_numel`` elements)
    again in backward, once the module trace is ``recorded`` (after the first step).

    The paper's schedule keeps every parameter from forward to backward when its next use is
    within ``stage3_max_reuse_distance`` (> Ψ_np: all of them) and the live cap holds them all.
    DeepSpeed's coordinator keeps a parameter when its next use is within the reuse distance or
    a prefetch took it: when one prefetch bucket and the live cap hold every gathered
    parameter, the first fetch prefetches the rest and nothing is gathered again; without
    prefetch it regathers as the paper's does. Any other DeepSpeed setting: None, the module
    trace decides (docs/formulas.md; tests/peer/test_deepspeed_collectives.py holds it to
    DeepSpeed's own log).
    """
    get = zero.get if isinstance(zero, dict) else lambda key, default: getattr(zero, key)
    reuse = get("stage3_max_reuse_distance", 1_000_000_000)
    live = get("stage3_max_live_parameters", 1_000_000_000)
    prefetch = get("stage3_prefetch_bucket_size", 50_000_000)
    kept = reuse > gathered_numel and live >= gathered_numel and recorded
    if schedule == "paper" or kept:
        return not kept
    if prefetch >= gathered_numel and live >= gathered_numel and recorded:
        return False
    return True if prefetch == 0 and reuse == 0 else None
