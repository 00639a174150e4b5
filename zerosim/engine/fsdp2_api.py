"""PyTorch FSDP2's own face (``zerosim.fsdp``): ``fully_shard`` and ``MixedPrecisionPolicy`` with
torch's names and defaults, running the strategy of ``zerosim.schedule: "fsdp2"``
(``zero/stage3_fsdp2.py``) without an engine. A torch user's loop reads the same::

    mp = zs.fsdp.MixedPrecisionPolicy(param_dtype="bfloat16", reduce_dtype="float32")
    for block in model.blocks:
        zs.fsdp.fully_shard(block, mp_policy=mp)
    zs.fsdp.fully_shard(model, mp_policy=mp)
    optimizer = zs.optim.AdamW(model.parameters(), lr=1e-3)
    for x, y in batches:                   # this rank's micro-batch
        loss = model(x, y)
        model.backward()                   # torch: loss.backward()
        zs.fsdp.clip_grad_norm_(model.parameters(), 1.0)   # optional, torch's
        optimizer.step()
        optimizer.zero_grad()

As in torch, the *root* is found at the first forward: the outermost module given to
``fully_shard``; the modules given before it inside it are its blocks. The strategy is built
then. Between steps every parameter's ``.data`` is this rank's chunk (a view of the shard: what
torch's DTensor holds locally, ceil(dim0 / N) rows flattened) and after backward its ``.grad``
is the reduced chunk, so an optimizer over ``model.parameters()`` steps exactly the shards, as
torch's does. That holds for rules that act element by element (SGD, Adam, AdamW, …), not for
LAMB or Muon, which need whole matrices. Every backward reduces (torch's default) and adds into
``.grad`` until ``zero_grad``; to accumulate without reducing, as torch's users do, call
``model.set_requires_gradient_sync(False)`` before every micro-batch but the last (the unsharded
gradients are summed locally, in ``reduce_dtype``, and reduced once) and, to keep the parameters
gathered between those micro-batches, ``model.set_reshard_after_backward(False)``.
``clip_grad_norm_`` is torch's on the sharded gradients: one all-reduce of each parameter's
partial ‖g‖², then every gradient times min(1, max_norm / (norm + 1e-6)).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from zerosim import optim
from zerosim.comm import Communicator, default_comm
from zerosim.config.sections import ZeroConfig
from zerosim.engine.boundary import global_grad_norm
from zerosim.engine.engine import clip_coef
from zerosim.nn import Module
from zerosim.zero.schedule import BoundarySettings, fsdp2_checks
from zerosim.zero.stage3_fsdp2 import Stage3FSDP2


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """torch's ``MixedPrecisionPolicy``: the dtype of the all-gather and the computation
    (``param_dtype``) and of the gradient reduce-scatter (``reduce_dtype``); None keeps the
    parameters' own dtype (for ``reduce_dtype``: ``param_dtype``)."""

    param_dtype: str | None = None
    reduce_dtype: str | None = None


class FullyShardState:
    """What ``fully_shard`` recorded for one module, and, for the root, the running strategy."""

    def __init__(
        self, module: Module, mesh: Any, reshard_after_forward: bool | int, mp: Any
    ) -> None:
        self.module: Module = module
        self.mesh: Any = mesh  # the communicator (torch: the device mesh); None: the default
        self.reshard_after_forward: bool | int = reshard_after_forward
        self.mp_policy: MixedPrecisionPolicy = mp
        self.strategy: Stage3FSDP2 | None = None  # the root's, built at its first forward
        # set_requires_gradient_sync: False, this backward sums gradients locally, unreduced
        self.requires_gradient_sync: bool = True
        # set_reshard_after_backward: False, parameters stay gathered until the next forward
        self.reshard_after_backward: bool = True

    def pre_forward(self, args: tuple) -> tuple | None:
        """The root's first forward builds the strategy; every forward starts a micro-step."""
        if self.strategy is None:
            self.strategy = build_root(self)
            self.strategy.before_forward()
            root = self.strategy.fetcher.fsdp_modules[-1]  # its hook was added after this one
            return self.strategy.fetcher.pre_forward(root, args)
        self.strategy.before_forward()
        return None

    def pre_backward(self) -> None:
        """Gradients of this backward land in the shard: cleared where ``zero_grad`` set
        ``.grad`` to None, kept (to accumulate into) elsewhere; ``.grad`` is free for the
        layers' full-size gradients."""
        s = self.strategy
        for g in s.groups:
            for i, (_, p) in enumerate(g.named_params):
                if p.grad is None:
                    start = g.partition.offsets[i]
                    g.grad_shard[start : start + g.partition.chunks[i]] = 0
                p.grad = None
        s.reshard_after_backward = self.reshard_after_backward
        s.before_backward(self.requires_gradient_sync)

    def post_backward(self) -> None:
        """Every reduction has landed: each parameter shows its chunk and its reduced chunk
        (unchanged by a backward that only summed locally), unless it was kept gathered."""
        s = self.strategy
        s.after_backward(self.requires_gradient_sync)
        if self.requires_gradient_sync or self.reshard_after_backward:
            show_shards(s)  # else whole, gathered, until the next micro-batch's backward


