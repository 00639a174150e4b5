"""Muon (Jordan et al. 2024): momentum, then the update matrix replaced by a nearby orthogonal one,
as DeepSpeed 0.19.8 computes it (``deepspeed/runtime/zero/muon/original_muon.py``).

Muon is the first rule here that is not element-wise: ``muon_update`` needs the whole gradient
*matrix*, because Newton–Schulz iterations multiply the matrix by its own transpose. That is
what makes it expensive under ZeRO (``zerosim/zero/muon.py``): a rank that owns a slice of a
matrix must first obtain the whole matrix's gradient.

Newton–Schulz runs in a lower precision, as DeepSpeed picks it on a machine without fp16
matrix products (its CPU accelerator): ``"gram"`` (the default) in float32, ``"standard"`` in
bfloat16. A bfloat16 product is computed in float32 and rounded once, as torch's CPU kernels
do; every other operation rounds its result (``_Rounding``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from zerosim.backend import DTYPES, xp_of

# The quintic's coefficients, chosen to maximise the slope at zero (Jordan et al. 2024).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_METHODS = ("gram", "standard")
NORM_EPS = 1e-7  # added to the Frobenius norm before dividing by it
# The step at which the Gram iteration rebuilds X from Q (DeepSpeed's ``restart_at``).
GRAM_RESTART = 2


def ns_compute_dtype(ns_method: str) -> np.dtype:
    """The dtype Newton–Schulz runs in: DeepSpeed's choice on its CPU accelerator, which has
    bfloat16 but not fp16 matrix products: gram → float32 (fp16 on a GPU), standard →
    bfloat16."""
    if ns_method not in NS_METHODS:
        raise ValueError(f"ns_method={ns_method!r} is not supported; allowed: {list(NS_METHODS)}")
    return DTYPES["float32"] if ns_method == "gram" else DTYPES["bfloat16"]


class _Rounding:
    """Arithmetic of a compute dtype: values held in float32 (or the dtype itself when it is
    float32/float64), each result rounded to the dtype."""

    def __init__(self, xp: Any, dtype: np.dtype) -> None:
        self.xp = xp
        self.dtype = dtype
        self.half = dtype == DTYPES["bfloat16"] or dtype == DTYPES["float16"]
        self.hold = DTYPES["float32"] if self.half else dtype

    def __call__(self, x: Any) -> Any:
        """``x`` rounded to the compute dtype (and held in float32 if that is 16-bit)."""
        xp = self.xp
        if self.half:
            return xp.astype(xp.astype(x, self.dtype), self.hold)
        return xp.astype(x, self.hold)

    def matmul(self, a: Any, b: Any) -> Any:
        return self(self.xp.matmul(a, b))

    def scale(self, c: float, x: Any) -> Any:
        return self(x * self.hold.type(c))

    def add(self, x: Any, y: Any) -> Any:
        return self(x + y)


def _normalize(xp: Any, X: Any, r: _Rounding | None = None) -> Any:
    """X / (‖X‖_F + 1e-7): the spectral norm is then at most 1 (rounded as ``r`` says)."""
    norm = xp.sqrt(xp.sum(X * X))
    if r is None:
        return X / (norm + X.dtype.type(NORM_EPS))
    return r(X / r(r(norm) + r.hold.type(NORM_EPS)))


def _quintic_steps(X: Any, steps: int, r: _Rounding) -> Any:
    """X ← a·X + (b·A + (c·A)·A)·X with A = X·Xᵀ, ``steps`` times, in ``r``'s arithmetic."""
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        A = r.matmul(X, X.T)
        B = r.add(r.scale(b, A), r.matmul(r.scale(c, A), A))
        X = r.add(r.scale(a, X), r.matmul(B, X))
    return X


