"""How an ``MPIComm`` moves CuPy (GPU) arrays: NCCL, CUDA-aware MPI, or staging through the host.

The one place with CuPy-only communication code. ``MPIComm`` asks ``transport(x)`` for every
collective and records the answer in the call's ledger record (``Record.transport``):

- ``"host"``: NumPy arrays, handed to MPI as they are (no copy).
- ``"nccl"``: CuPy arrays when ``cupy.cuda.nccl`` is available. One NCCL communicator per
  ``MPIComm`` group, its unique id made on rank 0 and broadcast over MPI once (at set-up, not
  on a hot path); collectives run on a dedicated CUDA stream, and a non-blocking call's
  ``wait()`` synchronizes that stream. NCCL has no reduce-scatter with uneven counts nor an
  all-to-all: those calls use the next transport. NCCL needs a GPU of its own for each rank
  (it refuses two ranks on one device: "Duplicate GPU detected"); a group with more ranks than
  GPUs on a node uses the next transport for all its calls, and rank 0 logs why.
- ``"cuda-aware"``: CuPy arrays handed to MPI directly, when the MPI library says it reads
  device memory (``MPI.Query_cuda_support()`` where mpi4py has it, or
  ``ZEROSIM_CUDA_AWARE_MPI=1`` for libraries that do not report it).
- ``"staged"``: any other device array (CuPy without the above, array_api_strict's
  non-host device) is copied to host memory, sent, and copied back, through
  ``backend.to_host``/``from_host``, which count each crossing (``backend.crossings()``).

Only ``"host"`` and ``"staged"`` run on machines without a GPU (tests/test_array_api_engine.py);
the CuPy transports run where CuPy sees a GPU (tests/test_gpu.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from zerosim.backend import is_cupy, is_device_array, np_dtype

CUDA_AWARE_ENV = "ZEROSIM_CUDA_AWARE_MPI"

log = logging.getLogger(__name__)


def cuda_aware_mpi() -> bool:
    """Whether the MPI library reads and writes device memory itself."""
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        try:
            return bool(query())
        except MPI.Exception:
            return False
    return os.environ.get(CUDA_AWARE_ENV, "0") == "1"


def transport(x: Any, nccl: Any, cuda_aware: bool) -> str:
    """How a collective on ``x`` travels (see the module docstring)."""
    if not is_device_array(x):
        return "host"
    if is_cupy(x):
        if nccl is not None:
            return "nccl"
        if cuda_aware:
            return "cuda-aware"
    return "staged"


def nccl_device() -> str | None:
    """This process's GPU as ``host/PCI bus id`` when CuPy has NCCL and sees a GPU, else None
    (no CuPy, a CuPy built without NCCL, or no device)."""
    try:
        import cupy  # noqa: PLC0415  (GPU-only)
        from cupy.cuda import nccl  # noqa: PLC0415

        import zerosim.backend as backend  # noqa: PLC0415

        if not (backend.gpu_available() and nccl.available):
            return None
        bus_id = cupy.cuda.runtime.deviceGetPCIBusId(cupy.cuda.runtime.getDevice())
    except Exception:  # noqa: BLE001  (CUDA raises its own error types)
        return None
    return f"{MPI.Get_processor_name()}/{bus_id}"


class Nccl:
    """One NCCL communicator over the ranks of an mpi4py communicator (built collectively)."""

    OPS = ("sum", "max", "min")

    def __init__(self, mpi: MPI.Comm) -> None:
        import cupy  # noqa: PLC0415  (GPU-only)
        from cupy.cuda import nccl  # noqa: PLC0415

        self.cupy, self.nccl = cupy, nccl
        uid = nccl.get_unique_id() if mpi.Get_rank() == 0 else None
        uid = mpi.bcast(uid, root=0)  # once, at set-up: a tuple of 128 small ints
        self.comm = nccl.NcclCommunicator(mpi.Get_size(), uid, mpi.Get_rank())
        self.rank, self.size = mpi.Get_rank(), mpi.Get_size()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._types = {
            np.dtype(np.float64): nccl.NCCL_FLOAT64,
            np.dtype(np.float32): nccl.NCCL_FLOAT32,
            np.dtype(np.float16): nccl.NCCL_FLOAT16,
            np.dtype(np.int8): nccl.NCCL_INT8,
            np.dtype(np.uint8): nccl.NCCL_UINT8,
            np.dtype(np.int32): nccl.NCCL_INT32,
            np.dtype(np.int64): nccl.NCCL_INT64,
        }
        self._ops = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN}

    @classmethod
    def maybe(cls, mpi: MPI.Comm) -> Nccl | None:
        """An NCCL communicator when every rank has NCCL and a GPU of its own; else None (on
        every rank alike: each rank's device is all-gathered, once, so that no rank waits in a
        set-up the others skip). Ranks that share a GPU (more ranks than GPUs on a node) get
        None, since NCCL refuses them, and rank 0 logs it."""
        if mpi.Get_size() == 1:
            return None
        devices = mpi.allgather(nccl_device())  # at set-up: one short string per rank
        if None in devices:
            return None
        if len(set(devices)) < len(devices):
            if mpi.Get_rank() == 0:
                log.warning(
                    "NCCL not used: ranks share a GPU (%s) and NCCL needs one GPU per rank; "
                    "CuPy arrays go by the next transport (CUDA-aware MPI, else staged)",
                    ", ".join(f"rank {r}: {d}" for r, d in enumerate(devices)),
                )
            return None
        return cls(mpi)

    def _type(self, x: Any) -> int:
        return self._types[np_dtype(x.dtype)]

    def _run(self, launch: Callable[[int], None], blocking: bool) -> Callable[[], None]:
        """Order the launch after the work already queued on the current stream, run it on the
        NCCL stream, and return what completes it."""
        self.stream.wait_event(self.cupy.cuda.get_current_stream().record())
        launch(self.stream.ptr)
        if blocking:
            self.stream.synchronize()
        return self.stream.synchronize

    def all_gather(self, out: Any, inp: Any, blocking: bool = True) -> Callable[[], None]:
        return self._run(
            lambda s: self.comm.allGather(inp.data.ptr, out.data.ptr, inp.size, self._type(inp), s),
            blocking,
        )

    def reduce_scatter(
        self, out: Any, inp: Any, op: str, blocking: bool = True
    ) -> Callable[[], None]:
        return self._run(
            lambda s: self.comm.reduceScatter(
                inp.data.ptr, out.data.ptr, out.size, self._type(inp), self._ops[op], s
            ),
            blocking,
        )

    def all_reduce(self, buf: Any, op: str, blocking: bool = True) -> Callable[[], None]:
        return self._run(
            lambda s: self.comm.allReduce(
                buf.data.ptr, buf.data.ptr, buf.size, self._type(buf), self._ops[op], s
            ),
            blocking,
        )

    def reduce(self, buf: Any, root: int, op: str, blocking: bool = True) -> Callable[[], None]:
        return self._run(
            lambda s: self.comm.reduce(
                buf.data.ptr, buf.data.ptr, buf.size, self._type(buf), self._ops[op], root, s
            ),
            blocking,
        )

    def broadcast(self, buf: Any, root: int, blocking: bool = True) -> Callable[[], None]:
        return self._run(
            lambda s: self.comm.broadcast(
                buf.data.ptr, buf.data.ptr, buf.size, self._type(buf), root, s
            ),
            blocking,
        )