def show_shards(strategy: Stage3FSDP2) -> None:
    """Each parameter's ``.data`` and ``.grad`` become views of this rank's chunk of them."""
    for g in strategy.groups:
        for i, (_, p) in enumerate(g.named_params):
            start, chunk = g.partition.offsets[i], g.partition.chunks[i]
            p.data = g.flat_param[start : start + chunk]
            p.grad = g.grad_shard[start : start + chunk]


# module -> what fully_shard recorded for it (weak: a dropped model leaves no entry); the lock
# guards it against LocalWorld's ranks, threads of one process, each sharding its own model
_STATES: weakref.WeakKeyDictionary[Module, FullyShardState] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _states() -> list[FullyShardState]:
    with _LOCK:
        return list(_STATES.values())


def state_of(module: Module) -> FullyShardState | None:
    """What ``fully_shard`` recorded for ``module`` (its ``strategy`` once the root ran), or
    None if it was not given to ``fully_shard``."""
    with _LOCK:
        return _STATES.get(module)


def fully_shard(
    module: Module,
    *,
    mesh: Communicator | None = None,
    reshard_after_forward: bool | int = True,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 (frozen, as torch's)
) -> Module:
    """torch's ``fully_shard``: shard ``module``'s parameters over ``mesh`` (a communicator;
    the default world when None). Call it on each block, then on the model. Returns ``module``."""
    if not isinstance(module, Module):
        raise TypeError(f"module must be a zerosim.nn.Module, got {type(module).__name__}")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {mp_policy!r}")
    state = FullyShardState(module, mesh, reshard_after_forward, mp_policy)
    with _LOCK:
        if module in _STATES:
            raise ValueError(f"fully_shard was already applied to this {type(module).__name__}")
        _STATES[module] = state
    module.register_forward_pre_hook(lambda _m, args: _root_pre_forward(state, args))
    # torch's FSDPModule methods, on this module and every module given to fully_shard inside it
    module.set_requires_gradient_sync = lambda flag: _set_inside(
        module, "requires_gradient_sync", flag
    )
    module.set_reshard_after_backward = lambda flag: _set_inside(
        module, "reshard_after_backward", flag
    )
    return module


def _set_inside(module: Module, field: str, value: bool) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{field} must be True or False, got {value!r}")
    for s in _states():
        if _holds(module, s.module):
            setattr(s, field, value)


def clip_grad_norm_(parameters: Any, max_norm: float) -> float:
    """torch's ``clip_grad_norm_`` on FSDP2's sharded gradients: the 2-norm of every gradient of
    the root that holds ``parameters`` (one all-reduce of each parameter's partial ‖g‖²), every
    gradient multiplied by min(1, max_norm / (norm + 1e-6)); returns the norm."""
    if not max_norm > 0:
        raise ValueError(f"max_norm must be a number > 0, got {max_norm!r}")
    params = list(parameters)
    owners = [
        s.strategy
        for s in _states()
        if s.strategy is not None and all(id(p) in s.strategy.where for p in params)
    ]
    if not params or not owners:
        raise ValueError(
            "clip_grad_norm_: the parameters must be those of a model given to fully_shard "
            "that has run a forward and a backward"
        )
    strategy = owners[0]
    reference = np.dtype(strategy.dtype) == np.float64  # zerosim's float64 runs: a float64 norm
    settings = BoundarySettings(False, False, float(max_norm), reference_precision=reference)
    checks = fsdp2_checks(settings)
    norm = global_grad_norm(strategy, strategy.comm, checks)
    coef = clip_coef(norm, max_norm)  # torch's clamp: nan for a nan norm
    for g in strategy.groups:
        g.grad_shard *= coef
    return norm


def _root_pre_forward(state: FullyShardState, args: tuple) -> tuple | None:
    """Only the root acts: a block inside it is driven by the root's strategy."""
    outer = [
        s for s in _states() if s.module is not state.module and _holds(s.module, state.module)
    ]
    if state.strategy is None and any(s.strategy is not None for s in outer):
        return None
    return state.pre_forward(args)


def _holds(outer: Module, inner: Module) -> bool:
    return any(m is inner for m in outer.modules())


def build_root(state: FullyShardState) -> Stage3FSDP2:
    """The config route's strategy over the root's parameters, its blocks the modules given to
    fully_shard inside it (in the model's order)."""
    root = state.module
    inside = {id(s.module) for s in _states() if s.module is not root}
    blocks = [m for m in root.modules() if id(m) in inside and m is not root]
    comm = default_comm() if state.mesh is None else state.mesh
    named = list(root.named_parameters())
    settings = {state_of(b).reshard_after_forward for b in blocks}
    if len(settings) > 1:
        raise ValueError(
            f"reshard_after_forward differs between the blocks ({sorted(map(str, settings))}); "
            "zerosim takes one value for every block"
        )
    strategy = Stage3FSDP2(
        groups=[(named, {})],
        comm=comm,
        zero=ZeroConfig(),
        dtype=named[0][1].dtype,
        optimizer_cls=optim.SGD,  # unused: the user's optimizer steps the shards
        reshard_after_forward=settings.pop() if settings else True,  # the root never reshards
        param_dtype=state.mp_policy.param_dtype,
        reduce_dtype=state.mp_policy.reduce_dtype,
        blocks=blocks,
    )
    strategy.attach(root)
    root.register_full_backward_pre_hook(lambda _m, _g: state.pre_backward())
    root.register_full_backward_hook(lambda _m, _gi, _go: state.post_backward())
    return strategy
