"""The ledger: one record per collective call, so measured bytes can be set beside the formulas.

Each communicator owns a ledger (sub-groups made by ``split`` write to their parent's). A record
says which collective ran, in which phase of training (``forward``, ``backward``, ``step`` …, set
with ``comm.phase(name)``), on which group, with which dtype and how many elements, how many bytes
this rank sent and received, and how long it took.

Byte counts follow nccl-tests' conventions. ``size_bytes`` (S) is the full buffer: the output of an
all-gather, the input of a reduce-scatter, the buffer of an all-reduce or broadcast. With native
collectives the bytes are those a ring algorithm moves (``counted == "model"``); with
``collectives="ring"`` they are the bytes our own ring really handed to send calls
(``counted == "wire"``), and the two agree exactly (tests hold them to it).

    algbw = S / time                      busbw = algbw · factor
    factor: all_gather, reduce_scatter, all_to_all (N−1)/N · all_reduce 2(N−1)/N · broadcast 1

**Intra- and inter-node bytes.** Ranks sit on nodes (``comm.set_ranks_per_node``); each record
splits ``bytes_sent`` into ``intra_bytes`` (sent to a rank on this rank's node) and
``inter_bytes`` (sent to another node), so ``bytes_sent == intra_bytes + inter_bytes``. The ring
collectives (native or ours) send everything to the next rank of the group, so the whole amount
is intra or inter by that one neighbour's node; an all-to-all sends block j to rank j, so it is
split block by block. Without a node map the whole group is one node: everything is intra.
``ledger.node`` is this rank's node: sub-groups, which share their parent's ledger, learn their
members' nodes from it.

**DeepSpeed's layout.** ``ds_summary()`` / ``ds_table()`` give the same records as DeepSpeed's
comms logger ``log_summary()`` shows them (its names, message sizes, ms and Gbit/s;
``comm/deepspeed_log.py``), to diff a zerosim run against a DeepSpeed log.

**Bounded.** A run makes collectives for as long as it trains, so the ledger keeps its newest
records one by one (``keep`` of them, 50,000 by default, and up to twice that between folds:
about 400 bytes each, so 20-40 MB) and folds older ones into totals per (phase, op, group, dtype,
group size, buffer size). ``summary()``, ``table()``, ``ds_summary()`` and ``bytes_sent()`` /
``bytes_recv()`` without a step count every call of the run; ``records``, ``select()`` and
``to_json()`` hold the kept ones, and asking ``select()`` or the byte counts for a step whose
records were folded is an error naming the step. A folded call still leaves its wall time (8
bytes, outside the garbage collector's reach) for DeepSpeed's trimmed-mean latencies, as
DeepSpeed's comms logger keeps every latency: that part grows with the run, 25 times slower than
records would. A non-blocking call not waited on yet stays a record until it is. ``keep=None``
keeps every record.

**Byte counts as the run goes.** ``bytes_sent()`` and ``bytes_recv()`` are answered from running
totals per (phase, op), for the whole run and for each step still kept. A query first adds the
records appended since the one before (``append`` itself only appends: it is on every
collective's path), so asking once per step costs the same after a thousand steps as after one
(``zerosim train`` asks four times per step; scanning every kept record made its 1,400th step
1.4 times as slow as its first at N = 4: ``benchmarks/long_run.py``). Records enter by
``append`` (or by assigning ``records``, which counts them again).

**The schedule.** With ``ledger.events`` a list (None by default), every call of this rank's
groups appends ``("issue", record)`` once its record is written and every ``Handle.wait()`` that
completes a non-blocking call appends ``("wait", record)``: the order in which the program issued
and waited on its collectives, which the dry run's time model replays (tests hold the dry run's
order to a real run's), with ``("stream", name)`` where the engine notes where a GPU would run
what follows (``Communicator.note_stream``): "reduce", on DeepSpeed's reduction stream (stage
3); "reduce_in_turn", on it once the compute stream has waited for it (stages 1 and 2);
"compute", back on the compute stream; "sync", the host waiting for the reduction stream.
Nothing else changes while it is on.

**Flight recorder.** ``ledger.flight`` numbers every call as it starts and keeps the last K of
them, whatever ``reset()`` clears: what the watchdog prints when a collective stalls
(``comm/flight.py``).
"""

from __future__ import annotations

import json
import operator
import sys
import time
from array import array
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict

from zerosim.comm import deepspeed_log
from zerosim.comm.flight import FlightRecorder
from zerosim.comm.record import Record, busbw_factor

