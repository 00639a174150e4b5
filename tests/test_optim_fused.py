"""The fused path of the update rules (zerosim.optim.functional.fused, numba's kernels).

What the parity files do not show: when a rule takes the fused path and when NumPy's, the
switch (ZEROSIM_FUSED, set_fused), that both paths give the same numbers for every rule and
flag (including the rules without a torch twin), non-finite values included, that numba is
imported only at the first fused step, and that the ZeRO engine's shard update takes it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from engine_cases import Case, max_rel_error, train

import zerosim as zs
import zerosim.optim as zo
from zerosim.optim.functional import fused

pytestmark = pytest.mark.skipif(not fused.numba_available(), reason="numba is not installed")


class Param:
    def __init__(self, data):
        self.data = data
        self.grad = None


@pytest.fixture
def kernel_calls(monkeypatch):
    """The list of kernels ``fused.run`` is asked to call, by name, during the test."""
    calls = []
    run = fused.run

    def spy(kernel, *args, **kwargs):
        calls.append(kernel.py_func.__name__)
        return run(kernel, *args, **kwargs)

    monkeypatch.setattr(fused, "run", spy)
    return calls


# --- the switch ----------------------------------------------------------------------------


def test_environment_variable_zero_selects_numpy_and_set_fused_wins_over_it(monkeypatch):
    with fused.use_fused(None):  # follow the environment
        monkeypatch.setenv(fused.ENV_VAR, "0")
        assert not fused.fused_enabled()
        monkeypatch.setenv(fused.ENV_VAR, "1")
        assert fused.fused_enabled()
        monkeypatch.delenv(fused.ENV_VAR)
        assert fused.fused_enabled()
        monkeypatch.setenv(fused.ENV_VAR, "0")
        with fused.use_fused(True):
            assert fused.fused_enabled()
        assert not fused.fused_enabled()


def test_unknown_environment_value_is_rejected_with_the_allowed_ones(monkeypatch):
    monkeypatch.setenv(fused.ENV_VAR, "yes")
    with fused.use_fused(None), pytest.raises(ValueError, match="ZEROSIM_FUSED='yes'.*'0'"):
        fused.fused_enabled()


def test_set_fused_true_without_numba_names_the_extra(monkeypatch):
    monkeypatch.setattr(fused, "numba_available", lambda: False)
    with pytest.raises(ImportError, match=r"zerosim\[fast\]"):
        fused.set_fused(True)
    with pytest.raises(ValueError, match="allowed values are True, False, None"):
        fused.set_fused("on")


@pytest.mark.slow
def test_import_zerosim_leaves_numba_unimported_until_the_first_fused_step():
    code = (
        "import sys, numpy as np, zerosim, zerosim.optim as zo\n"
        "before = 'numba' in sys.modules\n"
        "class P: pass\n"
        "p = P(); p.data = np.zeros(4); p.grad = np.ones(4)\n"
        "zo.Adam([p]).step()\n"
        "print(before, 'numba' in sys.modules)\n"
    )
    env = {**os.environ, fused.ENV_VAR: "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.split() == ["False", "True"]


# --- which arrays take the fused path ------------------------------------------------------


def test_contiguous_numpy_arrays_take_one_kernel_call_per_parameter(kernel_calls):
    params = [Param(np.zeros((3, 4))), Param(np.zeros(5, np.float32))]
    for p in params:
        p.grad = np.ones_like(p.data)
    with fused.use_fused(True):
        zo.Adam(params, amsgrad=True).step()
        zo.SGD(params, lr=0.1, momentum=0.9).step()
        zo.RMSprop(params, momentum=0.5, centered=True).step()
    expected = ["adam_amsgrad", "sgd_momentum", "rmsprop_centered_momentum"]
    assert kernel_calls == [name for name in expected for _ in params]


def test_strided_views_keras_adam_and_the_switch_take_the_numpy_path(kernel_calls):
    strided = Param(np.zeros((6, 5)).T)
    strided.grad = np.ones((5, 6))
    plain = Param(np.zeros(8))
    plain.grad = np.ones(8)
    with fused.use_fused(True):
        zo.Adam([strided]).step()
        zo.Adam([plain], variant="keras").step()
    with fused.use_fused(False):
        zo.Adam([plain]).step()
    assert kernel_calls == []
    assert not fused.applies(np.zeros(4), np.zeros(4), np.zeros(8)[::2])


def test_arrays_other_than_numpy_take_their_own_path():
    xps = pytest.importorskip("array_api_strict")
    a = xps.asarray([1.0, 2.0])
    with fused.use_fused(True):
        assert not fused.applies(a, a, a)
        assert fused.applies(np.zeros(2), np.zeros(2), None)


# --- both paths give the same numbers --------------------------------------------------------

RULES = [
    ("SGD", {"lr": 0.05}),
    ("SGD", {"lr": 0.05, "momentum": 0.9, "dampening": 0.3, "weight_decay": 0.01}),
    ("SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "maximize": True}),
    ("Adam", {"lr": 0.01, "weight_decay": 0.01}),
    ("Adam", {"lr": 0.01, "betas": (0.2, 0.9), "amsgrad": True, "maximize": True}),
    ("AdamW", {"lr": 0.01, "amsgrad": True}),
    ("Adam", {"lr": 0.01, "variant": "keras"}),
    ("Adagrad", {"lr": 0.05, "lr_decay": 0.01, "weight_decay": 0.01, "maximize": True}),
    ("RMSprop", {"lr": 0.01}),
    ("RMSprop", {"lr": 0.01, "momentum": 0.5, "weight_decay": 0.01}),
    ("RMSprop", {"lr": 0.01, "centered": True, "alpha": 0.3}),
    ("RMSprop", {"lr": 0.01, "centered": True, "momentum": 0.5, "maximize": True}),
    ("Adamax", {"lr": 0.01, "weight_decay": 0.01}),
    ("Adamax", {"lr": 0.01, "betas": (0.3, 0.99), "variant": "keras", "maximize": True}),
    ("NAdam", {"lr": 0.01, "weight_decay": 0.01}),
    ("NAdam", {"lr": 0.01, "weight_decay": 0.01, "decoupled_weight_decay": True}),
    ("RAdam", {"lr": 0.01, "weight_decay": 0.01, "maximize": True}),  # ρ_t > 5 from step 6
    ("RAdam", {"lr": 0.01, "weight_decay": 0.01, "decoupled_weight_decay": True}),
    ("Lion", {"lr": 0.01, "weight_decay": 0.1}),
    ("Lion", {"lr": 0.01, "betas": (0.3, 0.99), "maximize": True}),
]


def rule_id(rule):
    name, kw = rule
    flags = [k if v is True else f"{k}={v}" for k, v in kw.items() if k not in ("lr",)]
    return "-".join([name, *flags]).replace(" ", "")


def run_steps(name, kwargs, init, grads, enabled):
    p = Param(init.copy())
    opt = getattr(zo, name)([p], **kwargs)
    with fused.use_fused(enabled):
        for g in grads:
            p.grad = g
            opt.step()
    return p, opt


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("rule", RULES, ids=[rule_id(r) for r in RULES])
def test_fused_and_numpy_paths_agree_for_every_rule(rule, dtype):
    name, kwargs = rule
    rng = np.random.default_rng(0)
    n = 1031  # the kernels' vector loop and its scalar remainder
    init = rng.standard_normal(n).astype(dtype)
    grads = [rng.standard_normal(n).astype(dtype) for _ in range(25)]
    fast, fast_opt = run_steps(name, kwargs, init, grads, True)
    slow, slow_opt = run_steps(name, kwargs, init, grads, False)
    # float32: the paths round differently (torch's order against NumPy's), a few ulps a step
    rtol = 1e-12 if dtype == np.float64 else 2e-6
    scale = float(np.abs(slow.data).max())
    np.testing.assert_allclose(fast.data, slow.data, rtol=rtol, atol=rtol * scale)
    assert fast.data.dtype == dtype
    for key, value in slow_opt.state[slow].items():
        if isinstance(value, np.ndarray):
            ref = float(np.abs(value).max())
            got = fast_opt.state[fast][key]
            np.testing.assert_allclose(got, value, rtol=rtol, atol=rtol * ref, err_msg=key)


@pytest.mark.parametrize("rule", RULES, ids=[rule_id(r) for r in RULES])
def test_nan_and_inf_reach_the_same_elements_on_both_paths(rule):
    name, kwargs = rule
    rng = np.random.default_rng(1)
    init = rng.standard_normal(40)
    grads = [rng.standard_normal(40) for _ in range(3)]
    grads[1][[3, 17]] = np.nan
    grads[1][[5, 29]] = [np.inf, -np.inf]
    with np.errstate(invalid="ignore", over="ignore"):  # NumPy warns about inf − inf
        fast, _ = run_steps(name, kwargs, init, grads, True)
        slow, _ = run_steps(name, kwargs, init, grads, False)
    np.testing.assert_array_equal(np.isnan(fast.data), np.isnan(slow.data))
    np.testing.assert_array_equal(np.isinf(fast.data), np.isinf(slow.data))


def test_two_runs_of_the_fused_path_are_bitwise_equal():
    rng = np.random.default_rng(2)
    init = rng.standard_normal(5000).astype(np.float32)
    grads = [rng.standard_normal(5000).astype(np.float32) for _ in range(5)]
    a, _ = run_steps("AdamW", {"amsgrad": True}, init, grads, True)
    b, _ = run_steps("AdamW", {"amsgrad": True}, init, grads, True)
    np.testing.assert_array_equal(a.data, b.data)


# --- the ZeRO engine's shard update ----------------------------------------------------------


@pytest.mark.parametrize("stage", [1, 3])
def test_engine_shard_update_takes_the_fused_kernels_and_matches_numpy(stage, kernel_calls):
    case = Case(stage=stage, steps=4)
    with fused.use_fused(True):
        fast = zs.LocalWorld(2).run(train, case)[0]["params"]
    assert set(kernel_calls) == {"adam"}  # DeepSpeed's Adam section: AdamW, one flat shard
    with fused.use_fused(False):
        slow = zs.LocalWorld(2).run(train, case)[0]["params"]
    assert max_rel_error(fast, slow) <= 1e-12


def test_the_switch_also_takes_cupy_arrays_off_the_elementwise_kernels():
    """set_fused(False) / ZEROSIM_FUSED=0 choose the element-wise path on CuPy too, so that
    path stays reachable (and testable against the kernels) on a GPU."""
    from types import SimpleNamespace

    from zerosim.optim.functional import cupy_kernels
    from zerosim.optim.functional.fused import use_fused

    class CupyLike:
        dtype = np.dtype(np.float32)
        flags = SimpleNamespace(c_contiguous=True)

    CupyLike.__module__ = "cupy._core.core"
    p, g = CupyLike(), CupyLike()
    with use_fused(None):
        assert cupy_kernels.applies(p, g)
    with use_fused(False):
        assert not cupy_kernels.applies(p, g)
    assert not cupy_kernels.applies(np.ones(2, np.float32), np.ones(2, np.float32))
