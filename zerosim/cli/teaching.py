"""The teaching subcommands of ``zerosim``: memory, volume, project, compare and plot.

Each prints a table (``--json``: the numbers as JSON) computed by ``zerosim.analysis`` through
``zerosim.report.tables`` and, with ``--plot FILE.png``, draws it with ``zerosim.report.plots``.
``compare`` runs the engine on the current world and checks the measured bytes and memory against
the formulas (``zerosim.report.compare``), in fp32/fp64 or fp16/bf16 mixed precision
(``--precision``); the others are formulas only.
"""

from __future__ import annotations

import argparse
import json
import math
from fractions import Fraction
from typing import Any

from zerosim import analysis
from zerosim.analysis import EVERY_STAGE_SCHEDULES, SCHEDULES
from zerosim.analysis.stages import STAGES
from zerosim.backend import PRECISION_DTYPES
from zerosim.cli.arguments import int_at_least, parameter_count, refuse
from zerosim.report.tables import (
    DTYPE_NAMES,
    load_cluster,
    memory_data,
    project_data,
    table1_page,
    volume_data,
)


def _stages(chosen: list[str], allowed: tuple[str, ...]) -> list[str]:
    return list(allowed) if "all" in chosen else [s for s in allowed if s in chosen]


# -- the commands ---------------------------------------------------------------------------------
def _table(head: list[str], rows: list[list[str]], widths: list[int]) -> list[str]:
    """Lines of right-aligned columns: column i at least ``widths[i]`` characters wide and, after
    the first, one wider than its longest cell, so numbers of any size keep a space between them."""
    lines = [head, *rows]
    fit = [
        max([widths[i]] + [len(line[i]) + (i > 0) for line in lines if i < len(line)])
        for i in range(len(widths))
    ]
    return ["".join(f"{cell:>{fit[i]}}" for i, cell in enumerate(line)) for line in lines]


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=2) if args.json else text)


def _dtype(args: argparse.Namespace) -> str:
    """``--precision`` (DeepSpeed's fp16/bf16/fp32) wins over ``--dtype`` when given."""
    return PRECISION_DTYPES[args.precision] if args.precision else args.dtype


def _volume(args: argparse.Namespace) -> dict[str, Any]:
    knobs = (args.accumulation, args.dtype, args.persistent_numel, args.stage3_reuse)
    named = {"numels": getattr(args, "numels", None), "shapes": getattr(args, "shapes", None)}
    every = getattr(args, "reduce_every_micro_batch", False)  # volume has it, plot volume not
    return volume_data(args.params, args.dp, *knobs, **named, reduce_every_micro_batch=every)


def _reduce_every_refusal(
    args: argparse.Namespace, command: str, missing: str | None
) -> int | None:
    """``--reduce-every-micro-batch`` (``zerosim.fsdp2.reduce_every_micro_batch``) changes FSDP2's
    gradient reduce-scatters only: refused (exit code 2) where no FSDP2 row is asked for
    (``missing`` says what it needs) or with one micro-batch, where it changes nothing."""
    if not args.reduce_every_micro_batch:
        return None
    if missing is not None:
        return refuse(command, f"--reduce-every-micro-batch is FSDP2's knob: it {missing}")
    if args.accumulation < 2:
        return refuse(
            command,
            f"--reduce-every-micro-batch needs --accumulation K >= 2, got {args.accumulation} "
            "(with one micro-batch FSDP2 reduce-scatters once per step either way)",
        )
    return None


