"""The Communicator interface that every layer above ``comm/`` talks to.

A communicator is one rank's view of a group: ``rank``, ``size``, the collectives ZeRO needs, and a
ledger. Every public collective reads the same way, in three steps:

1. check the arguments on this rank (``comm/checks.py``: types, dtypes, contiguity, sizes, op,
   root) before anything is sent;
2. enter ``Bookkeeping`` (``comm/call.py``), which posts the cross-rank check
   (``comm/agreement.py``, with ``validate=True``), writes the ledger record, numbers it in the
   flight recorder (``comm/flight.py``) and sets the watchdog's note ``waiting``;
3. run the world's native collective (``MPIComm``, ``LocalWorld``), one frame below the public
   method, or our ring algorithm over point-to-point messages (``collectives="ring"``,
   ``comm/ring.py``); leaving ``Bookkeeping`` times the call, splits its bytes into bytes sent
   within this rank's node and to other nodes (``set_ranks_per_node``) and appends the record.

Subclasses provide the native collectives (``_native_*``, hooks called only from this class), the
point-to-point ``send``, ``recv`` and ``sendrecv`` the ring algorithms use, the cross-rank
exchange (``post_signature``, ``signatures_agree``, ``gather_ints``) and ``split``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from zerosim.comm import checks, ring
from zerosim.comm.call import Bookkeeping, Handle
from zerosim.comm.flight import check_timeout, default_timeout, env_flight_dir, env_timeout
from zerosim.comm.ledger import Ledger
from zerosim.comm.record import Record


class Communicator(ABC):
    """One rank's handle on a group of ranks: collectives, sub-groups and a ledger."""

    # called as after_record(record, root, counts) once a call's record is written (the dry
    # run's virtual world logs its calls so); None: nothing to do
    after_record: Callable[[Record, int, tuple[int, ...] | None], None] | None = None

    def __init__(
        self,
        rank: int,
        size: int,
        ledger: Ledger | None,
        collectives: str,
        group: str,
        validate: bool,
    ) -> None:
        self.rank = rank
        self.size = size
        self.ledger = ledger if ledger is not None else Ledger()
        self.group = group
        self.validate = validate
        self.collectives = collectives
        # the node of each rank of this group, in rank order; None when unknown (one node). A
        # sub-group learns it at its first collective after the parent's map was set.
        self.node_of: tuple[int, ...] | None = None
        self.route_now = "host"  # how the current call's data travels (Record.transport)
        self.node_version = 0  # the ledger's node_version this group's map was learnt at
        self.timeout = default_timeout()  # seconds a wait may last (0: forever); the watchdog's
        # (call number, record, stage) of the call this rank may be waiting in, for the watchdog
        self.waiting: tuple[int, Record | None, str] | None = None
        self.splits = 0  # sub-groups split off so far (every rank splits in the same order)
        self._child_names: set[str] = set()  # their names, so that no two share one

    # -- configuration --------------------------------------------------------------------------
    @property
    def collectives(self) -> str:
        """'native' (the world's own collectives) or 'ring' (our ring over point-to-point)."""
        return self._collectives

    @collectives.setter
    def collectives(self, value: str) -> None:
        self._collectives = checks.collectives(value)

    @property
    def timeout(self) -> float:
        """Seconds any one wait of a collective may last before the watchdog ends the job
        (``MPIComm``) or raises (``LocalWorld``); 0 means never. Sub-groups inherit it."""
        return self._timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._timeout = check_timeout(value)

    def set_watchdog(
        self,
        timeout: float | None = None,
        flight_records: int | None = None,
        flight_dir: str | None = None,
    ) -> None:
        """Apply the config's ``zerosim.timeout``, ``flight_records`` and ``flight_dir``.

        The environment variables ``ZEROSIM_TIMEOUT`` and ``ZEROSIM_FLIGHT_DIR`` win over the
        values given, so that a job can be given a shorter limit without editing its config.
        Sub-groups split off later inherit the timeout; the flight recorder is the ledger's.
        """
        env = env_timeout()
        timeout = env if env is not None else timeout
        if timeout is not None:
            self.timeout = timeout
        if flight_records is not None:
            self.ledger.flight.resize(flight_records)
        folder = env_flight_dir() or flight_dir
        if folder is not None:
            self.ledger.flight.directory = str(folder)

    def phase(self, name: str) -> AbstractContextManager[None]:
        """Context manager labelling the ledger records made inside it (forward, step…)."""
        return self.ledger.phase(name)

    def note_stream(self, stream: str) -> None:
        """Note in ``ledger.events`` (if kept) the GPU stream of what follows (``Ledger``)."""
        if self.ledger.events is not None:
            self.ledger.events.append(("stream", stream))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size}, group={self.group!r})"

    # -- nodes ----------------------------------------------------------------------------------
    def set_ranks_per_node(self, ranks_per_node: int | None) -> None:
        """Place rank r of this group on node r // ranks_per_node, for the ledger's split.

        With None, an MPI world asks MPI which ranks share memory (``MPI_COMM_TYPE_SHARED``):
        one node per shared-memory domain, named by its lowest rank (a collective); any other
        world is left as one node. Call it on every rank of the group, which should be the
        world whose ledger the sub-groups share (``split`` groups inherit the map).
        """
        if ranks_per_node is None:
            node = self._shared_memory_node()
            nodes = None if node is None else tuple(s[0] for s in self.gather_ints((node,)))
        elif (
            isinstance(ranks_per_node, bool)
            or not isinstance(ranks_per_node, (int, np.integer))
            or ranks_per_node < 1
        ):
            raise ValueError(f"ranks_per_node must be None or an int ≥ 1, got {ranks_per_node!r}")
        else:
            nodes = tuple(r // int(ranks_per_node) for r in range(self.size))
            node = nodes[self.rank]
        self.ledger.set_node(node)
        self.node_of, self.node_version = nodes, self.ledger.node_version

    def _shared_memory_node(self) -> int | None:
        """MPI worlds: the lowest rank of this rank's shared-memory node; other worlds: None."""
        return None

    def sync_nodes(self) -> None:
        """Learn the members' nodes (one small exchange) if the ledger's node changed since."""
        if self.node_version == self.ledger.node_version:
            return
        node = self.ledger.node
        self.node_of = None if node is None else tuple(s[0] for s in self.gather_ints((node,)))
        self.node_version = self.ledger.node_version

    # -- collectives ------------------------------------------------------------------------------
    def all_gather(self, out: Any, inp: Any) -> None:
        """out ← concatenation of every rank's ``inp`` in rank order (out.size = size · inp.size).

        ``inp`` may be this rank's own slice of ``out`` (in place, as ZeRO gathers a flat buffer).
        """
        in_place = checks.gather_scatter("all_gather", out, inp, self.rank, self.size)
        with Bookkeeping(self, "all_gather", out.dtype, out.size) as call:
            if call.ring:
                call.moved(*ring.all_gather(self, out, inp))
            else:
                self._native_all_gather(out, inp, in_place)

    def reduce_scatter(self, out: Any, inp: Any, op: str = "sum") -> None:
        """out ← chunk ``rank`` of the element-wise reduction of every rank's ``inp``."""
        in_place = checks.gather_scatter("reduce_scatter", inp, out, self.rank, self.size, op)
        with Bookkeeping(self, "reduce_scatter", inp.dtype, inp.size) as call:
            if call.ring:
                call.moved(*ring.reduce_scatter(self, out, inp, op, None))
            else:
                self._native_reduce_scatter(out, inp, op, in_place)

    def reduce_scatter_v(self, out: Any, inp: Any, counts: Sequence[int], op: str = "sum") -> None:
        """Reduce-scatter with uneven pieces: rank q gets ``counts[q]`` elements of the reduction.

        Rank q's piece starts at ``sum(counts[:q])``. ZeRO stage 2 uses it to reduce a gradient
        bucket whose elements are owned unevenly by the ranks (MPI_Reduce_scatter).
        """
        counts = checks.counts(out, inp, counts, op, self.rank, self.size)
        with Bookkeeping(self, "reduce_scatter", inp.dtype, inp.size, counts=counts) as call:
            if call.ring:
                call.moved(*ring.reduce_scatter(self, out, inp, op, counts))
            else:
                self._native_ireduce_scatter_v(out, inp, counts, op)()

    def all_reduce(self, buf: Any, op: str = "sum") -> None:
        """buf ← element-wise reduction of every rank's ``buf`` (in place)."""
        checks.buffer("buf", buf, writable=True)
        checks.op(op)
        with Bookkeeping(self, "all_reduce", buf.dtype, buf.size) as call:
            if call.ring:
                call.moved(*ring.all_reduce(self, buf, op))
            else:
                self._native_all_reduce(buf, op)

    def broadcast(self, buf: Any, root: int = 0) -> None:
        """buf ← root's ``buf`` on every rank."""
        checks.buffer("buf", buf, writable=True)
        checks.root(root, self.size)
        with Bookkeeping(self, "broadcast", buf.dtype, buf.size, root) as call:
            if call.ring:
                call.moved(*ring.broadcast(self, buf, root))
            else:
                self._native_broadcast(buf, root)

    def reduce(self, buf: Any, root: int = 0, op: str = "sum") -> None:
        """buf on ``root`` ← element-wise reduction of every rank's ``buf`` (in place there); the
        other ranks' ``buf`` is left as it was. DeepSpeed's ``reduce_scatter`` path at stages
        1-2 reduces each piece of a gradient bucket to the rank that owns it this way."""
        checks.reduce(buf, root, op, self.rank, self.size)
        with Bookkeeping(self, "reduce", buf.dtype, buf.size, root) as call:
            if call.ring:
                call.moved(*ring.reduce(self, buf, root, op))
            else:
                self._native_reduce(buf, root, op)

    def all_to_all(self, out: Any, inp: Any) -> None:
        """Block j of ``inp`` goes to rank j; block i of ``out`` comes from rank i."""
        checks.all_to_all(out, inp, self.size)
        with Bookkeeping(self, "all_to_all", inp.dtype, inp.size) as call:
            if call.ring:
                call.moved(*ring.all_to_all(self, out, inp))
            else:
                self._native_all_to_all(out, inp)

    def barrier(self) -> None:
        """Wait until every rank of the group has reached the barrier."""
        with Bookkeeping(self, "barrier", np.dtype(np.uint8), 0, has_ring=False):
            self._native_barrier()

    # -- non-blocking collectives ------------------------------------------------------------
    # The world's call starts the transfer and returns what completes it in ``Handle.wait()``;
    # our ring is synchronous, so its handle is already complete.
    def iall_gather(self, out: Any, inp: Any) -> Handle:
        """Start an all-gather; the result is in ``out`` after ``.wait()``."""
        in_place = checks.gather_scatter("all_gather", out, inp, self.rank, self.size)
        with Bookkeeping(self, "all_gather", out.dtype, out.size, blocking=False) as call:
            if call.ring:
                call.moved(*ring.all_gather(self, out, inp))
            else:
                call.finish = self._native_iall_gather(out, inp, in_place)
        return call.handle()

    def ireduce_scatter(self, out: Any, inp: Any, op: str = "sum") -> Handle:
        """Start a reduce-scatter; the result is in ``out`` after ``.wait()``."""
        in_place = checks.gather_scatter("reduce_scatter", inp, out, self.rank, self.size, op)
        with Bookkeeping(self, "reduce_scatter", inp.dtype, inp.size, blocking=False) as call:
            if call.ring:
                call.moved(*ring.reduce_scatter(self, out, inp, op, None))
            else:
                call.finish = self._native_ireduce_scatter(out, inp, op, in_place)
        return call.handle()

    def ireduce_scatter_v(
        self, out: Any, inp: Any, counts: Sequence[int], op: str = "sum"
    ) -> Handle:
        """Start a reduce-scatter with uneven pieces; ``out`` is ready after ``.wait()``."""
        counts = checks.counts(out, inp, counts, op, self.rank, self.size)
        with Bookkeeping(
            self, "reduce_scatter", inp.dtype, inp.size, counts=counts, blocking=False
        ) as call:
            if call.ring:
                call.moved(*ring.reduce_scatter(self, out, inp, op, counts))
            else:
                call.finish = self._native_ireduce_scatter_v(out, inp, counts, op)
        return call.handle()

    def iall_reduce(self, buf: Any, op: str = "sum") -> Handle:
        """Start an all-reduce; the result is in ``buf`` after ``.wait()``."""
        checks.buffer("buf", buf, writable=True)
        checks.op(op)
        with Bookkeeping(self, "all_reduce", buf.dtype, buf.size, blocking=False) as call:
            if call.ring:
                call.moved(*ring.all_reduce(self, buf, op))
            else:
                call.finish = self._native_iall_reduce(buf, op)
        return call.handle()

    def ireduce(self, buf: Any, root: int = 0, op: str = "sum") -> Handle:
        """Start a reduce to ``root``; root's ``buf`` holds the result after ``.wait()``."""
        checks.reduce(buf, root, op, self.rank, self.size)
        with Bookkeeping(self, "reduce", buf.dtype, buf.size, root, blocking=False) as call:
            if call.ring:
                call.moved(*ring.reduce(self, buf, root, op))
            else:
                call.finish = self._native_ireduce(buf, root, op)
        return call.handle()

    # -- sub-groups ----------------------------------------------------------------------------
    @abstractmethod
    def split(self, color: int, key: int = 0, name: str | None = None) -> Communicator:
        """A communicator over the ranks that passed the same ``color``, ordered by (key, rank).

        Its ledger name is ``<this group>/<name>.<color>``; ``name`` defaults to ``split<k>`` for
        the k-th split of this communicator, so two sub-groups of one rank never share a name
        (hpZ's group and qgZ's two hops on rank 0 are ``world/split1.0``, ``world/split2.0``, …).
        """

    def split_by(
        self, rule: Callable[[int], tuple[int, int]], name: str | None = None
    ) -> Communicator:
        """``split(color, key, name)`` with ``(color, key) = rule(self.rank)``, where ``rule(r)``
        is what every rank r of this group passes: the same split, stated for all ranks at
        once, so that a world whose ranks cannot ask each other (the dry run's virtual world,
        ``comm/virtual.py``) knows the members of every sub-group."""
        color, key = rule(self.rank)
        return self.split(color, key, name)

    def name_split(self, color: int, key: int, name: str | None) -> str:
        """Check ``split``'s arguments, count the split; return the new group's unique name."""
        checks.split(color, key, name)
        self.splits += 1
        child = f"{self.group}/{name or f'split{self.splits}'}.{int(color)}"
        if child in self._child_names:  # a name given twice: number the second
            child = f"{child}#{self.splits}"
        self._child_names.add(child)
        return child

    # -- what a world provides ----------------------------------------------------------------
    # Native collectives (non-blocking ones return what completes them), point-to-point for the
    # ring algorithms, the cross-rank exchange. ``in_place``: ``inp`` is this rank's own chunk of
    # ``out`` (all-gather), ``out`` of ``inp`` (reduce-scatter).
    @abstractmethod
    def _native_all_gather(self, out: Any, inp: Any, in_place: bool) -> None: ...
    @abstractmethod
    def _native_reduce_scatter(self, out: Any, inp: Any, op: str, in_place: bool) -> None: ...
    @abstractmethod
    def _native_all_reduce(self, buf: Any, op: str) -> None: ...
    @abstractmethod
    def _native_broadcast(self, buf: Any, root: int) -> None: ...
    @abstractmethod
    def _native_reduce(self, buf: Any, root: int, op: str) -> None: ...
    @abstractmethod
    def _native_all_to_all(self, out: Any, inp: Any) -> None: ...
    @abstractmethod
    def _native_barrier(self) -> None: ...
    @abstractmethod
    def _native_iall_gather(self, out: Any, inp: Any, in_place: bool) -> Callable[[], None]: ...
    @abstractmethod
    def _native_ireduce_scatter(
        self, out: Any, inp: Any, op: str, in_place: bool
    ) -> Callable[[], None]: ...
    @abstractmethod
    def _native_iall_reduce(self, buf: Any, op: str) -> Callable[[], None]: ...
    @abstractmethod
    def _native_ireduce(self, buf: Any, root: int, op: str) -> Callable[[], None]: ...
    @abstractmethod
    def _native_ireduce_scatter_v(
        self, out: Any, inp: Any, counts: tuple[int, ...], op: str
    ) -> Callable[[], None]: ...
    @abstractmethod
    def send(self, buf: Any, dest: int) -> None:
        """Send ``buf`` to rank ``dest`` of this group (returns once it may be reused)."""

    @abstractmethod
    def recv(self, buf: Any, source: int) -> None:
        """Receive into ``buf`` what rank ``source`` of this group sends."""

    @abstractmethod
    def sendrecv(self, sendbuf: Any, dest: int, recvbuf: Any, source: int) -> None:
        """Send ``sendbuf`` to ``dest`` while receiving ``recvbuf`` from ``source``."""

    @abstractmethod
    def gather_ints(self, values: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Every rank's ``values``, in rank order (a tiny all-gather, watched)."""

    # The cross-rank check in two halves, so that its message travels while this rank writes the
    # ledger record (``comm/call.py``). Worlds override them with something cheaper.
    def post_signature(self, signature: tuple[int, ...]) -> Any:
        """Send this rank's ``signature``; return the token ``signatures_agree`` waits on."""
        return signature

    def signatures_agree(self, token: Any) -> bool:
        """Wait for every rank's signature: are they all equal (the same answer on every rank)?"""
        every = self.gather_ints(token)
        return all(s == every[0] for s in every)
