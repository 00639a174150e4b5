"""Bad hyperparameters, parameters and state_dicts fail fast, naming argument, value and range."""

from __future__ import annotations

import numpy as np
import pytest

import zerosim.optim as zo


class Param:
    def __init__(self, data):
        self.data = data
        self.grad = None


def params(n=2):
    return [Param(np.zeros(3)) for _ in range(n)]


ALL = [
    zo.SGD, zo.Adam, zo.AdamW, zo.Adagrad, zo.RMSprop, zo.Adamax, zo.NAdam, zo.RAdam, zo.Lion,
    zo.Lamb,
]  # fmt: skip
WITH_EPS = [zo.Adam, zo.AdamW, zo.Adagrad, zo.RMSprop, zo.Adamax, zo.NAdam, zo.RAdam, zo.Lamb]
WITH_BETAS = [zo.Adam, zo.AdamW, zo.Adamax, zo.NAdam, zo.RAdam, zo.Lion, zo.Lamb]

BAD = (
    [(cls, "lr", -1e-3, "0.0 <= lr") for cls in ALL]
    + [(cls, "weight_decay", -0.1, "0.0 <= weight_decay") for cls in ALL]
    + [(cls, "eps", -1e-8, "0.0 <= eps") for cls in WITH_EPS]
    + [(cls, "betas", (1.0, 0.999), "0.0 <= betas[0] < 1.0") for cls in WITH_BETAS]
    + [(cls, "betas", (0.9, -0.5), "0.0 <= betas[1] < 1.0") for cls in WITH_BETAS]
    + [
        (zo.SGD, "momentum", -0.9, "0.0 <= momentum"),
        (zo.RMSprop, "momentum", -0.9, "0.0 <= momentum"),
        (zo.RMSprop, "alpha", -0.5, "0.0 <= alpha"),
        (zo.Adagrad, "lr_decay", -0.1, "0.0 <= lr_decay"),
        (zo.Adagrad, "initial_accumulator_value", -1.0, "0.0 <= initial_accumulator_value"),
        (zo.NAdam, "momentum_decay", -4e-3, "0.0 <= momentum_decay"),
        (zo.Adam, "lr", float("nan"), "0.0 <= lr"),
    ]
)


@pytest.mark.parametrize(
    ("cls", "name", "value", "allowed"), BAD, ids=[f"{c.__name__}-{n}-{v}" for c, n, v, _ in BAD]
)
def test_out_of_range_hyperparameter_names_argument_value_and_range(cls, name, value, allowed):
    with pytest.raises(ValueError) as err:
        cls(params(), **{name: value})
    message = str(err.value)
    assert message.startswith(cls.__name__)
    assert allowed in message
    shown = name if name != "betas" else ("betas[0]" if value[0] >= 1 else "betas[1]")
    bad = value if name != "betas" else value[0] if value[0] >= 1 else value[1]
    assert f"{shown}={bad!r}" in message


@pytest.mark.parametrize("cls", ALL)
def test_out_of_range_value_in_a_param_group_names_the_group(cls):
    groups = [{"params": params(1)}, {"params": params(1), "lr": -2.0}]
    with pytest.raises(ValueError, match=f"{cls.__name__} param group 1: invalid lr=-2.0"):
        cls(groups)


@pytest.mark.parametrize("cls", WITH_BETAS)
def test_betas_must_be_a_pair(cls):
    with pytest.raises(ValueError, match=r"betas must be a pair \(beta1, beta2\); got 0.9"):
        cls(params(), betas=0.9)


def test_lr_that_is_not_a_number_is_a_type_error():
    with pytest.raises(TypeError, match="lr must be a real number; got '0.1' of type str"):
        zo.Adam(params(), lr="0.1")


@pytest.mark.parametrize(
    "kwargs", [{"nesterov": True}, {"nesterov": True, "momentum": 0.9, "dampening": 0.1}]
)
def test_nesterov_without_momentum_or_with_dampening_is_rejected(kwargs):
    with pytest.raises(ValueError, match="nesterov=True requires momentum > 0 and dampening = 0"):
        zo.SGD(params(), **kwargs)


@pytest.mark.parametrize("cls", [zo.Adam, zo.Adamax])
def test_unknown_variant_lists_the_allowed_ones(cls):
    with pytest.raises(ValueError, match=r"invalid variant='tf'; allowed: \['torch', 'keras'\]"):
        cls(params(), variant="tf")