def cmd_memory(args: argparse.Namespace) -> int:
    from zerosim.report import plots

    if args.table1:
        data = {
            "table1": [vars(r) for r in analysis.table1()],
            "megatron": [vars(r) for r in analysis.megatron_table()],
        }
        _emit(args, data, table1_page())
        return 0
    allowed = STAGES
    if "all" in args.stage and args.offload_param != "none":
        allowed = ("3",)  # parameter offload exists for stage 3 only
    elif "all" in args.stage and args.offload_optimizer != "none":
        allowed = ("1", "2", "3")
    stages = _stages(args.stage, allowed)
    dtype = _dtype(args)
    if (code := _model_params(args, "memory")) is not None:
        return code
    if (code := _memory_fsdp2_refusal(args, stages)) is not None:
        return code
    try:
        data = memory_data(
            args.params,
            args.dp,
            stages,
            dtype,
            args.num_states,
            args.offload_optimizer,
            args.offload_param,
            numels=args.numels,
            shapes=args.shapes,
            accumulation=args.accumulation,
            reduce_every_micro_batch=args.reduce_every_micro_batch,
        )
    except ValueError as err:
        return refuse("memory", str(err))
    cell = {(r["dp"], r["stage"]): r["device"] for r in data["rows"]}
    heads = [f"{STAGES[s].paper_name} ({s})" if s != "megatron" else s for s in stages]
    rows = [
        [str(n)] + [analysis.format_paper_gb(Fraction(cell[n, s]) / 10**9) for s in stages]
        for n in args.dp
    ]  # GB from the exact byte count: no float rounding in the digits of a large model
    lines = [
        f"model-state memory per device (GB = 1e9 B), Ψ = {args.params:,}, {dtype}, "
        f"K_s = {args.num_states}, offload optimizer {args.offload_optimizer}, "
        f"params {args.offload_param}",
        *_table(["N", *heads], rows, [6, 17, *[16] * (len(heads) - 1)]),
    ]
    lines += [_fsdp2_memory_line(row) for row in data.get("fsdp2", [])]
    _emit(args, data, "\n".join(lines))
    if args.plot:
        series = {heads[i]: [cell[n, s] for n in args.dp] for i, s in enumerate(stages)}
        plots.memory_vs_dp(args.dp, series, args.plot, f"Ψ = {args.params:.3g}, {dtype}")
    return 0


def _memory_fsdp2_refusal(
    args: argparse.Namespace, stages: list[str], command: str = "memory"
) -> int | None:
    """``memory``'s (and ``plot memory``'s) ``--reduce-every-micro-batch`` and
    ``--accumulation`` change FSDP2's row only: refused (exit code 2) where there is none (no
    ``--model``, or no stage 3)."""
    missing = None
    if not args.model:
        missing = "needs --model (FSDP2's row is built from its shapes), got --params"
    elif "3" not in stages:
        missing = f"needs stage 3 (FSDP2's row is a stage-3 row), got --stage {' '.join(stages)}"
    if (code := _reduce_every_refusal(args, command, missing)) is not None:
        return code
    if missing is not None and args.accumulation > 1:
        return refuse(
            command,
            f"--accumulation changes FSDP2's row only (gradients kept between "
            f"micro-batches): it {missing}",
        )
    return None


def _fsdp2_memory_line(row: dict[str, Any]) -> str:
    """``memory``'s FSDP2 line: its model states, gathered peak and, over k > 1 micro-batches,
    the unsharded gradients kept between them (none when every micro-batch reduce-scatters)."""

    def gb(key: str) -> str:
        return analysis.format_paper_gb(Fraction(row[key]) / 10**9)

    line = (
        f"FSDP2 at N = {row['dp']}: {gb('total')} GB (fp32 shards are the optimizer's weights), "
        f"gathered peak {gb('peak_gathered_params')} GB (root + 2 blocks)"
    )
    k = row["accumulation"]
    if k == 1:
        return line
    if row["reduce_every_micro_batch"]:
        kept, when = "no unsharded gradient kept", "after every one"
    else:
        kept, when = f"unsharded gradients kept {gb('peak_accumulated_grads')} GB", "at the last"
    return f"{line}; {kept} between the k = {k} micro-batches (reduce-scattered {when})"


def _fsdp2_series_name(row: dict[str, Any]) -> str:
    """``plot memory``'s label of FSDP2's series: its model states, and the unsharded gradients
    kept between micro-batches where there are some."""
    if row["peak_accumulated_grads"]:
        return f"FSDP2 (+ unsharded gradients kept over k = {row['accumulation']})"
    return "FSDP2"


