"""The one place that decides the array namespace, names dtypes, and crosses host <-> device.

Everything else in zerosim receives arrays and asks this module for their namespace
(``xp_of(x)``), so the same code runs on every backend:

- ``numpy`` (the CPU): ``xp_of`` returns NumPy itself. NumPy 2's main namespace holds the
  Array API's functions (``astype``, ``concat``, ``permute_dims``, ``pow`` …) beside its own
  ufuncs with ``out=``, which the CPU hot paths use to avoid temporaries.
- ``cupy`` (a GPU): CuPy's own namespace, NumPy's names on device memory.
- ``array_api_strict`` (the portability test): the strict, minimal implementation of the
  Python Array API standard, with arrays on ``Device("device1")``, which refuse to mix with
  host arrays and refuse ``numpy.asarray`` just as GPU arrays do. Its namespace comes from
  ``array_api_compat.array_namespace`` and is wrapped in ``StandardNamespace``, which adds
  what zerosim's code calls that the standard lacks, each as a *named fallback* written with
  standard functions only: NumPy's ``out=`` argument, ``copyto``, ``concatenate``,
  ``add_at`` (NumPy's ``np.add.at``, for an embedding's backward) and NumPy dtypes as
  arguments. 16-bit floats are not in the standard; asking for one on this backend raises
  a TypeError that names the dtype (see docs/install.md, "What runs where").

What must happen on the host (the RNG of parameter init, checkpoint files, NVMe memmaps,
MPI buffers without device support) crosses through ``to_host`` and ``from_host``, and
each crossing is counted (``crossings()``: calls and bytes in each direction, per thread,
so each rank of a ``LocalWorld`` counts its own).

bfloat16 on the CPU comes from ``ml_dtypes``; CuPy has no bfloat16 dtype, so the GPU path
supports float64, float32 and float16 only and says so when asked for bfloat16.

- ``meta`` (the dry run, ``zerosim/meta``): arrays with a shape, a dtype and a layout but no
  values. Their class names their namespace (``__zerosim_namespace__``), which ``xp_of``
  returns; ``shape_only_init()`` makes the layers' initialisers return such arrays, so a model
  of any size is built without its values.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np

BACKENDS = ("numpy", "cupy", "array_api_strict", "meta")
# The non-host device array_api_strict arrays live on (the stand-in for a GPU).
STRICT_DEVICE_NAME = "device1"
ENV_VAR = "ZEROSIM_BACKEND"

# The floating dtypes zerosim trains in, by the names the config uses.
DTYPES: dict[str, np.dtype] = {
    "float64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}
HALF_DTYPES = (DTYPES["float16"], DTYPES["bfloat16"])
# DeepSpeed's precision names (fp16/bf16 sections, communication_data_type) -> dtype names.
PRECISION_DTYPES: dict[str, str] = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def resolve_dtype(dtype: str | np.dtype | type) -> np.dtype:
    """Return the numpy dtype for a zerosim dtype name (or a dtype) and reject others."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; allowed: {sorted(DTYPES)}")
        return DTYPES[dtype]
    return np_dtype(dtype)


def np_dtype(dtype: Any) -> np.dtype:
    """The NumPy dtype of ``dtype``: a NumPy dtype or type, or another namespace's dtype
    object (array_api_strict's ``float32`` …), matched by its name."""
    if isinstance(dtype, np.dtype):
        return dtype
    try:
        return np.dtype(dtype)
    except TypeError:
        pass
    name = str(dtype).rsplit(".", 1)[-1]
    if name in DTYPES:
        return DTYPES[name]
    try:
        return np.dtype(name)
    except TypeError as err:
        raise TypeError(f"dtype {dtype!r} is not a dtype; allowed: {sorted(DTYPES)}") from err


@functools.lru_cache(maxsize=64)
def _name_of(dtype: Any) -> str:
    return np_dtype(dtype).name