# the running totals of a (phase, op): [bytes sent, bytes received, of the sent intra, inter]
SENT, RECV, INTRA, INTER = range(4)
_SUM_OF = {None: SENT, "intra": INTRA, "inter": INTER}


DEFAULT_KEEP = 50_000  # records kept one by one (about 400 bytes each), up to twice as many


def check_keep(keep: int | None) -> int | None:
    if keep is None:
        return None
    try:
        value = operator.index(keep)  # ints, NumPy's included; not bools, floats or strings
    except TypeError:
        value = None
    if value is None or isinstance(keep, bool) or value < 1:
        raise ValueError(f"keep must be a positive int or None (keep every record), got {keep!r}")
    return value


class _Folded:
    """The totals of the folded calls of one (phase, op, group, dtype, peers, size_bytes)."""

    __slots__ = (
        "calls", "elements", "bytes_sent", "bytes_recv", "intra", "inter", "time_s", "times"
    )  # fmt: skip

    def __init__(self) -> None:
        self.calls = self.elements = self.bytes_sent = self.bytes_recv = 0
        self.intra = self.inter = 0
        self.time_s = 0.0  # their wall times summed
        self.times = array("d")  # every call's wall time, seconds

    def add(self, r: Record) -> None:
        self.calls += 1
        self.elements += r.elements
        self.bytes_sent += r.bytes_sent
        self.bytes_recv += r.bytes_recv
        self.intra += r.intra_bytes
        self.inter += r.inter_bytes
        self.time_s += r.wall_time or 0.0
        self.times.append(r.wall_time or 0.0)

    def merge(self, other: _Folded, times: bool = True) -> None:
        self.calls += other.calls
        self.elements += other.elements
        self.bytes_sent += other.bytes_sent
        self.bytes_recv += other.bytes_recv
        self.intra += other.intra
        self.inter += other.inter
        self.time_s += other.time_s
        if times:
            self.times.extend(other.times)


