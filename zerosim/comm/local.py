"""LocalWorld: N ranks as threads in one process, for notebooks and tests without mpirun.

``LocalWorld(4).run(fn, *args)`` calls ``fn(comm, *args)`` on four threads, each with its own
``LocalComm`` (rank 0 … 3) and its own ledger, and returns the four results in rank order.

Every collective is a rendezvous: each rank *posts* a copy of what it contributes to a slot named
by (group, call number) and, once all ranks of the group have posted, *collects* what it is owed
(its chunk of the sum, the concatenation, …). A non-blocking call posts at once and collects in
``wait()``, so it has MPI's semantics: contributions are taken at the call, results appear at the
wait. Point-to-point messages (used by the ring algorithms) go through per-pair FIFO mailboxes.

A group of one rank (a one-rank world, as ``zerosim train`` runs at N = 1, or a sub-group of one)
runs its collectives as MPI runs them on a communicator of one: a gather or a reduce-scatter
copies its input into its output, an all-reduce, a reduce or a broadcast leaves its buffer as it
is (the reduction of one contribution is that contribution), and nothing is posted, since no
other rank reads it.

Nothing waits forever. An exception on one rank wakes every other rank, which raises
``WorldAborted`` (naming the rank and its error); ``run`` then re-raises the first rank's own
exception with a note naming the rank. A rank that returns from ``fn`` while others wait in a
collective it never joined makes them fail at once, naming it; any other wait fails after the
communicator's ``timeout`` seconds (the watchdog's setting: ``zerosim.timeout``,
``ZEROSIM_TIMEOUT``, else 600; 0 = never) with a ``TimeoutError`` naming the call and the missing
ranks, with the rank's flight record as a note (and in ``<flight_dir>/rank<R>.json`` when set).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from zerosim.backend import array_module, flat
from zerosim.comm import checks
from zerosim.comm.base import Communicator
from zerosim.comm.call import complete
from zerosim.comm.flight import check_timeout, default_timeout
from zerosim.comm.ledger import Ledger
from zerosim.faults.diagnosis import describe


class WorldAborted(RuntimeError):
    """Raised on the ranks of a LocalWorld that were waiting when another rank failed."""


class _Slot:
    def __init__(self, op: str, members: tuple[int, ...]) -> None:
        self.op = op
        self.members = members
        self.payloads: dict[int, Any] = {}  # group rank -> payload
        self.collected = 0


class _WorldState:
    """What the threads of one ``run`` share: slots, mailboxes, who failed, who finished."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.cond = threading.Condition()
        self.slots: dict[tuple, _Slot] = {}
        self.mailboxes: dict[tuple, deque] = {}
        self.failed: dict[int, BaseException] = {}
        self.finished: set[int] = set()

    def wait_until(
        self,
        ready: Callable[[], bool],
        world_rank: int,
        waiting_for: Callable[[], list[int]],
        what: str,
        timeout: float,
    ) -> None:
        """Block (holding ``cond``) until ``ready()``; fail fast on abort, exit or timeout."""
        start = time.monotonic()
        deadline = start + timeout if timeout else float("inf")
        while not ready():
            if self.failed:
                bad = sorted(self.failed)
                first = self.failed[bad[0]]
                cause = str(first).split("\n")[0]
                raise WorldAborted(
                    f"rank {world_rank}: {what} abandoned because rank(s) {bad} raised "
                    f"(rank {bad[0]}: {type(first).__name__}: {cause})"
                )
            missing = waiting_for()
            gone = [r for r in missing if r in self.finished]
            if gone:
                raise RuntimeError(
                    f"rank {world_rank}: {what} cannot complete: rank(s) {gone} "
                    f"returned without joining it"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"rank {world_rank}: {what} timed out after {timeout:g} s"
                    f" waiting for rank(s) {missing} (zerosim.timeout / ZEROSIM_TIMEOUT)"
                )
            self.cond.wait(min(remaining, 1.0))


_REDUCE = {"sum": "add", "max": "maximum", "min": "minimum"}


def _snapshot(x: Any) -> Any:
    """A flat copy of ``x`` in its own namespace (what a rank posts for the others to read)."""
    return array_module(x).asarray(flat(x), copy=True)


def _reduce(parts: list[Any], op: str) -> Any:
    """Element-wise reduction of ``parts`` in rank order (every rank gets identical bits)."""
    xp = array_module(parts[0])
    ufunc = getattr(xp, _REDUCE[op])
    acc = _snapshot(parts[0])
    for part in parts[1:]:
        ufunc(acc, part, out=acc)
    return acc


