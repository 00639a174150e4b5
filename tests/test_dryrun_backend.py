"""The dry run follows the code path of the backend it stands for: with ``backend="numpy"`` its
memory equals a real NumPy run's (measured by ``tracemalloc``, outside zerosim) and its optimizer
is numba's one kernel call per shard; with ``"cupy"`` (the default, and a GPU cluster's) the
shape-only arrays keep CuPy's path: the work buffers of optimizer blocks of 2^24 elements, and
an fp32 AdamW step as CuPy's one ElementwiseKernel call per shard (``cupy_kernels.py``)."""

from __future__ import annotations

import json

import pytest
from cluster_files import write_cluster
from mpi_helpers import run_mpi

from zerosim.dryrun import dry_run, load_cluster_model
from zerosim.optim.functional.common import GPU_BLOCK_LENGTH, SCRATCH_SLOTS
from zerosim.optim.functional.fused import fused_enabled

MODEL = "gpt:2,256,96,64,4"  # Ψ = 1,645,568: at N = 2 a shard of 822,784 elements
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2},
    "zerosim": {"dtype": "float32", "schedule": "paper"},
}


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "ds.json"
    path.write_text(json.dumps(CONFIG))
    proc = run_mpi(2, ["tests/helpers/dryrun_backend_worker.py", MODEL, str(path)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("MEMORY")]
    return {int(r[1]): tuple(int(v) for v in r[2:]) for r in rows}


@pytest.mark.mpi
def test_a_numpy_dry_run_holds_and_peaks_at_what_a_real_numpy_run_allocates(real):
    report = dry_run(MODEL, 2, CONFIG, backend="numpy")
    assert report["backend"] == "numpy"
    for entry in report["ranks"]:
        for r in entry["ranks"]:
            live, rise, kernel_calls = real[r]
            # tracemalloc also sees the step's Python objects (ledger records, frames): ~20 KB
            assert entry["step_start_bytes"] == pytest.approx(live, rel=2e-3)
            assert entry["peak_bytes"] - entry["step_start_bytes"] == pytest.approx(rise, rel=5e-3)
            if fused_enabled():
                assert entry["ops"].get("kernel", 0) == kernel_calls == 1


@pytest.mark.mpi
def test_a_cupy_dry_run_is_not_a_numpy_run(real):
    report = dry_run(MODEL, 2, CONFIG, backend="cupy")
    entry = report["ranks"][0]
    live = real[entry["ranks"][0]][0]
    shard = 1_645_568 // 2
    # CuPy's optimizer walks the shard in one block (< 2^24) with SCRATCH_SLOTS work buffers
    assert shard < GPU_BLOCK_LENGTH
    assert entry["step_start_bytes"] > live + (SCRATCH_SLOTS - 1) * shard * 4
    # fp32 parameter, gradient and moments: one zs_adam kernel for the shard, no ufunc calls
    assert entry["ops"]["kernel"] == 1


def test_the_backend_follows_the_cluster_file(tmp_path):
    selene = load_cluster_model("selene")
    assert selene.backend == "torch"  # Megatron-LM's fused kernels (the file's comment)
    small = dict(CONFIG, zero_optimization={"stage": 1})
    assert dry_run("gpt:1,32,80,16,2", 2, small, cluster="selene")["backend"] == "torch"
    host = tmp_path / "host.json"
    spec = {
        "nodes": 1, "devices_per_node": 2, "intra_bandwidth": 1e10, "inter_bandwidth": 1e10,
        "intra_latency": 1e-5, "inter_latency": 1e-5, "device_flops": 1e11, "backend": "numpy",
    }  # fmt: skip
    write_cluster(host, **spec)
    assert dry_run("gpt:1,32,80,16,2", 2, small, cluster=str(host))["backend"] == "numpy"
    assert dry_run("gpt:1,32,80,16,2", 2, small)["backend"] == "cupy"
    spec["backend"] = "tpu"
    write_cluster(host, **spec)
    with pytest.raises(ValueError, match=r"must be one of \(.numpy., .cupy., .torch.\), got .tpu."):
        load_cluster_model(host)
