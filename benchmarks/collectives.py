"""zerosim's collectives against raw mpi4py calls on the same buffers, timed two ways.

    python benchmarks/collectives.py [--ranks 2 4] [--max-mib 256] [--repeats 15]

launches ``mpirun -n N`` for each N, times all_gather / reduce_scatter / all_reduce from 4 KiB to
``--max-mib`` MiB (S, the full buffer, as nccl-tests counts it), and prints algbw, busbw and the
ratio raw / zerosim (time_raw / time_zerosim: 1.0 means no overhead). zerosim runs with its
defaults (ledger on, cross-rank argument check on) and with the check off (``validate=False``).

Two timing modes, each sample the slowest rank's time:

* **back-to-back**: a barrier, then enough calls in a row to last about 10 ms, time per call (as
  nccl-tests averages over iterations): what a training step's train of collectives sees;
* **one at a time**: a barrier before each call and the call timed alone, so nothing of one call
  hides in the next (a fixed cost per call, or a cost that overlaps the next call's transfer).

Samples are interleaved (raw, raw again, zerosim, check off, raw + bare check, then the reverse
order on the next repeat), so a change of load on a shared machine hits all five alike; "raw
again" is the same raw call timed as a second variant, an A/A control: its ratio to raw shows what
the timing can resolve on this machine at that moment. "raw + bare check" is the raw call preceded
by the cheapest form of a cross-rank check, in MPI alone: a persistent all-gather of the same
signature size as zerosim's (``Allgather_init`` once, ``Start`` and ``Wait`` per call, no Python
bookkeeping). Its ratio is the ceiling for any call that checks every rank's arguments before the
data moves, however little it does besides. Each cell's ratio is the median over repeats of the
ratio of neighbouring samples, and its times the medians. The ring column is our
explicit ring algorithm over point-to-point messages (back-to-back), for reference. Targets:
ratio ≥ 0.97 from 4 MiB and ≥ 0.95 from 1 MiB, in both modes, check on.

The summary also states the fixed cost zerosim adds to every call (its time minus raw's at the
smallest size, where the transfer is negligible) and the ratio that cost alone allows at 1 MiB.
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
# raw mpi4py, raw again (the A/A control: what the timing resolves), zerosim's defaults,
# zerosim with the check off, raw after a bare check in MPI (the ceiling of any checked call)
VARIANTS = ("raw", "again", "zerosim", "fast", "checked")
COMPARED = VARIANTS[1:]  # each has a paired ratio to raw
MODES = {"": "back-to-back", "_bar": "one at a time"}  # row-key suffix → timing mode
MIB = 2**20


def worker_rows(script: str, n: int, args: list[str]) -> list[dict]:
    """Run ``mpirun -n n python script --worker ARGS`` (the mpirun beside this Python, else the
    first on PATH; one thread per rank) and return the JSON rows its ranks printed."""
    mpirun = Path(sys.executable).parent / "mpirun"
    cmd = [str(mpirun if mpirun.exists() else "mpirun"), "-n", str(n), sys.executable, script]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [*cmd, "--worker", *args], capture_output=True, text=True, env=env, check=True
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def _sizes(max_mib: float) -> list[int]:
    sizes, s = [], 4 * 1024
    while s <= max_mib * MIB:
        sizes.append(s)
        s *= 4
    return sizes


def _cores() -> int:
    """The cores this process may run on (all ranks of a job share them here)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _slowest(comm, seconds: float) -> float:
    """The largest of every rank's ``seconds`` (the collective took as long as its last rank)."""
    from mpi4py import MPI

    value = np.array([seconds])
    comm.Allreduce(MPI.IN_PLACE, value, op=MPI.MAX)
    return float(value[0])


def back_to_back(comm, fn, iters: int) -> float:
    """Time per call of ``iters`` calls in a row after a barrier, on the slowest rank."""
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return _slowest(comm, (time.perf_counter() - t0) / iters)


def one_at_a_time(comm, fn, calls: int) -> float:
    """Median over ``calls`` calls, each timed alone between a barrier and its return."""
    times = []
    for _ in range(calls):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    # per call, the slowest rank's time (one reduction for all calls, outside the timing)
    from mpi4py import MPI

    every = np.array(times)
    comm.Allreduce(MPI.IN_PLACE, every, op=MPI.MAX)
    return float(np.median(every))


def _iters(comm, fn, target_s: float = 0.01) -> int:
    """Calls per back-to-back sample so that one lasts about ``target_s`` (same on every rank)."""
    one = min(back_to_back(comm, fn, 1) for _ in range(3))
    return max(1, min(1000, int(target_s / max(one, 1e-7))))


