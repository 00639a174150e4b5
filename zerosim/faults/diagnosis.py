"""Why a collective stalled: what each rank is doing, in words, and which ranks hold the call up.

The watchdog (``comm/watchdog.py``) reads every rank's state from its node's progress table when a
wait has lasted too long; ``zerosim flight DIR`` reads the same states back from the flight files
(``faults/flight_files.py``). Both hand them to the functions here, which are pure: a state in,
words or a sorting of ranks out. docs/faults.md shows what they print.

A rank's state, as the progress table gives it (``watchdog.Progress.read``) and the flight files
keep it: ``calls`` begun; ``waiting``: the call it is inside now, or None; ``op``, ``stage`` (what
of that call it waits for) and ``waited_s`` where its watchdog thread has seen that wait;
``silent_s``: how long ago that thread last looked (its process last ran); ``left``: None while the
rank is in the program, else how it left (``LEFT``), ``left_s`` seconds ago.
"""

from __future__ import annotations

import os
from typing import Any

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


def describe(seq: int, record: Any, stage: str = "") -> str:
    """One line naming a call: ``all_reduce call #57 (phase 'forward', group 'world', …)``."""
    if record is None:
        return f"call #{seq}" + (f" ({stage})" if stage else "")
    text = (
        f"{record.op} call #{seq} (phase {record.phase!r}, group {record.group!r}, "
        f"{record.dtype}, {record.elements:,} elements, step {record.step})"
    )
    return text + (f", in its {stage}" if stage else "")


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


def verdict(
    head: str,
    group: str,
    pending: tuple,
    found: dict[str, list[int]],
    others: dict[int, dict[str, Any]],
    mine: dict[int, Any],
) -> list[str]:
    """The report's verdict on call ``pending`` of ``group``: the ranks that left the program
    (with the last call each began: ``mine``, this rank's flight entries, names it), those that
    show no sign of life, those that never arrived, and those held up inside other calls."""
    seq, record, stage = pending
    name = f"call #{seq} ({record.op if record else stage}) of group {group}"
    lines = []
    for w in found["exited"]:
        state = others[w]
        calls = state["calls"]
        last = describe(calls, mine[calls]) if calls in mine else f"call #{calls}"
        lines.append(
            f"{head} rank {w} {state['left']} {state['left_s']:.1f} s ago ({LEFT[state['left']]}); "
            + (f"the last call it began was {last}" if calls else "it began no call")
            + (f", so it never reaches {name}" if never_arrives(seq, state, record is None) else "")
        )
    if found["silent"]:
        lines.append(
            f"{head} rank(s) {found['silent']} show no sign of life: their process does not run "
            f"(stopped: SIGSTOP, a debugger; or frozen), so {name} cannot complete"
        )
    if found["absent"]:
        lines.append(
            f"{head} rank(s) {found['absent']} never arrived at {name}: they are in no "
            f"collective (computing, sleeping, or stuck outside zerosim)"
        )
    elsewhere = [w for w in found["inside"] if others[w]["waiting"] != seq]
    if elsewhere and lines:
        lines.append(
            f"{head} rank(s) {elsewhere} are inside calls of their own (above), held up as well"
        )
    return lines
