"""Shared machinery of the update rules: the state dtype, and walking arrays in cache-sized blocks.

An optimizer update is a chain of element-wise operations (Adam needs twelve). Done
naively over whole arrays, every operation streams full-size arrays through main memory
and needs full-size temporaries. The rules here instead walk the flat arrays in blocks of
``block_length`` elements (64 Ki to 256 Ki on the CPU, small enough that a block of every
array stays in the CPU cache), so main memory sees each array about once per step and the
only temporaries are a few block-sized work buffers: the *scratch*. Blocks change nothing
numerically: every operation is element-wise.

Each operation is one ufunc call with an explicit output (``xp.multiply(a, c, out=a)``
rather than ``a *= c``); the hot rules (Adam, SGD) also make their scalars once per step
with ``scalar``. On the CPU a call costs a fixed ~0.4 µs on top of its arithmetic, and a
Python float argument or an in-place operator adds about as much again.

16-bit parameters keep their optimizer state in float32 (the mixed-precision recipe of
Micikevicius et al. 2018); a block of such a parameter is upcast into a work buffer,
updated in float32 and rounded back to the parameter's dtype.

The rules compute with the namespace of their arrays (``xp_of``): NumPy's ufuncs on the
CPU, CuPy's on a GPU, and on an Array API standard namespace (array_api_strict) the same
calls through the backend's named fallbacks (``out=`` stores the result). Standard arrays
hide their memory layout, so they are not walked in blocks: each array is one block.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from zerosim.backend import DTYPES, dtype_name, is_host_array, np_dtype, xp_of

# Elements per block on the CPU: a 32nd of the parameter, between 64 Ki and 256 Ki. Each
# block costs ~12 ufunc calls of ~0.4 µs each on top of the arithmetic, so longer blocks are
# cheaper; at 256 Ki, one Adam block of its 5 arrays (5 MiB in float32) still stays in the L3
# cache. On a 2-core EPYC (512 KiB L2 per core), 256 Ki blocks are 2-4% faster than 64 Ki
# ones, 16 Ki blocks (L2-sized) ~10% slower and 512 Ki ones ~5% slower. A 32nd keeps the
# scratch (``SCRATCH_SLOTS`` blocks) well below the parameter's size. On a GPU each block is
# a kernel launch, so a block is a whole array up to 16 Mi elements.
CPU_BLOCK_LENGTH = 2**18
CPU_MIN_BLOCK_LENGTH = 2**16
GPU_BLOCK_LENGTH = 2**24
# The most work buffers any rule needs at once (NAdam's three plus the float32 copies
# of a 16-bit parameter and gradient block).
SCRATCH_SLOTS = 5


def scalar(value: float, param: Any) -> Any:
    """``value`` rounded to the state dtype of ``param``, ready to pass to ufuncs.

    On NumPy it is a 0-d array: a Python float rounds to the array's dtype just the same
    (NEP 50), but costs every ufunc call a conversion. Elsewhere (CuPy, the Array API
    standard's arrays, which refuse NumPy operands) it stays a float.
    Make the scalars of a rule once per step, before walking the blocks.
    """
    if isinstance(param, np.ndarray):
        return np.array(value, dtype=state_dtype(param.dtype))
    return float(value)


def state_dtype(param_dtype: Any) -> np.dtype:
    """The dtype of the optimizer state (and of the arithmetic) for a parameter dtype.

    float64 and float32 parameters keep state in their own dtype; float16 and bfloat16
    parameters keep it in float32. Other dtypes raise TypeError.
    """
    dt = param_dtype if isinstance(param_dtype, np.dtype) else np_dtype(param_dtype)
    if dt in (DTYPES["float64"], DTYPES["float32"]):
        return dt
    if dt in (DTYPES["float16"], DTYPES["bfloat16"]):
        return DTYPES["float32"]
    raise TypeError(
        f"parameter dtype {dtype_name(dt)!r} cannot be optimized; allowed: {sorted(DTYPES)}"
    )


def has_layout(x: Any) -> bool:
    """True for arrays that expose their memory layout (NumPy's and CuPy's ``.flags``).

    The Array API standard's arrays do not; the rules update them whole (one block).
    """
    return hasattr(x, "flags")


def block_length(param: Any) -> int:
    """How many elements of ``param`` one block holds (at least 1)."""
    size = int(param.size)
    if is_host_array(param):  # a dry run standing for NumPy too
        limit = min(CPU_BLOCK_LENGTH, max(CPU_MIN_BLOCK_LENGTH, size // 32))
    elif has_layout(param):
        limit = GPU_BLOCK_LENGTH
    else:
        limit = size
    return max(1, min(size, limit))


def make_scratch(param: Any, slots: int = SCRATCH_SLOTS) -> Any:
    """A reusable scratch buffer for updating ``param``: ``slots`` blocks of its state dtype.

    Pass it as ``scratch=`` to any rule to avoid allocating work buffers on every call.
    """
    xp = xp_of(param)
    return xp.empty(slots * block_length(param), dtype=state_dtype(param.dtype))


def zeros_state(param: Any, fill: float = 0.0) -> Any:
    """A new state array shaped like ``param`` in its state dtype, filled with ``fill``."""
    xp = xp_of(param)
    return xp.full(param.shape, fill, dtype=state_dtype(param.dtype))


def check_arrays(param: Any, grad: Any, **states: Any) -> None:
    """Raise ValueError unless grad and every state array (None skipped) fit ``param``."""
    if grad.shape != param.shape:
        raise ValueError(
            f"grad has shape {tuple(grad.shape)}; it must equal the parameter's "
            f"shape {tuple(param.shape)}"
        )
    want = state_dtype(param.dtype)
    host = isinstance(param, np.ndarray)  # NumPy's dtypes compare without np_dtype's call
    for name, arr in states.items():
        if arr is None:
            continue
        if arr.shape != param.shape or (arr.dtype if host else np_dtype(arr.dtype)) != want:
            raise ValueError(
                f"{name} has shape {tuple(arr.shape)} and dtype {np_dtype(arr.dtype).name}; "
                f"it must have the parameter's shape {tuple(param.shape)} and the state "
                f"dtype {dtype_name(want)}"
            )


def _work_buffers(param: Any, count: int, length: int, scratch: Any) -> list[Any]:
    """``count`` disjoint buffers of ``length`` elements, carved from ``scratch`` if given."""
    want = state_dtype(param.dtype)
    if scratch is None:
        return [xp_of(param).empty(length, dtype=want) for _ in range(count)]
    contiguous = not has_layout(scratch) or scratch.flags.c_contiguous
    if scratch.ndim != 1 or np_dtype(scratch.dtype) != want or not contiguous:
        raise ValueError(
            f"scratch must be a contiguous 1-D array of dtype {dtype_name(want)}; got "
            f"shape {tuple(scratch.shape)} and dtype {np_dtype(scratch.dtype).name}"
        )
    if scratch.size < count * length:
        raise ValueError(
            f"scratch has {scratch.size} elements; this update needs at least "
            f"{count * length} (use make_scratch(param))"
        )
    return [scratch[i * length : (i + 1) * length] for i in range(count)]


def blocks(
    param: Any,
    grad: Any,
    states: Sequence[Any],
    n_work: int,
    scratch: Any = None,
) -> Iterator[tuple[Any, Any, list[Any], list[Any]]]:
    """Walk ``param``, ``grad`` and ``states`` together, one block at a time.

    Yields ``(p, g, state_blocks, work)``: matching views of one block of the parameter,
    the gradient and each state array (None stays None), all in the state dtype, plus
    ``n_work`` work buffers of the block's length. Write the update into ``p`` and the
    state blocks in place; ``g`` may be the caller's gradient, so never write to it.
    A 16-bit parameter block is an upcast copy that is rounded back after the body.
    NumPy or CuPy arrays that are not all C-contiguous are processed as a single block,
    with work buffers of their full size allocated for the call (``scratch`` is not used).
    The Array API standard's arrays, whose layout is hidden, are one block too, with
    their work buffers carved from ``scratch`` when it is given.
    """
    xp = xp_of(param)
    want = state_dtype(param.dtype)
    host = xp is np  # NumPy's dtypes compare without np_dtype's call
    cast_param = (param.dtype if host else np_dtype(param.dtype)) != want
    cast_grad = (grad.dtype if host else np_dtype(grad.dtype)) != want
    arrays = [param, grad, *[s for s in states if s is not None]]
    layout = host or all(has_layout(a) for a in arrays)
    flat = layout and all(a.flags.c_contiguous for a in arrays)
    length = block_length(param) if flat else max(1, int(param.size))
    count = n_work + cast_param + cast_grad
    buffers = _work_buffers(param, count, length, scratch if flat or not layout else None)
    if flat:  # NumPy or CuPy arrays: their own reshape costs a sixth of np.reshape's
        param, grad = param.reshape(-1), grad.reshape(-1)
        states = [None if s is None else s.reshape(-1) for s in states]
    elif layout:
        buffers = [b.reshape(param.shape) for b in buffers]
    else:  # the standard's arrays: one block, the work buffers shaped like the parameter
        buffers = [xp.reshape(b, tuple(param.shape)) for b in buffers]
    size = int(param.size)
    for start in range(0, size, length):
        p, g, state_blocks, work = param, grad, states, list(buffers)
        if flat:
            block = slice(start, min(start + length, size))
            p, g = param[block], grad[block]
            state_blocks = [None if s is None else s[block] for s in states]
            if size - start < length:  # the last, shorter block
                work = [b[: size - start] for b in buffers]
        p_buf = work.pop() if cast_param else None  # the upcast copies, after the work buffers
        g_buf = work.pop() if cast_grad else None
        p_out = p
        if cast_param:
            xp.copyto(p_buf, p_out)
            p = p_buf
        if cast_grad:
            xp.copyto(g_buf, g)
            g = g_buf
        yield p, g, state_blocks, work
        if cast_param:
            xp.copyto(p_out, p)


def coupled_weight_decay(step: Any) -> float:
    """λ added to the gradient (Adam, NAdam and RAdam's L2 form); 0 under their decoupled form,
    whose decay scales θ instead. Read as the ``coupled_decay`` property of their step tuples."""
    return 0.0 if step.decoupled_weight_decay else step.weight_decay


def effective_grad(g: Any, p: Any, *, maximize: bool, weight_decay: float, out: Any) -> Any:
    """The gradient a rule descends: ``g' = (−g if maximize else g) + weight_decay·p``.

    Returns ``g`` itself when nothing changes, else writes ``g'`` into ``out``. This is
    *coupled* weight decay (an L2 penalty ½·λ·‖θ‖² added to the loss); decoupled decay
    (Loshchilov & Hutter 2019) scales the parameter instead, inside the rules.
    """
    if weight_decay == 0 and not maximize:
        return g
    xp = xp_of(g)
    if weight_decay == 0:
        return xp.negative(g, out=out)
    xp.multiply(p, weight_decay, out=out)
    if maximize:
        return xp.subtract(out, g, out=out)
    return xp.add(out, g, out=out)


def lerp_scale(weight: float) -> float:
    """The factor :func:`lerp_` multiplies ``end − start`` by: weight, or 1 − weight from 0.5."""
    return weight if weight < 0.5 else 1.0 - weight


def lerp_(start: Any, end: Any, weight: float, tmp: Any, scale: Any = None) -> None:
    """``start ← start + weight·(end − start)`` in place; ``tmp`` is a work buffer.

    Like torch.lerp, for weight ≥ 0.5 it computes ``end − (1 − weight)·(end − start)``
    instead, so that weight = 1 gives ``end`` exactly (β = 0 makes a moment the gradient).
    ``scale`` is ``lerp_scale(weight)`` when the caller made it once per step (``scalar``).
    """
    xp = xp_of(start)
    xp.subtract(end, start, out=tmp)
    xp.multiply(tmp, lerp_scale(weight) if scale is None else scale, out=tmp)
    if weight < 0.5:
        xp.add(start, tmp, out=start)
    else:
        xp.subtract(end, tmp, out=start)


def add_square_(avg: Any, g: Any, beta: Any, tmp: Any, one_minus_beta: Any = None) -> None:
    """The second-moment update ``avg ← beta·avg + (1 − beta)·g²`` in place, as torch's
    ``mul_(beta).addcmul_(g, g, value=1 − beta)`` computes it: ((1 − beta)·g)·g.
    ``one_minus_beta`` is 1 − beta when the caller made it once per step (``scalar``)."""
    xp = xp_of(avg)
    xp.multiply(avg, beta, out=avg)
    xp.multiply(g, 1.0 - beta if one_minus_beta is None else one_minus_beta, out=tmp)
    xp.multiply(tmp, g, out=tmp)
    xp.add(avg, tmp, out=avg)


def add_ratio_(p: Any, num: Any, denom: Any, coef: float, tmp: Any) -> None:
    """The step of the adaptive rules, ``p ← p + coef·num/denom`` in place (coef·num first).

    ``tmp`` is a work buffer; it may be ``num`` itself when ``num`` is no longer needed.
    """
    xp = xp_of(p)
    xp.multiply(num, coef, out=tmp)
    xp.divide(tmp, denom, out=tmp)
    xp.add(p, tmp, out=p)


VARIANTS = ("torch", "keras")  # whose arithmetic a rule follows where torch and Keras differ


def check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is not supported; allowed: {list(VARIANTS)}")
