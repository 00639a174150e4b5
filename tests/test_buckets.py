"""Gradient bucket buffers come from a pool: reused across steps, never model-sized per step."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from mpi_helpers import ROOT

from zerosim.analysis import bucket_pool_bytes
from zerosim.comm import LocalWorld
from zerosim.engine import initialize
from zerosim.nn import MLP
from zerosim.zero.buckets import MAX_IN_FLIGHT, BufferPool

SIZES = [128] * 25 + [4]  # 24 equal layers and a small head: no layer is much of Ψ
BUCKET = 10_000  # elements: each bucket is one layer (weight and bias)
LAYER = 128 * 128 + 128
PSI = sum(a * b + b for a, b in zip(SIZES[:-1], SIZES[1:], strict=True))


def test_pool_lends_zeroed_views_and_reuses_the_smallest_buffer_that_fits():
    pool = BufferPool(np, np.float32)
    a = pool.take(100)
    a[...] = 7
    b = pool.take((3, 10))
    assert pool.allocations == 2 and pool.nbytes == 4 * (100 + 30)
    pool.give(a)
    pool.give(b)
    c = pool.take((2, 12))  # 24 elements: the 30-element buffer fits best
    assert c.shape == (2, 12) and np.shares_memory(c, b) and not c.any()
    d = pool.take(90)  # only the 100-element one is left, and it was filled with 7s
    assert np.shares_memory(d, a) and not d.any()
    assert pool.allocations == 2
    pool.take(101)  # nothing free is large enough
    assert pool.allocations == 3 and pool.nbytes == 4 * (100 + 30 + 101)


def _train(comm, stage: int, overlap: bool):
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": overlap,
            "reduce_bucket_size": BUCKET,
            "stage3_param_persistence_threshold": 0,
        },
    }
    engine, *_ = initialize(model=MLP(SIZES, seed=1), config=config, comm=comm)
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal((4, SIZES[0])).astype(np.float32)
    y = rng.integers(0, SIZES[-1], 4)
    made = []
    for _ in range(4):
        for _ in range(2):
            engine.backward(engine(x, y))
            engine.step()
        made.append(engine.strategy.pool.allocations)
    return made, engine.strategy.pool.nbytes, engine.memory_report()


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("overlap", [True, False])
def test_bucket_buffers_are_made_in_the_first_step_and_only_reused_after(stage, overlap):
    for made, pool_bytes, report in LocalWorld(2).run(_train, stage, overlap):
        assert made[0] > 0 and made[1:] == [made[0]] * 3, made
        assert report["bucket_buffers"] == pool_bytes
        # Two buckets may be open at once (a bucket boundary inside a layer's parameters),
        # plus MAX_IN_FLIGHT launched ones, each with its 1/N output: a few layers, not Ψ.
        assert pool_bytes <= 4 * (MAX_IN_FLIGHT + 2) * LAYER * 3 // 2 < 4 * PSI / 4
        # ZeRO-R's constant buffers: within the analysis bound, which does not grow with Ψ
        bound = bucket_pool_bytes(BUCKET, LAYER, 2 * PSI, 2, 4, MAX_IN_FLIGHT)
        assert pool_bytes <= bound == bucket_pool_bytes(BUCKET, LAYER, 20 * PSI, 2, 4)


@pytest.mark.slow
def test_a_steady_state_step_allocates_no_model_sized_buffer_under_mpirun(tmp_path):
    """tracemalloc in each rank of a real MPI job (benchmarks/allocations.py): at fp32 the most
    a step allocates at once is a fraction of the model's bytes (one layer's weight gradient,
    activations; stage 3 also its bounded gathered parameters)."""
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "benchmarks/allocations.py", "--stages", "0", "2", "3"]
    cmd += ["--dtypes", "fp32", "--json", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {r["stage"]: r for r in json.loads(out.read_text())}
    sizes = [128] * 17 + [10]  # the benchmark's MLP, written out here
    psi_bytes = 4 * sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:], strict=True))
    assert rows[0]["pool_bytes"] == 0 and rows[2]["pool_bytes"] > 0
    # tracemalloc also counts the step's small Python objects (array views, ledger records,
    # hook closures: 30-40 KiB here), so the bounds leave room for them above the arrays. Stage 3
    # (DeepSpeed's coordinator): a coalesced gather's N rank segments and the parameters cut
    # from them are alive together for a moment, two copies of a fetch (module + prefetch).
    for stage, bound in ((0, 0.3), (2, 0.3), (3, 0.75)):
        assert rows[stage]["pool_new"] == 0
        assert 0 < rows[stage]["peak_max"] < bound * psi_bytes, (stage, rows[stage])