def cmd_volume(args: argparse.Namespace) -> int:
    from zerosim.report import plots, whole_params

    if (code := _model_params(args, "volume")) is not None:
        return code
    no_model = "needs --model (FSDP2's row is built from its shapes), got --params"
    if (
        code := _reduce_every_refusal(args, "volume", None if args.model else no_model)
    ) is not None:
        return code
    try:
        data = _volume(args)
        if args.optimizer != "adam":  # what LAMB or Muon add (zerosim/report/whole_params.py)
            extra = whole_params.volume_data(
                args.params, args.dp, args.optimizer, args.matrices, data["itemsize"]
            )
            data = {**data, "whole_params": extra}
    except ValueError as err:
        return refuse("volume", str(err))
    phases = ("forward", "backward", "step")
    head = ["stage", "Ψ_pad", *phases, "total"]
    widths = [9, 17, 18, 18, 18, 18]

    def cells(s: str, row: dict[str, Any]) -> list[str]:
        return [s] + [f"{row[key]:,}" for key in ("padded_numel", *phases, "total")]

    lines = [
        f"bytes sent per rank per optimizer step, Ψ = {args.params:,}, N = {args.dp}, "
        f"b = {data['itemsize']}, k = {args.accumulation}",
        *_table(head, [cells(s, row) for s, row in data["stages"].items()], widths),
    ]
    clip = data["clip_bytes"]
    lines.append(f"clip: {clip['end_ranks']} B on the end ranks, {clip['middle_ranks']} on others")
    lines.append(
        f"stage 3: Ψ_persist = {args.persistent_numel:,}, "
        + ("every parameter reused in backward" if args.stage3_reuse else "no reuse")
    )
    lines += [
        "",
        "DeepSpeed 0.19.8's schedule (zerosim.schedule = deepspeed, its defaults; stage 3 as "
        "above), rank 0:",
        *_table(
            [*head, "× paper"],
            [
                cells(s, row) + ([] if row["ratio"] is None else [f"{row['ratio']:.3f}"])
                for s, row in data["deepspeed"].items()
            ],
            [*widths, 9],
        ),
    ]
    lines += [
        "stages 1-2: DeepSpeed all-reduces each gradient bucket, 2(N−1)/N·Ψ, where the paper",
        "reduce-scatters it, (N−1)/N·Ψ_pad; its norm all-reduce is one float32 (4 B)",
    ]
    if "fsdp2" in data:  # --model: PyTorch FSDP2's schedule, each parameter padded on dim 0
        when = "every micro-batch" if args.reduce_every_micro_batch else "the last micro-batch"
        lines += [
            "",
            "PyTorch FSDP2's schedule (stage 3; param_dtype = reduce_dtype, blocks resharded "
            f"after forward, gradients reduce-scattered after {when}):",
            *_table(head, [cells("fsdp2", data["fsdp2"])], widths),
        ]
    if "whole_params" in data:
        lines += ["", whole_params.format_volume(data["whole_params"])]
    _emit(args, data, "\n".join(lines))
    if args.plot:
        bars = {s: {p: row[p] for p in phases} for s, row in data["stages"].items()}
        plots.volume_by_phase(bars, args.plot)
    return 0


def cmd_project(args: argparse.Namespace) -> int:
    from zerosim.report import plots
    from zerosim.report.tables import model_description

    try:
        model = None if args.model is None else model_description(args.model)
        if model is not None:
            args.params = model.num_parameters()
        cluster = load_cluster(args.cluster)
        data = project_data(
            cluster,
            args.params,
            args.tokens_per_step,
            args.dtype,
            args.accumulation,
            args.efficiency,
            args.recompute,
            model,
        )
    except (OSError, ValueError) as err:
        return refuse("project", str(err))
    c = cluster
    lines = [
        f"{c.nodes} nodes × {c.devices_per_node} devices = {c.world_size}; intra "
        f"{c.intra_bandwidth / 1e9:g} GB/s {c.intra_latency * 1e6:g} µs, inter "
        f"{c.inter_bandwidth / 1e9:g} GB/s {c.inter_latency * 1e6:g} µs, "
        f"{c.device_flops / 1e12:g} TFLOP/s × {args.efficiency}",
        f"Ψ = {args.params:,}, {args.tokens_per_step:,.0f} tokens per step, {args.dtype}",
        f"compute {data['compute_flops_per_device']:.4g} FLOPs per device per step: "
        + ("6Ψ per token" if model is None else f"{model.name}'s 6·N_matmul + 12·l·h·s per token"),
    ]
    head = ["stage", "GB/device", "compute s", "comm s", "step s (no overlap)", "step s (overlap)"]
    rows = [
        [s, f"{row['memory']['total'] / 1e9:.2f}"]
        + [f"{row[key]:.3f}" for key in ("compute_s", "comm_s", "step_s_no_overlap")]
        + [f"{row['step_s_overlap']:.3f}"]
        for s, row in data["stages"].items()
    ]
    lines += _table(head, rows, [9, 11, 11, 11, 21, 18])
    _emit(args, data, "\n".join(lines))
    if args.plot:
        bars = {
            s: {"compute": r["compute_s"], "communication": r["comm_s"]}
            for s, r in data["stages"].items()
        }
        colors = {"compute": "#4c72b0", "communication": "#dd8452"}
        plots.stacked_bars(bars, args.plot, "step time without overlap", "seconds", colors)
    return 0


