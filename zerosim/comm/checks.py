"""The arguments of a collective, checked on this rank before anything is sent.

Each check raises an error naming the argument, the value and what is allowed; the common case
(a C-contiguous NumPy array of a supported dtype) passes in a few attribute reads. What every rank
must agree on (the same call, dtype and size) is the cross-rank check's job (``comm/agreement.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from zerosim.backend import DTYPES, dtype_name, is_device_array, np_dtype, resolve_dtype

OPS = ("sum", "max", "min")
COLLECTIVES = ("native", "ring")
SUPPORTED_DTYPES = ("float64", "float32", "float16", "bfloat16", "int8", "uint8", "int32", "int64")
SUPPORTED = {np.dtype(resolve_dtype(n)) if n in DTYPES else np.dtype(n) for n in SUPPORTED_DTYPES}


def address(x: Any) -> int | None:
    """Where ``x``'s first element lives: NumPy's and CuPy's pointers; None for an Array API
    standard array, which exposes none (its collectives then never run in place)."""
    if isinstance(x, np.ndarray):
        return x.__array_interface__["data"][0]
    data = getattr(x, "data", None)
    return data.ptr if hasattr(data, "ptr") else None


def buffer(name: str, x: Any, writable: bool = False) -> None:
    """``x`` is an array of a supported dtype, C-contiguous, and writable if it must be."""
    if type(x) is np.ndarray:  # the common case, accepted in a few attribute reads
        flags = x.flags
        if x.dtype in SUPPORTED and flags.c_contiguous and (flags.writeable or not writable):
            return
    _explain_buffer(name, x, writable)


def _explain_buffer(name: str, x: Any, writable: bool) -> None:
    """Raise the error that says what is wrong with ``x`` (device arrays that pass return)."""
    if not (isinstance(x, np.ndarray) or is_device_array(x)):
        raise TypeError(
            f"{name} must be an array (numpy, cupy or the Array API backend's), got "
            f"{type(x).__name__}"
        )
    if np_dtype(x.dtype) not in SUPPORTED:
        raise TypeError(
            f"{name} has dtype {dtype_name(x.dtype)}; allowed: {list(SUPPORTED_DTYPES)}"
        )
    if not hasattr(x, "flags"):  # an Array API standard array: no memory layout to check
        return
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous, got an array with strides {x.strides}")
    if writable and isinstance(x, np.ndarray) and not x.flags.writeable:
        raise ValueError(f"{name} must be writable, got a read-only array")


def collectives(value: str) -> str:
    if value not in COLLECTIVES:
        raise ValueError(f"collectives must be one of {list(COLLECTIVES)}, got {value!r}")
    return value


def op(value: str) -> None:
    if value not in OPS:
        raise ValueError(f"op must be one of {list(OPS)}, got {value!r}")


def root(value: int, size: int) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, np.integer))
        or not (0 <= value < size)
    ):
        raise ValueError(f"root must be an int in [0, {size}), got {value!r}")


def reduce(buf: Any, at: int, reduction: str, rank: int, size: int) -> None:
    """A reduce to rank ``at``: only the root's buffer is written."""
    root(at, size)
    buffer("buf", buf, writable=rank == at)
    op(reduction)


def same_dtype(out: Any, inp: Any) -> None:
    if type(out) is not type(inp) and (is_device_array(out) or is_device_array(inp)):
        raise TypeError(
            f"out and inp must be arrays of one kind on one device, got out "
            f"{type(out).__module__}.{type(out).__name__} and inp "
            f"{type(inp).__module__}.{type(inp).__name__} (move one with "
            "zerosim.backend.from_host / to_host)"
        )
    if out.dtype != inp.dtype:
        raise TypeError(
            f"out and inp must have the same dtype, got out {dtype_name(out.dtype)}"
            f" and inp {dtype_name(inp.dtype)}"
        )


