"""A layer's chain of element-wise calls, counted as the one kernel PyTorch runs for it.

zerosim's layers are NumPy-shaped: GELU's backward is a dozen array calls, LayerNorm's forward
eight, a bf16 ``Linear`` casts its input and weight to float32, adds the bias and casts back.
On a GPU, PyTorch runs each of these chains as one kernel that reads its inputs once and writes
its outputs once, computing in float32 registers (cuBLAS reads and writes bf16 and adds the bias
in its epilogue; LayerNorm, GELU and the softmax cross-entropy are one kernel each).
A dry run that stands for PyTorch (``Values.backend`` ``"torch"``: the published runs) counts
a marked chain that way:

    @fused("gelu")
    def gelu_kernel(x): ...        # one "gelu" kernel: x read, the result written

    @fused("linear", epilogue=True)
    def forward(self, x): ...      # the products inside count; the casts and bias add are
                                   # their epilogue and cost nothing more

Everywhere else (NumPy, CuPy, array_api_strict, a dry run for a host or for zerosim's CuPy
path) the function runs and counts as it always does: ``fused`` changes no value and no
allocation. Under ``"torch"`` it changes what the time model is told a GPU launches, and the
peaks: the chain's temporaries, which a fused kernel keeps in registers, raise no peak; what
is live when it returns (its results, what it saved for backward) does. Live bytes are
unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from zerosim.meta.array import MetaArray
from zerosim.meta.tracker import current, values


def fused(name: str, *, epilogue: bool = False) -> Callable[[Callable], Callable]:
    """Mark a function as one GPU kernel named ``name``: under the ``"torch"`` backend its
    array calls are not counted, and when it returns, one ``name`` operation is, of the bytes
    of its array arguments (read) and of its array results (written). With ``epilogue`` the
    function's matrix products are the kernels and its other calls ride on them: nothing is
    added. A kernel marked inside another kernel is part of it; inside an epilogue it is a
    kernel of its own (a bias gradient's reduction beside the products of a backward)."""

    def mark(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if values().backend != "torch":  # every run but a dry run standing for PyTorch
                return fn(*args, **kwargs)
            inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, MetaArray)]
            if not inputs:
                return fn(*args, **kwargs)
            tracker = current()
            inside_kernel = tracker.in_kernel
            peaks = tracker.peak_total, dict(tracker.peak)
            tracker.fused_depth += 1
            tracker.in_kernel = inside_kernel or not epilogue
            try:
                result = fn(*args, **kwargs)
            finally:
                tracker.fused_depth -= 1
                tracker.in_kernel = inside_kernel
            _no_temporaries(tracker, *peaks)
            if not (epilogue or inside_kernel):
                outputs = result if isinstance(result, tuple) else (result,)
                moved = sum(a.nbytes for a in (*inputs, *outputs) if isinstance(a, MetaArray))
                tracker.kernel_op(name, moved)
            return result

        return call

    return mark


def _no_temporaries(tracker: Any, peak_total: int, peak: dict[str, int]) -> None:
    """The peaks as a fused kernel leaves them: it allocates its results and nothing else, so
    the chain's temporaries, gone by its end, raise no peak (what is live at the end does)."""
    tracker.peak_total = max(peak_total, tracker.live_total)
    for category, before in peak.items():
        tracker.peak[category] = max(before, tracker.live[category])
