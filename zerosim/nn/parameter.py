"""``Parameter``: a trainable array with a name, a logical shape and a gradient slot.

The ZeRO engine swaps ``.data`` underneath the layers (a view into a flat buffer in
stages 1/2; an empty array while released and a view of the gathered buffer while
available in stage 3), so ``shape``, ``numel`` and ``dtype`` are recorded once, at
creation, and stay the *logical* description whatever ``.data`` holds right now.
Layers therefore read ``param.data`` at every call and never keep arrays derived from it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zerosim.backend import np_dtype, xp_of
from zerosim.nn.functional import downcast, is_floating


class Parameter:
    """A trainable array: ``.data``, ``.grad`` (None until a backward writes it), ``.name``.

    ``shape`` (tuple), ``numel`` (int, an attribute, not a method) and ``dtype`` describe the
    logical tensor; ``Module.to`` is the only thing that changes ``dtype``.
    """

    def __init__(self, data: Any, name: str | None = None, requires_grad: bool = True) -> None:
        if not hasattr(data, "shape") or not hasattr(data, "dtype"):
            data = np.asarray(data)
        if not is_floating(data.dtype):
            raise TypeError(
                f"Parameter data must be a floating array; got dtype {data.dtype} "
                f"(allowed: float64, float32, float16, bfloat16)"
            )
        self.data = data
        self.grad: Any = None
        self.name = name
        self.requires_grad = requires_grad
        self.shape: tuple[int, ...] = tuple(int(n) for n in data.shape)
        self.numel: int = int(np.prod(self.shape, dtype=np.int64))
        self.dtype: np.dtype = np_dtype(data.dtype)  # a NumPy dtype, whatever the backend
        # ZeRO-3 partition record when built inside ``zerosim.zero.Init``: this rank's chunk and
        # what gathering needs (then ``data`` is empty until gathered); None for a whole array.
        self.partition: Any = None

    def set_full_(self, value: Any) -> None:
        """Write the parameter's full value in place: into ``data``, or, for a partitioned
        parameter (collective then), rank 0's value into this rank's chunk."""
        if self.partition is not None:
            self.partition.set_full(value)
        else:
            self.data[...] = value

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        part = "" if self.partition is None else ", partitioned"
        return f"Parameter(name={self.name!r}, shape={self.shape}, dtype={self.dtype.name}{part})"


def accumulate_grad(param: Parameter, grad: Any) -> None:
    """Add ``grad`` into ``param.grad`` in place, or create it when it is None.

    Never rebinds an existing ``param.grad``: the engine may have pointed it at a
    view of a flat gradient buffer before backward, and must see the sum there.
    A fresh gradient is stored in the parameter's dtype. A 16-bit gradient slot receives
    ``grad`` rounded to its dtype first, then the sum is rounded again, as torch adds one
    backward's 16-bit gradient into ``.grad``: round(old + round(grad)).
    """
    if not param.requires_grad:
        return
    if grad.shape != param.shape:
        raise ValueError(
            f"gradient for parameter {param.name!r} has shape {grad.shape}; "
            f"expected the parameter's shape {param.shape}"
        )
    if param.grad is None:
        param.grad = downcast(grad, param.dtype)
    elif isinstance(param.grad, np.ndarray):
        with np.errstate(over="ignore"):  # float16 overflow → inf, for the loss scaler
            grad = downcast(grad, param.grad.dtype)
            np.add(param.grad, grad, out=param.grad, casting="unsafe")
    else:  # the sum in the wider dtype, rounded into the gradient (NumPy's unsafe casting)
        grad = downcast(grad, param.grad.dtype)
        xp_of(param.grad).add(param.grad, grad, out=param.grad)
