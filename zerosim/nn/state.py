"""State of a module tree: ``state_dict``, ``load_state_dict`` and casting (``Module.to``).

Keys are torch's: the dotted path of the owning module plus the attribute name, for every
parameter and persistent buffer, visiting shared modules and tied parameters under each of
their names (so a tied weight appears twice, as in torch).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple, Protocol

import numpy as np

from zerosim.backend import (
    DTYPES,
    Backend,
    StandardNamespace,
    from_host,
    get_backend,
    np_dtype,
    resolve_dtype,
    to_host,
    xp_of,
)
from zerosim.nn.functional import is_floating
from zerosim.nn.parameter import Parameter


class ModuleTree(Protocol):
    """What this file reads of a module tree; ``zerosim.nn.module.Module`` is the one there is.

    Written as a protocol so that this file, which ``Module`` calls, does not import it back.
    """

    _parameters: dict[str, Parameter | None]
    _buffers: dict[str, Any]
    _non_persistent: set[str]

    def named_modules(
        self, memo: set[int] | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, ModuleTree]]: ...

    def modules(self) -> Iterator[ModuleTree]: ...

    def parameters(self) -> Iterator[Parameter]: ...


class StateDictError(ValueError):
    """``load_state_dict`` found missing or unexpected keys, or shapes that differ."""


class LoadResult(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


def state_entries(module: ModuleTree) -> dict[str, tuple[ModuleTree, str, bool]]:
    """state-dict key → (owning module, attribute name, is_parameter)."""
    entries: dict[str, tuple[ModuleTree, str, bool]] = {}
    for module_name, m in module.named_modules(remove_duplicate=False):
        dot = f"{module_name}." if module_name else ""
        for name, p in m._parameters.items():
            if p is not None:
                entries[dot + name] = (m, name, True)
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent:
                entries[dot + name] = (m, name, False)
    return entries


def state_dict(module: ModuleTree) -> dict[str, Any]:
    """{key: the parameter's ``.data`` or the buffer}, references, in definition order."""
    out = {}
    for key, (m, name, is_param) in state_entries(module).items():
        out[key] = m._parameters[name].data if is_param else m._buffers[name]
    return out


def load_state_dict(module: ModuleTree, values: dict[str, Any], strict: bool = True) -> LoadResult:
    """Validate every key and shape first, then copy in place (``target[...] = value``)."""
    entries = state_entries(module)
    missing = [k for k in entries if k not in values]
    unexpected = [k for k in values if k not in entries]
    mismatched = []
    for key, (m, name, is_param) in entries.items():
        if key in values:
            expected = m._parameters[name].shape if is_param else tuple(m._buffers[name].shape)
            got = tuple(np.shape(values[key]))
            if got != expected:
                mismatched.append(f"{key}: got shape {got}, expected {expected}")
    problems = []
    if strict and missing:
        problems.append(f"missing keys {missing}")
    if strict and unexpected:
        problems.append(f"unexpected keys {unexpected}")
    if mismatched:
        problems.append(f"shape mismatches [{'; '.join(mismatched)}]")
    if problems:
        raise StateDictError(
            f"load_state_dict into {type(module).__name__}: " + ", ".join(problems)
        )
    for key, (m, name, is_param) in entries.items():
        if key not in values:
            continue
        target = m._parameters[name].data if is_param else m._buffers[name]
        if is_param and tuple(target.shape) != m._parameters[name].shape:
            raise RuntimeError(
                f"parameter {key!r} currently holds shape {tuple(target.shape)} (released?); "
                f"gather it to its full shape {m._parameters[name].shape} before loading"
            )
        target[...] = _like(values[key], target)
    return LoadResult(missing, unexpected)


def _like(value: Any, target: Any) -> Any:
    """``value`` on ``target``'s backend: as it is when it already lives there, else crossed
    through the host (``to_host`` then ``from_host``, each counted off NumPy)."""
    xp = xp_of(target)
    if xp is np:
        return to_host(value)
    if xp_of(value) is xp:
        return value
    return from_host(to_host(value), like=target)


def cast(module: ModuleTree, dtype: Any = None, backend: str | Backend | None = None) -> None:
    """Rebind every parameter's ``.data`` / ``.grad`` and every buffer to a copy in ``dtype``
    (floating arrays only) on ``backend``; Parameter objects and their ``shape`` stay.

    Arrays reach another backend through the counted crossings (``to_host`` / ``from_host``
    inside ``Backend.asarray``). A dtype the target namespace cannot hold (16-bit floats on
    array_api_strict, bfloat16 on cupy) raises TypeError before anything is changed."""
    dt = None if dtype is None else resolve_dtype(dtype)
    be = get_backend(backend) if isinstance(backend, str) else backend
    if be is not None and be.name == "cupy" and dt == DTYPES["bfloat16"]:
        raise TypeError(
            "dtype 'bfloat16' is not supported by the cupy backend; "
            "allowed on cupy: float64, float32, float16"
        )

    def target_dtype(a: Any) -> np.dtype:
        current = np_dtype(a.dtype)
        return dt if dt is not None and is_floating(current) else current

    if be is not None and isinstance(be.xp, StandardNamespace):
        for a in _arrays(module):
            be.xp.dtype(target_dtype(a))  # raises TypeError naming a dtype it lacks

    def convert(a: Any) -> Any:  # cast where the array is, then move it
        if dt is not None and is_floating(a.dtype):
            a = a.astype(dt) if isinstance(a, np.ndarray) else xp_of(a).astype(a, dt)
        if be is not None:
            a = to_host(a) if be.name == "numpy" else be.asarray(a)
        return a

    for p in module.parameters():
        if p.partition is not None:  # zero.Init: cast this rank's chunk
            p.partition.chunk = convert(p.partition.chunk)
        p.data = convert(p.data)
        p.grad = None if p.grad is None else convert(p.grad)
        p.dtype = np_dtype(p.data.dtype)
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = convert(b)


def _arrays(module: ModuleTree) -> list[Any]:
    """Every array ``cast`` converts: parameters' data, chunks and gradients, and buffers."""
    arrays = []
    for p in module.parameters():
        arrays += [a for a in (p.data, p.grad) if a is not None]
        if p.partition is not None:
            arrays.append(p.partition.chunk)
    for m in module.modules():
        arrays += [b for b in m._buffers.values() if b is not None]
    return arrays
