"""A bounded ledger: past ``keep`` records it folds the oldest into totals, and every total it
reports (summary, table, DeepSpeed's table, bytes) equals what a ledger that keeps every record
reports for the same calls."""

from dataclasses import astuple

import numpy as np
import pytest

import zerosim as zs
from zerosim.comm.ledger import Ledger
from zerosim.comm.record import Record

OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


def records(count, seed=0, pending_at=None):
    """``count`` varied records over several steps, phases, groups, dtypes and sizes."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        peers = int(rng.choice([2, 4]))
        elements = int(rng.choice([8, 64, 1000])) * peers
        itemsize = int(rng.choice([2, 4]))
        sent, recv = (int(v) for v in rng.integers(0, 10_000, 2))
        r = Record(
            str(rng.choice(OPS)),
            str(rng.choice(["forward", "backward", "step"])),
            "world" if peers == 4 else "world/split0",
            "bfloat16" if itemsize == 2 else "float32",
            elements,
            elements * itemsize,
            sent,
            recv,
            peers,
            i // 10,  # step: ten calls each
            "model",
            True,
            float(i),
            None if i == pending_at else float(rng.uniform(1e-5, 1e-3)),
        )
        r.intra_bytes = int(rng.integers(0, sent + 1))
        r.inter_bytes = sent - r.intra_bytes
        out.append(r)
    return out


def fill(keep, recs):
    ledger = Ledger(keep=keep)
    lengths = []
    for r in recs:
        ledger.append(r)
        lengths.append(len(ledger.records))
    return ledger, lengths


def same_rows(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for key, value in w.items():
            expected = pytest.approx(value, rel=1e-12) if isinstance(value, float) else value
            assert g[key] == expected, key


def test_totals_of_a_bounded_ledger_equal_those_of_one_that_keeps_everything():
    recs = records(1000)
    every, _ = fill(None, recs)
    bounded, lengths = fill(32, recs)
    assert len(every.records) == 1000 and every.folded_calls == 0
    assert max(lengths) < 64 and len(bounded.records) >= 32  # folded in batches of keep
    assert bounded.folded_calls + len(bounded.records) == 1000
    assert bounded.records == recs[-len(bounded.records) :]  # the latest, in order
    same_rows(bounded.summary(), every.summary())
    for name, sizes in every.ds_summary().items():
        assert list(bounded.ds_summary()[name]) == list(sizes)
        same_rows(list(bounded.ds_summary()[name].values()), list(sizes.values()))
    for op in (None, *OPS):
        for phase in (None, "forward", "step"):
            for where in (None, "intra", "inter"):
                assert bounded.bytes_sent(op, phase, where=where) == every.bytes_sent(
                    op, phase, where=where
                )
            assert bounded.bytes_recv(op, phase) == every.bytes_recv(op, phase)
    total = bounded.table().splitlines()[-1]
    assert total == every.table().splitlines()[-1]
    # and against the records themselves, summed here
    assert f"{sum(r.bytes_sent for r in recs):,}" in total
    assert sum(row["calls"] for row in bounded.summary()) == 1000
    for op in OPS:
        mine = [r for r in recs if r.op == op]
        assert bounded.bytes_recv(op) == sum(r.bytes_recv for r in mine)
        assert bounded.bytes_sent(op, where="inter") == sum(r.inter_bytes for r in mine)
        rows = [row for row in bounded.summary() if row["op"] == op]
        assert sum(row["time_s"] for row in rows) == pytest.approx(
            sum(r.wall_time for r in mine), rel=1e-12
        )
        name = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor"}
        counts = bounded.ds_summary()[name.get(op, op)]
        assert sum(row["count"] for row in counts.values()) == len(mine)


def test_a_folded_step_is_an_error_and_a_kept_step_is_whole():
    recs = records(1000)
    every, _ = fill(None, recs)
    bounded, _ = fill(32, recs)
    last = recs[-1].step
    assert bounded.select(step=last) == every.select(step=last) != []
    assert bounded.bytes_sent(step=last) == every.bytes_sent(step=last)
    old = bounded.folded_through_step
    assert old is not None and old < last
    with pytest.raises(ValueError, match=rf"step=0: records of steps up to {old} were folded"):
        bounded.select(step=0)
    with pytest.raises(ValueError, match="Ledger\\(keep=None\\)"):
        bounded.bytes_recv(step=old)
    bounded.reset()
    assert bounded.summary() == [] and bounded.folded_calls == 0 and bounded.select(step=0) == []


def test_a_step_folded_in_part_is_an_error_too():
    recs = records(64)  # ten calls a step: the fold at 64 records takes calls 0-31
    bounded, _ = fill(32, recs)
    assert bounded.folded_calls == 32 and bounded.records[0] is recs[32]
    assert bounded.folded_through_step == 3  # calls 30 and 31 folded, 32-39 kept
    with pytest.raises(ValueError, match="step=3"):
        bounded.select(step=3)
    assert bounded.select(step=4) == recs[40:50]


def test_a_call_not_waited_on_stays_a_record_and_the_rest_still_folds():
    recs = records(200, pending_at=50)  # a non-blocking call whose wait() has not come
    bounded, lengths = fill(8, recs)
    assert max(lengths) <= 16  # folding goes on past it: the ledger stays bounded
    assert recs[50] in bounded.records and bounded.records[0] is recs[50]
    assert bounded.folded_calls == 199 - (len(bounded.records) - 1)
    recs[50].wall_time = 1e-4  # waited on: folded with the next batch
    for r in records(16, seed=2):
        bounded.append(r)
    assert recs[50] not in bounded.records and bounded.folded_calls + len(bounded.records) == 216
    every, _ = fill(None, recs + records(16, seed=2))
    same_rows(bounded.summary(), every.summary())


def test_keep_can_change_during_a_run():
    recs = records(300)
    every, _ = fill(None, recs)
    ledger, _ = fill(None, recs[:100])
    ledger.keep = 10  # from keeping everything to ten: the next call folds the rest
    for r in recs[100:]:
        ledger.append(r)
    assert 10 <= len(ledger.records) < 20 and ledger.records == recs[-len(ledger.records) :]
    same_rows(ledger.summary(), every.summary())


def _by_hand(recs, op=None, phase=None, step=None, field="bytes_sent"):
    """A byte count summed here from the records themselves."""
    return sum(
        getattr(r, field)
        for r in recs
        if (op is None or r.op == op)
        and (phase is None or r.phase == phase)
        and (step is None or r.step == step)
    )


@pytest.mark.parametrize("keep", [None, 16])
def test_byte_counts_asked_as_the_run_goes_equal_sums_over_the_records(keep):
    """Asked after every step (as ``zerosim train`` asks), in every combination, the ledger's
    byte counts equal the records' bytes summed here: for the step just taken and for the run so
    far, while it folds (keep=16) or not."""
    recs = records(300)  # ten calls a step, steps 0-29
    ledger = Ledger(keep=keep)
    fields = {None: "bytes_sent", "intra": "intra_bytes", "inter": "inter_bytes"}
    for step in range(30):
        for r in recs[10 * step : 10 * step + 10]:
            ledger.append(r)
        seen = recs[: 10 * step + 10]
        for op in (None, *OPS):
            for phase in (None, "forward", "backward", "step"):
                for where, field in fields.items():
                    got = ledger.bytes_sent(op, phase, step, where)
                    assert got == _by_hand(seen, op, phase, step, field)
                    assert ledger.bytes_sent(op, phase, where=where) == _by_hand(
                        seen, op, phase, field=field
                    )
                assert ledger.bytes_recv(op, phase, step) == _by_hand(
                    seen, op, phase, step, "bytes_recv"
                )
                assert ledger.bytes_recv(op, phase) == _by_hand(seen, op, phase, field="bytes_recv")
    assert ledger.bytes_sent() == sum(r.bytes_sent for r in recs) > 0
    if keep is not None:
        assert ledger.folded_calls > 0  # the totals went on through the folds
    ledger.reset()
    assert ledger.bytes_sent() == ledger.bytes_recv() == ledger.bytes_sent(step=29) == 0


def test_byte_counts_follow_records_assigned_to_the_ledger():
    recs = records(100)
    ledger = Ledger()
    ledger.append(recs[0])
    assert ledger.bytes_sent() == recs[0].bytes_sent
    ledger.records = recs[50:]
    assert ledger.bytes_sent() == _by_hand(recs[50:]) and ledger.bytes_sent(step=0) == 0
    assert ledger.bytes_recv("all_reduce", step=7) == _by_hand(
        recs[50:], "all_reduce", None, 7, "bytes_recv"
    )


class _CountedRecord(Record):
    """A record that counts how often its fields are read."""

    __slots__ = ()
    reads = [0]

    def __getattribute__(self, name):
        _CountedRecord.reads[0] += 1
        return object.__getattribute__(self, name)


def _reads_of_the_last_step_query(steps):
    """Records read by the byte queries of the last of ``steps`` steps (ten calls each) of a
    ledger that keeps every record, asked after each step as ``zerosim train`` asks."""
    recs = [_CountedRecord(*astuple(r)) for r in records(10 * steps)]
    ledger = Ledger(keep=None)
    for step in range(steps):
        for r in recs[10 * step : 10 * step + 10]:
            ledger.append(r)
        _CountedRecord.reads[0] = 0
        for phase in ("forward", "backward", "step", "clip"):
            ledger.bytes_sent(phase=phase, step=step)
    return _CountedRecord.reads[0]


def test_a_step_s_byte_counts_read_as_many_records_after_200_steps_as_after_2():
    """Asking for the bytes of the step just taken reads that step's records only, not every
    record kept: the 200th step's queries read as many as the 2nd's (scanning read 2,000)."""
    late, early = _reads_of_the_last_step_query(200), _reads_of_the_last_step_query(2)
    assert 0 < late == early


@pytest.mark.parametrize("keep", [0, -3, 1.5, True, "10"])
def test_keep_must_be_a_positive_int_or_none(keep):
    with pytest.raises(ValueError, match=rf"keep must be a positive int or None .*got {keep!r}"):
        Ledger(keep=keep)
    ledger = Ledger()
    with pytest.raises(ValueError, match="keep must be"):
        ledger.keep = keep
    assert ledger.keep == 50_000
    assert Ledger(keep=np.int64(7)).keep == 7 and type(Ledger(keep=np.int64(7)).keep) is int


def test_a_long_run_of_collectives_stays_bounded_and_counts_every_byte():
    """3 ranks, 500 all-reduces of 12 float32 each, ledger keeping 16 records: every call is in
    the totals, with the ring's bytes 2(N-1)/N · S per rank (S = 48 bytes)."""

    def run(comm):
        comm.ledger.keep = 16
        longest, total = 0, 0.0
        for i in range(500):
            buf = np.full(12, comm.rank + i, dtype=np.float32)
            comm.all_reduce(buf)
            total += float(buf[0])
            longest = max(longest, len(comm.ledger.records))
        (row,) = comm.ledger.summary()
        return longest, row["calls"], comm.ledger.bytes_sent(), total

    for longest, calls, sent, total in zs.LocalWorld(3).run(run):
        assert longest < 32 and calls == 500
        assert sent == 500 * 2 * 2 * 48 // 3
        assert total == sum(3 * i + 3 for i in range(500))  # rank + i summed over ranks 0-2
