"""The two collective schedules, and the small collectives of the accumulation boundary.

``zerosim.schedule`` chooses which collectives carry ZeRO's data (config key, docs/config.md):

- ``"deepspeed"`` (the default): the collectives DeepSpeed 0.19.8 issues for the same config.
  Stage 0 all-reduces the unpadded gradients at the boundary in messages of at most 5e8 elements
  (``stage0_deepspeed.py``); stages 1-2 pad flat buffers to a multiple of 2·N and reduce gradient
  buckets as its switches say (``ipg.py``: all-reduces by default); stage 3 fetches as DeepSpeed's
  coordinator does (``ds_coordinator.py``: one coalesced all-gather per module fetch and per
  prefetch, which follow the module trace) and buckets gradients in its hook order.
- ``"paper"``: the ZeRO paper's schedule: flat buffers padded to a multiple of N, gradients
  reduce-scattered (stages 1-2), 2(N−1)/N · Ψ_pad per step at stages 0-2.

At the boundary a step may also all-reduce one overflow flag and the gradient norm. The step is
skipped (weights, optimizer state, step count and LR schedule untouched; ``skipped_steps`` + 1;
the loss scaler told of an overflow) when the flag says some rank saw inf/nan, or when the norm
is not finite and the last column says so. Each row below is a function here, and each strategy
class names its row (``Strategy.boundary_checks``); which, in which dtype:

    schedule   stage  overflow flag               norm                            inf/nan norm
    paper      any    fp16: float64 max           float64 sum of Σg² partials     skip
    deepspeed  0      fp16, bf16: checked         fp32 without fp16/bf16 and      fp16, bf16:
                      locally (every rank holds   with gradient_clipping > 0:     skip; fp32:
                      every reduced gradient)     sum of ‖g‖/N (runtime/utils.    step ("as_is")
                                                  clip_grad_norm_); else
                                                  computed locally, not sent
    deepspeed  1, 2   uint8 max under fp16, and   fp32 sum of Σg² partials; none  skip; bf16
                      under bf16 with bf16.       with zero_optimization.         without the
                      check_grad_overflow         compute_grad_norm false         check: step
                                                                                  ("inf")
    deepspeed  3      uint8 max under fp16        float64 sum of Σg² partials     skip
                                                  (fp32 under optimizer offload)
    fsdp2      3      none (no fp16 under FSDP2)  with gradient_clipping > 0:     step ("as_is")
                                                  fp32 sum of one ‖g‖² partial
                                                  per parameter; else none

DeepSpeed 0.19.8's sources for the last column: stage 0 in one precision steps the client's
torch optimizer after ``clip_grad_norm_`` (``engine._take_model_step``), whose coefficient
``torch.min(1, max_norm / (norm + 1e-6))`` is nan for a nan norm and 0 for an inf one; in fp16
and bf16 its ``FP16_UnfusedOptimizer`` skips on a local inf/nan or an invalid norm.
``stage_1_and_2.step`` masks an inf/nan norm to inf (``get_grad_norm_direct``,
``combine_grad_norm_groups``) and skips on it unless the model is bf16 without
``check_grad_overflow`` (then the step runs and the inf norm clips every finite gradient to 0).
``stage3.step`` skips on it at every precision (``check_grad_overflow`` is not read there). A
step skipped on the flag sends no norm; without a norm (``compute_grad_norm`` false) only the
flag can skip. The paper's schedule skips whenever the norm is not finite: a float64 Σg² of
16- or 32-bit gradients is finite exactly when every gradient is, so no non-finite gradient
reaches the weights, and no collective is added for it.

DeepSpeed's fp32 messages are float64 in zerosim's float64 reference mode (``zerosim.dtype``),
which DeepSpeed does not have.

FSDP2's row is what torch's ``clip_grad_norm_`` does on DTensor gradients (torch 2.13,
``nn/utils/clip_grad.py``): each parameter's local norm is a partial DTensor, the stacked norms are
reduced in one all-reduce of one ‖g‖² per parameter, and the total is the norm of those norms.
Without clipping a torch user takes no norm, so none is sent; ``clip_grad_norm_`` multiplies by
``min(1, max_norm / (norm + 1e-6))`` whatever the norm, so a nan norm reaches the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BoundaryChecks:
    """The overflow and norm collectives of one optimizer step, and what a bad norm does.

    ``overflow``: "all_reduce" (a one-element max of ``flag_dtype``), "local" (this rank's own
    gradients decide: they are the reduced ones everywhere) or "none" (no flag).
    ``norm``: "sum_sq" (all-reduce of this rank's Σg² over what it owns), "per_param" (all-reduce
    of this rank's Σg² of each parameter, one element per parameter: torch's), "mean" (all-reduce of
    the locally computed ‖g‖ / N), "local" (‖g‖ of this rank's gradients, no collective) or
    "none" (no norm). ``norm_dtype``: the dtype of the norm message.
    ``bad_norm``, when the norm is inf or nan: "skip" (skip the step), "inf" (step with the norm
    taken as inf, as DeepSpeed's ZeRO optimizers mask it) or "as_is" (step with the norm as it
    is: a nan norm makes the clip coefficient nan).
    """

    overflow: str
    flag_dtype: np.dtype
    norm: str
    norm_dtype: np.dtype
    bad_norm: str = "skip"


@dataclass(frozen=True)
class BoundarySettings:
    """The config switches the boundary's checks depend on (``reference_precision``: zerosim's
    float64 mode; ``bf16_overflow``: ``bf16.check_grad_overflow``)."""

    fp16: bool
    bf16: bool
    clip: float
    reference_precision: bool = False
    bf16_overflow: bool = True
    compute_grad_norm: bool = True
    optimizer_offload: bool = False


# One function per row of the module docstring's table; each strategy class names its row
# (``Strategy.boundary_rule``: the paper's; DeepSpeed's subclasses their stage's).


def paper_checks(s: BoundarySettings) -> BoundaryChecks:
    f64 = np.dtype(np.float64)
    return BoundaryChecks("all_reduce" if s.fp16 else "none", f64, "sum_sq", f64)


def deepspeed_stage0_checks(s: BoundarySettings) -> BoundaryChecks:
    mixed = s.fp16 or s.bf16
    norm = "local" if mixed or s.clip <= 0 else "mean"
    overflow, bad_norm = ("local", "skip") if mixed else ("none", "as_is")
    return BoundaryChecks(overflow, _U8, norm, _fp32(s), bad_norm=bad_norm)


def deepspeed_stage12_checks(s: BoundarySettings) -> BoundaryChecks:
    if not s.compute_grad_norm and s.clip > 0:
        raise ValueError(
            "zero_optimization.compute_grad_norm=false requires gradient_clipping=0 "
            f"(DeepSpeed's rule at stages 1 and 2); got gradient_clipping={s.clip}"
        )
    flag = s.fp16 or (s.bf16 and s.bf16_overflow)
    norm = "sum_sq" if s.compute_grad_norm else "none"
    bad_norm = "inf" if s.bf16 and not s.bf16_overflow else "skip"
    return BoundaryChecks("all_reduce" if flag else "none", _U8, norm, _fp32(s), bad_norm)


def deepspeed_stage3_checks(s: BoundarySettings) -> BoundaryChecks:
    # under optimizer offload stage3.py sums per-parameter norms into a FloatTensor
    # (complete_grad_norm_calculation_for_cpu_offload); else a float64 one (get_grad_norm_direct)
    norm_dtype = _fp32(s) if s.optimizer_offload else np.dtype(np.float64)
    return BoundaryChecks("all_reduce" if s.fp16 else "none", _U8, "sum_sq", norm_dtype)


def fsdp2_checks(s: BoundarySettings) -> BoundaryChecks:
    norm = "per_param" if s.clip > 0 else "none"  # torch's clip_grad_norm_ on DTensors
    return BoundaryChecks("none", _U8, norm, _fp32(s), bad_norm="as_is")


_U8 = np.dtype(np.uint8)


def _fp32(s: BoundarySettings) -> np.dtype:
    """DeepSpeed's fp32 messages: float64 in zerosim's float64 reference mode."""
    return np.dtype(np.float64 if s.reference_precision else np.float32)