def dtype_name(dtype: np.dtype | type) -> str:
    """The short name of a dtype: 'float32', 'bfloat16', 'int8', … (cached: on the hot path)."""
    return _name_of(dtype)


def is_half(dtype: np.dtype | type) -> bool:
    """True for the 16-bit floating dtypes (float16, bfloat16)."""
    return np_dtype(dtype) in HALF_DTYPES


@functools.cache
def cupy_or_none() -> ModuleType | None:
    """CuPy if it imports, else None (cached: a failed import is not retried on every call)."""
    try:
        import cupy  # noqa: PLC0415  (optional dependency, imported on demand)
    except ImportError:
        return None
    return cupy


def gpu_available() -> bool:
    """True when CuPy is installed and sees at least one CUDA device."""
    cupy = cupy_or_none()
    if cupy is None:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001  (CUDA raises its own error types when no driver)
        return False


# --- the Array API standard's namespaces, with zerosim's named fallbacks ----------------------

# Creation functions: they take ``device=``; the wrapper puts new arrays on its device.
_CREATION = frozenset({"asarray", "zeros", "ones", "empty", "full", "arange", "linspace", "eye"})
# Functions whose dtype argument is positional, and where.
_DTYPE_AT = {"astype": 1, "finfo": 0, "iinfo": 0, "isdtype": 0}
# NumPy's names for the standard's functions.
_RENAMED = {
    "concatenate": "concat",
    "power": "pow",
    "transpose": "permute_dims",
    "absolute": "abs",
    "arccos": "acos",
    "arcsin": "asin",
    "arctan": "atan",
    "arctan2": "atan2",
    "bool_": "bool",
}


