"""zerosim.optim.lr_scheduler against torch.optim.lr_scheduler, and DeepSpeed's schedulers
against their formulas written out independently here."""

from __future__ import annotations

import copy
import inspect
import itertools
import math
import pickle

import numpy as np
import pytest
import torch
import torch.optim.lr_scheduler as T

import zerosim.optim as ZO
import zerosim.optim.lr_scheduler as Z

N_STEPS = 300
# torch warns when a scheduler steps before its optimizer; SequentialLR's first step of a
# ChainedScheduler does so at construction. zerosim has no such warning (docs/schedulers.md).
pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step:UserWarning")


class GroupsOnly:
    """The least an optimizer must offer a scheduler: param_groups (and defaults)."""

    def __init__(self, groups: list[dict], defaults: dict) -> None:
        self.param_groups = groups
        self.defaults = defaults


SGD_GROUPS = [{"lr": 0.1, "momentum": 0.9}, {"lr": 0.03, "momentum": 0.5}]
ADAM_GROUPS = [{"lr": 0.1, "betas": (0.9, 0.999)}, {"lr": 0.03, "betas": (0.8, 0.99)}]


def make_pair(kind: str) -> tuple[GroupsOnly, torch.optim.Optimizer]:
    """A duck-typed zerosim-side optimizer and a torch optimizer with the same two groups."""
    groups = SGD_GROUPS if kind == "sgd" else ADAM_GROUPS
    params = [torch.zeros(3, requires_grad=True) for _ in groups]
    torch_groups = [{"params": [p], **g} for p, g in zip(params, groups, strict=True)]
    if kind == "sgd":
        torch_opt = torch.optim.SGD(torch_groups, lr=0.1, momentum=0.9)
        defaults = {"lr": 0.1, "momentum": 0.9}
    else:
        torch_opt = torch.optim.Adam(torch_groups, lr=0.1)
        defaults = {"lr": 0.1, "betas": (0.9, 0.999)}
    return GroupsOnly(copy.deepcopy(groups), defaults), torch_opt


def group_values(opt) -> list[tuple]:
    """lr and the momentum-like entry of every group."""
    return [(g["lr"], g.get("momentum"), g.get("betas")) for g in opt.param_groups]


class PowerScale:
    """A CyclicLR ``scale_fn`` that is a callable object: its attributes are its state, which
    torch's state_dict keeps (a plain function it does not)."""

    def __init__(self, base: float) -> None:
        self.base = base

    def __call__(self, x: float) -> float:
        return self.base**x


class Halving:
    """A MultiplicativeLR ``lr_lambda`` object: halves the lr every ``every`` epochs."""

    def __init__(self, every: int) -> None:
        self.every = every

    def __call__(self, epoch: int) -> float:
        return 0.5 if epoch % self.every == 0 else 1.0


