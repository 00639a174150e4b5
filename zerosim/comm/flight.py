"""The watchdog's settings and the flight recorder: what a rank was doing when a job stalled.

Every collective a rank starts gets a call number (#1, #2, … on this rank's ledger, never reset)
and is remembered in a ring of the last K calls (``zerosim.flight_records``, default 64), which
``ledger.reset()`` does not clear. When the watchdog gives up on a collective (after
``zerosim.timeout`` seconds, or ``ZEROSIM_TIMEOUT``) or a rank raises under ``mpirun``, the rank
prints its record; with ``zerosim.flight_dir`` (or ``ZEROSIM_FLIGHT_DIR``) it also writes it to
``<dir>/rank<R>.json``. ``zerosim flight DIR`` reads those files (``diagnose``) and says which rank
is behind and on which call. PyTorch's NCCL flight recorder is the model (``TORCH_NCCL_TRACE_*``).

The files hold, besides this rank's records, what the rank could see of the other ranks on its
node (``node_ranks``, from the MPI world's shared progress table; see ``comm/watchdog.py``): how
many calls each had begun, the call it was inside, if any, and how long ago its process last ran.
A rank that stopped calling collectives, whose process was stopped, or that left the program (it
exited while the others train on) writes no file itself, but its neighbours' files say where it is.
``rank_state`` and ``diagnose`` put that into words, for the watchdog's report and for ``zerosim
flight`` alike.
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
FILE_PATTERN = "rank*.json"
# A rank whose watchdog thread has not looked for this long shows no sign of life: its process
# does not run (stopped, frozen). The thread looks every quarter second; this is four looks missed.
SILENT_S = 1.0
# How a rank left the program, as the progress table tells it, in words
LEFT = {
    "exited": "its program ended: sys.exit, a return from the main program, or an exception that "
    "did not reach zerosim's exception hook",
    "vanished": "its process no longer exists and never reached zerosim's exit hook: os._exit, "
    "or a signal the launcher did not act on",
}


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


# -- what holds a stalled call up --------------------------------------------------------------
def process_gone(pid: int) -> bool:
    """Whether process ``pid`` of this node has ended (no such process, or a zombie that its
    parent has not collected yet)."""
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # it exists, as another user's
    try:
        with open(f"/proc/{pid}/stat") as stat:  # Linux: the state follows the name's ")"
            return stat.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


# A rank's state, as the progress table gives it (``watchdog.Progress.read``) and the flight files
# keep it: ``calls`` begun; ``waiting``: the call it is inside now, or None; ``op``, ``stage``
# (what of that call it waits for) and ``waited_s`` where its watchdog thread has seen that wait;
# ``silent_s``: how long ago that thread last looked (its process last ran); ``left``: None while
# the rank is in the program, else how it left (``LEFT``), ``left_s`` seconds ago.
def has_left(state: dict[str, Any]) -> bool:
    """Whether a rank has left the program: it will begin no call any more."""
    return state.get("left") is not None


def is_silent(state: dict[str, Any]) -> bool:
    """Whether a rank shows no sign of life although it has not left the program: its watchdog
    thread has not looked for SILENT_S (the process is stopped or frozen)."""
    silent = state.get("silent_s")
    return silent is not None and silent > SILENT_S and not has_left(state)


def position(state: dict[str, Any]) -> str:
    """Which call a rank is in: ``waits in call #613 (all_gather, data exchange) for 3.1 s``,
    ``is inside call #613 (all_gather)`` (what it waits for there not seen, or not now's: a
    silent rank's), ``is not in a collective``."""
    call = state.get("waiting")
    if call is None:
        return "is not in a collective"
    if state.get("stage") is None or is_silent(state) or has_left(state):
        return f"is inside call #{call}" + (f" ({state['op']})" if state.get("op") else "")
    return f"waits in call #{call} ({state['op']}, {state['stage']}) for {state['waited_s']:.1f} s"


