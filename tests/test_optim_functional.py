"""The update rules in zerosim.optim.functional: formulas without a torch twin, blocks, dtypes.

Lion and the Keras variants are checked against their formulas written out here in plain
numpy (Chen et al. 2023; Keras's Adam and Adamax), the block walk against an unblocked
run, 16-bit parameters against a float32 master copy rounded after every step. Every test
runs on both paths of the rules (the ``update_path`` fixture): numba's fused kernels and
NumPy's blocks; tests of the NumPy path's own machinery (blocks, scratch) force it.
"""

from __future__ import annotations

import tracemalloc

import ml_dtypes
import numpy as np
import pytest

import zerosim.optim as zo
from zerosim.optim import functional as F
from zerosim.optim.functional import common, fused


@pytest.fixture(autouse=True, scope="module", params=["fused", "numpy"])
def update_path(request):
    """Run every test of this file on the fused kernels, then on the NumPy blocks."""
    if request.param == "fused" and not fused.numba_available():
        pytest.skip("numba is not installed (pip install 'zerosim[fast]')")
    with fused.use_fused(request.param == "fused"):
        yield request.param


class Param:
    def __init__(self, data):
        self.data = data
        self.grad = None


def run_class(cls, init, grads, **kwargs):
    p = Param(init.copy())
    opt = cls([p], **kwargs)
    for g in grads:
        p.grad = g
        opt.step()
    return p, opt


def random_grads(shape, steps, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(steps)]


# --- Lion and the Keras variants against their formulas ----------------------------------


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("maximize", [False, True])
def test_lion_matches_the_update_formula_of_chen_et_al(dtype, maximize):
    lr, beta1, beta2, wd = 3e-3, 0.8, 0.95, 0.2
    init = np.random.default_rng(1).standard_normal(37).astype(dtype)
    grads = random_grads(37, 25, dtype)
    p_ref, m_ref = init.astype(np.float64), np.zeros(37)
    for g in grads:
        g = -g.astype(np.float64) if maximize else g.astype(np.float64)
        c = beta1 * m_ref + (1 - beta1) * g
        p_ref = p_ref - lr * (np.sign(c) + wd * p_ref)
        m_ref = beta2 * m_ref + (1 - beta2) * g
    p, opt = run_class(
        zo.Lion, init, grads, lr=lr, betas=(beta1, beta2), weight_decay=wd, maximize=maximize
    )
    rtol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(p.data, p_ref, rtol=rtol, atol=rtol)
    np.testing.assert_allclose(opt.state[p]["exp_avg"], m_ref, rtol=rtol, atol=rtol)
    assert set(opt.state[p]) == {"exp_avg"}


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("cls", [zo.Adam, zo.AdamW])
def test_keras_adam_adds_epsilon_to_the_uncorrected_root(amsgrad, cls):
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.99, 1e-3, 0.05
    init = np.random.default_rng(2).standard_normal(20)
    grads = random_grads(20, 30, seed=3)
    p_ref, m, v, v_hat = init.copy(), np.zeros(20), np.zeros(20), np.zeros(20)
    for t, g in enumerate(grads, start=1):
        if cls is zo.AdamW:
            p_ref = p_ref - lr * wd * p_ref  # decoupled decay, as keras.optimizers.AdamW
        else:
            g = g + wd * p_ref
        m = m + (g - m) * (1 - b1)
        v = v + (g * g - v) * (1 - b2)
        v_hat = np.maximum(v_hat, v)
        alpha = lr * np.sqrt(1 - b2**t) / (1 - b1**t)
        p_ref = p_ref - alpha * m / (np.sqrt(v_hat if amsgrad else v) + eps)
    p, _ = run_class(
        cls,
        init,
        grads,
        lr=lr,
        betas=(b1, b2),
        eps=eps,
        weight_decay=wd,
        amsgrad=amsgrad,
        variant="keras",
    )
    np.testing.assert_allclose(p.data, p_ref, rtol=1e-12, atol=1e-14)
    torch_style, _ = run_class(
        cls, init, grads, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, amsgrad=amsgrad
    )
    assert np.max(np.abs(torch_style.data - p_ref)) > 1e-6  # the variants really differ


