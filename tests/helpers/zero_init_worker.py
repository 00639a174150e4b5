"""One rank of the zero.Init memory-cap job: ``mpirun -n 8 python
tests/helpers/zero_init_worker.py``.

Each rank caps its own private memory (``RLIMIT_DATA``, enforced by the kernel) at what it holds
after start-up (modules and the optimizer's kernels loaded) plus an allowance of
``--margin-mib``, then builds an MLP of ``--layers`` square layers of ``--width``, inside
``zerosim.zero.Init`` (``--inside``) or outside it, and trains it at stage 3 (``--optimizer``).
Prints one JSON line per rank: the cap and allowance, what it held at start, the model's fp32
size, the counted model states and the measured peaks, or the MemoryError it met.
Used by tests/test_zero_init.py and benchmarks/zero_init_cap.py.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tracemalloc

HERE = os.path.dirname(os.path.abspath(__file__))  # tests/helpers
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository

import numpy as np  # noqa: E402

import zerosim as zs  # noqa: E402
from zerosim.comm import MPIComm  # noqa: E402


def vmdata() -> int:
    """Bytes of this process's private data (heap and private anonymous mappings)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData in /proc/self/status")


def config(bucket: int, optimizer: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": optimizer, "params": {"lr": 1e-3}},
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": False,
            "reduce_bucket_size": bucket,
            "stage3_prefetch_bucket_size": 0,
            "stage3_max_reuse_distance": 0,
            "stage3_param_persistence_threshold": 0,
        },
    }


def emit(row: dict) -> None:
    """One line, one write: rows of 8 ranks never interleave (a pipe write < 4 KiB is atomic)."""
    os.write(1, (json.dumps(row) + "\n").encode())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inside", action="store_true", help="build inside zerosim.zero.Init")
    ap.add_argument("--layers", type=int, default=96)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--margin-mib", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--optimizer", choices=["Adam", "SGD"], default="Adam")
    args = ap.parse_args()
    comm = MPIComm()
    warm = zs.nn.Parameter(np.zeros(4, np.float32))  # load the optimizer's kernels (start-up)
    warm.grad = np.ones(4, np.float32)
    zs.optim.Adam([warm]).step()
    start = vmdata()
    cap = start + args.margin_mib * 2**20
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    sizes = [args.width] * (args.layers + 1)
    numel = sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:], strict=True))
    cfg = config(bucket=args.width * args.width, optimizer=args.optimizer)
    row = {"rank": comm.rank, "cap": cap, "allowance": cap - start, "start": start}
    row["fp32_model_bytes"] = 4 * numel
    tracemalloc.start()
    try:
        if args.inside:
            with zs.zero.Init(comm=comm, config=cfg):
                model = zs.nn.MLP(sizes, seed=0)
        else:
            model = zs.nn.MLP(sizes, seed=0)
    except MemoryError as err:
        row["error"] = f"MemoryError: {err}"
        emit(row)
        return 3
    row["build_peak"] = tracemalloc.get_traced_memory()[1]
    tracemalloc.reset_peak()
    engine, *_ = zs.initialize(model, cfg, comm=comm)
    rng = np.random.default_rng(comm.rank)
    losses = []
    for _ in range(args.steps):
        x = rng.normal(size=(2, args.width)).astype(np.float32)
        y = rng.integers(0, args.width, size=2)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    report = engine.memory_report()
    row.update(
        losses=losses,
        padded_numel=engine.strategy.padded_numel,
        report=report,
        held=engine.memory_totals()["held"],
        train_peak=tracemalloc.get_traced_memory()[1],
        vmdata_end=vmdata(),
    )
    emit(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
