"""zerosim.optim.Muon and functional.muon against DeepSpeed 0.19.8's own Muon functions.

DeepSpeed's ``muon_update`` and its Newton–Schulz iterations run here on the same matrices
(importing them compiles them with torch's CPU compiler on first use, ~30 s: these tests are
``slow``). Which of DeepSpeed's two paths is the oracle, and the bounds:

- Newton–Schulz against DeepSpeed's *eager* functions (``__wrapped__``, the code as written):
  "standard" (bfloat16, every operation rounded) must be bit-identical; "gram" (float32) agrees
  to ``GRAM_ATOL`` = 1e-5 on entries of size ~1 [measured 1.1e-6]: BLAS and torch sum a
  product's terms in different orders and the iteration amplifies the float32 rounding.
- ``muon_update`` against the *compiled* function (what DeepSpeed runs): the momentum must be
  bit-identical (zerosim's lerp is the compiled kernel's); the update, "gram" to ``GRAM_ATOL``;
  "standard" to twice DeepSpeed's own spread between its eager and compiled Newton–Schulz on the
  same input (torch.compile keeps fused bfloat16 intermediates in float32 and rounds once).
- ``MuonWithAuxAdam`` on whole matrices (DeepSpeed without ZeRO) with torch's AdamW as the
  auxiliary Adam: weights after 4 steps to ``STEP_ATOL`` = 1e-6 [~2e-7].

Hand checks need no oracle: the output's singular values, the aspect-ratio scale, the first
momentum, the overflow guard, the step's arithmetic.
"""

from __future__ import annotations

import numpy as np
import pytest

import zerosim.optim as zo
from zerosim.backend import DTYPES
from zerosim.optim import functional as F
from zerosim.optim.functional.muon import (
    aspect_ratio_scale,
    zeropower_via_gram_newtonschulz,
    zeropower_via_newtonschulz5,
)

GRAM_ATOL = 1e-5
STEP_ATOL = 1e-6
SHAPES = [(12, 20), (20, 12), (16, 16), (37, 20)]


