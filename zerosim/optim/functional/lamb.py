"""LAMB (You et al. 2020), as DeepSpeed's FusedLamb computes it: Adam's step scaled per parameter
by a trust ratio of two whole-parameter norms.

DeepSpeed's kernel (``csrc/lamb/fused_lamb_cuda_kernel.cu``) makes two passes over a parameter,
and so do these functions:

1. ``lamb_moments``: the moments, the update u (Adam's direction plus λ·θ) and two sums of
   squares, Σθ² and Σu² (the kernel's ``lamb_cuda_kernel_part1`` and ``part2``).
2. ``trust_ratio`` turns ‖θ‖ and ‖u‖ into the coefficient; ``lamb_apply`` recomputes u from the
   moments and steps θ (``part3``).

The pass is split because the coefficient needs the *whole* parameter's norms. On one process
``lamb`` runs the two passes back to back. Under ZeRO a rank may hold only a slice of a
parameter: it sums squares over its slice, the ranks add their sums (one all-reduce,
``zerosim/zero/lamb_norms.py``), and only then can anyone apply the step.

Hyperparameters are trusted here; the optimizer class (``zerosim.optim.Lamb``) validates them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from zerosim.backend import item
from zerosim.optim.functional.common import blocks, check_arrays, scalar, state_dtype, xp_of


def lamb_step_size(
    lr: float, beta1: float, beta2: float, step: float, bias_correction: bool, dtype: Any
) -> float:
    """The kernel's ``step_size``: lr·√(1 − β₂ᵗ)/(1 − β₁ᵗ) with bias correction, else lr.

    Computed in ``dtype`` (the state dtype), as the kernel does in float: the bias corrections
    are rounded to it, then lr·√(1 − β₂ᵗ) and the division.
    """
    t = np.dtype(dtype).type
    if not bias_correction:
        return float(t(lr))
    correction1 = t(1.0 - float(t(beta1)) ** step)
    correction2 = t(1.0 - float(t(beta2)) ** step)
    return float(t(t(lr) * np.sqrt(correction2)) / correction1)


def trust_ratio(
    weight_norm: float, update_norm: float, *, max_coeff: float, min_coeff: float
) -> float:
    """The LAMB coefficient of DeepSpeed's kernel: ‖θ‖/‖u‖ clamped to [min_coeff, max_coeff].

    1 when either norm is 0 (a zero parameter, or nothing to update). The clamps are applied
    in the kernel's order, max first, so min_coeff wins when min_coeff > max_coeff.
    """
    if weight_norm == 0 or update_norm == 0:
        return 1.0
    coeff = weight_norm / update_norm
    if coeff > max_coeff:
        coeff = max_coeff
    if coeff < min_coeff:
        coeff = min_coeff
    return float(coeff)


def _update_(xp: Any, p: Any, m: Any, v: Any, out: Any, tmp: Any, c: dict[str, Any]) -> Any:
    """u = m/denom + λ·θ into ``out``: denom = √v + ε, or √(v + ε) with eps_inside_sqrt."""
    if c["eps_inside_sqrt"]:
        xp.add(v, c["eps"], out=out)
        xp.sqrt(out, out=out)
    else:
        xp.sqrt(v, out=out)
        xp.add(out, c["eps"], out=out)
    xp.divide(m, out, out=out)
    if c["decays"]:
        xp.multiply(p, c["weight_decay"], out=tmp)
        xp.add(out, tmp, out=out)
    return out


def _coefficients(param: Any, eps: float, weight_decay: float, eps_inside_sqrt: bool) -> dict:
    return {
        "eps": scalar(eps, param),
        "weight_decay": scalar(weight_decay, param),
        "decays": float(weight_decay) != 0,
        "eps_inside_sqrt": bool(eps_inside_sqrt),
    }


def lamb_moments(
    param: Any,
    grad: Any,
    exp_avg: Any,
    exp_avg_sq: Any,
    *,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    eps_inside_sqrt: bool = False,
    grad_scale: float = 1.0,
    scratch: Any = None,
) -> tuple[float, float]:
    """Pass 1: update the moments; return (Σθ², Σu²) over these elements.

    With g = ``grad`` / ``grad_scale`` (the kernel divides a still-scaled gradient), m =
    ``exp_avg``, v = ``exp_avg_sq`` (neither bias-corrected: the correction is in the step
    size) and λ = ``weight_decay``::

        m ← β₁·m + (1 − β₁)·g
        v ← β₂·v + ((1 − β₂)·g)·g
        u = m/(√v + ε) + λ·θ           (eps_inside_sqrt: m/√(v + ε) + λ·θ)

    θ is not changed. The sums are over the elements given, so a slice of a parameter gives
    its partial sums; add those of every slice before taking the roots.
    """
    check_arrays(param, grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    xp = xp_of(param)
    c = _coefficients(param, eps, weight_decay, eps_inside_sqrt)
    t = state_dtype(param.dtype).type  # 1 − β in that dtype, of the rounded β, as the kernel
    beta1_, one_minus_beta1 = scalar(beta1, param), scalar(t(1) - t(beta1), param)
    beta2_, one_minus_beta2 = scalar(beta2, param), scalar(t(1) - t(beta2), param)
    scale = None if float(grad_scale) == 1.0 else scalar(grad_scale, param)
    weight_sq = update_sq = 0.0
    for p, g, (m, v), (g_buf, u, tmp) in blocks(param, grad, [exp_avg, exp_avg_sq], 3, scratch):
        if scale is not None:
            g = xp.divide(g, scale, out=g_buf)
        xp.multiply(g, one_minus_beta1, out=tmp)
        xp.multiply(m, beta1_, out=m)
        xp.add(m, tmp, out=m)
        xp.multiply(g, one_minus_beta2, out=tmp)
        xp.multiply(tmp, g, out=tmp)
        xp.multiply(v, beta2_, out=v)
        xp.add(v, tmp, out=v)
        _update_(xp, p, m, v, u, tmp, c)
        weight_sq += _sum_sq(xp, p)
        update_sq += _sum_sq(xp, u)
    return weight_sq, update_sq


def lamb_apply(
    param: Any,
    exp_avg: Any,
    exp_avg_sq: Any,
    *,
    step_size: float,
    coeff: float,
    eps: float,
    weight_decay: float = 0.0,
    eps_inside_sqrt: bool = False,
    scratch: Any = None,
) -> None:
    """Pass 2: θ ← θ − (step_size·coeff)·u, with u recomputed from the moments as in pass 1."""
    check_arrays(param, param, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    xp = xp_of(param)
    c = _coefficients(param, eps, weight_decay, eps_inside_sqrt)
    t = state_dtype(param.dtype).type
    scale = scalar(float(t(step_size) * t(coeff)), param)
    for p, _, (m, v), (u, tmp) in blocks(param, param, [exp_avg, exp_avg_sq], 2, scratch):
        _update_(xp, p, m, v, u, tmp, c)
        xp.multiply(u, scale, out=u)
        xp.subtract(p, u, out=p)


def lamb(
    param: Any,
    grad: Any,
    exp_avg: Any,
    exp_avg_sq: Any,
    *,
    step: float,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    bias_correction: bool = True,
    eps_inside_sqrt: bool = False,
    max_coeff: float = 10.0,
    min_coeff: float = 0.01,
    grad_scale: float = 1.0,
    scratch: Any = None,
) -> float:
    """One LAMB step of a whole parameter (You et al. 2020, "Large Batch Optimization for Deep
    Learning: Training BERT in 76 minutes", Alg. 2, in DeepSpeed FusedLamb's form)::

        m, v, u as in ``lamb_moments``
        r = clamp(‖θ‖/‖u‖, min_coeff, max_coeff)      (1 if either norm is 0)
        θ ← θ − lr·√(1 − β₂ᵗ)/(1 − β₁ᵗ) · r · u       (without bias correction: θ − lr·r·u)

    Returns r (DeepSpeed's ``get_lamb_coeffs`` reports it).
    """
    weight_sq, update_sq = lamb_moments(
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        eps_inside_sqrt=eps_inside_sqrt,
        grad_scale=grad_scale,
        scratch=scratch,
    )
    coeff = trust_ratio(
        math.sqrt(weight_sq), math.sqrt(update_sq), max_coeff=max_coeff, min_coeff=min_coeff
    )
    step_size = lamb_step_size(lr, beta1, beta2, step, bias_correction, state_dtype(param.dtype))
    lamb_apply(
        param,
        exp_avg,
        exp_avg_sq,
        step_size=step_size,
        coeff=coeff,
        eps=eps,
        weight_decay=weight_decay,
        eps_inside_sqrt=eps_inside_sqrt,
        scratch=scratch,
    )
    return coeff


def _sum_sq(xp: Any, x: Any) -> float:
    """Σ x² of a block as a Python float (BLAS's dot on NumPy)."""
    if xp is np:
        return float(np.vdot(x, x))
    return float(item(xp.sum(x * x)))
