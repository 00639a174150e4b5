"""``MetaArray``: a NumPy-like array that has a shape, a dtype and a memory layout, but no values.

It does what zerosim's engine, layers, optimizer and stages do with an array, at the cost of the
shape arithmetic only, so a 175B-parameter model runs on a laptop:

- **Views and copies as NumPy makes them.** An array is a view (shape, strides and offset in
  elements) of one ``Storage``, an allocation counted by the dry run's ``Tracker``. Basic
  indexing, ``reshape`` where NumPy can reshape without copying (its ``_attempt_nocopy_reshape``
  rule), transposes and ``astype(copy=False)`` of the same dtype are views; everything else
  allocates. A storage is freed when its last view is garbage collected, as NumPy frees it.
- **Dtypes as NumPy computes them.** The result dtype of every operation is NumPy's own for the
  same operand dtypes and Python scalars (asked of NumPy on one-element arrays, once per
  combination), so float32 + Python float stays float32 and bfloat16 + Python float is float32.
- **No values.** What code reads from one (``float(x)``, ``bool(x)``, ``np.asarray(x)``) is the
  dry run's documented default (``tracker.Values``): inf/nan tests answer ``Values.overflow``,
  known constant results (such tests, their ``all``/``any``, ``count_nonzero``) keep their value,
  anything else reads as ``Values.fill``.

Binary operators with NumPy arrays and NumPy or Python scalars work from either side
(``__array_ufunc__ = None`` makes NumPy hand the operation to the MetaArray).
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any

import numpy as np

from zerosim.meta.tracker import Storage, current, rate_class, values

DEVICE = "meta"


def _c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def _is_c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    if 0 in shape:
        return True
    expected = 1
    for d, s in zip(reversed(shape), reversed(strides), strict=True):
        if d == 1:
            continue
        if s != expected:
            return False
        expected *= d
    return True


def _nocopy_strides(
    shape: tuple[int, ...], strides: tuple[int, ...], new: tuple[int, ...]
) -> tuple[int, ...] | None:
    """Strides of ``new`` viewing the same elements, or None when NumPy would copy (its
    ``_attempt_nocopy_reshape``, C order)."""
    old = [(d, s) for d, s in zip(shape, strides, strict=True) if d != 1]
    old_dims = [d for d, _ in old]
    old_strides = [s for _, s in old]
    new_strides = [0] * len(new)
    oi, oj, ni, nj = 0, 1, 0, 1
    while ni < len(new) and oi < len(old_dims):
        np_, op = new[ni], old_dims[oi]
        while np_ != op:
            if np_ < op:
                np_ *= new[nj]
                nj += 1
            else:
                op *= old_dims[oj]
                oj += 1
        for ok in range(oi, oj - 1):
            if old_strides[ok] != old_dims[ok + 1] * old_strides[ok + 1]:
                return None
        new_strides[nj - 1] = old_strides[oj - 1]
        for nk in range(nj - 1, ni, -1):
            new_strides[nk - 1] = new_strides[nk] * new[nk]
        ni, oi = nj, oj
        nj, oj = nj + 1, oj + 1
    last = new_strides[ni - 1] if ni >= 1 else 1
    for nk in range(ni, len(new)):
        new_strides[nk] = last
    return tuple(new_strides)


def _resolve_shape(shape: Any, size: int) -> tuple[int, ...]:
    """A reshape target as a tuple, with one −1 resolved; ValueError as NumPy's when it cannot."""
    if isinstance(shape, int | np.integer):
        shape = (int(shape),)
    shape = tuple(int(d) for d in shape)
    if shape.count(-1) > 1:
        raise ValueError("can only specify one unknown dimension")
    if -1 in shape:
        known = math.prod(d for d in shape if d != -1)
        if known == 0 or size % known:
            raise ValueError(f"cannot reshape array of size {size} into shape {shape}")
        shape = tuple(size // known if d == -1 else d for d in shape)
    if math.prod(shape) != size:
        raise ValueError(f"cannot reshape array of size {size} into shape {shape}")
    return shape


def shape_of(x: Any) -> tuple[int, ...]:
    """The shape of an operand: a MetaArray's, a NumPy array's, () for a scalar."""
    return tuple(x.shape) if hasattr(x, "shape") else ()


def probe(x: Any) -> Any:
    """What stands for ``x`` when NumPy is asked for a result dtype: a one-element array of its
    dtype (arrays, NumPy scalars), or the Python scalar itself (weak in NumPy 2's promotion)."""
    if isinstance(x, MetaArray | np.ndarray | np.generic):
        return np.dtype(x.dtype)
    if isinstance(x, bool | int | float | complex):
        return type(x)
    return np.asarray(x).dtype


_SAMPLE = {bool: True, int: 1, float: 1.0, complex: 1.0 + 0j}


@functools.lru_cache(maxsize=4096)
def result_dtype(fn: Any, kinds: tuple[Any, ...], kwargs: tuple = ()) -> np.dtype:
    """NumPy's result dtype of ``fn`` applied to operands of these kinds (cached)."""
    operands = [
        _SAMPLE[k] if isinstance(k, type) else np.ones((1,) * (2 if fn is np.matmul else 1), k)
        for k in kinds
    ]
    with np.errstate(all="ignore"):
        return np.dtype(fn(*operands, **dict(kwargs)).dtype)


_BASIC_KEYS = frozenset({slice, int, type(None), type(Ellipsis)})


def broadcast_shapes(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    """NumPy's broadcast shape (equal shapes, the common case, without NumPy's call)."""
    first = shapes[0]
    if all(s == first for s in shapes):
        return tuple(first)
    return tuple(np.broadcast_shapes(*shapes))


def _is_index_array(k: Any) -> bool:
    return isinstance(k, MetaArray | np.ndarray)


def _is_mask(k: Any) -> bool:
    return probe(k) == np.bool_


def _copied(kind: str, source: Any, result: Any) -> Any:
    """``result``, a copy of ``source``'s elements, counted as one operation of ``kind`` that
    reads ``source`` and writes ``result`` (what a host's time model prices)."""
    rate = rate_class([source.dtype], result.dtype, copy=True)
    current().op(kind, source.nbytes + result.nbytes, rate)
    return result


class Flags:
    """The part of NumPy's ``flags`` that zerosim reads."""

    __slots__ = ("c_contiguous", "writeable")

    def __init__(self, c_contiguous: bool) -> None:
        self.c_contiguous = c_contiguous
        self.writeable = True


class MetaArray:
    """Shape, dtype and layout of an array whose values do not exist (see the module docstring)."""

    __slots__ = ("shape", "dtype", "_strides", "_offset", "_storage", "value", "__weakref__")
    __array_ufunc__ = None  # NumPy's operators defer to ours
    __hash__ = None  # type: ignore[assignment]  (== is elementwise, as NumPy's)
    __zerosim_namespace__: Any = None  # set by zerosim/meta/namespace.py: backend.xp_of reads it
    device = DEVICE

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: Any,
        storage: Storage | None = None,
        strides: tuple[int, ...] | None = None,
        offset: int = 0,
        value: Any = None,
        category: str | None = None,
    ) -> None:
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        if any(d < 0 for d in self.shape):
            raise ValueError(f"negative dimensions are not allowed: {self.shape}")
        if storage is None:
            storage = Storage(math.prod(self.shape) * self.dtype.itemsize, category)
            strides = _c_strides(self.shape)
        self._storage = storage
        self._strides = strides if strides is not None else _c_strides(self.shape)
        self._offset = offset
        self.value = value

    # -- attributes --------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def strides(self) -> tuple[int, ...]:
        return tuple(s * self.dtype.itemsize for s in self._strides)

    @property
    def flags(self) -> Flags:
        return Flags(_is_c_contiguous(self.shape, self._strides))

    @property
    def base(self) -> Storage:
        return self._storage

    @property
    def T(self) -> MetaArray:  # noqa: N802  (NumPy's name)
        return self.transpose()

    @property
    def mT(self) -> MetaArray:  # noqa: N802  (NumPy's name)
        if self.ndim < 2:
            raise ValueError("matrix transpose with ndim < 2 is undefined")
        axes = list(range(self.ndim))
        axes[-2], axes[-1] = axes[-1], axes[-2]
        return self.transpose(axes)

    @property
    def __zerosim_host__(self) -> bool:  # noqa: PLW3201  (read by backend.is_host_array)
        """True when the dry run stands for a NumPy host: take NumPy's branches."""
        return values().backend == "numpy"

    # the array API standard's signature; every version gets the one namespace
    def __array_namespace__(self, api_version: str | None = None) -> Any:  # noqa: V107
        return self.__zerosim_namespace__

    def __repr__(self) -> str:
        return f"MetaArray(shape={self.shape}, dtype={self.dtype.name})"

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    # -- views ---------------------------------------------------------------------------
    def _view(self, shape: tuple[int, ...], strides: tuple[int, ...], offset: int) -> MetaArray:
        view = object.__new__(MetaArray)  # no checks: shape and strides come from this array's
        view.shape, view.dtype, view._storage = shape, self.dtype, self._storage
        view._strides, view._offset, view.value = strides, offset, self.value
        return view

    def transpose(self, *axes: Any) -> MetaArray:
        if len(axes) == 1 and not isinstance(axes[0], int | np.integer):
            axes = tuple(axes[0]) if axes[0] is not None else ()
        axes = (
            tuple(range(self.ndim))[::-1] if not axes else tuple(int(a) % self.ndim for a in axes)
        )
        if sorted(axes) != list(range(self.ndim)):
            raise ValueError(f"axes {axes} don't match array of {self.ndim} dimensions")
        return self._view(
            tuple(self.shape[a] for a in axes), tuple(self._strides[a] for a in axes), self._offset
        )

    def reshape(self, *shape: Any, copy: bool | None = None) -> MetaArray:
        if len(shape) == 1:
            shape = shape[0]
        new = _resolve_shape(shape, self.size)
        strides = None if copy else _nocopy_strides(self.shape, self._strides, new)
        if strides is None:
            if copy is False:
                raise ValueError("unable to avoid creating a copy while reshaping")
            return _copied("reshape", self, MetaArray(new, self.dtype, value=self.value))
        return self._view(new, strides, self._offset)

    def astype(self, dtype: Any, copy: bool = True) -> MetaArray:
        dtype = np.dtype(dtype)
        if not copy and dtype == self.dtype:
            return self
        return _copied("astype", self, MetaArray(self.shape, dtype, value=self.value))

    def copy(self) -> MetaArray:
        return _copied("copy", self, MetaArray(self.shape, self.dtype, value=self.value))

    def ravel(self) -> MetaArray:
        return self.reshape(-1)

    def flatten(self) -> MetaArray:
        return self.reshape(-1, copy=True)

    # -- indexing ----------------------------------------------------------------------------
    def _basic(self, key: tuple) -> MetaArray:
        """A view for a key of ints, slices, Ellipsis and None."""
        real = sum(1 for k in key if k is not None and k is not Ellipsis)
        if real > self.ndim:
            raise IndexError(
                f"too many indices for array: array is {self.ndim}-dimensional, "
                f"but {real} were indexed"
            )
        at = next((i for i, k in enumerate(key) if k is Ellipsis), None)
        fill = (slice(None),) * (self.ndim - real)
        key = key + fill if at is None else key[:at] + fill + key[at + 1 :]
        shape, strides, offset, axis = [], [], self._offset, 0
        for k in key:
            if k is None:
                shape.append(1)
                strides.append(0)
                continue
            dim, step = self.shape[axis], self._strides[axis]
            if isinstance(k, slice):
                start, stop, stride = k.indices(dim)
                n = len(range(start, stop, stride))
                if n:
                    offset += start * step
                shape.append(n)
                strides.append(step * stride)
            else:
                i = operator.index(k)
                if not -dim <= i < dim:
                    raise IndexError(f"index {i} is out of bounds for axis {axis} with size {dim}")
                offset += (i % dim) * step
            axis += 1
        return self._view(tuple(shape), tuple(strides), offset)

    def _advanced_shape(self, key: tuple) -> tuple[int, ...]:
        """The result shape of NumPy's advanced indexing (integer or boolean index arrays; a
        boolean mask selects all its elements: there are no values to test)."""

        def consumed(k: Any) -> int:
            if _is_index_array(k):
                return len(shape_of(k)) if _is_mask(k) else 1
            return 0 if k is None or k is Ellipsis else 1

        real = sum(consumed(k) for k in key if k is not Ellipsis)
        at = next((i for i, k in enumerate(key) if k is Ellipsis), None)
        fill = (slice(None),) * (self.ndim - real)
        key = key + fill if at is None else key[:at] + fill + key[at + 1 :]
        out: list[int | None] = []  # the result's axes; None where the index arrays go
        places, shapes, axis = [], [], 0
        for k in key:
            if k is None:
                out.append(1)
            elif _is_index_array(k):
                shape = shape_of(k)
                n = len(shape) if _is_mask(k) else 1
                places.append(len(out))
                out.append(None)
                shapes.append((math.prod(shape),) if _is_mask(k) else shape)
                axis += n
            elif isinstance(k, slice):
                out.append(len(range(*k.indices(self.shape[axis]))))
                axis += 1
            else:
                axis += 1
        broadcast = tuple(np.broadcast_shapes(*shapes))
        rest = [d for d in out if d is not None]
        adjacent = places == list(range(places[0], places[0] + len(places)))
        first = sum(1 for d in out[: places[0]] if d is not None) if adjacent else 0
        return tuple(rest[:first]) + broadcast + tuple(rest[first:])

    @staticmethod
    def _key(key: Any) -> tuple:
        key = key if isinstance(key, tuple) else (key,)
        return tuple(np.asarray(k) if isinstance(k, list) else k for k in key)

    def _is_advanced(self, key: tuple) -> bool:
        return any(_is_index_array(k) for k in key)

    def __getitem__(self, key: Any) -> MetaArray:
        if type(key) is slice and self.shape:  # the common case: a run of a flat buffer
            start, stop, step = key.indices(self.shape[0])
            n = len(range(start, stop, step))
            stride = self._strides[0]
            offset = self._offset + (start * stride if n else 0)
            return self._view((n, *self.shape[1:]), (stride * step, *self._strides[1:]), offset)
        if type(key) is tuple and all(type(k) in _BASIC_KEYS for k in key):
            return self._basic(key)
        key = self._key(key)
        if self._is_advanced(key):  # a copy, as NumPy's: the rows read, the result written
            result = MetaArray(self._advanced_shape(key), self.dtype)
            return _copied("getitem", result, result)
        return self._basic(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        key = self._key(key)
        target = self._advanced_shape(key) if self._is_advanced(key) else self._basic(key).shape
        np.broadcast_shapes(shape_of(value), target)  # NumPy's error when they do not fit
        arrays = [value.dtype] if isinstance(value, MetaArray | np.ndarray) else []
        read = value.nbytes if arrays else 0
        rate = rate_class(arrays, self.dtype, copy=True)
        current().op("setitem", math.prod(target) * self.itemsize + read, rate)  # a copy in
        self.value = None

    # -- values ------------------------------------------------------------------------------
    def _read(self) -> Any:
        rules = values()
        if self.size > rules.read_limit:
            raise RuntimeError(
                f"a dry run holds no values: reading a shape-only array of shape {self.shape} "
                f"({self.size} elements) on the host; reads of at most {rules.read_limit} "
                "elements are allowed (they give zerosim.meta.Values.fill)"
            )
        return rules.fill if self.value is None else self.value

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        with np.errstate(all="ignore"):
            return np.full(self.shape, self._read(), dtype=dtype or self.dtype)

    def tolist(self) -> Any:
        return self.__array__().tolist()

    def item(self) -> Any:
        if self.size != 1:
            raise ValueError("can only convert an array of size 1 to a Python scalar")
        return self.__array__().reshape(-1)[0].item()

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __bool__(self) -> bool:
        return bool(self.item())

    def __index__(self) -> int:
        return operator.index(self.item())

    # -- arithmetic: the namespace's functions (zerosim/meta/namespace.py) -------------------
    def _ufunc(self, fn: Any, *operands: Any, out: Any = None) -> MetaArray:
        return self.__zerosim_namespace__.apply(fn, *operands, out=out)

    def __matmul__(self, other: Any) -> MetaArray:
        return self.__zerosim_namespace__.matmul(self, other)

    def __rmatmul__(self, other: Any) -> MetaArray:
        return self.__zerosim_namespace__.matmul(other, self)

    def __imatmul__(self, other: Any) -> MetaArray:
        return self.__zerosim_namespace__.matmul(self, other, out=self)

    def __neg__(self) -> MetaArray:
        return self._ufunc(np.negative, self)

    def __pos__(self) -> MetaArray:
        return self._ufunc(np.positive, self)

    def __abs__(self) -> MetaArray:
        return self._ufunc(np.absolute, self)

    def __invert__(self) -> MetaArray:
        return self._ufunc(np.invert, self)

    def sum(self, axis: Any = None, dtype: Any = None, keepdims: bool = False, out: Any = None):
        return self.__zerosim_namespace__.sum(self, axis=axis, dtype=dtype, keepdims=keepdims)

    def mean(self, axis: Any = None, dtype: Any = None, keepdims: bool = False, out: Any = None):
        return self.__zerosim_namespace__.mean(self, axis=axis, dtype=dtype, keepdims=keepdims)

    def max(self, axis: Any = None, keepdims: bool = False, out: Any = None) -> MetaArray:
        return self.__zerosim_namespace__.max(self, axis=axis, keepdims=keepdims)

    def min(self, axis: Any = None, keepdims: bool = False, out: Any = None) -> MetaArray:
        return self.__zerosim_namespace__.min(self, axis=axis, keepdims=keepdims)

    def all(self, axis: Any = None, keepdims: bool = False) -> MetaArray:
        return self.__zerosim_namespace__.all(self, axis=axis, keepdims=keepdims)

    def any(self, axis: Any = None, keepdims: bool = False) -> MetaArray:
        return self.__zerosim_namespace__.any(self, axis=axis, keepdims=keepdims)

    def fill(self, value: Any) -> None:
        self.value = None


_BINARY = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "truediv": np.true_divide,
    "floordiv": np.floor_divide,
    "mod": np.remainder,
    "pow": np.power,
    "and": np.bitwise_and,
    "or": np.bitwise_or,
    "xor": np.bitwise_xor,
    "lshift": np.left_shift,
    "rshift": np.right_shift,
}
_COMPARE = {
    "eq": np.equal,
    "ne": np.not_equal,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
}


def _install_operators() -> None:
    """``a + b``, ``b + a``, ``a += b`` … and the comparisons, each one ufunc of the namespace."""

    def forward(fn: Any) -> Any:
        return lambda self, other: self._ufunc(fn, self, other)

    def reflected(fn: Any) -> Any:
        return lambda self, other: self._ufunc(fn, other, self)

    def in_place(fn: Any) -> Any:
        return lambda self, other: self._ufunc(fn, self, other, out=self)

    for name, fn in _BINARY.items():
        setattr(MetaArray, f"__{name}__", forward(fn))
        setattr(MetaArray, f"__r{name}__", reflected(fn))
        setattr(MetaArray, f"__i{name}__", in_place(fn))
    for name, fn in _COMPARE.items():
        setattr(MetaArray, f"__{name}__", forward(fn))


_install_operators()