def disjoint(name: str, out: Any, inp: Any) -> None:
    if isinstance(out, np.ndarray) and np.may_share_memory(out, inp):
        raise ValueError(f"{name}: out and inp must not overlap")


def is_own_slice(full: Any, part: Any, rank: int) -> bool:
    """Whether ``part`` is chunk ``rank`` of ``full`` (the collective then runs in place)."""
    if part.size == 0 or type(full) is not type(part):
        return False
    if isinstance(full, np.ndarray) and not np.may_share_memory(full, part):
        return False  # the common case, decided by a bounds check in C
    at, base = address(part), address(full)
    if at is None or base is None:
        return False
    return at == base + rank * part.size * np_dtype(part.dtype).itemsize


def gather_scatter(
    name: str, full: Any, part: Any, rank: int, size: int, reduction: str | None = None
) -> bool:
    """The checks of all_gather (full=out, part=inp) and reduce_scatter (the reverse); True when
    ``part`` is this rank's own chunk of ``full`` (the call runs in place)."""
    full_name, part_name = ("out", "inp") if name == "all_gather" else ("inp", "out")
    buffer(part_name, part, writable=name == "reduce_scatter")
    buffer(full_name, full, writable=name == "all_gather")
    if reduction is not None:
        op(reduction)
    same_dtype(full, part)
    if full.size != size * part.size:
        raise ValueError(
            f"{name} needs {full_name}.size == size * {part_name}.size = "
            f"{size} * {part.size} = {size * part.size}, "
            f"got {full_name}.size={full.size}"
        )
    if type(full) is np.ndarray and not np.may_share_memory(full, part):
        return False  # the common case: two buffers, told apart by a bounds check in C
    if is_own_slice(full, part, rank):
        return True  # in place: the part is this rank's own chunk of the full buffer
    disjoint(name, full, part)
    return False


def counts(
    out: Any, inp: Any, pieces: Sequence[int], reduction: str, rank: int, size: int
) -> tuple[int, ...]:
    """The checks of an uneven reduce-scatter; returns ``pieces`` as a tuple of ints."""
    buffer("inp", inp)
    buffer("out", out, writable=True)
    op(reduction)
    same_dtype(out, inp)
    if len(pieces) != size or any(
        isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 0 for c in pieces
    ):
        raise ValueError(
            f"counts must hold {size} non-negative ints (one per rank), got {pieces!r}"
        )
    pieces = tuple(int(c) for c in pieces)
    if sum(pieces) != inp.size or out.size != pieces[rank]:
        raise ValueError(
            f"reduce_scatter_v needs sum(counts) == inp.size and out.size == "
            f"counts[{rank}]; got sum(counts)={sum(pieces)}, inp.size={inp.size}, "
            f"out.size={out.size}, counts[{rank}]={pieces[rank]}"
        )
    disjoint("reduce_scatter_v", out, inp)
    return pieces


def all_to_all(out: Any, inp: Any, size: int) -> None:
    buffer("inp", inp)
    buffer("out", out, writable=True)
    same_dtype(out, inp)
    if out.size != inp.size or inp.size % size:
        raise ValueError(
            f"all_to_all needs out.size == inp.size and a multiple of size={size}"
            f"; got out.size={out.size}, inp.size={inp.size}"
        )
    disjoint("all_to_all", out, inp)


def split(color: int, key: int, name: str | None) -> None:
    """``split``'s arguments: a colour ≥ 0, an int key, and a name for the ledger or None."""
    if isinstance(color, bool) or not isinstance(color, (int, np.integer)) or color < 0:
        raise ValueError(f"color must be a non-negative int, got {color!r}")
    if isinstance(key, bool) or not isinstance(key, (int, np.integer)):
        raise ValueError(f"key must be an int, got {key!r}")
    if name is not None and (not isinstance(name, str) or not name or "/" in name):
        raise ValueError(f"name must be None or a non-empty string without '/', got {name!r}")