def _run_on_world(args: argparse.Namespace, fn: Any, *fn_args: Any) -> tuple[Any, int]:
    """Run fn(comm, …): under mpirun (this rank's result, its rank), else on a LocalWorld of
    ``args.local`` ranks ([every rank's result], 0)."""
    from zerosim.comm import LocalWorld, world_size_from_env

    if world_size_from_env() > 1:
        from zerosim.comm import MPIComm

        comm = MPIComm()
        result = fn(comm, *fn_args)
        return result, comm.rank
    return LocalWorld(args.local or 4).run(fn, *fn_args), 0


def cmd_compare(args: argparse.Namespace) -> int:
    from zerosim.report import compare, plots

    missing = None
    if args.optimizer != "adam":
        missing = (
            f"needs --optimizer adam (the others run DeepSpeed's stages), got {args.optimizer!r}"
        )
    elif "fsdp2" not in args.schedule:
        missing = f"needs --schedule fsdp2, got --schedule {' '.join(args.schedule)}"
    if (code := _reduce_every_refusal(args, "compare", missing)) is not None:
        return code
    if args.optimizer != "adam":  # LAMB's or Muon's extra collectives, measured vs formulas
        from zerosim.report import whole_params

        result, rank = _run_on_world(
            args, whole_params.compare, args.optimizer, args.model, args.steps
        )
        report = result[0] if isinstance(result, list) else result
        if rank == 0:
            _emit(args, report, whole_params.format_report(report))
        return 0 if report["ok"] else 1

    stages = _stages(args.stage, tuple(STAGES))
    if args.precision != "fp32" and args.dtype != "float32":
        return refuse("compare", f"--precision {args.precision} needs --dtype float32")
    if "fsdp2" in args.schedule and args.precision != "fp32":
        return refuse("compare", f"--schedule fsdp2 needs --precision fp32, got {args.precision!r}")
    fsdp2 = {"reduce_every_micro_batch": True} if args.reduce_every_micro_batch else None
    result, rank = _run_on_world(
        args,
        compare.compare,
        stages,
        args.model,
        args.steps,
        args.dtype,
        args.accumulation,
        args.precision,
        tuple(dict.fromkeys(args.schedule)),
        fsdp2,
    )
    report = result[0] if isinstance(result, list) else result
    if rank == 0:
        _emit(args, report, compare.format_report(report))
        if args.plot:
            several = len(report["schedules"]) > 1
            bars = {
                (f"{r['name']} {r['schedule']}" if several else r["name"]): dict(
                    zip(r["bytes"]["phases"], r["bytes"]["measured"][0], strict=True)
                )
                for r in report["stages"]
            }
            plots.volume_by_phase(bars, args.plot, "measured bytes sent by rank 0 per step")
    return 0 if report["ok"] else 1


def _timeline(
    comm: Any, stage: str, model: str, steps: int, schedule: str
) -> dict[str, list[dict]]:
    from zerosim.report import compare

    out = compare.run_stage(comm, stage, model, steps, keep_records=True, schedule=schedule)
    return {"records": out["records"], "events": out["events"]}


