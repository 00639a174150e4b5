"""The dry run's step time against real runs on this machine: predicted / measured per row.

    python -m benchmarks.dryrun_host [--quick] [--steps 10] [--host HOST.json] [--json PATH]
        [--shapes K] [--ranks 1 2] [--stages 0 3] [--schedules paper] [--dtypes fp32]
        [--models gpt:1,64,8192,128,4 ...] [--metrics LanguageCrossEntropy ...]
    python -m benchmarks.dryrun_host --faults     # the allocator model against ru_minflt

``zerosim calibrate --ranks N`` measures this host (microbenchmarks only, run on N ranks at
once, as a step of N ranks runs) right before each model's rows at each N, so that a machine
whose speed drifts over the grid's minutes is measured close to the steps it predicts; then for
each row
of the grid (GPT from about 1M to about 50M parameters; stages 0-3; the paper's and DeepSpeed's
schedules; fp32 and bf16; micro-batch 4; N = 1 and 2 judged, N = 4 reported, as it oversubscribes
two cores) ``zerosim train --json`` runs under ``mpirun -n N`` and ``zerosim dryrun --cluster
host.json`` predicts its step. Nothing is fitted on a step time.

**What is measured.** ``zerosim train --json`` gives every optimizer step's wall seconds and,
per step, the smallest share of that wall time any rank spent on the CPU (``step_cpu_share``).
A step in which some rank got less than ``CPU_SHARE`` (0.9) of the wall time as CPU time saw
another process take its core: it is dropped, and the table says how many were. "measured" is
the median wall time of the steps kept after the two warm-up steps; a row with none kept is
reported, not judged ("all steps s" is the median of every timed step, dropped ones too, and
"rank 0 CPU s" the median of rank 0's CPU seconds a step: on a loaded machine, at N = 1, the
step the rank would take with its core to itself).

**The target.** Predicted / measured within ±15% for a step of 100 ms or more, ±25% for a
faster one, on every judged row (N = 1 and 2). The table is markdown, with the load average
before each row: judge it on a quiet machine.

**--faults** runs one real NumPy step per configuration in a process of its own and prints
the minor page faults the kernel counted (``ru_minflt``) beside the fresh pages the dry run's
allocator model (``zerosim/dryrun/host.py``) counted for the same step, and zerosim's own
Python calls counted the same way in both.

**--models** replaces the grid's shapes by the given ``--model`` specs; **--metrics** runs
Composer's train metrics in every row, in the real run (``zerosim train --metrics``) and in the
dry run (``zerosim dryrun --metrics``) alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MPIRUN = Path(sys.executable).parent / "mpirun"

# (spec, parameters): layers, hidden, vocabulary, sequence, heads
SHAPES = [
    ("gpt:2,192,256,64,4", "1.0M"),
    ("gpt:4,256,256,128,4", "3.3M"),
    ("gpt:6,512,512,128,8", "19M"),
    ("gpt:7,768,1024,128,12", "51M"),
]
STAGES = (0, 1, 2, 3)
SCHEDULES = ("paper", "deepspeed")
DTYPES = ("fp32", "bf16")
JUDGED_RANKS = (1, 2)
REPORTED_RANKS = (4,)
CPU_SHARE = 0.9  # a step is kept when every rank got this share of its wall time as CPU time
ON_SPEED = 0.10  # … and the probes around it ran within this of the calibration's probe
WARMUP_STEPS = 2  # zerosim train's: the first two steps are left out
SLOW_STEP_S = 0.1
SETTLED = 0.10  # a row is judged when calibrations before and after its group agree this well
TARGETS = {True: 0.15, False: 0.25}  # step ≥ SLOW_STEP_S: ±15%, faster: ±25%


def config(stage: int, schedule: str, dtype: str = "fp32") -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
        "zerosim": {"dtype": "float32", "schedule": schedule},
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _run(cmd: list[str], timeout: float = 1800) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode not in (0, 1):  # 1: train's byte check found no closed form (stage 3)
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr[-2000:]}")
    return proc.stdout


def kept_steps(report: dict, probe_s: float | None = None) -> tuple[list[float], int, int]:
    """(wall seconds of the steps kept, steps dropped for a rank off the CPU, steps dropped off
    speed): after the warm-up, the steps in which every rank got at least ``CPU_SHARE`` of the
    wall time as CPU time and, given the calibration's ``probe_s``, whose probes right before
    and after (``zerosim train --probe``: rank 0's, as calibrate's) are within ``ON_SPEED`` of
    it: the machine ran at the speed it was calibrated at."""
    walls = report["step_wall_s"]
    shares = report["step_cpu_share"]
    probes = report.get("step_probe_s") or [None] * len(walls)
    kept, off_cpu, off_speed = [], 0, 0
    for i in range(WARMUP_STEPS, len(walls)):
        if shares[i] is not None and shares[i] < CPU_SHARE:
            off_cpu += 1
        elif probe_s and not all(
            p is not None and abs(p / probe_s - 1) <= ON_SPEED for p in probes[i - 1 : i + 1]
        ):
            off_speed += 1
        else:
            kept.append(walls[i])
    return kept, off_cpu, off_speed


def _metrics(metrics: list[str] | None) -> list[str]:
    """The ``--metrics`` option for both commands (none when there are no metrics)."""
    return ["--metrics", *metrics] if metrics else []


def measure(
    model: str, ranks: int, cfg: Path, steps: int, probe_s: float | None, metrics=None
) -> dict:
    launch = [str(MPIRUN), "-n", str(ranks), sys.executable, "-m", "zerosim", "train"]
    out = _run([*launch, "--model", model, "--config", str(cfg), "--steps", str(steps), "--json",
                "--probe", *_metrics(metrics)])  # fmt: skip
    report = json.loads(out.strip().splitlines()[-1])
    kept, dropped, off_speed = kept_steps(report, probe_s)
    return {
        "measured_s": statistics.median(kept) if kept else None,
        "kept": len(kept),
        "dropped": dropped,
        "off_speed": off_speed,
        "median_all_s": report["step_s"],
        "cpu_s": report.get("step_cpu_s"),
    }


def predict(model: str, ranks: int, cfg: Path, host: Path, metrics=None) -> dict:
    out = _run([sys.executable, "-m", "zerosim", "dryrun", "--model", model, "--ranks",
                str(ranks), "--config", str(cfg), "--cluster", str(host), "--json",
                *_metrics(metrics)])  # fmt: skip
    return json.loads(out)["time"]


def within(ratio: float, measured_s: float) -> bool:
    """Whether predicted / measured meets the target for a step of ``measured_s``."""
    tolerance = TARGETS[measured_s >= SLOW_STEP_S]
    return 1 - tolerance <= ratio <= 1 + tolerance


def grid(
    quick: bool, shapes: int, only: dict | None = None, models: list[str] | None = None
) -> list[tuple[str, int, int, str, str]]:
    """(model, N, stage, schedule, dtype) rows: every combination, or with ``quick`` eight that
    cover each stage, schedule, dtype and N once or more on the two smallest shapes; ``only``
    keeps the rows whose N, stage, schedule or dtype is among those it names; ``models``
    replaces the shapes."""
    rows = _rows(quick, shapes, models)
    for position, name in enumerate(("ranks", "stages", "schedules", "dtypes"), start=1):
        if only and only.get(name):
            rows = [row for row in rows if row[position] in only[name]]
    return rows


def _rows(quick: bool, shapes: int, models=None) -> list[tuple[str, int, int, str, str]]:
    if quick and not models:
        small, medium = SHAPES[0][0], SHAPES[1][0]
        return [
            (small, 1, 0, "paper", "fp32"),
            (small, 2, 1, "deepspeed", "bf16"),
            (small, 2, 2, "paper", "fp32"),
            (small, 1, 3, "deepspeed", "fp32"),
            (medium, 1, 2, "deepspeed", "bf16"),
            (medium, 1, 3, "paper", "fp32"),
            (medium, 2, 3, "deepspeed", "fp32"),
            (medium, 4, 2, "paper", "fp32"),
        ]
    return [
        (model, n, stage, schedule, dtype)
        for model in models or [spec for spec, _ in SHAPES[:shapes]]
        for n in (*JUDGED_RANKS, *REPORTED_RANKS)
        for stage in STAGES
        for schedule in SCHEDULES
        for dtype in DTYPES
    ]


HEADER = (
    "| model | N | stage | schedule | dtype | measured s | predicted s | pred/meas | target "
    "| within | steps kept | dropped | off speed | all steps s | rank 0 CPU s | load |"
)


def row_line(r: dict) -> str:
    measured = "-" if r["measured_s"] is None else f"{r['measured_s']:.4f}"
    ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
    verdict = {True: "yes", False: "no", None: "not judged"}[r["within"]]
    return (
        f"| {r['model']} | {r['ranks']} | {r['stage']} | {r['schedule']} | {r['dtype']} | "
        f"{measured} | {r['predicted_s']:.4f} | {ratio} | ±{r['target']:.0%} | {verdict} | "
        f"{r['kept']} | {r['dropped']} | {r.get('off_speed', 0)} | {r['median_all_s']:.4f} | "
        f"{r['cpu_s'] or 0:.4f} | "
        f"{r['load']:.1f} |"
    )


def run_row(model: str, n: int, stage: int, schedule: str, dtype: str, args, tmp, host) -> dict:
    cfg = tmp / f"stage{stage}_{schedule}_{dtype}.json"
    cfg.write_text(json.dumps(config(stage, schedule, dtype)))
    load = os.getloadavg()[0]
    real = measure(model, n, cfg, args.steps, probe(host), args.metrics)
    dry = predict(model, n, cfg, host, args.metrics)
    measured = real["measured_s"]
    ratio = None if measured is None else dry["step_s"] / measured
    judged = n in JUDGED_RANKS and ratio is not None
    return {
        "kind": "row", "model": model, "ranks": n, "stage": stage, "schedule": schedule,
        "dtype": dtype, "metrics": args.metrics or [], **real, "predicted_s": dry["step_s"],
        "compute_s": dry["compute_s"], "comm_s": dry["comm_s"], "ratio": ratio, "load": load,
        "cold_huge_pages": dry.get("host", {}).get("cold_huge_pages"),
        "target": TARGETS[(measured or dry["step_s"]) >= SLOW_STEP_S],
        "within": within(ratio, measured) if judged else None,
    }  # fmt: skip


def probe(host: Path) -> float | None:
    """The calibration's ``speed_probe`` (``measurements.probe_s``; None in an older file)."""
    return json.loads(host.read_text()).get("measurements", {}).get("probe_s")


