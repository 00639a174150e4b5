"""DeepSpeed's learning-rate schedulers (deepspeed/runtime/lr_schedules.py, 0.19.8 semantics).

These are what a DeepSpeed JSON ``"scheduler"`` section names, with DeepSpeed's parameter
names and defaults. Unlike torch's schedulers they count *batches*: ``last_batch_iteration``
starts at -1, each ``step()`` adds one, and iteration k's value is written to the groups
(the DeepSpeed engine steps them after every optimizer step). ``state_dict()`` holds only
``last_batch_iteration``. Import them from ``zerosim.optim.lr_scheduler``. The tests drive
each against DeepSpeed's own class over thousands of steps on a grid of parameters.

Deviations from DeepSpeed, all in the direction of failing fast: an unknown ``warmup_type``
raises ValueError (DeepSpeed logs a warning and uses 'log'), negative learning rates, ratios,
rates, momenta or step counts raise ValueError (DeepSpeed writes them into the optimizer), so
do ones that are not finite real numbers (a string, a bool, NaN, infinity), and
LRRangeTest's ``lr_range_test_staircase`` must be true/false or 0/1 (DeepSpeed tests any
value for truth, so the string 'false' turns it on).
"""

from __future__ import annotations

import logging
import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

WARMUP_TYPES = ("log", "linear")


def per_group(name: str, optimizer: Any, value: Any) -> list[Any]:
    """One value per param group: a list/tuple must match the group count, a scalar repeats."""
    n_groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n_groups:
            raise ValueError(
                f"{name} must be one value or one per param group ({n_groups}); "
                f"got {len(value)} values"
            )
        return list(value)
    return [value] * n_groups


def _check_non_negative(**values: Any) -> None:
    """Each value (or each of a per-group list) is a finite real number >= 0, not a bool."""
    for name, value in values.items():
        for v in value if isinstance(value, (list, tuple)) else [value]:
            number = isinstance(v, numbers.Real) and not isinstance(v, bool)
            if not number or not math.isfinite(v) or v < 0:
                raise ValueError(
                    f"{name} must be a finite number >= 0 (or one per param group); got {value!r}"
                )


def _check_steps(minimum: int = 0, **values: Any) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}")


def _check_warmup_type(warmup_type: Any) -> None:
    if warmup_type not in WARMUP_TYPES:
        raise ValueError(f"warmup_type must be one of {WARMUP_TYPES}; got {warmup_type!r}")


def _warmup_fraction(warmup_type: str, k: int, n_warmup: int) -> float:
    """Warmup progress at iteration k < n_warmup: log: ln(k+1)/ln(n_warmup); linear: k/n_warmup."""
    if warmup_type == "log":
        return (1.0 / math.log(n_warmup)) * math.log(k + 1)
    return k / n_warmup


