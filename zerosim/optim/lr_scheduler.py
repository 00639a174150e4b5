"""Learning-rate schedulers with torch.optim.lr_scheduler's semantics, plus a config builder.

A scheduler rewrites ``group["lr"]`` in an optimizer's ``param_groups`` once per ``step()``.
Any object with a ``param_groups`` list of dicts holding ``"lr"`` works (duck typing), so the
same schedulers drive zerosim's torch-like optimizers and the ZeRO engine's shard optimizer.

Conventions shared with torch (so a learner's torch intuition carries over, and the values
are bit-for-bit torch's):

* Construction performs an initial step: ``last_epoch`` goes from -1 to 0, each group gets
  ``initial_lr`` (its lr at that moment, kept if already present) and ``base_lrs`` records it.
* ``step()`` increments ``last_epoch`` (t below) and sets the new lrs; ``get_last_lr()``
  returns them. Call it after ``optimizer.step()``.
* Most schedulers are *chainable*: they compute lr_t from the group's current lr
  (a recursive form), so two schedulers on one optimizer compose multiplicatively.
  Where a closed form exists it is written next to the recursive one.

* ``state_dict()`` holds every attribute but the optimizer. A user function in it (LambdaLR's
  and MultiplicativeLR's ``lr_lambda``, CyclicLR's ``scale_fn``) is saved as torch saves it:
  a plain function (``def`` or ``lambda``) as None, a callable object as a copy of its
  ``__dict__``, which ``load_state_dict`` writes back into the object the scheduler was built
  with. So a state_dict pickles, and goes into a checkpoint, whatever the function.

DeepSpeed's schedulers (LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR) live in
``deepspeed_schedulers.py`` and are re-exported here; ``build_scheduler`` maps a DeepSpeed JSON
``"scheduler"`` section (DeepSpeed's or torch's type names) to an instance.
"""

from __future__ import annotations

import copy
import inspect
import math
import types
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from zerosim.optim.deepspeed_schedulers import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    per_group,
)

__all__ = [
    "LRScheduler",
    "StepLR",
    "MultiStepLR",
    "ExponentialLR",
    "CosineAnnealingLR",
    "LambdaLR",
    "MultiplicativeLR",
    "LinearLR",
    "ConstantLR",
    "PolynomialLR",
    "CosineAnnealingWarmRestarts",
    "CyclicLR",
    "SequentialLR",
    "ChainedScheduler",
    "OneCycleLR",
    "ReduceLROnPlateau",
    "LRRangeTest",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "OneCycle",
    "build_scheduler",
]


def _check_optimizer(optimizer: Any) -> None:
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise TypeError(
            f"optimizer must have a 'param_groups' list of dicts; got {type(optimizer).__name__}"
        )


