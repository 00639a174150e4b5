"""``zerosim train``: train with any DeepSpeed config; print what each rank moved and held.

The default is the main job of ``./run_mpi.sh``: a small character-level GPT on the corpus that
ships with zerosim, with ZeRO stage 3 (the settings of ``examples/ds_config_stage3.json``). At the
end rank 0 prints
the ledger table (and with ``--ds-summary`` the same calls in the layout of DeepSpeed's comms
logger), the bytes each rank sent in one optimizer step next to ``analysis.step_bytes``,
and each rank's memory next to ``analysis.full_precision_model_states``.
"""

from __future__ import annotations

import argparse
import inspect
import time
from pathlib import Path
from typing import Any

import numpy as np

from zerosim.analysis import (
    boundary_messages,
    clip_bytes,
    full_precision_model_states,
    step_bytes,
)
from zerosim.analysis.volume import stage3_backward_gathers
from zerosim.checkpoint import load_checkpoint, save_checkpoint
from zerosim.comm import Communicator, LocalComm
from zerosim.engine import initialize
from zerosim.engine.engine import to_device
from zerosim.nn import no_grad
from zerosim.nn.metrics import METRICS, step_metrics
from zerosim.report import workloads
from zerosim.report.compare import fsdp2_formula
from zerosim.zero.fetcher import coordinator_kind

DEFAULT_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "steps_per_print": 50,
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.01},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_max_lr": 3e-3, "warmup_num_steps": 20, "warmup_type": "linear"},
    },
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "reduce_bucket_size": 20000,
        "stage3_prefetch_bucket_size": 20000,
        "stage3_param_persistence_threshold": 100,
        "stage3_max_reuse_distance": 0,
    },
    "zerosim": {"dtype": "float32", "schedule": "paper"},
}
PHASES = ("forward", "backward", "step", "clip")


def build(args: argparse.Namespace) -> tuple[Any, Any]:
    """(model, dataset) for ``--model`` and the GPT's shape options (``report.workloads``)."""
    return workloads.build(
        args.model,
        seed=args.seed,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
    )


def _gather_rows(comm: Communicator, values: list[int]) -> np.ndarray:
    mine = np.array(values, dtype=np.int64)
    every = np.empty(comm.size * mine.size, dtype=np.int64)
    with comm.phase("report"):
        comm.all_gather(every, mine)
    return every.reshape(comm.size, mine.size)


def strategy_line(strategy: Any) -> str:
    """``strategy: Stage2DeepSpeed (zerosim/zero/stage2_deepspeed.py)``: the class that runs the
    stage and the file to read it in, path from the folder that holds the package."""
    cls = type(strategy)
    path = Path(inspect.getfile(cls)).resolve()
    root = Path(__file__).resolve().parents[2]  # zerosim/cli/train.py → the package's folder
    return f"strategy: {cls.__name__} ({path.relative_to(root).as_posix()})"


class UsageError(ValueError):
    """A command-line value that does not fit the run (raised alike on every rank)."""


def train(comm: Communicator, args: argparse.Namespace) -> dict[str, Any]:
    # a path goes to initialize as it is: load_config reads it (JSON or hjson, no repeated key)
    config = args.config or DEFAULT_CONFIG
    try:
        model, data = build(args)
    except ValueError as err:  # a model the corpus does not fit, alike on every rank
        raise UsageError(f"--model: {err}") from None
    from zerosim.report.compare import gradient_order

    order = gradient_order(model)  # DeepSpeed's schedule buckets gradients in this order
    engine, _, loader, _ = initialize(model, config, comm=comm, training_data=data)
    if getattr(args, "resume", None):  # weights, optimizer, scheduler, RNG and data position
        load_checkpoint(engine, args.resume, loader=loader)
        if args.steps <= engine.global_steps:
            raise UsageError(
                f"--steps {args.steps}: the checkpoint in {args.resume} is at step "
                f"{engine.global_steps} and --steps counts from the start of training; "
                f"pass a number > {engine.global_steps} to train more"
            )
    show = comm.rank == 0 and not args.quiet and not getattr(args, "json", False)
    bar = None
    if show:
        from tqdm import tqdm

        if not args.json:  # which file to read for what runs (stdout stays JSON with --json)
            print(strategy_line(engine.strategy), flush=True)

        bar = tqdm(
            total=args.steps,
            initial=engine.global_steps,
            desc=f"stage {engine.strategy.stage}, {comm.size} ranks",
        )
    probe = getattr(args, "probe", False)
    metrics = [METRICS[name]() for name in getattr(args, "metrics", None) or ()]
    engine.module.keep_output = bool(metrics)  # the logits, for the metrics after backward
    losses, last_step, clocks, computed = _train_steps(
        comm, engine, loader, args.steps, bar, probe, metrics
    )
    if bar is not None:
        bar.close()
    if getattr(args, "save", None):
        save_checkpoint(engine, args.save, loader=loader)
    return {
        "engine": engine,
        "order": order,
        "losses": losses,
        "step_bytes": last_step,
        "ds_summary": getattr(args, "ds_summary", False),
        "clocks": clocks,
        "model": args.model,
        "metrics": computed,
    }


