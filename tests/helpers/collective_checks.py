"""Checks of every collective, shared by the LocalWorld tests and the mpirun worker.

Each rank builds its own input from a seed that depends on its rank; the reference result is
computed with NumPy from every rank's input (the test can rebuild them all, the library cannot).
Integer-valued data makes the 16-bit and int8 reductions exact; float32/float64 use random reals
and a tolerance, because MPI may add in another order than NumPy.
"""

from __future__ import annotations

import numpy as np

from zerosim.backend import DTYPES

DTYPE_NAMES = ["float64", "float32", "float16", "bfloat16", "int8"]
EXACT = {"float16", "bfloat16", "int8"}


def as_dtype(name: str) -> np.dtype:
    return DTYPES[name] if name in DTYPES else np.dtype(name)


def rank_input(name: str, count: int, rank: int, salt: int) -> np.ndarray:
    rng = np.random.default_rng([rank, count, salt])
    if name in EXACT:
        return rng.integers(-3, 4, size=count).astype(as_dtype(name))
    return rng.standard_normal(count).astype(as_dtype(name))


def reference(parts: list[np.ndarray], op: str) -> np.ndarray:
    stacked = np.stack([p.astype(np.float64) for p in parts])
    return {"sum": stacked.sum(0), "max": stacked.max(0), "min": stacked.min(0)}[op]


def assert_close(got: np.ndarray, want: np.ndarray, name: str, what: str) -> None:
    got64 = got.astype(np.float64)
    if name in EXACT:
        np.testing.assert_array_equal(got64, want, err_msg=what)
    else:
        rtol = 1e-12 if name == "float64" else 1e-5
        np.testing.assert_allclose(got64, want, rtol=rtol, atol=rtol, err_msg=what)


def chunk_sizes(count: int, n: int) -> list[int]:
    return [len(c) for c in np.array_split(np.arange(count), n)]


def expected_bytes(
    op: str, count: int, n: int, rank: int, itemsize: int, root: int = 0
) -> tuple[int, int]:
    """The byte formulas of nccl-tests' ring model, written independently of zerosim's."""
    if n == 1:
        return 0, 0
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        b = (n - 1) * count // n * itemsize
        return b, b
    if op == "reduce":  # a chain into the root: the farthest rank only sends, the root receives
        farthest = (root - 1) % n
        return (0 if rank == root else count * itemsize), (
            0 if rank == farthest else count * itemsize
        )
    sizes = chunk_sizes(count, n)  # all_reduce over uneven chunks
    sent = 2 * count - sizes[rank] - sizes[(rank + 1) % n]
    recv = 2 * count - sizes[(rank - 1) % n] - sizes[rank]
    if count % n == 0:
        assert sent * itemsize == 2 * (n - 1) * count // n * itemsize
    return sent * itemsize, recv * itemsize


def sizes_for(n: int) -> list[int]:
    return [0, 1, 7, 1000, 3 * n + 1]


