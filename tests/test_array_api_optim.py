"""The update rules and the optimizer classes on Array API standard arrays held off the host.

Every case runs the same steps twice, on NumPy arrays and on array_api_strict arrays on
``Device("device1")`` (which refuse NumPy operands and ``numpy.asarray``, as GPU arrays do),
from the same initial values and gradients, and asserts that the results agree (float64:
within 1e-12 of the default NumPy path; float32: with the NumPy ufunc path, which the
standard path follows call for call) and that every array stayed on the device.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip(
    "array_api_strict",
    reason="array-api-strict (the stand-in device) is in the test extra",
)

from zerosim import optim  # noqa: E402
from zerosim.backend import from_host, get_backend, to_host  # noqa: E402
from zerosim.optim import functional as F  # noqa: E402
from zerosim.optim.functional.fused import use_fused  # noqa: E402

XP = get_backend("array_api_strict").xp
STEPS = 5

BETAS = {"beta1": 0.9, "beta2": 0.99, "eps": 1e-8}
# rule, number of state arrays, keyword arguments, the first ``step`` (None: takes no step)
RULES = {
    "adam": (F.adam, 2, {**BETAS, "lr": 1e-2}, 1),
    "adam_amsgrad_decay": (
        F.adam,
        3,
        {**BETAS, "lr": 1e-2, "amsgrad": True, "weight_decay": 0.1},
        1,
    ),
    "adamw_maximize": (
        F.adam,
        2,
        {
            **BETAS,
            "lr": 1e-2,
            "weight_decay": 0.1,
            "decoupled_weight_decay": True,
            "maximize": True,
        },
        1,
    ),
    "adam_keras": (F.adam, 2, {**BETAS, "lr": 1e-2, "variant": "keras"}, 1),
    "sgd": (F.sgd, 0, {"lr": 1e-2, "weight_decay": 0.1}, None),
    "sgd_momentum_dampening": (
        F.sgd,
        1,
        {"lr": 1e-2, "momentum": 0.9, "dampening": 0.2, "weight_decay": 0.1},
        None,
    ),
    "sgd_nesterov_maximize": (
        F.sgd,
        1,
        {"lr": 1e-2, "momentum": 0.9, "nesterov": True, "maximize": True},
        None,
    ),
    "adagrad": (F.adagrad, 1, {"lr": 1e-2, "lr_decay": 0.01, "weight_decay": 0.1}, 1),
    "adamax": (F.adamax, 2, {**BETAS, "lr": 1e-2, "weight_decay": 0.1}, 1),
    "adamax_keras": (F.adamax, 2, {**BETAS, "lr": 1e-2, "variant": "keras"}, 1),
    "nadam": (F.nadam, 2, {**BETAS, "lr": 1e-2, "weight_decay": 0.1, "mu_product": None}, 1),
    # from step 20 on ρ_t > 5: the rectified branch (the steps 1-5 of the others are not)
    "radam_rectified": (F.radam, 2, {**BETAS, "lr": 1e-2}, 20),
    "radam_decoupled": (
        F.radam,
        2,
        {**BETAS, "lr": 1e-2, "weight_decay": 0.1, "decoupled_weight_decay": True},
        1,
    ),
    "rmsprop": (F.rmsprop, 1, {"lr": 1e-2, "weight_decay": 0.1}, None),
    "rmsprop_centered_momentum": (
        F.rmsprop,
        3,
        {"lr": 1e-2, "momentum": 0.9, "centered": True},
        None,
    ),
    "lion": (F.lion, 1, {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1}, None),
}


def _on_device(x: Any) -> bool:
    return not isinstance(x, np.ndarray) and x.device == XP.device


def _run_rule(
    case: str, p0: np.ndarray, grads: list[np.ndarray], xp: Any, view: slice | None = None
) -> list[np.ndarray]:
    """``STEPS`` steps of a rule from ``p0``; returns the parameter and the state arrays.

    With ``view``, ``p0`` is a flat shard: the rule updates ``shard[view]`` in place with
    a scratch buffer made for the whole shard, as the ZeRO engine calls it.
    """
    rule, n_states, kwargs, first_step = RULES[case]
    kwargs = dict(kwargs)
    shard = from_host(p0.copy(), xp=xp)
    param = shard if view is None else shard[view]
    states = [F.zeros_state(param) for _ in range(n_states)]
    scratch = F.make_scratch(shard) if view is not None else None
    for t, g in enumerate(grads, 1):
        grad = from_host(g, xp=xp)
        if first_step is not None:
            kwargs["step"] = first_step + t - 1
        if rule is F.sgd:
            kwargs["first_step"] = t == 1
        if rule is F.nadam:
            kwargs["mu_product"] = kwargs["mu_product"] or 1.0
            kwargs["mu_product"] = rule(param, grad, *states, **kwargs, scratch=scratch)
        else:
            rule(param, grad, *states, **kwargs, scratch=scratch)
    if xp is not np:
        assert all(_on_device(a) for a in (shard, param, *states))
    return [to_host(a) for a in (shard, *states)]


@pytest.mark.parametrize("case", sorted(RULES))
def test_rule_on_strict_float64_equals_numpy(case: str) -> None:
    rng = np.random.default_rng(1)
    p0 = rng.standard_normal((4, 6))
    grads = [rng.standard_normal((4, 6)) for _ in range(STEPS)]
    want = _run_rule(case, p0, grads, np)  # the default path: numba's kernels when installed
    got = _run_rule(case, p0, grads, XP)
    assert not np.array_equal(want[0], p0)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("case", sorted(RULES))
def test_rule_on_strict_float32_equals_the_numpy_ufunc_path(case: str) -> None:
    rng = np.random.default_rng(2)
    p0 = rng.standard_normal(30).astype(np.float32)
    grads = [rng.standard_normal(30).astype(np.float32) for _ in range(STEPS)]
    with use_fused(False):
        want = _run_rule(case, p0, grads, np)
    got = _run_rule(case, p0, grads, XP)
    assert got[0].dtype == np.float32
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("case", ["adam_amsgrad_decay", "sgd_momentum_dampening", "nadam"])
def test_rule_on_a_slice_of_a_flat_strict_shard_with_scratch_equals_numpy(case: str) -> None:
    rng = np.random.default_rng(3)
    view = slice(7, 41)
    shard = rng.standard_normal(48)
    grads = [rng.standard_normal(view.stop - view.start) for _ in range(STEPS)]
    want = _run_rule(case, shard, grads, np, view)
    got = _run_rule(case, shard, grads, XP, view)
    np.testing.assert_array_equal(got[0][: view.start], shard[: view.start])  # outside: as was
    np.testing.assert_array_equal(got[0][view.stop :], shard[view.stop :])
    assert not np.array_equal(got[0][view], shard[view])
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-12)


def test_strict_scratch_of_the_wrong_dtype_is_refused() -> None:
    param = from_host(np.ones(8), xp=XP)
    scratch = XP.empty(F.SCRATCH_SLOTS * 8, dtype=np.float32)
    with pytest.raises(ValueError, match="scratch must be a contiguous 1-D array of dtype float64"):
        F.sgd(param, param, lr=0.1, scratch=scratch)


def test_strict_state_of_the_wrong_dtype_is_refused() -> None:
    param = from_host(np.ones(8), xp=XP)
    state = XP.zeros(8, dtype=np.float32)
    with pytest.raises(ValueError, match="exp_avg has shape"):
        F.lion(param, param, state, lr=0.1, beta1=0.9, beta2=0.99)


# --- the optimizer classes ------------------------------------------------------------------

OPTIMIZERS = {
    "SGD": (optim.SGD, {"lr": 0.1}),
    "SGD_momentum": (
        optim.SGD,
        {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01},
    ),
    "SGD_nesterov_maximize": (
        optim.SGD,
        {"lr": 0.1, "momentum": 0.9, "nesterov": True, "maximize": True},
    ),
    "Adam_amsgrad": (optim.Adam, {"lr": 0.01, "amsgrad": True, "weight_decay": 0.01}),
    "Adam_keras_maximize": (optim.Adam, {"lr": 0.01, "variant": "keras", "maximize": True}),
    "AdamW": (optim.AdamW, {"lr": 0.01}),
    "Adagrad": (optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.1}),
    "Adamax": (optim.Adamax, {"lr": 0.01, "weight_decay": 0.01}),
    "NAdam": (optim.NAdam, {"lr": 0.01, "weight_decay": 0.01, "decoupled_weight_decay": True}),
    "RAdam": (optim.RAdam, {"lr": 0.01, "betas": (0.9, 0.9)}),  # rectified from step 6
    "RMSprop": (optim.RMSprop, {"lr": 0.01, "momentum": 0.9, "centered": True}),
    "Lion": (optim.Lion, {"lr": 0.01, "weight_decay": 0.1}),
}


class _Param:
    """The least a parameter is: ``.data`` updated in place and ``.grad``."""

    def __init__(self, data: Any) -> None:
        self.data = data
        self.grad: Any = None


def _make(case: str, xp: Any, inits: list[np.ndarray]) -> tuple[Any, list[_Param]]:
    cls, kwargs = OPTIMIZERS[case]
    params = [_Param(from_host(a.copy(), xp=xp)) for a in inits]
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": kwargs["lr"] / 2}]
    return cls(groups, **kwargs), params


def _steps(opt: Any, params: list[_Param], grads: list[list[np.ndarray]], xp: Any) -> None:
    for step_grads in grads:
        opt.zero_grad(set_to_none=False)
        for p, g in zip(params, step_grads, strict=True):
            if p.grad is None:  # a copy: zero_grad(set_to_none=False) writes into it
                p.grad = from_host(g.copy(), xp=xp)
            else:
                p.grad[...] = from_host(g, xp=xp)
        opt.step()


def _state_arrays(opt: Any) -> list[Any]:
    return [v for s in opt.state.values() for v in s.values() if hasattr(v, "shape")]


@pytest.mark.parametrize("case", sorted(OPTIMIZERS))
def test_optimizer_on_strict_equals_numpy_through_a_state_dict_round_trip(case: str) -> None:
    rng = np.random.default_rng(4)
    inits = [rng.standard_normal(s) for s in [(3, 4), (5,), (2, 3)]]
    grads = [[rng.standard_normal(a.shape) for a in inits] for _ in range(STEPS + 2)]
    runs = {}
    for name, xp in (("numpy", np), ("strict", XP)):
        opt, params = _make(case, xp, inits)
        _steps(opt, params, grads[:STEPS], xp)
        # resume in a new optimizer from the state_dict, as a checkpoint load does
        resumed = type(opt)([{"params": params[:2]}, {"params": params[2:]}], **OPTIMIZERS[case][1])
        resumed.load_state_dict(opt.state_dict())
        _steps(resumed, params, grads[STEPS:], xp)
        runs[name] = (resumed, params)
    (np_opt, np_params), (st_opt, st_params) = runs["numpy"], runs["strict"]
    assert st_opt.param_groups[1]["lr"] == OPTIMIZERS[case][1]["lr"] / 2
    for want, got in zip(np_params, st_params, strict=True):
        assert _on_device(got.data) and _on_device(got.grad)
        np.testing.assert_allclose(to_host(got.data), want.data, rtol=0, atol=1e-12)
    np_states, st_states = _state_arrays(np_opt), _state_arrays(st_opt)
    assert len(np_states) == len(st_states)
    assert all(_on_device(a) for a in st_states)
    for want, got in zip(np_states, st_states, strict=True):
        np.testing.assert_allclose(to_host(got), want, rtol=0, atol=1e-12)
    for want, got in zip(np_opt.state.values(), st_opt.state.values(), strict=True):
        assert {k: v for k, v in got.items() if not hasattr(v, "shape")} == {
            k: v for k, v in want.items() if not hasattr(v, "shape")
        }


def test_a_numpy_state_dict_loads_into_a_strict_optimizer_across_the_host_line() -> None:
    rng = np.random.default_rng(5)
    inits = [rng.standard_normal(s) for s in [(3, 4), (5,), (2, 3)]]
    grads = [[rng.standard_normal(a.shape) for a in inits] for _ in range(4)]
    host_opt, host_params = _make("Adam_amsgrad", np, inits)
    _steps(host_opt, host_params, grads[:2], np)
    dev_opt, dev_params = _make("Adam_amsgrad", XP, [p.data for p in host_params])
    dev_opt.load_state_dict(host_opt.state_dict())
    assert all(_on_device(a) for a in _state_arrays(dev_opt))
    _steps(host_opt, host_params, grads[2:], np)
    _steps(dev_opt, dev_params, grads[2:], XP)
    for want, got in zip(host_params, dev_params, strict=True):
        np.testing.assert_allclose(to_host(got.data), want.data, rtol=0, atol=1e-12)
    # and back: the strict optimizer's state_dict loads into a NumPy one
    back, _ = _make("Adam_amsgrad", np, inits)
    back.load_state_dict(dev_opt.state_dict())
    assert all(isinstance(a, np.ndarray) for a in _state_arrays(back))


def test_zero_grad_on_strict_zeroes_in_place_or_drops_the_gradients() -> None:
    opt, params = _make("SGD_momentum", XP, [np.ones((2, 2)), np.ones(3), np.ones(1)])
    for p in params:
        p.grad = from_host(np.full(p.data.shape, 2.0), xp=XP)
    grads = [p.grad for p in params]
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is g and not np.any(to_host(g)) for p, g in zip(params, grads, strict=True))
    opt.zero_grad()
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize(
    "make", [optim.swa_utils.get_ema_multi_avg_fn, optim.swa_utils.get_swa_multi_avg_fn]
)
def test_weight_averaging_on_strict_equals_numpy(make: Any) -> None:
    rng = np.random.default_rng(6)
    avg0, cur = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    fn = make() if make is optim.swa_utils.get_swa_multi_avg_fn else make(0.9)
    host = avg0.copy()
    fn([host], [cur], 3)
    dev = from_host(avg0, xp=XP)
    fn([dev], [from_host(cur, xp=XP)], 3)
    assert _on_device(dev)
    np.testing.assert_array_equal(to_host(dev), host)
    # the closed forms (torch's swa_utils): EMA a + (1 − 0.9)(c − a); SWA a + (c − a)/(3 + 1)
    weight = 0.25 if make is optim.swa_utils.get_swa_multi_avg_fn else 1 - 0.9
    np.testing.assert_allclose(host, avg0 + weight * (cur - avg0), rtol=1e-12, atol=1e-15)


class _Model:
    """A duck-typed model of one parameter, as swa_utils reads models."""

    def __init__(self, w: Any) -> None:
        self.w = _Param(w)

    def named_parameters(self) -> list[tuple[str, Any]]:
        return [("w", self.w)]

    def named_modules(self) -> list[tuple[str, Any]]:
        return [("", self)]


def test_averaged_model_on_strict_equals_numpy_and_stays_on_device() -> None:
    rng = np.random.default_rng(7)
    weights = [rng.standard_normal((2, 5)) for _ in range(3)]
    results = []
    for xp in (np, XP):
        models = [_Model(from_host(w.copy(), xp=xp)) for w in weights]
        averaged = optim.swa_utils.AveragedModel(models[0])
        for m in models:
            averaged.update_parameters(m)
        results.append(averaged.module.w.data)
    assert _on_device(results[1])
    np.testing.assert_allclose(to_host(results[1]), np.mean(weights, axis=0), rtol=0, atol=1e-15)
    np.testing.assert_array_equal(to_host(results[1]), results[0])
