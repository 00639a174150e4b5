"""Schedulers inside the engine: checkpoints of schedulers that hold user functions, schedulers
built on the user's optimizer, and DeepSpeed's LRRangeTest from a config section (DeepSpeed's
own tests/unit/runtime/test_lr_schedulers.py, adapted, its parameters and checks kept)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from ckpt_worker import Case, build_model, config, train_steps

import zerosim as zs
import zerosim.optim.lr_scheduler as Z
from zerosim.engine import initialize
from zerosim.errors import ConfigError
from zerosim.nn import MLP


class PowerScale:
    """A CyclicLR ``scale_fn`` object; its ``base`` is state that a checkpoint must keep."""

    def __init__(self, base: float) -> None:
        self.base = base

    def __call__(self, x: float) -> float:
        return self.base**x


class Halving:
    """A MultiplicativeLR ``lr_lambda`` object: halves the lr every ``every`` steps."""

    def __init__(self, every: int) -> None:
        self.every = every

    def __call__(self, epoch: int) -> float:
        return 0.5 if epoch % self.every == 0 else 1.0


# name: (factory given to initialize(lr_scheduler=...), the user function objects whose
# attributes change after the save point, as a function of the scheduler).
FACTORIES = {
    "CyclicLR, scale_fn a lambda": lambda o: Z.CyclicLR(o, 1e-3, 1e-2, 3, scale_fn=lambda c: 1 / c),
    "CyclicLR, scale_fn an object": lambda o: Z.CyclicLR(
        o, 1e-3, 1e-2, 2, 3, scale_fn=PowerScale(0.9), scale_mode="iterations"
    ),
    "MultiplicativeLR, a lambda": lambda o: Z.MultiplicativeLR(o, lambda t: 0.8),
    "ChainedScheduler": lambda o: Z.ChainedScheduler(
        [Z.MultiplicativeLR(o, Halving(2)), Z.StepLR(o, step_size=3, gamma=0.3)]
    ),
}


def user_objects(sched) -> list:
    """The callable objects a scheduler holds (whose __dict__ torch's state_dict saves)."""
    children = getattr(sched, "_schedulers", [sched])
    found = [getattr(s, "_scale_fn_custom", None) for s in children]
    found += [fn for s in children for fn in getattr(s, "lr_lambdas", [])]
    return [f for f in found if isinstance(f, PowerScale | Halving)]


def hyper(engine) -> list[tuple]:
    return [(g["lr"], g.get("betas")) for g in engine.optimizer.param_groups]


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_checkpoint_with_a_scheduler_holding_user_functions_resumes_its_schedule(tmp_path, name):
    """Save at 2 ranks after 4 steps, change the function objects' state, go on 4 steps; a
    3-rank engine built afresh loads the save and must step through the same lrs (and betas),
    with the objects' attributes as they were saved."""
    case = Case(model="mlp", stage=1)

    def save(comm):
        engine, *_ = initialize(
            build_model(case), config(case), comm=comm, lr_scheduler=FACTORIES[name]
        )
        nxt = train_steps(engine, comm, case, 4, 0)
        for obj in user_objects(engine.lr_scheduler):  # their state at the save point
            obj.__dict__.update({k: v * 0.5 for k, v in obj.__dict__.items()})
        saved_attrs = [dict(obj.__dict__) for obj in user_objects(engine.lr_scheduler)]
        engine.save_checkpoint(tmp_path, client_state={"next_sample": nxt})
        state = engine.lr_scheduler.state_dict()
        after = []
        for _ in range(4):
            nxt = train_steps(engine, comm, case, 1, nxt)
            after.append(hyper(engine))
        return state, saved_attrs, after

    def load(comm):
        engine, *_ = initialize(
            build_model(case), config(case), comm=comm, lr_scheduler=FACTORIES[name]
        )
        _, client = engine.load_checkpoint(tmp_path)
        state = engine.lr_scheduler.state_dict()
        attrs = [dict(obj.__dict__) for obj in user_objects(engine.lr_scheduler)]
        nxt, after = client["next_sample"], []
        for _ in range(4):
            nxt = train_steps(engine, comm, case, 1, nxt)
            after.append(hyper(engine))
        return state, attrs, after

    saved_state, saved_attrs, want = zs.LocalWorld(2).run(save)[0]
    state, attrs, got = zs.LocalWorld(3).run(load)[0]
    assert state == saved_state and attrs == saved_attrs
    assert got == want
    assert len({lrs[0][0] for lrs in want}) > 1  # the schedule moves over these steps
    if "object" in name or name == "ChainedScheduler":
        assert saved_attrs  # the objects' changed attributes came back through the file


@pytest.mark.parametrize("kind", ["ChainedScheduler", "SequentialLR"])
def test_scheduler_of_schedulers_built_on_the_users_optimizer_drives_the_engine(kind):
    """initialize() re-points a scheduler object to the engine's optimizer: its children too."""
    case = Case(model="mlp", stage=2)

    def run(comm):
        model = build_model(case)
        opt = zs.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
        first, second = Z.ExponentialLR(opt, 0.5), Z.StepLR(opt, step_size=2, gamma=0.1)
        if kind == "ChainedScheduler":
            sched = Z.ChainedScheduler([first, second])
        else:
            sched = Z.SequentialLR(opt, [first, second], milestones=[2])
        cfg = {k: v for k, v in config(case).items() if k != "optimizer"}
        engine, *_ = initialize(model, cfg, comm=comm, optimizer=opt, lr_scheduler=sched)
        lrs = []
        for step in range(4):
            train_steps(engine, comm, case, 1, step * comm.size * case.micro)
            lrs.append(engine.get_lr()[0])
        return lrs

    lrs = zs.LocalWorld(2).run(run)[0]
    if kind == "ChainedScheduler":  # 0.5^t, times 0.1 at t = 2 and 4
        want = [0.005, 0.0025 * 0.1, 0.00125 * 0.1, 0.000625 * 0.01]
    else:  # ExponentialLR for t < 2, then StepLR restarted at t = 2
        want = [0.005, 0.01, 0.01, 0.001]
    assert lrs == pytest.approx(want, rel=1e-12)


# ------------------------------------------------------- LRRangeTest from a config section


def one_rank_engine(scheduler: dict):
    """DeepSpeed's tests' set-up: train_batch_size 2 on one rank, Adam lr 0.00015, clip 1."""
    cfg = {
        "train_batch_size": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
        "scheduler": scheduler,
        "gradient_clipping": 1.0,
        "zerosim": {"dtype": "float32"},
    }
    model = MLP([10, 10, 10], seed=0, dtype="float32")
    engine, _, _, sched = initialize(model, cfg, comm=zs.LocalWorld(1).comms()[0])
    return engine, sched


def train_batches(engine, n: int, before_each=None) -> None:
    rng = np.random.default_rng(0)
    for _ in range(n):
        if before_each is not None:
            before_each()
        loss = engine(rng.standard_normal((2, 10)), rng.integers(0, 10, 2))
        engine.backward(loss)
        engine.step()


@pytest.mark.parametrize(
    "min_lr, step_rate, step_size, staircase",
    [(1e-4, 1e-5, 1, True), (1e-5, 1e-5, 1, False), (1e-4, 1e-3, 10, True),
     (1e-3, 1e-3, 10, False), (1e-2, 1e-2, 19, True), (1e-2, 1e-2, 19, False)],
)  # fmt: skip
def test_deepspeed_lr_range(min_lr, step_rate, step_size, staircase):
    """DeepSpeed's TestLrRange: lr before each batch starts at min_lr, then rises in stairs of
    step_size batches or strictly at every batch."""
    params = {
        "lr_range_test_min_lr": min_lr,
        "lr_range_test_step_rate": step_rate,
        "lr_range_test_step_size": step_size,
        "lr_range_test_staircase": staircase,
    }
    engine, sched = one_rank_engine({"type": "LRRangeTest", "params": params})
    assert isinstance(sched, Z.LRRangeTest)
    step_lrs: list[float] = []
    train_batches(engine, max(50, step_size * 2), lambda: step_lrs.extend(sched.get_lr()))
    assert step_lrs[0] == min_lr
    if staircase:
        for i in range(0, len(step_lrs), step_size):
            assert all(v == step_lrs[i] for v in step_lrs[i : i + step_size])
        assert step_lrs[-1] > step_lrs[0]
    else:
        assert all(a < b for a, b in zip(step_lrs, step_lrs[1:], strict=False))


def test_deepspeed_scheduler_optimizer_parity_and_get_lr_before_train():
    """DeepSpeed's TestSchedulerOptimizerParity and TestGetLrBeforeTrain for LRRangeTest: the
    scheduler's lr is the optimizer's after every step, and get_lr works before training."""
    scheduler = {
        "type": "LRRangeTest",
        "params": {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 1},
    }
    engine, sched = one_rank_engine(scheduler)
    assert sched.get_lr() == engine.get_lr() == [1e-4]
    seen = []

    def check():
        assert sched.get_lr() == engine.get_lr()
        seen.append(engine.get_lr()[0])

    train_batches(engine, 50, check)
    assert seen[49] == pytest.approx(1e-4 * (1 + 49))  # default rate 1.0, one step per batch
    engine, sched = one_rank_engine({"type": "LRRangeTest", "params": {}})
    assert sched.get_lr() == [1e-3]  # DeepSpeed's default floor
    train_batches(engine, 3)


@pytest.mark.parametrize(
    "params, key, value",
    [
        ({"lr_range_test_step_size": 0}, "lr_range_test_step_size", "0"),
        ({"lr_range_test_step_size": 2.5}, "lr_range_test_step_size", "2.5"),
        ({"lr_range_test_min_lr": [1e-3, 1e-3]}, "lr_range_test_min_lr", "got 2"),
        ({"lr_range_test_min_lr": -1e-3}, "lr_range_test_min_lr", "-0.001"),
        ({"lr_range_test_step_rate": -2}, "lr_range_test_step_rate", "-2"),
        ({"lr_range_test_staircase": "false"}, "lr_range_test_staircase", "'false'"),
        ({"lr_range_test_min": 1e-3}, "lr_range_test_min", "allowed"),
    ],
)
def test_bad_lr_range_test_params_are_a_config_error_naming_key_value_and_allowed(
    params, key, value
):
    with pytest.raises(ConfigError) as error:
        one_rank_engine({"type": "LRRangeTest", "params": params})
    message = str(error.value)
    assert error.value.path == "scheduler.params" and "allowed: params of LRRangeTest" in message
    assert key in message and value in message


def test_lr_range_test_section_round_trips_through_a_checkpoint(tmp_path):
    scheduler = {
        "type": "LRRangeTest",
        "params": {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 3},
    }
    engine, _ = one_rank_engine(copy.deepcopy(scheduler))
    train_batches(engine, 5)
    engine.save_checkpoint(tmp_path, tag="t")
    want = []
    train_batches(engine, 4, lambda: want.append(engine.get_lr()))
    fresh, _ = one_rank_engine(copy.deepcopy(scheduler))
    fresh.load_checkpoint(tmp_path)
    assert fresh.lr_scheduler.state_dict() == {"last_batch_iteration": 4}
    got = []
    train_batches(fresh, 4, lambda: got.append(fresh.get_lr()))
    assert got == want
    meta = json.loads((tmp_path / "t" / "metadata.json").read_text())
    assert meta["objects"]["lr_scheduler_class"] == "LRRangeTest"