def cmd_plot(args: argparse.Namespace) -> int:
    from zerosim.report import plots

    if args.what in ("memory", "volume") and (code := _model_params(args, "plot")) is not None:
        return code
    if args.what == "memory":
        if (code := _memory_fsdp2_refusal(args, list(STAGES), "plot")) is not None:
            return code
        dtype = _dtype(args)
        data = memory_data(
            args.params,
            args.dp,
            list(STAGES),
            dtype,
            args.num_states,
            numels=args.numels,
            shapes=args.shapes,
            accumulation=args.accumulation,
            reduce_every_micro_batch=args.reduce_every_micro_batch,
        )
        series = {
            f"stage {s}": [r["device"] for r in data["rows"] if r["stage"] == s] for s in STAGES
        }
        if "fsdp2" in data:  # with a model: FSDP2's model states and the gradients it keeps
            series[_fsdp2_series_name(data["fsdp2"][0])] = [
                r["total"] + r["peak_accumulated_grads"] for r in data["fsdp2"]
            ]
        plots.memory_vs_dp(args.dp, series, args.out, f"Ψ = {args.params:.3g}, {dtype}")
    elif args.what == "volume":
        try:
            data = _volume(args)
        except ValueError as err:
            return refuse("plot", str(err))
        bars = {
            s: {p: row[p] for p in ("forward", "backward", "step")}
            for s, row in data["stages"].items()
        }
        plots.volume_by_phase(bars, args.out)
    else:
        from zerosim.comm import world_size_from_env

        if world_size_from_env() > 1:
            return refuse("plot", "timeline draws a LocalWorld run; do not use mpirun")
        per_rank, _ = _run_on_world(
            args, _timeline, args.stage, args.model, args.steps, args.schedule
        )
        records = [r["records"] for r in per_rank]
        data = {"records_by_rank": records}
        title = (
            f"stage {args.stage}, {len(per_rank)} ranks, step {args.steps - 1}, "
            f"{args.schedule}'s schedule"
        )
        if args.stage == "3":  # what is gathered when, and when each module releases it
            data["events_by_rank"] = [r["events"] for r in per_rank]
            plots.gather_release_timeline(records, data["events_by_rank"], args.out, title)
        else:
            plots.collective_timeline(records, args.out, title)
    print(json.dumps(data, indent=2) if args.json else f"wrote {args.out}")
    return 0


# -- argument parsing -----------------------------------------------------------------------------
def _common(p: argparse.ArgumentParser, plot: bool = True) -> None:
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    if plot:
        p.add_argument("--plot", metavar="FILE.png", help="also draw the result into a PNG")


def _memory_options(p: argparse.ArgumentParser) -> None:
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--params",
        type=parameter_count,
        default=7_500_000_000,
        help="parameters Ψ, 0 to 1e18 (default 7.5e9)",
    )
    size.add_argument("--model", help=MODEL_HELP)
    p.add_argument(
        "--dp",
        type=int_at_least(1),
        nargs="+",
        default=[1, 4, 16, 64, 256, 1024],
        metavar="N",
        help="data-parallel degrees, one row each (default: Table 1's 1 4 16 64 256 1024)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default="float16",
        help="float16/bfloat16: mixed precision with fp32 master weights and states (default); "
        "float32/float64: no master copy",
    )
    p.add_argument(
        "--precision",
        choices=list(PRECISION_DTYPES),
        default=None,
        help="DeepSpeed's name for --dtype: fp16 = float16, bf16 = bfloat16 (mixed precision), "
        "fp32 = float32 (no master copy); overrides --dtype",
    )
    p.add_argument(
        "--num-states",
        type=int_at_least(0),
        default=2,
        help="K_s, state arrays per parameter: Adam 2, SGD 1",
    )
    p.add_argument(
        "--accumulation",
        type=int_at_least(1),
        default=1,
        metavar="K",
        help="micro-batches per optimizer step: the FSDP2 row's unsharded gradients kept "
        "between them (needs --model and stage 3; default 1)",
    )
    p.add_argument(
        "--reduce-every-micro-batch",
        action="store_true",
        help=REDUCE_EVERY_HELP + ", so the FSDP2 row keeps no unsharded gradient between them "
        "(needs --model, stage 3 and --accumulation K >= 2)",
    )


MODEL_HELP = (
    "Ψ of a model instead of --params: a model preset (llama2-7b … llama3-405b, mpt-125m … "
    "mpt-70b, bloom-176b, bloomberggpt, each also NAME-tiny), a model-description JSON/hjson "
    "file, a GPT preset or gpt:n_layer,n_embd,vocab_size,block_size"
)


REDUCE_EVERY_HELP = (
    "FSDP2 reduce-scatters the gradients after each of the K micro-batches (torch's default "
    "while gradient sync stays on; zerosim.fsdp2.reduce_every_micro_batch), not once at the last"
)