def rank_state(state: dict[str, Any]) -> str:
    """Where a rank is, in words: ``began 613 calls, waits in call #613 (all_gather, data
    exchange) for 3.1 s``, ``… is inside call #613 (all_gather); no sign of life for 3.2 s``,
    ``began 26 calls, is not in a collective; exited 1.3 s ago (it left the program)``."""
    text = f"began {state['calls']} calls, {position(state)}"
    if state.get("left") == "exited":
        text += f"; exited {state['left_s']:.1f} s ago (it left the program)"
    elif has_left(state):
        text += f"; its process is gone (no sign of life for {state['left_s']:.1f} s)"
    elif is_silent(state):
        text += f"; no sign of life for {state['silent_s']:.1f} s (its process does not run)"
    return text


def never_arrives(call: int, state: dict[str, Any], setup: bool = False) -> bool:
    """Whether a rank has left the program without beginning call #``call`` (``setup``: the
    set-up step, a split or a barrier of MPIComm's own, that follows call #``call``)."""
    return has_left(state) and (state["calls"] <= call if setup else state["calls"] < call)


def diagnose(call: int, states: dict[int, dict[str, Any]]) -> dict[str, list[int]]:
    """Sort ranks by what they do while another rank waits in call #``call``.

    ``exited``: left the program (it exited, or its process is gone), wherever it was: it begins
    no call any more, so every call it had not begun waits for it forever. ``silent``: no sign of
    life (its process is stopped or frozen), wherever it is: what it was inside cannot complete,
    nor what the others wait for after it. ``absent``: running, in no
    collective, fewer than ``call`` calls begun: it never arrived at the call (it computes,
    sleeps, or is stuck outside zerosim). ``inside``: running and inside a call (a blocking one,
    its argument check, or the ``wait()`` of a non-blocking one): it arrived where it waits and
    is held up as well, not the cause.
    """
    out: dict[str, list[int]] = {"exited": [], "silent": [], "absent": [], "inside": []}
    for rank, state in sorted(states.items()):
        if has_left(state):
            out["exited"].append(rank)
        elif is_silent(state):
            out["silent"].append(rank)
        elif state.get("waiting") is not None:
            out["inside"].append(rank)
        elif state["calls"] < call:
            out["absent"].append(rank)
    return out


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


def _call_text(r: dict[str, Any]) -> str:
    """A flight file's record in words: ``#26 all_gather (phase 'step', group 'world', …)``."""
    return (
        f"#{r['call']} {r['op']} (phase {r['phase']!r}, group {r['group']!r}, {r['dtype']}, "
        f"{r['elements']:,} elements)"
    )


def _last_call(report: dict[str, Any]) -> str:
    if not report["records"]:
        return "no call yet"
    r = report["records"][-1]
    state = "completed" if r["wall_time_s"] is not None else "not completed"
    return f"{_call_text(r)}, {state}"


