"""Array-backed datasets with batched indexing, and synthetic ones for the MLP demos.

A dataset here is anything with ``len(ds)`` and ``ds[idx] -> (x, y)`` where
``idx`` is an integer array: one fancy-indexing call per micro-batch, never a
Python loop per sample. The synthetic generators are deterministic functions
of their seed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zerosim.backend import array_module, resolve_dtype
from zerosim.data.sampler import check_int


def check_indices(idx: Any, length: int) -> None:
    """Raise IndexError unless every index in ``idx`` lies in ``[0, length)``."""
    xp = array_module(idx)
    arr = xp.asarray(idx)
    if arr.dtype.kind not in "iu":
        raise IndexError(f"dataset indices must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= length):
        raise IndexError(
            f"dataset indices must be in [0, {length}), got min {int(arr.min())} "
            f"and max {int(arr.max())}"
        )


class ArrayDataset:
    """Pairs ``(x[i], y[i])`` of two arrays with the same first dimension.

    ``ds[idx]`` with an int array returns ``(x[idx], y[idx])``; with an int it
    returns one sample. The arrays stay on whichever backend they were given.
    """

    def __init__(self, x: Any, y: Any) -> None:
        if x.ndim == 0 or y.ndim == 0:
            raise ValueError(
                f"x and y need a leading sample dimension, got shapes {x.shape} and {y.shape}"
            )
        if x.shape[0] != y.shape[0]:
            raise ValueError(
                f"x and y must have the same number of samples, got x.shape={x.shape} "
                f"and y.shape={y.shape}"
            )
        self.x, self.y = x, y

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def __getitem__(self, idx: Any) -> tuple[Any, Any]:
        check_indices(idx, len(self))
        return self.x[idx], self.y[idx]


def make_classification(
    n_samples: int,
    n_features: int,
    n_classes: int,
    seed: int = 0,
    class_sep: float = 2.0,
    dtype: str = "float32",
) -> ArrayDataset:
    """Gaussian blobs: one centre per class, unit-variance noise around it.

    Centres ``c_k ~ N(0, class_sep² I)``; labels ``y_i`` uniform over
    ``range(n_classes)`` (int64); features ``x_i = c_{y_i} + ε_i``,
    ``ε_i ~ N(0, I)``. Everything comes from ``numpy.random.default_rng(seed)``.
    """
    n_samples = check_int("n_samples", n_samples, 1)
    n_features = check_int("n_features", n_features, 1)
    n_classes = check_int("n_classes", n_classes, 2)
    if not class_sep > 0:
        raise ValueError(f"class_sep must be > 0, got {class_sep}")
    rng = np.random.default_rng(check_int("seed", seed, 0))
    centres = rng.normal(scale=class_sep, size=(n_classes, n_features))
    y = rng.integers(0, n_classes, size=n_samples, dtype=np.int64)
    x = centres[y] + rng.normal(size=(n_samples, n_features))
    return ArrayDataset(x.astype(resolve_dtype(dtype)), y)


def make_regression(
    n_samples: int,
    n_features: int,
    n_targets: int = 1,
    noise: float = 0.1,
    seed: int = 0,
    dtype: str = "float32",
) -> ArrayDataset:
    """A noisy linear map: ``y = x W + b + noise · ε``.

    ``x ~ N(0, I)`` of shape (n_samples, n_features); ``W ~ N(0, 1/n_features)``
    of shape (n_features, n_targets) so that each target has variance about 1;
    ``b ~ N(0, 1)``; ``ε ~ N(0, I)``. ``y`` is always 2-D, (n_samples, n_targets),
    to match an MSE loss on a (batch, n_targets) model output.
    """
    n_samples = check_int("n_samples", n_samples, 1)
    n_features = check_int("n_features", n_features, 1)
    n_targets = check_int("n_targets", n_targets, 1)
    if not noise >= 0:
        raise ValueError(f"noise must be >= 0, got {noise}")
    rng = np.random.default_rng(check_int("seed", seed, 0))
    weight = rng.normal(scale=1.0 / np.sqrt(n_features), size=(n_features, n_targets))
    bias = rng.normal(size=n_targets)
    x = rng.normal(size=(n_samples, n_features))
    y = x @ weight + bias + noise * rng.normal(size=(n_samples, n_targets))
    dt = resolve_dtype(dtype)
    return ArrayDataset(x.astype(dt), y.astype(dt))
