"""Wire bytes equal model bytes for every collective a training run issues.

The same run is made twice: with MPI's (or LocalWorld's) own collectives, whose ledger bytes come
from the ring formulas (``counted == "model"``), and with ``zerosim.collectives = "ring"``, where
zerosim's own algorithms over point-to-point messages count what they hand to send
(``counted == "wire"``). Call by call (op, phase, group, dtype, elements, bytes sent and received,
intra- and inter-node bytes) the two ledgers are equal, and in the ring run no collective that
moves data is left to the formula. Every stage, both collective schedules where the config offers
them, the Megatron layout, and ZeRO++ (qwZ, hpZ, qgZ and all three).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from mpi_helpers import run_mpi

import zerosim as zs
from zerosim.config import load_config
from zerosim.config.sections import ZerosimConfig
from zerosim.config.values import knob_fields
from zerosim.engine import initialize
from zerosim.errors import ConfigError
from zerosim.nn import GPT


def schedules() -> list[str | None]:
    """The collective schedules the config accepts (``zerosim.schedule``); [None] before there
    is such a key, so the current schedule is tested either way."""
    if "schedule" not in {f.name for f in knob_fields(ZerosimConfig)}:
        return [None]
    found = []
    for name in ("paper", "deepspeed"):
        try:
            load_config({"train_batch_size": 1, "zerosim": {"schedule": name}}, 1)
        except ConfigError:
            continue
        found.append(name)
    return found


def config(stage: int, schedule: str | None, collectives: str, **extra) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 300, "allgather_bucket_size": 300}
    zero.update(extra.pop("zero", {}))
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": extra.pop("accumulation", 1),
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "zerosim": {"dtype": "float64", "collectives": collectives, **extra.pop("zerosim", {})},
        **extra,
    }
    if schedule is not None:
        cfg["zerosim"]["schedule"] = schedule
    return cfg


def run(comm, cfg: dict, steps: int = 2) -> tuple[list[tuple], dict[str, np.ndarray]]:
    """Train a small GPT; every ledger record from ``initialize`` on, and the final weights."""
    model = GPT(vocab_size=13, block_size=5, n_layer=2, n_head=2, n_embd=8, seed=3)
    engine, *_ = initialize(model, cfg, comm=comm)
    rng = np.random.default_rng(5)
    k = cfg["gradient_accumulation_steps"]
    for _ in range(steps * k):
        x = rng.integers(0, 13, (2 * comm.size, 5))[2 * comm.rank : 2 * comm.rank + 2]
        engine.backward(engine(x, np.roll(x, -1, 1)))
        engine.step()
    rows = [
        (
            r.op,
            r.phase,
            r.group,
            r.dtype,
            r.elements,
            r.bytes_sent,
            r.bytes_recv,
            r.intra_bytes,
            r.inter_bytes,
            r.counted,
            r.peers,
        )
        for r in comm.ledger.records
    ]
    return rows, engine.full_state_dict()


def assert_wire_equals_model(n: int, cfg_of) -> None:
    # the world is made in the config's mode: initialize's own checks come before it applies it
    native = zs.LocalWorld(n).run(run, cfg_of("native"))
    ring = zs.LocalWorld(n, collectives="ring").run(run, cfg_of("ring"))
    for rank in range(n):
        (model_rows, weights), (wire_rows, wire_weights) = native[rank], ring[rank]
        assert len(model_rows) == len(wire_rows), rank
        assert {r[9] for r in model_rows} == {"model"}
        for m, w in zip(model_rows, wire_rows, strict=True):
            assert m[:9] == w[:9], (rank, m, w)
            moves = w[4] > 0 and w[10] > 1  # a barrier or a 1-rank group moves nothing
            assert w[9] == ("wire" if moves else "model"), (rank, w)
        for name, value in weights.items():  # the ring adds in another order: float64 rounding
            np.testing.assert_allclose(wire_weights[name], value, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("schedule", schedules())
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_puts_its_model_bytes_on_the_wire(stage, schedule):
    def cfg(collectives):
        extra = {"zero": {"overlap_comm": stage != 1}, "accumulation": 2 if stage == 2 else 1}
        return config(stage, schedule, collectives, **extra)

    assert_wire_equals_model(3, cfg)


@pytest.mark.parametrize("schedule", [s for s in schedules() if s == "deepspeed"])
@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeeds_per_owner_reduces_put_their_model_bytes_on_the_wire(stage, schedule):
    """``use_multi_rank_bucket_allreduce: false``: each bucket piece is reduced to its owner."""

    def cfg(collectives):
        zero = {"use_multi_rank_bucket_allreduce": False}
        return config(stage, schedule, collectives, zero=zero)

    assert_wire_equals_model(3, cfg)
    rows = zs.LocalWorld(3).run(run, cfg("native"))[0][0]
    assert any(r[0] == "reduce" for r in rows)  # the path under test


def test_the_megatron_layout_puts_its_model_bytes_on_the_wire():
    def cfg(collectives):
        return config(1, None, collectives, zerosim={"layout": "megatron"})

    assert_wire_equals_model(3, cfg)


ZEROPP = {
    "qwZ": {"zero_quantized_weights": True},
    "hpZ": {"zero_hpz_partition_size": 2},
    "qgZ": {"zero_quantized_gradients": True},
    "all": {
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": 2,
        "zero_quantized_gradients": True,
    },
}


@pytest.mark.parametrize("variant", list(ZEROPP))
def test_zeropp_puts_its_model_bytes_on_the_wire_intra_and_inter(variant):
    def cfg(collectives):
        zero = {"stage3_param_persistence_threshold": 0, **ZEROPP[variant]}
        return config(3, None, collectives, zero=zero, zerosim={"ranks_per_node": 2})

    assert_wire_equals_model(4, cfg)


def test_sub_groups_keep_their_own_names_in_the_ledger():
    """hpZ's group and qgZ's two hops were all ``world/0`` on rank 0; now each has its name."""

    def fn(comm):
        zero = {"stage3_param_persistence_threshold": 0, **ZEROPP["all"]}
        rows, _ = run(comm, config(3, None, "native", zero=zero, zerosim={"ranks_per_node": 2}))
        return {(r[2], r[10]) for r in rows}

    for rank, groups in enumerate(zs.LocalWorld(4).run(fn)):
        node, position = rank // 2, rank % 2  # 2 ranks per node
        # hpZ's group (this node), qgZ's intra-node hop, qgZ's inter-node hop (same position)
        assert groups == {
            ("world", 4),
            (f"world/split1.{node}", 2),
            (f"world/split2.{node}", 2),
            (f"world/split3.{position}", 2),
        }, rank


WORKER = """
import sys
sys.path[:0] = ["tests", "tests/helpers"]
import test_wire_bytes as t
from zerosim.comm import MPIComm