def settle(rows: list[dict], before: Path, tmp: Path, metrics=None) -> None:
    """Calibrate again after a group of rows (one model at one N) and predict each of its rows
    from that calibration too: this machine's speed drifts over minutes (the same
    microbenchmarks have moved by half in half an hour), so a row whose two predictions differ
    by more than ``SETTLED`` ran while the machine changed under it. It is reported with its
    drift, not judged, as a row whose steps were all dropped."""
    last = rows[-1]
    group = [r for r in rows if (r["model"], r["ranks"]) == (last["model"], last["ranks"])]
    after = before.with_name(before.stem + "-after.json")
    calibrate(after, last["ranks"])
    for r in group:
        cfg = tmp / f"stage{r['stage']}_{r['schedule']}_{r['dtype']}.json"
        r["predicted_after_s"] = predict(r["model"], r["ranks"], cfg, after, metrics)["step_s"]
        r["drift"] = r["predicted_after_s"] / r["predicted_s"] - 1
        if r["within"] is not None and abs(r["drift"]) > SETTLED:
            r["within"], r["unsettled"] = None, True
    drifts = [r["drift"] for r in group]
    unsettled = [
        f"stage {r['stage']} {r['schedule']} {r['dtype']}" for r in group if r.get("unsettled")
    ]
    print(
        f"calibrated again after {last['model']} at N = {last['ranks']}: its predictions moved by "
        f"{min(drifts):+.0%} to {max(drifts):+.0%}; not judged (drift over ±{SETTLED:.0%}): "
        f"{', '.join(unsettled) or 'none'}",
        flush=True,
    )