class LocalComm(Communicator):
    """One rank of a LocalWorld (or of a group split from it)."""

    def __init__(
        self,
        state: _WorldState,
        members: tuple[int, ...],
        rank: int,
        ctx: tuple,
        ledger: Ledger,
        collectives: str,
        validate: bool,
        group: str,
    ) -> None:
        super().__init__(rank, len(members), ledger, collectives, group, validate)
        self._state = state
        self._members = members  # world rank of each group rank
        self._ctx = ctx
        self._calls = 0
        self._alone = len(members) == 1  # a group of one rank: no rendezvous (module docstring)

    @property
    def world_rank(self) -> int:
        return self._members[self.rank]

    def _wait_until(
        self, ready: Callable[[], bool], missing: Callable[[], list[int]], fallback: str
    ) -> None:
        """``_WorldState.wait_until`` naming the call this rank waits in; on a timeout, the
        error carries this rank's flight record (and it is written out when a folder is set)."""
        pending = self.waiting
        what = fallback if pending is None else describe(*pending) + f" on group {self.group!r}"
        try:
            self._state.wait_until(ready, self.world_rank, missing, what, self.timeout)
        except TimeoutError as err:
            flight = self.ledger.flight
            err.add_note(flight.format(self.world_rank))
            waiting = {"call": pending[0] if pending else 0, "what": what, "behind": missing()}
            path = flight.dump(self.world_rank, self._state.size, "timeout", waiting)
            if path is not None:
                err.add_note(f"flight record written to {path}")
            raise

    # -- rendezvous -----------------------------------------------------------------------------
    def _post(self, op: str, payload: Any) -> tuple:
        key = (self._ctx, self._calls)
        self._calls += 1
        st = self._state
        with st.cond:
            slot = st.slots.setdefault(key, _Slot(op, self._members))
            slot.payloads[self.rank] = payload
            st.cond.notify_all()
        return key

    def _collect(self, key: tuple) -> list[Any]:
        st = self._state
        with st.cond:
            slot = st.slots[key]

            def missing() -> list[int]:
                return [self._members[g] for g in range(self.size) if g not in slot.payloads]

            self._wait_until(
                lambda: len(slot.payloads) == self.size,
                missing,
                f"{slot.op} call #{key[1]} on group {self.group!r}",
            )
            payloads = [slot.payloads[g] for g in range(self.size)]
            slot.collected += 1
            if slot.collected == self.size:
                del st.slots[key]
        return payloads

    def _exchange(self, op: str, payload: Any) -> list[Any]:
        return self._collect(self._post(op, payload))

    # -- native collectives ----------------------------------------------------------------------
    def _copy_alone(self, out: Any, inp: Any, in_place: bool) -> Callable[[], None]:
        """A gather or a reduce-scatter on a group of one rank: ``inp`` copied into ``out`` at the
        call (nothing in place), complete at once. The dry run prices each collective of a
        one-rank group as this copy (``dryrun.timeline.self_copy_seconds``)."""
        if not in_place:
            flat(out)[...] = flat(inp)
        return complete

    def _native_iall_gather(self, out: Any, inp: Any, in_place: bool) -> Callable[[], None]:
        if self._alone:
            return self._copy_alone(out, inp, in_place)
        key = self._post("all_gather", _snapshot(inp))
        xp = array_module(out)

        def finish() -> None:
            flat(out)[...] = xp.concatenate(self._collect(key))

        return finish

    def _native_ireduce_scatter(
        self, out: Any, inp: Any, op: str, in_place: bool
    ) -> Callable[[], None]:
        return self._native_ireduce_scatter_v(out, inp, (out.size,) * self.size, op)

    def _native_ireduce_scatter_v(
        self, out: Any, inp: Any, counts: tuple[int, ...], op: str
    ) -> Callable[[], None]:
        if self._alone:
            return self._copy_alone(out, inp, checks.is_own_slice(inp, out, 0))
        key = self._post("reduce_scatter", _snapshot(inp))
        start = sum(counts[: self.rank])
        stop = start + counts[self.rank]

        def finish() -> None:
            parts = [p[start:stop] for p in self._collect(key)]
            flat(out)[...] = _reduce(parts, op)

        return finish

    def _native_iall_reduce(self, buf: Any, op: str) -> Callable[[], None]:
        if self._alone:
            return complete
        key = self._post("all_reduce", _snapshot(buf))

        def finish() -> None:
            flat(buf)[...] = _reduce(self._collect(key), op)

        return finish

    def _native_ireduce(self, buf: Any, root: int, op: str) -> Callable[[], None]:
        if self._alone:
            return complete
        key = self._post("reduce", _snapshot(buf))

        def finish() -> None:
            parts = self._collect(key)  # every rank collects, so that the slot is freed
            if self.rank == root:
                flat(buf)[...] = _reduce(parts, op)

        return finish

    def _native_all_gather(self, out: Any, inp: Any, in_place: bool) -> None:
        self._native_iall_gather(out, inp, in_place)()

    def _native_reduce_scatter(self, out: Any, inp: Any, op: str, in_place: bool) -> None:
        self._native_ireduce_scatter_v(out, inp, (out.size,) * self.size, op)()

    def _native_all_reduce(self, buf: Any, op: str) -> None:
        self._native_iall_reduce(buf, op)()

    def _native_reduce(self, buf: Any, root: int, op: str) -> None:
        self._native_ireduce(buf, root, op)()

    def _native_broadcast(self, buf: Any, root: int) -> None:
        if self._alone:
            return
        parts = self._exchange("broadcast", _snapshot(buf) if self.rank == root else None)
        flat(buf)[...] = parts[root]

    def _native_all_to_all(self, out: Any, inp: Any) -> None:
        if self._alone:
            self._copy_alone(out, inp, in_place=False)
            return
        block = inp.size // self.size
        parts = self._exchange("all_to_all", _snapshot(inp))
        whole = flat(out)
        for src, part in enumerate(parts):
            whole[src * block : (src + 1) * block] = part[
                self.rank * block : (self.rank + 1) * block
            ]

    def _native_barrier(self) -> None:
        if not self._alone:
            self._exchange("barrier", None)

    def gather_ints(self, values: tuple[int, ...]) -> list[tuple[int, ...]]:
        return self._exchange("argument check", values)

    def post_signature(self, signature: tuple[int, ...]) -> Any:
        return self._post("argument check", signature)

    def signatures_agree(self, token: Any) -> bool:
        every = self._collect(token)
        return all(s == every[0] for s in every)

    # -- point to point ----------------------------------------------------------------------
    def send(self, buf: Any, dest: int) -> None:
        st = self._state
        with st.cond:
            box = st.mailboxes.setdefault((self._ctx, self.rank, dest), deque())
            box.append(_snapshot(buf))
            st.cond.notify_all()

    def recv(self, buf: Any, source: int) -> None:
        st = self._state
        with st.cond:
            box = st.mailboxes.setdefault((self._ctx, source, self.rank), deque())
            self._wait_until(
                lambda: bool(box),
                lambda: [self._members[source]],
                f"receive from rank {source} on group {self.group!r}",
            )
            message = box.popleft()
        if message.size != buf.size:
            raise ValueError(
                f"rank {self.rank} expected {buf.size} elements from rank {source}, "
                f"got {message.size}"
            )
        buf[...] = message

    def sendrecv(self, sendbuf: Any, dest: int, recvbuf: Any, source: int) -> None:
        self.send(sendbuf, dest)
        self.recv(recvbuf, source)

    # -- sub-groups --------------------------------------------------------------------------
    def split(self, color: int, key: int = 0, name: str | None = None) -> LocalComm:
        group = self.name_split(color, key, name)
        self.waiting = (self.ledger.flight.calls, None, f"split of group {self.group!r}")
        pairs = self._exchange("split", (int(color), int(key)))
        self.waiting = None
        chosen = sorted((k, g) for g, (c, k) in enumerate(pairs) if c == color)
        members = tuple(self._members[g] for _, g in chosen)
        rank = [g for _, g in chosen].index(self.rank)
        ctx = (self._ctx, self.splits, int(color))
        child = LocalComm(
            self._state,
            members,
            rank,
            ctx,
            self.ledger,
            self.collectives,
            self.validate,
            group,
        )
        child.timeout = self.timeout
        return child


