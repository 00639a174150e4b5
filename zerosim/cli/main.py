"""The ``zerosim`` command line: ``zerosim train`` (the main job's default) and ``zerosim demo``.

Run under ``mpirun -n N`` (what ``./run_mpi.sh`` does) every rank runs the command on an MPIComm;
run plainly, ``--local N`` simulates N ranks as threads of one process (LocalWorld).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

import numpy as np

from zerosim.checkpoint import CheckpointError
from zerosim.cli.arguments import int_at_least, refuse
from zerosim.comm import Communicator, LocalWorld, world_size_from_env
from zerosim.comm.record import busbw_factor
from zerosim.errors import ConfigError
from zerosim.nn.metrics import METRICS


def _collective_demo(comm: Communicator, elements: int) -> tuple[str, list[str]]:
    """Gather, reduce-scatter and all-reduce one buffer; return the ledger table and checks."""
    n = comm.size
    shard = np.full(elements, float(comm.rank), dtype=np.float32)
    full = np.empty(n * elements, dtype=np.float32)
    with comm.phase("gather"):
        comm.all_gather(full, shard)
    with comm.phase("reduce"):
        comm.reduce_scatter(shard, full)
        comm.all_reduce(full)
    # every rank gathered chunk q = q, so the sums are n·rank (scattered) and n·q (all-reduced)
    expected = np.repeat(np.arange(n, dtype=np.float32) * n, elements)
    if not (np.all(shard == n * comm.rank) and np.array_equal(full, expected)):
        raise RuntimeError(f"rank {comm.rank}: reduce-scatter/all-reduce gave wrong values")
    size = n * elements * 4
    lines = []
    for op, factor in (("all_gather", 1), ("reduce_scatter", 1), ("all_reduce", 2)):
        measured = comm.ledger.bytes_sent(op=op)
        formula = factor * (n - 1) * size // n
        lines.append(
            f"{op:<15} measured {measured:>12,} B   formula {factor}(N-1)/N·S = "
            f"{formula:>12,} B   busbw factor {busbw_factor(op, n):.3f}   "
            f"{'OK' if measured == formula else 'MISMATCH'}"
        )
    return comm.ledger.table(), lines


def cmd_demo(args: argparse.Namespace) -> int:
    elements = int(args.mib * 2**20 / 4)
    if args.local:
        results = LocalWorld(args.local, collectives=args.collectives).run(
            _collective_demo, elements
        )
        rank, (table, lines) = 0, results[0]
        size = args.local
    else:
        from zerosim.comm import MPIComm

        comm = MPIComm(collectives=args.collectives)
        table, lines = _collective_demo(comm, elements)
        rank, size = comm.rank, comm.size
    if rank == 0:
        print(
            f"zerosim collective demo: {size} ranks, {args.mib} MiB shard per rank, "
            f"{args.collectives} collectives\n"
        )
        print(table)
        print()
        print("\n".join(lines))
    return 0 if all(line.endswith("OK") for line in lines) else 1


def cmd_train(args: argparse.Namespace) -> int:
    from zerosim.cli.train import UsageError

    if args.model not in ("gpt", "mlp"):  # the forms zerosim dryrun takes, checked alike
        from zerosim.dryrun import recipe

        try:
            recipe(args.model)
        except ValueError as err:
            return refuse("train", f"--model: {err}")
    try:
        if args.local:
            data = LocalWorld(args.local).run(_train_and_report, args)[0]
        else:
            from zerosim.comm import MPIComm

            data = _train_and_report(MPIComm(), args)
    except (ConfigError, CheckpointError, UsageError, OSError) as err:
        # raised on every rank alike (the config is read, a checkpoint checked and written by
        # every rank together), so every rank ends here: no rank is left waiting
        named = not isinstance(err, ConfigError) or not args.config or args.config in str(err)
        where = "" if named else f"--config {args.config}: "
        return refuse("train", f"{where}{err}")
    if not data["text"]:  # ranks other than 0
        return 0
    ok = data["bytes"]["equal"] and data["memory"]["equal"]
    if args.plot:
        from zerosim.report.plots import lines

        lines(
            {"loss": data["losses"]},
            args.plot,
            title=f"stage {data['stage']}, {data['world_size']} ranks",
            ylabel="loss",
        )
    if args.json:
        print(json.dumps({k: v for k, v in data.items() if k != "text"}))
    else:
        print(data["text"])
    return 0 if ok else 1


def _train_and_report(comm: Communicator, args: argparse.Namespace) -> dict:
    from zerosim.cli import train as train_demo

    return train_demo.report_data(comm, train_demo.train(comm, args))


def cmd_consolidate(args: argparse.Namespace) -> int:
    from zerosim.checkpoint.files import consolidate

    try:
        out = consolidate(args.ckpt_dir, args.out, args.tag, args.with_optimizer)
    except (ValueError, OSError) as err:  # CheckpointError is a ValueError
        return refuse("consolidate", str(err))
    if args.json:
        import numpy as np

        with np.load(out) as arrays:
            shapes = {name: list(arrays[name].shape) for name in arrays.files}
        print(json.dumps({"out": str(out), "arrays": shapes}))
    else:
        print(f"wrote {out}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Run benchmarks/ (in a source checkout) and write docs/benchmarks.md."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if not (root / "benchmarks" / "__main__.py").exists():
        return refuse(
            "bench",
            "needs a source checkout (the benchmarks/ folder is not installed); run it from a "
            "clone of the repository",
        )
    extra = ["--quick"] if args.quick else []
    out = Path(args.out) if Path(args.out).is_absolute() else root / args.out
    code = subprocess.call(
        [sys.executable, "-m", "benchmarks", *extra, "--out", str(out)], cwd=root
    )
    if code == 0 and args.json:
        sections = [line[3:] for line in out.read_text().splitlines() if line.startswith("## ")]
        print(json.dumps({"out": str(out), "sections": sections}))
    return code


def cmd_flight(args: argparse.Namespace) -> int:
    """Read a job's flight records (zerosim.flight_dir): which rank is stopped or behind."""
    from zerosim.faults.flight_files import format_summary, read_reports, summarize

    try:
        summary = summarize(read_reports(args.dir))
    except (FileNotFoundError, ValueError) as err:
        return refuse("flight", str(err))
    print(json.dumps(summary) if args.json else format_summary(summary))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerosim", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="run the collectives and print the ledger table")
    demo.add_argument("--mib", type=float, default=1.0, help="shard size per rank in MiB")
    demo.add_argument("--collectives", choices=["native", "ring"], default="native")
    demo.add_argument(
        "--local",
        type=int_at_least(0),
        default=0,
        metavar="N",
        help="simulate N ranks in this process instead of using MPI",
    )
    demo.set_defaults(func=cmd_demo)

    train = sub.add_parser("train", help="train a model with a DeepSpeed config (the main job)")
    train.add_argument(
        "--config",
        help="DeepSpeed config file, JSON or hjson (default: the stage-3 GPT demo's settings)",
    )
    train.add_argument(
        "--steps",
        type=int_at_least(1),
        default=150,
        help="train until this many optimizer steps (with --resume, counted from the start)",
    )
    train.add_argument(
        "--model",
        default="gpt",
        help="gpt (shaped by --block-size … --n-embd) or mlp, a model preset (llama3-8b-tiny, "
        "mpt-125m-tiny, bloom-176b-tiny, …: every preset of zerosim.nn.PRESETS and its -tiny) "
        "or a model-description JSON/hjson file (docs/nn.md); default gpt",
    )
    train.add_argument("--block-size", type=int_at_least(1), default=32)
    train.add_argument("--n-layer", type=int_at_least(1), default=2)
    train.add_argument("--n-head", type=int_at_least(1), default=4)
    train.add_argument("--n-embd", type=int_at_least(1), default=64)
    train.add_argument("--seed", type=int_at_least(0), default=0)
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.add_argument("--json", action="store_true", help="print the report as JSON")
    train.add_argument(
        "--probe",
        action="store_true",
        help="after each optimizer step (outside its clock) time a fixed sample of a step's "
        "work on every rank: --json's step_probe_s (rank 0's), how fast the machine ran then",
    )
    train.add_argument(
        "--ds-summary",
        action="store_true",
        help="also print rank 0's collectives as DeepSpeed's comms logger log_summary() does",
    )
    train.add_argument(
        "--metrics",
        nargs="+",
        choices=sorted(METRICS),
        metavar="NAME",
        help="train metrics as Composer's trainer keeps them (updated from each micro-batch's "
        "logits after backward, computed over every rank after each step): "
        + ", ".join(sorted(METRICS)),
    )
    train.add_argument("--plot", metavar="FILE.png", help="draw the loss curve into FILE.png")
    train.add_argument("--save", metavar="DIR", help="save a checkpoint in DIR at the end")
    train.add_argument("--resume", metavar="DIR", help="continue from DIR's latest checkpoint")
    train.add_argument(
        "--local",
        type=int_at_least(0),
        default=0,
        metavar="N",
        help="simulate N ranks in this process instead of using MPI",
    )
    train.set_defaults(func=cmd_train)

    bench = sub.add_parser("bench", help="run every benchmark and write docs/benchmarks.md")
    bench.add_argument("--quick", action="store_true", help="small sizes, to check it runs")
    bench.add_argument("--out", default="docs/benchmarks.md")
    bench.add_argument(
        "--json",
        action="store_true",
        help="also print the written report's path and sections as JSON",
    )
    bench.set_defaults(func=cmd_bench)

    cons = sub.add_parser(
        "consolidate", help="write a checkpoint's full weights to one .npz, a parameter at a time"
    )
    cons.add_argument("ckpt_dir", help="a save directory (its latest tag) or a tag directory")
    cons.add_argument("out", help="output .npz (keys: parameter names)")
    cons.add_argument("--tag", help="tag to read instead of the one 'latest' names")
    cons.add_argument(
        "--with-optimizer", action="store_true", help="also optimizer/<state>/<name> arrays"
    )
    cons.add_argument("--json", action="store_true", help="print the arrays written as JSON")
    cons.set_defaults(func=cmd_consolidate)
    flight = sub.add_parser(
        "flight", help="read the flight records a stalled job wrote; say which rank held it up"
    )
    flight.add_argument("dir", help="the folder of zerosim.flight_dir / ZEROSIM_FLIGHT_DIR")
    flight.add_argument("--json", action="store_true", help="print the summary as JSON")
    flight.set_defaults(func=cmd_flight)
    from zerosim.cli import teaching as cli_teaching  # memory, volume, project, compare, plot

    cli_teaching.add_subcommands(sub)
    from zerosim.cli import dryrun as cli_dryrun  # the dry run over N virtual ranks

    cli_dryrun.add_subcommand(sub)
    from zerosim.cli import calibrate as cli_calibrate  # measure this host for the dry run

    cli_calibrate.add_subcommand(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # the main job
        args = parser.parse_args(["train", "--save", "checkpoints"])
    if getattr(args, "local", 0) and world_size_from_env() > 1:
        parser.error("--local simulates ranks in one process; do not combine it with mpirun")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