def summary(rows: list[dict]) -> str:
    judged = [r for r in rows if r["within"] is not None]
    inside = sum(r["within"] for r in judged)
    unsettled = sum(bool(r.get("unsettled")) for r in rows)
    dropped = sum(r["dropped"] for r in rows)
    off_speed = sum(r.get("off_speed", 0) for r in rows)
    steps = dropped + off_speed + sum(r["kept"] for r in rows)
    loads = [r["load"] for r in rows]
    return (
        f"{inside} of {len(judged)} judged rows within target; {unsettled} rows not judged "
        f"(the machine drifted, ``settle``); of {steps} timed steps {dropped} dropped (a rank "
        f"below {CPU_SHARE:.0%} CPU) and {off_speed} off speed (a probe beside them off the "
        f"calibration's by more than {ON_SPEED:.0%}); load {min(loads):.1f}-{max(loads):.1f}"
    )


def calibrate(host: Path, ranks: int) -> None:
    """``zerosim calibrate --ranks ranks``: the rates of ``ranks`` ranks running side by side."""
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "zerosim", "calibrate", "--out", str(host), "--ranks", str(ranks)]
    print(_run(cmd).strip(), f"({time.perf_counter() - start:.0f} s)", flush=True)


def faults_check(tmp: Path) -> None:
    """Print the allocator model's fresh pages and the dry run's Python calls beside a real
    NumPy step's minor faults and calls (one process per configuration, N = 1)."""
    from zerosim.dryrun.run import recipe, run_world  # noqa: PLC0415

    print("| model | stage | schedule | dtype | real minor faults | model 4 KiB + 2 MiB faults "
          "| real calls | dry-run calls |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for model, stage, schedule, dtype in [
        (SHAPES[0][0], 2, "paper", "fp32"), (SHAPES[0][0], 3, "deepspeed", "fp32"),
        (SHAPES[1][0], 0, "paper", "fp32"), (SHAPES[1][0], 2, "paper", "fp32"),
        (SHAPES[1][0], 3, "paper", "bf16"), (SHAPES[2][0], 2, "deepspeed", "fp32"),
    ]:  # fmt: skip
        cfg = tmp / f"faults_{stage}_{schedule}_{dtype}.json"
        cfg.write_text(json.dumps(config(stage, schedule, dtype)))
        out = _run([str(MPIRUN), "-n", "1", sys.executable, "-m", "benchmarks.dryrun_host",
                    "--counts-worker", model, str(cfg)])  # fmt: skip
        calls, faults = (int(v) for v in out.split("COUNTS")[1].split()[:2])
        runs, _ = run_world(recipe(model), 1, config(stage, schedule, dtype), steps=3,
                            backend="numpy", op_events=True)  # fmt: skip
        events = runs[0][1].events
        small = sum(v[0] for k, v in events if k == "faults")
        huge = sum(v[1] for k, v in events if k == "faults")
        dry_calls = sum(v for k, v in events if k == "python")
        print(f"| {model} | {stage} | {schedule} | {dtype} | {faults} | {small} + {huge} | "
              f"{calls} | {dry_calls} |", flush=True)  # fmt: skip


