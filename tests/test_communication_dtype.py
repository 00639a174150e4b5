"""communication_data_type: bf16 gradients summed in fp32 over the wire, rounded once at the end.

The oracle is written here without the engine: each rank's local bf16 gradient from its own
micro-batch, summed over ranks in fp32, rounded to bf16, averaged in bf16 (the gradient buffer's
dtype), widened to fp32 for the master update θ ← θ − lr·g of plain SGD.
"""

from __future__ import annotations

import numpy as np
import pytest

from zerosim import ConfigError
from zerosim.backend import DTYPES
from zerosim.comm import LocalWorld
from zerosim.engine import initialize
from zerosim.nn import MLP

BF16 = DTYPES["bfloat16"]
SIZES = [5, 7, 3]
LR = 0.5


def _batch(rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + rank)
    return rng.standard_normal((4, SIZES[0])).astype(np.float32), rng.integers(0, SIZES[-1], 4)


def _config(stage: int, wire: str | None, layout: str = "deepspeed") -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 20},
        "zerosim": {"layout": layout},
    }
    if wire is not None:
        cfg["communication_data_type"] = wire
    return cfg


def _one_step(comm, stage: int, wire: str | None, layout: str = "deepspeed"):
    engine, *_ = initialize(MLP(SIZES, seed=4), _config(stage, wire, layout), comm=comm)
    x, y = _batch(comm.rank)
    comm.ledger.reset()
    engine.backward(engine(x, y))
    engine.step()
    # the gradient reductions (stage 3 under DeepSpeed's schedule also all-gathers its persistent
    # parameters in the first backward, as DeepSpeed does while it records the module trace)
    reduced = [r for r in comm.ledger.records if r.phase == "backward" and r.op != "all_gather"]
    return engine.full_state_dict(), reduced


def _oracle(n: int) -> dict[str, np.ndarray]:
    grads, start = [], {}
    for rank in range(n):
        model = MLP(SIZES, seed=4).to(dtype="bfloat16")
        start = {k: p.data.astype(np.float32) for k, p in model.named_parameters()}
        model(*_batch(rank))
        model.backward(grad_scale=1.0)
        grads.append({k: p.grad.astype(np.float32) for k, p in model.named_parameters()})
    out = {}
    for k, theta in start.items():
        total = np.zeros_like(theta)
        for g in grads:
            total += g[k]  # fp32 sums of bf16 values: exact here, so order does not matter
        mean = total.astype(BF16)  # rounded once, then averaged in bf16
        mean /= n
        out[k] = theta - np.float32(LR) * mean.astype(np.float32)
    return out


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_gradients_reduced_in_fp32_match_the_fp32_sum_rounded_once(stage, n):
    expected = _oracle(n)
    for state, reduced in LocalWorld(n).run(_one_step, stage, "fp32"):
        assert reduced and {r.dtype for r in reduced} == {"float32"}
        for name, want in expected.items():
            np.testing.assert_array_equal(state[name], want, err_msg=name)


def test_megatron_bf16_buffers_reduce_in_bf16_when_asked():
    # Megatron keeps bf16 gradients in fp32 buffers; communication_data_type bf16 halves the wire.
    fp32 = LocalWorld(2).run(_one_step, 1, None, "megatron")
    bf16 = LocalWorld(2).run(_one_step, 1, "bf16", "megatron")
    for (_, wide), (_, narrow) in zip(fp32, bf16, strict=True):
        assert {r.dtype for r in wide} == {"float32"} and {r.dtype for r in narrow} == {"bfloat16"}
        assert sum(r.bytes_sent for r in wide) == 2 * sum(r.bytes_sent for r in narrow) > 0


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_wire_sends_twice_the_gradient_bytes_and_the_same_parameter_bytes(stage):
    def bytes_by_op(comm, wire):
        engine, *_ = initialize(MLP(SIZES, seed=4), _config(stage, wire), comm=comm)
        x, y = _batch(comm.rank)
        comm.ledger.reset()
        engine.backward(engine(x, y))
        engine.step()
        return {
            op: sum(
                r.bytes_sent
                for r in comm.ledger.records
                if r.op == op and r.phase not in ("clip", "overflow")  # the one-element ones
            )
            for op in ("all_reduce", "reduce_scatter", "all_gather")
        }

    narrow = LocalWorld(3).run(bytes_by_op, None)
    wide = LocalWorld(3).run(bytes_by_op, "fp32")
    for a, b in zip(narrow, wide, strict=True):
        # DeepSpeed's schedule (the default) all-reduces the gradients at stages 0-2
        reduce_op = "reduce_scatter" if stage == 3 else "all_reduce"
        assert b[reduce_op] == 2 * a[reduce_op] > 0
        assert b["all_gather"] == a["all_gather"]


def test_communication_data_type_with_quantized_gradients_is_refused_on_every_rank():
    cfg = _config(3, "fp32")
    cfg["zero_optimization"]["zero_quantized_gradients"] = True

    def fn(comm):
        with pytest.raises(ConfigError, match="communication_data_type = 'fp32'"):
            initialize(MLP(SIZES, seed=4), cfg, comm=comm)
        return True

    assert LocalWorld(2).run(fn) == [True, True]
