"""What the engine reports, as DeepSpeed 0.19.8 reports it: the gradient norm that
``get_global_grad_norm()`` returns (which differs by stage in DeepSpeed, for reasons of its own
code, not of the algorithm), rank 0's progress line and its per-phase timers.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

# Strategy.reported_norm: which norm each stage's DeepSpeed optimizer keeps for
# get_global_grad_norm(), given the norm of the gradients over the loss scale before this step's
# update (``norm``) and over the scale after it (``unscaled``, the one clipping uses).
REPORTED_NORMS = {
    # stage 0 in one precision: the client's torch optimizer keeps no norm (clipping still uses
    # it); under fp16/bf16 DeepSpeed's FP16_Optimizer/BF16_Optimizer keep ``unscaled``
    "none_in_one_precision": lambda mixed, norm, unscaled: unscaled if mixed else None,
    # stages 1-2 (``stage_1_and_2.step``: ``norm``): on a step where the loss scale grows it is
    # that factor above the norm clipping used
    "before_scale_update": lambda mixed, norm, unscaled: norm,
    # stage 3 (``stage3.step``: ``scaled_global_grad_norm / self.loss_scale``, once updated)
    "after_scale_update": lambda mixed, norm, unscaled: unscaled,
}


def reported_norm(
    kind: str, mixed_precision: bool, norm: float | None, unscaled: float | None
) -> float | None:
    """The norm ``get_global_grad_norm()`` reports for a strategy whose ``reported_norm`` is
    ``kind`` (``REPORTED_NORMS``)."""
    if kind not in REPORTED_NORMS:
        raise ValueError(f"reported_norm must be one of {list(REPORTED_NORMS)}, got {kind!r}")
    return REPORTED_NORMS[kind](mixed_precision, norm, unscaled)


class StepLog:
    """Rank 0's log after an optimizer step, as DeepSpeed's: a progress line every
    ``steps_per_print`` steps (never when it is None, DeepSpeed's default) and, with
    ``wall_clock_breakdown``, the forward/backward/step time over the same steps (every step
    without a progress line). ``wall_clock`` holds the cumulative seconds per phase."""

    def __init__(self, rank: int, steps_per_print: int | None, wall_clock_breakdown: bool) -> None:
        self.rank = rank
        self.period = steps_per_print
        self.breakdown = wall_clock_breakdown
        self.wall_clock = {"forward": 0.0, "backward": 0.0, "step": 0.0}  # seconds, cumulative
        self._printed_clock = dict(self.wall_clock)

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Add the time spent in the block to ``wall_clock[name]``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.wall_clock[name] += time.perf_counter() - start

    def after_step(self, step: int, lr: Any, norm: Any, loss_scale: float, skipped: int) -> None:
        if self.rank != 0:
            return
        if self.period is not None and step % self.period == 0:
            log.info(
                "step %d: lr %s, grad norm %s, loss scale %g, skipped %d",
                step,
                lr,
                norm,
                loss_scale,
                skipped,
            )
        timed = self.period or 1  # DeepSpeed's timers: with the progress line, or every step
        if self.breakdown and step % timed == 0:
            spent = {k: (v - self._printed_clock[k]) * 1e3 for k, v in self.wall_clock.items()}
            log.info(
                "time over the last %d steps (ms): forward %.1f, backward %.1f, step %.1f",
                timed,
                spent["forward"],
                spent["backward"],
                spent["step"],
            )
            self._printed_clock = dict(self.wall_clock)
