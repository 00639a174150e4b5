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

WHERE = {"intra": "intra_bytes", "inter": "inter_bytes"}


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
        self.records: list[Record] = []
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

    def append(self, record: Record) -> Record:
        self.records.append(record)
        if len(self.records) >= self._fold_at:
            self._fold()
        return record

    def _fold(self) -> None:
        """Fold the oldest records into the totals, leaving the newest ``keep``; a non-blocking
        call not waited on yet (no wall time) stays a record, ahead of them, until a later fold
        finds it complete."""
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

    def _folded_rows(self, op: str | None, phase: str | None) -> list[_Folded]:
        return [
            f
            for (f_phase, f_op, *_), f in self.folded.items()
            if (op is None or f_op == op) and (phase is None or f_phase == phase)
        ]

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
        field = WHERE.get(where)
        if where is not None and field is None:
            raise ValueError(f"where must be None, 'intra' or 'inter', got {where!r}")
        kept = sum(getattr(r, field or "bytes_sent") for r in self.select(op, phase, step))
        if step is not None:
            return kept
        folded = {"intra_bytes": "intra", "inter_bytes": "inter"}.get(field, "bytes_sent")
        return kept + sum(getattr(f, folded) for f in self._folded_rows(op, phase))

    def bytes_recv(
        self, op: str | None = None, phase: str | None = None, step: int | None = None
    ) -> int:
        """Bytes this rank received, optionally only for one op, phase or step."""
        kept = sum(r.bytes_recv for r in self.select(op, phase, step))
        if step is not None:
            return kept
        return kept + sum(f.bytes_recv for f in self._folded_rows(op, phase))

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
