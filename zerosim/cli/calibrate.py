"""``zerosim calibrate``: measure this machine and write a cluster file for ``zerosim dryrun``.

    zerosim calibrate --out host.json [--ranks N] [--quick] [--json]

Microbenchmarks only (``zerosim/dryrun/calibrate.py``), never a training step: matrix products,
element-wise calls, a call's fixed cost, then zerosim's collectives. Every one runs under
``mpirun -n N`` (launched here, N = 1 by default), the compute benchmarks on all N ranks at once,
as a step of N ranks runs them. ``zerosim dryrun --cluster host.json`` reads the file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from zerosim.cli.arguments import int_at_least, refuse
from zerosim.comm import world_size_from_env

# seconds each measurement repeats for: full, and --quick (the whole run under 20 s)
BUDGET_S = {False: 0.2, True: 0.02}


def add_subcommand(sub: Any) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure this machine (microbenchmarks only) and write a cluster file for dryrun",
        description="Matrix products, element-wise bandwidth, a call's fixed cost, zerosim's "
        "own Python calls, a fresh page's first touch and zerosim's collectives on N ranks, "
        "written as a cluster file (docs/dryrun.md) that zerosim dryrun "
        "--cluster reads. Run it without mpirun: it launches mpirun -n N itself.",
    )
    p.add_argument("--out", required=True, metavar="HOST.json", help="the cluster file to write")
    p.add_argument(
        "--ranks",
        type=int_at_least(1),
        default=1,
        metavar="N",
        help="ranks of the runs to predict: every benchmark runs on N ranks at once under "
        "mpirun -n N (default 1: a collective on one rank, no others)",
    )
    p.add_argument("--quick", action="store_true", help="small grids and budgets (seconds)")
    p.add_argument("--json", action="store_true", help="print the written file's contents")
    p.add_argument("--ranks-worker", metavar="FILE", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from zerosim.dryrun import calibrate

    if args.ranks_worker:  # under mpirun, launched by the command below
        return _ranks_worker(args)
    if world_size_from_env() > 1:
        return refuse("calibrate", "run it without mpirun: --ranks N launches mpirun -n N itself")
    try:
        rates, collectives = _launch_ranks(args.ranks, args.quick)
    except (OSError, RuntimeError) as err:
        return refuse("calibrate", str(err))
    spec = calibrate.cluster_file(
        args.ranks,
        rates["matmul"],
        rates["elementwise"],
        rates["op_overhead_s"],
        collectives,
        rates["host"],
    )
    Path(args.out).write_text(json.dumps(spec, indent=1) + "\n")
    if args.json:
        print(json.dumps(spec))
    else:
        print(
            f"wrote {args.out}: matmul {spec['device_flops'] / 1e9:.1f} GFLOP/s, element-wise "
            f"{spec['memory_bandwidth'] / 1e9:.1f} GB/s, {spec['op_overhead_s'] * 1e6:.2f} µs a "
            f"call, collectives α {spec['intra_latency'] * 1e6:.1f} µs, "
            f"{spec['intra_bandwidth'] / 1e9:.2f} GB/s on {args.ranks} rank(s); "
            f"{spec['call_overhead_s'] * 1e9:.0f} ns a Python call, "
            f"{spec['page_fault_s'] * 1e6:.2f} µs a fresh page{_taken_back(spec)}"
        )
    return 0


def _taken_back(spec: dict) -> str:
    """What the summary line says of huge pages the machine takes back, where it does."""
    if "reclaim_after_s" not in spec:
        return ""
    return (
        f", {spec['cold_hugepage_fault_s'] * 1e3:.2f} ms a 2 MiB page taken back by the machine "
        f"{spec['reclaim_after_s']:.2f} s after it was freed"
    )


def _mpirun() -> str:
    """The mpirun next to this Python (the mpich wheel's), else the first on PATH."""
    here = Path(sys.executable).parent
    found = shutil.which("mpirun", path=str(here)) or shutil.which("mpirun")
    if found is None:
        raise RuntimeError(
            "calibrate runs its benchmarks under mpirun -n N (N = 1 too): no mpirun next to "
            "this Python or on PATH"
        )
    return found


def _launch_ranks(ranks: int, quick: bool) -> tuple[dict[str, Any], list]:
    """Run every benchmark under ``mpirun -n ranks``: rank 0's rates (measured while every rank
    runs the same benchmark, ``calibrate.side_by_side``) and its collectives' rows."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ranks.json"
        cmd = [_mpirun(), "-n", str(ranks), sys.executable, "-m", "zerosim", "calibrate"]
        cmd += ["--out", os.devnull, "--ranks-worker", str(out)]
        cmd += ["--quick"] if quick else []
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(
                f"mpirun -n {ranks} for the benchmarks failed ({proc.returncode}): "
                f"{proc.stderr.strip()[-500:]}"
            )
        found = json.loads(out.read_text())
        found["rates"]["host"]["one_rank_collective_s"] = found["one_rank_collective_s"]
        return found["rates"], found["collectives"]


def _ranks_worker(args: argparse.Namespace) -> int:
    """One rank of ``_launch_ranks``: the compute benchmarks side by side with the other ranks,
    then the collectives; rank 0 writes what it measured."""
    from zerosim.comm import MPIComm, default_comm
    from zerosim.dryrun import calibrate

    comm = MPIComm()
    budget = BUDGET_S[args.quick]
    with calibrate.side_by_side(comm):
        rates = calibrate.measure_compute(budget, args.quick)
    sizes = calibrate.COLLECTIVE_SIZES[::2] if args.quick else None
    collectives = calibrate.measure_collectives(comm, budget, sizes) if comm.size > 1 else []
    # a step's one-rank groups: split from the MPI world at N > 1; at N = 1 zerosim train runs
    # on a one-rank LocalComm (``default_comm``), whose collectives skip MPI
    solo = comm if comm.size > 1 else default_comm()
    one_rank = calibrate.measure_one_rank_collective(solo, budget)
    if comm.rank == 0:
        found = {"rates": rates, "collectives": collectives, "one_rank_collective_s": one_rank}
        Path(args.ranks_worker).write_text(json.dumps(found))
    return 0