def zeropower_via_newtonschulz5(G: Any, steps: int = NS_STEPS, dtype: Any = None) -> Any:
    """The orthogonalization of G (≈ U·S'·Vᵀ with S'ᵢᵢ ~ U(0.5, 1.5) where G = U·S·Vᵀ), by the
    quintic Newton–Schulz iteration on X (n × m, n ≤ m: G or Gᵀ), from X = G/(‖G‖_F + 1e-7)::

        A = X·Xᵀ;   X ← a·X + (b·A + c·A·A)·X,      (a, b, c) = (3.4445, −4.7750, 2.0315)

    Every operation in ``dtype`` (default bfloat16, DeepSpeed's for ``"standard"``), G itself
    rounded to it first. Returns the result held in float32 (float64 for a float64 dtype).
    """
    xp = xp_of(G)
    r = _Rounding(xp, np.dtype(dtype) if dtype is not None else ns_compute_dtype("standard"))
    X = r(G)
    tall = G.shape[-2] > G.shape[-1]
    if tall:
        X = X.T
    X = _normalize(xp, X, r)
    X = _quintic_steps(X, steps, r)
    return X.T if tall else X


def zeropower_via_gram_newtonschulz(G: Any, steps: int = NS_STEPS, dtype: Any = None) -> Any:
    """The same orthogonalization, iterating on the n × n Gram matrix R = X·Xᵀ instead of the
    n × m matrix X (Dao 2026, "Gram Newton–Schulz"; DeepSpeed's default method). With
    Z = b·R + c·R·R the step X ← (a·I + Z)·X becomes Q ← a·Q + Z·Q on the accumulated factor Q,
    and R ← (a·I + Z)·R·(a·I + Z); at step 2 X is rebuilt as Q·X (a restart that keeps the
    iteration stable in low precision). A square X takes the standard iteration.

    G is normalised in its own dtype (float32 for float16), then cast to ``dtype`` (default
    float32, DeepSpeed's choice without fp16 matrix products). A bfloat16 G is normalised as
    torch.compile does it: the norm and the quotient in float32, the quotient rounded once to
    bfloat16.
    """
    xp = xp_of(G)
    r = _Rounding(xp, np.dtype(dtype) if dtype is not None else ns_compute_dtype("gram"))
    a, b, c = NS_COEFFICIENTS
    own = DTYPES["float32"] if G.dtype == DTYPES["float16"] else G.dtype
    X = xp.astype(G, DTYPES["float32"] if own == DTYPES["bfloat16"] else own)
    tall = G.shape[-2] > G.shape[-1]
    if tall:
        X = X.T
    n, m = X.shape
    X = _normalize(xp, X)
    if own == DTYPES["bfloat16"]:
        X = xp.astype(xp.astype(X, own), DTYPES["float32"])
    X = r(X)
    if m <= n:  # square: no saving, the standard iteration
        X = _quintic_steps(X, steps, r)
        return X.T if tall else X
    R = r.matmul(X, X.T)
    Q = None
    for i in range(steps):
        if i == GRAM_RESTART:
            X = r.matmul(Q, X)
            R = r.matmul(X, X.T)
            Q = None
        Z = r.add(r.scale(b, R), r.matmul(r.scale(c, R), R))
        if Q is None:
            Q = Z + xp.eye(n, dtype=Z.dtype) * Z.dtype.type(a)  # Z with a added on the diagonal
            Q = r(Q)
        else:
            Q = r.add(r.scale(a, Q), r.matmul(Z, Q))
        if i < steps - 1 and i + 1 != GRAM_RESTART:
            RZ = r.add(r.scale(a, R), r.matmul(Z, R))
            R = r.add(r.scale(a, RZ), r.matmul(Z, RZ))
    return r.matmul(X.T, Q.T) if tall else r.matmul(Q, X)


def aspect_ratio_scale(rows: int, cols: int) -> float:
    """√(rows/cols) for a tall matrix, else 1: the orthogonalized update's scale (DeepSpeed's
    ``_aspect_ratio_scale``)."""
    return math.sqrt(rows / cols) if rows > cols else 1.0


