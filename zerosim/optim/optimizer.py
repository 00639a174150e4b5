"""The Optimizer base class: torch.optim's API over any objects that have ``.data`` and ``.grad``.

A subclass names its hyperparameters (``defaults``), checks them (``_check_group``), says
which state arrays it keeps (``state_keys``) and applies one update to one parameter
(``_update``, a call into ``zerosim.optim.functional``). This class owns everything
else: param groups, lazily created state and its step count, ``step``/``zero_grad``, and
``state_dict`` in torch's format, so a checkpoint's numbers can be compared with torch's
one for one.

A *parameter* is any object with ``.data`` (a float array, updated in place, never
rebound) and ``.grad`` (an array of the same shape, or None to skip it), hashed by
identity: ``zerosim.nn.Parameter``, or the ZeRO engine's view of a flat shard.
"""

from __future__ import annotations

import copy
import numbers
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from zerosim.backend import from_host, is_device_array, to_host
from zerosim.optim.functional.common import (
    SCRATCH_SLOTS,
    block_length,
    state_dtype,
    xp_of,
    zeros_state,
)

# Keys of torch's param groups that choose an implementation, not the arithmetic; dropped
# when a torch state_dict is loaded.
TORCH_IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable")
# Keys a param group may hold besides the hyperparameters: its parameters, and what LR
# schedulers write into groups (torch's names: every scheduler's initial_lr, OneCycleLR's
# max_lr/min_lr/max_momentum/base_momentum, SWALR's swa_lr), so a group copied from a
# scheduled optimizer can be added to a new one.
GROUP_BOOKKEEPING_KEYS = (
    "params",
    "initial_lr",
    "max_lr",
    "min_lr",
    "max_momentum",
    "base_momentum",
    "swa_lr",
)


def check_range(
    owner: str, name: str, value: Any, low: float = 0.0, high: float | None = None
) -> None:
    """Raise unless ``value`` is a real number with ``low <= value`` (and ``value < high``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{owner}: {name} must be a real number; got {value!r} of type {type(value).__name__}"
        )
    if not (low <= value and (high is None or value < high)):
        allowed = f"{low} <= {name}" + ("" if high is None else f" < {high}")
        raise ValueError(f"{owner}: invalid {name}={value!r}; allowed: {allowed}")


def check_non_negative(owner: str, group: Mapping[str, Any], *names: str) -> None:
    """Raise unless every hyperparameter of ``group`` named in ``names`` is a real number >= 0."""
    for name in names:
        check_range(owner, name, group[name])


def check_betas(owner: str, betas: Any) -> None:
    """Raise unless ``betas`` is a pair with both entries in [0, 1)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{owner}: betas must be a pair (beta1, beta2); got {betas!r}")
    check_range(owner, "betas[0]", betas[0], 0.0, 1.0)
    check_range(owner, "betas[1]", betas[1], 0.0, 1.0)


def _is_parameter(obj: Any) -> bool:
    return hasattr(obj, "data") and hasattr(obj, "grad")


def _array_like(value: Any, data: Any) -> Any:
    """``value`` (an array of any namespace, or host data) as an array of ``data``'s
    namespace and device; what is on another side of the host/device line crosses it."""
    xp = xp_of(data)
    if is_device_array(value) and xp_of(value) is xp:
        return value
    host = to_host(value) if is_device_array(value) else np.asarray(value)
    return host if xp is np else from_host(host, xp=xp)


