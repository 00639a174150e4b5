"""Array functions the layers are built from: dtypes for accumulation, erfc, GELU, softmax.

Pure functions of arrays of any backend (numpy, cupy, an Array API standard namespace such
as array_api_strict's, through ``xp_of``); the modules in ``zerosim.nn`` own the parameters
and the saved activations and call these for the math. NumPy-only fast paths (einsum, the
cache-sized pieces of the GELU backward) run under ``if xp is np``, beside a standard path.

NumPy has no ``erf``, so :func:`erfc` is evaluated from Chebyshev interpolants fitted
once at import to the C library's ``math.erfc`` (the transform is the one of Numerical
Recipes' ``erfccheb``): for ``z >= 0`` and ``t = 2 / (2 + z)``,

    erfc(z) = t · exp(P(t) − z²),   P(t) ≈ log(erfc(z) / t) + z²  (smooth in t),

with one interpolant on z ∈ [0, 6] and one on [6, 26]; erfc(z ≥ 26) < 6e-296 is returned
as 0. Relative error ≤ 2e-14 on [0, 6] and ≤ 3e-13 on [6, 26] in float64.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.polynomial import chebyshev

from zerosim.backend import DTYPES, HALF_DTYPES, is_cupy, is_host_array, np_dtype, to_host, xp_of
from zerosim.meta.fusion import fused

_SQRT_2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_TANH_C = math.sqrt(2.0 / math.pi)  # GELU tanh approximation (Hendrycks & Gimpel 2016)
_TANH_A = 0.044715
_FLOAT32 = np.dtype(np.float32)


def compute_dtype(dtype: Any) -> np.dtype:
    """The dtype arithmetic runs in: float32 for float16/bfloat16, else ``dtype`` itself.

    16-bit storage with float32 accumulation is what tensor cores and torch's CPU
    kernels do for matmuls, softmax, normalisation statistics and loss reductions.
    """
    dtype = dtype if isinstance(dtype, np.dtype) else np_dtype(dtype)
    return _FLOAT32 if dtype in HALF_DTYPES else dtype


def is_floating(dtype: Any) -> bool:
    """True for the floating dtypes, bfloat16 included (numpy sees ml_dtypes' as kind 'V')."""
    dtype = np_dtype(dtype)
    return dtype.kind == "f" or dtype == DTYPES["bfloat16"]


def upcast(x: Any) -> Any:
    """``x`` in its compute dtype (no copy unless it is a 16-bit float array)."""
    if isinstance(x, np.ndarray):
        return x.astype(compute_dtype(x.dtype), copy=False)
    return xp_of(x).astype(x, compute_dtype(x.dtype), copy=False)


def downcast(x: Any, dtype: Any) -> Any:
    """``x`` rounded to the storage ``dtype`` (no copy when it already is). Values beyond the
    dtype's range become ±inf silently: with float16 that is the overflow the engine's loss
    scaler checks for, not an error."""
    if isinstance(x, np.ndarray):
        if x.dtype == dtype:
            return x
        with np.errstate(over="ignore"):
            return x.astype(dtype)
    if np_dtype(x.dtype) == np_dtype(dtype):
        return x
    return xp_of(x).astype(x, dtype)


def reshape(x: Any, shape: Any) -> Any:
    """``x`` in ``shape`` (a view where the layout allows), on any backend. On NumPy the
    method, which skips the function's dispatch (the layers call this for every batch)."""
    if isinstance(x, np.ndarray):
        return x.reshape(shape)
    return xp_of(x).reshape(x, shape)


def permute(x: Any, axes: tuple[int, ...]) -> Any:
    """``x`` with its axes permuted (a view), on any backend; NumPy's method on NumPy."""
    if isinstance(x, np.ndarray):
        return x.transpose(axes)
    return xp_of(x).permute_dims(x, axes)


def reduce(op: str, x: Any, **kwargs: Any) -> Any:
    """The reduction ``op`` ("sum", "mean", "max", "min") of ``x`` with the standard's
    keywords (axis, keepdims, dtype), on any backend; NumPy's method on NumPy."""
    if isinstance(x, np.ndarray):
        return getattr(x, op)(**kwargs)
    return getattr(xp_of(x), op)(x, **kwargs)


def host_ints(*scalars: Any) -> list[int]:
    """0-d integer arrays (ids' bounds, counts) as Python ints. Off NumPy they are stacked
    and brought to the host in one counted crossing (``to_host``), not one sync each."""
    if isinstance(scalars[0], np.ndarray | np.generic):
        return [int(v) for v in scalars]
    return [int(v) for v in to_host(xp_of(scalars[0]).stack(scalars)).tolist()]


# --- erfc -----------------------------------------------------------------------------


def _fit_erfc_piece(z_lo: float, z_hi: float, degree: int) -> tuple[np.ndarray, float, float]:
    """Chebyshev coefficients of log(erfc(z)/t) + z² in t = 2/(2+z) for z in [z_lo, z_hi]."""
    t_lo, t_hi = 2.0 / (2.0 + z_hi), 2.0 / (2.0 + z_lo)
    reference = np.vectorize(math.erfc)

    def target(u: np.ndarray) -> np.ndarray:
        t = t_lo + (u + 1.0) * (t_hi - t_lo) / 2.0
        z = 2.0 / t - 2.0
        return np.log(reference(z) / t) + z * z

    return chebyshev.chebinterpolate(target, degree), t_lo, t_hi


_ERFC_PIECES = [
    (0.0, 6.0, _fit_erfc_piece(0.0, 6.0, 22)),
    (6.0, 26.0, _fit_erfc_piece(6.0, 26.0, 12)),
]


def _clenshaw(coefficients: np.ndarray, u: Any) -> Any:
    """Σ c_k T_k(u) by Clenshaw's recurrence, in the dtype of ``u`` (each c_k, a Python
    float, is rounded to it as it meets the array)."""
    xp = xp_of(u)
    b1 = xp.zeros_like(u)
    b2 = xp.zeros_like(u)
    for c in coefficients[:0:-1].tolist():
        b1, b2 = 2 * u * b1 - b2 + c, b1
    return u * b1 - b2 + float(coefficients[0])


def _erfc_nonnegative(z: Any) -> Any:
    xp = xp_of(z)
    out = xp.zeros_like(z)
    for z_lo, z_hi, (coefficients, t_lo, t_hi) in _ERFC_PIECES:
        mask = (z >= z_lo) & (z < z_hi)
        whole = bool(xp.all(mask))
        zz = z if whole else z[mask]
        if zz.size == 0:
            continue
        t = 2 / (2 + zz)
        u = (2 * t - (t_lo + t_hi)) / (t_hi - t_lo)
        value = t * xp.exp(_clenshaw(coefficients, u) - zz * zz)
        if whole:
            return value
        out[mask] = value
    return out


def device_erfc(x: Any) -> Any:
    """A GPU's erfc as one element-wise kernel: CuPy's ``cupyx.scipy.special.erfc`` on CuPy,
    and its stand-in on the dry run's shape-only arrays when the run stands for a GPU; None
    elsewhere (NumPy, a host's dry run, other namespaces: the series below)."""
    if is_host_array(x):
        return None
    if is_cupy(x):
        from cupyx.scipy.special import erfc as cupy_erfc

        return cupy_erfc
    return getattr(xp_of(x), "erfc", None)


def erfc(x: Any) -> Any:
    """Complementary error function 1 − erf(x), elementwise, in the compute dtype of ``x``.

    On a GPU one kernel (``device_erfc``). Elsewhere the Chebyshev series above; for x < 0 it
    uses erfc(x) = 2 − erfc(−x), which loses nothing since the result is in [1, 2].
    """
    xp = xp_of(x)
    x = upcast(x)
    kernel = device_erfc(x)
    if kernel is not None:
        return kernel(x)
    ax = xp.abs(x)
    out = _erfc_nonnegative(ax)
    return xp.where(x < 0, 2 - out, out)


# --- GELU -----------------------------------------------------------------------------

# Elements per piece when an elementwise chain is evaluated piece by piece on the host:
# 2¹⁶ float32 values (256 KiB per temporary) keep each pass inside the core's caches,
# where a pass over one big array at a time would stream it through main memory.
_PIECE = 1 << 16


def _pieces(size: int) -> list[slice]:
    """Contiguous slices of ``range(size)`` for :func:`gelu_backward` on the host."""
    return [slice(i, min(i + _PIECE, size)) for i in range(0, size, _PIECE)]


def _minus_2u(x: Any, x2: Any = None) -> Any:
    """−2u = −2·√(2/π)·(x + 0.044715·x³) as a new array: the tanh form's argument, doubled.

    ``x2``, when given, is x² already computed (the backward needs it again)."""
    if x2 is None:
        e = x * x
        e *= -2 * _TANH_C * _TANH_A
    else:
        e = x2 * (-2 * _TANH_C * _TANH_A)
    e -= 2 * _TANH_C
    e *= x
    return e


def gelu(x: Any, approximate: str = "none") -> Any:
    """GELU(x) = x·Φ(x), Φ(x) = ½·erfc(−x/√2); or its tanh approximation (Hendrycks & Gimpel).

    tanh form: ½·x·(1 + tanh(u)), u = √(2/π)·(x + 0.044715·x³), evaluated as
    x·σ(2u) = x / (1 + exp(−2u)), since ½(1 + tanh u) = σ(2u): one exp instead of a tanh,
    which costs about twice as much in NumPy. Computed in the compute dtype.
    """
    x = upcast(x)
    if approximate == "tanh":
        xp = xp_of(x)
        e = _minus_2u(x)
        with np.errstate(over="ignore"):  # exp → inf for x ≲ −10 (float32): x / inf = −0
            xp.exp(e, out=e)
        e += 1
        return xp.divide(x, e, out=e)
    return 0.5 * x * erfc(-x / _SQRT_2)


def _gelu_tanh_backward(x: Any, grad: Any, out: Any) -> None:
    """out = grad · s·(1 + p·(1 − s)), s = σ(2u), p = 2·√(2/π)·x·(1 + 3·0.044715·x²)."""
    xp = xp_of(x)
    x2 = x * x
    s = _minus_2u(x, x2)  # s = 1 / (1 + exp(−2u))
    with np.errstate(over="ignore"):  # s = 1 / (1 + inf) = 0 where exp overflows
        xp.exp(s, out=s)
    s += 1
    if xp is np:
        np.reciprocal(s, out=s)
    else:  # the standard has no reciprocal
        xp.divide(1.0, s, out=s)
    p = x2  # p = x·(2c + 6ca·x²), in x²'s place
    p *= 6 * _TANH_C * _TANH_A
    p += 2 * _TANH_C
    p *= x
    xp.subtract(1, s, out=out)
    out *= p
    out += 1
    out *= s
    out *= grad


def gelu_backward(x: Any, grad: Any, approximate: str = "none") -> Any:
    """d GELU / dx · grad.

    exact: Φ(x) + x·φ(x), φ(x) = exp(−x²/2)/√(2π).
    tanh:  with s = σ(2u) = ½(1 + tanh u), u as in :func:`gelu`, and 1 − tanh²u = 4s(1 − s),
           d/dx [x·s] = s + x·s(1 − s)·2√(2/π)(1 + 3·0.044715·x²)
                      = s·(1 + p·(1 − s)),   p = 2√(2/π)·x·(1 + 3·0.044715·x²);
           on the host the chain runs piece by piece (``_PIECE`` values) so that its
           fifteen passes read and write cache, not main memory.
    """
    xp = xp_of(x)
    x = upcast(x)
    grad = upcast(grad)
    if approximate == "tanh":
        out = xp.empty(x.shape, dtype=xp.result_type(x, grad))
        if xp is not np:  # one pass over whole arrays: no cache to fit in
            _gelu_tanh_backward(x, grad, out)
            return out
        x_flat = np.ascontiguousarray(x).reshape(-1)
        grad_flat = np.ascontiguousarray(grad).reshape(-1)
        out_flat = out.reshape(-1)
        for piece in _pieces(x_flat.size):
            _gelu_tanh_backward(x_flat[piece], grad_flat[piece], out_flat[piece])
        return out
    cdf = 0.5 * erfc(-x / _SQRT_2)
    pdf = xp.exp(-0.5 * x * x) * _INV_SQRT_2PI
    return (cdf + x * pdf) * grad


# --- softmax --------------------------------------------------------------------------


@fused("softmax")
def softmax_(z: Any, axis: int = -1) -> Any:
    """exp(z − max z) / Σ exp(z − max z) along ``axis``, computed in place in ``z``
    (a float32/float64 array, overwritten and returned). One kernel in PyTorch and Megatron
    (``meta.fusion``), as its backward is."""
    xp = xp_of(z)
    z -= reduce("max", z, axis=axis, keepdims=True)
    xp.exp(z, out=z)
    z *= 1 / reduce("sum", z, axis=axis, keepdims=True)
    return z


@fused("softmax")
def scaled_masked_softmax_(z: Any, scale: float, mask: Any, bias: Any = None) -> Any:
    """softmax(z·scale + mask [+ bias]) along the last axis, in place in ``z`` (overwritten and
    returned): attention's scores scaled by 1/√d, masked (an additive −∞ mask) and normalised.
    Megatron-LM runs the three as one kernel (``FusedScaleMaskSoftmax``), and so does a dry
    run standing for PyTorch (``meta.fusion``); its reads include the mask block, which
    Megatron's causal kernel computes instead of reading (1/(B·h) of the scores' bytes)."""
    z *= scale
    z += mask
    if bias is not None:
        z += bias
    return softmax_(z)


@fused("log_softmax")
def log_softmax(z: Any, axis: int = -1) -> Any:
    """z − max z − log Σ exp(z − max z) along ``axis``, into a new array (``z`` is left as it
    was): torch's ``log_softmax``, one kernel on a GPU (``meta.fusion``)."""
    xp = xp_of(z)
    shifted = z - reduce("max", z, axis=axis, keepdims=True)
    return shifted - xp.log(reduce("sum", xp.exp(shifted), axis=axis, keepdims=True))


@fused("softmax_backward")
def softmax_backward_(probs: Any, grad: Any) -> Any:
    """Jacobian-vector product of softmax over the last axis, p ⊙ (g − Σ p ⊙ g),
    computed in place in ``grad`` (overwritten and returned)."""
    grad -= rowdot(grad, probs)[..., None]
    grad *= probs
    return grad


def rowdot(a: Any, b: Any) -> Any:
    """Σ_i a[..., i]·b[..., i]: the dot product along the last axis, without an (…, n)
    temporary (NumPy's einsum on the host, the standard's ``vecdot`` elsewhere; the two may
    round differently in the last bit)."""
    if isinstance(a, np.ndarray):
        return np.einsum("...i,...i->...", a, b)
    return xp_of(a).vecdot(a, b, axis=-1)
