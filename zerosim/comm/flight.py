"""The watchdog's settings and the flight recorder: what a rank was doing when a job stalled.

Every collective a rank starts gets a call number (#1, #2, … on this rank's ledger, never reset)
and is remembered in a ring of the last K calls (``zerosim.flight_records``, default 64), which
``ledger.reset()`` does not clear. When the watchdog gives up on a collective (after
``zerosim.timeout`` seconds, or ``ZEROSIM_TIMEOUT``) or a rank raises under ``mpirun``, the rank
prints its record; with ``zerosim.flight_dir`` (or ``ZEROSIM_FLIGHT_DIR``) it also writes it to
``<dir>/rank<R>.json``. ``zerosim flight DIR`` reads those files (``faults/flight_files.py``) and
says which rank is behind and on which call. PyTorch's NCCL flight recorder is the model
(``TORCH_NCCL_TRACE_*``).

The files hold, besides this rank's records, what the rank could see of the other ranks on its
node (``node_ranks``, from the MPI world's shared progress table; see ``comm/watchdog.py``): how
many calls each had begun, the call it was inside, if any, and how long ago its process last ran.
A rank that stopped calling collectives, whose process was stopped, or that left the program (it
exited while the others train on) writes no file itself, but its neighbours' files say where it is.
``faults/diagnosis.py`` puts that into words, for the watchdog's report and for ``zerosim flight``
alike.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
import weakref
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zerosim.comm.record import Record

ENV_TIMEOUT = "ZEROSIM_TIMEOUT"
ENV_FLIGHT_DIR = "ZEROSIM_FLIGHT_DIR"
DEFAULT_TIMEOUT = 600.0  # seconds, as ``zerosim.timeout``'s default
DEFAULT_RECORDS = 64  # calls kept, as ``zerosim.flight_records``'s default


def check_timeout(value: Any, name: str = "timeout") -> float:
    """``value`` as seconds: a finite number ≥ 0, where 0 means never give up."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a number of seconds >= 0 (0 = never), got {value!r}")
    return float(value)


def env_timeout() -> float | None:
    """``ZEROSIM_TIMEOUT`` in seconds, or None when it is not set."""
    raw = os.environ.get(ENV_TIMEOUT, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = raw  # type: ignore[assignment]  (check_timeout names it)
    return check_timeout(value, f"the environment variable {ENV_TIMEOUT}")


def default_timeout() -> float:
    """The timeout of a communicator nobody configured: ``ZEROSIM_TIMEOUT``, else 600 s."""
    value = env_timeout()
    return DEFAULT_TIMEOUT if value is None else value


def env_flight_dir() -> str | None:
    return os.environ.get(ENV_FLIGHT_DIR) or None


def _row(seq: int, r: Record) -> dict[str, Any]:
    return {
        "call": seq,
        "op": r.op,
        "phase": r.phase,
        "group": r.group,
        "dtype": r.dtype,
        "elements": r.elements,
        "step": r.step,
        "blocking": r.blocking,
        "start_s": round(r.start, 6),
        "wall_time_s": None if r.wall_time is None else round(r.wall_time, 6),
    }


_LIVE: weakref.WeakSet[FlightRecorder] = weakref.WeakSet()


def live_recorders() -> list[FlightRecorder]:
    """The recorders of this process that have seen a call (what the exception hook prints)."""
    return [r for r in list(_LIVE) if r.calls]


class FlightRecorder:
    """The last ``size`` calls of one rank's ledger, numbered from 1; kept across ledger resets.

    ``calls`` counts every call begun. A record whose ``wall_time`` is None has not completed
    (a collective still in flight, one being waited on, or one that raised).
    """

    def __init__(self, size: int = DEFAULT_RECORDS) -> None:
        # calls begun, in one int64 of memory: this recorder's own, or the cell of the MPI
        # world's progress table that the other ranks of the node read (``count_in``)
        self._count = memoryview(bytearray(8)).cast("q")
        self._ring: deque[tuple[int, Record]] = deque(maxlen=self._check_size(size))
        self.directory: str | None = env_flight_dir()  # where ``dump`` writes, if anywhere
        _LIVE.add(self)

    @staticmethod
    def _check_size(size: Any) -> int:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"flight_records must be an int >= 0, got {size!r}")
        return size

    @property
    def size(self) -> int:
        return self._ring.maxlen or 0

    def resize(self, size: int) -> None:
        """Keep the last ``size`` calls from now on (the newest ones already kept stay)."""
        self._ring = deque(self._ring, maxlen=self._check_size(size))

    @property
    def calls(self) -> int:
        """How many calls have begun (the number of the latest)."""
        return self._count[0]

    def count_in(self, cell: memoryview) -> None:
        """Count calls in ``cell`` (one int64 of shared memory) from now on. The MPI watchdog
        gives the world ledger's recorder a cell of its node's progress table, so that the
        other ranks read this rank's count as it is at every moment, even once its process is
        stopped (a copy made by a thread would be as old as the thread's last look)."""
        cell[0] = self._count[0]
        self._count = cell

    def begin(self, record: Record) -> int:
        """Number a call that is starting and remember it; returns its number."""
        count = self._count
        seq = count[0] + 1
        count[0] = seq
        self._ring.append((seq, record))
        return seq

    def entries(self) -> list[tuple[int, Record]]:
        return list(self._ring)

    def rows(self) -> list[dict[str, Any]]:
        return [_row(seq, r) for seq, r in self._ring]

    def format(self, rank: int) -> str:
        """A text table of the kept calls, oldest first."""
        head = (
            f"[zerosim rank {rank}] flight record: the last {len(self._ring)} of {self.calls} "
            f"collective calls, oldest first"
        )
        lines = [
            head,
            f"  {'call':>6} {'step':>5} {'phase':<12} {'op':<15} {'group':<15} {'dtype':<9} "
            f"{'elements':>12} {'time ms':>9}",
        ]
        for seq, r in self._ring:
            took = "not done" if r.wall_time is None else f"{r.wall_time * 1e3:.3f}"
            lines.append(
                f"  {seq:>6} {r.step:>5} {r.phase:<12} {r.op:<15} {r.group:<15} {r.dtype:<9} "
                f"{r.elements:>12,} {took:>9}"
            )
        return "\n".join(lines)

    def dump(
        self,
        rank: int,
        size: int,
        reason: str,
        waiting: dict[str, Any] | None = None,
        node_ranks: dict[int, dict[str, Any]] | None = None,
    ) -> Path | None:
        """Write ``<directory>/rank<R>.json`` when a directory is set; returns the path."""
        if not self.directory:
            return None
        seen = None if node_ranks is None else {str(q): v for q, v in node_ranks.items()}
        report = {
            "rank": rank,
            "size": size,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "time": time.time(),
            "reason": reason,
            "calls": self.calls,
            "waiting": waiting,
            "records": self.rows(),
            "node_ranks": seen,
        }
        folder = Path(self.directory)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{rank}.json"
        tmp = path.with_suffix(f".json.tmp{os.getpid()}")
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        os.replace(tmp, path)
        return path
