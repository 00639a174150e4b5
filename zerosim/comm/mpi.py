"""MPIComm: the Communicator over a real MPI communicator (mpi4py's buffer methods only).

Every collective is one upper-case mpi4py call (``Allgather``, ``Reduce_scatter_block``,
``Allreduce``, ``Reduce``, ``Bcast``, ``Alltoall``, ``Iallgather`` …) on the arrays themselves: no
pickling and no copies for contiguous NumPy arrays.

What goes on the wire:

* float64, float32, int8/uint8/int32/int64 travel as their MPI types and reduce with MPI's own
  SUM/MAX/MIN.
* float16 and bfloat16 have no MPI reduction. They travel as 16-bit words (``MPI.UINT16_T``, so
  the wire carries exactly 2 bytes per element, as the ledger says) and reduce with a user-defined
  ``MPI.Op`` that views the words as float16/bfloat16 and adds (or takes max/min) in that dtype.
* CuPy arrays are staged through host memory (copied to NumPy, communicated, copied back). This is
  correct everywhere but not fast; NCCL and CUDA-aware MPI are not used yet.

No rank waits forever: every wait is watched (``comm/watchdog.py``). Where ranks wait for each
other to arrive (the cross-rank argument check, barriers, splits) the call is MPI's non-blocking
one, polled with sleeps so that a waiting rank does not hold a core; where data moves it is MPI's
own blocking call. A wait longer than ``timeout`` ends the job with a report of what it waited for.

Under ``mpirun`` with more than one rank, creating an MPIComm installs an exception hook that
prints the failing rank's traceback and flight record and calls ``MPI.COMM_WORLD.Abort(1)``, so one
rank's error ends the whole job within seconds instead of leaving the others blocked in a
collective (``watchdog.install_abort_on_exception``).
"""

from __future__ import annotations

import array
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from zerosim.backend import DTYPES, any_device_array, is_device_array, is_half, to_host
from zerosim.comm import watchdog
from zerosim.comm.base import Communicator
from zerosim.comm.ledger import Ledger

_MPI_TYPES = {
    np.dtype(np.float64): MPI.DOUBLE,
    np.dtype(np.float32): MPI.FLOAT,
    np.dtype(np.int8): MPI.INT8_T,
    np.dtype(np.uint8): MPI.UINT8_T,
    np.dtype(np.int32): MPI.INT32_T,
    np.dtype(np.int64): MPI.INT64_T,
    DTYPES["float16"]: MPI.UINT16_T,
    DTYPES["bfloat16"]: MPI.UINT16_T,
}
_NATIVE_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
_HALF_OPS: dict[tuple[np.dtype, str], MPI.Op] = {}