def _model_params(args: argparse.Namespace, command: str) -> int | None:
    """Set ``args.params`` (Ψ) and ``args.numels`` (every parameter's elements, None without a
    model) from ``--model`` when given; the exit code 2 of a refusal, else None."""
    from zerosim.report.tables import model_description

    args.numels = args.shapes = None
    if getattr(args, "model", None) is None:
        return None
    try:
        desc = model_description(args.model)
    except ValueError as err:
        return refuse(command, str(err))
    args.shapes = list(desc.parameter_shapes())
    args.numels = [math.prod(shape) for _, shape in args.shapes]
    args.params = sum(args.numels)
    return None


def _volume_options(p: argparse.ArgumentParser) -> None:
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument(
        "--params",
        type=parameter_count,
        help="parameters Ψ before padding, 0 to 1e18",
    )
    size.add_argument("--model", help=MODEL_HELP)
    p.add_argument(
        "--dp", type=int_at_least(1), required=True, metavar="N", help="data-parallel ranks"
    )
    p.add_argument(
        "--accumulation",
        type=int_at_least(1),
        default=1,
        metavar="K",
        help="micro-steps per optimizer step",
    )
    p.add_argument(
        "--dtype", choices=DTYPE_NAMES, default="float32", help="element size b (default float32)"
    )
    p.add_argument(
        "--persistent-numel",
        type=int_at_least(0),
        default=0,
        metavar="Ψ_persist",
        help="stage 3: elements of persistent parameters, padded (a multiple of N; default 0)",
    )
    p.add_argument(
        "--stage3-reuse",
        action="store_true",
        help="stage 3: every parameter kept from forward to backward (no backward all-gather)",
    )
    p.add_argument(
        "--optimizer",
        choices=["adam", "lamb", "muon"],
        default="adam",
        help="lamb or muon: also what that optimizer adds per step, Ψ laid out as --matrices "
        "equal square matrices (default adam: nothing added)",
    )
    p.add_argument(
        "--matrices",
        type=int_at_least(1),
        default=16,
        metavar="M",
        help="with --optimizer (default 16)",
    )