@pytest.mark.parametrize("cls", ALL)
def test_empty_parameter_list_is_rejected(cls):
    with pytest.raises(ValueError, match="params is empty"):
        cls([])


def test_empty_param_group_is_kept_like_torch():
    p = Param(np.ones(2))
    opt = zo.SGD([{"params": [p]}, {"params": [], "lr": 0.5}], lr=0.25)
    p.grad = np.ones(2)
    opt.step()
    np.testing.assert_array_equal(p.data, [0.75, 0.75])
    assert opt.state_dict()["param_groups"][1]["params"] == []


def test_unknown_group_key_is_rejected_with_the_allowed_keys():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['betaz'\]; allowed: .*'betas'"):
        zo.Adam([{"params": params(), "betaz": (0.9, 0.9)}])


def test_parameter_in_two_groups_is_rejected():
    shared = Param(np.zeros(2))
    with pytest.raises(ValueError, match="already in param group 0"):
        zo.SGD([{"params": [shared]}, {"params": [Param(np.zeros(2)), shared]}])


def test_parameter_twice_in_one_group_is_rejected():
    p = Param(np.zeros(2))
    with pytest.raises(ValueError, match=r"params\[1\] appears twice"):
        zo.SGD([p, p])


def test_objects_without_data_and_grad_are_rejected():
    with pytest.raises(TypeError, match=r"params\[0\] is a ndarray; allowed: objects with"):
        zo.SGD([np.zeros(3)])


def test_a_single_parameter_instead_of_a_list_is_rejected():
    with pytest.raises(TypeError, match="got a single Param"):
        zo.SGD(Param(np.zeros(3)))


def test_integer_parameter_is_rejected():
    with pytest.raises(TypeError, match="'int64' cannot be optimized"):
        zo.SGD([Param(np.zeros(3, dtype=np.int64))])


# --- load_state_dict says what differs and changes nothing ----------------------------------


def stepped_adam(sizes):
    ps = [[Param(np.ones(3)) for _ in range(n)] for n in sizes]
    opt = zo.Adam([{"params": g} for g in ps], lr=0.1)
    for g in ps:
        for p in g:
            p.grad = np.ones(3)
    opt.step()
    return ps, opt


def test_load_state_dict_with_another_group_count_says_both_counts():
    _, saved = stepped_adam([2, 1])
    _, opt = stepped_adam([3])
    with pytest.raises(ValueError, match="has 2 parameter groups; this optimizer has 1"):
        opt.load_state_dict(saved.state_dict())


def test_load_state_dict_with_another_group_size_names_the_group_and_sizes():
    _, saved = stepped_adam([2, 1])
    _, opt = stepped_adam([2, 2])
    with pytest.raises(
        ValueError, match="parameter group 1 has 1 parameters in the state_dict and 2"
    ):
        opt.load_state_dict(saved.state_dict())


def test_load_state_dict_with_wrong_array_shape_changes_nothing():
    _, saved = stepped_adam([2])
    ps, opt = stepped_adam([2])
    state = saved.state_dict()
    state["param_groups"][0]["lr"] = 0.5
    state["state"][1]["exp_avg"] = np.zeros(4)
    before = {
        k: v.copy() if isinstance(v, np.ndarray) else v for k, v in opt.state[ps[0][1]].items()
    }
    with pytest.raises(ValueError, match="state of parameter 1: 'exp_avg' has shape \\(4,\\)"):
        opt.load_state_dict(state)
    assert opt.param_groups[0]["lr"] == 0.1
    for key, value in before.items():
        np.testing.assert_array_equal(opt.state[ps[0][1]][key], value)


def test_load_state_dict_missing_a_state_array_names_it():
    _, saved = stepped_adam([1])
    state = saved.state_dict()
    state["param_groups"][0]["amsgrad"] = True
    _, opt = stepped_adam([1])
    with pytest.raises(ValueError, match=r"missing \['max_exp_avg_sq'\]"):
        opt.load_state_dict(state)


def test_load_state_dict_with_bad_hyperparameter_is_rejected():
    _, saved = stepped_adam([1])
    state = saved.state_dict()
    state["param_groups"][0]["betas"] = (0.9, 1.5)
    _, opt = stepped_adam([1])
    with pytest.raises(ValueError, match="parameter group 0: invalid betas\\[1\\]=1.5"):
        opt.load_state_dict(state)