class _BatchScheduler(ABC):
    """Shared counter/state logic: ``step()`` sets iteration k and writes ``get_lr()``."""

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        if not isinstance(getattr(optimizer, "param_groups", None), list):
            raise TypeError(
                f"optimizer must have a 'param_groups' list; got {type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = [g["lr"] for g in optimizer.param_groups]

    @abstractmethod
    def get_lr(self) -> list[float]: ...

    def _write(self, lrs: list[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to ``last_batch_iteration`` (default: the next one) and write its lrs."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._write(self.get_lr())

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_batch_iteration = state_dict["last_batch_iteration"]


class LRRangeTest(_BatchScheduler):
    """The learning-rate range test (Smith, arXiv:1803.09820): lr grows from a floor without
    bound; the lr at which the loss starts to diverge bounds a good cyclic schedule.

    With S = lr_range_test_step_size, r = lr_range_test_step_rate, k = last_batch_iteration:
        lr_k = min_lr * (1 + r * i_k),
        i_k = (k + 1) / S  (continuous)  or  floor((k + 1) / S)  (lr_range_test_staircase).
    The floor may be one value or one per param group. Construction (k = -1) writes it.
    """

    def __init__(
        self,
        optimizer: Any,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = per_group("lr_range_test_min_lr", optimizer, lr_range_test_min_lr)
        _check_non_negative(
            lr_range_test_min_lr=lr_range_test_min_lr,
            lr_range_test_step_rate=lr_range_test_step_rate,
        )
        _check_steps(1, lr_range_test_step_size=lr_range_test_step_size)
        staircase = lr_range_test_staircase
        if not isinstance(staircase, int) or staircase not in (0, 1):
            raise ValueError(
                f"lr_range_test_staircase must be true, false, 0 or 1; got {staircase!r}"
            )
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = bool(staircase)
        if last_batch_iteration == -1:
            self._write(list(self.min_lr))

    def _interval(self) -> float:
        batches = self.last_batch_iteration + 1
        if self.staircase:
            return math.floor(float(batches) / self.step_size)
        return float(batches) / self.step_size

    def get_lr(self) -> list[float]:
        increase = 1 + self.step_rate * self._interval()
        return [lo * increase for lo in self.min_lr]


class WarmupLR(_BatchScheduler):
    """Warm up from warmup_min_lr to warmup_max_lr over warmup_num_steps, then hold.

    With N = max(2, warmup_num_steps) and k = last_batch_iteration:
        lr_k = min_lr + (max_lr - min_lr) * gamma_k,
        gamma_k = ln(k + 1) / ln(N)  ('log')  or  k / N  ('linear')  for k < N, else 1.
    warmup_max_lr None (the default) is each group's lr at construction. Construction
    (k = -1) writes warmup_min_lr into the groups.
    """

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = [g["lr"] for g in optimizer.param_groups]
        _check_non_negative(warmup_min_lr=warmup_min_lr, warmup_max_lr=warmup_max_lr)
        _check_steps(1, warmup_num_steps=warmup_num_steps)
        _check_warmup_type(warmup_type)
        self.min_lrs = per_group("warmup_min_lr", optimizer, warmup_min_lr)
        self.max_lrs = per_group("warmup_max_lr", optimizer, warmup_max_lr)
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs, strict=True)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        if last_batch_iteration == -1:
            self._write(self.get_lr())

    def _gamma(self) -> float:
        k = self.last_batch_iteration
        if k < self.warmup_num_steps:
            return _warmup_fraction(self.warmup_type, k, self.warmup_num_steps)
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay back to warmup_min_lr at total_num_steps.

    gamma_k as WarmupLR's for k < N; after: max(0, (T - k) / max(1, T - N)), T = total_num_steps.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        _check_steps(total_num_steps=total_num_steps)
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
            last_batch_iteration,
        )  # fmt: skip
        if total_num_steps < self.warmup_num_steps:
            logger.warning(
                "total_num_steps %d is less than warmup_num_steps %d",
                total_num_steps,
                warmup_num_steps,
            )

    def _gamma(self) -> float:
        k, n, total = self.last_batch_iteration, self.warmup_num_steps, self.total_num_steps
        if k < n:
            return _warmup_fraction(self.warmup_type, k, n)
        return max(0.0, float(total - k) / float(max(1.0, total - n)))


class WarmupCosineLR(_BatchScheduler):
    """Warm up, then cosine-decay, as ratios of each group's lr at construction (lr_0).

    With N = max(2, warmup_num_steps), T = total_num_steps, k = last_batch_iteration:
      k < N:  ratio = warmup_min_ratio + (1 - warmup_min_ratio) * f_k,  f_k as in WarmupLR;
      k >= N: ratio = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi p)) / 2)
              with p = min(1, (k - N + 1) / max(1, T - N)): from T on the ratio stays at
              cos_min_ratio (also when T <= N: no decay window, the floor at once).
    lr_k = lr_0 * ratio. Construction (k = -1) writes 0.0, as DeepSpeed does.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        _check_steps(total_num_steps=total_num_steps)
        _check_steps(1, warmup_num_steps=warmup_num_steps)
        _check_non_negative(warmup_min_ratio=warmup_min_ratio, cos_min_ratio=cos_min_ratio)
        _check_warmup_type(warmup_type)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        if total_num_steps < self.warmup_num_steps:
            logger.warning(
                "total_num_steps %d is less than warmup_num_steps %d",
                total_num_steps,
                warmup_num_steps,
            )
        self.org_lrs = [g["lr"] for g in optimizer.param_groups]
        if last_batch_iteration == -1:
            self._write(self.get_lr())

    def get_lr_ratio(self, k: int | None = None) -> float:
        """The multiplier of lr_0 at iteration k (default: ``last_batch_iteration``)."""
        k = self.last_batch_iteration if k is None else k
        n = self.warmup_num_steps
        if k < 0:
            return 0.0
        if k < n:
            fraction = _warmup_fraction(self.warmup_type, k, n)
            return self.warmup_min_ratio + fraction * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (k - n + 1) / max(1, self.total_num_steps - n))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(_BatchScheduler):
    """DeepSpeed's 1cycle: a triangle from cycle_min_lr up to cycle_max_lr and back, then decay.

    With b = k + 1, S1 = cycle_first_step_size, S2 = cycle_second_step_size (default S1),
    S = S1 + S2, r = S1 / S, x = b/S + 1 - floor(1 + b/S):
      k < S:  scale = x / r if x <= r else (x - 1) / (r - 1);
              with a stair count c > 0 for that half (cycle_first_stair_count, or
              cycle_second_stair_count, default the first): scale = floor(q) / c with
              q = (b mod S) · c / S1 in the first half, (S - b mod S) · c / S2 in the second;
              lr = min_lr + (max_lr - min_lr) * scale
              beta1 = max_mom - (max_mom - min_mom) * scale
      k >= S: d = (k - S + 1) / decay_step_size;
              lr = min_lr / (1 + decay_lr_rate * d)
              beta1 = max_mom * (1 + decay_mom_rate * d)
              (no decay, lr = min_lr and beta1 = max_mom, if decay_step_size or the rate is 0).
    The bounds may be one value or one per param group. Momentum is cycled only for Adam-like
    optimizers (``betas`` in their defaults); as in DeepSpeed the groups' betas become
    (beta1, 0.99). Construction writes cycle_min_lr and betas (cycle_min_mom, 0.99).
    """

    def __init__(
        self,
        optimizer: Any,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        _check_non_negative(
            cycle_min_lr=cycle_min_lr, cycle_max_lr=cycle_max_lr, decay_lr_rate=decay_lr_rate,
            decay_step_size=decay_step_size, cycle_min_mom=cycle_min_mom,
            cycle_max_mom=cycle_max_mom, decay_mom_rate=decay_mom_rate,
        )  # fmt: skip
        self._init_cycle(
            cycle_first_step_size,
            cycle_second_step_size,
            cycle_first_stair_count,
            cycle_second_stair_count,
        )
        self.decay_step_size = decay_step_size
        self.decay_lr_rate = decay_lr_rate
        self.decay_mom_rate = decay_mom_rate
        no_decay = math.isclose(decay_step_size, 0)
        self.skip_lr_decay = no_decay or math.isclose(decay_lr_rate, 0)
        self.skip_mom_decay = no_decay or math.isclose(decay_mom_rate, 0)
        self.min_lrs = per_group("cycle_min_lr", optimizer, cycle_min_lr)
        self.max_lrs = per_group("cycle_max_lr", optimizer, cycle_max_lr)
        self._init_momentum(optimizer, cycle_momentum, cycle_min_mom, cycle_max_mom)
        if last_batch_iteration == -1:
            self._write(list(self.min_lrs))
            if self.cycle_momentum:
                for group, betas in zip(optimizer.param_groups, self.min_moms, strict=True):
                    group["betas"] = betas

    def _init_cycle(
        self,
        first_step_size: int,
        second_step_size: int | None,
        first_stair_count: int,
        second_stair_count: int | None,
    ) -> None:
        """The triangle's two halves (S1, S2, S = S1 + S2, r = S1 / S) and their stair counts,
        as DeepSpeed's ``_initialize_cycle``."""
        first = float(first_step_size)
        second = first if second_step_size is None else float(second_step_size)
        if first <= 0 or second < 0:
            raise ValueError(
                "cycle_first_step_size must be > 0 and cycle_second_step_size >= 0; "
                f"got {first_step_size} and {second_step_size}"
            )
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = first_stair_count
        self.second_stair_count = (
            first_stair_count if second_stair_count is None else second_stair_count
        )

    def _init_momentum(
        self,
        optimizer: Any,
        cycle_momentum: bool,
        min_mom: float | Sequence[float],
        max_mom: float | Sequence[float],
    ) -> None:
        """The (beta1, 0.99) bounds per group, or no momentum cycling for an optimizer without
        ``betas`` (as DeepSpeed's ``_initialize_momentum``)."""
        defaults = getattr(optimizer, "defaults", None) or optimizer.param_groups[0]
        if cycle_momentum and "betas" not in defaults:
            logger.warning(
                "cycle_momentum is disabled: %s has no 'betas' in its defaults",
                type(optimizer).__name__,
            )
            cycle_momentum = False
        self.cycle_momentum = cycle_momentum
        if cycle_momentum:
            self.min_moms = [(m, 0.99) for m in per_group("cycle_min_mom", optimizer, min_mom)]
            self.max_moms = [(m, 0.99) for m in per_group("cycle_max_mom", optimizer, max_mom)]

    def _scale(self) -> float:
        b = self.last_batch_iteration + 1
        x = 1.0 + b / self.total_size - math.floor(1 + b / self.total_size)
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:  # from the integer offset, so that a stair edge is exact
            at = b % self.total_size
            if at <= self.first_step_size:
                position = at * stairs / self.first_step_size
            else:
                position = (self.total_size - at) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def _decay_interval(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [
                lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)
            ]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * self._decay_interval()
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """The groups' (beta1, beta2) at the current iteration, or None without cycle_momentum."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [
                (hi[0] - (hi[0] - lo[0]) * scale, lo[1])
                for lo, hi in zip(self.min_moms, self.max_moms, strict=True)
            ]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * self._decay_interval()
        return [(hi[0] * factor, hi[1]) for hi in self.max_moms]

    def step(self, last_batch_iteration: int | None = None) -> None:
        super().step(last_batch_iteration)
        momenta = self.get_mom()
        if momenta is not None:
            for group, betas in zip(self.optimizer.param_groups, momenta, strict=True):
                group["betas"] = betas
