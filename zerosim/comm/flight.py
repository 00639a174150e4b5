"""The watchdog's settings and the flight recorder: what a rank was doing when a job stalled.

Every collective a rank starts gets a call number (#1, #2, … on this rank's ledger, never reset)
and is remembered in a ring of the last K calls (``zerosim.flight_records``, default 64), which
``ledger.reset()`` does not clear. When the watchdog gives up on a collective (after
``zerosim.timeout`` seconds, or ``ZEROSIM_TIMEOUT``) or a rank raises under ``mpirun``, the rank
prints its record; with ``zerosim.flight_dir`` (or ``ZEROSIM_FLIGHT_DIR``) it also writes it to
``<dir>/rank<R>.json``. ``zerosim flight DIR`` reads those files (``diagnose``) and says which rank
is behind and on which call. PyTorch's NCCL flight recorder is the model (``TORCH_NCCL_TRACE_*``).

The files hold, besides this rank's records, what the rank could see of the other ranks on its
node (``node_ranks``, from the MPI world's shared progress table; see ``comm/mpi.py``): how many
calls each had begun and whether it was waiting in one. A rank that stopped calling collectives
writes no file itself, but its neighbours' files say where it stopped.
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
    from zerosim.comm.ledger import Record

ENV_TIMEOUT = "ZEROSIM_TIMEOUT"
ENV_FLIGHT_DIR = "ZEROSIM_FLIGHT_DIR"
DEFAULT_TIMEOUT = 600.0  # seconds, as ``zerosim.timeout``'s default
DEFAULT_RECORDS = 64  # calls kept, as ``zerosim.flight_records``'s default
FILE_PATTERN = "rank*.json"


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


def describe(seq: int, record: Record | None, stage: str = "") -> str:
    """One line naming a call: ``all_reduce call #57 (phase 'forward', group 'world', …)``."""
    if record is None:
        return f"call #{seq}" + (f" ({stage})" if stage else "")
    text = (
        f"{record.op} call #{seq} (phase {record.phase!r}, group {record.group!r}, "
        f"{record.dtype}, {record.elements:,} elements, step {record.step})"
    )
    return text + (f", in its {stage}" if stage else "")


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
        self.calls = 0
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

    def begin(self, record: Record) -> int:
        """Number a call that is starting and remember it; returns its number."""
        self.calls += 1
        self._ring.append((self.calls, record))
        return self.calls

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


# -- reading the files back (``zerosim flight DIR``) ---------------------------------------------
def read_reports(directory: str | Path) -> list[dict[str, Any]]:
    """Every ``rank*.json`` in ``directory``, in rank order."""
    folder = Path(directory)
    if not folder.is_dir():
        raise FileNotFoundError(f"flight directory {str(folder)!r} does not exist")
    reports = []
    for path in sorted(folder.glob(FILE_PATTERN)):
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"{path}: not a zerosim flight record ({err})") from err
        if not isinstance(report, dict) or "rank" not in report or "records" not in report:
            raise ValueError(f"{path}: not a zerosim flight record (no 'rank' or 'records')")
        reports.append(report)
    if not reports:
        raise FileNotFoundError(
            f"no flight records ({FILE_PATTERN}) in {str(folder)!r}; set zerosim.flight_dir or "
            f"{ENV_FLIGHT_DIR} to write them"
        )
    return sorted(reports, key=lambda r: r["rank"])


def _last_call(report: dict[str, Any]) -> str:
    if not report["records"]:
        return "no call yet"
    r = report["records"][-1]
    state = "completed" if r["wall_time_s"] is not None else "not completed"
    return (
        f"#{r['call']} {r['op']} (phase {r['phase']!r}, group {r['group']!r}, {r['dtype']}, "
        f"{r['elements']:,} elements), {state}"
    )


def _status(rank: int, reports: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """What is known of ``rank``: its own file, else a node neighbour's view of it."""
    if rank in reports:
        own = reports[rank]
        waiting = own.get("waiting") or {}
        return {
            "calls": own["calls"],
            "waiting": waiting.get("call", 0),
            "what": waiting.get("what"),
            "reason": own.get("reason", ""),
            "last": _last_call(own),
            "source": "its own file",
        }
    for other in reports.values():
        seen = (other.get("node_ranks") or {}).get(str(rank))
        if seen is not None:
            return {
                "calls": seen["calls"],
                "waiting": seen.get("waiting", 0),
                "what": None,
                "reason": "wrote no file",
                "last": f"#{seen.get('last_call')} {seen.get('op')} (the last it waited in)",
                "source": f"rank {other['rank']}'s file (same node)",
            }
    return None


def summarize(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Which rank is behind and on which call, from the ranks' flight records.

    ``ranks``: each rank's status (None when neither its file nor a neighbour's saw it);
    ``behind``: ranks that began fewer calls than the most any rank began; ``waiting``: ranks
    waiting in a call; ``raised``: ranks whose file says they raised.
    """
    by_rank = {r["rank"]: r for r in reports}
    size = max(max(int(r.get("size", 0)) for r in reports), max(by_rank) + 1)
    ranks = {q: _status(q, by_rank) for q in range(size)}
    known = {q: s for q, s in ranks.items() if s is not None}
    most = max(s["calls"] for s in known.values())
    waiting = sorted(q for q, s in known.items() if s["waiting"])
    what = next((known[q]["what"] for q in waiting if known[q]["what"]), None)
    return {
        "size": size,
        "files": sorted(by_rank),
        "ranks": ranks,
        "most_calls": most,
        "behind": sorted(q for q, s in known.items() if s["calls"] < most),
        "waiting": waiting,
        "waiting_in": what,
        "raised": sorted(q for q, s in known.items() if s["reason"].startswith("exception")),
    }


def format_summary(summary: dict[str, Any]) -> str:
    """``summarize``'s answer as the lines ``zerosim flight`` prints."""
    lines = [f"flight records of {len(summary['files'])} of {summary['size']} ranks"]
    for q, s in summary["ranks"].items():
        if s is None:
            lines.append(f"  rank {q}: no file, and no rank of its node saw it")
            continue
        where = "is not in a collective"
        if s["waiting"]:
            where = f"waits in {s['what'] or 'call #' + str(s['waiting'])}"
        lines.append(
            f"  rank {q}: began {s['calls']} calls, {where}; last: {s['last']} "
            f"[{s['reason']}; from {s['source']}]"
        )
    for q in summary["raised"]:
        lines.append(f"rank {q} raised: {summary['ranks'][q]['reason']}")
    waiting_in = summary["waiting_in"] or "a call"
    for q in summary["behind"]:
        s = summary["ranks"][q]
        idle = "" if s["waiting"] else " and is not in a collective (computing, sleeping, stuck)"
        lines.append(
            f"rank {q} is behind: it began {s['calls']} collective calls, other ranks "
            f"{summary['most_calls']}; it has not reached call #{s['calls'] + 1}{idle}"
        )
    ahead = [q for q in summary["waiting"] if q not in summary["behind"]]
    if summary["behind"] and ahead:
        lines.append(f"ranks {ahead} wait for it in {waiting_in}")
    elif summary["waiting"] and not summary["behind"]:
        lines.append(
            f"no rank is behind in calls: ranks {summary['waiting']} wait in {waiting_in}; look "
            f"for a rank that called another collective or on another group, or a dead rank"
        )
    elif not summary["behind"] and not summary["raised"]:
        lines.append(f"no rank is behind: every rank began {summary['most_calls']} calls")
    return "\n".join(lines)
