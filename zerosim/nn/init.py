"""Seeded initialisation: a Generator from a seed, and torch's default initialisers.

Every layer draws its initial values from a ``numpy.random.Generator`` passed in by
the model, so a model built twice with the same seed has the same weights. Values
are drawn in float64 and then cast, so a model's float32 and float64 versions start
from the same numbers up to rounding.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from zerosim.backend import resolve_dtype, shape_only_array

RngLike = np.random.Generator | int | None


def as_generator(rng: RngLike) -> np.random.Generator:
    """A Generator as given, or seeded from an int; None means seed 0 (deterministic).

    Layers built with the same int or with None start identical: pass one shared
    Generator to a model's layers to give each different values.
    """
    if isinstance(rng, np.random.Generator):
        return rng
    if rng is None:
        return np.random.default_rng(0)
    if isinstance(rng, int | np.integer) and not isinstance(rng, bool):
        return np.random.default_rng(int(rng))
    raise TypeError(f"rng must be a numpy Generator, an int seed or None; got {type(rng).__name__}")


def uniform(rng: np.random.Generator, shape: tuple[int, ...], bound: float, dtype: Any) -> Any:
    """U(−bound, bound) in ``dtype`` (no values inside ``backend.shape_only_init``)."""
    made = shape_only_array(shape, dtype)
    if made is not None:
        return made
    return rng.uniform(-bound, bound, size=shape).astype(resolve_dtype(dtype))


def linear_default(
    rng: np.random.Generator, shape: tuple[int, ...], fan_in: int, dtype: Any
) -> Any:
    """torch's default for Linear weight and bias: U(−1/√fan_in, 1/√fan_in).

    (kaiming_uniform with a = √5 gives bound = √(6 / ((1 + a²)·fan_in)) = 1/√fan_in.)
    """
    return uniform(rng, shape, 1.0 / math.sqrt(fan_in), dtype)


def normal(rng: np.random.Generator, shape: tuple[int, ...], std: float, dtype: Any) -> Any:
    """N(0, std²) in ``dtype`` (no values inside ``backend.shape_only_init``)."""
    made = shape_only_array(shape, dtype)
    if made is not None:
        return made
    return (std * rng.standard_normal(size=shape)).astype(resolve_dtype(dtype))


def check_positive_int(name: str, value: Any) -> int:
    """``value`` as an int, or a ValueError naming ``name`` when it is not a positive int."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise ValueError(f"{name} must be a positive int; got {value!r}")
    return int(value)


def check_last_axis(who: str, x: Any, size: int, ndim: int | None = None) -> None:
    """A ValueError naming the module ``who`` unless ``x``'s last axis has ``size`` elements (and
    ``x`` has ``ndim`` axes, where given: ``ndim=3`` is a (B, T, C) sequence)."""
    if x.ndim == 0 or x.shape[-1] != size or (ndim is not None and x.ndim != ndim):
        want = f"(B, T, {size}) input" if ndim == 3 else f"a last axis of {size}"
        raise ValueError(f"{who} expects {want}; got shape {tuple(x.shape)}")