@pytest.fixture(scope="module")
def ds():
    """DeepSpeed's Muon module (compiles on first use), with its accelerator pinned to no fp16
    while this module runs: DeepSpeed's CPU accelerator says fp16 where oneDNN has fp16 matrix
    products (a CPU with AMX-FP16), and its "gram" iteration then runs in fp16
    (``ns_compute_dtype``); elsewhere, and in zerosim, in float32 (tests/peer/ds_driver.py pins
    it the same way)."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is the oracle here")
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.muon import original_muon

    accelerator = get_accelerator()
    before = vars(accelerator).get("is_fp16_supported")  # an instance attribute set earlier
    accelerator.is_fp16_supported = lambda: False
    try:
        yield original_muon
    finally:
        if before is None:
            del accelerator.is_fp16_supported
        else:
            accelerator.is_fp16_supported = before


def _torch():
    import torch

    return torch


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_standard_newton_schulz_is_deepspeeds_eager_bit_for_bit(ds, shape):
    torch = _torch()
    d = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    want = ds.zeropower_via_newtonschulz5.__wrapped__(torch.tensor(d), 5).float().numpy()
    got = zeropower_via_newtonschulz5(d, 5)
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_gram_newton_schulz_equals_deepspeeds_eager(ds, shape, dtype):
    torch = _torch()
    d = np.random.default_rng(1).normal(size=shape).astype(dtype)
    want = ds.zeropower_via_gram_newtonschulz.__wrapped__(torch.tensor(d), 5).numpy()
    got = zeropower_via_gram_newtonschulz(d, 5)
    assert got.dtype == want.dtype == np.float32  # float32 even for a float64 matrix
    np.testing.assert_allclose(got, want, rtol=0, atol=GRAM_ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gram", "standard"])
@pytest.mark.parametrize("shape", SHAPES)
def test_muon_update_equals_deepspeeds_compiled_muon_update(ds, shape, method):
    torch = _torch()
    rng = np.random.default_rng(2)
    g = rng.normal(size=shape).astype(np.float32)
    m = rng.normal(size=shape).astype(np.float32) * 0.1
    ds_m = torch.tensor(m.copy())
    want = ds.muon_update(torch.tensor(g.copy()), ds_m, beta=0.95, ns_method=method).numpy()
    zs_m = m.copy()
    got = F.muon_update(g.copy(), zs_m, beta=0.95, ns_method=method)
    np.testing.assert_array_equal(zs_m, ds_m.numpy())
    if method == "gram":
        np.testing.assert_allclose(got, want, rtol=0, atol=GRAM_ATOL)
        return
    # DeepSpeed's own spread: eager against compiled Newton–Schulz of the same blend d
    d = zs_m + (zs_m - g) * np.float32(0.95 - 1)
    eager = ds.zeropower_via_newtonschulz5.__wrapped__(torch.tensor(d), 5).float().numpy()
    compiled = ds.zeropower_via_newtonschulz5(torch.tensor(d), 5).float().numpy()
    spread = float(np.abs(eager - compiled).max())
    assert spread > 0  # the two paths of DeepSpeed really differ here
    np.testing.assert_allclose(got, want, rtol=0, atol=2 * spread * aspect_ratio_scale(*shape))


class Param:
    def __init__(self, data):
        self.data = data
        self.grad = None


@pytest.mark.slow
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_muon_with_aux_adam_steps_as_deepspeeds(ds, adam_w_mode):
    torch = _torch()
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    rng = np.random.default_rng(3)
    shapes = {"w1": (12, 20), "w2": (20, 8), "b1": (12,), "emb": (6, 5)}
    init = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    muon_names, adam_names = ["w1", "w2"], ["b1", "emb"]
    tp = {k: torch.nn.Parameter(torch.tensor(v.copy())) for k, v in init.items()}
    zp = {k: Param(v.copy()) for k, v in init.items()}
    hyper_m = {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.1, "ns_method": "gram"}
    hyper_a = {"lr": 0.01, "betas": (0.8, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    adam_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    theirs = MuonWithAuxAdam(
        [
            {"params": [tp[k] for k in muon_names], "use_muon": True, **hyper_m},
            {"params": [tp[k] for k in adam_names], "use_muon": False, **hyper_a},
        ],
        adam_optimizer=adam_cls,
        adam_w_mode=adam_w_mode,
    )
    ours = zo.Muon(
        [
            {"params": [zp[k] for k in muon_names], "use_muon": True, **hyper_m},
            {"params": [zp[k] for k in adam_names], "use_muon": False, **hyper_a},
        ],
        adam_w_mode=adam_w_mode,
    )
    for _ in range(4):
        for k, s in shapes.items():
            g = rng.normal(size=s).astype(np.float32)
            tp[k].grad = torch.tensor(g.copy())
            zp[k].grad = g.copy()
        theirs.step()
        ours.step()
    for k in shapes:
        np.testing.assert_allclose(zp[k].data, tp[k].detach().numpy(), rtol=0, atol=STEP_ATOL)
    m = ours.state[zp["w1"]]["momentum_buffer"]
    np.testing.assert_allclose(m, theirs.state[tp["w1"]]["momentum_buffer"].numpy(), atol=1e-6)


# -- by hand ------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["gram", "standard"])
@pytest.mark.parametrize("shape", [(8, 24), (24, 8), (16, 16)])
def test_newton_schulz_output_has_singular_values_near_one(method, shape):
    """Five quintic steps send every singular value of X/‖X‖ into ~[0.6, 1.2] (Jordan et al.:
    "S' ~ U(0.5, 1.5)"), whatever the input's spread (here 1e-2 to 1)."""
    rng = np.random.default_rng(4)
    n = min(shape)
    u, _ = np.linalg.qr(rng.normal(size=(shape[0], n)))
    v, _ = np.linalg.qr(rng.normal(size=(shape[1], n)))
    g = (u * np.logspace(-2, 0, n)) @ v.T
    fn = zeropower_via_gram_newtonschulz if method == "gram" else zeropower_via_newtonschulz5
    s = np.linalg.svd(fn(g.astype(np.float32)).astype(np.float64), compute_uv=False)
    assert 0.5 < s.min() and s.max() < 1.3, s


def test_first_update_orthogonalizes_a_nesterov_blend_of_the_gradient():
    """Step 1 from μ = 0: μ = (1 − β)g and d = g + β(μ − g) = (1 − β + β(1 − β))g, a positive
    multiple of g; Newton–Schulz is scale-free (up to the 1e-7 added to the norm, and float32
    rounding: ``GRAM_ATOL``), so the update is NS(g), times √(rows/cols)."""
    rng = np.random.default_rng(5)
    g = rng.normal(size=(30, 10))
    mu = np.zeros_like(g)
    update = F.muon_update(g, mu, beta=0.9)
    np.testing.assert_allclose(mu, 0.1 * g, rtol=1e-15)
    want = zeropower_via_gram_newtonschulz(g) * np.sqrt(3.0)
    np.testing.assert_allclose(update, want, rtol=0, atol=GRAM_ATOL)
    assert update.dtype == np.float64