def _lerp(start: Any, end: Any, weight: float) -> Any:
    """torch.lerp(start, end, weight) as DeepSpeed's compiled ``muon_update`` computes it on a
    CPU: start + (end − start)·w, with w rounded once to the arrays' dtype (for w ≥ 0.5 torch
    writes end + (start − end)·(1 − w); the compiled kernel, end + (end − start)·(w − 1), the
    same up to the last bit). 16-bit arrays are computed in float32 and rounded once, as
    torch's kernels compute them."""
    dtype = start.dtype
    if dtype in (DTYPES["bfloat16"], DTYPES["float16"]):
        xp, f32 = xp_of(start), DTYPES["float32"]
        out = _lerp(xp.astype(start, f32), xp.astype(end, f32), weight)
        return xp.astype(out, dtype)
    t = dtype.type
    if abs(weight) < 0.5:
        return start + (end - start) * t(weight)
    return end + (end - start) * t(weight - 1)


def muon_update(
    grad: Any,
    momentum: Any,
    *,
    beta: float = 0.95,
    ns_steps: int = NS_STEPS,
    nesterov: bool = True,
    ns_method: str = "gram",
) -> Any:
    """Muon's update of one matrix; ``momentum`` is updated in place, ``grad`` only read.

    With μ = ``momentum``, g = ``grad`` and β = ``beta`` (DeepSpeed's ``muon_update``)::

        μ ← μ + (1 − β)·(g − μ)                    (torch.lerp)
        d = g + β·(μ − g)   (nesterov)   or   μ
        update = NS(d) · √max(1, rows/cols)         NS: ``ns_method``'s Newton–Schulz

    returned in grad's dtype. A gradient holding inf or nan leaves μ unchanged and is returned
    as it is, so the overflow is still seen and the step skipped (DeepSpeed's guard).
    """
    if grad.ndim != 2 or grad.shape != momentum.shape:
        raise ValueError(
            f"Muon updates 2-D matrices; got a gradient of shape {tuple(grad.shape)} and a "
            f"momentum of shape {tuple(momentum.shape)}"
        )
    xp = xp_of(grad)
    if not bool(xp.all(xp.isfinite(grad))):
        return grad.copy()
    momentum[...] = _lerp(momentum, xp.astype(grad, momentum.dtype), 1 - beta)
    d = _lerp(xp.astype(grad, momentum.dtype), momentum, beta) if nesterov else momentum
    dtype = ns_compute_dtype(ns_method)
    if ns_method == "gram":
        update = zeropower_via_gram_newtonschulz(d, steps=ns_steps, dtype=dtype)
    else:
        update = zeropower_via_newtonschulz5(d, steps=ns_steps, dtype=dtype)
    scale = aspect_ratio_scale(grad.shape[-2], grad.shape[-1])
    if scale != 1.0:  # ``update *= scale``: the product is rounded to the compute dtype
        update = _Rounding(xp, dtype).scale(scale, update)
    return xp.astype(update, grad.dtype)


def muon(
    param: Any,
    grad: Any,
    momentum_buffer: Any,
    *,
    lr: float,
    momentum: float = 0.95,
    weight_decay: float = 0.0,
    ns_method: str = "gram",
    ns_steps: int = NS_STEPS,
) -> None:
    """One Muon step of a matrix parameter, in place (DeepSpeed's ``MuonWithAuxAdam.step``)::

    θ ← θ·(1 − lr·λ) − lr·muon_update(g, μ)
    """
    update = muon_update(
        grad, momentum_buffer, beta=momentum, ns_steps=ns_steps, ns_method=ns_method
    )
    muon_apply(param, update, lr=lr, weight_decay=weight_decay)


def muon_apply(param: Any, update: Any, *, lr: float, weight_decay: float = 0.0) -> None:
    """θ ← θ·(1 − lr·λ) − lr·update, in place: the step once the update is made (under ZeRO,
    each owner applies the slice of the update it owns)."""
    xp = xp_of(param)
    t = param.dtype.type if param.dtype in (DTYPES["float32"], DTYPES["float64"]) else np.float32
    if weight_decay != 0:
        param[...] = param * t(1 - lr * weight_decay)
    param[...] = param - t(lr) * xp.astype(update, param.dtype)