# Each case builds the scheduler(s) from a module M (torch's or zerosim's) on an optimizer.
CASES = {
    "step": ("sgd", lambda M, o: [M.StepLR(o, step_size=7, gamma=0.5)]),
    "multistep_repeated": ("sgd", lambda M, o: [M.MultiStepLR(o, [30, 80, 80, 200], 0.3)]),
    "exponential": ("sgd", lambda M, o: [M.ExponentialLR(o, gamma=0.99)]),
    "cosine_restarts": ("sgd", lambda M, o: [M.CosineAnnealingLR(o, T_max=50, eta_min=1e-3)]),
    "cosine_full": ("sgd", lambda M, o: [M.CosineAnnealingLR(o, T_max=N_STEPS)]),
    "lambda": ("sgd", lambda M, o: [M.LambdaLR(o, lambda t: 1.0 / (1.0 + 0.1 * t))]),
    "lambda_per_group": (
        "sgd",
        lambda M, o: [M.LambdaLR(o, [lambda t: 0.99**t, lambda t: 1.0 + math.sin(t / 9.0)])],
    ),
    "linear_up": ("sgd", lambda M, o: [M.LinearLR(o, start_factor=0.25, total_iters=40)]),
    "linear_down": (
        "sgd",
        lambda M, o: [M.LinearLR(o, start_factor=1.0, end_factor=0.1, total_iters=100)],
    ),
    "chained_exponential_and_step": (
        "sgd",
        lambda M, o: [M.ExponentialLR(o, gamma=0.995), M.StepLR(o, step_size=25, gamma=0.7)],
    ),
    "sequential_linear_then_cosine": (
        "sgd",
        lambda M, o: [
            M.SequentialLR(
                o,
                [M.LinearLR(o, start_factor=0.1, total_iters=20), M.CosineAnnealingLR(o, 250)],
                milestones=[20],
            )
        ],
    ),
    "sequential_three": (
        "adam",
        lambda M, o: [
            M.SequentialLR(
                o,
                [
                    M.ExponentialLR(o, gamma=0.9),
                    M.StepLR(o, step_size=10, gamma=0.5),
                    M.LinearLR(o, start_factor=0.5, end_factor=0.2, total_iters=30),
                ],
                milestones=[15, 120],
            )
        ],
    ),
    "onecycle_cos_sgd": ("sgd", lambda M, o: [M.OneCycleLR(o, [1.0, 0.5], total_steps=N_STEPS)]),
    "onecycle_linear_adam": (
        "adam",
        lambda M, o: [
            M.OneCycleLR(
                o, 0.4, epochs=10, steps_per_epoch=30, anneal_strategy="linear", pct_start=0.25
            )
        ],
    ),
    "onecycle_three_phase_adam": (
        "adam",
        lambda M, o: [
            M.OneCycleLR(
                o,
                0.4,
                total_steps=N_STEPS,
                three_phase=True,
                base_momentum=[0.8, 0.7],
                max_momentum=0.97,
                div_factor=10.0,
                final_div_factor=100.0,
            )
        ],
    ),  # fmt: skip
    "onecycle_no_momentum": (
        "sgd",
        lambda M, o: [M.OneCycleLR(o, 0.2, total_steps=N_STEPS + 7, cycle_momentum=False)],
    ),
    "constant_then_exponential": (
        "sgd",
        lambda M, o: [M.ConstantLR(o, factor=0.4, total_iters=30), M.ExponentialLR(o, 0.995)],
    ),
    "polynomial": ("sgd", lambda M, o: [M.PolynomialLR(o, total_iters=200, power=1.7)]),
    "warm_restarts": ("sgd", lambda M, o: [M.CosineAnnealingWarmRestarts(o, T_0=25)]),
    "warm_restarts_growing": (
        "adam",
        lambda M, o: [M.CosineAnnealingWarmRestarts(o, T_0=7, T_mult=2, eta_min=1e-3)],
    ),
    "cyclic_triangular_sgd": (
        "sgd",
        lambda M, o: [M.CyclicLR(o, 0.01, [0.2, 0.1], step_size_up=13, step_size_down=29)],
    ),
    "cyclic_triangular2_adam": (
        "adam",
        lambda M, o: [M.CyclicLR(o, [0.01, 0.02], 0.3, step_size_up=20, mode="triangular2")],
    ),
    "cyclic_exp_range_no_momentum": (
        "sgd",
        lambda M, o: [
            M.CyclicLR(o, 0.01, 0.1, 17, mode="exp_range", gamma=0.995, cycle_momentum=False)
        ],
    ),
    "cyclic_scale_fn_object_iterations": (
        "adam",
        lambda M, o: [
            M.CyclicLR(o, 0.01, 0.3, 11, 23, scale_fn=PowerScale(0.997), scale_mode="iterations")
        ],
    ),  # fmt: skip
    "cyclic_scale_fn_lambda_cycle": (
        "sgd",
        lambda M, o: [M.CyclicLR(o, [0.01, 0.02], 0.2, 9, scale_fn=lambda c: 1.0 / c)],
    ),
    "multiplicative": ("sgd", lambda M, o: [M.MultiplicativeLR(o, lambda t: 0.99)]),
    "multiplicative_per_group": (
        "adam",
        lambda M, o: [M.MultiplicativeLR(o, [Halving(40), lambda t: 1.0 + 0.3 * math.sin(t)])],
    ),
    "chained_constant_exponential": (
        "sgd",
        lambda M, o: [
            M.ChainedScheduler(
                [M.ConstantLR(o, factor=0.1, total_iters=20), M.ExponentialLR(o, 0.99)]
            )
        ],
    ),
    "chained_three_with_optimizer": (
        "adam",
        lambda M, o: [
            M.ChainedScheduler(
                [
                    M.ExponentialLR(o, 0.995),
                    M.MultiplicativeLR(o, Halving(70)),
                    M.CosineAnnealingLR(o, T_max=90, eta_min=1e-3),
                ],
                optimizer=o,
            )
        ],
    ),  # fmt: skip
    "chained_inside_sequential": (
        "sgd",
        lambda M, o: [
            M.SequentialLR(
                o,
                [
                    M.ChainedScheduler(
                        [M.LinearLR(o, 0.1, total_iters=50), M.ConstantLR(o, 0.1, 50)]
                    ),
                    M.ConstantLR(o, factor=0.5, total_iters=100),
                ],
                milestones=[50],
            )
        ],
    ),  # fmt: skip
    "sequential_inside_chained": (
        "sgd",
        lambda M, o: [
            M.ChainedScheduler(
                [
                    M.SequentialLR(o, [M.ConstantLR(o, 0.2, 30), M.StepLR(o, 40, 0.5)], [30]),
                    M.MultiplicativeLR(o, lambda t: 0.998),
                ]
            )
        ],
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_lr_and_momentum_sequence_over_300_steps_equals_torch(case):
    kind, build = CASES[case]
    ours, theirs = make_pair(kind)
    z_scheds, t_scheds = build(Z, ours), build(T, theirs)
    assert group_values(ours) == group_values(theirs)
    for step in range(N_STEPS):
        theirs.step()
        for z, t in zip(z_scheds, t_scheds, strict=True):
            z.step()
            t.step()
        assert group_values(ours) == group_values(theirs), f"step {step}"
        assert z_scheds[-1].get_last_lr() == t_scheds[-1].get_last_lr()


TORCH_NAMES = [n for n in Z.__all__ if hasattr(T, n) and n != "LRScheduler"]


@pytest.mark.parametrize("name", TORCH_NAMES)
def test_torch_schedulers_have_torchs_parameters_and_defaults(name):
    ours = inspect.signature(getattr(Z, name).__init__).parameters
    theirs = inspect.signature(getattr(T, name).__init__).parameters
    assert [(k, p.default) for k, p in ours.items()] == [(k, p.default) for k, p in theirs.items()]


def test_lr_actually_changes_in_every_case():
    """Guards the torch comparison against a case that would pass by never moving lr."""
    for case, (kind, build) in CASES.items():
        ours, _ = make_pair(kind)
        scheds = build(Z, ours)
        seen = set()
        for _ in range(N_STEPS):
            for s in scheds:
                s.step()
            seen.add(ours.param_groups[0]["lr"])
        assert len(seen) > 2, case


class Param:
    """What zerosim's optimizers need of a parameter: .data and .grad arrays."""

    def __init__(self, data: np.ndarray) -> None:
        self.data, self.grad = data, None


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_zerosim_optimizer_driven_by_one_cycle_trains_like_torch(kind):
    """The optimizer really uses the lr and momentum/beta1 the scheduler writes."""
    rng = np.random.default_rng(0)
    init = [rng.standard_normal(4), rng.standard_normal(3)]
    ours = [Param(x.copy()) for x in init]
    theirs = [torch.tensor(x, requires_grad=True) for x in init]
    groups = SGD_GROUPS if kind == "sgd" else ADAM_GROUPS
    z_cls, t_cls = (ZO.SGD, torch.optim.SGD) if kind == "sgd" else (ZO.Adam, torch.optim.Adam)
    z_opt = z_cls([{"params": [p], **g} for p, g in zip(ours, groups, strict=True)], lr=0.1)
    t_opt = t_cls([{"params": [p], **g} for p, g in zip(theirs, groups, strict=True)], lr=0.1)
    z_sched = Z.OneCycleLR(z_opt, [0.5, 0.2], total_steps=60, three_phase=True)
    t_sched = T.OneCycleLR(t_opt, [0.5, 0.2], total_steps=60, three_phase=True)
    for _ in range(60):
        grads = [rng.standard_normal(x.shape) for x in init]
        for z, t, g in zip(ours, theirs, grads, strict=True):
            z.grad, t.grad = g.copy(), torch.from_numpy(g.copy())
        z_opt.step()
        t_opt.step()
        z_sched.step()
        t_sched.step()
        assert group_values(z_opt) == group_values(t_opt)
    for z, t, x in zip(ours, theirs, init, strict=True):
        np.testing.assert_allclose(z.data, t.detach().numpy(), rtol=1e-12, atol=1e-14)
        assert not np.allclose(z.data, x)


PLATEAU_CONFIGS = [
    dict(mode="min", patience=3),
    dict(mode="min", patience=2, threshold=0.05, threshold_mode="abs", cooldown=4, factor=0.5),
    dict(mode="max", patience=0, threshold_mode="rel", min_lr=[0.01, 0.02], factor=0.7),
    dict(mode="max", patience=5, threshold=0.01, threshold_mode="abs", eps=1e-3),
]


def plateau_metrics(mode: str) -> np.ndarray:
    """Noisy staircase: improves in bursts, stalls in between (seeded)."""
    rng = np.random.default_rng(7)
    base = 1.0 / (1.0 + np.arange(N_STEPS) // 25) + 0.02 * rng.standard_normal(N_STEPS)
    return base if mode == "min" else -base


@pytest.mark.parametrize("config", PLATEAU_CONFIGS, ids=lambda c: "-".join(map(str, c.values())))
def test_reduce_lr_on_plateau_equals_torch(config):
    ours, theirs = make_pair("sgd")
    z, t = Z.ReduceLROnPlateau(ours, **config), T.ReduceLROnPlateau(theirs, **config)
    reductions = 0
    for metric in plateau_metrics(config["mode"]):
        before = ours.param_groups[0]["lr"]
        z.step(metric)
        t.step(float(metric))
        reductions += ours.param_groups[0]["lr"] != before
        assert group_values(ours) == group_values(theirs)
        assert z.get_last_lr() == t.get_last_lr()
        assert (z.best, z.num_bad_epochs, z.cooldown_counter) == (
            t.best,
            t.num_bad_epochs,
            t.cooldown_counter,
        )
    assert reductions >= 2


def test_reduce_lr_on_plateau_reduces_a_param_group_added_later_like_torch():
    """One min_lr for all groups covers the new group; torch and zerosim step side by side."""
    ours, theirs = make_pair("sgd")
    z, t = Z.ReduceLROnPlateau(ours, patience=2), T.ReduceLROnPlateau(theirs, patience=2)
    for step, metric in enumerate(plateau_metrics("min")):
        if step == 40:
            ours.param_groups.append({"lr": 0.07, "momentum": 0.0})
            theirs.add_param_group({"params": [torch.zeros(2)], "lr": 0.07, "momentum": 0.0})
        z.step(metric)
        t.step(float(metric))
        assert group_values(ours) == group_values(theirs)
        assert z.get_last_lr() == t.get_last_lr() and z.min_lrs == t.min_lrs
    assert ours.param_groups[2]["lr"] < 0.07 and len(z.min_lrs) == 3


def test_reduce_lr_on_plateau_with_a_min_lr_list_raises_runtime_error_for_a_new_group():
    """As torch: RuntimeError when a reduction is due. Unlike torch nothing has changed, so the
    same step, repeated once min_lrs has three values, gives torch's values."""
    ours, theirs = make_pair("sgd")
    config = dict(patience=0, min_lr=[1e-5, 1e-4])
    z, t = Z.ReduceLROnPlateau(ours, **config), T.ReduceLROnPlateau(theirs, **config)
    ours.param_groups.append({"lr": 0.05, "momentum": 0.0})
    theirs.add_param_group({"params": [torch.zeros(2)], "lr": 0.05, "momentum": 0.0})
    z.step(1.0)
    t.step(1.0)
    before = z.state_dict()
    with pytest.raises(RuntimeError, match=r"The number of param groups in the optimizer \(3\)"):
        z.step(1.3)
    with pytest.raises(RuntimeError, match="The number of param groups in the"):
        t.step(1.3)  # torch's message starts so too
    assert z.state_dict() == before and group_values(ours)[2][0] == 0.05
    z.min_lrs.append(1e-6)
    fresh = T.ReduceLROnPlateau(make_pair("sgd")[1], **config)  # torch without the failed step
    fresh.optimizer.add_param_group({"params": [torch.zeros(2)], "lr": 0.05, "momentum": 0.0})
    fresh.min_lrs.append(1e-6)
    fresh.step(1.0)
    z.step(1.3)
    fresh.step(1.3)
    assert group_values(ours) == group_values(fresh.optimizer)
    assert [g["lr"] for g in ours.param_groups] == pytest.approx([0.01, 0.003, 0.005])


BAD_COMPOSITE = [
    (lambda o: Z.ChainedScheduler([]), ValueError, "at least one scheduler.*none"),
    (lambda o: Z.ChainedScheduler([Z.StepLR(o, 3), 7]), TypeError, r"schedulers\[1\].*int"),
    (
        lambda o: Z.ChainedScheduler([Z.StepLR(o, 3), Z.ReduceLROnPlateau(o)]),
        ValueError,
        r"schedulers\[1\].*ReduceLROnPlateau.*metric",
    ),
    (
        lambda o: Z.ChainedScheduler([Z.StepLR(o, 3), Z.StepLR(make_pair("sgd")[0], 3)]),
        ValueError,
        r"schedulers\[1\].*another optimizer",
    ),
    (
        lambda o: Z.ChainedScheduler([Z.StepLR(o, 3)], optimizer=make_pair("sgd")[0]),
        ValueError,
        r"schedulers\[0\].*another optimizer",
    ),
    (lambda o: Z.SequentialLR(o, [], []), ValueError, "at least one scheduler"),
    (lambda o: Z.MultiplicativeLR(o, 0.95), TypeError, "lr_lambda should be a function.*0.95"),
    (lambda o: Z.MultiplicativeLR(o, [0.95, 0.95]), TypeError, "lr_lambda should be a function"),
    (lambda o: Z.MultiplicativeLR(o, [lambda t: 0.9]), ValueError, "lr_lambda.*2.*got 1"),
]


@pytest.mark.parametrize("build, error, message", BAD_COMPOSITE)
def test_bad_chained_and_multiplicative_arguments_raise_as_torch_naming_them(build, error, message):
    ours, _ = make_pair("sgd")
    with pytest.raises(error, match=message):
        build(ours)


def test_chained_scheduler_re_points_its_children_with_its_optimizer():
    """What the engine does with a scheduler built on the user's optimizer: every child then
    writes the new optimizer's groups."""
    first, second = make_pair("sgd")[0], make_pair("sgd")[0]
    chained = Z.ChainedScheduler(
        [Z.ExponentialLR(first, 0.5), Z.MultiplicativeLR(first, Halving(1))]
    )
    sequential = Z.SequentialLR(first, [chained, Z.StepLR(first, 2)], milestones=[3])
    sequential.optimizer = second
    assert all(s.optimizer is second for s in (chained, *chained._schedulers))
    first_lrs = [g["lr"] for g in first.param_groups]
    chained.step()
    assert [g["lr"] for g in second.param_groups] == [0.1 * 0.25, 0.03 * 0.25]
    assert [g["lr"] for g in first.param_groups] == first_lrs


# ------------------------------------------- torch's own unit tests, their expected values kept
# test/optim/test_lrscheduler.py (torch 2.13): an SGD with two groups, lr 0.05 and 0.5; each
# epoch checks every group's lr against the target (atol 1e-5), then steps the schedulers.


def torch_test_optimizer() -> GroupsOnly:
    return GroupsOnly([{"lr": 0.05, "momentum": 0.0}, {"lr": 0.5, "momentum": 0.0}], {"lr": 0.05})


def run_torch_test(opt, schedulers, targets, epochs):
    for epoch in range(epochs):
        for group, target in zip(opt.param_groups, targets, strict=False):  # as torch's test
            assert group["lr"] == pytest.approx(target[epoch], abs=1e-5, rel=0), epoch
        for sched in schedulers:
            sched.step()


def test_torch_multiplicative_lr():
    opt = torch_test_optimizer()
    opt.param_groups[0]["lr"], opt.param_groups[1]["lr"] = 0.05, 0.4
    targets = [[0.05 * 0.9**x for x in range(10)], [0.4 * 0.8**x for x in range(10)]]
    run_torch_test(opt, [Z.MultiplicativeLR(opt, [lambda x1: 0.9, lambda x2: 0.8])], targets, 10)


_POLY = [(1.0 - x / 5) ** 0.9 for x in range(5)] + [0.0] * 5
# name: (children on an optimizer o, targets, epochs), torch's test_chained_lr1..5.
TORCH_CHAINED = {
    "chained_lr1": (
        lambda o: [Z.StepLR(o, gamma=0.1, step_size=3)],
        [[0.05] * 3 + [0.005] * 3 + [0.0005] * 3 + [0.00005] * 3],
        10,
    ),
    "chained_lr2": (
        lambda o: [Z.LinearLR(o, start_factor=0.4, total_iters=3)],
        [[0.02, 0.03, 0.04] + [0.05] * 9],
        10,
    ),
    "chained_lr3": (
        lambda o: [Z.LinearLR(o, start_factor=0.4, total_iters=3),
                   Z.MultiStepLR(o, milestones=[4, 8, 10], gamma=0.1)],
        [[0.02, 0.03, 0.04, 0.05] + [0.005] * 4 + [0.0005] * 3 + [0.00005] * 3],
        10,
    ),
    "chained_lr4": (
        lambda o: [Z.ExponentialLR(o, gamma=0.9), Z.ConstantLR(o, factor=0.2, total_iters=4),
                   Z.StepLR(o, gamma=0.1, step_size=3)],
        [[0.05 * 0.2 * 0.9**x for x in range(3)] + [0.05 * 0.2 * 0.9**3 * 0.1]
         + [0.05 * 0.9**x * 0.1 for x in range(4, 6)]
         + [0.05 * 0.9**x * 0.01 for x in range(6, 9)]],
        9,
    ),
    "chained_lr5": (
        lambda o: [Z.PolynomialLR(o, power=0.9, total_iters=5), Z.ConstantLR(o, factor=0.1)],
        [[0.05 * 0.1 * x for x in _POLY], [0.5 * 0.1 * x for x in _POLY]],
        10,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(TORCH_CHAINED))
def test_torch_chained_lr(name):
    build, targets, epochs = TORCH_CHAINED[name]
    opt = torch_test_optimizer()
    children = build(opt)
    chained = Z.ChainedScheduler(children)
    assert chained.get_last_lr() == children[-1].get_last_lr()  # ..._get_last_lr_before_step
    run_torch_test(opt, [chained], targets, epochs)
    assert chained.get_last_lr() == children[-1].get_last_lr()


def test_torch_sequentiallr5_with_a_chained_scheduler():
    opt = torch_test_optimizer()
    chained = Z.ChainedScheduler(
        [
            Z.LinearLR(opt, start_factor=0.1, total_iters=5),
            Z.ConstantLR(opt, factor=0.1, total_iters=5),
        ]
    )
    second = Z.ConstantLR(opt, factor=0.5, total_iters=5)
    sequential = Z.SequentialLR(opt, schedulers=[chained, second], milestones=[5])
    targets = [[0.0005, 0.0014, 0.0023, 0.0032, 0.0041] + [0.025] * 5]
    run_torch_test(opt, [sequential], targets, 10)


@pytest.mark.parametrize("min_lr", ["scalar", "list"])
def test_torch_add_param_group_does_not_break_reduce_lr_on_plateau(min_lr):
    opt = torch_test_optimizer()
    for group in opt.param_groups:
        group["lr"] = 0.5
    targets = [[0.5] * 6 + [0.05] * (5 + 6) + [0.005] * 4]
    metrics = [1] * 7 + [0.6] + [0.5] * 12
    sched = Z.ReduceLROnPlateau(
        opt, mode="min", threshold_mode="rel", threshold=0.1, patience=5, cooldown=5,
        min_lr=0 if min_lr == "scalar" else [1e-5, 1e-4],
    )  # fmt: skip
    for epoch in range(20):
        if epoch == 8:
            opt.param_groups.append({"lr": 0.05, "momentum": 0.0})
            if min_lr == "list":
                sched.min_lrs.append(1e-6)
        sched.step(metrics[epoch])
        for group, target in zip(opt.param_groups, targets, strict=False):  # group 0 only
            assert group["lr"] == pytest.approx(target[epoch], abs=1e-5, rel=0), epoch


def test_torch_add_param_group_errors_reduce_lr_on_plateau():
    opt = torch_test_optimizer()
    sched = Z.ReduceLROnPlateau(
        opt, mode="min", threshold_mode="rel", threshold=1e-5, patience=0, cooldown=0,
        min_lr=[1e-5, 1e-4],
    )  # fmt: skip
    opt.param_groups.append({"lr": 0.05, "momentum": 0.0})
    sched.step(1)
    with pytest.raises(RuntimeError, match="The number of param groups in the"):
        sched.step(1.3)


ROUND_TRIP_CASES = [
    "step",
    "cosine_restarts",
    "lambda",
    "sequential_three",
    "onecycle_cos_sgd",
    "cyclic_scale_fn_object_iterations",
    "cyclic_scale_fn_lambda_cycle",
    "multiplicative_per_group",
    "chained_three_with_optimizer",
    "chained_inside_sequential",
    "sequential_inside_chained",
]


@pytest.mark.parametrize("case", ROUND_TRIP_CASES)
def test_state_dict_round_trip_at_step_150_continues_like_the_uninterrupted_run(case):
    kind, build = CASES[case]
    ours, theirs = make_pair(kind)
    z, t = build(Z, ours)[0], build(T, theirs)[0]
    for _ in range(150):
        theirs.step()
        z.step()
        t.step()
    saved_groups, saved_state = copy.deepcopy(ours.param_groups), z.state_dict()
    # A fresh run: build the scheduler, restore the optimizer's groups, then the scheduler.
    resumed_opt, _ = make_pair(kind)
    resumed = build(Z, resumed_opt)[0]
    for group, saved in zip(resumed_opt.param_groups, saved_groups, strict=True):
        group.clear()
        group.update(saved)
    resumed.load_state_dict(saved_state)
    for _ in range(N_STEPS - 150):
        theirs.step()
        for s in (z, t, resumed):
            s.step()
        assert group_values(resumed_opt) == group_values(ours) == group_values(theirs)


INTERCHANGE_CASES = [
    "step",
    "cosine_restarts",
    "onecycle_linear_adam",
    "cyclic_scale_fn_object_iterations",
    "multiplicative_per_group",
    "chained_three_with_optimizer",
    "chained_inside_sequential",
]


@pytest.mark.parametrize("case", INTERCHANGE_CASES)
def test_torch_state_dict_loads_into_zerosim_scheduler_and_continues_like_torch(case):
    kind, build = CASES[case]
    _, theirs = make_pair(kind)
    t = build(T, theirs)[0]
    for _ in range(120):
        theirs.step()
        t.step()
    ours, _ = make_pair(kind)
    z = build(Z, ours)[0]
    for group, torch_group in zip(ours.param_groups, theirs.param_groups, strict=True):
        group.update({k: v for k, v in torch_group.items() if k != "params"})
    z.load_state_dict(t.state_dict())
    for _ in range(N_STEPS - 120):
        theirs.step()
        z.step()
        t.step()
        assert group_values(ours) == group_values(theirs)


@pytest.mark.parametrize("case", INTERCHANGE_CASES)
def test_zerosim_state_dict_loads_into_torch_scheduler_and_continues_like_zerosim(case):
    kind, build = CASES[case]
    ours, _ = make_pair(kind)
    z = build(Z, ours)[0]
    for _ in range(120):
        z.step()
    _, theirs = make_pair(kind)
    t = build(T, theirs)[0]
    for torch_group, group in zip(theirs.param_groups, ours.param_groups, strict=True):
        torch_group.update(group)
    t.load_state_dict(z.state_dict())
    for _ in range(N_STEPS - 120):
        theirs.step()
        z.step()
        t.step()
        assert group_values(ours) == group_values(theirs)


# torch's test_lr_scheduler_state_dict_load: a state_dict survives pickling and loads into a
# scheduler built afresh, whatever functions the scheduler holds.
@pytest.mark.parametrize("case", sorted(CASES))
def test_state_dict_pickles_and_loads_into_a_fresh_scheduler(case):
    kind, build = CASES[case]
    ours, _ = make_pair(kind)
    scheds = build(Z, ours)
    for _ in range(7):
        for sched in scheds:
            sched.step()
    state = scheds[-1].state_dict()
    loaded = pickle.loads(pickle.dumps(state))
    assert loaded == state
    fresh = build(Z, make_pair(kind)[0])[-1]
    fresh.load_state_dict(loaded)
    assert fresh.state_dict() == state


@pytest.mark.parametrize(
    "scale_fn, saved", [(lambda x: 0.9**x, None), (PowerScale(0.9), {"base": 0.9})]
)
def test_cyclic_lr_saves_a_scale_fn_as_torch_does(scale_fn, saved):
    """A function: None (it is not picklable in general); an object: a copy of its __dict__."""
    ours, theirs = make_pair("sgd")
    z = Z.CyclicLR(ours, 0.01, 0.1, 5, scale_fn=scale_fn)
    t = T.CyclicLR(theirs, 0.01, 0.1, 5, scale_fn=scale_fn)
    state = z.state_dict()
    assert state["_scale_fn_custom"] == t.state_dict()["_scale_fn_custom"] == saved
    assert state["_scale_fn_custom"] is not getattr(scale_fn, "__dict__", None)  # a copy
    assert pickle.loads(pickle.dumps(state)) == state


def test_scale_fn_and_lr_lambda_objects_get_their_attributes_back_as_in_torch():
    """The objects' state moves on mid-run; load_state_dict writes it into the fresh objects."""
    for module_a, module_b in ((T, Z), (Z, T)):
        opt_a, opt_b = make_pair("adam")[1], make_pair("adam")[1]
        cyclic_a = module_a.CyclicLR(opt_a, 0.01, 0.3, 11, scale_fn=PowerScale(0.99))
        mult_a = module_a.MultiplicativeLR(make_pair("sgd")[1], Halving(7))
        for _ in range(50):
            cyclic_a.step()
            mult_a.step()
        cyclic_a._scale_fn_custom.base = 0.95
        mult_a.lr_lambdas[0].every = 3
        cyclic_b = module_b.CyclicLR(opt_b, 0.01, 0.3, 11, scale_fn=PowerScale(0.5))
        mult_b = module_b.MultiplicativeLR(make_pair("sgd")[1], Halving(100))
        for group_b, group_a in zip(opt_b.param_groups, opt_a.param_groups, strict=True):
            group_b.update({k: v for k, v in group_a.items() if k != "params"})
        cyclic_b.load_state_dict(cyclic_a.state_dict())
        mult_b.load_state_dict(mult_a.state_dict())
        assert cyclic_b._scale_fn_custom.base == 0.95
        assert [f.every for f in mult_b.lr_lambdas] == [3, 3]
        for _ in range(100):
            cyclic_a.step()
            cyclic_b.step()
            assert group_values(opt_a) == group_values(opt_b)


def test_cyclic_lr_without_scale_fn_refuses_a_saved_scale_fn_object():
    ours, _ = make_pair("sgd")
    state = Z.CyclicLR(ours, 0.01, 0.1, scale_fn=PowerScale(0.9)).state_dict()
    plain = Z.CyclicLR(make_pair("sgd")[0], 0.01, 0.1, mode="triangular2")
    before = plain.state_dict()
    with pytest.raises(ValueError, match="scale_fn object.*built without scale_fn"):
        plain.load_state_dict(state)
    assert plain.state_dict() == before


def test_scheduler_state_dict_is_a_snapshot_not_a_live_view():
    ours, _ = make_pair("sgd")
    sched = Z.MultiStepLR(ours, [2, 4], gamma=0.5)
    state = sched.state_dict()
    for _ in range(5):
        sched.step()
    assert state["last_epoch"] == 0 and state["_last_lr"] == [0.1, 0.03]
    assert sched.last_epoch == 5


def test_resuming_with_last_epoch_needs_initial_lr_in_every_group():
    ours, _ = make_pair("sgd")
    with pytest.raises(KeyError, match=r"param_groups \[0, 1\].*initial_lr"):
        Z.StepLR(ours, step_size=3, last_epoch=10)


def test_onecycle_stepping_past_total_steps_raises_like_torch():
    ours, _ = make_pair("sgd")
    sched = Z.OneCycleLR(ours, 0.1, total_steps=5)
    for _ in range(5):
        sched.step()
    with pytest.raises(ValueError, match="total_steps=5"):
        sched.step()


BAD_TORCH_STYLE = [
    (lambda o: Z.StepLR(o, step_size=0), "step_size.*0"),
    (lambda o: Z.StepLR(o, step_size=3, gamma=-0.5), "gamma.*-0.5"),
    (lambda o: Z.MultiStepLR(o, [5, -1]), r"milestones.*\[5, -1\]"),
    (lambda o: Z.ExponentialLR(o, gamma=-1.0), "gamma.*-1.0"),
    (lambda o: Z.CosineAnnealingLR(o, T_max=0), "T_max.*0"),
    (lambda o: Z.CosineAnnealingLR(o, T_max=10, eta_min=-1e-3), "eta_min.*-0.001"),
    (lambda o: Z.LinearLR(o, start_factor=0.0), r"start_factor.*\(0, 1\].*0.0"),
    (lambda o: Z.LinearLR(o, end_factor=1.5), r"end_factor.*\[0, 1\].*1.5"),
    (lambda o: Z.LinearLR(o, total_iters=0), "total_iters.*0"),
    (lambda o: Z.LambdaLR(o, [lambda t: 1.0]), "lr_lambda.*2.*got 1"),
    (lambda o: Z.OneCycleLR(o, 0.1, total_steps=-3), "total_steps.*-3"),
    (lambda o: Z.OneCycleLR(o, 0.1), "total_steps.*epochs.*steps_per_epoch"),
    (lambda o: Z.OneCycleLR(o, 0.1, epochs=2, steps_per_epoch=0), "steps_per_epoch.*0"),
    (lambda o: Z.OneCycleLR(o, 0.1, total_steps=9, pct_start=1.5), "pct_start.*1.5"),
    (lambda o: Z.OneCycleLR(o, 0.1, total_steps=9, anneal_strategy="exp"), "anneal.*'exp'"),
    (lambda o: Z.OneCycleLR(o, [0.1, 0.2, 0.3], total_steps=9), "max_lr.*2.*got 3"),
    (lambda o: Z.ReduceLROnPlateau(o, mode="lowest"), "mode.*'lowest'"),
    (lambda o: Z.ReduceLROnPlateau(o, threshold_mode="pct"), "threshold_mode.*'pct'"),
    (lambda o: Z.ReduceLROnPlateau(o, factor=1.0), "factor.*1.0"),
    (lambda o: Z.ReduceLROnPlateau(o, patience=-1), "patience.*-1"),
    (lambda o: Z.ReduceLROnPlateau(o, min_lr=[0.1]), "min_lr.*got 1"),
    (lambda o: Z.SequentialLR(o, [Z.StepLR(o, 2), Z.StepLR(o, 3)], []), "milestones.*1.*got 0"),
]


@pytest.mark.parametrize("build, message", BAD_TORCH_STYLE)
def test_bad_torch_style_parameters_raise_value_error_naming_them(build, message):
    ours, _ = make_pair("sgd")
    with pytest.raises(ValueError, match=message):
        build(ours)


def test_onecycle_momentum_needs_an_optimizer_with_momentum_or_betas():
    plain = GroupsOnly([{"lr": 0.1}], {"lr": 0.1})
    with pytest.raises(ValueError, match="momentum.*betas"):
        Z.OneCycleLR(plain, 0.1, total_steps=10)
    Z.OneCycleLR(plain, 0.1, total_steps=10, cycle_momentum=False)  # fine without cycling


def test_object_without_param_groups_is_rejected():
    with pytest.raises(TypeError, match="param_groups.*int"):
        Z.StepLR(3, step_size=2)


# ---------------------------------------------------------------- DeepSpeed's schedulers
# Expected values are written from DeepSpeed's documented formulas, independently of the
# implementation, with k = the batch iteration the step() moved to (0 after the first step).


def warmup_fraction(kind: str, k: int, n: int) -> float:
    if kind == "log":
        return math.log(k + 1, n)  # log base n of (k + 1)
    return k / n


def run_ds(sched, opt, n: int = N_STEPS) -> list[list[float]]:
    lrs = []
    for _ in range(n):
        sched.step()
        lrs.append([g["lr"] for g in opt.param_groups])
    return lrs


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_follows_its_formula(kind):
    opt, _ = make_pair("adam")
    lo, hi, n = [1e-4, 0.0], [1e-2, 5e-3], 100
    sched = Z.WarmupLR(opt, lo, hi, warmup_num_steps=n, warmup_type=kind)
    assert [g["lr"] for g in opt.param_groups] == lo  # construction writes warmup_min_lr
    for k, lrs in enumerate(run_ds(sched, opt)):
        gamma = warmup_fraction(kind, k, n) if k < n else 1.0
        expected = [a + (b - a) * gamma for a, b in zip(lo, hi, strict=True)]
        assert lrs == pytest.approx(expected, rel=1e-12, abs=1e-18)


def test_warmup_lr_hand_checked_points_with_deepspeed_defaults():
    opt, _ = make_pair("sgd")  # groups' lr: 0.1 and 0.03, the default warmup_max_lr
    sched = Z.WarmupLR(opt)  # min 0, max each group's lr, 1000 steps, 'log'
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]
    lrs = run_ds(sched, opt, 1001)
    # k=9: ln(10)/ln(1000) = 1/3; k=99: ln(100)/ln(1000) = 2/3; k=999 and after: 1.
    assert lrs[9][0] == pytest.approx(0.1 / 3, rel=1e-12)
    assert lrs[99][1] == pytest.approx(0.06 / 3, rel=1e-12)
    assert lrs[999][0] == pytest.approx(0.1, rel=1e-12) and lrs[1000][1] == 0.03
    opt, _ = make_pair("sgd")
    linear = Z.WarmupLR(opt, warmup_max_lr=1e-3, warmup_type="linear")
    # linear: k=250 of 1000 -> a quarter of the way to 1e-3.
    assert run_ds(linear, opt, 251)[250][0] == pytest.approx(2.5e-4, rel=1e-12)


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr_follows_its_formula(kind):
    opt, _ = make_pair("sgd")
    lo, hi, n, total = 1e-4, 1e-2, 60, 250
    sched = Z.WarmupDecayLR(opt, total, lo, hi, warmup_num_steps=n, warmup_type=kind)
    lrs = run_ds(sched, opt)
    for k, (lr, _) in enumerate(lrs):
        if k < n:
            gamma = warmup_fraction(kind, k, n)
        else:
            gamma = max(0.0, (total - k) / (total - n))
        assert lr == pytest.approx(lo + (hi - lo) * gamma, rel=1e-12)
    # Hand check: k=155 is halfway from 60 to 250 -> (lo + hi) / 2; from k=250 on: lo.
    assert lrs[155][0] == pytest.approx((1e-4 + 1e-2) / 2, rel=1e-12)
    assert lrs[250][0] == lrs[299][0] == 1e-4


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr_follows_its_formula(kind):
    opt, _ = make_pair("adam")  # groups' lr0: 0.1 and 0.03
    n, total, wmr, cmr = 50, 300, 0.1, 0.01
    sched = Z.WarmupCosineLR(opt, total, wmr, n, cmr, warmup_type=kind)
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]  # DeepSpeed writes 0 at k = -1
    lrs = run_ds(sched, opt, 2 * total)
    for k, (lr0, lr1) in enumerate(lrs):
        if k < n:
            ratio = wmr + (1 - wmr) * warmup_fraction(kind, k, n)
        else:  # from k = total - 1 on, the floor: the cosine does not come back up
            angle = math.pi * min(1.0, (k - n + 1) / (total - n))
            ratio = cmr + (1 - cmr) * 0.5 * (1 + math.cos(angle))
        assert (lr0, lr1) == pytest.approx((0.1 * ratio, 0.03 * ratio), rel=1e-12)
    # Hand checks: k=174 is 125 of 250 cosine steps -> cos(pi/2) = 0 -> ratio 0.505;
    # k=299 is the end -> cos(pi) = -1 -> ratio = cos_min_ratio = 0.01.
    assert lrs[174][0] == pytest.approx(0.1 * 0.505, rel=1e-12)
    assert lrs[299][1] == pytest.approx(0.03 * 0.01, rel=1e-12)
    assert lrs[599][1] == lrs[299][1]
    if kind == "linear":  # k=25 of 50: halfway from 0.1 to 1 -> 0.55
        assert lrs[25][0] == pytest.approx(0.1 * 0.55, rel=1e-12)


def test_deepspeed_one_cycle_follows_its_formula_with_decay_and_betas():
    opt, _ = make_pair("adam")
    lo, hi, s1, s2, lr_rate, decay_size = 0.01, 0.1, 50, 100, 0.5, 10
    m_lo, m_hi, m_rate = 0.8, 0.9, 0.01
    sched = Z.OneCycle(
        opt, lo, hi, decay_lr_rate=lr_rate, cycle_first_step_size=s1, cycle_second_step_size=s2,
        decay_step_size=decay_size, cycle_min_mom=m_lo, cycle_max_mom=m_hi, decay_mom_rate=m_rate,
    )  # fmt: skip
    assert [g["lr"] for g in opt.param_groups] == [lo, lo]
    assert [g["betas"] for g in opt.param_groups] == [(m_lo, 0.99)] * 2
    for k in range(N_STEPS):
        sched.step()
        b = k + 1
        if b <= s1:  # rising edge of the triangle
            frac = b / s1
        elif b <= s1 + s2:  # falling edge
            frac = (s1 + s2 - b) / s2
        if b <= s1 + s2:
            lr, beta1 = lo + (hi - lo) * frac, m_hi - (m_hi - m_lo) * frac
        else:  # post-cycle decay
            d = (b - s1 - s2) / decay_size
            lr, beta1 = lo / (1 + lr_rate * d), m_hi * (1 + m_rate * d)
        for group in opt.param_groups:
            assert group["lr"] == pytest.approx(lr, rel=1e-12)
            assert group["betas"][0] == pytest.approx(beta1, rel=1e-12)
            assert group["betas"][1] == 0.99
        # Hand checks: k=49 is the peak; k=99 is halfway down; k=159 is one decay interval.
        if k == 49:
            assert group["lr"] == pytest.approx(0.1) and group["betas"][0] == pytest.approx(0.8)
        if k == 99:
            assert group["lr"] == pytest.approx(0.055) and group["betas"][0] == pytest.approx(0.85)
        if k == 159:
            assert group["lr"] == pytest.approx(0.01 / 1.5)


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test_follows_its_formula(staircase):
    opt, _ = make_pair("adam")
    lo, size, rate = [1e-4, 3e-4], 25, 0.5
    sched = Z.LRRangeTest(opt, lo, size, rate, staircase)
    assert [g["lr"] for g in opt.param_groups] == lo  # construction writes the floor
    for k, lrs in enumerate(run_ds(sched, opt)):
        interval = (k + 1) // size if staircase else (k + 1) / size
        assert lrs == pytest.approx([x * (1 + rate * interval) for x in lo], rel=1e-12)
    # Hand checks with one floor, 0.01: k = 24 ends the first interval (x 1.5), k = 99 the
    # fourth (x 3); the staircase holds x 1 up to k = 23 and x 2.5 over k = 74..98.
    opt, _ = make_pair("sgd")
    got = run_ds(Z.LRRangeTest(opt, 0.01, size, rate, staircase), opt, 100)
    assert got[24][0] == pytest.approx(0.015) and got[99][1] == pytest.approx(0.03)
    if staircase:
        assert got[23][0] == 0.01 and got[74][0] == pytest.approx(0.025) == got[98][0]
    else:
        assert got[23][0] == pytest.approx(0.01 * (1 + 0.5 * 24 / 25))


def test_deepspeed_one_cycle_without_betas_leaves_momentum_alone_and_holds_min_lr():
    opt, _ = make_pair("sgd")
    sched = Z.OneCycle(opt, 0.001, 0.01, cycle_first_step_size=20)  # no decay: defaults
    lrs = run_ds(sched, opt, 100)
    assert not sched.cycle_momentum
    assert [g["momentum"] for g in opt.param_groups] == [0.9, 0.5]
    assert lrs[19][0] == pytest.approx(0.01) and lrs[29][0] == pytest.approx(0.0055)
    assert lrs[39][0] == pytest.approx(0.001) and lrs[99] == [0.001, 0.001]


@pytest.mark.parametrize(
    "build",
    [
        lambda o: Z.WarmupLR(o, 0.0, 0.01, 40, "linear"),
        lambda o: Z.WarmupDecayLR(o, 200, 0.0, 0.01, 40),
        lambda o: Z.WarmupCosineLR(o, 200, 0.05, 40),
        lambda o: Z.OneCycle(o, 0.001, 0.01, 0.2, 30, 60, decay_step_size=5),
        lambda o: Z.LRRangeTest(o, [1e-3, 2e-3], 7, 0.3, True),
    ],
    ids=["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"],
)
def test_deepspeed_scheduler_state_dict_round_trip(build):
    opt, _ = make_pair("adam")
    sched = build(opt)
    run_ds(sched, opt, 70)
    state = sched.state_dict()
    assert state == {"last_batch_iteration": 69}
    fresh_opt, _ = make_pair("adam")
    fresh = build(fresh_opt)
    fresh.load_state_dict(state)
    assert run_ds(fresh, fresh_opt, 200) == run_ds(sched, opt, 200)


def test_deepspeed_step_accepts_an_explicit_iteration():
    opt, _ = make_pair("sgd")
    sched = Z.WarmupLR(opt, 0.0, 1.0, 100, "linear")
    sched.step(40)
    assert sched.get_last_lr() == [0.4, 0.4] and sched.last_batch_iteration == 40


BAD_DS = [
    (lambda o: Z.WarmupLR(o, warmup_type="exp"), "warmup_type.*'exp'"),
    (lambda o: Z.WarmupLR(o, warmup_min_lr=-1e-3), "warmup_min_lr.*-0.001"),
    (lambda o: Z.WarmupLR(o, warmup_num_steps=-5), "warmup_num_steps.*-5"),
    (lambda o: Z.WarmupDecayLR(o, total_num_steps=2.5), "total_num_steps.*2.5"),
    (lambda o: Z.WarmupLR(o, warmup_num_steps=0), "warmup_num_steps.*>= 1.*0"),
    (lambda o: Z.WarmupCosineLR(o, 1000, warmup_num_steps=0), "warmup_num_steps.*>= 1.*0"),
    (lambda o: Z.WarmupCosineLR(o, 2000, cos_min_ratio=-0.1), "cos_min_ratio.*-0.1"),
    (lambda o: Z.OneCycle(o, 0.1, 1.0, cycle_first_step_size=0), "cycle_first_step_size.*0"),
    (lambda o: Z.OneCycle(o, -0.1, 1.0), "cycle_min_lr.*-0.1"),
    (lambda o: Z.WarmupLR(o, warmup_max_lr=[0.1]), "warmup_max_lr.*2.*got 1"),
    (lambda o: Z.LRRangeTest(o, lr_range_test_step_size=0), "lr_range_test_step_size.*>= 1.*0"),
    (lambda o: Z.LRRangeTest(o, lr_range_test_step_size=2.5), "lr_range_test_step_size.*2.5"),
    (lambda o: Z.LRRangeTest(o, lr_range_test_min_lr=[0.1]), "lr_range_test_min_lr.*2.*got 1"),
    (lambda o: Z.LRRangeTest(o, lr_range_test_min_lr=-0.1), "lr_range_test_min_lr.*-0.1"),
    (lambda o: Z.LRRangeTest(o, lr_range_test_step_rate=-1.0), "lr_range_test_step_rate.*-1.0"),
    (lambda o: Z.LRRangeTest(o, lr_range_test_staircase="false"), "staircase.*true, false, 0 or 1"),
    # a number that is not one: named with the value and what is allowed, not a bare TypeError
    (
        lambda o: Z.LRRangeTest(o, lr_range_test_min_lr="0.1"),
        r"lr_range_test_min_lr must be a finite number >= 0.*got '0.1'",
    ),
    (lambda o: Z.WarmupLR(o, warmup_max_lr="1e-3"), r"warmup_max_lr must be a finite.*'1e-3'"),
    (lambda o: Z.WarmupLR(o, warmup_min_lr=float("nan")), r"warmup_min_lr must be a finite.*nan"),
    (lambda o: Z.WarmupLR(o, warmup_max_lr=[0.1, math.inf]), r"warmup_max_lr must.*inf\]"),
    (lambda o: Z.OneCycle(o, 0.1, True), r"cycle_max_lr must be a finite number.*True"),
    (lambda o: Z.WarmupCosineLR(o, 2000, cos_min_ratio=None), r"cos_min_ratio must.*None"),
]


@pytest.mark.parametrize("build, message", BAD_DS)
def test_bad_deepspeed_parameters_raise_value_error_naming_them(build, message):
    opt, _ = make_pair("sgd")
    with pytest.raises(ValueError, match=message):
        build(opt)


# ---------------------------------------------------------------- build_scheduler


def test_build_scheduler_from_a_deepspeed_section_equals_direct_construction():
    section = {
        "type": "WarmupDecayLR",
        "params": {"total_num_steps": 500, "warmup_max_lr": 3e-3, "warmup_num_steps": 50},
    }
    built_opt, _ = make_pair("adam")
    direct_opt, _ = make_pair("adam")
    built = Z.build_scheduler(section["type"], built_opt, section["params"])
    direct = Z.WarmupDecayLR(direct_opt, 500, warmup_max_lr=3e-3, warmup_num_steps=50)
    assert isinstance(built, Z.WarmupDecayLR)
    assert run_ds(built, built_opt, 200) == run_ds(direct, direct_opt, 200)


def test_build_scheduler_accepts_torch_type_names():
    ours, theirs = make_pair("sgd")
    z = Z.build_scheduler("CosineAnnealingLR", ours, {"T_max": 40, "eta_min": 1e-4})
    t = T.CosineAnnealingLR(theirs, T_max=40, eta_min=1e-4)
    for _ in range(60):
        theirs.step()
        z.step()
        t.step()
    assert group_values(ours) == group_values(theirs)


def test_build_scheduler_builds_lr_range_test_and_the_python_only_types():
    built_opt, direct_opt = make_pair("adam")[0], make_pair("adam")[0]
    params = {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 9}
    built = Z.build_scheduler("LRRangeTest", built_opt, params)
    direct = Z.LRRangeTest(direct_opt, 1e-4, 9)
    assert run_ds(built, built_opt, 40) == run_ds(direct, direct_opt, 40)
    opt, _ = make_pair("sgd")
    children = [Z.MultiplicativeLR(opt, lambda t: 0.9), Z.StepLR(opt, 2)]
    chained = Z.build_scheduler("ChainedScheduler", opt, {"schedulers": children})
    assert isinstance(chained, Z.ChainedScheduler) and chained.optimizer is opt
    with pytest.raises(ValueError, match=r"ChainedScheduler needs params \['schedulers'\]"):
        Z.build_scheduler("ChainedScheduler", opt, {})


@pytest.mark.parametrize(
    "name, params, message",
    [
        ("WarmupExp", {}, r"'WarmupExp' is unknown; allowed: \[.*'OneCycle'.*'WarmupLR'"),
        ("WarmupLR", {"warmup_max": 0.1}, r"\['warmup_max'\].*allowed.*'warmup_max_lr'"),
        ("WarmupCosineLR", {"warmup_num_steps": 10}, r"needs params \['total_num_steps'\]"),
        ("StepLR", {"gamma": 0.5}, r"StepLR needs params \['step_size'\]"),
        ("OneCycle", [0.1, 1.0], "params of scheduler OneCycle must be a dict"),
    ],
)
def test_build_scheduler_rejects_unknown_types_and_params_naming_them(name, params, message):
    opt, _ = make_pair("sgd")
    with pytest.raises(ValueError, match=message):
        Z.build_scheduler(name, opt, params)


# ------------------------------------------- DeepSpeed's own schedulers as the oracle

DS_STEPS = 2100  # past every phase of the grid below (the longest cycle or decay is 2000)


def _deepspeed_grid() -> list[tuple[str, str, dict]]:
    """(scheduler, optimizer kind, params): a grid over each DeepSpeed scheduler's knobs."""
    grid = []
    for n, kind, bounds in itertools.product(
        (1, 2, 10, 999),
        ("log", "linear"),
        ({}, {"warmup_min_lr": 1e-4, "warmup_max_lr": [1e-2, 2e-2]}),
    ):
        grid.append(("WarmupLR", "sgd", {"warmup_num_steps": n, "warmup_type": kind, **bounds}))
    for total, n, kind in itertools.product((1, 150, 2000), (1, 10, 500), ("log", "linear")):
        params = {"total_num_steps": total, "warmup_num_steps": n, "warmup_type": kind}
        grid.append(("WarmupDecayLR", "adam", {**params, "warmup_min_lr": 1e-5}))
    for total, n, wmr, cmr in itertools.product(
        (5, 300, 2000), (1, 10, 300), (0.0, 0.2), (1e-4, 0.3)
    ):
        params = {"total_num_steps": total, "warmup_num_steps": n, "warmup_min_ratio": wmr}
        grid.append(
            ("WarmupCosineLR", "sgd", {**params, "cos_min_ratio": cmr, "warmup_type": "linear"})
        )
    grid.append(("WarmupCosineLR", "adam", {"total_num_steps": 700, "warmup_num_steps": 40}))
    # DeepSpeed's TestLrRange grid (min_lr, step_rate, step_size, staircase), then wider.
    for min_lr, rate, size, staircase in [
        (1e-4, 1e-5, 1, True), (1e-5, 1e-5, 1, False), (1e-4, 1e-3, 10, True),
        (1e-3, 1e-3, 10, False), (1e-2, 1e-2, 19, True), (1e-2, 1e-2, 19, False),
        ([1e-3, 5e-4], 1.0, 2000, False), ([1e-3, 5e-4], 0.7, 333, True), (1e-3, 0.0, 7, False),
    ]:  # fmt: skip
        params = {
            "lr_range_test_min_lr": min_lr,
            "lr_range_test_step_rate": rate,
            "lr_range_test_step_size": size,
            "lr_range_test_staircase": staircase,
        }
        grid.append(("LRRangeTest", "adam" if staircase else "sgd", params))
    grid.append(("LRRangeTest", "sgd", {}))  # DeepSpeed's defaults
    cycles = ((400, None), (300, 700), (250, 0), (1, 1))
    stairs = ((0, None), (4, None), (3, 7), (5, 0))
    decays = ((0, 0.0, 0.0), (50, 0.5, 0.0), (20, 0.1, 0.02))
    for (first, second), (s1, s2), (every, lr_rate, mom_rate), kind in itertools.product(
        cycles, stairs, decays, ("sgd", "adam")
    ):
        params = {
            "cycle_min_lr": [1e-3, 2e-3],
            "cycle_max_lr": 1e-1,
            "cycle_first_step_size": first,
            "cycle_second_step_size": second,
            "cycle_first_stair_count": s1,
            "cycle_second_stair_count": s2,
            "decay_step_size": every,
            "decay_lr_rate": lr_rate,
            "decay_mom_rate": mom_rate,
            "cycle_min_mom": 0.85,
            "cycle_max_mom": [0.95, 0.9],
        }
        grid.append(("OneCycle", kind, params))
    return grid


DS_GRID = _deepspeed_grid()


@pytest.mark.parametrize(
    "name, kind, params", DS_GRID, ids=[f"{n}-{k}-{i}" for i, (n, k, _) in enumerate(DS_GRID)]
)
def test_deepspeed_scheduler_equals_deepspeeds_class_over_2100_steps(name, kind, params):
    """zerosim's scheduler and DeepSpeed 0.19.8's, each on its own torch optimizer with the
    same two groups: the lr (and OneCycle's betas) at construction and after every step."""
    schedules = pytest.importorskip(
        "deepspeed.runtime.lr_schedules",
        reason="DeepSpeed is the oracle (pip install -e '.[test]')",
    )
    ours, theirs = make_pair(kind)[1], make_pair(kind)[1]
    z = getattr(Z, name)(ours, **copy.deepcopy(params))
    d = getattr(schedules, name)(theirs, **copy.deepcopy(params))
    assert group_values(ours) == group_values(theirs)
    for step in range(DS_STEPS):
        z.step()
        d.step()
        assert group_values(ours) == group_values(theirs), (step, group_values(ours))
    assert z.get_last_lr() == d.get_last_lr()
    assert z.state_dict() == d.state_dict()