class LocalWorld:
    """N ranks as threads of this process; ``run(fn, *args)`` → [fn(comm_r, *args) for every r].

    ``timeout``: seconds a rank may wait in one collective before it raises ``TimeoutError``
    naming the missing ranks; None takes the watchdog's setting (``ZEROSIM_TIMEOUT``, else 600),
    0 means never. ``initialize`` sets it again from the config's ``zerosim.timeout``.
    """

    def __init__(
        self,
        size: int,
        collectives: str = "native",
        timeout: float | None = None,
        validate: bool = True,
    ) -> None:
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"size must be a positive int, got {size!r}")
        checks.collectives(collectives)
        self.size = int(size)
        self.collectives = collectives
        self.timeout = default_timeout() if timeout is None else check_timeout(timeout)
        self.validate = validate

    def __repr__(self) -> str:
        return f"LocalWorld({self.size})"

    def comms(self) -> list[LocalComm]:
        """Fresh communicators for every rank (for stepping through collectives by hand)."""
        state = _WorldState(self.size)
        members = tuple(range(self.size))
        comms = [
            LocalComm(
                state, members, r, ("world",), Ledger(), self.collectives, self.validate, "world"
            )
            for r in range(self.size)
        ]
        for comm in comms:
            comm.timeout = self.timeout
        return comms

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``fn(comm, *args, **kwargs)`` on every rank at once; results in rank order."""
        comms = self.comms()
        state = comms[0]._state
        results: list[Any] = [None] * self.size
        errors: dict[int, BaseException] = {}

        def body(comm: LocalComm) -> None:
            try:
                results[comm.rank] = fn(comm, *args, **kwargs)
            except BaseException as err:  # noqa: BLE001  (re-raised below by run)
                errors[comm.rank] = err
                with state.cond:
                    if not isinstance(err, WorldAborted):
                        state.failed[comm.rank] = err
                    state.cond.notify_all()
            finally:
                with state.cond:
                    state.finished.add(comm.rank)
                    state.cond.notify_all()

        threads = [
            threading.Thread(target=body, args=(c,), name=f"rank{c.rank}", daemon=True)
            for c in comms
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            primary = [r for r in sorted(errors) if not isinstance(errors[r], WorldAborted)]
            rank = primary[0] if primary else min(errors)
            err = errors[rank]
            if hasattr(err, "add_note"):
                err.add_note(f"(raised on rank {rank} of {self!r})")
            raise err
        return results