class StandardNamespace:
    """An Array API standard namespace on one device, with NumPy's conventions where zerosim's
    code uses them (each a named fallback built from standard functions only):

    - ``out=``: ``xp.multiply(a, b, out=c)`` computes ``a * b`` and stores it in ``c``
      (``c[...] = r``); the standard has no output arguments, so this makes one temporary.
    - dtypes: NumPy dtypes (``np.float32``, ``resolve_dtype("float32")``) are accepted and
      mapped to the namespace's by name; float16 and bfloat16, which the standard lacks,
      raise a TypeError naming them.
    - new arrays (``zeros``, ``empty``, ``asarray`` …) are made on this namespace's device;
      ``asarray`` refuses a NumPy array (a host array must cross with ``from_host``).
    - ``copyto(dst, src)``, ``concatenate``, ``power``, ``transpose``, ``copy(x)`` and
      ``add_at(target, indices, values)`` (NumPy's ``np.add.at``).

    Anything else is the standard's function of that name; a name the standard lacks raises
    AttributeError naming it and the namespace.
    """

    def __init__(self, ns: Any, device: Any) -> None:
        self._ns = ns
        self.device = device
        self.__name__ = getattr(ns, "__name__", type(ns).__name__)

    def __repr__(self) -> str:
        return f"StandardNamespace({self.__name__}, device={self.device!r})"

    def dtype(self, dtype: Any) -> Any:
        """This namespace's dtype object for a NumPy dtype (or a name, or its own dtype)."""
        if dtype is None or not isinstance(dtype, str | np.dtype | type):
            return dtype
        name = np_dtype(dtype).name
        if name == "bool":
            return self._ns.bool
        found = getattr(self._ns, name, None)
        if found is None:
            raise TypeError(
                f"dtype {name!r} is not in the Array API standard, so {self.__name__} arrays "
                "cannot hold it; allowed on this backend: float64, float32 and the integer "
                "dtypes (16-bit floats need the numpy or cupy backend)"
            )
        return found

    def _store(self, out: Any, result: Any) -> Any:
        if result.dtype != out.dtype:
            result = self._ns.astype(result, out.dtype)
        out[...] = result
        return out

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._ns, _RENAMED.get(name, name), None)
        if target is None:
            raise AttributeError(
                f"{name!r} is not in the Array API standard's namespace {self.__name__} "
                "and zerosim's backend has no fallback for it"
            )
        if not callable(target) or name in ("Device",):
            return target
        if name in _CREATION:
            fn = self._creation(name, target)
        elif name in _DTYPE_AT:
            fn = self._dtype_positional(target, _DTYPE_AT[name])
        else:
            fn = self._operation(target)
        self.__dict__[name] = fn  # look each name up once
        return fn

    def _creation(self, name: str, target: Any) -> Any:
        def create(*args: Any, dtype: Any = None, device: Any = None, **kw: Any) -> Any:
            if name == "asarray" and args and isinstance(args[0], np.ndarray | np.generic):
                raise TypeError(
                    f"a NumPy (host) array was given to {self.__name__}.asarray; host data "
                    "crosses to the device through zerosim.backend.from_host"
                )
            return target(*args, dtype=self.dtype(dtype), device=device or self.device, **kw)

        create.__name__ = name
        return create

    def _dtype_positional(self, target: Any, at: int) -> Any:
        def call(*args: Any, **kw: Any) -> Any:
            if len(args) > at:
                args = (*args[:at], self.dtype(args[at]), *args[at + 1 :])
            if "dtype" in kw:
                kw["dtype"] = self.dtype(kw["dtype"])
            return target(*args, **kw)

        call.__name__ = getattr(target, "__name__", "call")
        return call

    def _operation(self, target: Any) -> Any:
        def op(*args: Any, out: Any = None, dtype: Any = None, **kw: Any) -> Any:
            if dtype is not None:
                kw["dtype"] = self.dtype(dtype)
            result = target(*args, **kw)
            return result if out is None else self._store(out, result)

        op.__name__ = getattr(target, "__name__", "op")
        return op

    # --- NumPy's functions that the standard lacks, from standard ones ---------------------

    def copyto(self, dst: Any, src: Any) -> None:
        self._store(
            dst, src if hasattr(src, "dtype") else self._ns.asarray(src, device=self.device)
        )

    def copy(self, x: Any) -> Any:
        return self._ns.asarray(x, copy=True)

    def add_at(self, target: Any, indices: Any, values: Any) -> None:
        """``target[indices[k]] += values[k]`` for every k, repeated indices summed (NumPy's
        ``np.add.at`` along the first axis), as a one-hot matrix product: (n, V)ᵀ @ (n, …).
        The (n, V) one-hot matrix is a temporary the memory report does not count: for an
        embedding, tokens × vocabulary elements (this path serves the Array API test backend)."""
        ns = self._ns
        idx = ns.reshape(indices, (-1,))
        rows = ns.reshape(values, (idx.shape[0], -1))
        positions = ns.arange(target.shape[0], device=self.device, dtype=idx.dtype)
        one_hot = ns.astype(idx[:, None] == positions[None, :], rows.dtype)
        added = ns.reshape(ns.matmul(ns.matrix_transpose(one_hot), rows), target.shape)
        target += ns.astype(added, target.dtype)


def add_at(target: Any, indices: Any, values: Any) -> None:
    """``target[indices] += values`` with repeated indices summed, on any backend."""
    xp = xp_of(target)
    if xp is np:
        np.add.at(target, indices, values)
    elif isinstance(xp, StandardNamespace) or hasattr(xp, "add_at"):  # the standard's, meta
        xp.add_at(target, indices, values)
    else:  # CuPy
        import cupyx  # noqa: PLC0415  (GPU-only)

        cupyx.scatter_add(target, indices, values)


@functools.cache
def _standard_namespace(ns: Any, device: Any) -> StandardNamespace:
    return StandardNamespace(ns, device)


def array_module(*arrays: Any) -> Any:
    """The namespace that owns these arrays (see ``xp_of``); they must share it."""
    return xp_of(arrays[0]) if arrays else np


