"""Loss scaling for fp16 training: DeepSpeed's static and dynamic scalers and the overflow check.

float16 cannot hold gradients smaller than about 6e-8 (its smallest subnormal), so the loss is
multiplied by a scale S before backward and the fp32 gradients are divided by S before the
optimizer step. A scale too large makes some gradient overflow to inf/nan; then the step is
skipped and the scale lowered. This module holds the scale and its update rule; the engine
owns the rest (multiplying the loss, unscaling, skipping the step).

The rules are those of DeepSpeed 0.19.8's ``deepspeed/runtime/fp16/loss_scaler.py`` (the tests
drive both on random overflow sequences and compare every step):

- ``LossScaler`` (static, ``fp16.loss_scale > 0``): the scale never changes.
- ``DynamicLossScaler`` with ``init_scale``, ``scale_factor`` (2), ``scale_window``,
  ``min_scale``, ``delayed_shift`` (the config's ``hysteresis``), ``consecutive_hysteresis``
  and ``raise_error_at_min_scale``. ``update_scale(overflow)`` after every step:

  overflow, and ``delayed_shift == 1 or cur_hysteresis == 1``:
      if ``cur_scale == min_scale`` and ``raise_error_at_min_scale``: raise;
      else ``cur_scale = max(cur_scale / scale_factor, min_scale)``
  overflow, hysteresis left: ``cur_hysteresis -= 1`` (the scale stays)
  overflow, either way: ``last_overflow_iter = cur_iter``
  no overflow: if ``consecutive_hysteresis``: ``cur_hysteresis = delayed_shift``;
      ``stable = cur_iter - last_overflow_iter - 1``;
      if ``stable > 0 and stable % scale_window == 0``:
          if not ``consecutive_hysteresis``: ``cur_hysteresis = delayed_shift``;
          ``cur_scale *= scale_factor``
  always: ``cur_iter += 1``

  On a good step ``stable`` counts the good steps in a row *before* this one
  (``last_overflow_iter`` starts at -1), so the scale doubles on the good step that follows
  ``scale_window`` good steps: after ``scale_window + 1`` good steps from the start or from an
  overflow. A scale cut does not refill the hysteresis: only growth does (or any good step,
  when consecutive).

DeepSpeed's stage-0 ``FP16_Optimizer`` uses the same rule without hysteresis and without the
error at the minimum: ``delayed_shift=1, raise_error_at_min_scale=False`` here.

``build_loss_scaler`` turns the config's ``LossScaleSettings`` (``Config.loss_scaler()``, which
resolves the stage) into a scaler. ``has_inf_or_nan`` and ``overflow_flag`` check one rank's
gradient slice; the engine all-reduces the flag with max so that every rank takes the same
decision. The overflow log lines are DeepSpeed's, without its "[deepspeed]" and rank prefix.
"""

from __future__ import annotations

import logging
import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from zerosim.backend import StandardNamespace, item, xp_of


@dataclass(frozen=True)
class LossScaleSettings:
    """The numbers a loss scaler starts from: what DeepSpeed's scaler would be built with."""

    dynamic: bool
    init_scale: float
    scale_window: int
    min_scale: float
    hysteresis: int
    consecutive_hysteresis: bool
    raise_error_at_min_scale: bool = True


logger = logging.getLogger(__name__)

# Elements checked per isfinite call: bounds the boolean temporary to 1 MiB.
CHECK_BLOCK = 1 << 20


class LossScaleError(RuntimeError):
    """The dynamic loss scale would have to go below its minimum: training cannot continue."""


def _positive(name: str, value: Any) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _count(name: str, value: Any) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


class LossScalerBase(ABC):
    """What the engine asks of any scaler: the current scale and one update per step."""

    dynamic: bool = False

    def __init__(self, cur_scale: float, name: str = "init_scale") -> None:
        # the scale the next loss is multiplied by
        self.cur_scale: float = _positive(name, cur_scale)

    @property
    def loss_scale(self) -> float:
        """The factor the loss is multiplied by before backward."""
        return self.cur_scale

    @abstractmethod
    def update_scale(self, overflow: bool) -> None:
        """Called once per optimizer step with the agreed overflow flag."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Plain Python scalars (JSON-friendly) that ``load_state_dict`` restores."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore counters and settings from ``state_dict()`` (the checkpoint's settings win,
        as in DeepSpeed, which pickles the whole scaler object into the checkpoint)."""
        kind = "dynamic" if self.dynamic else "static"
        if state.get("type") != kind:
            raise ValueError(
                f"state['type'] is {state.get('type')!r}; this {type(self).__name__} loads "
                f"only {kind!r} states (use scaler_from_state_dict to rebuild the right kind)"
            )
        self._restore(state)

    @abstractmethod
    def _restore(self, state: Mapping[str, Any]) -> None: ...

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.state_dict().items() if k != "type")
        return f"{type(self).__name__}({fields})"


