"""The MPI world's watchdog: no rank waits forever in a collective, and the one that gives up says
what it waited for and who did not come.

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
before and marks it done after — one store each, on every wait of every collective — and one
daemon thread per process looks every quarter second. When a wait has lasted more than the
communicator's ``timeout`` (``zerosim.timeout``, ``ZEROSIM_TIMEOUT``;
0 = never), that thread prints what the rank waits for (op, phase, group, dtype, elements, seconds),
which ranks have not reached that call, and the rank's flight record (``comm/flight.py``), writes
the flight file if a folder is set, and calls ``MPI.COMM_WORLD.Abort(1)``: the whole job ends with
a non-zero code. NCCL's watchdog thread in PyTorch works the same way.

Which ranks have not reached the call comes from ``Progress``, a table in node-shared memory where
every rank's watchdog thread copies, each time it looks (``publish``), how many calls its rank has
begun and which one it waits in; the rank that gives up reads it without any message from the
others, so a rank that stopped calling collectives is named although it takes no part. (The thread
copies it, not the waits themselves: four shared-memory stores per wait cost about a third of a
microsecond, on every collective; a row at most a quarter second old is exact for a rank that has
stalled for seconds.) Ranks on other nodes are not visible.

An uncaught exception on any rank (``install_abort_on_exception``) prints its traceback and flight
record and aborts the job the same way, so the other ranks do not wait for it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

from mpi4py import MPI

from zerosim.comm.base import OP_CODES
from zerosim.comm.flight import describe, live_recorders

if TYPE_CHECKING:
    from zerosim.comm.mpi import MPIComm

_OP_NAMES = {code: op for op, code in OP_CODES.items()}
# poll: spin this long on Test(), … (longer costs where cores are shared: a spinning rank holds
# the core its peer needs. Interleaved at N = 2 on a loaded 2-core machine, 1-16 MiB, the median
# paired raw/zerosim ratio was 0.83-0.84 with 100 µs and 0.87-0.88 with 10 µs or none.)
HOT_SPIN_S = 10e-6
SPIN_S = 5e-3  # … then until this long, yielding the core between tests, …
FIRST_SLEEP_S = 50e-6  # … first for this long, doubling …
MAX_SLEEP_S = 1e-3  # … up to this
LOOK_EVERY_S = 0.25  # how often the watchdog thread looks at the wait in progress


class Progress:
    """Each rank's progress through its collectives, in memory every rank of its node can read.

    One shared-memory window per node (``MPI.Win.Allocate_shared``) with a row of four int64 per
    rank: calls begun (its flight recorder's count), the call it waits in (negated once the wait
    is over, so the row still names its last call), that call's op code (0: not a collective), and
    when the wait began (ms of the monotonic clock, which a node's processes share).
    """

    FIELDS = 4

    def __init__(self, world: MPI.Intracomm) -> None:
        node = world.Split_type(MPI.COMM_TYPE_SHARED)
        self.win = MPI.Win.Allocate_shared(8 * self.FIELDS, 8, comm=node)
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
        """{world rank: {calls, waiting, last_call, op, waited_s}} for every rank of this node;
        ``waiting`` is the call it waits in now (0: none), ``last_call`` the last it waited in."""
        now = time.monotonic() * 1e3
        out = {}
        for rank, row in self.rows.items():
            calls, call, op, since = row.tolist()
            out[rank] = {
                "calls": calls,
                "waiting": max(call, 0),
                "last_call": abs(call),
                "op": _OP_NAMES.get(op, "set-up"),
                "waited_s": round((now - since) / 1e3, 3) if call > 0 else 0.0,
            }
        return out


PROGRESS: Progress | None = None  # made once per process by the first MPIComm over COMM_WORLD
PRIVATE_ROW = memoryview(bytearray(8 * Progress.FIELDS)).cast("q")  # until then, or without one
# (comm, pending, start) of the wait in progress; start None once it is over; None before any
_CURRENT: list[Any] = [None]
_started = False


def start(comm: MPIComm) -> None:
    """Once per process, under mpirun: the exception hook, the node's progress table (when
    ``comm`` is over COMM_WORLD: a collective, preceded by a barrier under the watchdog, so that
    a rank that never creates its MPIComm is reported, not waited for) and the watchdog thread."""
    global PROGRESS, _started
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        return
    install_abort_on_exception()
    if not _started:
        threading.Thread(target=_watch, name="zerosim-watchdog", daemon=True).start()
        _started = True
    if PROGRESS is None and comm.mpi == world:
        comm._pending = (comm.ledger.flight.calls, None, "MPIComm() set-up over COMM_WORLD")
        poll(comm, comm.mpi.Ibarrier())
        comm._pending = None
        PROGRESS = Progress(world)


def row() -> memoryview:
    """This rank's row of the progress table (a private one when there is no table)."""
    return PRIVATE_ROW if PROGRESS is None else PROGRESS.mine


