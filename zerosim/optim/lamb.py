"""LAMB with DeepSpeed FusedLamb's arguments and defaults (``deepspeed/ops/lamb/fused_lamb.py``).

FusedLamb is CUDA-only, so torch has no LAMB to compare against; the formula is DeepSpeed's
kernel's (``functional.lamb``). Unlike every other optimizer here, LAMB's update of an element
depends on its whole parameter: the step is scaled by a trust ratio ‖θ‖/‖u‖. A ZeRO strategy
whose optimizer sees slices of parameters sets ``piece_map`` (``zerosim/zero/lamb.py``),
which says which parameter each slice belongs to and adds the partial norms over ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, Protocol

from zerosim.backend import flat
from zerosim.optim import functional as F
from zerosim.optim.functional.common import state_dtype
from zerosim.optim.optimizer import Optimizer, check_betas, check_non_negative


class PieceMap(Protocol):
    """Where the optimizer's parameters sit in the model's (for a ZeRO strategy's shards)."""

    def pieces(self, param: Any) -> list[tuple[Hashable, int, int]]:
        """(model parameter, start, stop) of each run of ``param.data.reshape(-1)``."""

    def reduce(self, sums: dict[Hashable, list[float]]) -> dict[Hashable, list[float]]:
        """This rank's [Σθ², Σu²] per model parameter → the sums over every rank."""


class Lamb(Optimizer):
    """LAMB (You et al. 2020) as DeepSpeed's FusedLamb computes it; formula in ``functional.lamb``.

    Arguments as FusedLamb's, less ``max_grad_norm`` (DeepSpeed refuses it in a config: clip
    with ``gradient_clipping``) and ``amsgrad`` (FusedLamb raises on it). ``eps_inside_sqrt``
    is a group key here (FusedLamb keeps it for the whole optimizer). State per parameter:
    ``'step'``, ``'exp_avg'``, ``'exp_avg_sq'``. After each step ``coefficients`` holds each
    parameter's trust ratio, in order (FusedLamb's ``get_lamb_coeffs()``).
    """

    #: Set by a ZeRO strategy whose shards hold slices of parameters (see PieceMap).
    piece_map: PieceMap | None = None

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
    ) -> None:
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": betas,
            "eps": eps,
            "eps_inside_sqrt": eps_inside_sqrt,
            "weight_decay": weight_decay,
            "max_coeff": max_coeff,
            "min_coeff": min_coeff,
        }
        self.coefficients: list[float] = []
        super().__init__(params, defaults)

    def _check_group(self, group: Mapping[str, Any], owner: str) -> None:
        check_non_negative(owner, group, "lr", "eps", "weight_decay", "max_coeff", "min_coeff")
        check_betas(owner, group["betas"])
        for name in ("bias_correction", "eps_inside_sqrt"):
            if not isinstance(group[name], bool):
                raise TypeError(f"{owner}: {name} must be a bool; got {group[name]!r}")

    def state_keys(self, group: Mapping[str, Any]) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update every parameter whose ``.grad`` is not None; return ``closure()``'s loss."""
        self.coefficients = []
        if self.piece_map is None:  # whole parameters: the base class's loop, one at a time
            return super().step(closure)
        return self._step_pieces(closure)

    def _update(
        self, param: Any, state: dict[str, Any], group: dict[str, Any], scratch: Any
    ) -> None:
        beta1, beta2 = group["betas"]
        coeff = F.lamb(
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
            bias_correction=group["bias_correction"],
            eps_inside_sqrt=group["eps_inside_sqrt"],
            max_coeff=group["max_coeff"],
            min_coeff=group["min_coeff"],
            scratch=scratch,
        )
        self.coefficients.append(coeff)

    def _step_pieces(self, closure: Callable[[], Any] | None) -> Any:
        """The two passes over slices: moments and partial sums, the sums added over ranks
        (``piece_map.reduce``), then each slice stepped with its parameter's trust ratio."""
        loss = None if closure is None else closure()
        runs = self._runs()
        sums = self.piece_map.reduce(self._partial_norms(runs))
        group_of = {key: group for _, _, group, key, _, _ in runs}
        coefficients = {
            key: F.trust_ratio(
                math.sqrt(sums[key][0]),
                math.sqrt(sums[key][1]),
                max_coeff=group["max_coeff"],
                min_coeff=group["min_coeff"],
            )
            for key, group in group_of.items()
        }
        self._apply(runs, coefficients)
        self.coefficients = list(coefficients.values())
        return loss

    def _runs(self) -> list[tuple]:
        """(param, state, group, key, start, stop) for every slice of a parameter with a
        gradient, its state created on its first step and its step count advanced."""
        runs = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p] if p in self.state else {}
                if not state:
                    state.update(self._init_state(p, group))
                state["step"] += 1.0
                self.state[p] = state
                runs += [(p, state, group, *piece) for piece in self.piece_map.pieces(p)]
        return runs

    def _partial_norms(self, runs: list[tuple]) -> dict[Hashable, list[float]]:
        """First pass: update each slice's moments; {key: [‖w‖², ‖update‖²]} of this rank's
        slices of each parameter."""
        sums: dict[Hashable, list[float]] = {}
        for p, state, group, key, lo, hi in runs:
            beta1, beta2 = group["betas"]
            partial = F.lamb_moments(
                flat(p.data)[lo:hi],
                flat(p.grad)[lo:hi],
                flat(state["exp_avg"])[lo:hi],
                flat(state["exp_avg_sq"])[lo:hi],
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                eps_inside_sqrt=group["eps_inside_sqrt"],
                scratch=self._scratch_for(p.data),
            )
            total = sums.setdefault(key, [0.0, 0.0])
            total[0] += partial[0]
            total[1] += partial[1]
        return sums

    def _apply(self, runs: list[tuple], coefficients: dict[Hashable, float]) -> None:
        """Second pass: step each slice with its parameter's trust ratio."""
        for p, state, group, key, lo, hi in runs:
            beta1, beta2 = group["betas"]
            step_size = F.lamb_step_size(
                group["lr"],
                beta1,
                beta2,
                state["step"],
                group["bias_correction"],
                state_dtype(p.data.dtype),
            )
            F.lamb_apply(
                flat(p.data)[lo:hi],
                flat(state["exp_avg"])[lo:hi],
                flat(state["exp_avg_sq"])[lo:hi],
                step_size=step_size,
                coeff=coefficients[key],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                eps_inside_sqrt=group["eps_inside_sqrt"],
                scratch=self._scratch_for(p.data),
            )
