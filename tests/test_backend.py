"""Backend selection, dtype names and host conversion."""

import ml_dtypes
import numpy as np
import pytest

from zerosim import backend


def test_dtype_names_resolve_to_numpy_dtypes():
    assert backend.resolve_dtype("float64") == np.float64
    assert backend.resolve_dtype("float16") == np.float16
    assert backend.resolve_dtype("bfloat16") == np.dtype(ml_dtypes.bfloat16)
    assert backend.dtype_name(backend.resolve_dtype("bfloat16")) == "bfloat16"
    assert backend.is_half(ml_dtypes.bfloat16) and not backend.is_half(np.float32)


def test_unknown_dtype_name_is_rejected_with_the_allowed_list():
    with pytest.raises(ValueError, match=r"dtype 'float8' is not supported; allowed: \["):
        backend.resolve_dtype("float8")


def test_numpy_backend_by_default_and_from_the_environment(monkeypatch):
    monkeypatch.delenv("ZEROSIM_BACKEND", raising=False)
    assert backend.get_backend().name == "numpy"
    monkeypatch.setenv("ZEROSIM_BACKEND", "numpy")
    b = backend.get_backend()
    x = b.zeros((2, 3), "bfloat16")
    assert x.dtype == ml_dtypes.bfloat16 and b.xp is np
    assert backend.to_host(x) is x and backend.array_module(x) is np


def test_unknown_backend_names_the_source_and_allowed_values(monkeypatch):
    with pytest.raises(ValueError, match=r"backend 'jax' is not supported; allowed: \['numpy'"):
        backend.get_backend("jax")
    monkeypatch.setenv("ZEROSIM_BACKEND", "torch")
    with pytest.raises(ValueError, match="ZEROSIM_BACKEND 'torch'"):
        backend.get_backend()


@pytest.mark.skipif(backend.gpu_available(), reason="this machine has a GPU")
def test_cupy_without_a_gpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match="'cupy' was requested but"):
        backend.get_backend("cupy")


@pytest.mark.skipif(not backend.gpu_available(), reason="needs CuPy and a CUDA GPU")
def test_cupy_backend_round_trips_arrays_through_the_device():
    b = backend.get_backend("cupy")
    x = b.asarray(np.arange(6, dtype=np.float32))
    assert backend.is_device_array(x)
    np.testing.assert_array_equal(backend.to_host(x), np.arange(6, dtype=np.float32))
    with pytest.raises(TypeError, match="bfloat16"):
        b.asarray(np.zeros(2), dtype="bfloat16")


def test_host_data_that_is_not_an_array_yet_belongs_to_numpy():
    """A list or tuple is host data: NumPy's namespace, and it crosses to nothing."""
    from zerosim.backend import crossings, move_like, xp_of

    assert xp_of([1.0, 2.0]) is np and xp_of((3,)) is np
    before = crossings().to_host_calls
    moved = move_like([1.0, 2.0], np.zeros(2))
    np.testing.assert_array_equal(moved, [1.0, 2.0])
    assert crossings().to_host_calls == before


def test_a_cupy_array_is_told_by_its_type_even_without_the_array_api_method():
    """CuPy releases before 14 have no ``__array_namespace__``: still a device array."""
    from zerosim.backend import is_cupy, is_device_array

    class OldCupyArray:
        pass

    OldCupyArray.__module__ = "cupy._core.core"
    assert is_cupy(OldCupyArray()) and is_device_array(OldCupyArray())
    assert not is_cupy(np.ones(2)) and not is_device_array(np.ones(2))
    assert not is_device_array([1.0])


def test_local_rank_is_read_from_the_launcher(monkeypatch):
    """The cupy backend puts each rank of a node on its own GPU: local rank mod device count."""
    from zerosim.backend import LOCAL_RANK_VARS, local_rank

    for name in LOCAL_RANK_VARS:
        monkeypatch.delenv(name, raising=False)
    assert local_rank() == 0
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert local_rank() == 3
    monkeypatch.setenv("MPI_LOCALRANKID", "1")  # MPICH's Hydra, checked first
    assert local_rank() == 1