def xp_of(x: Any) -> Any:
    """The namespace of one array: NumPy for NumPy arrays and scalars (checked first: this
    runs in every layer call and optimizer block), CuPy for CuPy arrays, else the Array API
    standard namespace of ``x`` on its device (``StandardNamespace``)."""
    if isinstance(x, np.ndarray | np.generic | float | int):
        return np
    meta = getattr(type(x), "__zerosim_namespace__", None)  # the dry run's shape-only arrays
    if meta is not None:
        return meta
    if is_cupy(x):
        return _cupy_namespace()
    if not hasattr(x, "__array_namespace__"):
        return np  # host data that is not an array yet: a list, a tuple, a Python number
    import array_api_compat  # noqa: PLC0415  (only device backends need it)

    return _standard_namespace(array_api_compat.array_namespace(x), x.device)


def is_cupy(x: Any) -> bool:
    """True for a CuPy array, decided from its type's module (without importing CuPy, and
    whether or not the CuPy release implements ``__array_namespace__``)."""
    return type(x).__module__.startswith("cupy")


@functools.cache
def _cupy_namespace() -> Any:
    """CuPy's names (ufuncs with out=, add.at) plus the standard's (astype, concat …), through
    array-api-compat; imported once."""
    import array_api_compat.cupy  # noqa: PLC0415  (only the cupy backend needs it)

    return array_api_compat.cupy


def is_host_array(x: Any) -> bool:
    """True for a NumPy array, and for the dry run's shape-only array when the run stands for a
    NumPy host (``zerosim.meta``'s ``Values.backend``): the test of every branch that takes a
    faster NumPy-only path (cache-sized blocks, numba kernels), so that a dry run follows the
    path of the backend it predicts."""
    return isinstance(x, np.ndarray) or getattr(x, "__zerosim_host__", False)


def stands_for_gpu(x: Any) -> bool:
    """True for the dry run's shape-only array when the run stands for a GPU (``Values.backend``
    "cupy"): the branches that a GPU takes as one fused kernel count that kernel."""
    shape_only = getattr(type(x), "__zerosim_namespace__", None) is not None
    return shape_only and not is_host_array(x)


def is_device_array(x: Any) -> bool:
    """True for an array whose memory NumPy cannot read: CuPy's, or another namespace's."""
    if isinstance(x, np.ndarray | np.generic):
        return False
    return is_cupy(x) or hasattr(x, "__array_namespace__")


# --- the one host <-> device crossing, counted ------------------------------------------------


@dataclass
class Crossings:
    """Host <-> device crossings of one thread (one rank of a LocalWorld, or an MPI process)."""

    to_host_calls: int = 0
    to_host_bytes: int = 0
    from_host_calls: int = 0
    from_host_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


_crossings = threading.local()


def crossings() -> Crossings:
    """This thread's running totals of host <-> device crossings (calls and bytes)."""
    counts = getattr(_crossings, "counts", None)
    if counts is None:
        counts = _crossings.counts = Crossings()
    return counts


def nbytes(x: Any) -> int:
    """Bytes held by an array of any namespace (size × item size)."""
    return int(x.size) * np_dtype(x.dtype).itemsize


def to_host(x: Any) -> np.ndarray:
    """The host (NumPy) copy of an array; NumPy arrays pass through uncounted and uncopied.

    The one way device data reaches the host: each call on a device array is counted in
    ``crossings()`` (bytes and calls).
    """
    if isinstance(x, np.ndarray):
        return x
    if not is_device_array(x):
        return np.asarray(x)
    counts = crossings()
    counts.to_host_calls += 1
    counts.to_host_bytes += nbytes(x)
    if is_cupy(x):
        return x.get()
    xp = xp_of(x)
    host = (
        xp._ns.asarray(x, device=_host_device(xp._ns), copy=True)
        if isinstance(xp, StandardNamespace)
        else x
    )
    return np.asarray(host).astype(np_dtype(x.dtype), copy=False)