def _raw_calls(mpi, full, part) -> dict:
    from mpi4py import MPI

    return {
        "all_gather": lambda: mpi.Allgather(part, full),
        "reduce_scatter": lambda: mpi.Reduce_scatter_block(full, part, op=MPI.SUM),
        "all_reduce": lambda: mpi.Allreduce(MPI.IN_PLACE, full, op=MPI.SUM),
    }


def bare_check(mpi, fields: int):
    """The cheapest cross-rank check MPI offers: every rank's ``fields`` int64 gathered by a
    persistent all-gather (set up once; one ``Start`` and ``Wait`` per call), compared by nobody:
    the synchronisation and message a checked call cannot avoid, with no Python around it."""
    from mpi4py import MPI

    mine = np.zeros(fields, dtype=np.int64)
    every = np.zeros(fields * mpi.Get_size(), dtype=np.int64)
    try:
        request = mpi.Allgather_init(mine, every)
    except (AttributeError, NotImplementedError, MPI.Exception):  # MPI < 4.0: a request a call
        return lambda: mpi.Iallgather(mine, every).Wait()

    def check() -> None:
        request.Start()
        request.Wait()

    check.request = request  # freed by the caller before MPI finalizes
    return check


def _zerosim_calls(comm, full, part) -> dict:
    return {
        "all_gather": lambda: comm.all_gather(full, part),
        "reduce_scatter": lambda: comm.reduce_scatter(part, full),
        "all_reduce": lambda: comm.all_reduce(full),
    }


def measure(mpi, calls: dict, iters: int, repeats: int) -> dict:
    """Interleaved samples of every variant in both modes; medians and paired ratios."""
    samples: dict[str, list[float]] = {v + m: [] for v in calls for m in MODES}
    alone = max(1, min(20, iters))  # calls per one-at-a-time sample
    for rep in range(repeats):
        order = list(calls) if rep % 2 == 0 else list(calls)[::-1]
        for variant in order:
            samples[variant].append(back_to_back(mpi, calls[variant], iters))
        for variant in order:
            samples[variant + "_bar"].append(one_at_a_time(mpi, calls[variant], alone))
    row = {key: float(np.median(v)) for key, v in samples.items()}
    for variant in (v for v in COMPARED if v in calls):
        for mode in MODES:
            raw_t, ours_t = np.array(samples["raw" + mode]), np.array(samples[variant + mode])
            pairs = raw_t / ours_t
            row[f"ratio_{variant}{mode}"] = float(np.median(pairs))
            # spread of the per-round ratios (25th, 75th percentile) and the per-call cost
            # over raw as the median paired difference in microseconds: load shifts both
            # samples of a round alike, so the difference is steadier than the ratio
            row[f"spread_{variant}{mode}"] = [float(q) for q in np.percentile(pairs, [25, 75])]
            row[f"over_us_{variant}{mode}"] = float(np.median(ours_t - raw_t)) * 1e6
    return row