class LossScaler(LossScalerBase):
    """Static loss scale (``fp16.loss_scale > 0``; 1.0 without fp16): never changes.

    The engine still checks for overflow and skips such a step, as DeepSpeed's ZeRO
    optimizers do; only the scale stays where it is.
    """

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__(scale, "scale")

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            logger.warning(
                "OVERFLOW! Skipping step. Gradients are non-finite, weights were not updated."
            )

    def state_dict(self) -> dict[str, Any]:
        return {"type": "static", "cur_scale": self.cur_scale}

    def _restore(self, state: Mapping[str, Any]) -> None:
        self.cur_scale = _positive("state['cur_scale']", state["cur_scale"])


class DynamicLossScaler(LossScalerBase):
    """DeepSpeed's dynamic scale: divide on overflow (after ``delayed_shift`` overflows),
    multiply after ``scale_window`` overflow-free steps. The defaults are those of the fp16
    section (2**16, window 1000, minimum 1, hysteresis 2), as DeepSpeed 0.19.8 builds it."""

    dynamic = True

    def __init__(
        self,
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        delayed_shift: int = 2,
        consecutive_hysteresis: bool = False,
        raise_error_at_min_scale: bool = True,
    ) -> None:
        super().__init__(init_scale)
        # the scale is multiplied or divided by this
        self.scale_factor: float = _positive("scale_factor", scale_factor)
        if self.scale_factor <= 1.0:
            raise ValueError(f"scale_factor must be > 1, got {scale_factor!r}")
        # steps without overflow before the scale grows
        self.scale_window: int = _count("scale_window", scale_window)
        # the scale never falls below this
        self.min_scale: float = _positive("min_scale", min_scale)
        # hysteresis: overflows tolerated before the scale falls
        self.delayed_shift: int = _count("delayed_shift", delayed_shift)
        # refill the hysteresis after a clean step
        self.consecutive_hysteresis: bool = bool(consecutive_hysteresis)
        # an overflow at min_scale raises
        self.raise_error_at_min_scale: bool = bool(raise_error_at_min_scale)
        self.cur_iter: int = 0  # steps so far
        self.last_overflow_iter: int = -1  # the step of the last overflow (-1: none)
        self.cur_hysteresis: int = self.delayed_shift  # overflows left before the scale falls

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise LossScaleError(
                        f"gradient overflow at iteration {self.cur_iter} with the loss scale "
                        f"already at its minimum ({self.cur_scale} == min_loss_scale "
                        f"{self.min_scale}): the gradients are inf/nan even unscaled. Look for "
                        "a diverging run (lower the learning rate, clip gradients), bad input "
                        "data, or lower fp16.min_loss_scale; bf16 needs no loss scaling."
                    )
                next_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
                logger.info(
                    "OVERFLOW! Skipping step. Attempted loss scale: %d, reducing to %d",
                    self.cur_scale,
                    next_scale,
                )
                self.cur_scale = next_scale
            else:
                logger.info(
                    "OVERFLOW! Skipping step. Attempted loss scale: %d, but hysteresis is %d. "
                    "Reducing hysteresis to %d",
                    self.cur_scale,
                    self.cur_hysteresis,
                    self.cur_hysteresis - 1,
                )
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                logger.info(
                    "Consecutive hysteresis is enabled. Restoring hysteresis to %d",
                    self.delayed_shift,
                )
                self.cur_hysteresis = self.delayed_shift
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "type": "dynamic",
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
            "scale_factor": self.scale_factor,
            "scale_window": self.scale_window,
            "min_scale": self.min_scale,
            "delayed_shift": self.delayed_shift,
            "consecutive_hysteresis": self.consecutive_hysteresis,
            "raise_error_at_min_scale": self.raise_error_at_min_scale,
        }

    def _restore(self, state: Mapping[str, Any]) -> None:
        missing = sorted(set(self.state_dict()) - set(state))
        if missing:
            raise ValueError(f"dynamic loss scaler state lacks keys {missing}")
        fresh = DynamicLossScaler(
            state["cur_scale"],
            state["scale_factor"],
            state["scale_window"],
            state["min_scale"],
            state["delayed_shift"],
            state["consecutive_hysteresis"],
            state["raise_error_at_min_scale"],
        )  # validates the settings before anything of self changes
        fresh.cur_iter = int(state["cur_iter"])
        fresh.last_overflow_iter = int(state["last_overflow_iter"])
        fresh.cur_hysteresis = _count("state['cur_hysteresis']", state["cur_hysteresis"])
        self.__dict__.update(fresh.__dict__)