class LRScheduler:
    """Base class: owns ``last_epoch``, ``base_lrs`` and writes ``get_lr()`` into the groups.

    Subclasses implement ``get_lr()`` (the recursive form, reading ``group["lr"]``) and,
    where one exists, ``_closed_form_lr()`` (from ``base_lrs``; used by SequentialLR when it
    restarts a scheduler at a milestone).
    """

    def __init__(self, optimizer: Any, last_epoch: int = -1) -> None:
        _check_optimizer(optimizer)
        self.optimizer = optimizer
        if last_epoch == -1:
            for group in optimizer.param_groups:
                group.setdefault("initial_lr", group["lr"])
        else:
            missing = [i for i, g in enumerate(optimizer.param_groups) if "initial_lr" not in g]
            if missing:
                raise KeyError(
                    f"last_epoch={last_epoch} resumes a schedule, but param_groups {missing} "
                    "have no 'initial_lr'; load the optimizer's state first or use last_epoch=-1"
                )
        self.base_lrs: list[float] = [g["initial_lr"] for g in optimizer.param_groups]
        self.last_epoch = last_epoch
        self._initial_step()

    def _initial_step(self) -> None:
        self._step_count = 0
        self._is_initial = True
        try:
            self.step()
        finally:
            self._is_initial = False

    def get_lr(self) -> list[float]:
        """The lrs for the current ``last_epoch`` (called by ``step``)."""
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        """The lrs the last ``step()`` wrote into the groups."""
        return self._last_lr

    def step(self) -> None:
        """Advance one epoch (or batch) and write the new lrs into the optimizer."""
        self._step_count += 1
        self._update_lr(None)

    def _update_lr(self, epoch: int | None) -> None:
        if epoch is None:
            self.last_epoch += 1
            lrs = self.get_lr()
        else:
            self.last_epoch = epoch
            closed_form = getattr(self, "_closed_form_lr", None)
            lrs = closed_form() if closed_form is not None else self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """Every attribute except the optimizer (copied, so later steps do not alter it)."""
        return _attributes(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore attributes saved by ``state_dict`` (the group lrs are the optimizer's job)."""
        self.__dict__.update(copy.deepcopy(state_dict))


def _current_lrs(optimizer: Any) -> list[float]:
    return [g["lr"] for g in optimizer.param_groups]


def _attributes(scheduler: Any, leave_out: tuple[str, ...] = ()) -> dict[str, Any]:
    """A copy of the scheduler's attributes but the optimizer and ``leave_out``."""
    skip = ("optimizer", *leave_out)
    return {k: copy.deepcopy(v) for k, v in scheduler.__dict__.items() if k not in skip}


def _saved_callable(fn: Callable[..., float]) -> dict[str, Any] | None:
    """What torch keeps of a user function in a state_dict: nothing (None) for a plain
    function or lambda, which cannot be pickled reliably; a copy of ``__dict__`` for a callable
    object, whose attributes are its state."""
    return None if isinstance(fn, types.FunctionType) else copy.deepcopy(fn.__dict__)


def _restore_callable(fn: Callable[..., float], saved: dict[str, Any] | None) -> None:
    """Write a ``_saved_callable`` record back into the function the scheduler was built with."""
    if saved is not None:
        fn.__dict__.update(copy.deepcopy(saved))


class _LambdaScheduler(LRScheduler):
    """Shared by LambdaLR and MultiplicativeLR: one function of the epoch per param group."""

    def __init__(
        self,
        optimizer: Any,
        lr_lambda: Callable[[int], float] | Sequence[Callable[[int], float]],
        last_epoch: int = -1,
    ) -> None:
        _check_optimizer(optimizer)
        self.lr_lambdas = per_group("lr_lambda", optimizer, lr_lambda)
        for fn in self.lr_lambdas:
            if not callable(fn):
                raise TypeError(
                    f"lr_lambda should be a function (any callable); got {type(fn).__name__} {fn!r}"
                )
        super().__init__(optimizer, last_epoch)

    def state_dict(self) -> dict[str, Any]:
        """Attributes, with each lambda saved as ``_saved_callable`` says."""
        state = _attributes(self, leave_out=("lr_lambdas",))
        state["lr_lambdas"] = [_saved_callable(fn) for fn in self.lr_lambdas]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = copy.deepcopy(state_dict)
        saved = state.pop("lr_lambdas")
        self.__dict__.update(state)
        for fn, attrs in zip(self.lr_lambdas, saved, strict=True):
            _restore_callable(fn, attrs)


class LambdaLR(_LambdaScheduler):
    """lr_t = base_lr * lr_lambda(t), one lambda for all groups or one per group (not chainable)."""

    def get_lr(self) -> list[float]:
        return [
            base * fn(self.last_epoch)
            for fn, base in zip(self.lr_lambdas, self.base_lrs, strict=True)
        ]


class MultiplicativeLR(_LambdaScheduler):
    """lr_t = lr_{t-1} * lr_lambda(t) for t > 0 (chainable); lr_0 is the group's lr.

    Closed form: lr_t = base_lr * prod_{s=1..t} lr_lambda(s).
    """

    def get_lr(self) -> list[float]:
        lrs = _current_lrs(self.optimizer)
        if self._is_initial:
            return lrs
        return [lr * fn(self.last_epoch) for fn, lr in zip(self.lr_lambdas, lrs, strict=True)]


class StepLR(LRScheduler):
    """Multiply lr by gamma every ``step_size`` epochs.

    Closed form: lr_t = base_lr * gamma ** (t // step_size).
    Recursive:   lr_t = lr_{t-1} * gamma if t > 0 and t % step_size == 0, else lr_{t-1}.
    """

    def __init__(
        self, optimizer: Any, step_size: int, gamma: float = 0.1, last_epoch: int = -1
    ) -> None:
        if not isinstance(step_size, int) or step_size < 1:
            raise ValueError(f"step_size must be an integer >= 1; got {step_size!r}")
        if gamma < 0:
            raise ValueError(f"gamma must be >= 0; got {gamma}")
        self.step_size = step_size
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self.last_epoch == 0 or self.last_epoch % self.step_size != 0:
            return _current_lrs(self.optimizer)
        return [lr * self.gamma for lr in _current_lrs(self.optimizer)]

    def _closed_form_lr(self) -> list[float]:
        return [b * self.gamma ** (self.last_epoch // self.step_size) for b in self.base_lrs]


class MultiStepLR(LRScheduler):
    """Multiply lr by gamma at each milestone epoch (a repeated milestone multiplies twice).

    Closed form: lr_t = base_lr * gamma ** (number of milestones <= t).
    Recursive:   lr_t = lr_{t-1} * gamma ** count(t in milestones).
    """

    def __init__(
        self, optimizer: Any, milestones: Iterable[int], gamma: float = 0.1, last_epoch: int = -1
    ) -> None:
        milestones = list(milestones)
        if any(not isinstance(m, int) or m < 0 for m in milestones):
            raise ValueError(f"milestones must be integers >= 0; got {milestones}")
        if gamma < 0:
            raise ValueError(f"gamma must be >= 0; got {gamma}")
        self.milestones = Counter(milestones)
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self.last_epoch not in self.milestones:
            return _current_lrs(self.optimizer)
        factor = self.gamma ** self.milestones[self.last_epoch]
        return [lr * factor for lr in _current_lrs(self.optimizer)]

    def _closed_form_lr(self) -> list[float]:
        passed = bisect_right(sorted(self.milestones.elements()), self.last_epoch)
        return [b * self.gamma**passed for b in self.base_lrs]


class ExponentialLR(LRScheduler):
    """lr_t = lr_{t-1} * gamma  (closed form: base_lr * gamma ** t)."""

    def __init__(self, optimizer: Any, gamma: float, last_epoch: int = -1) -> None:
        if gamma < 0:
            raise ValueError(f"gamma must be >= 0; got {gamma}")
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self._is_initial:
            return _current_lrs(self.optimizer)
        return [lr * self.gamma for lr in _current_lrs(self.optimizer)]

    def _closed_form_lr(self) -> list[float]:
        return [b * self.gamma**self.last_epoch for b in self.base_lrs]


class CosineAnnealingLR(LRScheduler):
    """Cosine annealing from base_lr to eta_min over T_max steps (SGDR, arXiv:1608.03983).

    Closed form: lr_t = eta_min + (base_lr - eta_min) * (1 + cos(pi t / T_max)) / 2.
    Computed, as torch does, by the recursion (which keeps it chainable)
        lr_t = eta_min + (lr_{t-1} - eta_min) * (1 + cos(pi t / T)) / (1 + cos(pi (t-1) / T)),
    except where the denominator vanishes, t - 1 - T ≡ 0 (mod 2T), where it adds
        (base_lr - eta_min) * (1 - cos(pi / T)) / 2.
    Past T_max the curve keeps going (back up, a period of 2 T_max), as torch's does.
    """

    def __init__(
        self, optimizer: Any, T_max: int, eta_min: float = 0.0, last_epoch: int = -1
    ) -> None:
        if not isinstance(T_max, int) or T_max < 1:
            raise ValueError(f"T_max must be an integer >= 1; got {T_max!r}")
        if eta_min < 0:
            raise ValueError(f"eta_min must be >= 0; got {eta_min}")
        self.T_max = T_max
        self.eta_min = eta_min
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        t, T, lo = self.last_epoch, self.T_max, self.eta_min
        lrs = _current_lrs(self.optimizer)
        if self._is_initial:
            return lrs
        if self._step_count == 1 and t > 0:  # first step after resuming: jump to the curve
            return self._closed_form_lr()
        if (t - 1 - T) % (2 * T) == 0:
            return [
                lr + (b - lo) * (1 - math.cos(math.pi / T)) / 2
                for lr, b in zip(lrs, self.base_lrs, strict=True)
            ]
        ratio = (1 + math.cos(math.pi * t / T)) / (1 + math.cos(math.pi * (t - 1) / T))
        return [ratio * (lr - lo) + lo for lr in lrs]

    def _closed_form_lr(self) -> list[float]:
        t, T, lo = self.last_epoch, self.T_max, self.eta_min
        return [lo + (b - lo) * (1 + math.cos(math.pi * t / T)) / 2 for b in self.base_lrs]


class LinearLR(LRScheduler):
    """Scale lr by a factor going linearly from start_factor to end_factor over total_iters.

    Closed form: lr_t = base_lr * (s + (e - s) * min(t, total_iters) / total_iters).
    Recursive:   lr_0 = lr * s;  lr_t = lr_{t-1} * (1 + (e - s) / (total_iters*s + (t-1)*(e - s)))
                 for 0 < t <= total_iters, unchanged after.
    """

    def __init__(
        self,
        optimizer: Any,
        start_factor: float = 1.0 / 3,
        end_factor: float = 1.0,
        total_iters: int = 5,
        last_epoch: int = -1,
    ) -> None:
        if not 0 < start_factor <= 1:
            raise ValueError(f"start_factor must be in (0, 1]; got {start_factor}")
        if not 0 <= end_factor <= 1:
            raise ValueError(f"end_factor must be in [0, 1]; got {end_factor}")
        if not isinstance(total_iters, int) or total_iters < 1:
            raise ValueError(f"total_iters must be an integer >= 1; got {total_iters!r}")
        self.start_factor = start_factor
        self.end_factor = end_factor
        self.total_iters = total_iters
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        s, e, n, t = self.start_factor, self.end_factor, self.total_iters, self.last_epoch
        lrs = _current_lrs(self.optimizer)
        if t == 0:
            return [lr * s for lr in lrs]
        if self._is_initial or t > n:
            return lrs
        return [lr * (1.0 + (e - s) / (n * s + (t - 1) * (e - s))) for lr in lrs]

    def _closed_form_lr(self) -> list[float]:
        s, e, n, t = self.start_factor, self.end_factor, self.total_iters, self.last_epoch
        return [b * (s + (e - s) * min(n, t) / n) for b in self.base_lrs]


class ConstantLR(LRScheduler):
    """Multiply lr by ``factor`` until epoch ``total_iters``, then restore it.

    Closed form: lr_t = base_lr * (factor if t < total_iters else 1).
    Recursive:   lr_0 = lr * factor;  lr_t = lr_{t-1} / factor at t == total_iters, else unchanged.
    """

    def __init__(
        self, optimizer: Any, factor: float = 1.0 / 3, total_iters: int = 5, last_epoch: int = -1
    ) -> None:
        if not 0 <= factor <= 1:
            raise ValueError(f"factor must be in [0, 1]; got {factor}")
        self.factor = factor
        self.total_iters = total_iters
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        lrs = _current_lrs(self.optimizer)
        if self.last_epoch == 0:
            return [lr * self.factor for lr in lrs]
        if self.last_epoch != self.total_iters:
            return lrs
        return [lr * (1.0 / self.factor) for lr in lrs]

    def _closed_form_lr(self) -> list[float]:
        after = self.last_epoch >= self.total_iters
        return [b * (self.factor + after * (1 - self.factor)) for b in self.base_lrs]


class PolynomialLR(LRScheduler):
    """Decay lr polynomially to 0 over ``total_iters`` epochs, then hold.

    Closed form: lr_t = base_lr * (1 - min(t, total_iters) / total_iters) ** power.
    Recursive:   lr_t = lr_{t-1} * ((1 - t/T) / (1 - (t-1)/T)) ** power for 0 < t <= T.
    """

    def __init__(
        self, optimizer: Any, total_iters: int = 5, power: float = 1.0, last_epoch: int = -1
    ) -> None:
        self.total_iters = total_iters
        self.power = power
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        t, n = self.last_epoch, self.total_iters
        lrs = _current_lrs(self.optimizer)
        if self._is_initial or t > n:
            return lrs
        factor = ((1.0 - t / n) / (1.0 - (t - 1) / n)) ** self.power
        return [lr * factor for lr in lrs]

    def _closed_form_lr(self) -> list[float]:
        t, n = self.last_epoch, self.total_iters
        return [b * (1.0 - min(n, t) / n) ** self.power for b in self.base_lrs]


class CosineAnnealingWarmRestarts(LRScheduler):
    """SGDR's cosine with restarts (arXiv:1608.03983): the cosine of CosineAnnealingLR over a
    period T_i that restarts from base_lr, each period T_mult times the last (T_0 first).

        lr_t = eta_min + (base_lr - eta_min) * (1 + cos(pi T_cur / T_i)) / 2,
    with T_cur the epochs since the last restart. Not chainable.
    """

    def __init__(
        self,
        optimizer: Any,
        T_0: int,
        T_mult: int = 1,
        eta_min: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        if not isinstance(T_0, int) or isinstance(T_0, bool) or T_0 <= 0:
            raise ValueError(f"T_0 must be a positive integer; got {T_0!r}")
        if not isinstance(T_mult, int) or isinstance(T_mult, bool) or T_mult < 1:
            raise ValueError(f"T_mult must be an integer >= 1; got {T_mult!r}")
        if not isinstance(eta_min, float | int) or isinstance(eta_min, bool):
            raise ValueError(f"eta_min must be a number; got {eta_min!r}")
        self.T_0 = self.T_i = T_0
        self.T_mult = T_mult
        self.eta_min = eta_min
        self.T_cur = last_epoch
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        cosine = (1 + math.cos(math.pi * self.T_cur / self.T_i)) / 2
        return [self.eta_min + (b - self.eta_min) * cosine for b in self.base_lrs]

    def step(self) -> None:
        self._step_count += 1
        if self.last_epoch < 0:  # the initial step: epoch 0, the first period
            self.T_i, self.T_cur, self.last_epoch = self.T_0, 0, 0
        else:
            self.last_epoch += 1
            self.T_cur += 1
            if self.T_cur >= self.T_i:  # a restart
                self.T_cur %= self.T_i
                self.T_i *= self.T_mult
        for group, lr in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
            group["lr"] = lr
        self._last_lr = _current_lrs(self.optimizer)


class CyclicLR(LRScheduler):
    """Cyclical learning rates (Smith, arXiv:1506.01186): a triangle between base_lr and max_lr.

    With S = step_size_up + step_size_down, r = step_size_up / S, cycle = floor(1 + t/S),
    x = 1 + t/S - cycle: scale = x / r if x <= r else (x - 1) / (r - 1), and
        lr_t = base_lr + (max_lr - base_lr) * scale * f,
    f = scale_fn(x): 1 ('triangular'), 1 / 2**(x - 1) ('triangular2'), gamma**x ('exp_range'),
    or the user's ``scale_fn``, with x the cycle or t (``scale_mode``; the built-in modes fix
    it: 'cycle', 'cycle', 'iterations'). With cycle_momentum, momentum (or beta1) moves the
    other way between max_momentum and base_momentum. Not chainable. A user ``scale_fn`` goes
    into ``state_dict()`` as torch puts it there (see the module docstring).
    """

    def __init__(
        self,
        optimizer: Any,
        base_lr: float | Sequence[float],
        max_lr: float | Sequence[float],
        step_size_up: int = 2000,
        step_size_down: int | None = None,
        mode: str = "triangular",
        gamma: float = 1.0,
        scale_fn: Callable[[float], float] | None = None,
        scale_mode: str = "cycle",
        cycle_momentum: bool = True,
        base_momentum: float | Sequence[float] = 0.8,
        max_momentum: float | Sequence[float] = 0.9,
        last_epoch: int = -1,
    ) -> None:
        _check_optimizer(optimizer)
        base_lrs = per_group("base_lr", optimizer, base_lr)
        self.max_lrs = per_group("max_lr", optimizer, max_lr)
        if mode not in ("triangular", "triangular2", "exp_range") and scale_fn is None:
            raise ValueError(f"mode must be triangular, triangular2 or exp_range; got {mode!r}")
        up = float(step_size_up)
        down = up if step_size_down is None else float(step_size_down)
        self.total_size = up + down
        self.step_ratio = up / self.total_size
        self.mode, self.gamma = mode, gamma
        self._scale_fn_custom = scale_fn  # torch's attribute name, so state_dicts interchange
        self.scale_mode = (
            scale_mode
            if scale_fn is not None
            else ("iterations" if mode == "exp_range" else "cycle")
        )
        self.cycle_momentum = cycle_momentum
        if cycle_momentum:
            defaults = getattr(optimizer, "defaults", None) or optimizer.param_groups[0]
            if "momentum" not in defaults and "betas" not in defaults:
                raise ValueError(
                    "cycle_momentum=True needs an optimizer with 'momentum' or 'betas'; "
                    f"its defaults have {sorted(defaults)}"
                )
            self.use_beta1 = "betas" in defaults
            self.base_momentums = per_group("base_momentum", optimizer, base_momentum)
            self.max_momentums = per_group("max_momentum", optimizer, max_momentum)
        self.optimizer = optimizer
        if last_epoch == -1:
            for group, lr in zip(optimizer.param_groups, base_lrs, strict=True):
                group["lr"] = lr
            if cycle_momentum:
                for i, group in enumerate(optimizer.param_groups):
                    self._set_momentum(group, self.max_momentums[i])
                    group["max_momentum"] = self.max_momentums[i]
                    group["base_momentum"] = self.base_momentums[i]
        super().__init__(optimizer, last_epoch)
        self.base_lrs = base_lrs

    def _set_momentum(self, group: dict, value: float) -> None:
        if self.use_beta1:
            group["betas"] = (value, *group["betas"][1:])
        else:
            group["momentum"] = value

    def scale_fn(self, x: float) -> float:
        """The height of the triangle at x (a cycle number or an iteration, per scale_mode)."""
        if self._scale_fn_custom is not None:
            return self._scale_fn_custom(x)
        if self.mode == "triangular":
            return 1.0
        if self.mode == "triangular2":
            return 1 / (2.0 ** (x - 1))
        return self.gamma**x

    def get_lr(self) -> list[float]:
        cycle = math.floor(1 + self.last_epoch / self.total_size)
        x = 1.0 + self.last_epoch / self.total_size - cycle
        scale = x / self.step_ratio if x <= self.step_ratio else (x - 1) / (self.step_ratio - 1)
        factor = self.scale_fn(cycle if self.scale_mode == "cycle" else self.last_epoch)
        lrs = [
            b + (hi - b) * scale * factor for b, hi in zip(self.base_lrs, self.max_lrs, strict=True)
        ]
        if self.cycle_momentum:
            pairs = zip(self.base_momentums, self.max_momentums, strict=True)
            momenta = [hi - (hi - lo) * scale * factor for lo, hi in pairs]
            for group, momentum in zip(self.optimizer.param_groups, momenta, strict=True):
                self._set_momentum(group, momentum)
        return lrs

    def state_dict(self) -> dict[str, Any]:
        """Attributes, with a user ``scale_fn`` saved as ``_saved_callable`` says."""
        state = _attributes(self, leave_out=("_scale_fn_custom",))
        fn = self._scale_fn_custom
        state["_scale_fn_custom"] = None if fn is None else _saved_callable(fn)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = copy.deepcopy(state_dict)
        saved = state.pop("_scale_fn_custom", None)
        state.pop("scale_fn", None)  # the key of earlier zerosim versions: the function itself
        if saved is not None and self._scale_fn_custom is None:
            raise ValueError(
                "state_dict holds the attributes of a scale_fn object, but this CyclicLR was "
                "built without scale_fn; build it with the same kind of scale_fn object"
            )
        self.__dict__.update(state)
        if self._scale_fn_custom is not None:
            _restore_callable(self._scale_fn_custom, saved)


class _SchedulerOfSchedulers(LRScheduler):
    """Shared by SequentialLR and ChainedScheduler: children on one optimizer.

    ``state_dict()`` nests the children's; setting ``optimizer`` re-points every child (the
    engine does so when it is given a scheduler built on the user's optimizer).
    """

    _schedulers: list[Any]

    @property
    def optimizer(self) -> Any:
        return self._optimizer

    @optimizer.setter
    def optimizer(self, optimizer: Any) -> None:
        self._optimizer = optimizer
        for child in self._schedulers:
            child.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        state = _attributes(self, leave_out=("_optimizer", "_schedulers"))
        state["_schedulers"] = [s.state_dict() for s in self._schedulers]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = copy.deepcopy(state_dict)
        children = state.pop("_schedulers")
        if len(children) != len(self._schedulers):
            raise ValueError(
                f"state_dict holds {len(children)} schedulers; this "
                f"{type(self).__name__} has {len(self._schedulers)}"
            )
        self.__dict__.update(state)
        for sched, child_state in zip(self._schedulers, children, strict=True):
            sched.load_state_dict(child_state)


def _check_children(kind: str, optimizer: Any, schedulers: Sequence[Any]) -> None:
    """torch's rules: at least one; each has an optimizer, the same one; no ReduceLROnPlateau."""
    if len(schedulers) < 1:
        raise ValueError(f"{kind} needs at least one scheduler in schedulers; got none")
    for i, sched in enumerate(schedulers):
        if not hasattr(sched, "optimizer"):
            raise TypeError(
                f"schedulers[{i}] of {kind} must be a scheduler with an 'optimizer' attribute; "
                f"got {type(sched).__name__}"
            )
        if isinstance(sched, ReduceLROnPlateau):
            raise ValueError(
                f"schedulers[{i}] of {kind} is ReduceLROnPlateau, which cannot be stepped "
                "without a metric; step it on its own"
            )
        if sched.optimizer is not optimizer:
            raise ValueError(
                f"schedulers[{i}] of {kind} ({type(sched).__name__}) drives another optimizer; "
                "all must drive the same one"
            )


class SequentialLR(_SchedulerOfSchedulers):
    """Run ``schedulers[i]`` between ``milestones[i-1]`` and ``milestones[i]`` (torch semantics).

    At construction the groups go back to ``initial_lr``, every child's initial step is
    undone and the first child restarts. At milestone m_i the next child restarts from its
    closed form at its epoch 0 (e.g. LinearLR gives base_lr * start_factor); in between,
    only the active child steps.
    """

    def __init__(
        self,
        optimizer: Any,
        schedulers: Sequence[LRScheduler],
        milestones: Sequence[int],
        last_epoch: int = -1,
    ) -> None:
        _check_optimizer(optimizer)
        _check_children("SequentialLR", optimizer, schedulers)
        if len(milestones) != len(schedulers) - 1:
            raise ValueError(
                f"milestones must have len(schedulers) - 1 = {len(schedulers) - 1} entries; "
                f"got {len(milestones)}"
            )
        self._schedulers = list(schedulers)
        self.optimizer = optimizer
        self._milestones = list(milestones)
        self.last_epoch = last_epoch + 1
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"]
        for sched in self._schedulers:
            _undo_initial_step(sched)
        first = self._schedulers[bisect_right(self._milestones, 0)]
        first._initial_step()
        self._last_lr = first.get_last_lr()

    def step(self) -> None:
        self.last_epoch += 1
        idx = bisect_right(self._milestones, self.last_epoch)
        sched = self._schedulers[idx]
        if idx > 0 and self._milestones[idx - 1] == self.last_epoch:
            sched._update_lr(0)
        else:
            sched.step()
        self._last_lr = sched.get_last_lr()


class ChainedScheduler(_SchedulerOfSchedulers):
    """Step several chainable schedulers as one: ``step()`` steps each, in the order given.

    Chainable schedulers compute lr_t from the group's current lr, so their factors multiply;
    ConstantLR(factor=0.1, total_iters=20) chained with ExponentialLR(gamma=0.9) gives
    lr_t = base_lr * 0.1 * 0.9**t for t < 20, then base_lr * 0.9**t. Nothing is undone at
    construction (the children have taken their initial steps). ``optimizer`` defaults to
    the children's; ``get_last_lr()`` is the groups' lrs after the last child stepped.
    """

    def __init__(self, schedulers: Sequence[LRScheduler], optimizer: Any = None) -> None:
        if len(schedulers) >= 1 and optimizer is None:
            optimizer = getattr(schedulers[0], "optimizer", None)
        _check_children("ChainedScheduler", optimizer, schedulers)
        self._schedulers = list(schedulers)
        self.optimizer = optimizer
        self._last_lr = _current_lrs(optimizer)

    def step(self) -> None:  # type: ignore[override]
        for sched in self._schedulers:
            sched.step()
        self._last_lr = _current_lrs(self.optimizer)


def _undo_initial_step(sched: Any) -> None:
    if hasattr(sched, "_schedulers"):
        for child in sched._schedulers:
            _undo_initial_step(child)
    elif hasattr(sched, "last_epoch"):
        sched.last_epoch -= 1


def _anneal(strategy: str, start: float, end: float, pct: float) -> float:
    """'cos': end + (start - end)/2 * (1 + cos(pi pct));  'linear': start + (end - start) pct."""
    if strategy == "cos":
        return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
    return (end - start) * pct + start


def _one_cycle_phases(total_steps: int, pct_start: float, three_phase: bool) -> list[dict]:
    """The 1cycle phases as torch's OneCycleLR lists them: the step each ends at, and the group
    keys its learning rate and momentum start and end at."""
    up_end = float(pct_start * total_steps) - 1
    last = total_steps - 1
    if three_phase:
        phases = [
            (up_end, "initial_lr", "max_lr", "max_momentum", "base_momentum"),
            (float(2 * pct_start * total_steps) - 2, "max_lr", "initial_lr",
             "base_momentum", "max_momentum"),
            (last, "initial_lr", "min_lr", "max_momentum", "max_momentum"),
        ]  # fmt: skip
    else:
        phases = [
            (up_end, "initial_lr", "max_lr", "max_momentum", "base_momentum"),
            (last, "max_lr", "min_lr", "base_momentum", "max_momentum"),
        ]
    keys = ("end_step", "start_lr", "end_lr", "start_momentum", "end_momentum")
    return [dict(zip(keys, phase, strict=True)) for phase in phases]


class OneCycleLR(LRScheduler):
    """The 1cycle policy (Smith & Topin, arXiv:1708.07120), fastai/torch flavour.

    With N = total_steps, p = pct_start, initial = max_lr / div_factor and
    min = initial / final_div_factor, lr is annealed ('cos' or 'linear') through phases
    ending at step e_i, pct = (t - e_{i-1}) / (e_i - e_{i-1}):
      two phases:   initial -> max_lr  until e_1 = pN - 1;  max_lr -> min  until N - 1.
      three_phase:  initial -> max_lr  until pN - 1;  max_lr -> initial until 2pN - 2;
                    initial -> min until N - 1.
    With cycle_momentum, momentum moves the opposite way between max_momentum and
    base_momentum (and stays at max_momentum in the third phase). It is written to
    ``group["betas"][0]`` if the optimizer has betas (Adam-like), else ``group["momentum"]``.
    Stepping past N raises ValueError. Not chainable.
    """

    def __init__(
        self,
        optimizer: Any,
        max_lr: float | Sequence[float],
        total_steps: int | None = None,
        epochs: int | None = None,
        steps_per_epoch: int | None = None,
        pct_start: float = 0.3,
        anneal_strategy: str = "cos",
        cycle_momentum: bool = True,
        base_momentum: float | Sequence[float] = 0.85,
        max_momentum: float | Sequence[float] = 0.95,
        div_factor: float = 25.0,
        final_div_factor: float = 1e4,
        three_phase: bool = False,
        last_epoch: int = -1,
    ) -> None:
        _check_optimizer(optimizer)
        self.optimizer = optimizer
        self.total_steps = _one_cycle_total_steps(total_steps, epochs, steps_per_epoch)
        if not 0 <= pct_start <= 1:
            raise ValueError(f"pct_start must be in [0, 1]; got {pct_start}")
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"anneal_strategy must be 'cos' or 'linear'; got {anneal_strategy!r}")
        self._anneal_func_type = anneal_strategy
        self._schedule_phases = _one_cycle_phases(self.total_steps, pct_start, three_phase)
        max_lrs = per_group("max_lr", optimizer, max_lr)
        self.cycle_momentum = cycle_momentum
        if cycle_momentum:  # validate everything before the groups are touched
            defaults = getattr(optimizer, "defaults", None) or optimizer.param_groups[0]
            if "momentum" not in defaults and "betas" not in defaults:
                raise ValueError(
                    "cycle_momentum=True needs an optimizer with 'momentum' or 'betas'; "
                    f"its defaults have {sorted(defaults)}"
                )
            self.use_beta1 = "betas" in defaults
            highs = per_group("max_momentum", optimizer, max_momentum)
            lows = per_group("base_momentum", optimizer, base_momentum)
        if last_epoch == -1:
            for i, group in enumerate(optimizer.param_groups):
                group["initial_lr"] = max_lrs[i] / div_factor
                group["max_lr"] = max_lrs[i]
                group["min_lr"] = group["initial_lr"] / final_div_factor
                if cycle_momentum:
                    self._set_momentum(group, highs[i])
                    group["max_momentum"] = highs[i]
                    group["base_momentum"] = lows[i]
        super().__init__(optimizer, last_epoch)

    def _set_momentum(self, group: dict, value: float) -> None:
        if self.use_beta1:
            group["betas"] = (value, *group["betas"][1:])
        else:
            group["momentum"] = value

    def get_lr(self) -> list[float]:
        t = self.last_epoch
        if t > self.total_steps:
            raise ValueError(f"stepped {t} times, past total_steps={self.total_steps}")
        lrs = []
        for group in self.optimizer.param_groups:
            start = 0.0
            for i, phase in enumerate(self._schedule_phases):
                end = phase["end_step"]
                if t <= end or i == len(self._schedule_phases) - 1:
                    pct = (t - start) / (end - start)
                    break
                start = end
            kind = self._anneal_func_type
            lrs.append(_anneal(kind, group[phase["start_lr"]], group[phase["end_lr"]], pct))
            if self.cycle_momentum:
                momentum = _anneal(
                    kind, group[phase["start_momentum"]], group[phase["end_momentum"]], pct
                )
                self._set_momentum(group, momentum)
        return lrs


def _one_cycle_total_steps(
    total_steps: int | None, epochs: int | None, steps_per_epoch: int | None
) -> int:
    if total_steps is not None:
        if not isinstance(total_steps, int) or total_steps <= 0:
            raise ValueError(f"total_steps must be a positive integer; got {total_steps!r}")
        return total_steps
    if epochs is None or steps_per_epoch is None:
        raise ValueError("give total_steps, or both epochs and steps_per_epoch")
    for name, value in (("epochs", epochs), ("steps_per_epoch", steps_per_epoch)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer; got {value!r}")
    return epochs * steps_per_epoch


class ReduceLROnPlateau(LRScheduler):
    """Multiply lr by ``factor`` when a metric has not improved for ``patience`` steps.

    ``step(metric)``: the metric improves on ``best`` when (mode, threshold_mode)
      min/rel: m < best * (1 - threshold)    min/abs: m < best - threshold
      max/rel: m > best * (1 + threshold)    max/abs: m > best + threshold
    Otherwise it is a bad epoch. During ``cooldown`` epochs after a reduction bad epochs are
    not counted. When bad epochs exceed ``patience``: lr_new = max(lr * factor, min_lr), kept
    only if lr - lr_new > eps. No initial step is taken at construction.

    A param group added to the optimizer later is reduced too: with one ``min_lr`` for all
    groups it gets that floor; with a list, a reduction raises RuntimeError (as torch does)
    until ``min_lrs`` is given one value per group. Unlike torch, that error leaves the
    scheduler as it was, so the same ``step(metric)`` can be repeated once ``min_lrs`` is set.
    """

    def __init__(
        self,
        optimizer: Any,
        mode: str = "min",
        factor: float = 0.1,
        patience: int = 10,
        threshold: float = 1e-4,
        threshold_mode: str = "rel",
        cooldown: int = 0,
        min_lr: float | Sequence[float] = 0,
        eps: float = 1e-8,
    ) -> None:
        _check_optimizer(optimizer)
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max'; got {mode!r}")
        if threshold_mode not in ("rel", "abs"):
            raise ValueError(f"threshold_mode must be 'rel' or 'abs'; got {threshold_mode!r}")
        if not factor < 1.0:
            raise ValueError(f"factor must be < 1.0; got {factor}")
        for name, value in (("patience", patience), ("cooldown", cooldown)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0; got {value!r}")
        self.optimizer = optimizer
        self.default_min_lr = None if isinstance(min_lr, (list, tuple)) else min_lr
        self.min_lrs = per_group("min_lr", optimizer, min_lr)
        self.mode, self.factor, self.patience = mode, factor, patience
        self.threshold, self.threshold_mode = threshold, threshold_mode
        self.cooldown, self.eps = cooldown, eps
        self.mode_worse = math.inf if mode == "min" else -math.inf
        self.last_epoch = 0
        self._last_lr = _current_lrs(optimizer)
        self.best = self.mode_worse
        self.cooldown_counter = 0
        self.num_bad_epochs = 0

    def step(self, metrics: float) -> None:  # type: ignore[override]
        """Record one metric value and reduce the lrs if it has plateaued."""
        current = float(metrics)
        better = self._is_better(current)
        bad_epochs = 0 if better else self.num_bad_epochs + 1
        cooldown_counter = self.cooldown_counter
        if cooldown_counter > 0:  # bad epochs in a cooldown do not count
            cooldown_counter -= 1
            bad_epochs = 0
        reduce = bad_epochs > self.patience
        floors = self._floors() if reduce else []  # may raise: nothing has changed yet
        self.last_epoch += 1
        if better:
            self.best = current
        self.num_bad_epochs, self.cooldown_counter = bad_epochs, cooldown_counter
        if reduce:
            for group, floor in zip(self.optimizer.param_groups, floors, strict=True):
                old = float(group["lr"])
                new = max(old * self.factor, floor)
                if old - new > self.eps:
                    group["lr"] = new
            self.cooldown_counter = self.cooldown
            self.num_bad_epochs = 0
        self._last_lr = _current_lrs(self.optimizer)

    def _is_better(self, current: float) -> bool:
        best, th = self.best, self.threshold
        if self.mode == "min":
            return current < (best * (1.0 - th) if self.threshold_mode == "rel" else best - th)
        return current > (best * (th + 1.0) if self.threshold_mode == "rel" else best + th)

    def _floors(self) -> list[float]:
        """``min_lrs``, one per param group; a single min_lr covers groups added since."""
        n_groups = len(self.optimizer.param_groups)
        if len(self.min_lrs) == n_groups:
            return self.min_lrs
        if self.default_min_lr is None:
            raise RuntimeError(
                f"The number of param groups in the optimizer ({n_groups}) differs from the "
                f"number of min_lrs ({len(self.min_lrs)}) ReduceLROnPlateau was built with, "
                "usually because a param group was added to the optimizer; set the "
                f"scheduler's min_lrs to a list of {n_groups} values"
            )
        self.min_lrs = [self.default_min_lr] * n_groups
        return self.min_lrs


def build_scheduler(name: str, optimizer: Any, params: dict[str, Any] | None = None) -> Any:
    """Build a scheduler from a DeepSpeed config ``"scheduler": {"type": name, "params": params}``.

    ``name`` is one of DeepSpeed's types (LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR,
    WarmupCosineLR) or a torch.optim.lr_scheduler class name implemented here. Unknown types,
    unknown params and missing required params raise ValueError naming them and listing what
    is allowed.
    """
    registry = {cls.__name__: cls for cls in BUILDABLE}
    if name not in registry:
        raise ValueError(f"scheduler type {name!r} is unknown; allowed: {sorted(registry)}")
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise ValueError(f"params of scheduler {name} must be a dict; got {type(params).__name__}")
    cls = registry[name]
    signature = inspect.signature(cls.__init__).parameters
    allowed = [p for p in signature if p not in ("self", "optimizer")]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"scheduler {name} has no params {unknown}; allowed: {allowed}")
    missing = [
        p for p in allowed if signature[p].default is inspect.Parameter.empty and p not in params
    ]
    if missing:
        raise ValueError(f"scheduler {name} needs params {missing}; allowed: {allowed}")
    return cls(optimizer=optimizer, **params)


# The schedulers build_scheduler makes from a config's "scheduler" type, by class name.
BUILDABLE = (
    StepLR, MultiStepLR, ExponentialLR, CosineAnnealingLR, LambdaLR, MultiplicativeLR, LinearLR,
    ConstantLR, PolynomialLR, CosineAnnealingWarmRestarts, CyclicLR, SequentialLR,
    ChainedScheduler, OneCycleLR, ReduceLROnPlateau, LRRangeTest, WarmupLR, WarmupDecayLR,
    WarmupCosineLR, OneCycle,
)  # fmt: skip
