"""The bookkeeping around one collective call, as one context manager, and a non-blocking call's
``Handle``.

A public collective of ``Communicator`` reads::

    with Bookkeeping(self, "all_gather", out.dtype, out.size) as call:
        if call.ring:
            call.moved(*ring.all_gather(self, out, inp))
        else:
            self._native_all_gather(out, inp, in_place)

so that the world's own collective runs one Python frame below the public method. Entering
posts the cross-rank check (``comm/agreement.py``), writes the ledger record (the ring-model bytes
of ``ring.model_bytes``, or zeros for our ring to fill in) and numbers it in the flight recorder
while the check's message travels, then waits for the check and sets the watchdog's note
(``comm.waiting``: call number, record, stage). Leaving splits the bytes by node, times the call
and appends the record. An exception inside leaves the record unwritten and the note standing,
for the watchdog and the flight recorder to name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zerosim.backend import dtype_name, np_dtype
from zerosim.comm import agreement, ring
from zerosim.comm.record import Record


def complete() -> None:
    """What completes a call that is already complete."""


DTYPE_NAMES: dict[Any, str] = {}


def cached_dtype_name(dtype: Any) -> str:
    """``dtype_name`` memoised by dtype object (one dict lookup on the hot path)."""
    name = DTYPE_NAMES.get(dtype)
    if name is None:
        name = DTYPE_NAMES[dtype] = dtype_name(dtype)
    return name


class Handle:
    """A non-blocking collective in flight; ``wait()`` completes it and times it in the ledger."""

    def __init__(self, finish: Callable[[], None], record: Record, comm: Any, seq: int) -> None:
        self._finish = finish
        self._record = record
        self._comm = comm
        self._seq = seq  # the call's number in the flight recorder
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        self._comm.waiting = (self._seq, self._record, "wait()")
        self._finish()
        self._comm.waiting = None
        self.done = True
        ledger = self._comm.ledger
        self._record.wall_time = ledger.now() - self._record.start
        if ledger.events is not None:
            ledger.events.append(("wait", self._record))


class Bookkeeping:
    """Check, record, flight entry and watchdog note of one call on ``comm`` (a Communicator).

    ``ring``: run our ring algorithm (then report its bytes with ``moved``), else the world's
    own collective. A non-blocking call stores what completes it in ``finish`` and asks for its
    ``handle()`` after the block.
    """

    __slots__ = (
        "comm",
        "op",
        "dtype",
        "count",
        "root",
        "counts",
        "ring",
        "finish",
        "record",
        "seq",
    )

    def __init__(
        self,
        comm: Any,
        op: str,
        dtype: Any,
        count: int,
        root: int = 0,
        counts: tuple[int, ...] | None = None,
        blocking: bool = True,
        has_ring: bool = True,
    ) -> None:
        self.comm = comm
        self.op = op
        self.dtype = np_dtype(dtype)
        self.count = count
        self.root = root
        self.counts = counts
        self.ring = has_ring and comm.collectives == "ring" and comm.size > 1
        self.finish: Callable[[], None] | None = None if blocking else complete
        self.record: Record | None = None
        self.seq = 0

    def moved(self, sent: int, recv: int) -> None:
        """The bytes our ring really handed to send calls and received."""
        self.record.bytes_sent, self.record.bytes_recv = sent, recv

    def __enter__(self) -> Bookkeeping:
        comm, ledger, dtype, count = self.comm, self.comm.ledger, self.dtype, self.count
        if comm.node_version != ledger.node_version:
            comm.sync_nodes()
        checking = comm.validate and comm.size > 1
        if checking:
            mine = agreement.signature(self.op, dtype, count, self.root, self.counts)
            token = comm.post_signature(mine)
        if self.ring:
            sent = recv = 0
        else:
            sent, recv = ring.model_bytes(
                self.op, count, comm.size, comm.rank, dtype.itemsize, self.root, self.counts
            )
        self.record = record = Record(  # positional (half the cost of keywords), in order:
            self.op,  # op
            ledger.current_phase,  # phase
            comm.group,  # group
            cached_dtype_name(dtype),  # dtype
            count,  # elements
            count * dtype.itemsize,  # size_bytes
            sent,  # bytes_sent
            recv,  # bytes_recv
            comm.size,  # peers
            ledger.step,  # step
            "wire" if self.ring else "model",  # counted
            self.finish is None,  # blocking
            ledger.now(),  # start (set again when the data starts to move)
        )
        self.seq = seq = ledger.flight.begin(record)
        if checking:
            comm.waiting = (seq, record, "cross-rank argument check")
            if not comm.signatures_agree(token):
                comm.waiting = None
                every = comm.gather_ints(mine)  # every rank learnt the same answer: the details
                raise agreement.disagreement(comm.group, comm.rank, self.op, dtype, mine, every)
        comm.waiting = (seq, record, "data exchange")
        comm.route_now = "host"
        record.start = ledger.now()  # the wall time is the transfer's, without the check
        return self

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        if kind is not None:
            return  # the record is not written; the watchdog's note still names the call
        comm, record = self.comm, self.record
        comm.waiting = None
        record.transport = comm.route_now
        if comm.node_of is None:
            record.intra_bytes = record.bytes_sent  # one node: every byte stays on it
        else:
            record.intra_bytes, record.inter_bytes = ring.split_by_node(
                comm.node_of, comm.rank, self.op, record.bytes_sent, self.count, self.dtype.itemsize
            )
        if self.finish is None:
            record.wall_time = comm.ledger.now() - record.start
        comm.ledger.append(record)
        if comm.ledger.events is not None:
            comm.ledger.events.append(("issue", record))
        if comm.after_record is not None:
            comm.after_record(record, self.root, self.counts)

    def handle(self) -> Handle:
        """What completes a non-blocking call (already complete after our ring)."""
        return Handle(self.finish, self.record, self.comm, self.seq)
