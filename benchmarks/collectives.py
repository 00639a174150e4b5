"""zerosim's collectives against raw mpi4py calls on the same buffers.

    python benchmarks/collectives.py [--ranks 2 4] [--max-mib 256] [--repeats 5]

launches ``mpirun -n N`` for each N, times all_gather / reduce_scatter / all_reduce from 4 KiB to
``--max-mib`` MiB (S, the full buffer, as nccl-tests counts it), and prints algbw, busbw and the
ratio zerosim / raw mpi4py (time_raw / time_zerosim: 1.0 means no overhead). zerosim runs with its
defaults (ledger on, cross-rank argument check on) and with the check off (``validate=False``),
timed interleaved with the raw calls; each sample times enough back-to-back calls to last about
10 ms (as nccl-tests averages over iterations). The ring column is our explicit ring algorithm over
point-to-point messages, for reference. Target: ratio ≥ 0.95 from 1 MiB up.

The summary also states the fixed cost zerosim adds to every call (its time minus raw's at the
smallest size, where the transfer is negligible) and the ratio that cost alone allows at 1 MiB:
the argument checks, the ledger record and, with the check on, one extra small all-gather that
makes every rank's arguments agree before any data moves.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

OPS = ("all_gather", "reduce_scatter", "all_reduce")
FACTOR = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}


def _sizes(max_mib: float) -> list[int]:
    sizes, s = [], 4 * 1024
    while s <= max_mib * 2**20:
        sizes.append(s)
        s *= 4
    return sizes


def _time(comm, fn, repeats: int, iters: int = 1) -> float:
    """Median over repeats of the slowest rank's time per call, over ``iters`` calls in a row.

    As nccl-tests does, each sample times several back-to-back calls, so one call's jitter (a
    rank descheduled for a moment) is averaged instead of deciding the sample.
    """
    from mpi4py import MPI

    times = []
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        elapsed = np.array([(time.perf_counter() - t0) / iters])
        comm.Allreduce(MPI.IN_PLACE, elapsed, op=MPI.MAX)
        times.append(elapsed[0])
    return float(np.median(times))


def _iters(comm, fn, target_s: float = 0.01) -> int:
    """Calls per sample so that one sample lasts about ``target_s`` (the same on every rank)."""
    one = _time(comm, fn, 3)
    return max(1, min(1000, int(target_s / max(one, 1e-7))))


def _raw_calls(mpi, full, part) -> dict:
    from mpi4py import MPI

    return {
        "all_gather": lambda: mpi.Allgather(part, full),
        "reduce_scatter": lambda: mpi.Reduce_scatter_block(full, part, op=MPI.SUM),
        "all_reduce": lambda: mpi.Allreduce(MPI.IN_PLACE, full, op=MPI.SUM),
    }


def _zerosim_calls(comm, full, part) -> dict:
    return {
        "all_gather": lambda: comm.all_gather(full, part),
        "reduce_scatter": lambda: comm.reduce_scatter(part, full),
        "all_reduce": lambda: comm.all_reduce(full),
    }


def worker(max_mib: float, repeats: int) -> None:
    from mpi4py import MPI

    from zerosim.comm import MPIComm

    mpi = MPI.COMM_WORLD
    n, rank = mpi.Get_size(), mpi.Get_rank()
    zs_comm = MPIComm()
    fast_comm = MPIComm(validate=False)
    ring_comm = MPIComm(collectives="ring")
    for size in _sizes(max_mib):
        count = size // 4 // n * n
        full = np.ones(count, dtype=np.float32)
        part = np.ones(count // n, dtype=np.float32)
        raw = _raw_calls(mpi, full, part)

        for op in OPS:
            ours = _zerosim_calls(zs_comm, full, part)
            fast = _zerosim_calls(fast_comm, full, part)
            ring = _zerosim_calls(ring_comm, full, part)
            ours[op]()  # warm-up
            iters = _iters(mpi, raw[op])
            t_raw, t_zs, t_fast = [], [], []
            for _ in range(repeats):  # interleaved, so a change of load hits all three
                t_raw.append(_time(mpi, raw[op], 1, iters))
                t_zs.append(_time(mpi, ours[op], 1, iters))
                t_fast.append(_time(mpi, fast[op], 1, iters))
                for c in (zs_comm, fast_comm):
                    c.ledger.reset()  # between samples, so the ledger does not grow unbounded
            t_ring = _time(mpi, ring[op], max(1, repeats // 2), max(1, iters // 4))
            ring_comm.ledger.reset()
            if rank == 0:
                row = {
                    "n": n,
                    "op": op,
                    "bytes": count * 4,
                    "raw": float(np.median(t_raw)),
                    "zerosim": float(np.median(t_zs)),
                    "fast": float(np.median(t_fast)),
                    "ring": t_ring,
                    "iters": iters,
                }
                print(json.dumps(row), flush=True)


def _row(r: dict) -> str:
    n, size = r["n"], r["bytes"]
    factor = FACTOR[r["op"]] * (n - 1) / n
    alg_raw, alg = size / r["raw"] / 1e9, size / r["zerosim"] / 1e9
    cells = [
        n,
        r["op"],
        f"{size / 2**20:.3f}",
        f"{alg_raw:.3f}",
        f"{alg_raw * factor:.3f}",
        f"{alg:.3f}",
        f"{alg * factor:.3f}",
        f"{size / r['ring'] / 1e9 * factor:.3f}",
        f"{r['raw'] / r['zerosim']:.3f}",
        f"{r['raw'] / r['fast']:.3f}",
    ]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--max-mib", type=float, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the rows (times in seconds) to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.max_mib, args.repeats)
        return 0
    mpirun = Path(sys.executable).parent / "mpirun"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    rows = []
    for n in args.ranks:
        out = subprocess.run(
            [
                str(mpirun if mpirun.exists() else "mpirun"),
                "-n",
                str(n),
                sys.executable,
                __file__,
                "--worker",
                "--max-mib",
                str(args.max_mib),
                "--repeats",
                str(args.repeats),
            ],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        rows += [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    print(
        "| N | op | S (MiB) | raw algbw GB/s | raw busbw GB/s | zerosim algbw GB/s | "
        "zerosim busbw GB/s | ring busbw GB/s | ratio zerosim/raw | ratio, check off |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(_row(r))
    print()
    for key, label in (
        ("zerosim", "defaults (ledger on, argument check on)"),
        ("fast", "ledger on, argument check off"),
    ):
        big = [r["raw"] / r[key] for r in rows if r["bytes"] >= 2**20]
        if big:
            print(
                f"from 1 MiB up, {label}: ratio min {min(big):.3f}, median "
                f"{float(np.median(big)):.3f} (target >= 0.95)"
            )
    for n in args.ranks:
        mine = [r for r in rows if r["n"] == n]
        if not mine:
            continue
        small = min(r["bytes"] for r in mine)
        at_small = [r for r in mine if r["bytes"] == small]
        at_mib = [r for r in mine if r["bytes"] >= 2**20]
        for key, label in (("zerosim", "check on"), ("fast", "check off")):
            extra = float(np.median([r[key] - r["raw"] for r in at_small]))
            line = f"N={n}, {label}: fixed cost per call {extra * 1e6:.1f} us (at {small} B)"
            if at_mib:
                raw = min(r["raw"] for r in at_mib if r["bytes"] == min(x["bytes"] for x in at_mib))
                line += (
                    f"; raw takes {raw * 1e6:.0f} us at 1 MiB, so that cost alone caps the "
                    f"ratio there at {raw / (raw + extra):.3f}"
                )
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