def counts_worker(model: str, cfg_path: str) -> None:
    """One real NumPy run of three steps; the last one's calls and minor faults, printed."""
    from zerosim.dryrun.host import real_step_counts  # noqa: PLC0415

    calls, faults = real_step_counts(model, json.loads(Path(cfg_path).read_text()))
    print(f"COUNTS {calls} {faults}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="eight rows of the two smallest shapes")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per measured run")
    p.add_argument("--host", help="a calibrated host file to use instead of calibrating")
    p.add_argument("--json", help="write the rows here too")
    p.add_argument("--shapes", type=int, default=len(SHAPES), help="the first this many shapes")
    p.add_argument("--faults", action="store_true", help="the allocator model against ru_minflt")
    p.add_argument("--ranks", type=int, nargs="+", help="only these N")
    p.add_argument("--stages", type=int, nargs="+", help="only these stages")
    p.add_argument("--schedules", nargs="+", choices=SCHEDULES, help="only these schedules")
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, help="only these dtypes")
    p.add_argument("--models", nargs="+", metavar="SPEC", help="these --model specs, not SHAPES")
    p.add_argument(
        "--metrics", nargs="+", metavar="NAME", help="train metrics in every row (both commands)"
    )
    p.add_argument("--counts-worker", nargs=2, metavar=("MODEL", "CONFIG"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.counts_worker:
        counts_worker(*args.counts_worker)
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="dryrun_host_"))
    if args.faults:
        faults_check(tmp)
        return 0
    print(HEADER)
    print("|" + "---|" * HEADER.count(" | ") + "---|")
    rows, hosts = [], {}
    only = {k: getattr(args, k) for k in ("ranks", "stages", "schedules", "dtypes")}
    for row in grid(args.quick, args.shapes, only, args.models):
        model, n = row[:2]
        if (model, n) not in hosts:  # calibrated right before each model's rows at each N
            if rows and not args.host:
                settle(rows, hosts[rows[-1]["model"], rows[-1]["ranks"]], tmp, args.metrics)
            hosts[model, n] = Path(args.host) if args.host else tmp / f"host-{len(hosts)}.json"
            if not args.host:
                calibrate(hosts[model, n], n)
        rows.append(run_row(*row, args, tmp, hosts[model, n]))
        print(row_line(rows[-1]), flush=True)
    if rows and not args.host:
        settle(rows, hosts[rows[-1]["model"], rows[-1]["ranks"]], tmp, args.metrics)
    print(f"\n{summary(rows)}")
    if args.json:  # the rows, then each calibration as a row of its own
        host_rows = [
            {"kind": "host", "model": model, "ranks": n, **json.loads(h.read_text())}
            for (model, n), h in hosts.items()
        ]
        Path(args.json).write_text(json.dumps([*rows, *host_rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
