"""The engine and the fused kernels on a GPU (CuPy): the array_api_strict cases, on CuPy.

Every test here skips, naming why, unless CuPy is installed and sees a CUDA device
(``pip install zerosim[gpu]``). They are the GPU half of tests/test_array_api_engine.py: the same
parity cases on ``"zerosim": {"backend": "cupy"}`` in float64 (to the NumPy run's weights, 1e-12)
and in float32 (as close to the NumPy float64 run as NumPy's own float32 run is, within a factor
of 2: both differ from it by float32 rounding alone), in-process and under ``mpirun -n 2``; the
ElementwiseKernel updates against the NumPy path; and the route each collective took under
``mpirun -n 2`` (NCCL needs a GPU per rank: on a machine with one GPU the two ranks share it, and
the next route runs instead). The fused Adam kernel's bandwidth against the device's copy
bandwidth and torch's fused Adam is a benchmark: benchmarks/gpu_adam.py. benchmarks/gpu_check.sh
runs this file on a bare GPU machine.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from zerosim.backend import gpu_available

if not gpu_available():
    pytest.skip(
        "no GPU: CuPy is not installed or sees no CUDA device (pip install zerosim[gpu] on a "
        "machine with one); the device code paths run on array_api_strict instead "
        "(tests/test_array_api_engine.py)",
        allow_module_level=True,
    )

import cupy  # noqa: E402
from engine_cases import Case, train_on  # noqa: E402
from mpi_helpers import run_mpi  # noqa: E402

import zerosim as zs  # noqa: E402
from zerosim.optim import functional as F  # noqa: E402
from zerosim.optim.functional import cupy_kernels  # noqa: E402

CASES = [
    Case(stage=0, model="gpt", accumulation=2, clip=0.5),
    Case(stage=1, model="gpt", layout="megatron", clip=1.0),
    Case(stage=2, model="gpt", accumulation=2, clip=0.05),
    Case(stage=3, model="gpt", accumulation=2, clip=0.5),
]
FLOAT32_CASES = [
    *CASES,
    Case(stage=2, model="mlp", optimizer="sgd"),
]
# how far a float32 run on the GPU may be from the NumPy float64 run, as a multiple of NumPy's own
# float32 run's distance from it (array_api_strict's float32, another implementation on the
# host, stays within 1.7 times of it in these cases)
FLOAT32_FACTOR = 2.0


def _largest_difference(got: dict, want: dict) -> float:
    return max(float(np.max(np.abs(got[k].astype(np.float64) - want[k]))) for k in want)


def _compare(comm, case):
    want = train_on(comm, case.with_(steps=4))["params"]
    got = train_on(comm, case.with_(steps=4, backend="cupy"))
    return _largest_difference(got["params"], want), got["devices"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"s{c.stage}-{c.model}-{c.layout}")
def test_every_stage_on_the_gpu_matches_the_numpy_run(case):
    for err, devices in zs.LocalWorld(2).run(_compare, case):
        assert set(devices) == {str(cupy.cuda.Device(0))}, devices  # LocalWorld: one process
        assert err <= 1e-12


def _float32(comm, case):
    reference = train_on(comm, case.with_(steps=4))["params"]
    host = train_on(comm, case.with_(steps=4, dtype="float32"))["params"]
    device = train_on(comm, case.with_(steps=4, dtype="float32", backend="cupy"))
    return (
        _largest_difference(device["params"], reference),
        _largest_difference(host, reference),
        device["devices"],
    )


@pytest.mark.parametrize("case", FLOAT32_CASES, ids=lambda c: f"s{c.stage}-{c.model}-{c.optimizer}")
def test_every_stage_in_float32_on_the_gpu_is_as_close_to_float64_as_numpys_float32(case):
    for device, host, devices in zs.LocalWorld(2).run(_float32, case):
        assert set(devices) == {str(cupy.cuda.Device(0))}, devices
        assert 0 < host and device <= FLOAT32_FACTOR * host, (device, host)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_the_adam_elementwise_kernel_matches_the_numpy_path(dtype, amsgrad):
    rng = np.random.default_rng(0)
    host = [rng.standard_normal(10_001).astype(dtype) for _ in range(5)]
    host[3] = np.abs(host[3])
    host[4] = np.abs(host[4])
    dev = [cupy.asarray(a) for a in host]
    assert cupy_kernels.applies(*dev[:2], *dev[2:])
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, amsgrad=amsgrad)
    for step in (1, 2, 3):
        F.adam(*host, step=step, decoupled_weight_decay=True, **kw)
        F.adam(*dev, step=step, decoupled_weight_decay=True, **kw)
    tol = 0 if dtype == "float64" else 1e-6
    for h, d in zip(host, dev, strict=True):
        np.testing.assert_allclose(cupy.asnumpy(d), h, rtol=tol, atol=tol)


@pytest.mark.parametrize("nesterov", [False, True])
def test_the_sgd_elementwise_kernel_matches_the_numpy_path(nesterov):
    rng = np.random.default_rng(1)
    host = [rng.standard_normal(4097) for _ in range(3)]
    dev = [cupy.asarray(a) for a in host]
    for step in (1, 2, 3):
        kw = dict(lr=0.1, momentum=0.9, nesterov=nesterov, weight_decay=1e-3, first_step=step == 1)
        F.sgd(*host, **kw)
        F.sgd(*dev, **kw)
    for h, d in zip(host, dev, strict=True):
        np.testing.assert_array_equal(cupy.asnumpy(d), h)


def _expected_route() -> str:
    """The route of CuPy arrays under ``mpirun -n 2``: NCCL where CuPy has it and each rank has
    a GPU of its own (NCCL refuses two ranks on one device), else CUDA-aware MPI where the
    library reads device memory, else staged through the host."""
    from cupy.cuda import nccl

    from zerosim.comm import cuda

    if nccl.available and cupy.cuda.runtime.getDeviceCount() >= 2:
        return "nccl"
    return "cuda-aware" if cuda.cuda_aware_mpi() else "staged"


@pytest.mark.mpi
def test_collectives_on_gpu_arrays_say_how_they_travelled_under_mpirun():
    proc = run_mpi(2, ["tests/helpers/mpi_worker.py", "gpu_transport"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    routes = re.findall(r"OK rank \d+ result ([a-z-]+)", proc.stdout)
    want = _expected_route()
    assert routes == [want, want], proc.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_every_stage_on_the_gpu_under_mpirun_2(dtype):
    proc = run_mpi(2, ["tests/helpers/mpi_worker.py", "device_parity", "cupy", dtype], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = re.findall(r"OK rank (\d) result (\S+) (\S+)", proc.stdout)
    assert sorted(rank for rank, _, _ in results) == ["0", "1"], proc.stdout
    for _, pairs, routes in results:
        assert set(routes.split(",")) - {"host"} == {_expected_route()}, routes
        for pair in pairs.split(","):
            device, host = (float(v) for v in pair.split("/"))
            if dtype == "float64":
                assert device <= 1e-12, pairs
            else:
                assert 0 < host and device <= FLOAT32_FACTOR * host, pairs
