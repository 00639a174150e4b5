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
* CuPy arrays go by NCCL where CuPy has it, else straight to a CUDA-aware MPI, else staged
  through host memory (copied to NumPy, communicated, copied back: correct everywhere but not
  fast); ``comm/cuda.py`` decides, and each ledger record names the route (``transport``).

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
import struct
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from zerosim.backend import (
    DTYPES,
    cupy_or_none,
    from_host,
    is_cupy,
    is_half,
    move_like,
    np_dtype,
    to_host,
)
from zerosim.comm import cuda, watchdog
from zerosim.comm.agreement import SIGNATURE_FIELDS
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
_OPS: dict[tuple[np.dtype, str], MPI.Op] = {}  # (dtype, op) → MPI's reduction, made once


def _half_op(dtype: np.dtype, op: str) -> MPI.Op:
    """A user-defined MPI.Op reducing 16-bit words as float16/bfloat16 values."""
    ufunc = {"sum": np.add, "max": np.maximum, "min": np.minimum}[op]

    # MPI.Op.Create calls its function with (inbuf, inoutbuf, datatype); the dtype is ours
    def reduce_half(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:  # noqa: V107
        a = np.frombuffer(inbuf, dtype=dtype)
        b = np.frombuffer(inoutbuf, dtype=dtype)
        ufunc(a, b, out=b)

    return MPI.Op.Create(reduce_half, commute=True)


def mpi_op(dtype: np.dtype, op: str) -> MPI.Op:
    """MPI's reduction for ``op`` on ``dtype`` (a user-defined one for 16-bit floats), cached:
    every reducing collective asks."""
    if not isinstance(dtype, np.dtype):  # another namespace's dtype (a staged device array)
        dtype = np_dtype(dtype)
    key = (dtype, op)
    found = _OPS.get(key)
    if found is None:
        found = _OPS[key] = _half_op(dtype, op) if is_half(dtype) else _NATIVE_OPS[op]
    return found


# dtype → (the dtype its words travel as, or None to send it as it is; the MPI datatype)
_WIRE = {
    dtype: (np.dtype(np.uint16) if is_half(dtype) else None, t) for dtype, t in _MPI_TYPES.items()
}


def buffer_spec(x: np.ndarray) -> list:
    """[buffer, MPI datatype] for a contiguous numpy array (16-bit floats as raw words)."""
    view, mpi_type = _WIRE[x.dtype]
    return [x if view is None else x.view(view), mpi_type]


def _back(x: Any, host: np.ndarray) -> None:
    """Copy a staged result back to its device array (nothing to do for NumPy arrays)."""
    if host is not x:
        x[...] = from_host(host, like=x)


def _result_to_own_chunk(rank: int, out: Any, host: np.ndarray) -> None:
    """An in-place reduce-scatter over ``host`` (the input, or its staged copy): MPI leaves the
    result at the front of the buffer; move it to this rank's own chunk ``out``."""
    result = host.reshape(-1)[: out.size].reshape(out.shape)
    if type(out) is not np.ndarray:  # a staged copy crosses back; CUDA-aware: already there
        out[...] = move_like(result, out)
    elif rank:
        out[...] = result


_NOT_YET = object()  # an MPIComm's NCCL communicator before its first CuPy collective


class _ArgumentCheck:
    """The buffers and the request of the cross-rank argument check: an all-gather of every rank's
    signature (a few int64). With MPI 4 it is a persistent collective (``Allgather_init``: set up
    once with the communicator, started once per call), else one ``Iallgather`` per call."""

    def __init__(self, mpi: MPI.Intracomm, fields: int) -> None:
        self.size = mpi.Get_size()
        self.mine = array.array("q", bytes(8 * fields))  # this rank's signature
        self.every = array.array("q", bytes(8 * fields * self.size))  # every rank's, rank order
        self._args = ([self.mine, MPI.INT64_T], [self.every, MPI.INT64_T])
        self._mpi = mpi
        self._pack = struct.Struct(f"{fields}q").pack_into
        try:
            self.persistent: MPI.Prequest | None = mpi.Allgather_init(*self._args)
        except (AttributeError, NotImplementedError, MPI.Exception):
            self.persistent = None  # an MPI before 4.0
        else:  # freed with the communicator, or at exit before MPI finalizes
            weakref.finalize(self, _free_request, self.persistent)

    def start(self, signature: tuple[int, ...]) -> MPI.Request:
        """Send this rank's ``signature``; the request completes once every rank's is here."""
        self._pack(self.mine, 0, *signature)
        if self.persistent is None:
            return self._mpi.Iallgather(*self._args)
        self.persistent.Start()
        return self.persistent

    def all_equal(self) -> bool:
        """After the request completed: did every rank send this rank's signature?"""
        return self.every.tobytes() == self.mine.tobytes() * self.size


def _free_request(request: MPI.Request) -> None:
    if not MPI.Is_finalized():
        request.Free()


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
        self.world_rank = MPI.COMM_WORLD.Get_rank()
        mine, world = self.mpi.Get_group(), MPI.COMM_WORLD.Get_group()
        self._world_ranks = mine.Translate_ranks(list(range(self.size)), world)
        mine.Free()
        world.Free()
        watchdog.start(self)
        # the check's persistent all-gather: set up by every rank as it makes this communicator
        self._check = _ArgumentCheck(self.mpi, len(SIGNATURE_FIELDS)) if self.size > 1 else None
        # how CuPy arrays travel (comm/cuda.py): NCCL, CUDA-aware MPI, or staged through the host.
        # The NCCL communicator is made at this group's first collective on CuPy arrays (every
        # rank reaches it together), so a run that never communicates CuPy arrays makes none.
        self._nccl: cuda.Nccl | None | object = _NOT_YET
        self._cuda_aware = cuda.cuda_aware_mpi()

    def _route(self, x: Any, nccl: bool = True) -> str:
        """How this call's data travels; written into its ledger record. ``nccl=False``: a call
        NCCL has no form of (uneven reduce-scatter, all-to-all, point to point)."""
        if type(x) is np.ndarray:  # the common case, decided without a call
            return "host"  # (Bookkeeping set route_now to "host" before the data moves)
        if nccl and self._nccl is _NOT_YET and is_cupy(x):
            # every rank of a job shares one installation: NCCL's set-up runs on all or none
            self._nccl = cuda.Nccl.maybe(self.mpi) if cupy_or_none() is not None else None
        self.route_now = route = cuda.transport(x, self._nccl if nccl else None, self._cuda_aware)
        if route == "cuda-aware":  # MPI reads the memory now: finish the work queued on it
            import cupy  # noqa: PLC0415

            cupy.cuda.get_current_stream().synchronize()
        return route

    def _host(self, x: Any) -> Any:
        """What MPI is given for ``x``: itself (NumPy, or CuPy under CUDA-aware MPI), else a
        host copy (staging, counted by the backend)."""
        return x if type(x) is np.ndarray or self.route_now == "cuda-aware" else to_host(x)

    def world_ranks(self) -> list[int]:
        """The COMM_WORLD rank of each rank of this group, in group order."""
        return list(self._world_ranks)

    # -- blocking: MPI's own call, watched -----------------------------------------------------
    def _blocking(self, call: Callable[..., None], *args: Any) -> None:
        """``call(*args)``, one of MPI's blocking collectives, watched by the watchdog."""
        watchdog.enter(self)
        try:
            call(*args)
        finally:
            watchdog.leave()

    def _native_all_gather(self, out: Any, inp: Any, in_place: bool) -> None:
        if self._route(out) == "nccl":
            self._nccl.all_gather(out, inp)
            return
        host = self._host(out)
        send = MPI.IN_PLACE if in_place else buffer_spec(self._host(inp))
        self._blocking(self.mpi.Allgather, send, buffer_spec(host))
        _back(out, host)

    def _native_reduce_scatter(self, out: Any, inp: Any, op: str, in_place: bool) -> None:
        if self._route(inp) == "nccl":
            self._nccl.reduce_scatter(out, inp, op)
            return
        host, reduction = self._host(inp), mpi_op(inp.dtype, op)
        if in_place:
            self._blocking(
                self.mpi.Reduce_scatter_block, MPI.IN_PLACE, buffer_spec(host), reduction
            )
            _result_to_own_chunk(self.rank, out, host)
        else:
            result = self._host(out)
            self._blocking(
                self.mpi.Reduce_scatter_block, buffer_spec(host), buffer_spec(result), reduction
            )
            _back(out, result)

    def _native_all_reduce(self, buf: Any, op: str) -> None:
        if self._route(buf) == "nccl":
            self._nccl.all_reduce(buf, op)
            return
        host = self._host(buf)
        self._blocking(self.mpi.Allreduce, MPI.IN_PLACE, buffer_spec(host), mpi_op(buf.dtype, op))
        _back(buf, host)

    def _native_reduce(self, buf: Any, root: int, op: str) -> None:
        if self._route(buf) == "nccl":
            self._nccl.reduce(buf, root, op)
            return
        host = self._host(buf)
        send, recv = self._reduce_specs(host, root)
        self._blocking(self.mpi.Reduce, send, recv, mpi_op(buf.dtype, op), root)
        _back(buf, host)

    def _reduce_specs(self, host: np.ndarray, root: int) -> tuple[Any, Any]:
        """(send, receive) buffers of a reduce in place on the root; no receive buffer elsewhere."""
        return (MPI.IN_PLACE, buffer_spec(host)) if self.rank == root else (buffer_spec(host), None)

    def _native_broadcast(self, buf: Any, root: int) -> None:
        if self._route(buf) == "nccl":
            self._nccl.broadcast(buf, root)
            return
        host = self._host(buf)
        self._blocking(self.mpi.Bcast, buffer_spec(host), root)
        _back(buf, host)

    def _native_all_to_all(self, out: Any, inp: Any) -> None:
        self._route(out, nccl=False)
        host = self._host(out)
        self._blocking(self.mpi.Alltoall, buffer_spec(self._host(inp)), buffer_spec(host))
        _back(out, host)

    def _native_barrier(self) -> None:
        watchdog.poll(self, self.mpi.Ibarrier())  # a pure rendezvous: wait without a core

    # -- non-blocking: started now, completed by MPI's blocking Wait, watched ------------------
    def _finisher(
        self, request: MPI.Request, then: Callable[[], None] | None = None, staged: tuple = ()
    ) -> Callable:
        """What completes ``request``: MPI's wait, then ``then``. ``staged`` holds the host
        copies the call was given (its input above all, which nothing else refers to) until the
        wait: MPI may read a send buffer at any time before the request completes (Open MPI's
        non-blocking collectives do, as they progress), and a copy freed and reused meanwhile
        would send whatever was written there since."""
        staged_copies = [x for x in staged if x is not None]

        def finish() -> None:
            watchdog.wait(self, request)
            if then is not None:
                then()
            staged_copies.clear()  # from here on the copies may be freed

        return finish

    def _native_iall_gather(self, out: Any, inp: Any, in_place: bool) -> Callable[[], None]:
        if self._route(out) == "nccl":
            return self._nccl.all_gather(out, inp, blocking=False)
        host = self._host(out)
        send = None if in_place else self._host(inp)
        request = self.mpi.Iallgather(
            MPI.IN_PLACE if send is None else buffer_spec(send), buffer_spec(host)
        )
        back = None if host is out else lambda: _back(out, host)
        return self._finisher(request, back, staged=(send, host))

    def _native_ireduce_scatter(
        self, out: Any, inp: Any, op: str, in_place: bool
    ) -> Callable[[], None]:
        if self._route(inp) == "nccl":
            return self._nccl.reduce_scatter(out, inp, op, blocking=False)
        host, reduction = self._host(inp), mpi_op(inp.dtype, op)
        if in_place:  # MPI leaves the result at the front of the buffer: moved at the wait
            request = self.mpi.Ireduce_scatter_block(MPI.IN_PLACE, buffer_spec(host), reduction)
            return self._finisher(request, lambda: _result_to_own_chunk(self.rank, out, host))
        result = self._host(out)
        request = self.mpi.Ireduce_scatter_block(buffer_spec(host), buffer_spec(result), reduction)
        back = None if result is out else lambda: _back(out, result)
        return self._finisher(request, back, staged=(host, result))

    def _native_ireduce_scatter_v(
        self, out: Any, inp: Any, counts: tuple[int, ...], op: str
    ) -> Callable[[], None]:
        self._route(out, nccl=False)
        send, result = self._host(inp), self._host(out)
        request = self.mpi.Ireduce_scatter(
            buffer_spec(send), buffer_spec(result), list(counts), mpi_op(inp.dtype, op)
        )
        back = None if result is out else lambda: _back(out, result)
        return self._finisher(request, back, staged=(send, result))

    def _native_ireduce(self, buf: Any, root: int, op: str) -> Callable[[], None]:
        if self._route(buf) == "nccl":
            return self._nccl.reduce(buf, root, op, blocking=False)
        host = self._host(buf)
        send, recv = self._reduce_specs(host, root)
        request = self.mpi.Ireduce(send, recv, mpi_op(buf.dtype, op), root=root)
        back = None if host is buf else lambda: _back(buf, host)
        return self._finisher(request, back, staged=(host,))

    def _native_iall_reduce(self, buf: Any, op: str) -> Callable[[], None]:
        if self._route(buf) == "nccl":
            return self._nccl.all_reduce(buf, op, blocking=False)
        host = self._host(buf)
        request = self.mpi.Iallreduce(MPI.IN_PLACE, buffer_spec(host), mpi_op(buf.dtype, op))
        back = None if host is buf else lambda: _back(buf, host)
        return self._finisher(request, back, staged=(host,))

    # -- point to point and checks ------------------------------------------------------------
    _RING_TAG = 7071

    # MPI's blocking call under the watchdog, written out here rather than through ``_blocking``:
    # the ring algorithms call these, and MPI's call stays two frames below the public collective.
    def sendrecv(self, sendbuf: Any, dest: int, recvbuf: Any, source: int) -> None:
        self._route(recvbuf, nccl=False)
        host, tag = self._host(recvbuf), self._RING_TAG
        send = buffer_spec(self._host(sendbuf))
        watchdog.enter(self)
        try:
            self.mpi.Sendrecv(send, dest, tag, buffer_spec(host), source, tag)
        finally:
            watchdog.leave()
        _back(recvbuf, host)

    def send(self, buf: Any, dest: int) -> None:
        self._route(buf, nccl=False)
        watchdog.enter(self)
        try:
            self.mpi.Send(buffer_spec(self._host(buf)), dest, self._RING_TAG)
        finally:
            watchdog.leave()

    def recv(self, buf: Any, source: int) -> None:
        self._route(buf, nccl=False)
        host = self._host(buf)
        watchdog.enter(self)
        try:
            self.mpi.Recv(buffer_spec(host), source, self._RING_TAG)
        finally:
            watchdog.leave()
        _back(buf, host)

    def post_signature(self, signature: tuple[int, ...]) -> MPI.Request:
        return self._check.start(signature)

    def signatures_agree(self, request: MPI.Request) -> bool:
        # Where a rank waits for the others to arrive at a collective: polled without holding a
        # core. Equal bytes mean equal signatures.
        watchdog.poll(self, request)
        return self._check.all_equal()

    def gather_ints(self, values: tuple[int, ...]) -> list[tuple[int, ...]]:
        mine = np.asarray(values, dtype=np.int64)
        every = np.empty(self.size * mine.size, dtype=np.int64)
        watchdog.poll(self, self.mpi.Iallgather([mine, MPI.INT64_T], [every, MPI.INT64_T]))
        return [tuple(int(v) for v in row) for row in every.reshape(self.size, -1)]

    def _shared_memory_node(self) -> int | None:
        """The lowest rank of this rank's shared-memory node (a collective, watched)."""
        self.waiting = (self.ledger.flight.calls, None, "node discovery")
        watchdog.poll(self, self.mpi.Ibarrier())  # every rank is here: the split cannot hang
        shared = self.mpi.Split_type(MPI.COMM_TYPE_SHARED)
        lowest = np.array([self.rank], dtype=np.int64)
        watchdog.wait(self, shared.Iallreduce(MPI.IN_PLACE, [lowest, MPI.INT64_T], op=MPI.MIN))
        shared.Free()
        self.waiting = None
        return int(lowest[0])

    def split(self, color: int, key: int = 0, name: str | None = None) -> MPIComm:
        group = self.name_split(color, key, name)
        self.waiting = (self.ledger.flight.calls, None, f"split of group {self.group!r}")
        watchdog.poll(self, self.mpi.Ibarrier())  # every rank is here: the split cannot hang
        self.waiting = None
        child = MPIComm(
            self.mpi.Split(int(color), int(key)),
            self.collectives,
            self.validate,
            self.ledger,
            group,
        )
        child.timeout = self.timeout
        return child
