"""Lion (EvoLved Sign Momentum, Chen et al. 2023), with the torch.optim-style API.

torch.optim has no Lion; the class's defaults follow the paper and lion-pytorch (lr 1e-4,
betas (0.9, 0.99), weight_decay 0), whose authors suggest an lr 3-10x smaller than AdamW's.
A DeepSpeed config's ``"optimizer": {"type": "Lion"}`` section gets DeepSpeed's defaults
instead (lr 1e-3, betas (0.9, 0.999), those of its FusedLion): ``OptimizerConfig.kwargs``
fills them in, so the class keeps the API its users expect and a config means what it means
in DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from zerosim.optim import functional as F
from zerosim.optim.optimizer import Optimizer, check_betas, check_range


class Lion(Optimizer):
    """Lion; the formula is in ``functional.lion``. State per parameter: ``'exp_avg'``."""

    counts_steps = False

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": betas,
            "weight_decay": weight_decay,
            "maximize": maximize,
        }
        super().__init__(params, defaults)

    def _check_group(self, group: Mapping[str, Any], owner: str) -> None:
        check_range(owner, "lr", group["lr"])
        check_betas(owner, group["betas"])
        check_range(owner, "weight_decay", group["weight_decay"])

    def state_keys(self, group: Mapping[str, Any]) -> tuple[str, ...]:
        return ("exp_avg",)

    def _update(
        self, param: Any, state: dict[str, Any], group: dict[str, Any], scratch: Any
    ) -> None:
        beta1, beta2 = group["betas"]
        F.lion(
            param.data,
            param.grad,
            state["exp_avg"],
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            maximize=group["maximize"],
            scratch=scratch,
        )