def _train_steps(
    comm: Communicator,
    engine: Any,
    loader: Any,
    steps: int,
    bar: Any,
    probe: bool = False,
    metrics: list | None = None,
) -> tuple[list[float], dict[str, int], np.ndarray, dict[str, float]]:
    """Train until optimizer step ``steps``: the losses, the bytes of the last step by phase,
    each optimizer step's (wall, CPU, probe) seconds on this rank, from its first forward to the
    end of its ``engine.step()`` and its metrics (the loader's batches and this loop's
    bookkeeping left out), and the last step's ``metrics``. With ``probe``,
    ``calibrate.speed_probe()`` runs right after the step's clock stops (else NaN): how fast
    this machine ran then. The metrics run as Composer's trainer runs its train metrics (and
    the dry run its recipe's): reset when a step begins, updated from each micro-batch's logits
    after its backward, computed over every rank when the step is done."""
    from zerosim.dryrun.calibrate import speed_probe

    metrics = metrics or []
    losses, last_step, clocks, computed = [], {}, [], {}
    t0 = time.perf_counter()
    batches = iter(loader)
    start = None
    while engine.global_steps < steps:
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            continue
        if start is None:  # the first micro-batch of an optimizer step
            start = (time.perf_counter(), time.process_time())
            for metric in metrics:
                metric.reset()
        comm.ledger.step = engine.global_steps
        if metrics:  # the batch crosses to the device once, for the model and the metrics
            x, y = to_device(x, engine.backend), to_device(y, engine.backend)
        loss = engine(x, y)
        engine.backward(loss)
        with no_grad():
            for metric in metrics:
                metric.update(engine.module.output, y)
        engine.step()
        if engine.micro_steps % engine.gradient_accumulation_steps == 0:
            values = step_metrics(metrics, comm)
            computed = {name: float(v) for name, v in values.items()}
            wall, cpu = time.perf_counter() - start[0], time.process_time() - start[1]
            clocks.append((wall, cpu, speed_probe() if probe else np.nan))
            start = None
            losses.append(float(loss))
            last_step = {
                p: comm.ledger.bytes_sent(phase=p, step=engine.global_steps - 1) for p in PHASES
            }
            if bar is not None:
                bar.set_postfix(
                    loss=f"{np.mean(losses[-10:]):.3f}",
                    step_ms=f"{(time.perf_counter() - t0) * 1e3 / len(losses):.0f}",
                )
                bar.update(1)
    return losses, last_step, np.array(clocks, dtype=np.float64).reshape(-1, 3), computed


# The steps left out of ``step_s``: the first builds the optimizer state and the buckets, the
# second still warms caches and the allocator.
WARMUP_STEPS = 2


def step_timing(comm: Communicator, clocks: np.ndarray) -> dict[str, Any]:
    """``step_s``: the median wall time of rank 0's optimizer steps after the first
    ``WARMUP_STEPS``, None when there are none (``--steps`` 2 or fewer). The median, not the
    mean: on a shared machine a step in which another process held a core is 1.6-2.2x slower.
    ``step_cpu_share``: per step, the smallest share of its wall time any rank spent on the CPU
    (MPICH sleeps while it waits, so a waiting rank shows a share below 1 too); ``step_cpu_s``:
    the median CPU seconds of rank 0's timed steps (on a machine whose cores other processes
    hold, the step a single process would take alone; it leaves out the waits on other ranks);
    ``step_probe_s`` (``--probe``): per step, rank 0's ``speed_probe`` right after it, as
    ``zerosim calibrate`` writes rank 0's (the slowest rank's sat 10% above it at N = 2 here).
    A collective: every rank calls it with as many steps."""
    mine = np.ascontiguousarray(clocks, dtype=np.float64).reshape(-1)
    every = np.empty(comm.size * mine.size, dtype=np.float64)
    with comm.phase("report"):
        comm.all_gather(every, mine)
    every = every.reshape(comm.size, -1, 3)
    wall, cpu, probe = every[..., 0], every[..., 1], every[0, :, 2]
    timed = wall[0, WARMUP_STEPS:]
    share = np.min(cpu / np.maximum(wall, 1e-12), axis=0)
    if isinstance(comm, LocalComm):  # threads of one process share one CPU clock
        share = np.full_like(share, np.nan)
    return {
        "step_s": float(np.median(timed)) if timed.size else None,
        "step_cpu_s": float(np.median(cpu[0, WARMUP_STEPS:])) if timed.size else None,
        "steps_timed": int(timed.size),
        "step_wall_s": [float(t) for t in wall[0]],
        "step_cpu_share": [None if np.isnan(v) else float(v) for v in share],
        "step_probe_s": [None if np.isnan(v) else float(v) for v in probe],
    }


