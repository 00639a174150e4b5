"""zerosim.optim.Lamb and functional.lamb against DeepSpeed's FusedLamb kernel.

FusedLamb is CUDA-only, so the oracle is ``kernel_step`` below: DeepSpeed 0.19.8's
``csrc/lamb/fused_lamb_cuda_kernel.cu`` written out element by element in NumPy scalars of the
parameter's dtype (``lamb_cuda_kernel_part1`` → the two sums, ``part2`` → their total, ``part3``
→ the coefficient and the step; the host code's ``step_size``). It shares no code with zerosim.
Bounds: float64 1e-12 relative, float32 1e-6 (a float32 sum of squares in another order).
The trust ratio's clamps are also checked by hand, without any oracle.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import zerosim.optim as zo
from zerosim.optim import functional as F


def kernel_step(p, m, v, g, *, lr, beta1, beta2, max_coeff, min_coeff, eps, grad_scale, step,
                mode, bias_correction, decay, host=np.float32):  # fmt: skip
    """One ``fused_lamb_cuda`` call on flat arrays, in place; returns lamb_coeff.

    ``mode`` 0: eps under the square root (ADAM_MODE_0), 1: outside (ADAM_MODE_1). ``host`` is
    the type of the scalars the host passes (lr, betas, eps, decay, step_size, lamb_coeff):
    float in DeepSpeed. zerosim's float64 reference precision keeps them in float64 (a
    deliberate difference of ~1e-8 relative, docs/optim.md), so float64 runs pass float64.
    """
    T = p.dtype.type  # the kernel's T (float for fp32 tensors, double for fp64)
    f = host
    b1, b2, eps_, decay_, scale_ = (T(f(x)) for x in (beta1, beta2, eps, decay, grad_scale))
    # host: step_size (float); std::pow(float, int) is computed in double
    if bias_correction == 1:
        bias_correction1 = f(1 - math.pow(float(f(beta1)), step))
        bias_correction2 = f(1 - math.pow(float(f(beta2)), step))
        step_size = f(f(lr) * np.sqrt(bias_correction2)) / bias_correction1
    else:
        step_size = f(lr)
    # part1: moments, update, sums of squares
    reg_w, reg_u = T(0), T(0)
    for j in range(p.size):
        scaled_grad = g[j] / scale_
        pj = p[j]
        m[j] = b1 * m[j] + (1 - b1) * scaled_grad
        v[j] = b2 * v[j] + (1 - b2) * scaled_grad * scaled_grad
        denom = np.sqrt(v[j] + eps_) if mode == 0 else np.sqrt(v[j]) + eps_
        update = (m[j] / denom) + (decay_ * p[j])
        reg_u += update * update
        reg_w += pj * pj
    # part3: coefficient and step
    reg_w, reg_u = np.sqrt(reg_w), np.sqrt(reg_u)
    lamb_coeff = 1.0
    if reg_w != 0 and reg_u != 0:
        lamb_coeff = reg_w / reg_u
        if lamb_coeff > max_coeff:
            lamb_coeff = max_coeff
        if lamb_coeff < min_coeff:
            lamb_coeff = min_coeff
    for j in range(p.size):
        pj = p[j]
        denom = np.sqrt(v[j] + eps_) if mode == 0 else np.sqrt(v[j]) + eps_
        update = (m[j] / denom) + (decay_ * pj)
        p[j] = pj - (T(step_size) * T(lamb_coeff) * update)
    return float(lamb_coeff)


SETTINGS = [
    {},
    {"weight_decay": 0.01},
    {"eps_inside_sqrt": True, "weight_decay": 0.1},
    {"bias_correction": False},
    {"max_coeff": 0.2},  # the ratio of these parameters is ~0.3: clamped from above
    {"min_coeff": 0.5, "max_coeff": 10.0},  # clamped from below
    {"eps": 1e-3, "betas": (0.8, 0.95)},
]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("settings", SETTINGS, ids=[str(s) for s in SETTINGS])
def test_lamb_equals_deepspeeds_kernel_written_out(dtype, settings):
    rng = np.random.default_rng(7)
    hyper = {
        "lr": 0.01,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.0,
        "bias_correction": True,
        "eps_inside_sqrt": False,
        "max_coeff": 10.0,
        "min_coeff": 0.01,
    }
    hyper.update(settings)
    p = rng.normal(size=37).astype(dtype)
    ref_p, ref_m, ref_v = p.copy(), np.zeros_like(p), np.zeros_like(p)
    m, v = F.zeros_state(p), F.zeros_state(p)
    rtol = 1e-12 if dtype == np.float64 else 1e-6
    for t in range(1, 6):
        g = rng.normal(size=37).astype(dtype) * 10.0**t  # gradients of growing size
        want = kernel_step(
            ref_p, ref_m, ref_v, g,
            lr=hyper["lr"], beta1=hyper["betas"][0], beta2=hyper["betas"][1],
            max_coeff=hyper["max_coeff"], min_coeff=hyper["min_coeff"], eps=hyper["eps"],
            grad_scale=1.0, step=t, mode=0 if hyper["eps_inside_sqrt"] else 1,
            bias_correction=int(hyper["bias_correction"]), decay=hyper["weight_decay"],
            host=np.float32 if dtype == np.float32 else np.float64,
        )  # fmt: skip
        got = F.lamb(
            p,
            g,
            m,
            v,
            step=t,
            lr=hyper["lr"],
            beta1=hyper["betas"][0],
            beta2=hyper["betas"][1],
            eps=hyper["eps"],
            weight_decay=hyper["weight_decay"],
            bias_correction=hyper["bias_correction"],
            eps_inside_sqrt=hyper["eps_inside_sqrt"],
            max_coeff=hyper["max_coeff"],
            min_coeff=hyper["min_coeff"],
        )
        assert got == pytest.approx(want, rel=rtol)
        for name, a, b in (("param", p, ref_p), ("exp_avg", m, ref_m), ("exp_avg_sq", v, ref_v)):
            np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(b).max(), err_msg=name)
    if "max_coeff" in settings and "min_coeff" not in settings:
        assert want == pytest.approx(0.2)  # the case really clamped
    if "min_coeff" in settings:
        assert want == 0.5


def test_a_scaled_gradient_is_divided_by_grad_scale_as_in_the_kernel():
    """FP16_UnfusedOptimizer's fused-LAMB path hands the kernel the scaled gradient and the
    scale: the step equals that of the unscaled gradient."""
    rng = np.random.default_rng(3)
    p = rng.normal(size=20)
    g = rng.normal(size=20)
    p1, p2 = p.copy(), p.copy()
    s1 = [F.zeros_state(p), F.zeros_state(p)]
    s2 = [F.zeros_state(p), F.zeros_state(p)]
    hyper = {"step": 1, "lr": 0.1, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}
    F.lamb(p1, g, *s1, **hyper)
    F.lamb(p2, g * 1024.0, *s2, **hyper, grad_scale=1024.0)
    np.testing.assert_allclose(p2, p1, rtol=1e-15)


# -- the trust ratio by hand ------------------------------------------------------------------


def test_trust_ratio_is_the_ratio_of_the_norms_inside_the_clamps():
    assert F.trust_ratio(3.0, 4.0, max_coeff=10.0, min_coeff=0.01) == 0.75
    assert F.trust_ratio(100.0, 1.0, max_coeff=10.0, min_coeff=0.01) == 10.0
    assert F.trust_ratio(1.0, 1000.0, max_coeff=10.0, min_coeff=0.01) == 0.01


def test_trust_ratio_is_one_when_either_norm_is_zero():
    assert F.trust_ratio(0.0, 5.0, max_coeff=10.0, min_coeff=0.5) == 1.0
    assert F.trust_ratio(5.0, 0.0, max_coeff=0.5, min_coeff=0.01) == 1.0


def test_min_coeff_wins_when_it_exceeds_max_coeff_as_in_the_kernel():
    """The kernel clamps to max_coeff first, then to min_coeff."""
    assert F.trust_ratio(1.0, 1.0, max_coeff=0.1, min_coeff=0.2) == 0.2


@pytest.mark.parametrize(("max_coeff", "min_coeff", "ratio"), [(10.0, 0.01, None), (1.0, 0.01, 1.0),
                                                               (10.0, 5.0, 5.0)])  # fmt: skip
def test_first_step_moves_every_element_by_lr_times_the_trust_ratio(max_coeff, min_coeff, ratio):
    """By hand, with ε = 0 and no decay: after one step m/√v = (1 − β₁)/√(1 − β₂)·sign(g), the
    step size lr·√(1 − β₂)/(1 − β₁) cancels those factors, so θ moves by lr·r·sign(g), where
    r = ‖θ‖/‖u‖ = 5 / (√2·(1 − β₁)/√(1 − β₂)) for θ = (3, 4) unless clamped."""
    beta1, beta2, lr = 0.9, 0.999, 0.01
    p = np.array([3.0, 4.0])
    g = np.array([2.0, -0.5])
    r = 5.0 / (math.sqrt(2) * (1 - beta1) / math.sqrt(1 - beta2))
    want_r = r if ratio is None else ratio
    m, v = F.zeros_state(p), F.zeros_state(p)
    got_r = F.lamb(p, g, m, v, step=1, lr=lr, beta1=beta1, beta2=beta2, eps=0.0,
                   max_coeff=max_coeff, min_coeff=min_coeff)  # fmt: skip
    assert got_r == pytest.approx(want_r, rel=1e-14)
    np.testing.assert_allclose(p, [3.0 - lr * want_r, 4.0 + lr * want_r], rtol=1e-14)


def test_weight_decay_enters_the_update_and_so_its_norm():
    """u = m/√v + λθ: with a zero gradient (m = v = 0 after one step, ε > 0) u = λθ, so
    ‖θ‖/‖u‖ = 1/λ and θ moves by lr·(1/λ)·λθ·√(1 − β₂)/(1 − β₁): clamped at max_coeff here."""
    p = np.array([1.0, -2.0, 2.0])
    m, v = F.zeros_state(p), F.zeros_state(p)
    lam, lr = 0.5, 0.1
    got_r = F.lamb(p, np.zeros(3), m, v, step=1, lr=lr, beta1=0.9, beta2=0.99, eps=1e-6,
                   weight_decay=lam, max_coeff=10.0, min_coeff=0.01)  # fmt: skip
    assert got_r == pytest.approx(1 / lam, rel=1e-14)
    step_size = lr * math.sqrt(1 - 0.99) / (1 - 0.9)
    np.testing.assert_allclose(p, np.array([1.0, -2.0, 2.0]) * (1 - step_size), rtol=1e-14)


# -- the class ----------------------------------------------------------------------------------


class Param:
    def __init__(self, data):
        self.data = data
        self.grad = None


def test_class_steps_each_parameter_with_its_own_trust_ratio():
    rng = np.random.default_rng(0)
    shapes = [(4, 5), (5,), (3, 2)]
    params = [Param(rng.normal(size=s)) for s in shapes]
    twins = [p.data.copy() for p in params]
    states = [(F.zeros_state(t), F.zeros_state(t)) for t in twins]
    opt = zo.Lamb([{"params": params[:2]}, {"params": params[2:], "lr": 0.5}], lr=0.02,
                  weight_decay=0.01)  # fmt: skip
    for t in range(1, 4):
        want = []
        for k, p in enumerate(params):
            p.grad = rng.normal(size=p.data.shape)
            lr = 0.5 if k == 2 else 0.02
            want.append(F.lamb(twins[k], p.grad, *states[k], step=t, lr=lr, beta1=0.9,
                               beta2=0.999, eps=1e-8, weight_decay=0.01))  # fmt: skip
        opt.step()
        assert opt.coefficients == want
        for p, twin in zip(params, twins, strict=True):
            np.testing.assert_array_equal(p.data, twin)
    assert opt.state[params[0]]["step"] == 3.0
    assert sorted(opt.state[params[0]]) == ["exp_avg", "exp_avg_sq", "step"]


def test_state_dict_round_trip_continues_identically():
    rng = np.random.default_rng(1)
    a, b = Param(rng.normal(size=(6, 3))), Param(rng.normal(size=(6, 3)))
    b.data[...] = a.data
    grads = [rng.normal(size=(6, 3)) for _ in range(4)]
    opt_a = zo.Lamb([a], lr=0.05, eps_inside_sqrt=True)
    for g in grads[:2]:
        a.grad = g
        opt_a.step()
    opt_b = zo.Lamb([b], lr=0.05, eps_inside_sqrt=True)
    b.data[...] = a.data
    opt_b.load_state_dict(opt_a.state_dict())
    for g in grads[2:]:
        a.grad, b.grad = g, g
        opt_a.step()
        opt_b.step()
    np.testing.assert_array_equal(a.data, b.data)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1.0}, "lr"),
        ({"max_coeff": -0.5}, "max_coeff"),
        ({"min_coeff": float("nan")}, "min_coeff"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"eps_inside_sqrt": 1}, "eps_inside_sqrt"),
    ],
)
def test_bad_hyperparameters_are_refused_naming_them(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        zo.Lamb([Param(np.zeros(3))], **kwargs)