def test_aspect_ratio_scale_is_the_root_of_rows_over_columns_for_tall_matrices():
    assert aspect_ratio_scale(32, 8) == 2.0
    assert aspect_ratio_scale(8, 32) == 1.0
    assert aspect_ratio_scale(8, 8) == 1.0


def test_a_non_finite_gradient_leaves_the_momentum_and_comes_back_unchanged():
    g = np.ones((4, 6), dtype=np.float32)
    g[1, 2] = np.inf
    mu = np.full_like(g, 0.5)
    update = F.muon_update(g, mu, beta=0.95)
    np.testing.assert_array_equal(mu, 0.5)
    np.testing.assert_array_equal(update, g)


def test_muon_step_decays_decoupled_then_subtracts_lr_times_the_update():
    rng = np.random.default_rng(6)
    p = rng.normal(size=(5, 7))
    g = rng.normal(size=(5, 7))
    before = p.copy()
    mu = np.zeros_like(p)
    F.muon(p, g, mu, lr=0.1, momentum=0.9, weight_decay=0.5)
    update = zeropower_via_gram_newtonschulz(g)  # μ = 0.1·g, d = 0.19·g: NS is scale-free
    np.testing.assert_allclose(p, before * (1 - 0.1 * 0.5) - 0.1 * update, atol=0.1 * GRAM_ATOL)


def test_a_flat_shard_of_a_muon_group_takes_its_gradient_as_the_update():
    """Under ZeRO the strategy writes the update into a 1-D shard's gradient; the optimizer
    only decays and steps, and keeps no momentum for the shard."""
    p = Param(np.array([1.0, 2.0, 3.0]))
    p.grad = np.array([0.5, -0.5, 1.0])
    opt = zo.Muon([{"params": [p], "use_muon": True, "lr": 0.1, "weight_decay": 0.2}])
    opt.step()
    np.testing.assert_allclose(p.data, np.array([1.0, 2.0, 3.0]) * 0.98 - 0.1 * p.grad)
    assert opt.state_dict()["state"] == {}


def test_groups_take_their_kinds_defaults():
    a, b = Param(np.zeros((3, 3))), Param(np.zeros(3))
    opt = zo.Muon([{"params": [a], "use_muon": True}, {"params": [b], "use_muon": False}])
    muon, adam = opt.param_groups
    assert (muon["lr"], muon["momentum"], muon["ns_method"]) == (0.02, 0.95, "gram")
    assert (adam["lr"], adam["betas"], adam["eps"]) == (3e-4, (0.9, 0.95), 1e-10)
    assert "betas" not in muon and "momentum" not in adam


@pytest.mark.parametrize(
    ("group", "match"),
    [
        ({}, "use_muon"),
        ({"use_muon": 1}, "use_muon"),
        ({"use_muon": True, "ns_method": "newton"}, "ns_method"),
        ({"use_muon": True, "momentum": -0.5}, "momentum"),
        ({"use_muon": True, "betas": (0.9, 0.9)}, "betas"),  # an Adam key in a Muon group
        ({"use_muon": False, "eps": -1.0}, "eps"),
    ],
)
def test_bad_groups_are_refused_naming_the_key(group, match):
    with pytest.raises(ValueError, match=match):
        zo.Muon([{"params": [Param(np.zeros((2, 2)))], **group}])


def test_update_of_a_vector_is_refused():
    with pytest.raises(ValueError, match="2-D"):
        F.muon_update(np.zeros(4), np.zeros(4))


def test_the_scale_of_a_tall_update_is_rounded_to_the_compute_dtype():
    """``update *= scale`` on DeepSpeed's bfloat16 result rounds the product to bfloat16."""
    g = np.random.default_rng(7).normal(size=(20, 5)).astype(np.float32)
    update = F.muon_update(g, np.zeros_like(g), ns_method="standard")
    rounded = update.astype(DTYPES["bfloat16"]).astype(np.float32)
    np.testing.assert_array_equal(rounded, update)
