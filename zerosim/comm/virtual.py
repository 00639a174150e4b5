"""VirtualWorld: N ranks that complete every collective without moving data, for the dry run.

A ``VirtualComm`` is one rank of a world of N (any N: 1,024 or 4,096) that exists only as
arithmetic. Its collectives go through the ``Communicator`` machinery every world shares
(``comm/base.py``: the argument checks, the ring-model bytes, the ledger record, the intra/inter
split), so each writes exactly the record ``MPIComm`` would write on that rank: same op, phase,
group, dtype, elements, bytes sent and received, in the same order. Only the data stays home:

- shape-only arrays (``zerosim/meta``) need nothing done;
- host (NumPy) buffers, the engine's few small messages (the model and config fingerprints, the
  norm, the overflow flag), are completed as if every rank had sent this rank's values
  (all-gather: N copies; sum: N times; max/min: itself), which is what ranks running the same
  program on the same model send.

No rank waits for another, so each rank runs alone, one after the other. **Sub-groups** are
made with ``split_by(rule)``, where ``rule(r)`` is the (color, key) every rank r passes (the way
zerosim's stages split): knowing every rank's colour, a virtual rank knows its sub-group's members
without asking them. ``split(color, key)``, which names only this rank's colour, is refused.

**Other ranks' records.** Ranks whose program is the same (the dry run's classes of rank) issue
the same calls; only the bytes of a call depend on the rank (an all-reduce's uneven chunks, a
broadcast's root, the neighbour's node) and so does a sub-group's name and size. ``as_rank(m)``
rewrites this rank's records as rank m's: the same calls, with m's sub-groups and m's bytes from
the same byte model (``ring.model_bytes``, ``ring.split_by_node``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from zerosim.comm import ring
from zerosim.comm.base import Communicator
from zerosim.comm.call import complete
from zerosim.comm.ledger import Ledger
from zerosim.comm.record import Record


@dataclass(frozen=True)
class Call:
    """One collective as the ledger recorded it, with what the record does not keep."""

    record: Record
    comm: VirtualComm
    root: int
    counts: tuple[int, ...] | None
    nodes_known: bool  # whether the group knew its members' nodes then (else all is intra)


class VirtualWorld:
    """N virtual ranks; ``comm(r)`` is rank r's communicator over the whole world."""

    def __init__(self, size: int) -> None:
        if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 1:
            raise ValueError(f"size must be a positive int, got {size!r}")
        self.size = int(size)
        self.nodes: tuple[int, ...] | None = None  # the node of every world rank, once set

    def __repr__(self) -> str:
        return f"VirtualWorld({self.size})"

    def comm(self, rank: int) -> VirtualComm:
        """Rank ``rank``'s communicator, with its own ledger (every record kept)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {rank!r}")
        return VirtualComm(self, tuple(range(self.size)), int(rank), Ledger(keep=None), "world")


def _symmetric(op: str, buf: Any, size: int) -> None:
    """A host buffer reduced over ``size`` ranks that all hold what this rank holds."""
    if op == "sum" and isinstance(buf, np.ndarray):
        buf *= size


class VirtualComm(Communicator):
    """One virtual rank of a group (see the module docstring)."""

    def __init__(
        self,
        world: VirtualWorld,
        members: tuple[int, ...],
        rank: int,
        ledger: Ledger,
        group: str,
        origin: tuple[VirtualComm, Callable[[int], tuple[int, int]], str, bool] | None = None,
    ) -> None:
        super().__init__(rank, len(members), ledger, "native", group, False)
        self.world = world
        self.members = members  # the world rank of each rank of this group
        # how this group was split off: (parent, rule, its name without the colour, numbered)
        self.origin = origin
        self.calls: list[Call] = [] if origin is None else origin[0].calls  # the world's log
        self.root: VirtualComm = self if origin is None else origin[0].root  # the world group
        # the root's: when a list, ("issue", call index) at each call and ("wait", call index)
        # when a non-blocking one is waited on (the order the dry run's time model reads)
        self._events: list | None = None
        self._views: dict[int, VirtualComm] = {}  # this group as other ranks see it
        self._colours: dict = {}  # (rule, group size) → its sub-groups' members, by colour

    @property
    def world_rank(self) -> int:
        return self.members[self.rank]

    # -- the record, and what it leaves out --------------------------------------------------
    def after_record(self, record: Record, root: int, counts: tuple[int, ...] | None) -> None:
        """Log the call in the world's ``calls`` (and its issue in the events, when asked)."""
        events = self.root._events
        if events is not None:
            events.append(("issue", len(self.calls)))
        self.calls.append(Call(record, self, int(root), counts, self.node_of is not None))

    def note_stream(self, stream: str) -> None:
        """The stream note in the world's events (``Communicator.note_stream``), when asked."""
        if self.root._events is not None:
            self.root._events.append(("stream", stream))

    def record_events(self, events: list | None) -> None:
        """Append this rank's ("issue", i) and ("wait", i) events, i its index in ``calls``, to
        ``events`` from now on, in every group of its world (None: stop)."""
        self.root._events = events

    # -- collectives: nothing moves ----------------------------------------------------------
    def _native_all_gather(self, out: Any, inp: Any, in_place: bool) -> None:
        if isinstance(out, np.ndarray):
            out.reshape(self.size, -1)[...] = np.reshape(inp, -1)

    def _native_reduce_scatter(self, out: Any, inp: Any, op: str, in_place: bool) -> None:
        if isinstance(out, np.ndarray):
            n = out.size
            out.reshape(-1)[...] = np.reshape(inp, -1)[self.rank * n : (self.rank + 1) * n]
            _symmetric(op, out, self.size)

    def _native_all_reduce(self, buf: Any, op: str) -> None:
        _symmetric(op, buf, self.size)

    def _native_broadcast(self, buf: Any, root: int) -> None:
        """Every rank already holds what the root holds."""

    def _native_reduce(self, buf: Any, root: int, op: str) -> None:
        if self.rank == root:
            _symmetric(op, buf, self.size)

    def _native_all_to_all(self, out: Any, inp: Any) -> None:
        if isinstance(out, np.ndarray):
            blocks = np.reshape(inp, (self.size, -1))
            out.reshape(self.size, -1)[...] = blocks[self.rank]

    def _native_barrier(self) -> None:
        """No rank to wait for."""

    def _completion(self) -> Callable[[], None]:
        """What ``wait()`` runs for a non-blocking call completed at once: it notes the wait when
        events are asked for. The call's index is the next one (its record is written after).
        A blocking call built on a non-blocking one (``reduce_scatter_v``) completes it inside
        the call, before its record: that is no wait, as a real rank's ledger has none."""
        events = self.root._events
        if events is None:
            return complete
        index = len(self.calls)

        def note_wait() -> None:
            if len(self.calls) > index:  # the record is written: the call was in flight
                events.append(("wait", index))

        return note_wait

    def _native_iall_gather(self, out: Any, inp: Any, in_place: bool) -> Callable[[], None]:
        self._native_all_gather(out, inp, in_place)
        return self._completion()

    def _native_ireduce_scatter(
        self, out: Any, inp: Any, op: str, in_place: bool
    ) -> Callable[[], None]:
        self._native_reduce_scatter(out, inp, op, in_place)
        return self._completion()

    def _native_iall_reduce(self, buf: Any, op: str) -> Callable[[], None]:
        self._native_all_reduce(buf, op)
        return self._completion()

    def _native_ireduce(self, buf: Any, root: int, op: str) -> Callable[[], None]:
        self._native_reduce(buf, root, op)
        return self._completion()

    def _native_ireduce_scatter_v(
        self, out: Any, inp: Any, counts: tuple[int, ...], op: str
    ) -> Callable[[], None]:
        if isinstance(out, np.ndarray):
            start = sum(counts[: self.rank])
            out.reshape(-1)[...] = np.reshape(inp, -1)[start : start + counts[self.rank]]
            _symmetric(op, out, self.size)
        return self._completion()

    # point to point (our ring algorithms): the ring counts its own bytes; nothing to carry
    def send(self, buf: Any, dest: int) -> None:
        pass

    def recv(self, buf: Any, source: int) -> None:
        pass

    def sendrecv(self, sendbuf: Any, dest: int, recvbuf: Any, source: int) -> None:
        pass

    def gather_ints(self, values: tuple[int, ...]) -> list[tuple[int, ...]]:
        return [values] * self.size

    def signatures_agree(self, token: Any) -> bool:
        return True  # every virtual rank makes this rank's call

    # -- nodes -------------------------------------------------------------------------------
    def set_ranks_per_node(self, ranks_per_node: int | None) -> None:
        super().set_ranks_per_node(ranks_per_node)
        if self.origin is None:  # the world's map, which every sub-group reads
            self.world.nodes = self.node_of

    def sync_nodes(self) -> None:
        nodes = self.world.nodes
        self.node_of = None if nodes is None else tuple(nodes[m] for m in self.members)
        self.node_version = self.ledger.node_version

    # -- sub-groups --------------------------------------------------------------------------
    def split(self, color: int, key: int = 0, name: str | None = None) -> VirtualComm:
        raise ValueError(
            f"a virtual rank cannot ask the other ranks of group {self.group!r} for their colour "
            f"(split(color={color!r})): use split_by(rule), rule(r) = (color, key) of every rank r"
        )

    def split_by(
        self, rule: Callable[[int], tuple[int, int]], name: str | None = None
    ) -> VirtualComm:
        color, key = rule(self.rank)
        group = self.name_split(color, key, name)
        members, rank = _members_of(rule, self.size, self.rank, self._colours)
        numbered = "#" in group.rsplit("/", 1)[-1]
        base = name or f"split{self.splits}"
        child = VirtualComm(
            self.world,
            tuple(self.members[g] for g in members),
            rank,
            self.ledger,
            group,
            (self, rule, base, numbered),
        )
        child.timeout = self.timeout
        return child

    # -- the same calls, as another rank makes them -------------------------------------------
    def view_of(self, world_rank: int) -> VirtualComm:
        """This group as rank ``world_rank`` of the world sees it: its own sub-group (name,
        members, its rank there) of the same split, on the same ledger (nothing is recorded)."""
        found = self._views.get(world_rank)
        if found is None:
            found = self._views[world_rank] = self._view(world_rank)
        return found

    def _view(self, world_rank: int) -> VirtualComm:
        if self.origin is None:
            return VirtualComm(self.world, self.members, world_rank, self.ledger, self.group)
        parent, rule, base, numbered = self.origin
        theirs = parent.view_of(world_rank)
        color, _ = rule(theirs.rank)
        members, rank = _members_of(rule, theirs.size, theirs.rank, parent._colours)
        group = f"{theirs.group}/{base}.{int(color)}"
        if numbered:
            group += f"#{self.group.rsplit('#', 1)[-1]}"
        view = VirtualComm(
            self.world,
            tuple(theirs.members[g] for g in members),
            rank,
            self.ledger,
            group,
            self.origin,
        )
        view.node_version = -1  # learn its nodes from the world's map at first use
        return view

    def bytes_by_phase(self, world_rank: int, step: int | None = None) -> dict[str, dict]:
        """{phase: {"sent", "recv", "intra", "inter"}}: the bytes of ``as_rank(world_rank)``'s
        records (of ``step`` only, when given), summed; each distinct call is rewritten once."""
        distinct: dict[tuple, int] = {}
        for call in self.calls:
            if step is not None and call.record.step != step:
                continue
            r = call.record
            key = (call.comm, r.op, r.phase, r.elements, r.size_bytes, call.root, call.counts)
            distinct[key + (call.nodes_known,)] = distinct.get(key + (call.nodes_known,), 0) + 1
        out: dict[str, dict] = {}
        for (comm, op, phase, elements, size, root, counts, known), times in distinct.items():
            record = Record(op, phase, "", "", elements, size, 0, 0, 0, 0, "model", True, 0.0)
            mine = self._rewrite(Call(record, comm, root, counts, known), world_rank)
            total = out.setdefault(phase, dict.fromkeys(("sent", "recv", "intra", "inter"), 0))
            total["sent"] += times * mine.bytes_sent
            total["recv"] += times * mine.bytes_recv
            total["intra"] += times * mine.intra_bytes
            total["inter"] += times * mine.inter_bytes
        return out

    def as_rank(self, world_rank: int) -> list[Record]:
        """The records rank ``world_rank`` writes when it makes the calls this rank made."""
        return [self._rewrite(call, world_rank) for call in self.calls]

    def _rewrite(self, call: Call, world_rank: int) -> Record:
        """``call``'s record as rank ``world_rank`` writes it."""
        r = call.record
        theirs = call.comm.view_of(world_rank)
        if theirs.node_version != self.ledger.node_version:
            theirs.sync_nodes()
        size = theirs.size
        itemsize = r.size_bytes // r.elements if r.elements else 1
        sent, recv = ring.model_bytes(
            r.op, r.elements, size, theirs.rank, itemsize, call.root, call.counts
        )
        mine = replace(r, group=theirs.group, bytes_sent=sent, bytes_recv=recv, peers=size)
        if theirs.node_of is None or not call.nodes_known:
            mine.intra_bytes, mine.inter_bytes = sent, 0
        else:
            mine.intra_bytes, mine.inter_bytes = ring.split_by_node(
                theirs.node_of, theirs.rank, r.op, sent, r.elements, itemsize
            )
        return mine


def _members_of(
    rule: Callable[[int], tuple[int, int]],
    size: int,
    rank: int,
    cache: dict[tuple[int, int], dict[int, list[int]]],
) -> tuple[list[int], int]:
    """The group ranks that share ``rank``'s colour under ``rule``, ordered by (key, rank), and
    ``rank``'s position among them (every rank's colour worked out once per rule and size)."""
    groups = cache.get((id(rule), size))
    if groups is None:
        by_colour: dict[int, list[tuple[int, int]]] = {}
        for g in range(size):
            color, key = rule(g)
            by_colour.setdefault(int(color), []).append((key, g))
        groups = cache[(id(rule), size)] = {
            c: [g for _, g in sorted(m)] for c, m in by_colour.items()
        }
    chosen = groups[int(rule(rank)[0])]
    return chosen, chosen.index(rank)