def worker(max_mib: float, repeats: int) -> None:
    from mpi4py import MPI

    from zerosim.comm import MPIComm
    from zerosim.comm.agreement import SIGNATURE_FIELDS

    mpi = MPI.COMM_WORLD
    n, rank = mpi.Get_size(), mpi.Get_rank()
    comms = {"zerosim": MPIComm(), "fast": MPIComm(validate=False)}
    check = bare_check(mpi, len(SIGNATURE_FIELDS))
    ring_comm = MPIComm(collectives="ring")
    for size in _sizes(max_mib):
        count = size // 4 // n * n
        full = np.ones(count, dtype=np.float32)
        part = np.ones(count // n, dtype=np.float32)
        raw = _raw_calls(mpi, full, part)
        ours = {name: _zerosim_calls(c, full, part) for name, c in comms.items()}
        ring = _zerosim_calls(ring_comm, full, part)
        for op in OPS:
            calls = {
                "raw": raw[op],
                "again": raw[op],
                "zerosim": ours["zerosim"][op],
                "fast": ours["fast"][op],
                "checked": lambda raw_call=raw[op]: (check(), raw_call()),
            }
            for fn in calls.values():
                fn()  # warm-up
            iters = _iters(mpi, raw[op])
            # bounded: the ledger keeps a record per call; it is reset between cells
            row = measure(mpi, calls, iters, repeats)
            row["ring"] = back_to_back(mpi, ring[op], max(1, iters // 4))
            for c in (*comms.values(), ring_comm):
                c.ledger.reset()
            if rank == 0:
                row.update(n=n, op=op, bytes=count * 4, iters=iters, cores=_cores())
                print(json.dumps(row), flush=True)
    if hasattr(check, "request"):
        check.request.Free()


def _cell(r: dict, key: str) -> str:
    return f"{r[key]:.3f}" if key in r else "-"


def _row(r: dict) -> str:
    n, size = r["n"], r["bytes"]
    factor = FACTOR[r["op"]] * (n - 1) / n
    alg_raw, alg = size / r["raw"] / 1e9, size / r["zerosim"] / 1e9
    cells = [
        n,
        r["op"],
        f"{size / MIB:.3f}",
        f"{alg_raw * factor:.3f}",
        f"{alg * factor:.3f}",
        f"{size / r['ring'] / 1e9 * factor:.3f}",
        f"{r['ratio_zerosim']:.3f}",
        f"{r['ratio_fast']:.3f}",
        f"{r['ratio_again']:.3f}",
        _cell(r, "ratio_checked"),
        f"{r['raw_bar'] * 1e6:.0f}",
        f"{r['ratio_zerosim_bar']:.3f}",
        f"{r['ratio_fast_bar']:.3f}",
        f"{r['ratio_again_bar']:.3f}",
        _cell(r, "ratio_checked_bar"),
    ]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def summary(rows: list[dict]) -> list[str]:
    """The lines under the table: each threshold per N and mode (check on, check off, the A/A
    control and the raw call after a bare check), and the fixed cost per call."""
    lines = []
    for n in sorted({r["n"] for r in rows}):
        cores = min(r.get("cores", n) for r in rows if r["n"] == n)
        if n > cores:
            lines.append(f"N={n} > {cores} cores (oversubscribed: reported, not judged):")
        for mode, label in MODES.items():
            for floor, target in ((MIB, 0.95), (4 * MIB, 0.97)):
                parts = []
                for key, what in (
                    ("zerosim", "check on"),
                    ("fast", "check off"),
                    ("again", "A/A"),
                    ("checked", "raw + bare check"),
                ):
                    got = [
                        r[f"ratio_{key}{mode}"]
                        for r in rows
                        if r["n"] == n and r["bytes"] >= floor and f"ratio_{key}{mode}" in r
                    ]
                    if got:
                        parts.append(f"{what} min {min(got):.3f}, median {np.median(got):.3f}")
                if parts:
                    lines.append(
                        f"N={n}, {label}, from {floor // MIB} MiB (target >= {target}): "
                        + "; ".join(parts)
                    )
    for n in sorted({r["n"] for r in rows}):
        mine = [r for r in rows if r["n"] == n]
        small = min(r["bytes"] for r in mine)
        at_small = [r for r in mine if r["bytes"] == small]
        at_mib = [r for r in mine if r["bytes"] >= MIB]
        for key, label in (("zerosim", "check on"), ("fast", "check off")):
            extra = float(np.median([r[key + "_bar"] - r["raw_bar"] for r in at_small]))
            line = f"N={n}, {label}: fixed cost per call {extra * 1e6:.1f} us (at {small} B)"
            for first in sorted({r["bytes"] for r in at_mib})[:2]:  # 1 MiB and 4 MiB
                raw = min(r["raw_bar"] for r in at_mib if r["bytes"] == first)
                line += (
                    f"; raw takes {raw * 1e6:.0f} us at {first / MIB:.0f} MiB, so that cost "
                    f"alone caps the ratio there at {raw / (raw + extra):.3f}"
                )
            lines.append(line)
    for r in rows:  # each op at 4 MiB: per-round ratios' median and spread, paired cost
        if r["bytes"] != 4 * MIB // 4 // r["n"] * r["n"] * 4 or "spread_zerosim" not in r:
            continue
        for mode, label in MODES.items():
            parts = []
            for key, what in (("zerosim", "check on"), ("fast", "check off"), ("again", "A/A")):
                lo, hi = r[f"spread_{key}{mode}"]
                parts.append(
                    f"{what} {r[f'ratio_{key}{mode}']:.3f} [{lo:.3f}, {hi:.3f}], "
                    f"{r[f'over_us_{key}{mode}']:+.0f} us"
                )
            lines.append(
                f"N={r['n']}, {r['op']} 4 MiB, {label}, ratio median [25th, 75th percentile] "
                "and paired time over raw: " + "; ".join(parts)
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--max-mib", type=float, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", help="also write the rows (times in seconds) to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.max_mib, args.repeats)
        return 0
    rows = []
    for n in args.ranks:
        rows += worker_rows(
            __file__, n, ["--max-mib", str(args.max_mib), "--repeats", str(args.repeats)]
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    print(
        "| N | op | S (MiB) | raw busbw GB/s | zerosim busbw GB/s | ring busbw GB/s | "
        "ratio zerosim/raw | ratio, check off | A/A raw/raw | raw + bare check | "
        "one at a time: raw µs | ratio zerosim/raw | ratio, check off | A/A raw/raw | "
        "raw + bare check |"
    )
    print("|" + "---|" * 15)
    for r in rows:
        print(_row(r))
    print()
    print("\n".join(summary(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
