"""Misuse of the engine's verbs and of initialize: one clear error each, before anything is sent.

docs/faults.md lists these messages; test_engine.py holds the older ones (step without backward,
a loss from another engine or from an earlier forward).
"""

import numpy as np
import pytest

import zerosim as zs
from zerosim.engine import initialize
from zerosim.errors import ConfigError
from zerosim.nn import MLP, Parameter

X, Y = np.ones((2, 4), np.float32), np.array([0, 1])


def _cfg(stage=2, **extra):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": stage},
        **extra,
    }


def _on_two_ranks(check, stage=2):
    """Run ``check(engine)`` on both ranks of a LocalWorld(2), each with its own engine."""

    def fn(comm):
        engine, *_ = initialize(MLP([4, 5, 3], seed=0), _cfg(stage), comm=comm)
        check(engine)

    zs.LocalWorld(2).run(fn)


def test_backward_twice_for_one_forward():
    def check(engine):
        loss = engine(X, Y)
        engine.backward(loss)
        with pytest.raises(RuntimeError, match=r"already called for the loss of forward #1"):
            engine.backward(loss)
        engine.step()  # the engine is still usable

    _on_two_ranks(check)


def test_two_backwards_without_a_step_in_between():
    def check(engine):
        engine.backward(engine(X, Y))
        loss = engine(X, Y)
        with pytest.raises(RuntimeError, match=r"backward\(\) was called again before step\(\)"):
            engine.backward(loss)
        engine.step()
        engine.backward(engine(X, Y))  # the right order works
        engine.step()

    _on_two_ranks(check)


@pytest.mark.parametrize(
    ("x", "y", "error", "match"),
    [
        ([[1.0] * 4] * 2, Y, TypeError, r"x must be an array .*got list"),
        (X, [0, 1], TypeError, r"y must be an array .*got list"),
        (np.float32(1.0), Y, ValueError, r"x must have a batch axis .*got shape \(\)"),
        (X, np.array([0, 1, 2]), ValueError, r"y must hold one target per sample of x \(2\)"),
        (np.ones((2, 5), np.float32), Y, ValueError, r"Linear expects input whose last axis"),
    ],
)
def test_a_batch_of_the_wrong_kind_is_refused_before_the_forward(x, y, error, match):
    def check(engine):
        with pytest.raises(error, match=match):
            engine(x, y)
        engine.backward(engine(X, Y))  # nothing was changed by the refused batch
        engine.step()

    _on_two_ranks(check)


def test_a_batch_laid_out_unlike_the_first_is_refused():
    def check(engine):
        engine.backward(engine(X, Y))
        engine.step()
        with pytest.raises(ValueError, match=r"x has 2 axes and dtype int64, but the first batch"):
            engine(np.ones((2, 4), np.int64), Y)
        with pytest.raises(ValueError, match=r"x has 3 axes"):
            engine(np.ones((2, 1, 4), np.float32), Y)

    _on_two_ranks(check)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_replacing_a_parameters_array_after_initialize_is_refused(stage):
    def check(engine):
        layer = engine.module.layers[0]
        if stage == 3:  # a shape the parameter never had
            layer.weight.data = np.zeros((2, 2), np.float32)
        else:  # a fresh array: the engine's flat buffer no longer backs the parameter
            layer.weight.data = np.zeros(layer.weight.shape, np.float32)
        with pytest.raises(RuntimeError, match=r"parameter 'layers\.0\.weight' no longer holds"):
            engine(X, Y)

    _on_two_ranks(check, stage)


def test_changing_weights_in_place_is_allowed_and_trains():
    def check(engine):
        for _, p in engine.module.named_parameters():
            p.data[...] = 0.5 * p.data
        engine.backward(engine(X, Y))
        engine.step()

    _on_two_ranks(check)


def test_casting_the_model_after_initialize_is_refused():
    def check(engine):
        engine.module.to(dtype="float64")
        with pytest.raises(RuntimeError, match=r"now shape \(5, 4\), dtype float64"):
            engine(X, Y)

    _on_two_ranks(check)


def test_replacing_a_parameter_object_after_initialize_is_refused():
    def check(engine):
        engine.module.layers[2].bias = Parameter(np.zeros(3, np.float32))
        with pytest.raises(RuntimeError, match=r"the model changed after initialize: parameters"):
            engine(X, Y)

    _on_two_ranks(check)


def test_ranks_with_different_configs_all_get_one_error_naming_the_keys():
    def fn(comm):
        cfg = _cfg(stage=3 if comm.rank == 2 else 2, gradient_clipping=float(comm.rank == 2))
        with pytest.raises(ConfigError) as info:
            initialize(MLP([4, 3], seed=0), cfg, comm=comm)
        return str(info.value)

    messages = zs.LocalWorld(3).run(fn)
    assert len(set(messages)) == 1  # the same message on every rank
    text = messages[0]
    assert "the config differs across ranks" in text
    assert "zero_optimization.stage: 2 on ranks [0, 1], 3 on ranks [2]" in text
    assert "gradient_clipping: 0.0 on ranks [0, 1], 1.0 on ranks [2]" in text


def test_the_configs_timeout_reaches_the_communicator(monkeypatch):
    monkeypatch.delenv("ZEROSIM_TIMEOUT", raising=False)

    def fn(comm):
        cfg = _cfg(zerosim={"timeout": 42, "flight_records": 7})
        engine, *_ = initialize(MLP([4, 3], seed=0), cfg, comm=comm)
        return engine.comm.timeout, engine.comm.ledger.flight.size

    assert zs.LocalWorld(2).run(fn) == [(42.0, 7)] * 2
