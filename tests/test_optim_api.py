"""The torch.optim API of zerosim.optim.Optimizer: groups, defaults, step, zero_grad, state_keys."""

from __future__ import annotations

import numpy as np
import pytest

import zerosim.optim as zo


class Param:
    def __init__(self, data):
        self.data = data
        self.grad = None


def test_param_groups_fill_missing_hyperparameters_from_defaults():
    a, b = Param(np.zeros(2)), Param(np.zeros(2))
    opt = zo.Adam([{"params": [a]}, {"params": [b], "lr": 0.1, "amsgrad": True}], lr=0.01)
    assert opt.param_groups[0]["lr"] == 0.01
    assert opt.param_groups[1]["lr"] == 0.1
    assert opt.param_groups[1]["betas"] == (0.9, 0.999)
    assert opt.param_groups[1]["amsgrad"] is True
    assert opt.defaults["amsgrad"] is False
    assert opt.param_groups[0]["params"] == [a]


@pytest.mark.parametrize(
    ("cls", "torch_defaults"),
    [
        (zo.SGD, {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0}),
        (zo.Adam, {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}),
        (zo.AdamW, {"lr": 1e-3, "weight_decay": 1e-2, "decoupled_weight_decay": True}),
        (zo.Adagrad, {"lr": 1e-2, "lr_decay": 0.0, "eps": 1e-10}),
        (zo.RMSprop, {"lr": 1e-2, "alpha": 0.99, "eps": 1e-8, "centered": False}),
        (zo.Adamax, {"lr": 2e-3, "betas": (0.9, 0.999), "eps": 1e-8}),
        (zo.NAdam, {"lr": 2e-3, "momentum_decay": 4e-3, "decoupled_weight_decay": False}),
        (zo.RAdam, {"lr": 1e-3, "betas": (0.9, 0.999), "decoupled_weight_decay": False}),
        (zo.Lion, {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0}),
    ],
)
def test_defaults_are_torchs(cls, torch_defaults):
    opt = cls([Param(np.zeros(2))])
    assert {k: opt.defaults[k] for k in torch_defaults} == torch_defaults


def test_step_skips_parameters_without_gradient():
    a, b = Param(np.ones(3)), Param(np.ones(3))
    opt = zo.Adam([a, b], lr=0.1)
    a.grad = np.ones(3)
    opt.step()
    np.testing.assert_array_equal(b.data, np.ones(3))
    assert b not in opt.state
    assert opt.state[a]["step"] == 1.0
    np.testing.assert_allclose(a.data, np.full(3, 0.9), rtol=1e-6)  # first Adam step ≈ −lr·sign(g)


def test_step_returns_the_closure_loss_computed_before_the_update():
    p = Param(np.array([2.0]))
    seen = []

    def closure():
        seen.append(p.data.copy())
        p.grad = 2 * p.data  # d/dθ θ²
        return float(p.data[0] ** 2)

    opt = zo.SGD([p], lr=0.25)
    assert opt.step(closure) == 4.0
    assert seen[0][0] == 2.0
    assert p.data[0] == 1.0  # 2 − 0.25·4
    assert opt.step() is None


def test_zero_grad_sets_to_none_by_default_or_zeros_in_place():
    p = Param(np.ones(3))
    opt = zo.SGD([p], lr=0.1)
    grad = np.ones(3)
    p.grad = grad
    opt.zero_grad(set_to_none=False)
    assert p.grad is grad
    np.testing.assert_array_equal(grad, np.zeros(3))
    opt.zero_grad()
    assert p.grad is None


def test_add_param_group_after_construction_is_stepped_with_its_own_lr():
    a, b = Param(np.zeros(2)), Param(np.zeros(2))
    opt = zo.SGD([a], lr=0.1)
    opt.add_param_group({"params": b, "lr": 1.0})
    a.grad, b.grad = np.ones(2), np.ones(2)
    opt.step()
    np.testing.assert_array_equal(a.data, [-0.1, -0.1])
    np.testing.assert_array_equal(b.data, [-1.0, -1.0])


def test_sgd_without_momentum_keeps_no_state_like_torch():
    p = Param(np.zeros(2))
    opt = zo.SGD([p], lr=0.1)
    p.grad = np.ones(2)
    opt.step()
    assert opt.state_dict()["state"] == {}


def test_adagrad_creates_state_at_construction_like_torch():
    p = Param(np.zeros(2))
    opt = zo.Adagrad([p], initial_accumulator_value=0.5)
    assert opt.state[p]["step"] == 0.0
    np.testing.assert_array_equal(opt.state[p]["sum"], [0.5, 0.5])


@pytest.mark.parametrize(
    ("cls", "kwargs", "keys"),
    [
        (zo.SGD, {}, ()),
        (zo.SGD, {"momentum": 0.9}, ("momentum_buffer",)),
        (zo.Adam, {}, ("exp_avg", "exp_avg_sq")),
        (zo.Adam, {"amsgrad": True}, ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
        (zo.AdamW, {"amsgrad": True}, ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
        (zo.Adagrad, {}, ("sum",)),
        (zo.RMSprop, {}, ("square_avg",)),
        (
            zo.RMSprop,
            {"momentum": 0.9, "centered": True},
            ("square_avg", "momentum_buffer", "grad_avg"),
        ),
        (zo.Adamax, {}, ("exp_avg", "exp_inf")),
        (zo.NAdam, {}, ("exp_avg", "exp_avg_sq")),
        (zo.RAdam, {}, ("exp_avg", "exp_avg_sq")),
        (zo.Lion, {}, ("exp_avg",)),
    ],
)
def test_state_keys_name_exactly_the_arrays_a_step_creates(cls, kwargs, keys):
    p = Param(np.zeros(4, dtype=np.float32))
    opt = cls([{"params": [p]}], **kwargs)
    assert opt.state_keys(opt.param_groups[0]) == keys
    p.grad = np.ones(4, dtype=np.float32)
    opt.step()
    arrays = {k for k, v in opt.state.get(p, {}).items() if isinstance(v, np.ndarray)}
    assert arrays == set(keys)
    assert all(opt.state[p][k].dtype == np.float32 and opt.state[p][k].shape == (4,) for k in keys)


def test_state_dict_numbers_parameters_across_groups_in_order():
    ps = [Param(np.zeros(2)) for _ in range(3)]
    opt = zo.Adam([{"params": ps[:2]}, {"params": ps[2:], "lr": 0.5}])
    for p in ps:
        p.grad = np.ones(2)
    opt.step()
    sd = opt.state_dict()
    assert [g["params"] for g in sd["param_groups"]] == [[0, 1], [2]]
    assert sd["param_groups"][1]["lr"] == 0.5
    assert set(sd["state"]) == {0, 1, 2}
    assert sd["state"][2]["step"] == 1.0
    assert isinstance(sd["state"][2]["step"], float)


def test_engine_style_flat_shard_is_optimized_by_identity():
    class Tile:  # only .data and .grad, like the ZeRO engine's view of its master slice
        __slots__ = ("data", "grad")

    shard = Tile()
    shard.data = np.linspace(-1, 1, 8, dtype=np.float32)
    shard.grad = np.ones(8, dtype=np.float32)
    opt = zo.AdamW([{"params": [shard], "lr": 0.01}])
    opt.step()
    assert opt.state[shard]["exp_avg"].dtype == np.float32
    np.testing.assert_allclose(opt.state[shard]["exp_avg"], np.full(8, 0.1), rtol=1e-6)
