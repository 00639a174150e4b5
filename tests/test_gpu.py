"""The engine and the fused kernels on a GPU (CuPy): the array_api_strict cases, on CuPy.

Every test here skips, naming why, unless CuPy is installed and sees a CUDA device
(``pip install zerosim[gpu]``). They are the GPU half of tests/test_array_api_engine.py: the same
parity cases on ``"zerosim": {"backend": "cupy"}``, the ElementwiseKernel updates against the
NumPy path, and the transport each collective took under ``mpirun -n 2``. The fused Adam
kernel's bandwidth against the device's copy bandwidth is a benchmark: benchmarks/gpu_adam.py.
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
    Case(stage=2, model="mlp", optimizer="sgd", dtype="float32"),
]


def _compare(comm, case):
    want = train_on(comm, case.with_(steps=4))["params"]
    got = train_on(comm, case.with_(steps=4, backend="cupy"))
    return max(float(np.max(np.abs(got["params"][k] - want[k]))) for k in want), got["devices"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"s{c.stage}-{c.model}-{c.dtype}")
def test_every_stage_on_the_gpu_matches_the_numpy_run(case):
    for err, devices in zs.LocalWorld(2).run(_compare, case):
        assert set(devices) == {str(cupy.cuda.Device(0))}, devices  # LocalWorld: one process
        assert err <= (1e-12 if case.dtype == "float64" else 1e-5)


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


@pytest.mark.mpi
def test_collectives_on_gpu_arrays_say_how_they_travelled_under_mpirun():
    from cupy.cuda import nccl

    from zerosim.comm import cuda

    proc = run_mpi(2, ["tests/mpi_worker.py", "gpu_transport"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    routes = re.findall(r"OK rank \d+ result ([a-z-]+)", proc.stdout)
    # NCCL first where CuPy has it; else CUDA-aware MPI where the library reads device memory
    want = "nccl" if nccl.available else "cuda-aware" if cuda.cuda_aware_mpi() else "staged"
    assert routes == [want, want], proc.stdout
