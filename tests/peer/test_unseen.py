"""unseen.py: what it leaves out of the weights' comparison is what no loss can see (zerosim's
models in float64), and the comparison still fails where a loss would see a difference, or
where the unseen part drifts further than its optimizer can move it. No DeepSpeed run."""

import copy

import numpy as np
import pytest
from cases import micro_batch
from unseen import adam_step_bound, assert_weight_equal, ns_largest_value, unseen_bound, unseen_part

import zerosim as zs

GPT = {"kind": "gpt", "vocab": 11, "block": 8, "layers": 1, "heads": 2, "embd": 16}
MLP = {"kind": "mlp", "sizes": [20, 37, 5]}
ADAMW = {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.05, "torch_adam": True}}
MUON = {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 1e-3, "weight_decay": 0.01}}
SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}


def _case(name, model, optimizer, steps=5):
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": copy.deepcopy(optimizer)}
    return {"name": name, "steps": steps, "model": model, "config": config}


CASES = [
    _case("gpt_adamw", GPT, ADAMW),
    _case("gpt_muon", GPT, MUON),
    _case("mlp_muon", MLP, MUON),
    _case("mlp_muon_one_step", MLP, MUON, steps=1),
]


def model64(case):
    spec = case["model"]
    if spec["kind"] == "mlp":
        return zs.nn.MLP(spec["sizes"], seed=0, dtype="float64")
    args = spec["vocab"], spec["block"], spec["layers"], spec["heads"], spec["embd"]
    return zs.nn.GPT(*args, seed=0, dtype="float64")


def loss_of(case, model):
    x, y = micro_batch(case, 0, 0, 0)
    return float(model(x.astype(np.float64) if x.dtype.kind == "f" else x, y))


def unseen_weights(case):
    """(name, parameter) of every weight of the case's model with an unseen part."""
    params = model64(case).named_parameters()
    return [(k, p) for k, p in params if unseen_part(case, k, p.data) is not None]


def test_each_case_has_the_unseen_parts_the_derivation_names():
    names = {c["name"]: [k for k, _ in unseen_weights(c)] for c in CASES}
    assert names["gpt_adamw"] == ["blocks.0.attn.c_attn.bias"]
    assert names["gpt_muon"] == [
        "blocks.0.attn.c_attn.bias",
        "blocks.0.attn.c_proj.weight",
        "blocks.0.mlp.c_proj.weight",
    ]
    assert names["mlp_muon"] == ["layers.2.weight"]
    # SGD does not normalise its step: rounding stays rounding, every weight compared whole
    assert not unseen_weights(_case("gpt_sgd", GPT, SGD))


@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: c["name"])
def test_the_unseen_part_changes_no_loss_and_has_no_gradient(case):
    """In float64: moving a weight along its unseen part leaves the loss as it was (to
    rounding), moving it along the rest changes it, and the gradient there is zero."""
    rng = np.random.default_rng(0)
    for key, _ in unseen_weights(case):
        model = model64(case)
        param = dict(model.named_parameters())[key]
        before = loss_of(case, model)
        model.backward()
        grad = param.grad.copy()
        assert np.abs(unseen_part(case, key, grad)).max() <= 1e-14 * np.abs(grad).max(), key
        r = rng.normal(scale=0.5, size=param.data.shape)
        hidden = unseen_part(case, key, r)
        start = param.data.copy()
        param.data[...] = start + hidden
        assert loss_of(case, model) == pytest.approx(before, rel=1e-12, abs=0), key
        param.data[...] = start + (r - hidden)
        assert abs(loss_of(case, model) - before) > 1e-6, key


def random_weights(case):
    rng = np.random.default_rng(1)
    return {k: rng.normal(size=p.data.shape) for k, p in model64(case).named_parameters()}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_a_seen_difference_beyond_atol_is_rejected(case):
    atol = 1e-5
    for key, want in random_weights(case).items():
        assert_weight_equal(case, key, want + 0.5 * atol, want, atol)  # within: passes
        got = want.copy()
        got.flat[0] += 2 * atol  # one element: seen, whether or not the weight has an unseen part
        with pytest.raises(AssertionError, match="where the loss sees it"):
            assert_weight_equal(case, key, got, want, atol)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_an_unseen_drift_is_held_to_its_bound(case):
    """Inside the bound the unseen part may differ by far more than atol; beyond it, no."""
    rng = np.random.default_rng(2)
    weights = random_weights(case)
    for key, _ in unseen_weights(case):
        want = weights[key]
        bound = unseen_bound(case, key, want.shape)
        assert bound > 1e3 * 1e-5  # much wider than atol: these are steps, not rounding
        hidden = unseen_part(case, key, rng.normal(size=want.shape))
        hidden /= np.abs(hidden).max()
        assert_weight_equal(case, key, want + 0.9 * bound * hidden, want, 1e-5)
        with pytest.raises(AssertionError, match="where no loss sees it"):
            assert_weight_equal(case, key, want + 1.1 * bound * hidden, want, 1e-5)


def test_the_bounds_follow_from_the_optimizers_steps():
    """2·Σₜ lr·Bₜ: the key bias under Muon's Adam (lr 1e-3, betas (0.9, 0.95)) and AdamW (lr
    2e-3, betas (0.9, 0.999)), and the output rows' mean under Muon (lr 0.02, 5 rows)."""
    key_bias, output = "blocks.0.attn.c_attn.bias", "layers.2.weight"
    adam_95 = sum(adam_step_bound(0.9, 0.95, t) for t in range(1, 6))
    adam_999 = sum(adam_step_bound(0.9, 0.999, t) for t in range(1, 6))
    assert unseen_bound(CASES[1], key_bias, (48,)) == pytest.approx(2 * 1e-3 * adam_95)
    assert unseen_bound(CASES[0], key_bias, (48,)) == pytest.approx(2 * 2e-3 * adam_999)
    muon = 2 * 0.02 * ns_largest_value() / np.sqrt(5)
    assert unseen_bound(CASES[2], output, (5, 37)) == pytest.approx(5 * muon)
    assert unseen_bound(CASES[3], output, (5, 37)) == pytest.approx(muon)
    assert 1.202 < ns_largest_value() < 1.203
    with pytest.raises(ValueError, match="no unseen part"):
        unseen_bound(CASES[0], "blocks.0.attn.c_attn.weight", (48, 16))


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.9, 0.95)])
def test_adam_step_bound_holds_for_any_gradients_and_is_reached(betas):
    """|m̂_t/√v̂_t| over random gradient sequences stays under the bound; the sequence that
    makes Cauchy–Schwarz an equality, g_s ∝ (β₁/β₂)^(t−s), reaches it."""
    beta1, beta2 = betas
    rng = np.random.default_rng(3)

    def ratio(g):
        m = v = 0.0
        for gs in g:
            m = beta1 * m + (1 - beta1) * gs
            v = beta2 * v + (1 - beta2) * gs * gs
        t = len(g)
        return abs(m / (1 - beta1**t)) / np.sqrt(v / (1 - beta2**t))

    for t in range(1, 8):
        bound = adam_step_bound(beta1, beta2, t)
        for _ in range(200):
            assert ratio(rng.normal(size=t) * rng.lognormal(size=t)) <= bound * (1 + 1e-12)
        worst = [(beta1 / beta2) ** (t - s) for s in range(1, t + 1)]
        assert ratio(worst) == pytest.approx(bound, rel=1e-12)
