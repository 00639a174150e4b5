"""Finite-difference check of a module's hand-written backward (float64, any backend).

For a random upstream gradient g, the objective f(θ, x) = Σ g ⊙ module(x) has
∂f/∂θ = the parameter gradient backward writes, and ∂f/∂x = what backward returns. The
central difference (f(θ + ε e_i) − f(θ − ε e_i)) / 2ε approximates each entry with error
O(ε²) + O(u/ε) (u = 2⁻⁵³), so ε = 1e-6 gives about 1e-10 relative in float64.
A module that draws random numbers (dropout) must be made deterministic first, e.g. with
a forward pre-hook that resets its ``rng``. Off NumPy, the perturbations are written into
the device arrays and each objective comes back to the host as one float.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zerosim.backend import from_host, to_host, xp_of
from zerosim.nn.functional import is_floating
from zerosim.nn.grad_mode import no_grad
from zerosim.nn.init import RngLike, as_generator
from zerosim.nn.module import Module


def relative_error(a: Any, b: Any) -> float:
    """‖a − b‖ / max(‖a‖, ‖b‖) (0 when both are 0)."""
    a, b = to_host(a).astype(np.float64), to_host(b).astype(np.float64)
    scale = max(np.linalg.norm(a), np.linalg.norm(b))
    return 0.0 if scale == 0 else float(np.linalg.norm(a - b) / scale)


def _central_differences(array: Any, objective: Any, eps: float) -> np.ndarray:
    flat = xp_of(array).reshape(array, (-1,))  # a view: perturbs ``array`` in place
    out = np.empty(flat.size)
    for i in range(flat.size):
        original = float(to_host(flat[i]))
        flat[i] = original + eps
        up = objective()
        flat[i] = original - eps
        down = objective()
        flat[i] = original
        out[i] = (up - down) / (2 * eps)
    return out.reshape(array.shape)


def gradcheck(
    module: Module, *inputs: Any, eps: float = 1e-6, rng: RngLike = 1234
) -> dict[str, float]:
    """Relative error of backward against central differences, per parameter name and
    per floating input (``"input0"``, …). Parameter gradients are reset first."""
    g = as_generator(rng)
    module.zero_grad()
    output = module(*inputs)
    xp = xp_of(output)
    upstream = from_host(g.standard_normal(tuple(output.shape)), like=output)  # float64
    grads = module.backward(xp.astype(upstream, output.dtype))
    grads = grads if isinstance(grads, tuple) else (grads,)

    def objective() -> float:
        with no_grad():
            return float(to_host(xp.sum(xp.astype(module(*inputs), np.float64) * upstream)))

    errors = {}
    for name, p in module.named_parameters():
        numerical = _central_differences(p.data, objective, eps)
        analytic = np.zeros(p.shape) if p.grad is None else p.grad
        errors[name] = relative_error(numerical, analytic)
    for i, x in enumerate(inputs):
        if hasattr(x, "dtype") and is_floating(x.dtype):
            errors[f"input{i}"] = relative_error(_central_differences(x, objective, eps), grads[i])
    return errors
