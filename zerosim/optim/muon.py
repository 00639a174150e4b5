"""Muon with an auxiliary Adam, as DeepSpeed 0.19.8's ``MuonWithAuxAdam``
(``deepspeed/runtime/zero/muon/muon_optimizer.py``).

Muon is meant for hidden weight matrices; embeddings, the output layer, biases and norms go to
an Adam in the same optimizer. Every param group says which with ``use_muon``, and takes that
kind's defaults: Muon lr 0.02, momentum 0.95, weight_decay 0, ns_method "gram"; Adam lr 3e-4,
betas (0.9, 0.95), eps 1e-10, weight_decay 0. A DeepSpeed config splits the model's parameters
into such groups itself (``zerosim/config/optimizer.py``: matrices without "embed" or "lm_head"
in their name use Muon).

Under ZeRO stages 1-3 the optimizer sees flat 1-D shards, not matrices. The strategy then makes
the Muon update itself (``zerosim/zero/muon.py``: it needs the whole matrix) and hands the
shard its slice of the update as ``.grad``; a 1-D parameter of a Muon group is stepped by
``θ ← θ·(1 − lr·λ) − lr·grad``, as DeepSpeed's step does with a flat partition.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from zerosim.optim import functional as F
from zerosim.optim.functional.muon import NS_METHODS
from zerosim.optim.optimizer import Optimizer, check_betas, check_non_negative

MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram"}
ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}


class Muon(Optimizer):
    """MuonWithAuxAdam: Muon for groups with ``use_muon=True``, Adam for the others.

    ``adam_w_mode`` (DeepSpeed's optimizer-level switch, default True; here the default of the
    Adam groups' key of that name): the Adam groups decay weights decoupled (AdamW) or add λ·θ
    to the gradient (Adam). Muon's decay is always decoupled. State per parameter:
    ``'momentum_buffer'`` (Muon); ``'step'``, ``'exp_avg'``, ``'exp_avg_sq'`` (Adam). The
    formulas are in ``functional.muon`` and ``functional.adam``.
    """

    counts_steps = False  # only the Adam groups count steps (_update does)
    #: Set by a ZeRO strategy at stage 0, whose shards are flat: makes every matrix's update
    #: from the shards' gradients and writes it into them before each step (zero/muon.py).
    before_step: Callable[[Muon], None] | None = None

    def __init__(self, params: Iterable[Any], *, adam_w_mode: bool = True) -> None:
        if not isinstance(adam_w_mode, bool):
            raise TypeError(f"Muon: adam_w_mode must be a bool; got {adam_w_mode!r}")
        self.adam_w_mode = adam_w_mode
        super().__init__(params, {})

    def group_defaults(self, param_group: Mapping[str, Any], owner: str) -> dict[str, Any]:
        use_muon = param_group.get("use_muon")
        if not isinstance(use_muon, bool):
            raise ValueError(
                f"{owner}: every Muon param group needs use_muon: true (Muon) or false "
                f"(auxiliary Adam); got {use_muon!r}"
            )
        if use_muon:
            return {**MUON_DEFAULTS, "use_muon": True}
        return {**ADAM_DEFAULTS, "adam_w_mode": self.adam_w_mode, "use_muon": False}

    def _check_group(self, group: Mapping[str, Any], owner: str) -> None:
        if not group:  # the optimizer-wide defaults: none, every group brings its kind's
            return
        check_non_negative(owner, group, "lr", "weight_decay")
        if group["use_muon"]:
            check_non_negative(owner, group, "momentum")
            if group["ns_method"] not in NS_METHODS:
                raise ValueError(
                    f"{owner}: invalid ns_method={group['ns_method']!r}; allowed: "
                    f"{list(NS_METHODS)}"
                )
        else:
            check_non_negative(owner, group, "eps")
            check_betas(owner, group["betas"])
            if not isinstance(group["adam_w_mode"], bool):
                raise TypeError(
                    f"{owner}: adam_w_mode must be a bool; got {group['adam_w_mode']!r}"
                )

    def state_keys(self, group: Mapping[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["use_muon"] else ("exp_avg", "exp_avg_sq")

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update every parameter whose ``.grad`` is not None; return ``closure()``'s loss."""
        if self.before_step is not None:
            self.before_step(self)
        return super().step(closure)

    def _init_state(self, param: Any, group: dict[str, Any]) -> dict[str, Any]:
        if group["use_muon"] and param.data.ndim < 2:
            return {}  # a ZeRO shard: the strategy keeps the momentum (zerosim/zero/muon.py)
        state = super()._init_state(param, group)
        if not group["use_muon"]:
            state["step"] = 0.0
        return state

    def _update(
        self, param: Any, state: dict[str, Any], group: dict[str, Any], scratch: Any
    ) -> None:
        if not group["use_muon"]:
            state["step"] += 1.0
            beta1, beta2 = group["betas"]
            F.adam(
                param.data,
                param.grad,
                state["exp_avg"],
                state["exp_avg_sq"],
                step=state["step"],
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                decoupled_weight_decay=group["adam_w_mode"],
                scratch=scratch,
            )
            return
        if param.data.ndim < 2:  # a ZeRO shard: its gradient already holds the update
            update = param.grad
        else:
            update = F.muon_update(
                param.grad,
                state["momentum_buffer"],
                beta=group["momentum"],
                ns_method=group["ns_method"],
            )
        F.muon_apply(param.data, update, lr=group["lr"], weight_decay=group["weight_decay"])