cases = [(1, {}), (3, {"zero": t.ZEROPP["all"], "zerosim": {"ranks_per_node": 2}})]
if "deepspeed" in t.schedules():  # MPI's Reduce against our chain, DeepSpeed's per-owner path
    cases.append((2, {"zero": {"use_multi_rank_bucket_allreduce": False}}))
for stage, extra in cases:
    rows = {}
    for collectives in ("native", "ring"):
        comm = MPIComm(collectives=collectives)  # fresh: its sub-groups are named alike
        cfg = t.config(stage, None, collectives, **{k: dict(v) for k, v in extra.items()})
        rows[collectives] = t.run(comm, cfg)[0]
    assert [r[:9] for r in rows["native"]] == [r[:9] for r in rows["ring"]], stage
    assert all(r[9] == "wire" for r in rows["ring"] if r[4] and r[10] > 1), stage
    print(f"WIRE {comm.rank} {stage} {len(rows['ring'])}", flush=True)  # one write per line
print(f"CASES {comm.rank} {len(cases)}", flush=True)
"""


@pytest.mark.mpi
def test_wire_bytes_equal_model_bytes_under_mpirun():
    proc = run_mpi(4, ["-c", WORKER], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    counts = dict(re.findall(r"^CASES (\d+) (\d+)$", proc.stdout, re.MULTILINE))
    assert sorted(counts) == ["0", "1", "2", "3"], proc.stdout
    cases = int(counts["0"])
    assert len(set(counts.values())) == 1 and cases >= 2, counts
    wire = re.findall(r"^WIRE (\d+) (\d+) (\d+)$", proc.stdout, re.MULTILINE)
    assert len(wire) == 4 * cases, proc.stdout