def expected_rows(engine: Any, order: list[int], persistent: int) -> list[list[int]] | None:
    """Per rank, the bytes of ``PHASES`` one optimizer step sends by ``zerosim.analysis``: the
    paper's schedule from Ψ_pad, DeepSpeed's (stages 0-2, DeepSpeed's layout) from the model's
    parameter sizes and ``order``, the order backward finishes their gradients; the norm
    all-reduce of the schedule (``boundary_messages``). None for DeepSpeed's stage 3 unless its
    prefetch bucket holds every gathered parameter: otherwise which fetch gathers what follows
    the module trace (docs/formulas.md), and the peer tests hold it to DeepSpeed's own log."""
    cfg, strategy, n = engine.config, engine.strategy, engine.comm.size
    zero = cfg.zero_optimization
    b = np.dtype(cfg.zerosim.dtype).itemsize
    k = engine.gradient_accumulation_steps
    schedule = cfg.zerosim.schedule
    precision = "fp16" if cfg.fp16.enabled else "bf16" if cfg.bf16.enabled else "fp32"
    checks = boundary_messages(
        strategy.stage,
        schedule=schedule,
        precision=precision,
        clip=cfg.gradient_clipping,
        float64=b == 8,
        bf16_overflow=cfg.bf16.check_grad_overflow,
        compute_grad_norm=zero.compute_grad_norm,
    )
    rows = []
    if schedule == "fsdp2":
        params = sum(len(g.partition.names) for g in strategy.groups)  # one norm element each
        shard = strategy.comm.size  # the norm's all-reduce runs in the shard group
        for r in range(n):
            formula = fsdp2_formula(strategy, k, r)
            clip = clip_bytes(shard, r % shard, checks["clip"], params) if "clip" in checks else 0
            rows.append([formula["forward"], formula["backward"], formula["step"], clip])
        return rows
    for r in range(n):
        if schedule == "deepspeed" and strategy.stage < 3 and strategy.layout_kind == "deepspeed":
            formula = step_bytes(
                strategy.stage, n, 0, b, k,
                schedule="deepspeed",
                numels=[p.numel for _, p in engine.module.named_parameters()],
                rank=r,
                order=order,
                reduce_bucket_size=zero.reduce_bucket_size,
                reduce_scatter=zero.reduce_scatter,
                use_multi_rank_bucket_allreduce=zero.use_multi_rank_bucket_allreduce,
                contiguous_gradients=zero.contiguous_gradients,
                overlap_comm=zero.overlap_comm,
            )  # fmt: skip
        else:
            regather = True
            if strategy.stage == 3:
                coordinator = coordinator_kind(strategy)
                gathered = strategy.padded_numel - persistent
                regather = stage3_backward_gathers(coordinator, zero, gathered)
                if regather is None:  # DeepSpeed's module trace decides
                    return None
            formula = step_bytes(
                strategy.stage, n, strategy.padded_numel, b, k, persistent, regather
            )
        clip = clip_bytes(n, r, checks["clip"]) if "clip" in checks else 0
        rows.append([formula["forward"], formula["backward"], formula["step"], clip])
    return rows


def report(comm: Communicator, result: dict[str, Any]) -> str:
    """The tables rank 0 prints (a collective: every rank must call it)."""
    return report_data(comm, result)["text"]


