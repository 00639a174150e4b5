"""Every benchmark in one run: ``python -m benchmarks [--quick] [--out docs/benchmarks.md]``.

Runs the collectives, optimizer-step, model-step, training-step, scaling, allocation, zero.Init,
large-GPT, dry-run and long-run scripts one after the other (each compares zerosim with a
baseline measured in the same run, or with published figures: raw mpi4py, NumPy's copy and
matmul rates, PyTorch, DeepSpeed, the memory formulas, the dry run's formulas and published
training runs, its own first steps), and writes their tables, with the machine, the versions
and the date, to a Markdown file. Each script also writes its rows as JSON (``--json``, to a
temporary folder); ``benchmarks/figures.py`` turns them into ``figures/bench_<module>.png``
beside the Markdown file, embedded under each section. ``--quick`` uses small sizes (a couple
of minutes) to check that everything runs. Then it writes docs/deepspeed_parity.md
(``benchmarks/deepspeed_parity.py``: zerosim against DeepSpeed, case by case).

``--only MODULE …`` runs those benchmarks and replaces their sections of an existing Markdown
file, keeping the others and their lines of the targets table as they were measured (each
re-measured section states its own date and load).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import targets  # noqa: E402  (after the path set-up above)
from benchmarks.figures import make_figure  # noqa: E402

HEADER = 3  # lines of docs/benchmarks.md before the targets table
# (title, module, full-size arguments, quick arguments, what the ratio means and its target)
SUITE = [
    (
        "Collectives",
        "collectives",
        ["--max-mib", "64", "--repeats", "7"],
        ["--max-mib", "1", "--repeats", "3"],
        "zerosim's all_gather / reduce_scatter / all_reduce against raw mpi4py calls on the same "
        "buffers (ratio = raw time / zerosim time), beside raw against raw (A/A) and the raw "
        "call after a bare check in MPI alone (the ceiling of any call that checks every rank's "
        "arguments first). Targets: ≥ 0.95 from 1 MiB and ≥ 0.97 from 4 MiB in both timing "
        "modes, check on, judged where the ranks do not outnumber the cores.",
    ),
    (
        "Optimizer step",
        "optimizer_step",
        ["--numel", str(2**24)],
        ["--numel", str(2**20), "--repeats", "3"],
        "Adam, AdamW and SGD-momentum on one float32 shard, one thread each: effective bandwidth "
        "against the STREAM Copy bandwidth and against torch.optim (single-tensor, foreach, "
        "fused). Targets: Adam ≥ 0.7 of copy; every optimizer at or under torch fused's time.",
    ),
    (
        "Model step",
        "model_step",
        [],
        ["--n-layer", "2", "--n-head", "4", "--n-embd", "64", "--block-size", "32", "--steps", "2"],
        "GPT forward+backward FLOP/s against NumPy's matmul rate and the same model in torch. "
        "Target ≥ 0.5 of the matmul rate.",
    ),
    (
        "Training step",
        "training_step",
        ["--repeats", "2"],
        ["--ranks", "2", "--steps", "4", "--model", "mlp", "--repeats", "1"],
        "zerosim stages 0-3 against PyTorch DDP / ZeroRedundancyOptimizer / FSDP2 on gloo and "
        "against DeepSpeed 0.19 stages 0-3 on CPU/gloo (launched by torchrun, its CPU FusedAdam), "
        "same model, batch and config, per-step time and peak RSS per rank, stage 3's exposed "
        "communication with and without prefetch, and its model-state memory per rank against "
        "1/N. Target: ratio ≤ 1 against every peer.",
    ),
    (
        "Scaling",
        "scaling",
        [],
        ["--quick"],
        "Model-state memory and step time per rank for N = 1, 2, 4, 8 and MLPs of Ψ, 10Ψ and "
        "100Ψ parameters, ZeRO stages 1-3, float32 Adam: the memory against the formulas of "
        "zerosim.analysis.memory (target: equal to the byte), and the step time against a "
        "least-squares line in Ψ (target: linear growth, R² near 1 at full size).",
    ),
    (
        "Allocations",
        "allocations",
        [],
        ["--stages", "2", "--dtypes", "fp32", "--steps", "1"],
        "Bytes allocated at once during a steady-state training step, per rank (tracemalloc), "
        "against the model's parameter bytes Ψ·b. Target: no model-sized buffer allocated per "
        "step (gradient buckets come from a pool filled in the first step).",
    ),
    (
        "A model larger than a rank: zero.Init under a memory cap",
        "zero_init_cap",
        [],
        ["--ranks", "2", "--layers", "4", "--width", "256", "--margin-mib", "64", "--steps", "1"],
        "8 ranks, each capped by RLIMIT_DATA at start-up plus an allowance smaller than the "
        "model's fp32 weights: built outside zero.Init it fails on every rank; inside, it trains "
        "at stage 3. Per rank, the measured peak against 16Ψ/N plus buffers. Target: ratio "
        "near 1, every rank under its cap.",
    ),
    (
        "A GPT of 124M parameters at stage 3 on 8 ranks",
        "large_gpt",
        ["--steps", "2", "--warmup", "1"],
        ["--ranks", "2", "--n-layer", "2", "--n-head", "4", "--n-embd", "128", "--vocab", "1024"]
        + ["--seq", "32", "--steps", "1", "--warmup", "1"],
        "GPT-2 small's shape (12 layers, 768 wide, vocabulary 50304, tied embedding), built "
        "inside zero.Init and trained at stage 3 with fp32 Adam by 8 ranks on this machine's "
        "cores: time per step, tokens per second, and per rank the model states and buffers "
        "that memory_report() counts against 16Ψ/N, beside the measured peak RSS.",
    ),
    (
        "The dry run: GPT-3 175B on 1,024 and 4,096 virtual ranks, and published runs predicted",
        "dryrun",
        ["--ranks", "1024", "4096"],
        ["--model", "gpt3-1.3b", "--ranks", "64", "--skip-predictions"],
        "The engine run shape-only over a virtual world (docs/dryrun.md), each world size in a "
        "fresh process: its wall time and peak host memory on this machine, each class of "
        "rank's model states and bytes per step against the ZeRO paper's formulas and its "
        "matmul FLOPs against Narayanan et al.'s eq. 3. Then the time model: Narayanan et al.'s "
        "six ZeRO-3 rows (SC21, Table 2) on zerosim/dryrun/clusters/selene.json, and Wang et "
        "al.'s ZeRO-3 and ZeRO++ figures on 384 V100s (the ZeRO++ blog's Figures 6-8) on "
        "zerosim/dryrun/clusters/zeropp_v100.json: cited physical rates and one software factor "
        "per cluster, fitted on one named row (benchmarks/dryrun_papers.py); every other row a "
        "prediction beside its published figure. Targets: 1,024 ranks under 60 s and 4 GB, "
        "4,096 under 5 minutes; states and bytes equal to the formulas, FLOPs within 2%; the "
        "fitted rows within 10%.",
    ),
    (
        "The dry run's step time against real runs on this machine",
        "dryrun_host",
        ["--ranks", "1", "2", "--dtypes", "fp32"],
        ["--quick"],
        "zerosim calibrate measures this machine with microbenchmarks only, on N ranks at once "
        "under mpirun -n N (matrix products by arithmetic intensity, element-wise calls by size "
        "and dtype on cold operands, zerosim's own Python calls, fresh pages, its collectives), "
        "right before each model's rows at each N; zerosim dryrun --cluster host.json then "
        "predicts the step that zerosim train measures under mpirun -n N, for GPTs of 1M-51M "
        "parameters, stages 0-3, both schedules, fp32, N = 1 and 2 (the whole grid, bf16 and "
        "N = 4 too, is `python benchmarks/dryrun_host.py`). Nothing is fitted on a step time. "
        "A step in which some rank got less than 0.9 of the wall time as CPU time is dropped "
        "and counted, and so is one beside which a fixed sample of a step's work (zerosim "
        "train --probe) ran more than 10% off its calibrated time; a row whose prediction "
        "from a second calibration, taken after its model's rows, differs by more than 10% "
        "ran while the machine's speed drifted and is reported, not judged. Target: "
        "predicted / measured within ±15% where a step takes "
        "100 ms or more, ±25% where it is faster, on every row.",
    ),
    (
        "A long run: a step's cost from the first step to the 1,400th",
        "long_run",
        [],
        ["--ranks", "2", "--steps", "200", "--window", "50"],
        "The loop of zerosim train (its default config, ZeRO stage 3 on the MLP), N = 4, 1,400 "
        "steps, with the four byte queries it makes per step, timed step by step: the median "
        "of the last 100 steps against the first 100 (the baseline), paired against a ledger "
        "of at most 2,000 records whose cost cannot grow, and beside the same counts from a "
        "scan of the kept records (how the ledger answered before it kept running totals). "
        "The three engines take a step each in turn, so the machine's load, which on this "
        "shared machine moves every step time alike (the bounded ledger's plain ratio shows by "
        "how much), cancels in the paired ratio. Target: ≤ 1.1.",
    ),
]


def machine() -> str:
    import numpy as np

    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = "not installed"
    from mpi4py import MPI

    cpu = platform.processor() or platform.machine()
    return (
        f"{platform.platform()}, {os.cpu_count()} logical CPUs ({cpu}), Python "
        f"{platform.python_version()}, NumPy {np.__version__}, PyTorch {torch_version}, "
        f"{MPI.Get_library_version().splitlines()[0].strip()}"
    )


def sections(lines: list[str]) -> dict[str, list[str]]:
    """An existing benchmarks page split at its ``## `` headings: {title: the section's lines,
    the heading and the blank line before it included}."""
    found: dict[str, list[str]] = {}
    title = None
    for line in lines:
        if line.startswith("## "):
            title = line[3:]
            found[title] = [""]
        if title is not None:
            found[title].append(line)
    for part in found.values():
        while part[-1] == "":
            part.pop()
    return found


def run_one(module: str, argv: list[str]) -> tuple[str, float]:
    """Run a benchmark's ``main(argv)`` in this process, capturing what it prints."""
    import importlib

    mod = importlib.import_module(f"benchmarks.{module}")
    out = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out):
        code = mod.main(argv)
    if code:
        raise RuntimeError(f"benchmarks/{module}.py exited with {code}:\n{out.getvalue()}")
    return out.getvalue(), time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, to check it runs")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    parser.add_argument(
        "--only",
        nargs="+",
        help="module names to run, replacing their sections of --out (default: all, a new page)",
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    figures = out.parent / "figures"
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    kept = out.read_text().splitlines() if args.only and out.is_file() else []  # --only: update
    header = kept[:HEADER] or [  # HEADER lines; the targets table goes after them
        "# Benchmarks",
        "",
        f"Measured {now} on {machine()}; load average at start {load:.2f}. "
        "Every figure is compared with a baseline measured in the same run. Regenerate with "
        "`python -m benchmarks` (or `zerosim bench`).",
    ]
    done = sections(kept)  # {title: section lines}: the kept ones, replaced as each runs
    rows: dict[str, list[dict]] = {}
    for title, module, full, quick, about in SUITE:
        if args.only and module not in args.only:
            continue
        started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        when = f"; measured {started}, load average {os.getloadavg()[0]:.2f}" if kept else ""
        with tempfile.TemporaryDirectory(prefix="zerosim-bench-") as json_dir:
            json_path = Path(json_dir) / f"{module}.json"
            text, seconds = run_one(
                module, [*(quick if args.quick else full), "--json", str(json_path)]
            )
            png = make_figure(module, json_path, figures)  # None when no rows were written
            if json_path.is_file():
                rows[module] = json.loads(json_path.read_text())
        print(f"{title}: {seconds:.0f} s", file=sys.stderr)
        done[title] = [
            "",
            f"## {title}",
            "",
            about,
            "",
            f"`python benchmarks/{module}.py {' '.join(quick if args.quick else full)}` "
            f"({seconds:.0f} s{when}):",
            "",
            "```",
            text.rstrip(),
            "```",
        ]
        if png is not None:
            done[title] += ["", f"![{title}]({png.relative_to(out.parent).as_posix()})"]
        head = ["", "## Targets", "", *targets.table(rows, kept)]
        body = [line for name, *_ in SUITE for line in done.get(name, [])]
        out.write_text("\n".join(header + head + body) + "\n")  # after each benchmark
    print(f"wrote {out} and its figures in {figures}", file=sys.stderr)
    if not args.only or "deepspeed_parity" in args.only:  # its own page: docs/deepspeed_parity.md
        ranks = ["2"] if args.quick else ["2", "3"]
        parity = out.parent / "deepspeed_parity.md"
        text, seconds = run_one("deepspeed_parity", ["--ranks", *ranks, "--out", str(parity)])
        print(f"DeepSpeed parity: {seconds:.0f} s, wrote {parity}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
