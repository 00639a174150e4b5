"""``Module``: the base of every layer — explicit forward/backward, names, state, hooks.

There is no autograd. Each layer writes ``forward(*inputs)`` and ``_backward(*grad_output)``;
forward pushes what backward needs onto the module's own *saved stack* (last in, first
out), so a module called twice in one forward is backpropagated twice, in reverse order.
Calling ``module(x)`` runs the forward hooks around ``forward``; calling
``module.backward(g)`` runs the backward hooks around ``_backward``. A composite module
calls its children the same way, so every module's hooks fire, in torch's order:

    forward:  pre-hook(m, args) → forward → hook(m, args, output)
    backward: pre-hook(m, grad_output) → _backward (writes m's parameter grads)
              → hook(m, grad_input, grad_output)

``grad_output`` and ``grad_input`` are tuples, one entry per output / positional input
(None for an input that has no gradient, such as token ids or targets). The ZeRO engine
gathers and releases parameters in these hooks (stage 3) and starts gradient reductions
from the full backward hook (stage 2), which therefore fires after the module's own
parameter gradients are written.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from zerosim.backend import Backend, is_device_array
from zerosim.nn import state
from zerosim.nn.grad_mode import is_grad_enabled
from zerosim.nn.parameter import Parameter
from zerosim.nn.state import LoadResult, StateDictError

__all__ = ["LoadResult", "Module", "RemovableHandle", "StateDictError"]

_hook_ids = itertools.count()
_parameter_registration_hooks: dict[int, Callable[..., Any]] = {}


def register_module_parameter_registration_hook(hook: Callable[..., Any]) -> RemovableHandle:
    """``hook(module, name, param) -> None | new Parameter`` whenever any module registers a
    parameter (torch's global hook of the same name). ``zerosim.zero.Init`` uses it to partition
    each parameter as soon as its module creates it."""
    key = next(_hook_ids)
    _parameter_registration_hooks[key] = hook
    return RemovableHandle(_parameter_registration_hooks, key)


class RemovableHandle:
    """Returned by ``register_*_hook``; ``handle.remove()`` unregisters the hook."""

    def __init__(self, hooks: dict[int, Callable[..., Any]], key: int) -> None:
        self._hooks = hooks
        self._key = key

    def remove(self) -> None:
        self._hooks.pop(self._key, None)


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, tuple | list) else (value,)


def _iter_arrays(item: Any) -> Iterator[Any]:
    """The arrays inside a saved entry (nested tuples and lists; other objects are skipped)."""
    if isinstance(item, tuple | list):
        for x in item:
            yield from _iter_arrays(x)
    elif isinstance(item, np.ndarray) or is_device_array(item):
        yield item


class Module:
    """Base class: subclasses set children/parameters as attributes and define the math."""

    training: bool

    def __init__(self) -> None:
        d = self.__dict__
        d["_parameters"] = {}
        d["_buffers"] = {}
        d["_non_persistent"] = set()
        d["_modules"] = {}
        d["_saved"] = []
        d["_forward_pre_hooks"] = {}
        d["_forward_hooks"] = {}
        d["_backward_pre_hooks"] = {}
        d["_backward_hooks"] = {}
        d["training"] = True

    # --- attributes: parameters, buffers and children are registered by assignment --------

    def __setattr__(self, name: str, value: Any) -> None:
        params, buffers, modules = self._parameters, self._buffers, self._modules
        if isinstance(value, Parameter):
            for table in (buffers, modules, self.__dict__):
                table.pop(name, None)
            for hook in list(_parameter_registration_hooks.values()):
                value = hook(self, name, value) or value
            params[name] = value
        elif isinstance(value, Module):
            for table in (params, buffers, self.__dict__):
                table.pop(name, None)
            modules[name] = value
        elif name in params and value is None:
            params[name] = None  # as torch: the slot stays, without a parameter
        elif name in params:
            raise TypeError(
                f"cannot assign {type(value).__name__} to parameter {name!r}; "
                "allowed: a Parameter (assign to .data to change its array)"
            )
        elif name in buffers:
            buffers[name] = value
        else:
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        d = self.__dict__
        for table in ("_parameters", "_buffers", "_modules"):
            if table in d and name in d[table]:
                return d[table][name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __delattr__(self, name: str) -> None:
        for table in (self._parameters, self._buffers, self._modules):
            if name in table:
                del table[name]
                return
        object.__delattr__(self, name)

    def register_buffer(self, name: str, array: Any, persistent: bool = True) -> None:
        """A non-trainable array that belongs to the module state (e.g. running statistics)."""
        self._buffers[name] = array
        if not persistent:
            self._non_persistent.add(name)

    def register_module(self, name: str, module: Module) -> None:
        setattr(self, name, module)

    # --- forward / backward with hooks ---------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define forward")

    def _backward(self, *grad_output: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define _backward")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for hook in list(self._forward_pre_hooks.values()):
            result = hook(self, args)
            if result is not None:
                args = _as_tuple(result)
        output = self.forward(*args, **kwargs)
        for hook in list(self._forward_hooks.values()):
            result = hook(self, args, output)
            if result is not None:
                output = result
        return output

    def backward(self, *grad_output: Any) -> Any:
        """Backpropagate ``grad_output`` through this module, firing its backward hooks.

        Returns the gradient of the input (a tuple when forward took several inputs).
        """
        for hook in list(self._backward_pre_hooks.values()):
            result = hook(self, grad_output)
            if result is not None:
                grad_output = _as_tuple(result)
        grad_input = _as_tuple(self._backward(*grad_output))
        for hook in list(self._backward_hooks.values()):
            result = hook(self, grad_input, grad_output)
            if result is not None:
                grad_input = _as_tuple(result)
        return grad_input[0] if len(grad_input) == 1 else grad_input

    def save_for_backward(self, *items: Any) -> None:
        """Push what backward will need (skipped under ``no_grad()``)."""
        if is_grad_enabled():
            self._saved.append(items)

    def pop_saved(self) -> tuple[Any, ...]:
        """Pop the entry pushed by the matching forward (the most recent one not yet used)."""
        if not self._saved:
            raise RuntimeError(
                f"{type(self).__name__}.backward has no saved forward to use: backward ran more "
                "often than forward, or forward ran under no_grad()"
            )
        return self._saved.pop()

    def saved_arrays(self) -> Iterator[Any]:
        """The arrays on this module's own saved stack (children not included)."""
        yield from _iter_arrays(self._saved)

    def clear_saved(self) -> None:
        """Drop every saved activation in this subtree (e.g. of a forward never backpropagated)."""
        self._saved.clear()
        for child in self._modules.values():
            child.clear_saved()

    # --- hooks ---------------------------------------------------------------------------

    def _add_hook(
        self, table: dict[int, Callable[..., Any]], hook: Callable[..., Any]
    ) -> RemovableHandle:
        key = next(_hook_ids)
        table[key] = hook
        return RemovableHandle(table, key)

    def register_forward_pre_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """``hook(module, args) -> None | new args`` before forward."""
        return self._add_hook(self._forward_pre_hooks, hook)

    def register_forward_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """``hook(module, args, output) -> None | new output`` after forward."""
        return self._add_hook(self._forward_hooks, hook)

    def register_full_backward_pre_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """``hook(module, grad_output) -> None | new grad_output`` before the module's backward."""
        return self._add_hook(self._backward_pre_hooks, hook)

    def register_full_backward_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """``hook(module, grad_input, grad_output) -> None | new grad_input`` after it.

        Fires after this module's parameter gradients have been written. (torch fires it
        early, before them, for a module none of whose inputs needs a gradient; zerosim
        always fires it last.)
        """
        return self._add_hook(self._backward_hooks, hook)

    # --- traversal -----------------------------------------------------------------------

    def named_children(self) -> Iterator[tuple[str, Module]]:
        yield from self._modules.items()

    def children(self) -> Iterator[Module]:
        yield from self._modules.values()

    def named_modules(
        self, memo: set[int] | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, Module]]:
        """(dotted name, module) in pre-order, this module first with name ``prefix``."""
        memo = set() if memo is None else memo
        if remove_duplicate:
            if id(self) in memo:
                return
            memo.add(id(self))
        yield prefix, self
        for name, child in self._modules.items():
            child_prefix = f"{prefix}.{name}" if prefix else name
            yield from child.named_modules(memo, child_prefix, remove_duplicate)

    def modules(self) -> Iterator[Module]:
        for _, m in self.named_modules():
            yield m

    def named_parameters(
        self, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, Parameter]]:
        """(dotted name, Parameter) in definition order; a shared Parameter appears once."""
        seen: set[int] = set()
        for module_name, m in self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate):
            for name, p in m._parameters.items():
                if p is None or (remove_duplicate and id(p) in seen):
                    continue
                seen.add(id(p))
                yield (f"{module_name}.{name}" if module_name else name), p

    def parameters(self) -> Iterator[Parameter]:
        for _, p in self.named_parameters():
            yield p

    def named_buffers(self, prefix: str = "") -> Iterator[tuple[str, Any]]:
        for module_name, m in self.named_modules(prefix=prefix):
            for name, b in m._buffers.items():
                if b is not None:
                    yield (f"{module_name}.{name}" if module_name else name), b

    def buffers(self) -> Iterator[Any]:
        for _, b in self.named_buffers():
            yield b

    # --- state (the work is done in zerosim/nn/state.py) ----------------------------------

    def state_dict(self) -> dict[str, Any]:
        """{name: array} of parameters and persistent buffers.

        Like torch, values are the current arrays themselves (references, on the module's
        backend), and a tied Parameter appears under each of its names. Copy or
        ``to_host`` them to keep a snapshot.
        """
        return state.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> LoadResult:
        """Copy arrays into the parameters and buffers, in place (views stay valid).

        Raises StateDictError listing every missing key, unexpected key (both only when
        ``strict``) and shape mismatch, before anything is copied.
        """
        return state.load_state_dict(self, state_dict, strict)

    def train(self, mode: bool = True) -> Module:
        """Set training mode here and, through each child's ``train``, below. Returns self."""
        self.training = mode
        for child in self._modules.values():
            child.train(mode)
        return self

    def eval(self) -> Module:
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop gradients (``set_to_none``) or zero them in place (keeps flat-buffer views)."""
        for p in self.parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad[...] = 0

    def to(self, dtype: Any = None, backend: str | Backend | None = None) -> Module:
        """Cast floating parameters, gradients and buffers to ``dtype`` and/or move them to
        ``backend`` ('numpy' | 'cupy' | 'array_api_strict', whose arrays live on its
        ``Device("device1")``), crossing through ``to_host`` / ``from_host``; the Parameter
        objects stay the same. Returns self."""
        state.cast(self, dtype, backend)
        return self

    # --- display ---------------------------------------------------------------------------

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}({self.extra_repr()}"]
        for name, child in self._modules.items():
            lines.append("  (" + name + "): " + repr(child).replace("\n", "\n  "))
        return lines[0] + ")" if len(lines) == 1 else "\n".join(lines) + "\n)"