def check_all_collectives(comm) -> int:
    """Run every collective over every dtype and size; return how many calls were checked."""
    n, r = comm.size, comm.rank
    wire = comm.collectives == "ring" and n > 1
    checked = 0
    for name in DTYPE_NAMES:
        dt = as_dtype(name)
        for count in sizes_for(n):
            for salt, nonblocking in ((0, False), (1, True)):
                # all_gather: every rank contributes `count` elements
                parts = [rank_input(name, count, q, salt) for q in range(n)]
                out = np.empty(n * count, dtype=dt)
                start = len(comm.ledger.records)
                if nonblocking:
                    comm.iall_gather(out, parts[r]).wait()
                else:
                    comm.all_gather(out, parts[r])
                what = f"all_gather {name} count={count} rank={r}"
                np.testing.assert_array_equal(
                    out.astype(np.float64), np.concatenate(parts).astype(np.float64), what
                )
                _check_record(comm, start, "all_gather", n * count, dt.itemsize, wire, what)
                checked += 1
                for op in ("sum", "max", "min"):
                    # reduce_scatter: every rank contributes n * count elements
                    parts = [rank_input(name, n * count, q, salt + 7) for q in range(n)]
                    out = np.empty(count, dtype=dt)
                    start = len(comm.ledger.records)
                    if nonblocking:
                        comm.ireduce_scatter(out, parts[r], op=op).wait()
                    else:
                        comm.reduce_scatter(out, parts[r], op=op)
                    what = f"reduce_scatter {op} {name} count={count} rank={r}"
                    assert_close(out, reference(parts, op)[r * count : (r + 1) * count], name, what)
                    _check_record(comm, start, "reduce_scatter", n * count, dt.itemsize, wire, what)
                    # all_reduce on any count, divisible by n or not
                    parts = [rank_input(name, count, q, salt + 13) for q in range(n)]
                    buf = parts[r].copy()
                    start = len(comm.ledger.records)
                    if nonblocking:
                        comm.iall_reduce(buf, op=op).wait()
                    else:
                        comm.all_reduce(buf, op=op)
                    what = f"all_reduce {op} {name} count={count} rank={r}"
                    assert_close(buf, reference(parts, op), name, what)
                    _check_record(comm, start, "all_reduce", count, dt.itemsize, wire, what)
                    checked += 2
            # broadcast from every root, and all_to_all
            for root in range(n):
                parts = [rank_input(name, count, q, 21) for q in range(n)]
                buf = parts[r].copy()
                start = len(comm.ledger.records)
                comm.broadcast(buf, root=root)
                np.testing.assert_array_equal(
                    buf.astype(np.float64), parts[root].astype(np.float64)
                )
                rec = comm.ledger.records[start]
                pos = (r - root) % n
                size = count * dt.itemsize
                assert (rec.bytes_sent, rec.bytes_recv) == (
                    size if pos < n - 1 else 0,
                    size if pos > 0 else 0,
                ), rec
                assert rec.counted == ("wire" if wire else "model"), rec
                checked += 1
                checked += _check_reduce(comm, name, count, root, wire)
            parts = [rank_input(name, n * count, q, 33) for q in range(n)]
            out = np.empty(n * count, dtype=dt)
            start = len(comm.ledger.records)
            comm.all_to_all(out, parts[r])
            want = np.concatenate([p[r * count : (r + 1) * count] for p in parts])
            np.testing.assert_array_equal(out.astype(np.float64), want.astype(np.float64))
            what = f"all_to_all {name} count={count} rank={r}"
            _check_record(comm, start, "all_to_all", n * count, dt.itemsize, wire, what)
            checked += 1
    return checked


def _check_reduce(comm, name: str, count: int, root: int, wire: bool) -> int:
    """reduce to ``root``, blocking and not, every op: the root holds the reduction, every other
    rank's buffer is unchanged; the chain's bytes (S sent by all but the root, S received by all
    but the rank farthest from it)."""
    n, r = comm.size, comm.rank
    checked = 0
    for op, nonblocking in (("sum", False), ("max", True), ("min", False), ("sum", True)):
        parts = [rank_input(name, count, q, 27 + root) for q in range(n)]
        buf = parts[r].copy()
        start = len(comm.ledger.records)
        if nonblocking:
            comm.ireduce(buf, root=root, op=op).wait()
        else:
            comm.reduce(buf, root=root, op=op)
        what = f"reduce {op} to {root} {name} count={count} rank={r}"
        if r == root:
            assert_close(buf, reference(parts, op), name, what)
        else:
            np.testing.assert_array_equal(buf.view(np.uint8), parts[r].view(np.uint8), what)
        itemsize = as_dtype(name).itemsize
        _check_record(comm, start, "reduce", count, itemsize, wire, what, root)
        checked += 1
    return checked


def _check_record(comm, start, op, elements, itemsize, wire, what, root=0):
    records = comm.ledger.records[start:]
    assert len(records) == 1, (what, records)
    rec = records[0]
    assert rec.op == op and rec.elements == elements, (what, rec)
    assert rec.size_bytes == elements * itemsize, (what, rec)
    assert rec.counted == ("wire" if wire else "model"), (what, rec)
    want = expected_bytes(op, elements, comm.size, comm.rank, itemsize, root)
    assert (rec.bytes_sent, rec.bytes_recv) == want, (what, rec, want)
    assert rec.wall_time is not None and rec.wall_time >= 0, (what, rec)