class Ledger:
    """This rank's list of collective records, with the current phase and training step; the
    last ``keep`` records one by one, older ones folded into totals (module docstring)."""

    def __init__(self, keep: int | None = DEFAULT_KEEP) -> None:
        self._records: list[Record] = []
        # running byte totals per (phase, op) (SENT … INTER): of the whole run, and of each step
        # that has records kept (steps folded in whole or in part are dropped at the fold)
        self._run_bytes: dict[tuple[str, str], list[int]] = {}
        self._step_bytes: dict[int, dict[tuple[str, str], list[int]]] = {}
        self._counted = 0  # records[:_counted] are in those totals, the newer ones not yet
        self.keep = keep
        # (phase, op, group, dtype, peers, size_bytes) → the folded calls' totals
        self.folded: dict[tuple, _Folded] = {}
        self.folded_calls = 0
        self.folded_through_step: int | None = None  # the latest step a folded record had
        self.step = 0
        self._phases: list[str] = []
        self._t0 = time.perf_counter()
        self.node: int | None = None  # this rank's node (None: unknown, one node for all)
        self.node_version = 0  # bumped when ``node`` is set, so sub-groups learn it again
        self.flight = FlightRecorder()  # the last K calls, numbered; survives ``reset()``
        # when a list: ("issue", record) per call, ("wait", record) per completing wait and
        # ("stream", name) per stream note
        self.events: list[tuple[str, Record | str]] | None = None

    @property
    def current_phase(self) -> str:
        return self._phases[-1] if self._phases else "none"

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Label every record made inside the block with ``name``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"phase name must be a non-empty string, got {name!r}")
        self._phases.append(name)
        try:
            yield
        finally:
            self._phases.pop()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    @property
    def keep(self) -> int | None:
        """How many records are kept one by one (None: all of them)."""
        return self._keep

    @keep.setter
    def keep(self, value: int | None) -> None:
        self._keep = check_keep(value)
        # fold in batches of ``keep`` (amortised: one list shift per ``keep`` calls)
        self._fold_at = sys.maxsize if self._keep is None else 2 * self._keep

    @property
    def records(self) -> list[Record]:
        """The records kept one by one, oldest first."""
        return self._records

    @records.setter
    def records(self, records: list[Record]) -> None:
        """Replace the kept records (the folded totals stay); the byte totals are counted again."""
        self._records = list(records)
        self._run_bytes = {
            key: [f.bytes_sent, f.bytes_recv, f.intra, f.inter]
            for key, f in self._folded_by_phase_op().items()
        }
        self._step_bytes = {}
        self._counted = 0

    def append(self, record: Record) -> Record:
        self._records.append(record)
        if len(self._records) >= self._fold_at:
            self._fold()
        return record

    def _count_new(self) -> None:
        """Add the records appended since the last count to the running byte totals of their
        (phase, op), of the run and of their step."""
        records, run, steps = self._records, self._run_bytes, self._step_bytes
        for i in range(self._counted, len(records)):
            r = records[i]
            key = (r.phase, r.op)
            step = steps.get(r.step)
            if step is None:
                step = steps[r.step] = {}
            for table in (run, step):
                sums = table.get(key)
                if sums is None:
                    sums = table[key] = [0, 0, 0, 0]
                sums[SENT] += r.bytes_sent
                sums[RECV] += r.bytes_recv
                sums[INTRA] += r.intra_bytes
                sums[INTER] += r.inter_bytes
        self._counted = len(records)

    def _fold(self) -> None:
        """Fold the oldest records into the totals, leaving the newest ``keep``; a non-blocking
        call not waited on yet (no wall time) stays a record, ahead of them, until a later fold
        finds it complete."""
        self._count_new()  # before the records move
        older = len(self.records) - self._keep
        waiting = []
        for r in self.records[:older]:
            if r.wall_time is None:
                waiting.append(r)
                continue
            key = (r.phase, r.op, r.group, r.dtype, r.peers, r.size_bytes)
            folded = self.folded.get(key)
            if folded is None:
                folded = self.folded[key] = _Folded()
            folded.add(r)
            if self.folded_through_step is None or r.step > self.folded_through_step:
                self.folded_through_step = r.step
        self.folded_calls += older - len(waiting)
        self.records[:older] = waiting
        self._counted = len(self.records)
        last = self.folded_through_step
        for step in [s for s in self._step_bytes if last is not None and s <= last]:
            del self._step_bytes[step]  # asking for it is an error from now on

    def set_node(self, node: int | None) -> None:
        """Record this rank's node (``comm.set_ranks_per_node`` calls it)."""
        self.node = node
        self.node_version += 1

    def reset(self) -> None:
        """Forget every record, kept or folded (the phase stack, step and flight recorder are
        kept)."""
        self.records.clear()
        self.folded.clear()
        self.folded_calls = 0
        self.folded_through_step = None
        self._run_bytes.clear()
        self._step_bytes.clear()
        self._counted = 0

    def _check_step_kept(self, step: int | None) -> None:
        if step is not None and self.folded_through_step is not None:
            if step <= self.folded_through_step:
                raise ValueError(
                    f"step={step}: records of steps up to {self.folded_through_step} were "
                    f"folded into totals (the ledger kept the newest records one by one); ask "
                    f"for a later step, or keep every record (Ledger(keep=None), before the run)"
                )

    def _totals(self, times: bool) -> dict[tuple, _Folded]:
        """Folded and kept calls together, per fold key, in first-call order (with every call's
        wall time when ``times``; else only their sum)."""
        totals: dict[tuple, _Folded] = {}
        for key, f in self.folded.items():
            t = totals[key] = _Folded()
            t.merge(f, times)
        for r in self.records:
            key = (r.phase, r.op, r.group, r.dtype, r.peers, r.size_bytes)
            t = totals.get(key)
            if t is None:
                t = totals[key] = _Folded()
            t.add(r)
        return totals

    def _folded_by_phase_op(self) -> dict[tuple[str, str], _Folded]:
        """The folded totals summed per (phase, op)."""
        out: dict[tuple[str, str], _Folded] = {}
        for (phase, op, *_), f in self.folded.items():
            out.setdefault((phase, op), _Folded()).merge(f, times=False)
        return out

    def _bytes(self, column: int, op: str | None, phase: str | None, step: int | None) -> int:
        """One column of the running totals, summed over the (phase, op) asked for."""
        self._check_step_kept(step)
        self._count_new()
        table = self._run_bytes if step is None else self._step_bytes.get(step, {})
        return sum(
            sums[column]
            for (t_phase, t_op), sums in table.items()
            if (op is None or t_op == op) and (phase is None or t_phase == phase)
        )

    def select(
        self, op: str | None = None, phase: str | None = None, step: int | None = None
    ) -> list[Record]:
        """The kept records of one op, phase or step (``folded_calls`` older ones are in the
        totals only)."""
        self._check_step_kept(step)
        return [
            r
            for r in self.records
            if (op is None or r.op == op)
            and (phase is None or r.phase == phase)
            and (step is None or r.step == step)
        ]

    def bytes_sent(
        self,
        op: str | None = None,
        phase: str | None = None,
        step: int | None = None,
        where: str | None = None,
    ) -> int:
        """Bytes this rank sent, optionally only for one op, phase or step.

        ``where="intra"`` counts only bytes sent to ranks of this rank's node, ``"inter"`` only
        bytes sent to other nodes; None counts both.
        """
        if where is not None and where not in ("intra", "inter"):
            raise ValueError(f"where must be None, 'intra' or 'inter', got {where!r}")
        return self._bytes(_SUM_OF[where], op, phase, step)

    def bytes_recv(
        self, op: str | None = None, phase: str | None = None, step: int | None = None
    ) -> int:
        """Bytes this rank received, optionally only for one op, phase or step."""
        return self._bytes(RECV, op, phase, step)

    def summary(self) -> list[dict]:
        """Rows aggregated by (phase, op, group, dtype): calls, bytes, time, bandwidths."""
        groups: dict[tuple, list[tuple[_Folded, int, int]]] = defaultdict(list)
        for (phase, op, group, dtype, peers, size), f in self._totals(times=False).items():
            groups[(phase, op, group, dtype)].append((f, peers, size))
        out = []
        for (phase, op, group, dtype), parts in groups.items():
            t = sum(f.time_s for f, _, _ in parts)
            size = sum(f.calls * s for f, _, s in parts)
            algbw = size / t if t > 0 else 0.0
            peers = parts[0][1]
            out.append(
                {
                    "phase": phase,
                    "op": op,
                    "group": group,
                    "dtype": dtype,
                    "calls": sum(f.calls for f, _, _ in parts),
                    "peers": peers,
                    "elements": sum(f.elements for f, _, _ in parts),
                    "size_bytes": size,
                    "bytes_sent": sum(f.bytes_sent for f, _, _ in parts),
                    "bytes_recv": sum(f.bytes_recv for f, _, _ in parts),
                    "intra_bytes": sum(f.intra for f, _, _ in parts),
                    "inter_bytes": sum(f.inter for f, _, _ in parts),
                    "time_s": t,
                    "algbw_GBps": algbw / 1e9,
                    "busbw_GBps": algbw * busbw_factor(op, peers) / 1e9,
                }
            )
        return out

    def table(self) -> str:
        """A text table of ``summary()``, for printing at the end of a run."""
        rows = self.summary()
        header = (
            f"{'phase':<10} {'op':<15} {'group':<15} {'dtype':<9} {'calls':>6} "
            f"{'sent (B)':>14} {'recv (B)':>14} {'time (ms)':>10} {'busbw GB/s':>11}"
        )
        lines = [header, "-" * len(header)]
        for r in rows:
            lines.append(
                f"{r['phase']:<10} {r['op']:<15} {r['group']:<15} {r['dtype']:<9} {r['calls']:>6} "
                f"{r['bytes_sent']:>14,} {r['bytes_recv']:>14,} {r['time_s'] * 1e3:>10.2f} "
                f"{r['busbw_GBps']:>11.3f}"
            )
        total_sent = sum(r["bytes_sent"] for r in rows)
        total_recv = sum(r["bytes_recv"] for r in rows)
        lines.append("-" * len(header))
        lines.append(f"{'total':<58} {total_sent:>14,} {total_recv:>14,}")
        return "\n".join(lines)

    def ds_summary(self, world_size: int | None = None) -> dict[str, dict[int, dict]]:
        """The records as DeepSpeed's comms logger sums them up: ``{name: {message size: row}}``
        with the keys of ``deepspeed.comm.log_summary(return_dict=True)["summary"]`` (count,
        total and average latency in ms, algbw and busbw in Gbit/s). DeepSpeed's names, message
        sizes (an all-gather's input shard, a reduce-scatter's or all-reduce's full buffer) and
        arithmetic: ``comm/deepspeed_log.py``. ``world_size`` (DeepSpeed's n in the bandwidths)
        defaults to the largest group in the records, the world's."""
        totals = self._totals(times=True)
        n = world_size or max((key[4] for key in totals), default=1)
        calls = [(key[1], key[5], key[4], t.times) for key, t in totals.items()]
        return deepspeed_log.summary((), n, calls)

    def ds_table(self, world_size: int | None = None) -> str:
        """``ds_summary()`` as the text ``deepspeed.comm.log_summary()`` prints."""
        return deepspeed_log.table(self.ds_summary(world_size))

    def to_json(self) -> str:
        """Every kept record as JSON (one object per record, with algbw and busbw in bytes/s)."""
        return json.dumps([{**asdict(r), "algbw": r.algbw, "busbw": r.busbw} for r in self.records])
