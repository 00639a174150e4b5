"""The shape-only array namespace: NumPy's names, as zerosim's code calls them, on ``MetaArray``.

``backend.xp_of(x)`` returns ``NAMESPACE`` for a ``MetaArray`` (the class names it in
``__zerosim_namespace__``), so every layer, update rule and stage that computes with "the
namespace of its arrays" runs on it unchanged, taking the paths it takes for CuPy: NumPy's
conventions (``out=``, ``copyto``, ufuncs, ``.flags``), not the Array API standard's fallbacks.

Each function computes the result's shape (NumPy's broadcasting, reductions, matrix products,
indexing) and dtype (NumPy's own, see ``array.result_dtype``), allocates it unless it writes into
``out=`` or returns a view, and counts a matrix product's FLOPs (``tracker.Tracker``). A name
zerosim's code does not call is not here: asking for one raises AttributeError naming it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from zerosim.meta.array import MetaArray, broadcast_shapes, probe, result_dtype, shape_of
from zerosim.meta.tracker import current, rate_class, values

_TESTS = {np.isfinite: False, np.isnan: True, np.isinf: True}  # the answer when overflow is True
_LOGICAL = {np.logical_and: all, np.logical_or: any}


def _shape(shape: Any) -> tuple[int, ...]:
    return (int(shape),) if isinstance(shape, int | np.integer) else tuple(int(d) for d in shape)


def _axes(axis: Any, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, int | np.integer) else tuple(axis)
    out = []
    for a in axes:
        if not -ndim <= a < max(ndim, 1):
            raise np.exceptions.AxisError(
                f"axis {a} is out of bounds for array of dimension {ndim}"
            )
        out.append(int(a) % max(ndim, 1))
    return tuple(out)


def _reduced(shape: tuple[int, ...], axis: Any, keepdims: bool) -> tuple[int, ...]:
    axes = _axes(axis, len(shape))
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def _nbytes(*operands: Any) -> int:
    """The bytes of the array operands (scalars: none)."""
    return sum(x.nbytes for x in operands if isinstance(x, MetaArray | np.ndarray))


def _dtypes(*operands: Any) -> list[np.dtype]:
    """The dtypes of the array operands (scalars: none)."""
    return [x.dtype for x in operands if isinstance(x, MetaArray | np.ndarray)]


def _joined(kind: str, sources: list, result: Any) -> Any:
    """``result``, made by copying elements (``sources`` read, or as many as it holds when
    none are given), counted as one operation of ``kind`` (what a host's time model prices)."""
    read = _nbytes(*sources) if sources else result.nbytes
    rate = rate_class(_dtypes(*sources), result.dtype, copy=True)
    current().op(kind, read + result.nbytes, rate)
    return result


def _write(out: MetaArray, shape: tuple[int, ...]) -> MetaArray:
    """``out`` receiving a result of ``shape`` (NumPy's error when it cannot)."""
    if broadcast_shapes(shape, out.shape) != out.shape:
        raise ValueError(
            f"non-broadcastable output operand with shape {out.shape} doesn't match the "
            f"broadcast shape {shape}"
        )
    out.value = None
    return out


class MetaNamespace:
    """NumPy's functions over ``MetaArray`` (see the module docstring)."""

    __name__ = "zerosim.meta"
    newaxis = None
    inf, nan, pi, e = np.inf, np.nan, np.pi, np.e

    def __repr__(self) -> str:
        return "zerosim.meta namespace"

    def __getattr__(self, name: str) -> Any:
        try:
            return np.dtype(name)  # dtype names: xp.float32, xp.int64 …
        except TypeError:
            pass
        raise AttributeError(
            f"the dry run's shape-only namespace has no {name!r} (zerosim's code had not called "
            "it when zerosim/meta/namespace.py was written: add it there)"
        )

    # -- creation ----------------------------------------------------------------------------
    def empty(self, shape: Any, dtype: Any = np.float64, device: Any = None, **_: Any):
        return MetaArray(_shape(shape), np.dtype(dtype or np.float64))

    def zeros(self, shape: Any, dtype: Any = np.float64, device: Any = None, **_: Any):
        return MetaArray(_shape(shape), np.dtype(dtype or np.float64), value=0)

    def ones(self, shape: Any, dtype: Any = np.float64, device: Any = None, **_: Any):
        return MetaArray(_shape(shape), np.dtype(dtype or np.float64), value=1)

    def full(self, shape: Any, fill_value: Any, dtype: Any = None, device: Any = None, **_: Any):
        dtype = np.asarray(fill_value).dtype if dtype is None else dtype
        value = fill_value if np.ndim(fill_value) == 0 else None
        return MetaArray(_shape(shape), np.dtype(dtype), value=value)

    def empty_like(self, x: Any, dtype: Any = None, shape: Any = None, **_: Any):
        return self.empty(shape_of(x) if shape is None else shape, dtype or x.dtype)

    def zeros_like(self, x: Any, dtype: Any = None, shape: Any = None, **_: Any):
        return self.zeros(shape_of(x) if shape is None else shape, dtype or x.dtype)

    def ones_like(self, x: Any, dtype: Any = None, shape: Any = None, **_: Any):
        return self.ones(shape_of(x) if shape is None else shape, dtype or x.dtype)

    def full_like(self, x: Any, fill_value: Any, dtype: Any = None, **_: Any):
        return self.full(shape_of(x), fill_value, dtype or x.dtype)

    def asarray(self, obj: Any, dtype: Any = None, copy: bool | None = None, **_: Any):
        """``obj`` as a MetaArray: itself (or a copy, or a cast); host data gives a new array of
        its shape and dtype (a Python or 0-d value is kept as the array's value)."""
        if isinstance(obj, MetaArray):
            if dtype is not None and np.dtype(dtype) != obj.dtype:
                return obj.astype(dtype)
            return obj.copy() if copy else obj
        host = np.asarray(obj, dtype=dtype)
        value = host.item() if host.ndim == 0 else None
        return MetaArray(host.shape, host.dtype, value=value)

    def arange(self, start: Any, stop: Any = None, step: Any = 1, dtype: Any = None, **_: Any):
        if stop is None:
            start, stop = 0, start
        ints = all(isinstance(v, int | np.integer) for v in (start, stop, step))
        n = len(range(start, stop, step)) if ints else max(0, math.ceil((stop - start) / step))
        return MetaArray((n,), np.dtype(dtype or (np.int64 if ints else np.float64)))

    def triu(self, x: MetaArray, k: int = 0) -> MetaArray:
        return MetaArray(x.shape, x.dtype)

    def tril(self, x: MetaArray, k: int = 0) -> MetaArray:
        return MetaArray(x.shape, x.dtype)

    # -- element-wise ------------------------------------------------------------------------
    def apply(self, fn: Any, *operands: Any, out: Any = None, dtype: Any = None, **kw: Any):
        """The ufunc ``fn`` (a NumPy function) on these operands: NumPy's broadcast shape and
        result dtype; into ``out`` when given. inf/nan tests answer ``Values.overflow``;
        ``logical_and``/``_or``/``_not`` of known answers are known."""
        shape = broadcast_shapes(*(shape_of(x) for x in operands))
        if out is not None:
            result = _write(out, shape)
        else:
            if dtype is None:
                kinds = tuple(probe(x) for x in operands)
                dtype = result_dtype(fn, kinds, tuple(sorted(kw.items())))
            result = MetaArray(shape, dtype, value=self._known(fn, operands))
        rate = rate_class(_dtypes(*operands), result.dtype)
        current().op(fn.__name__, _nbytes(*operands) + result.nbytes, rate)  # read and written
        return result

    @staticmethod
    def _known(fn: Any, operands: tuple) -> Any:
        if fn in _TESTS:  # "is it inf or nan": the overflow rule; isfinite the opposite
            return bool(values().overflow) == _TESTS[fn]
        known = [getattr(x, "value", None) for x in operands]
        if fn in _LOGICAL and None not in known:
            return _LOGICAL[fn](bool(v) for v in known)
        if fn is np.logical_not and known[0] is not None:
            return not known[0]
        return None

    # NumPy's signature; a shape and dtype do not depend on the decimals
    def round(self, x: Any, decimals: int = 0, out: Any = None) -> Any:  # noqa: V107
        return self.apply(np.round, x, out=out)

    def clip(self, x: Any, lo: Any = None, hi: Any = None, out: Any = None, **_: Any) -> Any:
        return self.apply(np.clip, x, lo, hi, out=out)

    def where(self, condition: Any, a: Any, b: Any) -> MetaArray:
        shape = broadcast_shapes(shape_of(condition), shape_of(a), shape_of(b))
        kinds = (np.dtype(np.bool_), probe(a), probe(b))
        return MetaArray(shape, result_dtype(np.where, kinds))

    # -- reductions --------------------------------------------------------------------------
    def _reduce(self, fn: Any, x: Any, axis: Any, keepdims: bool, dtype: Any = None) -> MetaArray:
        shape = _reduced(shape_of(x), axis, keepdims)
        kw = () if dtype is None else (("dtype", np.dtype(dtype)),)
        rdtype = result_dtype(fn, (probe(x),), kw)
        current().op(fn.__name__, _nbytes(x), rate_class(_dtypes(x), rdtype))
        value = None
        known = getattr(x, "value", None)
        if fn in (np.all, np.any) and known is not None:
            value = bool(known)
        return MetaArray(shape, rdtype, value=value)

    def sum(self, x: Any, axis: Any = None, dtype: Any = None, keepdims: bool = False, **_: Any):
        return self._reduce(np.sum, x, axis, keepdims, dtype)

    def mean(self, x: Any, axis: Any = None, dtype: Any = None, keepdims: bool = False, **_: Any):
        return self._reduce(np.mean, x, axis, keepdims, dtype)

    def max(self, x: Any, axis: Any = None, keepdims: bool = False, **_: Any) -> MetaArray:
        return self._reduce(np.max, x, axis, keepdims)

    def min(self, x: Any, axis: Any = None, keepdims: bool = False, **_: Any) -> MetaArray:
        return self._reduce(np.min, x, axis, keepdims)

    def all(self, x: Any, axis: Any = None, keepdims: bool = False, **_: Any) -> MetaArray:
        return self._reduce(np.all, x, axis, keepdims)

    def any(self, x: Any, axis: Any = None, keepdims: bool = False, **_: Any) -> MetaArray:
        return self._reduce(np.any, x, axis, keepdims)

    def count_nonzero(self, x: Any, axis: Any = None, keepdims: bool = False) -> MetaArray:
        """The count of every element (there are no values to test: ``Values``' rule)."""
        shape = shape_of(x)
        counted = math.prod(shape[a] for a in _axes(axis, len(shape)))
        return MetaArray(_reduced(shape, axis, keepdims), np.int64, value=counted)

    def vecdot(self, a: Any, b: Any, axis: int = -1) -> MetaArray:
        shape = broadcast_shapes(shape_of(a), shape_of(b))
        dtype = result_dtype(np.vecdot, (probe(a), probe(b)))
        current().op("vecdot", _nbytes(a, b), rate_class(_dtypes(a, b), dtype))
        return MetaArray(_reduced(shape, axis, False), dtype)

    # -- matrix products ---------------------------------------------------------------------
    def matmul(self, a: Any, b: Any, out: Any = None, **_: Any) -> MetaArray:
        """NumPy's matmul shapes; 2·m·k·n FLOPs per product, counted for the dry run."""
        current().op("matmul")
        sa, sb = shape_of(a), shape_of(b)
        if not sa or not sb:
            raise ValueError("matmul: Input operand does not have enough dimensions")
        ma = (1, *sa) if len(sa) == 1 else sa
        mb = (*sb, 1) if len(sb) == 1 else sb
        if ma[-1] != mb[-2]:
            raise ValueError(
                f"matmul: Input operand 1 has a mismatch in its core dimension 0 "
                f"(size {mb[-2]} is different from {ma[-1]})"
            )
        batch = broadcast_shapes(ma[:-2], mb[:-2])
        m, k, n = ma[-2], ma[-1], mb[-1]
        shape = (*batch, *(() if len(sa) == 1 else (m,)), *(() if len(sb) == 1 else (n,)))
        dtype = result_dtype(np.matmul, (probe(a), probe(b)))
        result_bytes = math.prod(shape) * np.dtype(dtype).itemsize
        current().matmul(2 * math.prod(batch) * m * k * n, _nbytes(a, b) + result_bytes)
        if out is not None:
            return _write(out, shape)
        return MetaArray(shape, dtype)

    def matrix_transpose(self, x: MetaArray) -> MetaArray:
        return x.mT

    # -- shapes ------------------------------------------------------------------------------
    def reshape(self, x: MetaArray, shape: Any, copy: bool | None = None, **_: Any) -> MetaArray:
        return x.reshape(shape, copy=copy)

    def permute_dims(self, x: MetaArray, axes: Sequence[int]) -> MetaArray:
        return x.transpose(axes)

    def transpose(self, x: MetaArray, axes: Sequence[int] | None = None) -> MetaArray:
        return x.transpose(axes)

    def astype(self, x: MetaArray, dtype: Any, copy: bool = True, **_: Any) -> MetaArray:
        return x.astype(dtype, copy=copy)

    def copy(self, x: MetaArray) -> MetaArray:
        return x.copy()

    def ascontiguousarray(self, x: MetaArray) -> MetaArray:
        return x if x.flags.c_contiguous else x.copy()

    def concatenate(self, arrays: Sequence[Any], axis: int | None = 0, **_: Any) -> MetaArray:
        arrays = list(arrays)
        dtype = np.result_type(*(probe(a) for a in arrays))
        if axis is None:
            flat = MetaArray((sum(math.prod(shape_of(a)) for a in arrays),), dtype)
            return _joined("concatenate", arrays, flat)
        first = shape_of(arrays[0])
        axis = _axes(axis, len(first))[0]
        total = sum(shape_of(a)[axis] for a in arrays)
        joined = MetaArray((*first[:axis], total, *first[axis + 1 :]), dtype)
        return _joined("concatenate", arrays, joined)

    concat = concatenate

    def stack(self, arrays: Sequence[Any], axis: int = 0) -> MetaArray:
        arrays = list(arrays)
        first = shape_of(arrays[0])
        axis = int(axis) % (len(first) + 1)
        shape = (*first[:axis], len(arrays), *first[axis:])
        stacked = MetaArray(shape, np.result_type(*(probe(a) for a in arrays)))
        return _joined("stack", arrays, stacked)

    def take(self, x: Any, indices: Any, axis: int | None = None, **_: Any) -> MetaArray:
        shape, index = shape_of(x), shape_of(indices)
        if axis is None:
            return _joined("take", [], MetaArray(index, x.dtype))
        axis = _axes(axis, len(shape))[0]
        return _joined("take", [], MetaArray((*shape[:axis], *index, *shape[axis + 1 :]), x.dtype))

    def take_along_axis(self, x: Any, indices: Any, axis: int) -> MetaArray:
        shape, index = shape_of(x), shape_of(indices)
        axis = _axes(axis, len(shape))[0]
        others = broadcast_shapes(
            (*shape[:axis], 1, *shape[axis + 1 :]), (*index[:axis], 1, *index[axis + 1 :])
        )
        return MetaArray((*others[:axis], index[axis], *others[axis + 1 :]), x.dtype)

    # -- writes ------------------------------------------------------------------------------
    def copyto(self, dst: MetaArray, src: Any, **_: Any) -> None:
        current().op("copyto", 2 * _nbytes(dst), rate_class(_dtypes(src), dst.dtype, copy=True))
        _write(dst, shape_of(src))

    def kernel(self, *arrays: Any) -> None:
        """One call of a compiled update rule (``optim/functional/fused.py``'s numba kernels)
        on these arrays: it writes them in place, so it allocates nothing; counted as ``kernel``,
        its bytes each array's once read and, but the gradient (the second), once written."""
        current().op("kernel", 2 * _nbytes(*arrays) - _nbytes(*arrays[1:2]))

    def erfc(self, x: Any) -> MetaArray:
        """CuPy's ``cupyx.scipy.special.erfc``: one element-wise kernel (read x, write the
        result) where the run stands for a GPU (``nn.functional.erfc``)."""
        result = MetaArray(shape_of(x), x.dtype)
        current().op("erfc", _nbytes(x) + result.nbytes, rate_class(_dtypes(x), x.dtype))
        return result

    def fused_matmul_kernel(self, flops: int, nbytes: int) -> None:
        """One call of a fused GPU kernel whose matrix products and the work between them stay in
        on-chip memory (FlashAttention, ``nn/flash.py``): ``flops`` counted as matrix products,
        ``nbytes`` the device memory it reads and writes once (its roofline's bytes); it
        allocates nothing (its caller allocates the outputs). Counted as an "attention"
        kernel, which a cluster that cites FlashAttention's own efficiency prices at it."""
        current().op("matmul")
        current().matmul(flops, nbytes, kernel="attention")

    def add_at(self, target: MetaArray, indices: Any, values: Any) -> None:
        """NumPy's ``np.add.at(target, indices, values)``: in place, nothing allocated."""
        rows = shape_of(indices)
        broadcast_shapes(shape_of(values), (*rows, *target.shape[1:]))
        rate = rate_class(_dtypes(values), target.dtype)
        current().op("add_at", 3 * _nbytes(values), rate)  # values read, rows read and written
        target.value = None

    # -- dtypes ------------------------------------------------------------------------------
    def result_type(self, *arrays_and_dtypes: Any) -> np.dtype:
        return np.result_type(
            *(probe(a) if not isinstance(a, np.dtype) else a for a in arrays_and_dtypes)
        )

    def finfo(self, dtype: Any) -> Any:
        return np.finfo(dtype)

    def iinfo(self, dtype: Any) -> Any:
        return np.iinfo(dtype)


# NumPy's ufuncs that zerosim's code calls by name (``xp.multiply(a, b, out=c)`` …)
UFUNCS = (
    "add subtract multiply divide true_divide power maximum minimum negative positive "
    "reciprocal square sqrt exp log tanh absolute sign rint isfinite isnan isinf logical_and "
    "logical_or logical_not equal not_equal less less_equal greater greater_equal bitwise_and "
    "bitwise_or left_shift right_shift"
).split()


def _ufunc_method(name: str) -> Any:
    fn = getattr(np, name)

    def call(self: MetaNamespace, *operands: Any, out: Any = None, **kw: Any) -> Any:
        return self.apply(fn, *operands, out=out, **kw)

    call.__name__ = call.__qualname__ = name
    return call


for _name in UFUNCS:
    setattr(MetaNamespace, _name, _ufunc_method(_name))
MetaNamespace.abs = MetaNamespace.absolute  # type: ignore[attr-defined]

NAMESPACE = MetaNamespace()
MetaArray.__zerosim_namespace__ = NAMESPACE
