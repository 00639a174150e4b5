"""How a collective's data travels (zerosim/comm/cuda.py), decided per array and recorded."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from zerosim.backend import from_host, get_backend, to_host
from zerosim.comm import cuda


class _CupyLike:
    """Stands for a CuPy array in the decision (which looks only at the array's type)."""

    __module__ = "cupy._core.core"

    def __array_namespace__(self):  # a device array, as CuPy's are
        raise NotImplementedError


@pytest.mark.parametrize(
    "nccl, aware, want",
    [(object(), False, "nccl"), (None, True, "cuda-aware"), (None, False, "staged")],
)
def test_cupy_arrays_take_nccl_then_cuda_aware_mpi_then_staging(nccl, aware, want):
    assert cuda.transport(_CupyLike(), nccl, aware) == want


def test_host_arrays_go_as_they_are_and_other_device_arrays_are_staged():
    pytest.importorskip(
        "array_api_strict",
        reason="array-api-strict (the stand-in device) is in the test extra",
    )
    assert cuda.transport(np.ones(3), object(), True) == "host"
    strict = from_host(np.ones(3), xp=get_backend("array_api_strict").xp)
    assert cuda.transport(strict, object(), True) == "staged"  # NCCL and MPI read CuPy only


def test_cuda_aware_mpi_can_be_declared_where_the_library_does_not_say(monkeypatch):
    monkeypatch.setattr(cuda.MPI, "Query_cuda_support", None, raising=False)
    monkeypatch.delenv(cuda.CUDA_AWARE_ENV, raising=False)
    assert cuda.cuda_aware_mpi() is False
    monkeypatch.setenv(cuda.CUDA_AWARE_ENV, "1")
    assert cuda.cuda_aware_mpi() is True


def test_nccl_goes_first_even_where_mpi_is_cuda_aware():
    assert cuda.transport(_CupyLike(), object(), True) == "nccl"


def test_an_mpi_group_makes_no_nccl_communicator_until_a_cupy_collective(monkeypatch):
    """A run that never communicates CuPy arrays never sets NCCL up (on a GPU host it would
    claim a device per rank for nothing)."""
    from zerosim.comm import MPIComm

    made = []
    monkeypatch.setattr(cuda.Nccl, "maybe", classmethod(lambda cls, mpi: made.append(mpi)))
    comm = MPIComm()
    buf = np.ones(4)
    comm.all_reduce(buf)
    comm.split(0).all_reduce(buf)
    assert made == []
    assert comm._route(_CupyLike(), nccl=False) == "staged"  # no NCCL form: none made either
    assert made == []


class _Group:
    """Stands for an mpi4py communicator in ``Nccl.maybe``: its ranks' GPUs, seen from rank 0."""

    def __init__(self, devices):
        self.devices = devices

    def Get_size(self):  # noqa: N802  (mpi4py's names)
        return len(self.devices)

    def Get_rank(self):  # noqa: N802
        return 0

    def allgather(self, mine):
        return list(self.devices)


@pytest.mark.parametrize(
    "devices, made",
    [
        (["node/0000:19:00.0", "node/0000:3B:00.0"], True),  # a GPU each: NCCL
        (["a/0000:19:00.0", "b/0000:19:00.0"], True),  # the same bus id on two nodes
        (["node/0000:19:00.0", "node/0000:19:00.0"], False),  # two ranks on one GPU
        (["node/0000:19:00.0", None], False),  # a rank without NCCL or a GPU
        (["node/0000:19:00.0"], False),  # one rank: nothing to talk to
    ],
)
def test_nccl_is_set_up_only_where_every_rank_has_a_gpu_of_its_own(
    monkeypatch, caplog, devices, made
):
    monkeypatch.setattr(cuda.Nccl, "__init__", lambda self, mpi: None)
    got = cuda.Nccl.maybe(_Group(devices))
    assert isinstance(got, cuda.Nccl) is made
    shared = len(set(devices)) < len(devices)
    assert ("ranks share a GPU" in caplog.text) is shared, caplog.text
    if shared:  # the log names the device the ranks share
        assert "rank 1: node/0000:19:00.0" in caplog.text


def test_a_process_without_cupy_offers_no_nccl_device():
    from zerosim.backend import gpu_available

    if gpu_available():
        pytest.skip("a GPU is visible: tests/test_gpu.py checks the route under mpirun")
    assert cuda.nccl_device() is None


def _strict_pair(n: int):
    xp = get_backend("array_api_strict").xp
    return from_host(np.arange(float(n)), xp=xp), from_host(np.zeros(n), xp=xp)


@pytest.mark.parametrize("op", ["iall_gather", "ireduce_scatter", "ireduce_scatter_v"])
def test_staged_copies_of_a_non_blocking_call_live_until_its_wait(op, monkeypatch):
    """MPI may read a send buffer at any time before the request completes (Open MPI's
    non-blocking collectives do): the host copy of a staged input must not be freed before the
    wait, though nothing but the request refers to it (freed and reused, it sends garbage)."""
    pytest.importorskip("array_api_strict", reason="array-api-strict is in the test extra")
    from zerosim.comm import MPIComm
    from zerosim.comm import mpi as comm_mpi

    copies = []

    def recorded(x):
        host = to_host(x)
        copies.append(weakref.ref(host))
        return host

    monkeypatch.setattr(comm_mpi, "to_host", recorded)
    comm = MPIComm()  # this process alone: the calls complete at once, the lifetimes still hold
    inp, out = _strict_pair(4 * comm.size)
    if op != "iall_gather":
        out = _strict_pair(4)[1]
    else:
        inp = _strict_pair(4)[0]
    start = {
        "iall_gather": lambda: comm.iall_gather(out, inp),
        "ireduce_scatter": lambda: comm.ireduce_scatter(out, inp),
        "ireduce_scatter_v": lambda: comm.ireduce_scatter_v(out, inp, [4] * comm.size),
    }[op]
    handle = start()
    gc.collect()
    assert len(copies) == 2 and all(ref() is not None for ref in copies)
    handle.wait()
    assert np.array_equal(to_host(out), np.arange(4.0))
