"""LocalWorld: every collective against NumPy, ledger bytes against the formulas, failures."""

import time

import collective_checks
import numpy as np
import pytest

import zerosim as zs
from zerosim.comm import WorldAborted


@pytest.mark.parametrize("collectives", ["native", "ring"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_every_collective_matches_numpy_and_ledger_formula(n, collectives):
    counts = zs.LocalWorld(n, collectives=collectives).run(collective_checks.check_all_collectives)
    assert counts == [counts[0]] * n and counts[0] >= 400


@pytest.mark.parametrize("collectives", ["native", "ring"])
def test_in_place_all_gather_and_split_on_5_ranks(collectives):
    world = zs.LocalWorld(5, collectives=collectives)
    world.run(collective_checks.check_in_place_all_gather)
    world.run(collective_checks.check_split)


@pytest.mark.parametrize("collectives", ["native", "ring"])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_in_place_and_uneven_reduce_scatter(n, collectives):
    world = zs.LocalWorld(n, collectives=collectives)
    world.run(collective_checks.check_in_place_reduce_scatter)
    world.run(collective_checks.check_reduce_scatter_v)


def test_ring_bytes_equal_model_bytes_for_uneven_all_reduce():
    def run(comm, mode):
        comm.collectives = mode
        comm.all_reduce(np.ones(1001))
        rec = comm.ledger.records[-1]
        return rec.bytes_sent, rec.bytes_recv, rec.counted

    native = zs.LocalWorld(4).run(run, "native")
    ring = zs.LocalWorld(4).run(run, "ring")
    assert [r[:2] for r in native] == [r[:2] for r in ring]
    assert {r[2] for r in native} == {"model"} and {r[2] for r in ring} == {"wire"}
    # 1001 = 251 + 250 + 250 + 250: rank 0 sends everything but chunks 0 and 1, twice over
    assert native[0][0] == (2 * 1001 - 251 - 250) * 8


def test_exception_on_one_rank_is_reraised_naming_it_and_releases_the_others():
    def fn(comm):
        if comm.rank == 2:
            raise KeyError("boom")
        comm.all_reduce(np.ones(3))  # never completes: rank 2 is gone

    t0 = time.monotonic()
    with pytest.raises(KeyError) as info:
        zs.LocalWorld(4, timeout=30).run(fn)
    assert time.monotonic() - t0 < 5
    assert "rank 2 of LocalWorld(4)" in "".join(getattr(info.value, "__notes__", []))


def test_rank_that_returns_early_makes_waiters_fail_naming_it():
    def fn(comm):
        if comm.rank != 1:
            comm.barrier()

    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] returned without joining"):
        zs.LocalWorld(3, timeout=30).run(fn)


def test_collective_not_reached_times_out_naming_missing_ranks():
    def fn(comm):
        if comm.rank == 0:
            time.sleep(1.5)
        else:
            comm.all_gather(np.empty(2 * comm.size), np.ones(2))

    with pytest.raises(TimeoutError, match=r"waiting for rank\(s\) \[0\]"):
        zs.LocalWorld(2, timeout=0.3).run(fn)


def test_mismatched_sizes_across_ranks_raise_valueerror_on_every_rank():
    def fn(comm):
        inp = np.ones(2 if comm.rank == 1 else 3)
        try:
            comm.all_gather(np.empty(comm.size * inp.size), inp)
        except ValueError as err:
            return str(err)
        return None

    messages = zs.LocalWorld(3).run(fn)
    assert all(m is not None and "rank 1: all_gather(count=6" in m for m in messages)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda c: c.all_gather(np.empty(3), np.ones(2)), ValueError, r"out.size == size \* inp"),
        (lambda c: c.all_gather(np.empty(4, np.float32), np.ones(2)), TypeError, "same dtype"),
        (lambda c: c.all_gather(np.empty(4), [1.0, 2.0]), TypeError, "must be an array"),
        (lambda c: c.all_reduce(np.ones((4, 4))[:, 0]), ValueError, "C-contiguous"),
        (lambda c: c.all_reduce(np.ones(4), op="prod"), ValueError, "op must be one of"),
        (lambda c: c.all_reduce(np.ones(4, dtype=np.complex64)), TypeError, "complex64"),
        (lambda c: c.broadcast(np.ones(4), root=2), ValueError, r"root must be an int in \[0, 2\)"),
        (lambda c: c.reduce_scatter(np.empty(3), np.ones(4)), ValueError, "inp.size == size"),
        (lambda c: (b := np.ones(4), c.reduce_scatter(b[1:3], b))[1], ValueError, "overlap"),
        (lambda c: c.all_to_all(np.empty(4), np.ones(3)), ValueError, "multiple of size=2"),
    ],
)
def test_bad_arguments_fail_before_anything_is_sent(call, error, match):
    def fn(comm):
        with pytest.raises(error, match=match):
            call(comm)
        return len(comm.ledger.records), comm._calls

    assert zs.LocalWorld(2).run(fn) == [(0, 0), (0, 0)]