def item(x: Any) -> float:
    """A 0-d (or one-element) array's value as a Python float; on a device this is a crossing
    of one element, counted like ``to_host``'s."""
    if isinstance(x, np.ndarray | np.generic | float | int):
        return float(x)
    counts = crossings()
    counts.to_host_calls += 1
    counts.to_host_bytes += np_dtype(x.dtype).itemsize
    return float(x)


def from_host(x: Any, like: Any = None, *, xp: Any = None, dtype: Any = None) -> Any:
    """``x`` (host data) as an array of ``like``'s namespace and device (or of ``xp``);
    NumPy targets take it uncopied and uncounted. The one way host data reaches a device:
    each call is counted in ``crossings()``."""
    if xp is None:
        xp = np if like is None else xp_of(like)
    if xp is np:
        return np.asarray(x, dtype=None if dtype is None else resolve_dtype(dtype))
    host = np.asarray(x, dtype=None if dtype is None else resolve_dtype(dtype))
    counts = crossings()
    counts.from_host_calls += 1
    counts.from_host_bytes += host.nbytes
    if isinstance(xp, StandardNamespace):
        dt = xp.dtype(host.dtype)
        on_host = xp._ns.asarray(host, dtype=dt, device=_host_device(xp._ns))
        return xp._ns.asarray(on_host, device=xp.device, copy=True)
    return xp.asarray(host)


def assign(dst: Any, src: Any) -> None:
    """``dst[...] = src``, rounding ``src`` to ``dst``'s dtype when they differ, as NumPy's and
    CuPy's assignment does (the standard refuses mixed dtypes there): where gradients enter a
    buffer of ``communication_data_type`` and come back."""
    if isinstance(dst, np.ndarray):
        dst[...] = src
        return
    xp = xp_of(dst)
    if isinstance(xp, StandardNamespace):
        xp.copyto(dst, src)
    else:
        dst[...] = src


def flat(x: Any) -> Any:
    """``x`` as a 1-D array (a view when its layout allows), in its own namespace."""
    return np.reshape(x, -1) if isinstance(x, np.ndarray) else xp_of(x).reshape(x, (-1,))


def contiguous(x: Any) -> Any:
    """``x`` in C order: NumPy's and CuPy's ``ascontiguousarray``; an Array API standard array
    has no memory layout to speak of, so it is returned as it is."""
    xp = xp_of(x)
    return x if isinstance(xp, StandardNamespace) else xp.ascontiguousarray(x)


def move_like(x: Any, like: Any) -> Any:
    """``x`` in ``like``'s namespace and device: itself when it already is, else a crossing
    (``to_host`` or ``from_host``, counted) — e.g. an offloaded host master written back into
    device parameters."""
    xp = xp_of(like)
    if xp_of(x) is xp:
        return x
    return to_host(x) if xp is np else from_host(to_host(x), xp=xp)


def _host_device(ns: Any) -> Any:
    """The namespace's host (CPU) device: array_api_strict's ``CPU_DEVICE``."""
    return ns.Device("CPU_DEVICE") if hasattr(ns, "Device") else None


@dataclass(frozen=True)
class Backend:
    """A backend's name and namespace, plus the helpers that depend on it."""

    name: str
    xp: Any

    def asarray(self, x: Any, dtype: str | np.dtype | None = None) -> Any:
        """``x`` as this backend's array: host data crosses with ``from_host`` (counted)."""
        dt = None if dtype is None else resolve_dtype(dtype)
        if self.name == "cupy" and dt is not None and dt == DTYPES["bfloat16"]:
            raise TypeError(
                "dtype 'bfloat16' is not supported by the cupy backend; "
                "allowed on cupy: float64, float32, float16"
            )
        if self.name == "numpy":
            return np.asarray(to_host(x), dtype=dt)
        if xp_of(x) is self.xp:
            return x if dt is None else self.xp.astype(x, dt)
        return from_host(to_host(x), xp=self.xp, dtype=dt)

    def zeros(self, shape: Any, dtype: str | np.dtype = "float32") -> Any:
        return self.xp.zeros(shape, dtype=resolve_dtype(dtype))

    def empty(self, shape: Any, dtype: str | np.dtype = "float32") -> Any:
        return self.xp.empty(shape, dtype=resolve_dtype(dtype))

    def to_host(self, x: Any) -> np.ndarray:
        return to_host(x)


