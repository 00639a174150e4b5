"""The virtual world: records as the real worlds write them, sub-groups by rule, classes of rank.

The oracle for the records is a real world running the same engine on real arrays: LocalWorld
here (its ledger is written by the same Communicator code as MPIComm's); tests/test_dryrun_mpi.py
holds the dry run to real mpirun runs.
"""

from __future__ import annotations

import numpy as np
import pytest

import zerosim as zs
from zerosim import meta
from zerosim.comm.virtual import VirtualWorld
from zerosim.dryrun import recipe, records_of, run_world
from zerosim.nn import GPT

FIELDS = (
    "op phase group dtype elements size_bytes bytes_sent bytes_recv peers step blocking "
    "intra_bytes inter_bytes"
).split()


def _key(records):
    return [tuple(getattr(r, f) for f in FIELDS) for r in records]


def test_host_buffers_complete_as_if_every_rank_sent_the_same():
    comm = VirtualWorld(4).comm(2)
    out = np.empty(8, np.int64)
    comm.all_gather(out, np.array([5, 6]))
    assert out.tolist() == [5, 6] * 4
    buf = np.array([1.5, -2.0])
    comm.all_reduce(buf)
    assert buf.tolist() == [6.0, -8.0]
    comm.all_reduce(buf, op="max")
    assert buf.tolist() == [6.0, -8.0]
    part = np.empty(2)
    comm.reduce_scatter(part, np.arange(8.0))
    assert part.tolist() == [16.0, 20.0]  # rank 2's chunk, summed over 4 equal ranks
    assert [r.op for r in comm.ledger.records] == [
        "all_gather",
        "all_reduce",
        "all_reduce",
        "reduce_scatter",
    ]


def test_split_needs_every_ranks_colour():
    comm = VirtualWorld(6).comm(4)
    with pytest.raises(ValueError, match="split_by"):
        comm.split(1, 4)
    group = comm.split_by(lambda r: (r % 2, -r))  # evens, keys descending: 4, 2, 0
    assert (group.members, group.rank, group.size, group.group) == (
        (4, 2, 0),
        0,
        3,
        "world/split1.0",
    )
    other = group.view_of(3)  # odd ranks 5, 3, 1
    assert (other.members, other.rank, other.group) == ((5, 3, 1), 1, "world/split1.1")


def _config(stage, schedule, dtype, zeropp, backend, ranks_per_node=None, n=4):
    zero = {"stage": stage, "reduce_bucket_size": 200}
    if zeropp:
        zero.update(
            zero_quantized_weights=True,
            zero_quantized_gradients=True,
            zero_hpz_partition_size=2 if n % 2 == 0 else 1,
        )
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**6,
        "zerosim": {"backend": backend, "schedule": schedule, "ranks_per_node": ranks_per_node},
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _model():
    return GPT(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=8, seed=1)


def _real(comm, cfg):
    engine, *_ = zs.initialize(_model(), cfg, comm=comm)
    rng = np.random.default_rng(comm.rank)
    for _ in range(4):
        x = rng.integers(0, 50, (2, 16))
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
    return _key(comm.ledger.records), engine.memory_report()


def _dry(world, rank, cfg):
    comm = world.comm(rank)
    with meta.tracking():
        engine, *_ = zs.initialize(_model(), cfg, comm=comm)
        x = meta.NAMESPACE.zeros((2, 16), np.int64)
        for _ in range(4):
            loss = engine(x, x)
            engine.backward(loss)
            engine.step()
        return comm, engine.memory_report()


CASES = [
    (4, 3, "deepspeed", "bf16", True, 2),
    (6, 2, "paper", "fp32", False, 2),
    (3, 1, "deepspeed", "bf16", False, None),
    (5, 0, "paper", "fp32", False, None),
]


@pytest.mark.parametrize("n, stage, schedule, dtype, zeropp, per_node", CASES)
def test_every_virtual_rank_writes_the_records_of_a_real_rank(
    n, stage, schedule, dtype, zeropp, per_node
):
    """Each virtual rank's own records and memory equal the real rank's; rank 0's records
    rewritten for rank r (``as_rank``) equal them too."""
    real = zs.LocalWorld(n).run(
        _real, _config(stage, schedule, dtype, zeropp, "numpy", per_node, n)
    )
    world = VirtualWorld(n)
    cfg = _config(stage, schedule, dtype, zeropp, "meta", per_node, n)
    first, _ = _dry(world, 0, cfg)
    for r in range(n):
        comm, memory = _dry(world, r, cfg)
        assert _key(comm.ledger.records) == real[r][0], f"rank {r}"
        assert memory == real[r][1], f"rank {r}"
        assert _key(first.as_rank(r)) == real[r][0], f"rank 0's calls as rank {r}"


@pytest.mark.parametrize(
    "stage, schedule, zeropp",
    [(2, "paper", False), (3, "deepspeed", True), (1, "deepspeed", False)],
)
def test_representatives_and_all_ranks_agree(stage, schedule, zeropp):
    n = 6
    cfg = _config(stage, schedule, "bf16", zeropp, "meta", 2, n)
    cfg["zero_optimization"]["reduce_bucket_size"] = 150
    model = recipe("gpt:2,16,40,16,2")
    classes, _ = run_world(model, n, cfg)
    every, _ = run_world(model, n, cfg, all_ranks=True)
    assert sorted(r for members, _ in classes for r in members) == list(range(n))
    # the first rank, the last, and the rest; the paper's stage 2 sizes a buffer by the rank's
    # piece of each bucket, which parts more ranks
    assert len(classes) > 3 if stage == 2 else len(classes) == 3
    for members, run in classes:
        for r in members:
            (own,) = [x for m, x in every if m == [r]]
            assert _key(records_of(run, r)) == _key(records_of(own, r)), f"rank {r}"
            assert run.memory == own.memory, f"rank {r}"
            # a copy into a shard is one call per parameter piece it takes: members of a class
            # may take a few pieces more or fewer, the same bytes (the only count that differs)
            mine, theirs = dict(run.tracker), dict(own.tracker)
            ops, own_ops = dict(mine.pop("ops")), dict(theirs.pop("ops"))
            assert mine == theirs, f"rank {r}"
            pieces, own_pieces = ops.pop("setitem", 0), own_ops.pop("setitem", 0)
            assert ops == own_ops and abs(pieces - own_pieces) <= 0.1 * own_pieces, f"rank {r}"


def test_ledger_events_note_issues_and_completing_waits_in_program_order():
    comm = VirtualWorld(2).comm(0)
    comm.ledger.events = []
    a, b = np.ones(4, np.float32), np.ones(6, np.float32)
    handle = comm.iall_reduce(a)
    comm.all_reduce(b)
    handle.wait()
    handle.wait()  # already complete: no second wait
    kinds = [(kind, r.elements, r.blocking) for kind, r in comm.ledger.events]
    assert kinds == [("issue", 4, False), ("issue", 6, True), ("wait", 4, False)]
    assert comm.ledger.events[2][1] is comm.ledger.events[0][1]  # the same call's record
    comm.ledger.events = None
    comm.all_reduce(b)
    assert len(comm.ledger.records) == 3
