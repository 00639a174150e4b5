"""The MPI world's watchdog: no rank waits forever in a collective, and the one that gives up says
what it waited for and what each other rank is doing.

How a rank waits (``MPIComm``):

* Where a rank waits for the others to *arrive* (the cross-rank argument check that starts every
  collective, a barrier, a split), it starts MPI's non-blocking call and ``poll``\\ s it: it spins
  on ``Test()`` for 10 µs (a shared-memory round trip), then until 5 ms tests and yields the
  core (``sched_yield``) in turn, then sleeps 50 µs, 100 µs, … up to 1 ms between tests, so
  a rank that waits for a slow one leaves the CPU to the ranks that compute (MPI's own blocking
  calls spin).
* Where the data moves (the collective itself once every rank has arrived, a ``wait()`` of a
  non-blocking one), it makes MPI's blocking call, at MPI's full speed.

Either way the wait is *watched*: the rank notes (communicator, call, start time) in ``_CURRENT``
and the call in its row of the progress table (below) before, clears the row's call after, and
one daemon thread per process looks every quarter second.
When a wait has lasted more than the communicator's ``timeout`` (``zerosim.timeout``,
``ZEROSIM_TIMEOUT``; 0 = never), that thread prints what the rank waits for (op, phase, group,
dtype, elements, seconds), where every other rank of its node is, and the rank's flight record
(``comm/flight.py``), writes the flight file if a folder is set, and calls
``MPI.COMM_WORLD.Abort(1)``: the whole job ends with a non-zero code. NCCL's watchdog thread in
PyTorch works the same way. Once the thread has decided to abort, the job fails whatever the
other threads do: it takes ``_ENDING`` first, and a program that finishes meanwhile waits for it
at exit (``_exit_guard``) instead of ending with code 0 while the thread waits for its words to
reach the launcher.

Where the other ranks are comes from ``Progress``, a table in node-shared memory that every rank
writes and the rank that gives up reads, with no message from the others (they may be stuck, or
stopped). What must be right at any moment is written by the rank itself, as it goes: its count of
calls begun (its flight recorder counts in the table) and the call it waits in (one store as a
wait begins, one as it ends). The rest is copied by its watchdog thread each time it looks: that
the process is alive, and the details of the wait (op, what of the call it waits for, since when),
which change only as fast as the waits do. A copy is as old as the thread's last look, and a
stopped process's thread does not look: when the thread copied everything, a stopped rank showed
the count of a quarter second before it stopped (hundreds of calls behind its neighbours). From
the table the report tells a rank inside a call (its argument check, its data exchange, the
``wait()`` of a non-blocking one) from one that never arrived, and either from one whose process
does not run (``diagnose`` in ``faults/diagnosis.py``, which words the whole verdict); it used to
call every rank with fewer calls begun one that "stopped calling collectives", a rank waiting
inside an earlier call included.
Ranks on other nodes are not visible.

A rank that leaves the program while the others train on (``sys.exit``, a return from the main
program, an exception that another hook handled) passes through its exit hook (``_exit_guard``,
run by ``atexit`` before MPI finalizes), which writes the time it left into its row. A rank that
waits in a call the leaver never began gives up once it has been gone LEFT_GRACE_S, whatever the
timeout, and its report names the rank, how it left and the last call it began. At a normal end
every rank has begun the same calls, so no rank waits for one that has left. A process that
ended without its exit hook (``os._exit``, a signal the launcher did not act on) is told from a
stopped one by its process id: no such process, or a zombie.

An uncaught exception on any rank (``install_abort_on_exception``) prints its traceback and flight
record and aborts the job the same way, so the other ranks do not wait for it.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

from mpi4py import MPI

from zerosim.comm.agreement import OP_CODES
from zerosim.comm.flight import live_recorders
from zerosim.faults.diagnosis import (
    SILENT_S,
    describe,
    diagnose,
    never_arrives,
    process_gone,
    rank_state,
    verdict,
)

if TYPE_CHECKING:
    from zerosim.comm.base import Communicator  # an MPIComm (comm/mpi.py imports this module)

_OP_NAMES = {code: op for op, code in OP_CODES.items()}
# poll: spin this long on Test(), … (longer costs where cores are shared: a spinning rank holds
# the core its peer needs. Interleaved at N = 2 on a loaded 2-core machine, 1-16 MiB, the median
# paired raw/zerosim ratio was 0.83-0.84 with 100 µs and 0.87-0.88 with 10 µs or none.)
HOT_SPIN_S = 10e-6
SPIN_S = 5e-3  # … then until this long, yielding the core between tests, …
FIRST_SLEEP_S = 50e-6  # … first for this long, doubling …
MAX_SLEEP_S = 1e-3  # … up to this
LOOK_EVERY_S = 0.25  # how often the watchdog thread looks at the wait in progress
# A wait for a rank that left the program without beginning the call is given up this long after
# it left, whatever the timeout: a rank that did begin and complete the call before it left lets
# the wait end within microseconds, so the grace only guards against reading the table too early.
LEFT_GRACE_S = 1.0


# what of a call a rank waits for, by the stage its ``waiting`` names (0: a set-up step)
_STAGES = {"cross-rank argument check": 1, "data exchange": 2, "wait()": 3}
_STAGE_NAMES = {
    0: "a split, node discovery or an MPIComm's set-up",
    1: "cross-rank argument check",
    2: "data exchange",
    3: "wait() of the non-blocking call",
}
# a row of the progress table: one int64 each
CALLS = 0  # calls begun: the world ledger's flight recorder counts here (exact at any moment)
WAITING = 1  # the call the rank waits in now, NOT_WAITING when none: the rank writes it
SEEN = 2  # the call whose wait the next three fields describe: copied by its watchdog thread
OP = 3  # that call's op code (0: not a collective: a set-up step)
STAGE = 4  # what of that call it waits for (_STAGES)
SINCE = 5  # when that wait began (ns of the monotonic clock, which a node's processes share)
ALIVE = 6  # when its watchdog thread last looked (ns, monotonic): the process runs
PID = 7  # its process id (a process of this node), to tell a process that is gone
LEFT_AT = 8  # when it left the program (ns, monotonic; 0 while in it): its exit hook writes it
FIELDS = 9
NOT_WAITING = -1


class Progress:
    """Each rank's progress through its collectives, in memory every rank of its node can read.

    One shared-memory window per node (``MPI.Win.Allocate_shared``) with a row of ``FIELDS``
    int64 per rank (``CALLS`` … ``ALIVE`` above).
    """

    def __init__(self, world: MPI.Intracomm) -> None:
        node = world.Split_type(MPI.COMM_TYPE_SHARED)
        self.win = MPI.Win.Allocate_shared(8 * FIELDS, 8, comm=node)
        mine, everyone = node.Get_group(), world.Get_group()
        members = mine.Translate_ranks(list(range(node.Get_size())), everyone)
        mine.Free()
        everyone.Free()
        self.rows = {
            int(w): memoryview(self.win.Shared_query(i)[0]).cast("B").cast("q")
            for i, w in enumerate(members)
        }
        self.mine = self.rows[world.Get_rank()]
        node.Free()

    def read(self) -> dict[int, dict[str, Any]]:
        """{world rank: state} for every rank of this node, as ``diagnosis.rank_state`` reads it:
        ``calls`` begun and ``waiting``, the call it is inside (None: none), as they are now;
        ``op``, ``stage`` and ``waited_s`` of that wait once its watchdog thread has seen it
        (else None); ``silent_s``, how long ago that thread last looked; ``left``: None, or
        ``exited`` (its exit hook ran) or ``vanished`` (silent, and its process no longer
        exists), ``left_s`` seconds ago."""
        now = time.monotonic_ns()
        out = {}
        for rank, row in self.rows.items():
            calls, waiting, seen, op, stage, since, alive, pid, left_at = row.tolist()
            state: dict[str, Any] = {"calls": calls, "waiting": None, "op": None, "stage": None}
            silent_s = round((now - alive) / 1e9, 3)
            state.update(waited_s=None, silent_s=silent_s, left=None, left_s=None)
            if left_at:
                state.update(left="exited", left_s=round((now - left_at) / 1e9, 3))
            elif silent_s > SILENT_S and pid and process_gone(pid):
                state.update(left="vanished", left_s=silent_s)
            if waiting != NOT_WAITING:
                state["waiting"] = waiting
                if seen == waiting:  # the thread has seen a wait in this call: its details
                    state["op"] = _OP_NAMES.get(op, "set-up")
                    state["stage"] = _STAGE_NAMES[stage]
                    state["waited_s"] = round((now - since) / 1e9, 3)
            out[rank] = state
        return out


PROGRESS: Progress | None = None  # made once per process by the first MPIComm over COMM_WORLD
# this rank's row: a private one until the table exists (or without one)
ROW = memoryview(bytearray(8 * FIELDS)).cast("q")
ROW[WAITING] = NOT_WAITING
# (comm, pending, start) of the wait in progress, or of the last one (ROW[WAITING] says which)
_CURRENT: list[Any] = [None]
_started = False
# Whoever holds this lock ends the process: the watchdog thread once it decides to abort (it
# never lets go: it aborts), or the exit guard once the program ends normally. The first keeps
# the other out: a decided abort is not outrun by the program finishing (exit code 0 although
# "aborting the job" was printed), and a normal exit is not aborted by a wait that just ended.
_ENDING = threading.Lock()
EXIT_GRACE_S = 10.0  # how long a normal exit waits for an abort begun by the watchdog thread


def start(comm: Communicator) -> None:
    """Once per process, under mpirun: the exception hook, the exit guard, the node's progress
    table (when ``comm`` is over COMM_WORLD: a collective, preceded by a barrier under the
    watchdog, so that a rank that never creates its MPIComm is reported, not waited for; its
    ledger's flight recorder then counts calls in this rank's row) and the watchdog thread."""
    global PROGRESS, ROW, _started
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        return
    install_abort_on_exception()
    if not _started:
        atexit.register(_exit_guard)  # runs before mpi4py finalizes MPI (a C-level exit hook)
        threading.Thread(target=_watch, name="zerosim-watchdog", daemon=True).start()
        _started = True
    if PROGRESS is None and comm.mpi == world:
        comm.waiting = (comm.ledger.flight.calls, None, "MPIComm() set-up over COMM_WORLD")
        poll(comm, comm.mpi.Ibarrier())
        comm.waiting = None
        PROGRESS = Progress(world)
        PROGRESS.mine[:] = ROW  # what the private row holds so far
        ROW = PROGRESS.mine
        ROW[ALIVE] = time.monotonic_ns()
        ROW[PID] = os.getpid()
        comm.ledger.flight.count_in(ROW[CALLS : CALLS + 1])


def enter(comm: Communicator, _clock: Any = time.monotonic) -> None:
    """A wait begins: note it for the watchdog thread, then (the thread relies on this order)
    the call it is in for the other ranks (on every wait of every collective: a tuple and a
    store)."""
    pending = comm.waiting or (comm.ledger.flight.calls, None, "set-up")
    _CURRENT[0] = (comm, pending, _clock())
    ROW[WAITING] = pending[0]


def leave() -> None:
    """The wait is over (``_CURRENT`` keeps it, as the last wait, for the thread's copy)."""
    ROW[WAITING] = NOT_WAITING


def publish() -> None:
    """What the watchdog thread adds to this rank's row each time it looks (and every report):
    that the process runs, and the details of the wait in progress (op, stage, start), the call
    they describe written last."""
    row = ROW
    row[ALIVE] = time.monotonic_ns()
    current = _CURRENT[0]
    if current is None:
        return
    _, (call, record, stage), since = current
    row[OP] = 0 if record is None else OP_CODES[record.op]
    row[STAGE] = _STAGES.get(stage, 0)
    row[SINCE] = int(since * 1e9)
    row[SEEN] = call


def poll(comm: Communicator, request: MPI.Request) -> None:
    """Complete ``request`` without holding a core: spin on Test() briefly, then sleep between
    polls (50 µs doubling to 1 ms); watched like any wait (one that is already complete is no
    wait, and is not noted)."""
    if request.Test():
        return
    enter(comm)
    try:
        start = time.monotonic()
        while time.monotonic() < start + HOT_SPIN_S:  # the message may be just behind
            if request.Test():
                return
        while time.monotonic() < start + SPIN_S:
            os.sched_yield()  # a rank that computes on this core goes first
            if request.Test():
                return
        delay = FIRST_SLEEP_S
        while not request.Test():
            time.sleep(delay)
            delay = min(2 * delay, MAX_SLEEP_S)
    finally:
        leave()


def wait(comm: Communicator, request: MPI.Request) -> None:
    """Complete ``request`` with MPI's blocking Wait (full speed), watched."""
    enter(comm)
    try:
        request.Wait()
    finally:
        leave()


def _watch() -> None:
    """The watchdog thread: every quarter second, is a wait older than its timeout, or one for
    a rank that left the program?"""
    while True:
        time.sleep(LOOK_EVERY_S)
        publish()
        current = _CURRENT[0]
        # A wait is in progress (ROW says so), and it is ``current``: enter() notes the wait in
        # _CURRENT before it writes ROW, so if _CURRENT still holds ``current`` now, no later
        # wait began before the ROW read.
        if current is None or ROW[WAITING] == NOT_WAITING or _CURRENT[0] is not current:
            continue
        comm, pending, since = current
        waited = time.monotonic() - since
        if comm.timeout and waited > comm.timeout:
            expire(comm, pending, waited)
        elif PROGRESS is not None:
            left = gone_for_good(comm, pending, PROGRESS.read())
            if left:
                expire(comm, pending, waited, left)


def gone_for_good(
    comm: Communicator, pending: tuple, table: dict[int, dict[str, Any]]
) -> list[int]:
    """The ranks of ``comm``'s group on this node that left the program, LEFT_GRACE_S or more
    ago, without beginning the call ``pending`` names: the wait can never complete. (At a normal
    end every rank begins the same calls, so no wait is in a call that a rank which left has
    not begun.)"""
    call, record, _ = pending
    out = []
    for w in comm.world_ranks():
        state = table.get(w)
        if state is None or not never_arrives(call, state, setup=record is None):
            continue
        if state["left_s"] >= LEFT_GRACE_S:
            out.append(w)
    return out


def report(
    comm: Communicator, pending: tuple | None, waited: float, left: list[int] | None = None
) -> tuple[str, dict[str, Any]]:
    """What the watchdog prints after ``waited`` seconds (because of the timeout, or because the
    ranks ``left`` left the program without beginning the call), and the summary for the flight
    file: where every rank of the group on this node is, and which of them hold the call up."""
    seq, record, stage = pending or (comm.ledger.flight.calls, None, "wait")
    what = describe(seq, record, stage)
    me = comm.world_rank
    head = f"[zerosim rank {me}] watchdog:"
    why = (
        f"can never complete: rank(s) {left} left the program without beginning it (waited "
        f"{waited:.1f} s)"
        if left
        else f"has not completed after {waited:.1f} s (timeout {comm.timeout:g} s: "
        f"zerosim.timeout or ZEROSIM_TIMEOUT)"
    )
    lines = [
        f"{head} {what} {why}; this is rank {comm.rank} of group {comm.group!r} ({comm.size} ranks)"
    ]
    publish()
    table = None if PROGRESS is None else PROGRESS.read()
    others: dict[int, dict[str, Any]] = {}
    if table is None:
        lines.append("  (where the other ranks are is not known here)")
    mine = dict(comm.ledger.flight.entries())  # call #k is the same op on every rank
    for w in comm.world_ranks() if table is not None else ():
        state = table.get(w)
        if state is None:
            lines.append(f"  rank {w}: on another node, not visible from here")
            continue
        if state["op"] is None and state["waiting"] in mine:  # its thread did not see the wait
            state["op"] = mine[state["waiting"]].op
        lines.append(f"  rank {w}{' (this rank)' if w == me else ''}: {rank_state(state)}")
        if w != me:
            others[w] = state
    found = diagnose(seq, others)
    lines += verdict(head, f"{comm.group!r}", (seq, record, stage), found, others, mine)
    if table is not None and not any(found[k] for k in ("exited", "silent", "absent")):
        lines.append(
            f"{head} no rank of this node is missing, gone or stopped: each is inside a call; "
            f"look for ranks inside different calls (another group's) or a rank on another node"
        )
    waiting = {"call": seq, "what": what, "stage": stage, "waited_s": round(waited, 3), **found}
    return "\n".join(lines), waiting


def expire(
    comm: Communicator, pending: tuple | None, waited: float, left: list[int] | None = None
) -> None:
    """Give up (after the timeout, or at once for ranks that ``left``): say what this rank waits
    for and who is missing, print the record, abort. Once it has begun, the process ends here
    whatever its other threads do (``_ENDING``)."""
    if not _ENDING.acquire(blocking=False):
        return  # the program is ending (its exit guard holds the lock), or already aborting
    try:
        text, waiting = report(comm, pending, waited, left)
        sys.stderr.write(text + "\n")
        reason = f"rank(s) {left} left the program" if left else f"timeout after {waited:.1f} s"
        dump_flight_records(reason, waiting)
        sys.stderr.write(f"[zerosim rank {comm.world_rank}] watchdog: aborting the job\n")
    finally:
        abort_job()


def _exit_guard() -> None:
    """At a normal exit (atexit, before MPI finalizes; ``sys.exit`` and a return from the main
    program come here too): say in the progress table that this rank has left the program, so
    that a rank waiting in a call this one never began gives up at once instead of after the
    timeout. Then take ``_ENDING``, so that the watchdog thread can no longer begin an abort. If
    it has begun one, wait: it ends the job once its report is out (abort from here if it has
    not within EXIT_GRACE_S). Without this, a program that finished while the thread waited for
    its words to reach the launcher exited 0."""
    ROW[LEFT_AT] = time.monotonic_ns()
    if not _ENDING.acquire(timeout=EXIT_GRACE_S):
        abort_job()


def dump_flight_records(reason: str, waiting: dict[str, Any] | None = None) -> None:
    """Print every flight recorder of this process to stderr; write the files that are due."""
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    publish()
    table = None if PROGRESS is None else PROGRESS.read()
    for recorder in live_recorders():
        sys.stderr.write(recorder.format(rank) + "\n")
        try:
            path = recorder.dump(rank, size, reason, waiting, table)
        except OSError as err:
            sys.stderr.write(f"[zerosim rank {rank}] could not write the flight record: {err}\n")
        else:
            if path is not None:
                sys.stderr.write(f"[zerosim rank {rank}] flight record written to {path}\n")
    sys.stderr.flush()


def abort_job() -> None:
    sys.stderr.flush()
    time.sleep(0.2)  # let the launcher forward this rank's message before the kill
    MPI.COMM_WORLD.Abort(1)
    os._exit(1)  # not reached: Abort ends the process


_abort_hook_installed = False


def install_abort_on_exception() -> None:
    """Make an uncaught exception on any rank print its traceback and flight record, then abort
    the whole MPI job."""
    global _abort_hook_installed
    if _abort_hook_installed:
        return
    previous = sys.excepthook

    def abort_hook(kind: type, value: BaseException, tb: Any) -> None:
        rank = MPI.COMM_WORLD.Get_rank()
        text = "".join(traceback.format_exception(kind, value, tb))
        sys.stderr.write(f"[zerosim rank {rank}] uncaught exception, aborting the job:\n{text}")
        if MPI.COMM_WORLD.Get_size() > 1:
            if _ENDING.acquire(blocking=False):  # else the watchdog thread is aborting already
                dump_flight_records(f"exception: {kind.__name__}: {value}")
            abort_job()
        previous(kind, value, tb)

    sys.excepthook = abort_hook
    _abort_hook_installed = True
