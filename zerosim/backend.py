"""The one place that decides between NumPy (CPU) and CuPy (GPU), and names dtypes.

Everything else in zerosim receives arrays and asks this module for their array
module (``array_module(x)``), so the same code runs on both. bfloat16 on the CPU
comes from ``ml_dtypes``; CuPy has no bfloat16 dtype, so the GPU path supports
float64, float32 and float16 only and says so when asked for bfloat16.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np

BACKENDS = ("numpy", "cupy")
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
    try:
        resolved = np.dtype(dtype)
    except TypeError as err:
        raise TypeError(f"dtype {dtype!r} is not a dtype; allowed: {sorted(DTYPES)}") from err
    return resolved


@functools.lru_cache(maxsize=64)
def _name_of(dtype: np.dtype) -> str:
    return dtype.name


def dtype_name(dtype: np.dtype | type) -> str:
    """The short name of a dtype: 'float32', 'bfloat16', 'int8', … (cached: on the hot path)."""
    return _name_of(np.dtype(dtype))


def is_half(dtype: np.dtype | type) -> bool:
    """True for the 16-bit floating dtypes (float16, bfloat16)."""
    return np.dtype(dtype) in HALF_DTYPES


@functools.cache
def _cupy_or_none() -> ModuleType | None:
    """CuPy if it imports, else None (cached: a failed import is not retried on every call)."""
    try:
        import cupy  # noqa: PLC0415  (optional dependency, imported on demand)
    except ImportError:
        return None
    return cupy


def gpu_available() -> bool:
    """True when CuPy is installed and sees at least one CUDA device."""
    cupy = _cupy_or_none()
    if cupy is None:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001  (CUDA raises its own error types when no driver)
        return False


def array_module(*arrays: Any) -> ModuleType:
    """The array module (numpy or cupy) that owns these arrays."""
    cupy = _cupy_or_none()
    if cupy is not None:
        return cupy.get_array_module(*arrays)
    return np


def xp_of(x: Any) -> ModuleType:
    """The array module of one array: numpy for numpy arrays and scalars without asking CuPy
    (this runs in every layer call and every optimizer block), else ``array_module``."""
    return np if isinstance(x, np.ndarray | np.generic) else array_module(x)


def is_device_array(x: Any) -> bool:
    """True for a CuPy array (memory on a GPU)."""
    cupy = _cupy_or_none()
    return cupy is not None and isinstance(x, cupy.ndarray)


def any_device_array(*arrays: Any) -> bool:
    """True if any of the arrays is a CuPy array (one cached lookup when CuPy is absent)."""
    cupy = _cupy_or_none()
    return cupy is not None and any(isinstance(a, cupy.ndarray) for a in arrays)


def to_host(x: Any) -> np.ndarray:
    """Copy an array to host memory as numpy (no copy when it already is numpy)."""
    if is_device_array(x):
        return x.get()
    return np.asarray(x)


@dataclass(frozen=True)
class Backend:
    """An array module plus the helpers that depend on it."""

    name: str
    xp: ModuleType

    def asarray(self, x: Any, dtype: str | np.dtype | None = None) -> Any:
        """Move or convert ``x`` to this backend's arrays (host → device for cupy)."""
        dt = None if dtype is None else resolve_dtype(dtype)
        if self.name == "cupy" and dt is not None and dt == DTYPES["bfloat16"]:
            raise TypeError(
                "dtype 'bfloat16' is not supported by the cupy backend; "
                "allowed on cupy: float64, float32, float16"
            )
        return self.xp.asarray(x, dtype=dt)

    def zeros(self, shape: Any, dtype: str | np.dtype = "float32") -> Any:
        return self.xp.zeros(shape, dtype=resolve_dtype(dtype))

    def empty(self, shape: Any, dtype: str | np.dtype = "float32") -> Any:
        return self.xp.empty(shape, dtype=resolve_dtype(dtype))

    def to_host(self, x: Any) -> np.ndarray:
        return to_host(x)


def get_backend(name: str | None = None) -> Backend:
    """The backend named by ``name``, else by ``$ZEROSIM_BACKEND``, else numpy.

    Raises ValueError for an unknown name and RuntimeError when cupy is asked for
    on a machine without CuPy or without a GPU.
    """
    source = "backend"
    if name is None:
        name = os.environ.get(ENV_VAR, "numpy")
        source = ENV_VAR
    if name not in BACKENDS:
        raise ValueError(f"{source} {name!r} is not supported; allowed: {list(BACKENDS)}")
    if name == "numpy":
        return Backend("numpy", np)
    cupy = _cupy_or_none()
    if cupy is None:
        raise RuntimeError(
            f"{source} 'cupy' was requested but CuPy is not installed; "
            "install the gpu extra (pip install zerosim[gpu]) or use 'numpy'"
        )
    if not gpu_available():
        raise RuntimeError(
            f"{source} 'cupy' was requested but no CUDA GPU is visible; use 'numpy' on this machine"
        )
    return Backend("cupy", cupy)