def enter(comm: MPIComm, _clock: Any = time.monotonic) -> None:
    """A wait begins: note it for the watchdog thread (on every collective: one store)."""
    _CURRENT[0] = (comm, comm._pending, _clock())


def leave(comm: MPIComm) -> None:
    """The wait is over (the call it was stays noted, for the progress table)."""
    _CURRENT[0] = (comm, comm._pending, None)


def publish() -> None:
    """Copy this rank's progress into its row of the node's table: calls begun, the call it waits
    in (negated once the wait is over, so the row still names its last call), that call's op code
    (0: not a collective) and when the wait began (ms of the monotonic clock, which a node's
    processes share). The watchdog thread calls it each time it looks, and so does every report."""
    current = _CURRENT[0]
    if current is None:
        return
    comm, pending, since = current
    mine = row()
    mine[0] = comm.ledger.flight.calls
    call = mine[0] if pending is None else pending[0]
    record = None if pending is None else pending[1]
    mine[2] = 0 if record is None else OP_CODES[record.op]
    if since is None:
        mine[1] = -call
    else:
        mine[1] = call
        mine[3] = int(since * 1e3)


def poll(comm: MPIComm, request: MPI.Request) -> None:
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
        leave(comm)


def wait(comm: MPIComm, request: MPI.Request) -> None:
    """Complete ``request`` with MPI's blocking Wait (full speed), watched."""
    enter(comm)
    try:
        request.Wait()
    finally:
        leave(comm)


def _watch() -> None:
    """The watchdog thread: every quarter second, is a wait older than its timeout?"""
    while True:
        time.sleep(LOOK_EVERY_S)
        current = _CURRENT[0]
        publish()
        if current is None or current[2] is None:
            continue
        comm, _, since = current
        waited = time.monotonic() - since
        if comm.timeout and waited > comm.timeout and _CURRENT[0] is current:
            expire(comm, current[1], waited)


def report(comm: MPIComm, pending: tuple | None, waited: float) -> tuple[str, dict[str, Any]]:
    """What the watchdog prints after ``waited`` seconds, and the summary for the flight file."""
    seq, record, stage = pending or (comm.ledger.flight.calls, None, "wait")
    what = describe(seq, record, stage)
    me = comm.world_rank
    lines = [
        f"[zerosim rank {me}] watchdog: {what} has not completed after {waited:.1f} s "
        f"(timeout {comm.timeout:g} s: zerosim.timeout or ZEROSIM_TIMEOUT); this is rank "
        f"{comm.rank} of group {comm.group!r} ({comm.size} ranks)"
    ]
    publish()
    table = None if PROGRESS is None else PROGRESS.read()
    behind = []
    if table is None:
        lines.append("  (which ranks have not reached this call is not known here)")
    else:
        for w in comm.world_ranks():
            seen = table.get(w)
            if seen is None:
                lines.append(f"  rank {w}: on another node, not visible from here")
                continue
            where = (
                f"is not in a collective (the last it waited in: #{seen['last_call']} {seen['op']})"
            )
            if seen["waiting"]:
                call, op, waited = seen["waiting"], seen["op"], seen["waited_s"]
                where = f"waits in call #{call} ({op}) for {waited:.1f} s"
            who = f"rank {w}" + (" (this rank)" if w == me else "")
            lines.append(f"  {who}: began {seen['calls']} calls, {where}")
            if w != me and seen["calls"] < seq:
                behind.append(w)
    if behind:
        lines.append(
            f"[zerosim rank {me}] watchdog: rank(s) {behind} have not reached call #{seq} "
            f"({record.op if record else stage}) of group {comm.group!r}: they stopped calling "
            f"collectives (computing, sleeping, stuck, or waiting in another group's call)"
        )
    waiting = {"call": seq, "what": what, "stage": stage, "waited_s": round(waited, 3)}
    waiting["behind"] = behind
    return "\n".join(lines), waiting


def expire(comm: MPIComm, pending: tuple | None, waited: float) -> None:
    """Give up: say what this rank waits for and who is missing, print the record, abort."""
    text, waiting = report(comm, pending, waited)
    sys.stderr.write(text + "\n")
    dump_flight_records(f"timeout after {waited:.1f} s", waiting)
    sys.stderr.write(f"[zerosim rank {comm.world_rank}] watchdog: aborting the job\n")
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
            dump_flight_records(f"exception: {kind.__name__}: {value}")
            abort_job()
        previous(kind, value, tb)

    sys.excepthook = abort_hook
    _abort_hook_installed = True