def _status(rank: int, reports: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """What is known of ``rank``: its own file (it was running: it wrote it), else a node
    neighbour's view of it from the progress table."""
    if rank in reports:
        own = reports[rank]
        waiting = own.get("waiting") or {}
        return {
            "calls": own["calls"],
            "waiting": waiting.get("call") or None,
            "what": waiting.get("what"),
            "reason": own.get("reason", ""),
            "last": _last_call(own),
            "source": "its own file",
        }
    for other in reports.values():
        seen = (other.get("node_ranks") or {}).get(str(rank))
        if seen is not None:
            kept = {r["call"]: r for r in other["records"]}  # call #k: the same op on every rank
            if seen.get("waiting") in kept and not seen.get("op"):  # name it from the
                seen = {**seen, "op": kept[seen["waiting"]]["op"]}  # neighbour's record
            if has_left(seen):  # the last call it began, as the neighbour made it
                last = kept.get(seen["calls"])
                seen = {
                    **seen,
                    "last": f"call #{seen['calls']}" if last is None else _call_text(last),
                }
            return {
                **seen,
                "what": None,
                "reason": "wrote no file",
                "source": f"rank {other['rank']}'s file (same node)",
            }
    return None


def summarize(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """What held the job up, from the ranks' flight records.

    ``ranks``: each rank's status (None when neither its file nor a neighbour's saw it);
    ``exited``: ranks that had left the program (exited, or their process was gone);
    ``silent``: ranks that showed no sign of life (their process did not run); ``behind``:
    running ranks in no collective that began fewer calls than the most any rank began (they
    never arrived at the next call); ``waiting``: ranks inside a call (held up, not the cause);
    ``raised``: ranks whose file says they raised.
    """
    by_rank = {r["rank"]: r for r in reports}
    size = max(max(int(r.get("size", 0)) for r in reports), max(by_rank) + 1)
    ranks = {q: _status(q, by_rank) for q in range(size)}
    known = {q: s for q, s in ranks.items() if s is not None}
    most = max(s["calls"] for s in known.values())
    sorted_out = diagnose(most, known)
    waiting = sorted_out["inside"]
    same_call = len({known[q]["waiting"] for q in waiting}) == 1
    what = next((known[q]["what"] for q in waiting if known[q]["what"] and same_call), None)
    return {
        "size": size,
        "files": sorted(by_rank),
        "ranks": ranks,
        "most_calls": most,
        "exited": sorted_out["exited"],
        "silent": sorted_out["silent"],
        "behind": sorted_out["absent"],
        "waiting": waiting,
        "waiting_in": what,
        "raised": sorted(q for q, s in known.items() if s["reason"].startswith("exception")),
    }


def format_summary(summary: dict[str, Any]) -> str:
    """``summarize``'s answer as the lines ``zerosim flight`` prints."""
    lines = [f"flight records of {len(summary['files'])} of {summary['size']} ranks"]
    ranks = summary["ranks"]
    for q, s in ranks.items():
        if s is None:
            lines.append(f"  rank {q}: no file, and no rank of its node saw it")
        elif s["source"] == "its own file":
            where = f"waits in {s['what']}" if s["what"] else "is not in a collective"
            lines.append(
                f"  rank {q}: began {s['calls']} calls, {where}; last: {s['last']} "
                f"[{s['reason']}; from {s['source']}]"
            )
        else:
            lines.append(f"  rank {q}: {rank_state(s)} [{s['reason']}; from {s['source']}]")
    for q in summary["raised"]:
        lines.append(f"rank {q} raised: {ranks[q]['reason']}")
    for q in summary["exited"]:
        s = ranks[q]
        lines.append(
            f"rank {q} {s['left']} {s['left_s']:.1f} s before the file was written "
            f"({LEFT[s['left']]}); the last call it began was {s['last']}, and every later call "
            f"it takes part in waits for it"
        )
    for q in summary["silent"]:
        s = ranks[q]
        lines.append(
            f"rank {q} shows no sign of life for {s['silent_s']:.1f} s: its process does not run "
            f"(stopped: SIGSTOP, a debugger; or frozen); it began {s['calls']} calls and "
            f"{position(s)}, and every call it takes part in waits for it"
        )
    for q in summary["behind"]:
        lines.append(
            f"rank {q} is behind: it began {ranks[q]['calls']} collective calls, other ranks "
            f"{summary['most_calls']}; it has not reached call #{ranks[q]['calls'] + 1} and is "
            f"not in a collective (computing, sleeping, stuck)"
        )
    held_up = summary["exited"] + summary["silent"] + summary["behind"]
    waiting_in = summary["waiting_in"] or "the calls above"
    if held_up and summary["waiting"]:
        them = "it" if len(held_up) == 1 else "them"
        lines.append(f"ranks {summary['waiting']} wait for {them} in {waiting_in}")
        for q in summary["waiting"]:
            if ranks[q]["calls"] < summary["most_calls"]:
                lines.append(
                    f"rank {q} began fewer calls ({ranks[q]['calls']}) but is inside call "
                    f"#{ranks[q]['waiting']}: it arrived there and is held up too, not behind"
                )
    elif summary["waiting"] and not held_up:
        lines.append(
            f"no rank is behind, silent or gone: ranks {summary['waiting']} wait in "
            f"{waiting_in}; look for a rank that called another collective or on another group, "
            f"a rank on another node, or a dead rank"
        )
    elif not held_up and not summary["raised"]:
        lines.append(f"no rank is behind: every rank began {summary['most_calls']} calls")
    return "\n".join(lines)
