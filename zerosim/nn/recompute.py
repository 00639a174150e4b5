"""Activation checkpointing: keep a module's input, recompute its activations in backward.

``checkpoint(block)`` returns a wrapper whose forward runs ``block`` under ``no_grad()``
(nothing inside saves), keeping only the input; its backward first re-runs the forward
with saving on, then backpropagates as usual (Chen et al. 2016, "Training Deep Nets with
Sublinear Memory Cost"). The wrapper shares the block's parameters, buffers and children
*tables*, so parameter names do not change (``blocks.0.ln_1.weight`` stays that) and the
wrapper takes the block's place in ``named_modules``. Recomputation restores every
``rng`` (dropout) inside to its state at the first forward, and puts buffers (BatchNorm
running statistics) back as they were, so gradients are bitwise those of the plain block.
Hooks of the modules inside fire twice in forward order: once in forward, once in the
recomputation (this is where stage 3 gathers the parameters again).

``saved_bytes(model)`` sums the bytes of the arrays that the saved stacks keep alive.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from zerosim.backend import nbytes, xp_of
from zerosim.nn.grad_mode import enable_grad, no_grad
from zerosim.nn.module import Module


class _RngStates:
    """Generator states of the dropout layers inside a block (not counted as activations)."""

    def __init__(self, modules: list[Module]) -> None:
        self.entries = [(m, m.rng.bit_generator.state) for m in modules]

    def restore(self) -> None:
        for m, state in self.entries:
            m.rng.bit_generator.state = state


class Checkpoint(Module):
    """Wraps ``module``: same parameters and names, only the input kept between passes."""

    def __init__(self, module: Module) -> None:
        super().__init__()
        if not isinstance(module, Module):
            raise TypeError(f"checkpoint expects a Module; got {type(module).__name__}")
        d = self.__dict__
        d["inner"] = module  # a plain attribute: not a child, so no name prefix
        for table in ("_parameters", "_buffers", "_non_persistent", "_modules"):
            d[table] = module.__dict__[table]
        d["training"] = module.training

    def _random_modules(self) -> list[Module]:
        return [
            m
            for m in self.inner.modules()
            if isinstance(m.__dict__.get("rng"), np.random.Generator)
        ]

    def forward(self, *args: Any) -> Any:
        self.save_for_backward(args, _RngStates(self._random_modules()))
        with no_grad():
            return self.inner(*args)

    def _backward(self, *grad_output: Any) -> Any:
        args, rng_at_forward = self.pop_saved()
        rng_now = _RngStates(self._random_modules())
        buffers = [
            (m, name, xp_of(b).asarray(b, copy=True))
            for m in self.inner.modules()
            for name, b in m._buffers.items()
            if b is not None
        ]
        rng_at_forward.restore()
        with enable_grad():
            self.inner(*args)
        rng_now.restore()
        for m, name, value in buffers:
            m._buffers[name][...] = value
        return self.inner.backward(*grad_output)

    def train(self, mode: bool = True) -> Module:
        self.training = mode
        self.inner.train(mode)
        return self

    def saved_arrays(self) -> Iterator[Any]:
        yield from super().saved_arrays()
        yield from self.inner.saved_arrays()

    def clear_saved(self) -> None:
        self.inner.clear_saved()
        self._saved.clear()

    def __repr__(self) -> str:
        return f"Checkpoint({self.inner!r})"


def checkpoint(module: Module) -> Checkpoint:
    """``module`` wrapped for activation checkpointing (returned as is if already wrapped)."""
    return module if isinstance(module, Checkpoint) else Checkpoint(module)


def _root(array: Any) -> Any:
    """The array that owns the memory ``array`` views (NumPy's and CuPy's ``.base``; an
    Array API standard array does not say, so it stands for itself)."""
    while hasattr(getattr(array, "base", None), "nbytes") and hasattr(array.base, "shape"):
        array = array.base
    return array


def saved_bytes(model: Module) -> int:
    """Bytes held by the saved stacks of ``model``'s modules: each buffer counted once,
    with its full size when a view of it is saved (where the backend tells views apart)."""
    seen: set[int] = set()
    total = 0
    for m in model.modules():
        for array in m.saved_arrays():
            root = _root(array)
            if id(root) not in seen:
                seen.add(id(root))
                total += nbytes(root)
    return total