def _half_op(dtype: np.dtype, op: str) -> MPI.Op:
    """A user-defined MPI.Op reducing 16-bit words as float16/bfloat16 values."""
    key = (np.dtype(dtype), op)
    if key not in _HALF_OPS:
        ufunc = {"sum": np.add, "max": np.maximum, "min": np.minimum}[op]

        def reduce_half(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
            a = np.frombuffer(inbuf, dtype=key[0])
            b = np.frombuffer(inoutbuf, dtype=key[0])
            ufunc(a, b, out=b)

        _HALF_OPS[key] = MPI.Op.Create(reduce_half, commute=True)
    return _HALF_OPS[key]


def _mpi_op(dtype: np.dtype, op: str) -> MPI.Op:
    return _half_op(dtype, op) if is_half(dtype) else _NATIVE_OPS[op]


# dtype → (the dtype its words travel as, or None to send it as it is; the MPI datatype)
_WIRE = {
    dtype: (np.dtype(np.uint16) if is_half(dtype) else None, t) for dtype, t in _MPI_TYPES.items()
}


def _spec(x: np.ndarray) -> list:
    """[buffer, MPI datatype] for a contiguous numpy array (16-bit floats as raw words)."""
    view, mpi_type = _WIRE[x.dtype]
    return [x if view is None else x.view(view), mpi_type]


class _Staged:
    """Host copies of CuPy arrays for one collective, copied back to the device when done.

    NumPy arrays pass through untouched (``host`` is the very list given).
    """

    def __init__(self, arrays: list[Any]) -> None:
        self.device = arrays
        self.host = arrays
        if any_device_array(*arrays):
            self.host = [to_host(a) if is_device_array(a) else a for a in arrays]

    def copy_back(self, *indices: int) -> None:
        if self.host is self.device:
            return
        for i in indices:
            if is_device_array(self.device[i]):
                self.device[i].set(self.host[i])


class MPIComm(Communicator):
    """A Communicator over an mpi4py communicator (COMM_WORLD unless one is given)."""

    def __init__(
        self,
        mpi_comm: MPI.Comm | None = None,
        collectives: str = "native",
        validate: bool = True,
        ledger: Ledger | None = None,
        group: str = "world",
    ) -> None:
        self.mpi = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        super().__init__(
            self.mpi.Get_rank(), self.mpi.Get_size(), ledger, collectives, group, validate
        )
        self._agree_buf: array.array | None = None
        self.world_rank = MPI.COMM_WORLD.Get_rank()
        mine, world = self.mpi.Get_group(), MPI.COMM_WORLD.Get_group()
        self._world_ranks = mine.Translate_ranks(list(range(self.size)), world)
        mine.Free()
        world.Free()
        # this rank's row of the node's progress table: a private one until ``start`` (which
        # may wait under the watchdog) has made the table
        self._row = watchdog.row()
        watchdog.start(self)
        self._row = watchdog.row()

    def world_ranks(self) -> list[int]:
        """The COMM_WORLD rank of each rank of this group, in group order."""
        return list(self._world_ranks)

    # -- blocking: MPI's own call, watched -----------------------------------------------------
    def _native_all_gather(self, out: Any, inp: Any) -> None:
        s = _Staged([out, inp])
        send = MPI.IN_PLACE if self._is_own_slice(out, inp) else _spec(s.host[1])
        watchdog.enter(self)
        try:
            self.mpi.Allgather(send, _spec(s.host[0]))
        finally:
            watchdog.leave(self)
        s.copy_back(0)

    def _native_reduce_scatter(self, out: Any, inp: Any, op: str) -> None:
        s = _Staged([out, inp])
        mpi_op = _mpi_op(inp.dtype, op)
        in_place = self._is_own_slice(inp, out)
        watchdog.enter(self)
        try:
            if in_place:
                self.mpi.Reduce_scatter_block(MPI.IN_PLACE, _spec(s.host[1]), mpi_op)
            else:
                self.mpi.Reduce_scatter_block(_spec(s.host[1]), _spec(s.host[0]), mpi_op)
        finally:
            watchdog.leave(self)
        if in_place and self.rank:
            # MPI leaves the result at the front of the buffer; move it to our chunk.
            s.host[0][...] = s.host[1].reshape(-1)[: out.size].reshape(out.shape)
        s.copy_back(0)

    def _native_all_reduce(self, buf: Any, op: str) -> None:
        s = _Staged([buf])
        watchdog.enter(self)
        try:
            self.mpi.Allreduce(MPI.IN_PLACE, _spec(s.host[0]), _mpi_op(buf.dtype, op))
        finally:
            watchdog.leave(self)
        s.copy_back(0)

    def _native_broadcast(self, buf: Any, root: int) -> None:
        s = _Staged([buf])
        watchdog.enter(self)
        try:
            self.mpi.Bcast(_spec(s.host[0]), root=root)
        finally:
            watchdog.leave(self)
        s.copy_back(0)

    def _native_reduce(self, buf: Any, root: int, op: str) -> None:
        s = _Staged([buf])
        send, recv = self._reduce_specs(s.host[0], root)
        watchdog.enter(self)
        try:
            self.mpi.Reduce(send, recv, _mpi_op(buf.dtype, op), root=root)
        finally:
            watchdog.leave(self)
        s.copy_back(0)

    def _reduce_specs(self, host: np.ndarray, root: int) -> tuple[Any, Any]:
        """(send, receive) buffers of a reduce in place on the root; no receive buffer elsewhere."""
        return (MPI.IN_PLACE, _spec(host)) if self.rank == root else (_spec(host), None)

    def _native_all_to_all(self, out: Any, inp: Any) -> None:
        s = _Staged([out, inp])
        watchdog.enter(self)
        try:
            self.mpi.Alltoall(_spec(s.host[1]), _spec(s.host[0]))
        finally:
            watchdog.leave(self)
        s.copy_back(0)

    def _native_barrier(self) -> None:
        watchdog.poll(self, self.mpi.Ibarrier())  # a pure rendezvous: wait without a core

    # -- non-blocking --------------------------------------------------------------------------
    def _finisher(self, request: MPI.Request, staged: _Staged) -> Callable[[], None]:
        def finish() -> None:
            watchdog.wait(self, request)
            staged.copy_back(0)

        return finish

    def _native_iall_gather(self, out: Any, inp: Any) -> Callable[[], None]:
        s = _Staged([out, inp])
        send = MPI.IN_PLACE if self._is_own_slice(out, inp) else _spec(s.host[1])
        return self._finisher(self.mpi.Iallgather(send, _spec(s.host[0])), s)

    def _native_ireduce_scatter(self, out: Any, inp: Any, op: str) -> Callable[[], None]:
        s = _Staged([out, inp])
        mpi_op = _mpi_op(inp.dtype, op)
        if not self._is_own_slice(inp, out):
            request = self.mpi.Ireduce_scatter_block(_spec(s.host[1]), _spec(s.host[0]), mpi_op)
            return self._finisher(request, s)
        # In place: MPI leaves the result at the front of the buffer; move it to our own chunk.
        request = self.mpi.Ireduce_scatter_block(MPI.IN_PLACE, _spec(s.host[1]), mpi_op)

        def finish() -> None:
            watchdog.wait(self, request)
            if self.rank:
                s.host[0][...] = s.host[1].reshape(-1)[: out.size].reshape(out.shape)
            s.copy_back(0)

        return finish

    def _native_ireduce_scatter_v(
        self, out: Any, inp: Any, counts: tuple[int, ...], op: str
    ) -> Callable[[], None]:
        s = _Staged([out, inp])
        request = self.mpi.Ireduce_scatter(
            _spec(s.host[1]), _spec(s.host[0]), list(counts), _mpi_op(inp.dtype, op)
        )
        return self._finisher(request, s)

    def _native_ireduce(self, buf: Any, root: int, op: str) -> Callable[[], None]:
        s = _Staged([buf])
        send, recv = self._reduce_specs(s.host[0], root)
        return self._finisher(self.mpi.Ireduce(send, recv, _mpi_op(buf.dtype, op), root=root), s)

    def _native_iall_reduce(self, buf: Any, op: str) -> Callable[[], None]:
        s = _Staged([buf])
        request = self.mpi.Iallreduce(MPI.IN_PLACE, _spec(s.host[0]), _mpi_op(buf.dtype, op))
        return self._finisher(request, s)

    # -- point to point and checks ------------------------------------------------------------
    _RING_TAG = 7071

    def _sendrecv(self, sendbuf: Any, dest: int, recvbuf: Any, source: int) -> None:
        s = _Staged([recvbuf, sendbuf])
        watchdog.enter(self)
        try:
            self.mpi.Sendrecv(
                _spec(s.host[1]), dest, self._RING_TAG, _spec(s.host[0]), source, self._RING_TAG
            )
        finally:
            watchdog.leave(self)
        s.copy_back(0)

    def _send(self, buf: Any, dest: int) -> None:
        watchdog.wait(self, self.mpi.Isend(_spec(to_host(buf)), dest, self._RING_TAG))

    def _recv(self, buf: Any, source: int) -> None:
        s = _Staged([buf])
        watchdog.wait(self, self.mpi.Irecv(_spec(s.host[0]), source, self._RING_TAG))
        s.copy_back(0)

    def _all_agree(self, signature: tuple[int, ...]) -> bool:
        # The all-gather of _agree without building tuples: equal bytes mean equal signatures.
        # (array.array is cheaper than a NumPy array for a handful of ints.) It is where a rank
        # waits for the others to arrive at a collective, so it is polled without holding a core.
        mine = array.array("q", signature)
        if self._agree_buf is None or len(self._agree_buf) != len(mine) * self.size:
            self._agree_buf = array.array("q", bytes(8 * len(mine) * self.size))
        request = self.mpi.Iallgather([mine, MPI.INT64_T], [self._agree_buf, MPI.INT64_T])
        watchdog.poll(self, request)
        return self._agree_buf.tobytes() == mine.tobytes() * self.size

    def _agree(self, signature: tuple[int, ...]) -> list[tuple[int, ...]]:
        mine = np.asarray(signature, dtype=np.int64)
        every = np.empty(self.size * mine.size, dtype=np.int64)
        watchdog.poll(self, self.mpi.Iallgather([mine, MPI.INT64_T], [every, MPI.INT64_T]))
        return [tuple(int(v) for v in row) for row in every.reshape(self.size, -1)]

    def _shared_memory_node(self) -> int | None:
        """The lowest rank of this rank's shared-memory node (a collective, watched)."""
        self._pending = (self.ledger.flight.calls, None, "node discovery")
        watchdog.poll(self, self.mpi.Ibarrier())  # every rank is here: the split cannot hang
        shared = self.mpi.Split_type(MPI.COMM_TYPE_SHARED)
        lowest = np.array([self.rank], dtype=np.int64)
        watchdog.wait(self, shared.Iallreduce(MPI.IN_PLACE, [lowest, MPI.INT64_T], op=MPI.MIN))
        shared.Free()
        self._pending = None
        return int(lowest[0])

    def split(self, color: int, key: int = 0, name: str | None = None) -> MPIComm:
        group = self._check_split(color, key, name)
        self._pending = (self.ledger.flight.calls, None, f"split of group {self.group!r}")
        watchdog.poll(self, self.mpi.Ibarrier())  # every rank is here: the split cannot hang
        self._pending = None
        child = MPIComm(
            self.mpi.Split(int(color), int(key)),
            self.collectives,
            self.validate,
            self.ledger,
            group,
        )
        child.timeout = self.timeout
        return child
