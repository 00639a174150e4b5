"""``zerosim flight DIR``: the flight files of a stalled job read back, and what held it up.

With ``zerosim.flight_dir`` (or ``ZEROSIM_FLIGHT_DIR``) every rank that gives up or raises writes
its flight record to ``<dir>/rank<R>.json`` (``comm/flight.py``), with what it could see of the
other ranks on its node. ``summarize`` puts the files together and sorts the ranks as the
watchdog's report does (``faults/diagnosis.py``); ``format_summary`` says it in lines.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zerosim.faults.diagnosis import LEFT, diagnose, has_left, position, rank_state

FILE_PATTERN = "rank*.json"


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
            "ZEROSIM_FLIGHT_DIR to write them"
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