def _world_options(p: argparse.ArgumentParser, steps: int) -> None:
    p.add_argument("--model", choices=["mlp", "gpt"], default="mlp", help="as in zerosim train")
    p.add_argument(
        "-n",
        "--local",
        type=int_at_least(1),
        default=None,
        metavar="N",
        help="ranks of the in-process world when not under mpirun (default 4)",
    )
    p.add_argument(
        "--steps", type=int_at_least(1), default=steps, help=f"optimizer steps (default {steps})"
    )


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Register memory, volume, project, compare and plot on the ``zerosim`` parser."""

    stage_help = "stages to show (default all)"
    memory = sub.add_parser(
        "memory",
        help="model-state memory per device (ZeRO paper Table 1)",
        description="Per-device model-state memory for each stage and N, in GB (1e9 bytes) "
        "as the ZeRO paper prints Table 1. Example: zerosim memory --params 7.5e9 --dp 64",
    )
    _memory_options(memory)
    memory.add_argument(
        "--stage", nargs="+", choices=[*STAGES, "all"], default=["all"], help=stage_help
    )
    memory.add_argument("--offload-optimizer", choices=["none", "cpu", "nvme"], default="none")
    memory.add_argument("--offload-param", choices=["none", "cpu", "nvme"], default="none")
    memory.add_argument(
        "--table1", action="store_true", help="print docs/table1.md (Table 1, Megatron's table)"
    )
    _common(memory)
    memory.set_defaults(func=cmd_memory)

    volume = sub.add_parser(
        "volume",
        help="bytes per rank per step by phase and stage",
        description="Bytes one rank sends per optimizer step, by phase, for each stage "
        "(analysis.step_bytes with Ψ padded to a multiple of N; Megatron: to lcm(N, 128)). "
        "Example: zerosim volume --params 1e6 --dp 8 --accumulation 4",
    )
    _volume_options(volume)
    volume.add_argument(
        "--reduce-every-micro-batch",
        action="store_true",
        help=REDUCE_EVERY_HELP + " in the FSDP2 row (needs --model and --accumulation K >= 2)",
    )
    _common(volume)
    volume.set_defaults(func=cmd_volume)

    project = sub.add_parser(
        "project",
        help="projected step time and memory on a cluster",
        description="Step time (compute from 6ΨT FLOPs, communication on the two-level α-β "
        "model, with and without overlap) and memory per GPU for each stage. Example: "
        "zerosim project --cluster examples/cluster_64gpu.json --model gpt-7b",
    )
    project.add_argument(
        "--cluster", required=True, help="cluster JSON, e.g. examples/cluster_64gpu.json"
    )
    size = project.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", type=parameter_count, help="parameters Ψ, 0 to 1e18")
    size.add_argument(
        "--model",
        help="a GPT: a preset (gpt2, gpt2-medium, gpt2-large, gpt2-xl, gpt-7b, gpt-13b) or "
        "gpt:n_layer,n_embd,vocab_size,block_size; or a model preset (llama3-8b, mpt-7b, "
        "bloom-176b, …, each also NAME-tiny) or a model-description JSON/hjson file",
    )
    project.add_argument(
        "--tokens-per-step",
        type=float,
        default=2.0**22,
        help="tokens per optimizer step, all ranks together (default 2^22)",
    )
    project.add_argument("--dtype", choices=DTYPE_NAMES, default="float16")
    project.add_argument("--accumulation", type=int_at_least(1), default=1, metavar="K")
    project.add_argument(
        "--efficiency", type=float, default=0.5, help="achieved fraction of peak (default 0.5)"
    )
    project.add_argument("--recompute", action="store_true", help="8ΨT FLOPs instead of 6ΨT")
    _common(project)
    project.set_defaults(func=cmd_project)

    comp = sub.add_parser(
        "compare",
        help="run every stage; measured bytes and memory vs the formulas",
        description="Train each stage for a few steps on this world (mpirun: every rank; "
        "else a LocalWorld of -n ranks) and print measured bytes per phase and memory per "
        "category beside the formulas, and step time beside the α-β model. Exit code 1 if "
        "any byte or memory count differs.",
    )
    _world_options(comp, steps=3)
    comp.add_argument(
        "--stage", nargs="+", choices=[*STAGES, "all"], default=["all"], help=stage_help
    )
    comp.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    comp.add_argument(
        "--precision",
        choices=list(PRECISION_DTYPES),
        default="fp32",
        help="fp16/bf16: the engine's mixed precision (fp32 master weights; needs --dtype "
        "float32); memory against analysis.zero_model_states with 2-byte params (default fp32)",
    )
    comp.add_argument("--accumulation", type=int_at_least(1), default=1, metavar="K")
    comp.add_argument(
        "--optimizer",
        choices=["adam", "lamb", "muon"],
        default="adam",
        help="lamb or muon: train that optimizer at stages 0-3 and check its extra collectives "
        "(LAMB's norm all-reduce; Muon's every phase) against zerosim.analysis.whole_params",
    )
    comp.add_argument(
        "--schedule",
        nargs="+",
        choices=list(SCHEDULES),
        default=list(EVERY_STAGE_SCHEDULES),
        help="zerosim.schedule to run each stage under: DeepSpeed 0.19.8's collectives, the "
        "ZeRO paper's, or both side by side (default both); fsdp2 adds PyTorch FSDP2's for "
        "stage 3 (fp32 only)",
    )
    comp.add_argument(
        "--reduce-every-micro-batch",
        action="store_true",
        help=REDUCE_EVERY_HELP + " (needs --schedule fsdp2 and --accumulation K >= 2)",
    )
    _common(comp)
    comp.set_defaults(func=cmd_compare)

    plot = sub.add_parser("plot", help="draw memory vs N, bytes per phase, or a timeline")
    what = plot.add_subparsers(dest="what", required=True)
    for name, helptext in (
        ("memory", "model-state memory per device against N for every stage"),
        ("volume", "bytes per rank per step, by phase, for every stage"),
        ("timeline", "the collectives of the last step on every rank of a LocalWorld"),
    ):
        p = what.add_parser(name, help=helptext, description=helptext)
        p.add_argument("--out", required=True, metavar="FILE.png", help="the PNG to write")
        _common(p, plot=False)
        if name == "memory":
            _memory_options(p)
        elif name == "volume":
            _volume_options(p)
        else:
            _world_options(p, steps=2)
            p.add_argument("--stage", choices=list(STAGES), default="2", help="default 2")
            p.add_argument(
                "--schedule",
                choices=["deepspeed", "paper"],
                default="deepspeed",
                help="zerosim.schedule: DeepSpeed 0.19.8's collectives (default) or the ZeRO "
                "paper's (stage 3: one gather per parameter and use)",
            )
        p.set_defaults(func=cmd_plot)