def test_keras_adamax_adds_epsilon_outside_the_max():
    lr, b1, b2, eps = 2e-3, 0.9, 0.999, 0.05
    init = np.random.default_rng(4).standard_normal(16)
    grads = random_grads(16, 30, seed=5)
    p_ref, m, u = init.copy(), np.zeros(16), np.zeros(16)
    for t, g in enumerate(grads, start=1):
        m = m + (g - m) * (1 - b1)
        u = np.maximum(b2 * u, np.abs(g))
        p_ref = p_ref - lr / (1 - b1**t) * m / (u + eps)
    p, opt = run_class(zo.Adamax, init, grads, lr=lr, betas=(b1, b2), eps=eps, variant="keras")
    np.testing.assert_allclose(p.data, p_ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(opt.state[p]["exp_inf"], u, rtol=1e-12)
    torch_style, _ = run_class(zo.Adamax, init, grads, lr=lr, betas=(b1, b2), eps=eps)
    assert np.max(np.abs(torch_style.data - p_ref)) > 1e-6


# --- the block walk ------------------------------------------------------------------------

ALL_RULES = [
    (zo.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    (zo.Adam, {"lr": 0.01, "amsgrad": True, "weight_decay": 0.01, "maximize": True}),
    (zo.Adagrad, {"lr": 0.05, "weight_decay": 0.01}),
    (zo.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True, "weight_decay": 0.01}),
    (zo.Adamax, {"lr": 0.01, "weight_decay": 0.01}),
    (zo.NAdam, {"lr": 0.01, "weight_decay": 0.01}),
    (zo.RAdam, {"lr": 0.01, "weight_decay": 0.01}),
    (zo.Lion, {"lr": 0.01, "weight_decay": 0.01}),
]
RULE_IDS = [cls.__name__ for cls, _ in ALL_RULES]


@pytest.mark.parametrize(("cls", "kwargs"), ALL_RULES, ids=RULE_IDS)
def test_blocks_of_7_elements_give_bitwise_the_unblocked_result(cls, kwargs, monkeypatch):
    init = np.random.default_rng(6).standard_normal((9, 11))
    grads = random_grads((9, 11), 12, seed=7)
    whole, _ = run_class(cls, init, grads, **kwargs)
    monkeypatch.setattr(common, "CPU_BLOCK_LENGTH", 7)
    assert F.block_length(init) == 7
    blocked, _ = run_class(cls, init, grads, **kwargs)
    np.testing.assert_array_equal(blocked.data, whole.data)


@pytest.mark.parametrize(("cls", "kwargs"), ALL_RULES, ids=RULE_IDS)
def test_non_contiguous_parameter_is_updated_in_place_like_a_contiguous_one(
    cls, kwargs, monkeypatch
):
    monkeypatch.setattr(common, "CPU_BLOCK_LENGTH", 7)  # parameter larger than scratch
    init = np.random.default_rng(8).standard_normal((6, 5))
    grads = random_grads((6, 5), 10, seed=9)
    ref, _ = run_class(cls, init, grads, **kwargs)
    storage = init.T.copy()  # (5, 6), C-contiguous; its transpose is a strided (6, 5) view
    p = Param(storage.T)
    opt = cls([p], **kwargs)
    for g in grads:
        p.grad = np.asfortranarray(g)
        opt.step()
    np.testing.assert_allclose(storage.T, ref.data, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize(("cls", "kwargs"), ALL_RULES, ids=RULE_IDS)
def test_a_shard_view_is_updated_in_place_and_its_gradient_left_alone(cls, kwargs):
    flat = np.arange(100, dtype=np.float32) / 100
    before = flat.copy()
    shard = Param(flat[30:70])  # what the ZeRO engine hands over: a slice of a flat buffer
    grad = np.random.default_rng(10).standard_normal(40).astype(np.float32)
    shard.grad = grad.copy()
    cls([{"params": [shard]}], **kwargs).step()
    assert np.shares_memory(shard.data, flat)
    assert np.all(flat[30:70] != before[30:70])
    np.testing.assert_array_equal(flat[:30], before[:30])
    np.testing.assert_array_equal(flat[70:], before[70:])
    np.testing.assert_array_equal(shard.grad, grad)


# --- 16-bit parameters keep float32 state ---------------------------------------------------


@pytest.mark.parametrize("half", [np.float16, ml_dtypes.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize(("cls", "kwargs"), ALL_RULES, ids=RULE_IDS)
def test_half_parameter_steps_like_float32_master_rounded_after_each_step(cls, kwargs, half):
    init = np.random.default_rng(11).standard_normal(50).astype(half)
    grads = random_grads(50, 8, np.float32, seed=12)
    p = Param(init.copy())
    opt = cls([p], **kwargs)
    master = Param(init.astype(np.float32))
    ref = cls([master], **kwargs)
    for g in grads:
        p.grad, master.grad = g.astype(half), g.astype(half).astype(np.float32)
        opt.step()
        ref.step()
        master.data[...] = master.data.astype(half).astype(np.float32)
    assert p.data.dtype == np.dtype(half)
    np.testing.assert_array_equal(p.data.astype(np.float32), master.data)
    for key in opt.state_keys(opt.param_groups[0]):
        assert opt.state[p][key].dtype == np.float32
        np.testing.assert_array_equal(opt.state[p][key], ref.state[master][key])


# --- memory: no full-size temporaries -------------------------------------------------------


@pytest.mark.parametrize("rule", ["adam", "nadam", "rmsprop"])
def test_rules_allocate_no_full_size_temporaries(rule):
    n = 2**21
    rng = np.random.default_rng(13)
    param, grad = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n)
    grad = grad.astype(np.float32)
    s1, s2, s3 = F.zeros_state(param), F.zeros_state(param), F.zeros_state(param)
    kw = {"lr": 1e-3, "weight_decay": 0.01, "maximize": True}
    calls = {
        "adam": lambda scratch: F.adam(
            param,
            grad,
            s1,
            s2,
            s3,
            step=1,
            beta1=0.9,
            beta2=0.99,
            eps=1e-8,
            amsgrad=True,
            scratch=scratch,
            **kw,
        ),
        "nadam": lambda scratch: F.nadam(
            param,
            grad,
            s1,
            s2,
            step=1,
            mu_product=1.0,
            beta1=0.9,
            beta2=0.99,
            eps=1e-8,
            scratch=scratch,
            **kw,
        ),
        "rmsprop": lambda scratch: F.rmsprop(
            param, grad, s1, s2, s3, momentum=0.5, centered=True, scratch=scratch, **kw
        ),
    }
    scratch = F.make_scratch(param)
    assert scratch.nbytes < param.nbytes / 4
    tracemalloc.start()
    try:
        calls[rule](None)  # allocates its block-sized work buffers
        _, peak_without = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        calls[rule](scratch)
        _, peak_with = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_without < param.nbytes / 4
    assert peak_with < 64 * 1024


def test_scratch_of_wrong_dtype_or_size_is_rejected_with_what_is_needed():
    param, grad = np.zeros(10, np.float32), np.ones(10, np.float32)
    buf = np.zeros(10, np.float32)
    with fused.use_fused(False):  # the NumPy path's work buffers (the fused path needs none)
        with pytest.raises(ValueError, match="needs at least 20"):
            F.sgd(param, grad, buf, lr=0.1, momentum=0.9, scratch=np.empty(5, np.float32))
        with pytest.raises(ValueError, match="dtype float32"):
            F.sgd(param, grad, buf, lr=0.1, momentum=0.9, scratch=np.empty(50, np.float64))


def test_state_array_of_wrong_dtype_names_the_argument():
    param, grad = np.zeros(4, np.float32), np.ones(4, np.float32)
    with pytest.raises(ValueError, match="exp_avg_sq has shape \\(4,\\) and dtype float64"):
        F.adam(
            param,
            grad,
            np.zeros(4, np.float32),
            np.zeros(4),
            step=1,
            lr=0.1,
            beta1=0.9,
            beta2=0.99,
            eps=1e-8,
        )
    with pytest.raises(ValueError, match="grad has shape \\(3,\\)"):
        F.adam(
            param,
            np.ones(3, np.float32),
            np.zeros(4, np.float32),
            np.zeros(4, np.float32),
            step=1,
            lr=0.1,
            beta1=0.9,
            beta2=0.99,
            eps=1e-8,
        )


@pytest.mark.parametrize(
    ("dtype", "state"),
    [
        ("float64", "float64"),
        ("float32", "float32"),
        ("float16", "float32"),
        ("bfloat16", "float32"),
    ],
)
def test_state_dtype_is_float32_for_16_bit_parameters(dtype, state):
    from zerosim.backend import DTYPES

    assert F.state_dtype(DTYPES[dtype]) == np.dtype(state)
    assert F.zeros_state(np.zeros(3, DTYPES[dtype])).dtype == np.dtype(state)


def test_state_dtype_rejects_integer_parameters():
    with pytest.raises(TypeError, match="'int32' cannot be optimized"):
        F.state_dtype(np.int32)