def build_loss_scaler(settings: LossScaleSettings | None) -> LossScalerBase:
    """The scaler for ``Config.loss_scaler()``: None (bf16 or full precision) → static 1.0,
    as DeepSpeed's ``CreateLossScaler`` does for non-fp16 dtypes."""
    if settings is None:
        return LossScaler(1.0)
    if not isinstance(settings, LossScaleSettings):
        raise TypeError(f"settings must be a LossScaleSettings or None, got {settings!r}")
    if not settings.dynamic:
        return LossScaler(settings.init_scale)
    return DynamicLossScaler(
        init_scale=settings.init_scale,
        scale_window=settings.scale_window,
        min_scale=settings.min_scale,
        delayed_shift=settings.hysteresis,
        consecutive_hysteresis=settings.consecutive_hysteresis,
        raise_error_at_min_scale=settings.raise_error_at_min_scale,
    )


def scaler_from_state_dict(state: Mapping[str, Any]) -> LossScalerBase:
    """A new scaler of the kind ``state`` records, restored from it."""
    kinds = {"static": LossScaler, "dynamic": DynamicLossScaler}
    kind = state.get("type") if isinstance(state, Mapping) else None
    if kind not in kinds:
        raise ValueError(f"state['type'] must be one of {sorted(kinds)}, got {kind!r}")
    scaler = kinds[kind]()
    scaler.load_state_dict(state)
    return scaler


def has_inf_or_nan(x: Any, block_size: int = CHECK_BLOCK) -> bool:
    """True when any element of ``x`` is +inf, -inf or nan (numpy or cupy, any float dtype).

    Exact: ``isfinite`` on blocks of ``block_size`` elements, so the boolean temporary is
    one block, never the whole array. On cupy the per-block answers are combined on the
    device and read back once. (DeepSpeed instead tests ``float(x.float().sum())``: a sum
    is inf/nan whenever an element is — inf + finite = inf, inf + -inf = nan, nan
    propagates — so it never misses an overflow, but it can flag a finite array whose
    sum exceeds the accumulator's range, e.g. two float16 65504s summed in float16, or
    float32 values near 3.4e38 summed in float32. Accumulating in a wider dtype makes that
    false alarm practically impossible; the block check makes it impossible.)
    """
    block_size = _count("block_size", block_size)
    xp = xp_of(x)
    if isinstance(xp, StandardNamespace):  # the Array API standard: one device reduction
        return not item(xp.all(xp.isfinite(x)))
    if x.ndim == 0 or x.flags.c_contiguous:
        x = x.reshape(-1)  # a view: no copy for contiguous arrays
    # Otherwise blocks of whole rows along axis 0 (views of a strided array).
    row = max(1, x.size // max(1, x.shape[0]))
    step = max(1, block_size // row)
    finite = None
    for start in range(0, x.shape[0], step):
        block_finite = xp.isfinite(x[start : start + step]).all()
        finite = block_finite if finite is None else xp.logical_and(finite, block_finite)
    return finite is not None and not bool(finite)


def overflow_flag(arrays: Iterable[Any]) -> float:
    """1.0 if any array (``None`` entries skipped) holds inf/nan, else 0.0: the value each
    rank contributes to the engine's all-reduce(max) over its own gradient slices."""
    for x in arrays:
        if x is not None and has_inf_or_nan(x):
            return 1.0
    return 0.0