def check_in_place_all_gather(comm) -> None:
    """ZeRO's gather: each rank's shard is a view of the flat buffer being gathered into."""
    n, r = comm.size, comm.rank
    flat = np.zeros(4 * n, dtype=np.float32)
    flat[4 * r : 4 * r + 4] = np.arange(4) + 10 * r
    comm.all_gather(flat, flat[4 * r : 4 * r + 4])
    want = np.concatenate([np.arange(4) + 10 * q for q in range(n)]).astype(np.float32)
    np.testing.assert_array_equal(flat, want)


def check_split(comm) -> None:
    """Sub-groups of even and odd ranks reduce separately and write to the parent's ledger."""
    sub = comm.split(comm.rank % 2, key=-comm.rank)  # reversed order inside each group
    members = [q for q in range(comm.size) if q % 2 == comm.rank % 2]
    assert sub.size == len(members)
    assert sub.rank == sorted(members, reverse=True).index(comm.rank)
    buf = np.array([float(comm.rank)])
    before = len(comm.ledger.records)
    sub.all_reduce(buf)
    assert buf[0] == sum(members)
    assert comm.ledger.records[before].group == f"world/split1.{comm.rank % 2}"
    # a second split with the same colour, and a named one: every group keeps its own name
    again = comm.split(comm.rank % 2)
    named = comm.split(0, name="pairs")
    again.barrier()
    named.barrier()
    assert [r.group for r in comm.ledger.records[-2:]] == [
        f"world/split2.{comm.rank % 2}",
        "world/pairs.0",
    ]


def check_in_place_reduce_scatter(comm) -> None:
    """Stage 1's reduction: each rank's output is its own chunk of the gradient buffer itself."""
    n, r = comm.size, comm.rank
    parts = [rank_input("float64", 5 * n, q, 41) for q in range(n)]
    grads = parts[r].copy()
    start = len(comm.ledger.records)
    comm.reduce_scatter(grads[5 * r : 5 * r + 5], grads)
    np.testing.assert_allclose(
        grads[5 * r : 5 * r + 5], reference(parts, "sum")[5 * r : 5 * r + 5], rtol=1e-12
    )
    wire = comm.collectives == "ring" and n > 1
    _check_record(comm, start, "reduce_scatter", 5 * n, 8, wire, "in-place reduce_scatter")
    grads = parts[r].copy()  # the non-blocking form, in place as well
    comm.ireduce_scatter(grads[5 * r : 5 * r + 5], grads).wait()
    np.testing.assert_allclose(
        grads[5 * r : 5 * r + 5], reference(parts, "sum")[5 * r : 5 * r + 5], rtol=1e-12
    )


def check_reduce_scatter_v(comm) -> None:
    """Uneven pieces (zeros too): values; bytes count − c_r sent, count − c_{r−1} received."""
    n, r = comm.size, comm.rank
    wire = comm.collectives == "ring" and n > 1
    for counts in ([3] * n, [q % 3 for q in range(n)], [0] * (n - 1) + [7], list(range(1, n + 1))):
        total = sum(counts)
        offsets = np.cumsum([0, *counts])
        for name in ("float64", "float32", "bfloat16"):
            parts = [rank_input(name, total, q, 51) for q in range(n)]
            for nonblocking in (False, True):
                out = np.empty(counts[r], dtype=as_dtype(name))
                start = len(comm.ledger.records)
                if nonblocking:
                    comm.ireduce_scatter_v(out, parts[r], counts).wait()
                else:
                    comm.reduce_scatter_v(out, parts[r], counts)
                want = reference(parts, "sum")[offsets[r] : offsets[r + 1]]
                assert_close(out, want, name, f"reduce_scatter_v {counts} {name}")
                rec = comm.ledger.records[start]
                assert rec.op == "reduce_scatter" and rec.counted == ("wire" if wire else "model")
                item = as_dtype(name).itemsize
                expect = (
                    (0, 0)
                    if n == 1
                    else ((total - counts[r]) * item, (total - counts[(r - 1) % n]) * item)
                )
                assert (rec.bytes_sent, rec.bytes_recv) == expect, (counts, rec)
    if n > 1:
        bad = np.empty(counts[r] + 1)
        try:
            comm.reduce_scatter_v(bad, np.ones(total), counts)
        except ValueError as err:
            assert "out.size == counts" in str(err)
        else:
            raise AssertionError("a wrong out size was accepted")
