"""``zerosim dryrun``: the engine over N virtual ranks on shape-only arrays (docs/dryrun.md).

    zerosim dryrun --model gpt3-175b --ranks 1024 --config CFG.json [--micro-batch B]
                   [--recompute] [--cluster C.json] [--all-ranks] [--json] [--trace FILE.json]
                   [--plot FILE.png]

Progress goes to stderr; the report (a table, or with ``--json`` one JSON object) to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any

from zerosim.cli.arguments import int_at_least, refuse
from zerosim.errors import ConfigError
from zerosim.nn.metrics import METRICS

GIB = 2**30


def add_subcommand(sub: Any) -> None:
    p = sub.add_parser(
        "dryrun",
        help="run the engine over N virtual ranks on shape-only arrays (any model size)",
        description="The engine, model, optimizer and stages over a virtual world of N ranks, "
        "on arrays without values: per class of rank, the memory held, the bytes sent per step "
        "and the FLOPs, beside the ZeRO paper's formulas and DeepSpeed's estimator. Example: "
        "zerosim dryrun --model gpt3-175b --ranks 1024 "
        "--config examples/ds_config_dryrun_bf16.json",
    )
    p.add_argument(
        "--model",
        required=True,
        help="gpt or mlp (as zerosim train), a GPT preset (gpt3-125m … gpt3-175b, gpt-529b), "
        "gpt:LAYERS,HIDDEN,VOCAB,SEQ[,HEADS], a model preset (llama2-7b … llama3-405b, mpt-125m "
        "… mpt-70b, bloom-176b, bloomberggpt, each also NAME-tiny) or a model-description "
        "JSON/hjson file",
    )
    p.add_argument(
        "--ranks", type=int_at_least(1), required=True, metavar="N", help="virtual world size"
    )
    p.add_argument("--config", required=True, metavar="CFG.json", help="DeepSpeed JSON config")
    p.add_argument(
        "--micro-batch",
        type=int_at_least(1),
        metavar="B",
        help="train_micro_batch_size_per_gpu to use",
    )
    p.add_argument(
        "--recompute", action="store_true", help="activation checkpointing of every block"
    )
    p.add_argument(
        "--all-ranks", action="store_true", help="run every rank, not one per class of rank"
    )
    p.add_argument(
        "--steps",
        type=int_at_least(1),
        help="optimizer steps to run; the last is reported (default: 3 on a calibrated host, "
        "the first step zerosim train times, else 2)",
    )
    p.add_argument(
        "--overflow",
        action="store_true",
        help="every inf/nan test finds one (every fp16/bf16 overflow check skips the step)",
    )
    p.add_argument(
        "--fill",
        type=float,
        default=0.0,
        help="the value any other read of an array gives (the loss, Σg²; default 0)",
    )
    p.add_argument(
        "--cluster",
        metavar="C.json",
        help="simulate the step on this cluster (a JSON file, or selene, zeropp_v100): adds `time`",
    )
    p.add_argument(
        "--backend",
        choices=["numpy", "cupy", "torch"],
        help="the array backend the run stands for, whose code path the shape-only arrays take "
        "(memory, operations; torch: CuPy's, with each layer's fused chain one kernel, as "
        "PyTorch runs it); default: the cluster's (a calibrated host: numpy), else cupy",
    )
    p.add_argument(
        "--metrics",
        nargs="+",
        choices=sorted(METRICS),
        default=(),
        metavar="NAME",
        help="train metrics, run as zerosim train --metrics runs them: "
        + ", ".join(sorted(METRICS)),
    )
    p.add_argument(
        "--trace", metavar="FILE.json", help="the simulated step as a Chrome/Perfetto trace"
    )
    p.add_argument("--plot", metavar="FILE.png", help="memory over the simulated step")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=cmd_dryrun)


def _ranks(ids: list[int]) -> str:
    """[0, 1, 2, 5] → '0-2,5'."""
    parts, start = [], ids[0]
    for a, b in zip(ids, [*ids[1:], None], strict=True):
        if b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(parts)


def format_report(report: dict[str, Any]) -> str:
    r = report
    lines = [
        f"{r['world_size']} virtual ranks, stage {r['stage']} ({r['schedule']} schedule), "
        f"{r['dtype']}, micro-batch {r['micro_batch']} × {r['accumulation']}: "
        f"Ψ = {r['params']:,} (padded {r['padded_params']:,})",
        f"{r['ranks_run']} rank(s) run on {r.get('backend', 'cupy')}'s code path in "
        f"{r['ranks_wall_s']:.1f} s, the whole dry run "
        f"{r['wall_s']:.1f} s, host peak RSS "
        f"{r['host_peak_rss_bytes'] / GIB:.2f} GiB",
        f"{'ranks':>16} {'states GiB':>11} {'peak GiB':>10} {'activ. GiB':>11} "
        f"{'sent GiB/step':>14} {'TFLOP/step':>11}",
    ]
    for e in r["ranks"]:
        sent = sum(e["bytes_sent"].values())
        lines.append(
            f"{_ranks(e['ranks']):>16} {e['model_states_bytes'] / GIB:>11.3f} "
            f"{e['peak_bytes'] / GIB:>10.2f} {e['activation_peak_bytes'] / GIB:>11.2f} "
            f"{sent / GIB:>14.3f} {e['flops'] / 1e12:>11.1f}"
            + (f"  would not start: {e['would_not_start']}" if "would_not_start" in e else "")
        )
    paper, estimator = r["formula"]["paper"], r["formula"]["deepspeed_estimator"]
    lines.append(
        f"{'ZeRO paper':>16} {paper['model_states_bytes'] / GIB:>11.3f} {'':>10} {'':>11} "
        f"{sum(paper['bytes_sent'].values()) / GIB:>14.3f}"
    )
    if estimator["model_states_bytes"] is not None:
        lines.append(f"{'DS estimator':>16} {estimator['model_states_bytes'] / GIB:>11.3f}")
    if "time" in r and not r["time"]["fits_device"]:
        t = r["time"]
        lines.append(
            f"step: OOM on {t['cluster']['name'] or 'the cluster'}: would not start, a peak above "
            f"its {r['device_memory_bytes'] / GIB:.3g} GiB per device (no step time)"
        )
    elif "time" in r:
        t = r["time"]
        # with a reduction stream, what the step waits beyond compute is its kernels' too
        exposed = f"{t['exposed_comm_s']:.3f} s"
        comm = f"communication {t['comm_s']:.3f} s of which exposed {exposed}"
        if t["reduce_s"]:
            comm = (
                f"DeepSpeed's reduction stream's kernels {t['reduce_s']:.3f} s, communication "
                f"{t['comm_s']:.3f} s, the two exposed beyond compute {exposed}"
            )
        lines.append(
            f"step {t['step_s']:.3f} s on {t['cluster']['name'] or 'the cluster'}: compute "
            f"{t['compute_s']:.3f} s, {comm}; {t['tflops_per_device']:.1f} model TFLOP/s per "
            "device"
        )
    return "\n".join(lines)


def cmd_dryrun(args: argparse.Namespace) -> int:
    from zerosim.dryrun import dry_run, recipe

    def progress(message: str) -> None:
        sys.stderr.write(f"zerosim dryrun: {message}\n")  # one write: lines never splice
        sys.stderr.flush()

    try:
        model = recipe(args.model)  # with the trainer's metrics, as zerosim train runs them
        if args.metrics:
            model = replace(model, metrics=tuple(dict.fromkeys((*model.metrics, *args.metrics))))
        report = dry_run(
            model,
            args.ranks,
            args.config,
            micro_batch=args.micro_batch,
            recompute=args.recompute,
            all_ranks=args.all_ranks,
            steps=args.steps,
            overflow=args.overflow,
            fill=args.fill,
            cluster=args.cluster,
            trace=args.trace,
            plot=args.plot,
            progress=progress,
            backend=args.backend,
        )
    except (OSError, ValueError, ConfigError) as err:  # bad input: the model, config, cluster
        return refuse("dryrun", str(err))
    print(json.dumps(report, default=str) if args.json else format_report(report))
    return 0
