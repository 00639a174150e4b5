"""Knowing, during backward, the moment each parameter's gradient is final.

ZeRO's stages start reducing a bucket of gradients while backward is still running, as soon as
every parameter in it has its final gradient for this backward (torch offers the same event as a
tensor's post-accumulate-grad hook). A parameter's gradient is final when the last module that
*used* it in forward has finished its backward; a parameter can be used more than once (tied
embeddings, a block applied twice), so uses are counted:

* forward hook of each module that owns parameters: ``uses[p] += 1`` (only while gradients are
  recorded, so a no-grad forward or the discarded first pass of activation checkpointing does
  not count);
* full backward hook of the same module (after it wrote its gradients): ``uses[p] -= 1``; at
  zero the parameter is reported ready. A module's parameters are reported in the order of its
  ``grad_ready_order`` (names; default: registration order), the order torch's autograd
  finishes them, which DeepSpeed's gradient buckets follow (``zerosim/zero/ipg.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zerosim.nn.grad_mode import is_grad_enabled
from zerosim.nn.module import Module
from zerosim.nn.parameter import Parameter


class GradReadyTracker:
    """Calls ``on_ready(param)`` once per backward for each parameter whose gradient is final."""

    def __init__(
        self,
        model: Module,
        on_ready: Callable[[Parameter], None],
        order: Callable[[Module], tuple[str, ...]] | None = None,
    ) -> None:
        """``order(module)``: the names in the order to report them, instead of the module's
        ``grad_ready_order`` (DeepSpeed's stage 3 finishes a Linear's weight first)."""
        self._on_ready = on_ready
        self._uses: dict[int, int] = {}
        self._handles = []
        for module in model.modules():
            order_of = getattr(module, "grad_ready_order", ()) if order is None else order(module)
            names = [n for n in order_of if n in module._parameters]
            names += [n for n in module._parameters if n not in names]
            own = [module._parameters[n] for n in names if module._parameters[n] is not None]
            if not own:
                continue
            self._handles.append(module.register_forward_hook(self._forward_hook(own)))
            self._handles.append(module.register_full_backward_hook(self._backward_hook(own)))

    def _forward_hook(self, own: list[Parameter]) -> Callable[..., None]:
        def hook(module: Module, args: Any, output: Any) -> None:
            if is_grad_enabled():
                for p in own:
                    self._uses[id(p)] = self._uses.get(id(p), 0) + 1

        return hook

    def _backward_hook(self, own: list[Parameter]) -> Callable[..., None]:
        def hook(module: Module, grad_input: Any, grad_output: Any) -> None:
            for p in own:
                left = self._uses.get(id(p), 0) - 1
                self._uses[id(p)] = left
                if left == 0:
                    self._on_ready(p)

        return hook

    def reset(self) -> None:
        """Forget the counts (after a backward, or a forward that was never backpropagated)."""
        self._uses.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