def report_data(comm: Communicator, result: dict[str, Any]) -> dict[str, Any]:
    """What ``report`` prints, as numbers too (``zerosim train --json``); empty off rank 0."""
    engine = result["engine"]
    strategy = engine.strategy
    b = np.dtype(engine.config.zerosim.dtype).itemsize
    k = engine.gradient_accumulation_steps
    measured = _gather_rows(comm, [result["step_bytes"].get(p, 0) for p in PHASES])
    memory = engine.memory_report()
    keys = ["params", "grads", "optimizer_states", "persistent_params", "peak_gathered"]
    mine = [
        memory["params"],
        memory["grads"],
        sum(v for key, v in memory.items() if key.startswith("optimizer_state.")),
        memory.get("persistent_params", 0),
        memory.get("peak_gathered_params", 0),
    ]
    held = _gather_rows(comm, mine)
    timing = step_timing(comm, result["clocks"])
    if comm.rank != 0:
        return {"text": ""}
    losses = result["losses"]
    lines = [
        f"loss: first 10 steps {np.mean(losses[:10]):.3f} → last 10 steps "
        f"{np.mean(losses[-10:]):.3f}",
        "",
        "ledger of rank 0:",
        comm.ledger.table(),
        "",
    ]
    if result.get("metrics"):
        shown = ", ".join(f"{name} {value:.4f}" for name, value in result["metrics"].items())
        lines += [f"train metrics of the last step, over every rank's targets: {shown}", ""]
    if result.get("ds_summary"):
        lines += [
            "rank 0's collectives as DeepSpeed's comms logger prints them (log_summary(); message "
            "size: an all-gather's input shard, a reduce-scatter's or all-reduce's whole buffer):",
            comm.ledger.ds_table(),
            "",
        ]
    persistent = strategy.persistent_padded_numel() if strategy.stage == 3 else 0
    formulas = expected_rows(engine, result["order"], persistent)
    lines.append(
        f"bytes sent per optimizer step (Ψ_pad = {strategy.padded_numel:,}, "
        f"b = {b}, N = {comm.size}, k = {k}, {engine.config.zerosim.schedule}'s schedule)"
    )
    lines.append(f"{'rank':>5} " + " ".join(f"{p:>12}" for p in PHASES) + "   vs formula")
    for r in range(comm.size):
        want = None if formulas is None else formulas[r]
        if want is None:
            ok = "follows the module trace (no closed form)"
        else:
            ok = "OK" if list(measured[r]) == want else f"MISMATCH (formula {want})"
        lines.append(f"{r:>5} " + " ".join(f"{v:>12,}" for v in measured[r]) + f"   {ok}")
    states = len(engine.optimizer.state_keys(engine.optimizer.param_groups[0]))
    model = full_precision_model_states(
        strategy.padded_numel, comm.size, strategy.stage, dtype_bytes=b, num_states=states
    )
    want = [model.params, model.grads, model.optimizer_states, persistent * b]
    lines += [
        "",
        "bytes held per rank (model states) vs the ZeRO formula",
        f"{'rank':>5} " + " ".join(f"{key:>17}" for key in keys),
    ]
    for r in range(comm.size):
        lines.append(f"{r:>5} " + " ".join(f"{v:>17,}" for v in held[r]))
    lines.append(f"{'formula':>5} " + " ".join(f"{v:>17,}" for v in want) + f"{'':>18}")
    verdict = all(list(held[r][:4]) == want for r in range(comm.size))
    lines.append("memory matches the formula on every rank" if verdict else "MEMORY MISMATCH")
    moved = engine.crossings()
    if engine.backend.name != "numpy":
        lines += [
            "",
            f"host <-> device crossings of rank 0 since initialize (backend "
            f"{engine.backend.name}): {moved['from_host_calls']:,} in "
            f"({moved['from_host_bytes']:,} B: the model once, then each batch), "
            f"{moved['to_host_calls']:,} out ({moved['to_host_bytes']:,} B)",
        ]
    text = "\n".join(lines)
    bytes_ok = formulas is not None and all(
        list(measured[r]) == formulas[r] for r in range(comm.size)
    )
    extra = {}
    if result.get("ds_summary"):
        rows = comm.ledger.ds_summary()
        extra["ds_summary"] = {name: {str(k): v for k, v in r.items()} for name, r in rows.items()}
    return {
        **extra,
        "text": text,
        "crossings": moved,
        "model": result["model"],
        "params": sum(p.numel for p in engine.module.parameters()),
        "schedule": engine.config.zerosim.schedule,
        "steps": engine.global_steps,
        **timing,
        "world_size": comm.size,
        "ranks": comm.size,
        "stage": strategy.stage,
        "padded_numel": strategy.padded_numel,
        "persistent_numel": persistent,
        "losses": losses,
        "metrics": result.get("metrics", {}),
        "bytes": {
            "phases": list(PHASES),
            "measured": measured.tolist(),
            "formula": None if formulas is None else formulas[0][:3],
            "formula_by_rank": formulas,
            "equal": bytes_ok,
        },
        "memory": {
            "categories": keys,
            "measured": held.tolist(),
            "formula": want,
            "equal": verdict,
        },
    }
