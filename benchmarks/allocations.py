"""Memory allocated during a steady-state training step, per rank, measured with tracemalloc.

    python benchmarks/allocations.py [--ranks 2] [--stages 0 1 2 3] [--dtypes fp32 bf16]

launches ``mpirun -n N`` per configuration. Each rank trains an MLP with Adam for a few steps (so
buffers that are made once already exist), then traces one more step (two micro-steps): NumPy
reports every array allocation to ``tracemalloc``, so the peak of traced memory above the level
at the step's start is the most this rank allocated at once during the step. Rank 0 also records,
at each new peak, which lines hold the memory (a snapshot), and prints them.

The baseline is the model itself: the table gives the peak in units of the model's parameter
bytes Ψ·b (b = 4, float32 parameters) and of its largest parameter. The target: no model-sized
buffer is allocated per step. What remains, by design, is working memory of one layer at a time
(a linear layer's weight gradient as backpropagation makes it, stage 3's gathered parameters of
the layers in use, bounded by the prefetch bucket and ``stage3_max_live_parameters`` with no
reuse) and, under fp16/bf16, the fp32
copy of the rank's gradient shard that the optimizer step reads (Ψ/N elements; DeepSpeed's ZeRO
optimizer makes the same copy per step and frees it, which keeps the model-state memory equal to
the ZeRO paper's formula). Gradient bucket
buffers come from a pool (zerosim/zero/buckets.py) that allocates nothing after the first step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np

SIZES = [128] * 17 + [10]  # MLP widths: 16 equal layers, so no layer is a large part of Ψ


def _psi() -> tuple[int, int]:
    numels = [a * b + b for a, b in zip(SIZES[:-1], SIZES[1:], strict=True)]
    return sum(numels), max(a * b for a, b in zip(SIZES[:-1], SIZES[1:], strict=True))


def worker(stage: int, dtype: str, steps: int) -> None:
    from zerosim.comm import MPIComm
    from zerosim.engine import initialize
    from zerosim.nn import MLP

    comm = MPIComm()
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 20_000,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 20_000,  # bound what stage 3 gathers ahead …
            "stage3_max_live_parameters": 50_000,  # … and holds at once (DeepSpeed: 5e7, 1e9)
            # release after use: DeepSpeed's coordinator keeps every parameter whose next use
            # is within this many elements (default 1e9: the whole model, whatever the live cap)
            "stage3_max_reuse_distance": 0,
        },
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    engine, *_ = initialize(model=MLP(SIZES, seed=0), config=config, comm=comm)
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal((8, SIZES[0])).astype(np.float32)
    y = rng.integers(0, SIZES[-1], 8)

    def step() -> None:
        for _ in range(2):
            engine.backward(engine(x, y))
            engine.step()

    for _ in range(steps):
        step()
    pool_before = engine.strategy.pool.allocations
    tracemalloc.start(6)
    start = tracemalloc.get_traced_memory()[0]
    peak = [start, None]

    def watch(frame, event, arg) -> None:  # snapshot the holders at each new peak (rank 0)
        if event in ("return", "c_return"):
            now = tracemalloc.get_traced_memory()[0]
            if now > peak[0] + 4096:
                peak[0] = now
                peak[1] = tracemalloc.take_snapshot() if comm.rank == 0 else None

    sys.setprofile(watch)
    step()
    sys.setprofile(None)
    top = []
    if peak[1] is not None:
        for stat in peak[1].statistics("traceback")[:4]:
            frames = [f for f in stat.traceback if "zerosim" in f.filename]
            where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
            top.append((stat.size, where))
    out = {
        "stage": stage,
        "dtype": dtype,
        "n": comm.size,
        "rank": comm.rank,
        "peak": peak[0] - start,
        "pool_bytes": engine.strategy.pool.nbytes,
        "pool_new": engine.strategy.pool.allocations - pool_before,
        "top": top,
    }
    every = comm.mpi.gather(out, root=0)  # one line from rank 0: ranks' prints interleave
    if comm.rank == 0:
        print(json.dumps(every), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--steps", type=int, default=3, help="warm-up steps before the traced one")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(int(a.worker[0]), a.worker[1], a.steps)
        return 0
    mpirun = Path(sys.executable).parent / "mpirun"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    psi, largest = _psi()
    rows = []
    for stage in a.stages:
        for dtype in a.dtypes:
            cmd = [str(mpirun if mpirun.exists() else "mpirun"), "-n", str(a.ranks)]
            cmd += [
                sys.executable,
                __file__,
                "--worker",
                str(stage),
                dtype,
                "--steps",
                str(a.steps),
            ]
            res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
            (ranks,) = [json.loads(line) for line in res.stdout.splitlines() if line[:1] == "["]
            rows.append(
                {
                    **next(r for r in ranks if r["rank"] == 0),
                    "peak_max": max(r["peak"] for r in ranks),
                    "psi_bytes": 4 * psi,
                    "largest_bytes": 4 * largest,
                }
            )
    print(
        f"MLP {SIZES}: Ψ = {psi:,} parameters (Ψ·b = {4 * psi:,} B float32), largest "
        f"parameter {largest:,} elements; N = {a.ranks}; Adam; 2 micro-steps per step; "
        f"peak = most bytes allocated at once during one steady-state step, above its start"
    )
    print()
    print(
        "| stage | dtype | peak, max over ranks (B) | ÷ Ψ·b | ÷ largest param bytes | bucket "
        "pool (B) | pool allocations in the step | rank 0's largest holders at its peak |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        holders = "; ".join(f"{where} {size / 1024:.0f} KiB" for size, where in r["top"])
        print(
            f"| {r['stage']} | {r['dtype']} | {r['peak_max']:,} | {r['peak_max'] / (4 * psi):.2f} "
            f"| {r['peak_max'] / (4 * largest):.2f} | {r['pool_bytes']:,} | {r['pool_new']} "
            f"| {holders} |"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
