"""Does a step late in a long run cost what a step early in it costs? ``zerosim train``'s loop,
timed step by step.

    python benchmarks/long_run.py [--ranks 4] [--steps 1400] [--window 100] [--model mlp|gpt]

launches ``mpirun -n N`` and runs on every rank the loop of ``zerosim train`` (``cli/train.py``,
its default config: ZeRO stage 3, AdamW, warm-up schedule): forward, backward, step, then the
bytes each phase sent in the step just taken, four ledger queries. Three engines of the same job,
from the same weights and batches, take a step each in turn, so that a change in the machine's
load hits all three alike; they differ only in how those bytes are asked for:

* ``totals``: as ``zerosim train`` asks, ``ledger.bytes_sent(phase=…, step=…)``, answered from the
  ledger's running totals, the ledger keeping its default 50,000 records and more;
* ``bounded``: the same, from a ledger that keeps at most 2,000 records (the control: its cost
  cannot grow with the run whatever the queries do);
* ``scan``: the same four counts summed over ``ledger.select(phase=…, step=…)``, a scan of every
  kept record, which is how the ledger answered them before it kept running totals.

Rank 0 times every step. Printed per engine: the median step time over the first ``--window``
steps (the baseline) and over the last ``--window``, their ratio (last / first), the same ratio
paired against the control (each step's time over the control's step taken just before it: the
load of the moment cancels, which on a shared machine moves the plain ratio by tens of per cent
either way), and the records kept at the end. Target: paired ratio ≤ 1.1 for ``totals``, the cost
of a step not depending on how many steps came before.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# how the bytes of a step are asked for: ledger.bytes_sent (running totals), the same from a
# ledger that keeps at most BOUNDED_KEEP records (the control), a sum over ledger.select (a scan)
WAYS = ("bounded", "totals", "scan")
BOUNDED_KEEP = 1_000  # records kept one by one, up to twice as many between folds


def sent_in_step(ledger: object, step: int, way: str) -> dict[str, int]:
    """Bytes each phase of ``zerosim train`` sent in ``step``, asked ``way``."""
    from zerosim.cli.train import PHASES

    if way != "scan":
        return {p: ledger.bytes_sent(phase=p, step=step) for p in PHASES}
    return {p: sum(r.bytes_sent for r in ledger.select(phase=p, step=step)) for p in PHASES}


def worker(steps: int, window: int, model: str) -> None:
    """On every rank: two engines of ``zerosim train``'s default config, each with a ledger of
    its own, trained ``steps`` steps, a step of each in turn; rank 0 prints one JSON row per way
    of asking with every step's time."""
    from mpi4py import MPI

    from zerosim.cli.train import DEFAULT_CONFIG
    from zerosim.comm import MPIComm
    from zerosim.engine import initialize
    from zerosim.report import workloads

    runs = {}
    for way in WAYS:
        comm = MPIComm(MPI.COMM_WORLD.Dup())  # its own ledger
        net, data = workloads.build(model, seed=0)
        engine, _, loader, _ = initialize(net, DEFAULT_CONFIG, comm=comm, training_data=data)
        if way == "bounded":
            comm.ledger.keep = BOUNDED_KEEP
        runs[way] = {"way": way, "comm": comm, "engine": engine, "loader": loader}
        runs[way].update(batches=iter(loader), times=[], sent=[])
    for _ in range(steps):
        for run in runs.values():  # one step of each in turn: the same load for all
            comm, engine = run["comm"], run["engine"]
            MPI.COMM_WORLD.Barrier()  # every rank starts the step together: no rank's wait
            t0 = time.perf_counter()  # for another's previous step is counted in this one
            try:
                x, y = next(run["batches"])
            except StopIteration:
                run["batches"] = iter(run["loader"])
                x, y = next(run["batches"])
            comm.ledger.step = engine.global_steps
            engine.backward(engine(x, y))
            engine.step()
            run["sent"].append(sent_in_step(comm.ledger, engine.global_steps - 1, run["way"]))
            run["times"].append(time.perf_counter() - t0)
    if MPI.COMM_WORLD.Get_rank() != 0:
        return
    control = runs["bounded"]["times"]
    for way, run in runs.items():
        comm, times = run["comm"], run["times"]
        early, late = statistics.median(times[:window]), statistics.median(times[-window:])
        row = {
            "way": way,
            "n": comm.size,
            "model": model,
            "steps": steps,
            "window": window,
            "first_ms": early * 1e3,
            "last_ms": late * 1e3,
            "ratio": late / early,
            "paired_ratio": _paired_growth(times, control, window),
            "records_kept": len(comm.ledger.records),
            # every way counts the same bytes, step by step
            "same_bytes": run["sent"] == runs["totals"]["sent"],
            "step_ms": [t * 1e3 for t in times],
        }
        print(json.dumps(row), flush=True)


def _paired_growth(times: list[float], control: list[float], window: int) -> float:
    """How much a step grew against the control's step taken just before it: the median of
    ``times[i] / control[i]`` over the last ``window`` steps over the same median over the first
    ``window``. The load of the moment is in both times of a pair, and cancels."""
    pairs = [t / c for t, c in zip(times, control, strict=True)]
    return statistics.median(pairs[-window:]) / statistics.median(pairs[:window])


def worker_rows(n: int, args: list[str]) -> list[dict]:
    """Run ``mpirun -n n python benchmarks/long_run.py --worker ARGS`` (the mpirun beside this
    Python, else the first on PATH; one thread per rank) and return the rows rank 0 printed."""
    mpirun = Path(sys.executable).parent / "mpirun"
    cmd = [str(mpirun if mpirun.exists() else "mpirun"), "-n", str(n), sys.executable, __file__]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [*cmd, "--worker", *args], capture_output=True, text=True, env=env, check=True
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1400)
    parser.add_argument("--window", type=int, default=100)
    parser.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    parser.add_argument("--json", help="also write the rows (times in ms) to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 1 <= args.window <= args.steps // 2:
        parser.error(
            f"--window must be from 1 to half of --steps ({args.steps}), got {args.window}"
        )
    shape = ["--steps", str(args.steps), "--window", str(args.window), "--model", args.model]
    if args.worker:
        worker(args.steps, args.window, args.model)
        return 0
    rows = worker_rows(args.ranks, shape)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    print(
        f"| bytes asked for | N | model | steps | first {args.window} steps: median ms | "
        f"last {args.window}: median ms | ratio last / first | the same, paired against "
        "bounded | records kept |"
    )
    print("|" + "---|" * 9)
    names = {
        "totals": "bytes_sent() (running totals)",
        "bounded": "bytes_sent(), ledger of ≤ 2,000 records",
        "scan": "sum over select() (a scan)",
    }
    for r in rows:
        print(
            f"| {names[r['way']]} | {r['n']} | {r['model']} | {r['steps']} | {r['first_ms']:.2f} "
            f"| {r['last_ms']:.2f} | {r['ratio']:.3f} | {r['paired_ratio']:.3f} | "
            f"{r['records_kept']:,} |"
        )
    same = all(r["same_bytes"] for r in rows)
    print(f"\nthe three counted the same bytes in every step: {'yes' if same else 'NO'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