def test_nonblocking_contributions_are_taken_at_the_call():
    def fn(comm):
        buf = np.full(3, float(comm.rank + 1))
        handle = comm.iall_reduce(buf)
        other = np.full(2, 1.0)
        comm.all_reduce(other)  # a second collective may run before the first is waited on
        handle.wait()
        handle.wait()  # idempotent
        return buf.tolist(), other.tolist(), comm.ledger.records[0].wall_time is not None

    assert zs.LocalWorld(3).run(fn) == [([6.0] * 3, [3.0] * 2, True)] * 3


def test_one_rank_group_runs_collectives_as_mpi_on_one_rank_without_a_snapshot():
    """A group of one copies a gather's or a reduce-scatter's input into its output and leaves
    an all-reduce's, a reduce's and a broadcast's buffer as it is, allocating nothing more than
    a few bytes: no posted copy for other ranks (the rendezvous copied 2 MB and concatenated
    it into 2 MB more here)."""
    import tracemalloc

    def fn(comm):
        x = np.arange(1 << 18, dtype=np.float64)  # 2 MiB
        gathered, scattered, summed = np.empty_like(x), np.empty_like(x), x.copy()
        tracemalloc.start()
        comm.all_gather(gathered, x)
        comm.reduce_scatter(scattered, x, op="max")
        comm.all_reduce(summed)
        comm.iall_gather(gathered, x).wait()
        comm.reduce(summed, root=0)
        comm.broadcast(summed, root=0)
        comm.barrier()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        own = x.copy()
        comm.all_gather(own, own)  # in place: its own chunk is the whole buffer
        return peak, [np.array_equal(v, x) for v in (gathered, scattered, summed, own)]

    ((peak, equal),) = zs.LocalWorld(1).run(fn)
    assert equal == [True] * 4
    assert peak < 64 << 10, peak


def test_phase_labels_and_ledger_queries():
    def fn(comm):
        with comm.phase("forward"):
            comm.all_gather(np.empty(8), np.ones(4))
        with comm.phase("backward"):
            comm.reduce_scatter(np.empty(4), np.ones(8))
        comm.ledger.step = 3
        comm.all_reduce(np.ones(10))
        led = comm.ledger
        out = (
            led.bytes_sent(phase="forward"),
            led.bytes_sent(op="reduce_scatter"),
            led.bytes_sent(step=3),
            led.bytes_sent(),
            led.records[-1].phase,
        )
        table = led.table()
        led.reset()
        return out, table, led.bytes_sent()

    (sent, table, after), _ = zs.LocalWorld(2).run(fn)
    assert sent == (32, 32, 80, 144, "none")
    assert "forward" in table and "backward" in table and after == 0


def test_world_rejects_bad_size_collectives_and_timeout():
    with pytest.raises(ValueError, match="size must be a positive int, got 0"):
        zs.LocalWorld(0)
    with pytest.raises(ValueError, match=r"collectives must be one of \['native', 'ring'\]"):
        zs.LocalWorld(2, collectives="tree")
    with pytest.raises(ValueError, match=r"timeout must be a number of seconds >= 0 \(0 = never\)"):
        zs.LocalWorld(2, timeout=-1)


def test_world_aborted_is_what_waiting_ranks_see():
    seen = []

    def fn(comm):
        if comm.rank == 0:
            raise ValueError("first")
        try:
            comm.barrier()
        except WorldAborted as err:
            seen.append(str(err))
            raise

    with pytest.raises(ValueError, match="first"):
        zs.LocalWorld(3).run(fn)
    assert len(seen) == 2 and all("rank(s) [0] raised" in s for s in seen)


@pytest.mark.parametrize("collectives", ["native", "ring"])
def test_reduce_to_each_owner_like_deepspeeds_bucket_pieces(collectives):
    """DeepSpeed's reduce_scatter path: every piece of a bucket is reduced to its owner with
    non-blocking reduces, then all are waited on; bytes go towards the root (rank − 1)."""

    def fn(comm):
        comm.set_ranks_per_node(2)
        bucket = np.arange(10, dtype=np.float32) * (comm.rank + 1)
        pieces = [(0, 3), (3, 3), (6, 0), (6, 4)]  # owner q gets [start, start + length)
        handles = [comm.ireduce(bucket[s : s + k], root=q) for q, (s, k) in enumerate(pieces)]
        for h in handles:
            h.wait()
        s, k = pieces[comm.rank]
        led = comm.ledger
        return bucket[s : s + k].tolist(), led.bytes_sent(where="intra"), led.bytes_sent()

    out = zs.LocalWorld(4, collectives=collectives).run(fn)
    total = 1 + 2 + 3 + 4
    for rank, (mine, _, _) in enumerate(out):
        s, k = [(0, 3), (3, 3), (6, 0), (6, 4)][rank]
        assert mine == [float(v * total) for v in range(s, s + k)]
    # rank r sends every piece but its own (12 B, 12 B, 0 B, 16 B) to rank r − 1
    sent = [sum(b for q, b in enumerate([12, 12, 0, 16]) if q != r) for r in range(4)]
    assert [o[2] for o in out] == sent
    # rank − 1 is on the same node for ranks 1 and 3 only
    assert [o[1] for o in out] == [0, sent[1], 0, sent[3]]
