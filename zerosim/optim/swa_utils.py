"""Weight averaging: SWA (Izmailov et al. 2018, arXiv:1803.05407) and EMA, torch's API.

* ``AveragedModel`` keeps a deep copy of a model whose parameters are a running average
  of the model's parameters at each ``update_parameters(model)`` call. Default: the SWA
  equal-weight mean; ``get_ema_multi_avg_fn(decay)`` gives an exponential moving average.
* ``SWALR`` anneals each group's lr to a constant ``swa_lr`` for the SWA phase.
* ``update_bn`` recomputes BatchNorm running statistics for the averaged weights (the
  averaged model's statistics are otherwise those of the last model it copied).

Models are duck-typed like zerosim.nn.Module (``named_parameters()`` of objects with a
``.data`` array, ``named_buffers()``, ``named_modules()``, ``train()``/``eval()``), so this
file does not import zerosim.nn.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from zerosim.backend import np_dtype
from zerosim.optim.deepspeed_schedulers import per_group

from .lr_scheduler import LRScheduler

__all__ = [
    "AveragedModel",
    "SWALR",
    "update_bn",
    "get_ema_avg_fn",
    "get_ema_multi_avg_fn",
    "get_swa_avg_fn",
    "get_swa_multi_avg_fn",
]

AvgFn = Callable[[Any, Any, int], Any]
MultiAvgFn = Callable[[list[Any], list[Any], int], None]


def _check_decay(decay: float) -> None:
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"decay must be in [0, 1]; got {decay}")


def _lerp_(start: Any, end: Any, weight: float) -> None:
    """start <- start + weight (end - start), in place, in torch.lerp's two-sided form:
    start + w (end - start) for |w| < 0.5, end - (end - start)(1 - w) otherwise."""
    diff = end - start
    if abs(weight) < 0.5:
        diff *= weight
        start += diff
    else:
        diff *= 1 - weight
        start[...] = end - diff


def get_swa_avg_fn() -> AvgFn:
    """SWA mean of n + 1 models: avg_{n+1} = avg_n + (current - avg_n) / (n + 1)."""

    def swa_update(averaged: Any, current: Any, n_averaged: int) -> Any:
        return averaged + (current - averaged) / (n_averaged + 1)

    return swa_update


def get_ema_avg_fn(decay: float = 0.999) -> AvgFn:
    """EMA: avg_{n+1} = decay * avg_n + (1 - decay) * current."""
    _check_decay(decay)

    def ema_update(averaged: Any, current: Any, n_averaged: int) -> Any:
        return decay * averaged + (1 - decay) * current

    return ema_update


def get_swa_multi_avg_fn() -> MultiAvgFn:
    """In-place SWA mean over lists of arrays: lerp(avg, current, 1 / (n + 1))."""

    def swa_update(averaged: list[Any], current: list[Any], n_averaged: int) -> None:
        for avg, cur in zip(averaged, current, strict=True):
            if np_dtype(avg.dtype).kind in "fc":
                _lerp_(avg, cur, 1 / (n_averaged + 1))
            else:  # integer buffers: truncate like torch's copy into an integer tensor
                avg[...] = avg + (cur - avg) / (n_averaged + 1)

    return swa_update


def get_ema_multi_avg_fn(decay: float = 0.999) -> MultiAvgFn:
    """In-place EMA over lists of arrays: lerp(avg, current, 1 - decay)."""
    _check_decay(decay)

    def ema_update(averaged: list[Any], current: list[Any], n_averaged: int) -> None:
        for avg, cur in zip(averaged, current, strict=True):
            if np_dtype(avg.dtype).kind in "fc":
                _lerp_(avg, cur, 1 - decay)
            else:
                avg[...] = avg * decay + cur * (1 - decay)

    return ema_update


class _AveragedArray:
    """One averaged array: where it lives (a Parameter's .data or a module buffer)."""

    def __init__(self, owner: Any, attr: str, is_param: bool) -> None:
        self.owner, self.attr, self.is_param = owner, attr, is_param

    def get(self) -> Any:
        holder = getattr(self.owner, self.attr)
        return holder.data if self.is_param else holder

    def set(self, value: Any) -> None:
        """Write in place when the slot holds an array (views stay valid), else rebind."""
        target = self.get()
        if hasattr(target, "shape") and np.shape(value) == tuple(target.shape):
            target[...] = value
        elif self.is_param:
            getattr(self.owner, self.attr).data = value
        else:
            setattr(self.owner, self.attr, copy.deepcopy(value))


def _slots(model: Any, buffers: bool) -> list[_AveragedArray]:
    """Parameters (and buffers) of ``model`` as slots, in named_parameters() order."""
    modules = dict(model.named_modules())
    names = [name for name, _ in model.named_parameters()]
    slots = [_AveragedArray(*_owner(modules, name), True) for name in names]
    if buffers and hasattr(model, "named_buffers"):
        slots += [
            _AveragedArray(*_owner(modules, name), False) for name, _ in model.named_buffers()
        ]
    return slots


def _owner(modules: dict[str, Any], dotted: str) -> tuple[Any, str]:
    prefix, _, leaf = dotted.rpartition(".")
    return modules[prefix], leaf


class AveragedModel:
    """A deep copy of ``model`` whose parameters average the models passed to update_parameters.

    The first ``update_parameters`` copies the model; the next ones apply ``multi_avg_fn``
    (in place, over all arrays at once) or ``avg_fn`` (per array, returns the new value);
    with neither, the SWA mean avg + (current - avg) / (n + 1). ``n_averaged`` counts the
    models averaged so far. With ``use_buffers`` the buffers (BatchNorm running stats) are
    averaged too; otherwise they are copied from the latest model.
    """

    def __init__(
        self,
        model: Any,
        multi_avg_fn: MultiAvgFn | None = None,
        avg_fn: AvgFn | None = None,
        use_buffers: bool = False,
    ) -> None:
        if avg_fn is not None and multi_avg_fn is not None:
            raise ValueError("give at most one of avg_fn and multi_avg_fn; got both")
        self.module = copy.deepcopy(model)
        self.multi_avg_fn = multi_avg_fn
        self.avg_fn = avg_fn
        self.use_buffers = use_buffers
        self.n_averaged = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def parameters(self) -> Iterable[Any]:
        return self.module.parameters()

    def named_parameters(self) -> Iterable[tuple[str, Any]]:
        return self.module.named_parameters()

    def update_parameters(self, model: Any) -> None:
        """Fold ``model``'s current parameters (and buffers) into the average."""
        ours, theirs = _slots(self.module, self.use_buffers), _slots(model, self.use_buffers)
        if len(ours) != len(theirs):
            raise ValueError(
                f"model has {len(theirs)} arrays to average but the averaged copy has "
                f"{len(ours)}; pass the model this AveragedModel was built from"
            )
        if self.n_averaged == 0:
            for mine, src in zip(ours, theirs, strict=True):
                mine.set(src.get())
        elif self.multi_avg_fn is not None:
            current = [src.get() for src in theirs]
            self.multi_avg_fn([mine.get() for mine in ours], current, self.n_averaged)
        else:
            avg_fn = self.avg_fn or get_swa_avg_fn()
            for mine, src in zip(ours, theirs, strict=True):
                mine.set(avg_fn(mine.get(), src.get(), self.n_averaged))
        if not self.use_buffers and hasattr(model, "named_buffers"):
            for mine, src in zip(_buffer_slots(self.module), _buffer_slots(model), strict=True):
                mine.set(src.get())
        self.n_averaged += 1

    def state_dict(self) -> dict[str, Any]:
        """torch's keys: ``module.<name>`` for the averaged model's state, and ``n_averaged``."""
        state = {"n_averaged": np.array(self.n_averaged, dtype=np.int64)}
        state.update({f"module.{k}": v for k, v in self.module.state_dict().items()})
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        inner = {k[len("module.") :]: v for k, v in state_dict.items() if k.startswith("module.")}
        self.module.load_state_dict(inner)
        self.n_averaged = int(state_dict["n_averaged"])


def _buffer_slots(model: Any) -> list[_AveragedArray]:
    modules = dict(model.named_modules())
    return [_AveragedArray(*_owner(modules, name), False) for name, _ in model.named_buffers()]


def _is_batchnorm(module: Any) -> bool:
    """A BatchNorm that tracks running statistics (duck-typed, like zerosim.nn.BatchNorm1d)."""
    has_stats = all(getattr(module, a, None) is not None for a in ("running_mean", "running_var"))
    return has_stats and hasattr(module, "momentum")


def _reset_running_stats(module: Any) -> None:
    """mean <- 0, var <- 1, batch count <- 0 (the module's own method when it has one)."""
    if hasattr(module, "reset_running_stats"):
        module.reset_running_stats()
        return
    module.running_mean[...] = 0
    module.running_var[...] = 1
    if getattr(module, "num_batches_tracked", None) is not None:
        module.num_batches_tracked[...] = 0


def update_bn(loader: Iterable[Any], model: Any) -> None:
    """Recompute every BatchNorm's running statistics with one pass over ``loader``.

    Each BatchNorm is reset and given momentum None (a cumulative average over the
    batches: after batch b, running = running + (batch_stat - running) / b), the model runs
    forward in train mode on each batch (``x``, or the first element of an ``(x, y)``
    batch), then momenta and the train/eval mode are restored. ``model`` may be an
    ``AveragedModel``.
    """
    if isinstance(model, AveragedModel):
        model = model.module
    momenta = {}
    for _, module in model.named_modules():
        if _is_batchnorm(module):
            _reset_running_stats(module)
            momenta[module] = module.momentum
    if not momenta:
        return
    was_training = model.training
    clear_saved = getattr(model, "clear_saved", None)  # forward saves activations; drop them
    model.train()
    try:
        for module in momenta:
            module.momentum = None
        for batch in loader:
            model(batch[0] if isinstance(batch, (list, tuple)) else batch)
            if clear_saved is not None:
                clear_saved()
    finally:
        for module, momentum in momenta.items():
            module.momentum = momentum
        model.train(was_training)


def _cos_anneal(t: float) -> float:
    return (1 - math.cos(math.pi * t)) / 2


def _linear_anneal(t: float) -> float:
    return t


class SWALR(LRScheduler):
    """Anneal each group's lr to ``swa_lr`` over ``anneal_epochs`` steps, then hold it.

    With s = steps since construction, E = anneal_epochs and lr_start the group's lr when
    SWALR was built:  alpha_s = f(min(1, s / max(1, E))),  f = (1 - cos(pi t)) / 2 ('cos')
    or t ('linear'),  lr_s = alpha_s * swa_lr + (1 - alpha_s) * lr_start.
    Like torch it is computed recursively from the group's current lr (recovering lr_start
    as (lr - alpha_{s-1} swa_lr) / (1 - alpha_{s-1})), so the values are torch's bit for bit.
    """

    def __init__(
        self,
        optimizer: Any,
        swa_lr: float | list[float],
        anneal_epochs: int = 10,
        anneal_strategy: str = "cos",
        last_epoch: int = -1,
    ) -> None:
        swa_lrs = per_group("swa_lr", optimizer, swa_lr)
        if any(lr < 0 for lr in swa_lrs):
            raise ValueError(f"swa_lr must be >= 0; got {swa_lr}")
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"anneal_strategy must be 'cos' or 'linear'; got {anneal_strategy!r}")
        if not isinstance(anneal_epochs, int) or anneal_epochs < 0:
            raise ValueError(f"anneal_epochs must be an integer >= 0; got {anneal_epochs!r}")
        for group, lr in zip(optimizer.param_groups, swa_lrs, strict=True):
            group["swa_lr"] = lr
        self._anneal_strategy = anneal_strategy
        self.anneal_epochs = anneal_epochs
        super().__init__(optimizer, last_epoch)

    def _alpha(self, step: int) -> float:
        t = max(0, min(1, step / max(1, self.anneal_epochs)))
        return _cos_anneal(t) if self._anneal_strategy == "cos" else _linear_anneal(t)

    def get_lr(self) -> list[float]:
        step = self._step_count - 1
        if self.anneal_epochs == 0:
            step = max(1, step)
        prev_alpha, alpha = self._alpha(step - 1), self._alpha(step)
        lrs = []
        for group in self.optimizer.param_groups:
            swa_lr = group["swa_lr"]
            if prev_alpha == 1:
                start = swa_lr
            else:
                start = (group["lr"] - prev_alpha * swa_lr) / (1 - prev_alpha)
            lrs.append(swa_lr * alpha + start * (1 - alpha))
        return lrs