def strict_namespace() -> StandardNamespace:
    """array_api_strict's namespace on its non-host ``Device("device1")``."""
    try:
        import array_api_strict  # noqa: PLC0415  (test-only dependency, imported on demand)
    except ImportError as err:
        raise RuntimeError(
            "backend 'array_api_strict' was requested but array-api-strict is not installed; "
            "pip install array-api-strict (it is in the test extra)"
        ) from err
    return _standard_namespace(array_api_strict, array_api_strict.Device(STRICT_DEVICE_NAME))


def get_backend(name: str | None = None) -> Backend:
    """The backend named by ``name``, else by ``$ZEROSIM_BACKEND``, else numpy.

    Raises ValueError for an unknown name and RuntimeError when cupy is asked for
    on a machine without CuPy or without a GPU, or array_api_strict without the package.
    """
    source = "backend"
    if name is None:
        name = os.environ.get(ENV_VAR, "numpy")
        source = ENV_VAR
    if name not in BACKENDS:
        raise ValueError(f"{source} {name!r} is not supported; allowed: {list(BACKENDS)}")
    if name == "numpy":
        return Backend("numpy", np)
    if name == "array_api_strict":
        return Backend("array_api_strict", strict_namespace())
    if name == "meta":
        from zerosim.meta import NAMESPACE  # noqa: PLC0415  (only the dry run needs it)

        return Backend("meta", NAMESPACE)
    cupy = cupy_or_none()
    if cupy is None:
        raise RuntimeError(
            f"{source} 'cupy' was requested but CuPy is not installed; "
            "install the gpu extra (pip install zerosim[gpu]) or use 'numpy'"
        )
    if not gpu_available():
        raise RuntimeError(
            f"{source} 'cupy' was requested but no CUDA GPU is visible; use 'numpy' on this machine"
        )
    # one GPU per rank of a node, as DeepSpeed picks by LOCAL_RANK (NCCL refuses two ranks on
    # one device)
    cupy.cuda.Device(local_rank() % cupy.cuda.runtime.getDeviceCount()).use()
    return Backend("cupy", _cupy_namespace())


# --- models built without values (the dry run) -------------------------------------------------

_shape_only = threading.local()


@contextlib.contextmanager
def shape_only_init() -> Iterator[None]:
    """Inside the block, the layers' initialisers (``zerosim.nn.init``) return shape-only arrays
    (``zerosim.meta``) instead of drawing values: a model of any size is built in no memory.
    Layers that make small arrays with NumPy directly (LayerNorm's ones) still do; the engine
    moves them to the meta backend with the rest."""
    before = getattr(_shape_only, "on", False)
    _shape_only.on = True
    try:
        yield
    finally:
        _shape_only.on = before


def shape_only_array(shape: tuple[int, ...], dtype: Any) -> Any:
    """A shape-only array of ``shape`` and ``dtype`` inside ``shape_only_init()``, else None."""
    if not getattr(_shape_only, "on", False):
        return None
    from zerosim.meta import NAMESPACE  # noqa: PLC0415

    return NAMESPACE.empty(shape, resolve_dtype(dtype))


# what MPICH's Hydra, Open MPI, Slurm and torchrun call a process's rank within its node
LOCAL_RANK_VARS = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK")


def local_rank() -> int:
    """This process's rank within its node, from the launcher's environment (0 if none says)."""
    for name in LOCAL_RANK_VARS:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0