class Optimizer(ABC):
    """Base of the torch-like optimizers: param groups, per-parameter state, state_dict.

    ``state[p]`` is a dict per parameter: ``'step'`` (a Python float, as torch keeps a
    float tensor) and the arrays named by ``state_keys(group)``, in the state dtype
    (float32 for 16-bit parameters). It is created at a parameter's first step.
    """

    #: Whether ``state[p]['step']`` counts this parameter's updates (``step`` adds 1 before
    #: each ``_update``).
    counts_steps: bool = True

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        name = type(self).__name__
        self.defaults = dict(defaults)
        self._check_group(self.defaults, name)
        self.state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
        self.param_groups: list[dict[str, Any]] = []
        self._scratch: dict[tuple[str, str], Any] = {}
        if _is_parameter(params) or isinstance(params, Mapping):
            raise TypeError(
                f"{name}: params must be an iterable of parameters or of param-group dicts; "
                f"got a single {type(params).__name__}"
            )
        groups = list(params)
        if not groups:
            raise ValueError(f"{name}: params is empty; allowed: at least one parameter")
        if not isinstance(groups[0], Mapping):
            groups = [{"params": groups}]
        for group in groups:
            self.add_param_group(group)

    # --- what a subclass provides -------------------------------------------------------

    @abstractmethod
    def state_keys(self, group: Mapping[str, Any]) -> tuple[str, ...]:
        """Names of the array-valued state entries kept for a parameter of ``group``."""

    @abstractmethod
    def _check_group(self, group: Mapping[str, Any], owner: str) -> None:
        """Raise ValueError (naming ``owner``) for a hyperparameter outside its range."""

    @abstractmethod
    def _update(
        self, param: Any, state: dict[str, Any], group: dict[str, Any], scratch: Any
    ) -> None:
        """Apply one update to ``param`` (its ``.grad`` is not None); advance ``state``.

        With ``counts_steps``, ``state['step']`` already counts this update (1 on the first).
        """

    def group_defaults(self, param_group: Mapping[str, Any], owner: str) -> dict[str, Any]:
        """The hyperparameters a new group starts from (``defaults``; an optimizer whose groups
        are of several kinds, such as Muon's, picks them by the group)."""
        return self.defaults

    def _init_state(self, param: Any, group: dict[str, Any]) -> dict[str, Any]:
        """The state of a parameter before its first update: step 0 and zero arrays."""
        state: dict[str, Any] = {"step": 0.0} if self.counts_steps else {}
        for key in self.state_keys(group):
            state[key] = zeros_state(param.data)
        return state

    # --- torch.optim's API ------------------------------------------------------------

    def add_param_group(self, param_group: Mapping[str, Any]) -> None:
        """Add a group of parameters with its own hyperparameters (defaults fill the rest)."""
        index = len(self.param_groups)
        owner = f"{type(self).__name__} param group {index}"
        if not isinstance(param_group, Mapping):
            raise TypeError(f"{owner}: must be a dict; got {type(param_group).__name__}")
        if "params" not in param_group:
            raise ValueError(f"{owner}: has no 'params' key; keys given: {sorted(param_group)}")
        defaults = self.group_defaults(param_group, owner)
        allowed = set(defaults) | set(GROUP_BOOKKEEPING_KEYS)
        unknown = sorted(set(param_group) - allowed)
        if unknown:
            raise ValueError(f"{owner}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
        params = param_group["params"]
        if isinstance(params, (set, frozenset)):
            raise TypeError(f"{owner}: params must be an ordered collection, not a set")
        params = [params] if _is_parameter(params) else list(params)
        self._check_params(params, owner)
        group = {**defaults, **param_group, "params": params}
        self._check_group(group, owner)
        self.param_groups.append(group)

    def _check_params(self, params: list[Any], owner: str) -> None:
        # A group may be empty (as in torch): a ZeRO rank may own nothing of a small group.
        seen: set[int] = set()
        for i, p in enumerate(params):
            if not _is_parameter(p):
                raise TypeError(
                    f"{owner}: params[{i}] is a {type(p).__name__}; allowed: objects with "
                    f".data and .grad (e.g. zerosim.nn.Parameter)"
                )
            state_dtype(p.data.dtype)  # raises TypeError for a dtype that cannot be optimized
            if id(p) in seen:
                raise ValueError(f"{owner}: params[{i}] appears twice in this group")
            seen.add(id(p))
        for j, other in enumerate(self.param_groups):
            if seen & {id(q) for q in other["params"]}:
                raise ValueError(
                    f"{owner}: some parameters are already in param group {j}; "
                    "a parameter may belong to one group only"
                )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset every gradient: to None (default) or to zeros in place."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad[...] = 0

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update every parameter whose ``.grad`` is not None; return ``closure()``'s loss."""
        loss = None if closure is None else closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p] if p in self.state else {}
                if not state:
                    state.update(self._init_state(p, group))
                if self.counts_steps:
                    state["step"] += 1.0
                self._update(p, state, group, self._scratch_for(p.data))
                if state:  # like torch, a stateless rule (SGD without momentum) adds no entry
                    self.state[p] = state
        return loss

    def _scratch_for(self, data: Any) -> Any:
        """One reusable work buffer per (array module, state dtype), grown as needed."""
        dtype = state_dtype(data.dtype)
        xp = xp_of(data)
        key = (xp.__name__, dtype.name)
        need = SCRATCH_SLOTS * block_length(data)
        buf = self._scratch.get(key)
        if buf is None or buf.size < need:
            buf = xp.empty(need, dtype=dtype)
            self._scratch[key] = buf
        return buf

    def state_dict(self) -> dict[str, Any]:
        """The state in torch's format: ``{'state': {index: {...}}, 'param_groups': [...]}``.

        Parameters are numbered across groups in order; each packed group lists its
        indices under ``'params'``. State arrays are the optimizer's own (not copies),
        as in torch: copy them to keep a snapshot while training goes on.
        """
        index: dict[int, int] = {}
        groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [index.setdefault(id(p), len(index)) for p in group["params"]]
            groups.append(packed)
        state = {index[id(p)]: dict(s) for p, s in self.state.items() if id(p) in index}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state_dict from ``state_dict()``, or torch's with tensors turned into arrays.

        Groups are matched in order and must have the same sizes; hyperparameters are
        taken from the state_dict (torch's implementation switches foreach, fused,
        capturable and differentiable are dropped). Arrays are copied into the state dtype
        on the parameter's array module. Nothing changes unless everything loads.
        """
        name = type(self).__name__
        for key in ("state", "param_groups"):
            if key not in state_dict:
                raise ValueError(f"{name}.load_state_dict: the state_dict has no {key!r} key")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"{name}.load_state_dict: the state_dict has {len(saved_groups)} parameter "
                f"groups; this optimizer has {len(self.param_groups)}"
            )
        id_map: dict[Any, Any] = {}
        new_groups = []
        for i, (group, saved) in enumerate(zip(self.param_groups, saved_groups, strict=True)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"{name}.load_state_dict: parameter group {i} has {len(saved['params'])} "
                    f"parameters in the state_dict and {len(group['params'])} in this optimizer"
                )
            id_map.update(zip(saved["params"], group["params"], strict=True))
            new = dict(group)
            for k, v in saved.items():
                if k != "params" and k not in TORCH_IMPLEMENTATION_KEYS:
                    new[k] = copy.deepcopy(v)
            self._check_group(new, f"{name}.load_state_dict: parameter group {i}")
            new_groups.append(new)
        group_of = {id(p): g for g in new_groups for p in g["params"]}
        new_state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
        for key, entry in state_dict["state"].items():
            if key not in id_map:
                raise ValueError(
                    f"{name}.load_state_dict: state entry {key!r} names no parameter; "
                    f"the param_groups list indices {sorted(id_map)}"
                )
            p = id_map[key]
            new_state[p] = self._load_param_state(p, entry, group_of[id(p)], key)
        self.param_groups = new_groups
        self.state = new_state

    def _load_param_state(
        self, param: Any, entry: Mapping[str, Any], group: dict[str, Any], key: Any
    ) -> dict[str, Any]:
        where = f"{type(self).__name__}.load_state_dict: state of parameter {key!r}"
        array_keys = self.state_keys(group)
        xp = xp_of(param.data)
        out: dict[str, Any] = {}
        for k, value in entry.items():
            if k in array_keys:
                arr = _array_like(value, param.data)
                if arr.shape != param.data.shape:
                    raise ValueError(
                        f"{where}: {k!r} has shape {tuple(arr.shape)}; the parameter has "
                        f"shape {tuple(param.data.shape)}"
                    )
                out[k] = xp.asarray(arr, dtype=state_dtype(param.data.dtype), copy=True)
            elif is_device_array(value) and value.ndim == 0:
                out[k] = float(to_host(value))
            elif np.ndim(value) == 0 and isinstance(np.asarray(value).item(), numbers.Real):
                out[k] = float(np.asarray(value).item())
            else:
                out[k] = copy.deepcopy(value)
        missing = [k for k in array_keys if k not in out]
        if out and missing:
            raise ValueError(
                f"{where}: missing {missing}; with this group's settings "
                f"{type(self).__name__} keeps {list(array_keys)}"
            )
        return out

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__} ("]
        for i, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            lines += [f"    {k}: {v}" for k, v in sorted(group.items()) if k != "params"]
        return "\n".join([*lines, ")"])
