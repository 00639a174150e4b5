"""Measured against predicted: run each ZeRO stage on a world and set it beside the formulas.

For every stage (0, 1, 2, 3 and Megatron's layout) on the communicator it is given, under each
collective schedule asked for (``zerosim.schedule``: DeepSpeed's and the ZeRO paper's; FSDP2's
for stage 3 only, beside them, its bytes from ``analysis.fsdp2_step_bytes``), in
fp32/fp64 or in fp16/bf16 mixed precision, ``compare`` trains a few optimizer steps and
collects, from every rank:

- the bytes the ledger recorded in the last step, by phase, next to ``analysis.step_bytes``
  of that schedule (forward, backward, step; DeepSpeed's from the model's parameter sizes and
  the order backward finishes their gradients) and ``analysis.clip_bytes`` of the
  one-element all-reduces ``analysis.boundary_messages`` says the schedule sends (clip, and the
  overflow flag) — must be equal. Stage 3 runs with ``stage3_param_persistence_threshold`` 0
  and ``stage3_max_reuse_distance`` 0 unless told otherwise, so its formula is the plain
  3(N−1)/N·Ψ_pad·b (ZeRO paper, Sec. 7.2.2);
- the bytes ``engine.memory_report()`` counts per category, next to
  ``analysis.full_precision_model_states`` (fp32/fp64), ``analysis.zero_model_states`` with
  2-byte parameters and gradients and fp32 master weights and states (fp16/bf16), or
  ``analysis.megatron_model_states`` — must be equal. Stage 3 adds its persistent parameters,
  Ψ_persist·b, with Ψ_persist counted here from the model's shapes;
- the wall time of the step's collectives next to the α-β model Σ c_α·α + c_β·S/B over the
  same calls, with α and B fitted (``analysis.fit_alpha_beta``) from all-gathers timed on the
  same world just before. Timing is reported, never checked: it depends on the machine.

``compare`` is collective (every rank calls it and gets the same report); ``format_report``
writes it as text. The ``zerosim compare`` command and notebooks 02, 04 and 05 use both.
ZeRO++ adds rows here once the engine runs it: extend ``analysis.stages.STAGES`` and
``_formula_bytes``.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import numpy as np

from zerosim.analysis import (
    EVERY_STAGE_SCHEDULES,
    SCHEDULES,
    alpha_beta_coefficients,
    boundary_messages,
    clip_bytes,
    collective_time,
    fit_alpha_beta,
    step_bytes,
)
from zerosim.analysis.stages import STAGES, stage_info
from zerosim.analysis.volume import fsdp2_step_bytes, stage3_backward_gathers
from zerosim.backend import PRECISION_DTYPES
from zerosim.comm import Communicator
from zerosim.engine import initialize
from zerosim.report import workloads
from zerosim.report.tables import element_bytes, model_states
from zerosim.zero.fetcher import coordinator_kind
from zerosim.zero.partition import dim0_partition

PHASES = ("forward", "backward", "step", "clip")
MEMORY = ("params", "grads", "master_params", "optimizer_states")
# compare's stage-3 knobs: nothing persistent, nothing reused, so the formula is 3(N−1)/N·Ψ_pad·b
STAGE3_PLAIN = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
FIT_ELEMENTS = (256, 4096, 32768, 131072)  # elements per rank of the timed all-gathers


def stage_config(
    name: str,
    dtype: str = "float32",
    accumulation: int = 1,
    bucket: int = 20000,
    precision: str = "fp32",
    zero: dict[str, Any] | None = None,
    schedule: str = "deepspeed",
    fsdp2: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config ``compare`` trains stage ``name`` with (Adam, clipping on).

    ``precision`` fp16 or bf16 adds that section with ``enabled`` (fp16 starts its loss scale at
    2**8 so that no step of a short run is skipped); ``zero`` overrides ``zero_optimization`` keys;
    ``schedule`` is ``zerosim.schedule``; ``fsdp2``, with schedule "fsdp2" only, is the
    ``zerosim.fsdp2`` section (such as ``{"reduce_every_micro_batch": True}``).
    """
    info = stage_info(name)
    if precision not in PRECISION_DTYPES:
        raise ValueError(f"precision must be one of {list(PRECISION_DTYPES)}, got {precision!r}")
    if precision != "fp32" and dtype != "float32":
        raise ValueError(
            f"dtype must be 'float32' with precision {precision!r} (fp32 master weights), "
            f"got {dtype!r}"
        )
    stage, layout = info.stage, info.layout
    if schedule == "fsdp2" and (stage != 3 or precision != "fp32"):
        raise ValueError(
            f"schedule 'fsdp2' runs stage 3 with precision 'fp32' (FSDP2 has no fp16/bf16 "
            f"sections), got stage {name!r} and precision {precision!r}"
        )
    if fsdp2 and schedule != "fsdp2":
        raise ValueError(f"fsdp2 {fsdp2!r} needs schedule 'fsdp2', got {schedule!r}")
    section = {"stage": stage, "reduce_bucket_size": bucket, **(STAGE3_PLAIN if stage == 3 else {})}
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {**section, **(zero or {})},
        "zerosim": {"dtype": dtype, "layout": layout, "schedule": schedule},
    }
    if fsdp2:
        config["zerosim"]["fsdp2"] = fsdp2
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def build_model(model: str, seed: int = 0) -> tuple[Any, Any]:
    """(model, dataset): the ``zerosim train`` models at a size that steps in milliseconds."""
    return workloads.build(model, seed=seed, block_size=16, n_layer=1, n_head=2, n_embd=32)


def fit_world(comm: Communicator, repeats: int = 5) -> dict[str, float] | None:
    """α (s) and B (bytes/s) fitted from float32 all-gathers timed on ``comm`` (None if N = 1).

    Each size is run ``repeats`` times; a call's time is the slowest rank's, and the median over
    repeats is fitted. If noise makes the fitted α negative, α = 0 and B is fitted alone.
    Collective: every rank gets the same answer.
    """
    if comm.size == 1:
        return None
    sizes, times = [], []
    with comm.phase("fit"):
        for elements in FIT_ELEMENTS:
            shard = np.ones(elements, dtype=np.float32)
            full = np.empty(elements * comm.size, dtype=np.float32)
            comm.all_gather(full, shard)  # warm-up
            took = np.empty(repeats)
            for i in range(repeats):
                comm.barrier()
                t0 = time.perf_counter()
                comm.all_gather(full, shard)
                took[i] = time.perf_counter() - t0
            comm.all_reduce(took, op="max")
            sizes.append(full.nbytes)
            times.append(float(np.median(took)))
    try:
        fit = fit_alpha_beta(sizes, times, comm.size, "all_gather")
    except ValueError as err:
        return {"error": str(err)}
    if fit.alpha >= 0:
        return {"alpha": fit.alpha, "bandwidth": fit.bandwidth, "residual_rms": fit.residual_rms}
    # noise can make the least-squares latency negative: then fit t = c_β·n/B alone (α = 0)
    x = alpha_beta_coefficients("all_gather", comm.size)[1] * np.asarray(sizes, dtype=float)
    t = np.asarray(times)
    beta = float(x @ t / (x @ x))
    rms = float(np.sqrt(np.mean((t - beta * x) ** 2)))
    return {"alpha": 0.0, "bandwidth": 1 / beta, "residual_rms": rms}


def _gather(comm: Communicator, values: list[float], dtype: Any) -> np.ndarray:
    mine = np.asarray(values, dtype=dtype)
    every = np.empty(comm.size * mine.size, dtype=dtype)
    with comm.phase("report"):
        comm.all_gather(every, mine)
    return every.reshape(comm.size, mine.size)


def persistent_numel(model: Any, world_size: int, threshold: int) -> int:
    """Ψ_persist: Σ ceil(numel_i / N)·N over the parameters of at most ``threshold`` elements.

    Stage 3 pads each parameter to a multiple of N (DeepSpeed's per-parameter partition) and
    keeps the small ones whole on every rank (``stage3_param_persistence_threshold``).
    """
    sizes = [p.numel for _, p in model.named_parameters() if p.numel <= threshold]
    return sum(-(-s // world_size) * world_size for s in sizes)


def _formula_bytes(
    name: str, n: int, padded: int, dtype: str, k: int, persistent: int = 0, gather: bool = True
) -> dict[str, int]:
    """{phase: bytes} of one step of the paper's schedule; Megatron's bf16 gradients are fp32
    (``grad_b``)."""
    param_b, grad_b = element_bytes(name, dtype)
    phases = step_bytes(STAGES[name].stage, n, padded, param_b, k, persistent, gather)
    if grad_b != param_b:  # only Megatron (stage 1): backward is its gradient reduce-scatter
        phases["backward"] = step_bytes(1, n, padded, grad_b, k)["backward"]
    return phases


def _deepspeed_formula_bytes(
    stage: int, n: int, rank: int, dtype: str, k: int, numels: list[int], order: list[int],
    zero: dict[str, Any],
) -> dict[str, int]:  # fmt: skip
    """{phase: bytes ``rank`` sends} of one step of DeepSpeed's schedule (stages 0-2)."""
    overlap = zero.get("overlap_comm", False)
    switches = {
        key: zero[key]
        for key in (
            "reduce_bucket_size",
            "reduce_scatter",
            "use_multi_rank_bucket_allreduce",
            "contiguous_gradients",
        )
        if key in zero
    }
    b = np.dtype(dtype).itemsize
    return step_bytes(
        stage, n, 0, b, k, schedule="deepspeed", numels=numels, rank=rank, order=order,
        overlap_comm=overlap, **switches,
    )  # fmt: skip


def fsdp2_formula(strategy: Any, accumulation: int, rank: int = 0) -> dict[str, int]:
    """FSDP2's bytes per step (``fsdp2_step_bytes``) from its FSDP modules' all-gather inputs:
    ceil(dim0 / N) rows of each parameter, and under an int reshard_after_forward g the
    ceil(dim0 / g) rows its blocks keep; ``rank`` in the whole world (its replica under HSDP)."""
    n, g = strategy.comm.size, strategy.reshard_after_forward
    shards, group_shards = [], []
    for mod in strategy.fetcher.fsdp_modules:
        where = [strategy.where[id(p)] for p in mod.params]
        shards.append(sum(strategy.groups[gi].partition.chunks[i] for gi, i in where))
        if not isinstance(g, bool):
            named = [("", strategy.groups[gi].partition.shapes[i]) for gi, i in where]
            group_shards.append(sum(dim0_partition(named, g).chunks))
    replicas = strategy.replicate_comm
    return fsdp2_step_bytes(
        shards,
        n,
        strategy.param_dtype.itemsize,
        strategy.reduce_dtype.itemsize,
        accumulation,
        g,
        strategy.reshard_after_backward,
        group_shards=group_shards or None,
        replicate=1 if replicas is None else replicas.size,
        replica=rank // n,
        reduce_every_micro_batch=strategy.reduce_every_micro_batch,
    )


def gradient_order(model: Any) -> list[int]:
    """Starts recording the order backward finishes ``model``'s gradients (parameter indices,
    the first backward's), which DeepSpeed's gradient buckets follow: returns the list that
    fills during that backward."""
    from zerosim.nn import GradReadyTracker

    index = {id(p): i for i, (_, p) in enumerate(model.named_parameters())}
    order: list[int] = []

    def ready(p: Any) -> None:
        if len(order) < len(index):
            order.append(index[id(p)])

    GradReadyTracker(model, ready)
    return order


def _watch_modules(model: Any, ledger: Any, events: list[dict[str, Any]]) -> None:
    """Time each parameter-owning module's forward and backward on the ledger's clock.

    Registered after the engine's own hooks, so a span starts once stage 3 has gathered the
    module's parameters and ends once it has released them.
    """
    owners = {name.rpartition(".")[0] for name, _ in model.named_parameters()}
    for name, module in model.named_modules():
        if name not in owners:
            continue
        for kind in ("forward", "backward"):

            def begin(*_: Any, name: str = name, kind: str = kind) -> None:
                events.append(
                    {"module": name, "pass": kind, "step": ledger.step, "start": ledger.now()}
                )

            def end(*_: Any, name: str = name, kind: str = kind) -> None:
                for e in reversed(events):
                    if e["module"] == name and e["pass"] == kind and "stop" not in e:
                        e["stop"] = ledger.now()
                        return

            if kind == "forward":
                module.register_forward_pre_hook(begin)
                module.register_forward_hook(end)
            else:
                module.register_full_backward_pre_hook(begin)
                module.register_full_backward_hook(end)


def _formula_rows(
    name: str,
    config: dict[str, Any],
    strategy: Any,
    model_dtype: str,
    net: Any,
    order: list[int],
    steps: int,
    persistent: int,
    gather: bool,
) -> list[dict[str, int]]:
    """{phase: bytes} each rank sends by the formulas of the run's schedule, one per rank."""
    n, pad, knobs = strategy.comm.size, strategy.padded_numel, config["zero_optimization"]
    schedule, k = config["zerosim"]["schedule"], config["gradient_accumulation_steps"]
    coordinator = coordinator_kind(strategy)
    if schedule == "fsdp2":
        return [fsdp2_formula(strategy, k, r) for r in range(n)]
    if schedule == "deepspeed" and strategy.stage < 3 and name != "megatron":
        numels = [p.numel for _, p in net.named_parameters()]
        formulas = [
            _deepspeed_formula_bytes(strategy.stage, n, r, model_dtype, k, numels, order, knobs)
            for r in range(n)
        ]
    elif coordinator == "deepspeed" and steps < 2 and persistent and k == 1:
        # the first step records the trace: DeepSpeed's coordinator gathers the persistent
        # parameters around every module too, both ways, then all-gathers them after the step
        formula = _formula_bytes(name, n, pad, model_dtype, k)
        formula["step"] = _formula_bytes(name, n, pad, model_dtype, k, persistent)["step"]
        formulas = [formula] * n
    else:
        formulas = [_formula_bytes(name, n, pad, model_dtype, k, persistent, gather)] * n
    return formulas


def _memory_formula(
    name: str,
    stage: int,
    pad: int,
    n: int,
    model_dtype: str,
    precision: str,
    states: int,
    persistent: int,
) -> tuple[list[str], list[int]]:
    """(categories, bytes each rank holds in each) by the ZeRO paper's model states."""
    categories = list(MEMORY)
    if precision != "fp32":
        categories.insert(3, "master_grads")  # Megatron's fp16 main-grad shard
    memory = model_states(name, pad, n, model_dtype, states).as_dict()
    if stage == 3:
        categories.append("persistent_params")
        memory["persistent_params"] = persistent * np.dtype(model_dtype).itemsize
    return categories, [memory[c] for c in categories]


def _boundary_rows(
    formulas: list[dict[str, int]], phases: tuple[str, ...], checks: dict[str, int], elements: int
) -> list[list[int]]:
    """Each rank's bytes of ``phases``: the schedule's ``formulas``, then clip and overflow,
    all-reduces of ``elements`` elements of the schedule's dtypes (none: 0); ``elements`` is 1
    except under FSDP2, whose norm sends one per parameter (torch's clip_grad_norm_)."""
    n = len(formulas)
    return [
        [
            formula[p]
            if p in formula
            else clip_bytes(n, r, checks[p], elements)
            if p in checks
            else 0
            for p in phases
        ]
        for r, formula in enumerate(formulas)
    ]


def _predicted(
    name: str,
    config: dict[str, Any],
    net: Any,
    engine: Any,
    steps: int,
    precision: str,
    order: list[int],
) -> dict[str, Any]:
    """The formulas' side of :func:`run_stage`: bytes per phase per rank, memory per category.

    Ψ_pad of the paper's schedule is the engine's (its layout's padding); DeepSpeed's schedule
    takes the model's parameter sizes and ``order``, the order backward finished them.
    """
    strategy, n = engine.strategy, engine.comm.size
    model_dtype = config["zerosim"]["dtype"] if precision == "fp32" else PRECISION_DTYPES[precision]
    pad, knobs = strategy.padded_numel, config["zero_optimization"]
    schedule = config["zerosim"]["schedule"]
    persistent = 0
    if strategy.stage == 3:
        persistent = persistent_numel(net, n, knobs["stage3_param_persistence_threshold"])
    # the last step's backward: are the non-persistent parameters gathered again? (None:
    # DeepSpeed's module trace decides, and the formula is the paper's regathering one)
    coordinator = coordinator_kind(strategy)
    gather = stage3_backward_gathers(coordinator, knobs, pad - persistent, steps >= 2)
    gather = True if gather is None else gather
    formulas = _formula_rows(
        name, config, strategy, model_dtype, net, order, steps, persistent, gather
    )
    checks = boundary_messages(
        strategy.stage,
        schedule=schedule,
        precision=precision,
        clip=config["gradient_clipping"],
        float64=model_dtype == "float64",
    )
    phases = PHASES + (("overflow",) if "overflow" in checks else ())
    elements = len(list(net.named_parameters())) if schedule == "fsdp2" else 1
    per_rank = _boundary_rows(formulas, phases, checks, elements)
    states = len(engine.optimizer.state_keys(engine.optimizer.param_groups[0]))
    categories, memory = _memory_formula(
        name, strategy.stage, pad, n, model_dtype, precision, states, persistent
    )
    return {
        "phases": list(phases),
        "bytes": per_rank,
        "categories": categories,
        "memory": memory,
        "persistent_numel": persistent,
        "itemsize": element_bytes(name, model_dtype)[0],
        "num_states": states,
    }


def _train(engine: Any, loader: Any, steps: int, accumulation: int) -> list[float]:
    """Train until ``steps`` optimizer steps are done; the wall time of each, in seconds."""
    batches, step_times = iter(loader), []
    while engine.global_steps < steps:
        t0 = time.perf_counter()
        for _ in range(accumulation):
            x, y = next(batches)
            engine.backward(engine(x, y))
            engine.step()
        step_times.append(time.perf_counter() - t0)
    return step_times


def _alpha_beta_time(records: list[Any], fit: dict[str, float] | None) -> float | None:
    """The α-β model's time for ``records``' collectives, when ``fit`` has an α."""
    if fit is None or "alpha" not in fit:
        return None
    return sum(
        collective_time(r.op, r.size_bytes, r.peers, fit["alpha"], fit["bandwidth"])
        for r in records
    )


def _measured(
    comm: Communicator,
    engine: Any,
    want: dict[str, Any],
    last: list[Any],
    step_times: list[float],
    fit: dict[str, float] | None,
) -> dict[str, Any]:
    """The "bytes", "memory" and "time" sections of :func:`run_stage`'s result (and stage 3's
    peak of gathered parameters): every rank's measurement beside the formulas (collective)."""
    measured_bytes = [sum(r.bytes_sent for r in last if r.phase == p) for p in want["phases"]]
    comm_time = sum(r.wall_time or 0.0 for r in last)
    report = engine.memory_report()
    report["optimizer_states"] = sum(
        v for c, v in report.items() if c.startswith("optimizer_state.")
    )
    held = [report.get(c, 0) for c in want["categories"]]
    bytes_rows = _gather(comm, measured_bytes, np.int64).tolist()
    memory_rows = _gather(comm, held, np.int64).tolist()
    times = _gather(comm, [float(np.median(step_times)), comm_time], np.float64).max(axis=0)
    sections = {
        "bytes": {
            "phases": want["phases"],
            "measured": bytes_rows,
            "formula": want["bytes"],
            "equal": bytes_rows == want["bytes"],
        },
        "memory": {
            "categories": want["categories"],
            "measured": memory_rows,
            "formula": want["memory"],
            "equal": all(row == want["memory"] for row in memory_rows),
        },
        "time": {
            "step_s": float(times[0]),
            "collectives_s": float(times[1]),
            "alpha_beta_s": _alpha_beta_time(last, fit),
        },
    }
    for key in ("peak_gathered_params", "peak_accumulated_grads"):  # stage 3; FSDP2's reducer
        if key in report:
            sections[key] = _gather(comm, [report[key]], np.int64)[:, 0].tolist()
    return sections


def run_stage(
    comm: Communicator,
    name: str,
    model: str = "mlp",
    steps: int = 3,
    dtype: str = "float32",
    accumulation: int = 1,
    fit: dict[str, float] | None = None,
    keep_records: bool = False,
    bucket: int = 20000,
    precision: str = "fp32",
    zero: dict[str, Any] | None = None,
    schedule: str = "deepspeed",
    fsdp2: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train stage ``name`` for ``steps`` optimizer steps on ``comm``; measured vs predicted.

    Collective. The returned dict (the same on every rank) has ``bytes`` and ``memory`` with
    ``measured`` (one row per rank), ``formula`` and ``equal``, ``time`` (rank-maximum wall times
    in seconds and the α-β prediction when ``fit`` has one) and ``fsdp2``, the run's
    ``zerosim.fsdp2`` section. ``keep_records`` adds ``records``: this rank's ledger records of
    the last step, as dicts (they differ by rank), and ``events``: its modules' spans in it.
    ``bucket`` is ``reduce_bucket_size``; the other knobs go to :func:`stage_config`.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    net, data = build_model(model)
    config = stage_config(name, dtype, accumulation, bucket, precision, zero, schedule, fsdp2)
    comm.ledger.reset()
    comm.ledger.step = 0
    order = gradient_order(net)
    engine, _, loader, _ = initialize(net, config, comm=comm, training_data=data)
    events: list[dict[str, Any]] = []
    if keep_records:
        _watch_modules(net, comm.ledger, events)
    step_times = _train(engine, loader, steps, accumulation)
    want = _predicted(name, config, net, engine, steps, precision, order)
    last = [r for r in comm.ledger.select(step=steps - 1) if r.phase in want["phases"]]
    sections = _measured(comm, engine, want, last, step_times, fit)
    strategy = engine.strategy
    out = {
        "name": name,
        "schedule": schedule,
        "stage": strategy.stage,
        "layout": strategy.layout_kind,
        "precision": precision,
        "numel": sum(p.numel for _, p in net.named_parameters()),
        "padded_numel": strategy.padded_numel,
        "persistent_numel": want["persistent_numel"],
        "itemsize": want["itemsize"],
        "num_states": want["num_states"],
        "skipped_steps": engine.skipped_steps,
        "loss_scale": engine.loss_scale,
        "fsdp2": config["zerosim"].get("fsdp2", {}),
        **sections,
    }
    if keep_records:
        out["records"] = [asdict(r) for r in last]
        out["events"] = [e for e in events if e["step"] == steps - 1 and "stop" in e]
    return out


def compare(
    comm: Communicator,
    stages: list[str] | None = None,
    model: str = "mlp",
    steps: int = 3,
    dtype: str = "float32",
    accumulation: int = 1,
    precision: str = "fp32",
    schedules: tuple[str, ...] | None = None,
    fsdp2: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Fit α and B on ``comm``, then :func:`run_stage` every stage under every schedule (in that
    order: all stages of the first schedule first; "fsdp2" runs stage 3 only, with the
    ``zerosim.fsdp2`` section ``fsdp2``); the report (collective)."""
    stages = list(STAGES) if stages is None else stages
    schedules = EVERY_STAGE_SCHEDULES if schedules is None else schedules
    for schedule in schedules:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if "fsdp2" in schedules and precision != "fp32":
        raise ValueError(
            f"precision must be 'fp32' with schedule 'fsdp2' (FSDP2 has no fp16/bf16 sections), "
            f"got {precision!r}"
        )
    if fsdp2 and "fsdp2" not in schedules:
        raise ValueError(f"fsdp2 {fsdp2!r} needs 'fsdp2' among the schedules, got {schedules!r}")
    fit = fit_world(comm)
    rows = [
        run_stage(
            comm,
            s,
            model,
            steps,
            dtype,
            accumulation,
            fit,
            precision=precision,
            schedule=sched,
            fsdp2=fsdp2 if sched == "fsdp2" else None,
        )
        for sched in schedules
        for s in stages
        if sched != "fsdp2" or STAGES[s].stage == 3  # FSDP2's is a stage-3 schedule
    ]
    ok = all(r["bytes"]["equal"] and r["memory"]["equal"] for r in rows)
    return {
        "world_size": comm.size,
        "model": model,
        "dtype": dtype,
        "precision": precision,
        "accumulation": accumulation,
        "steps": steps,
        "schedules": list(schedules),
        "fit": fit,
        "stages": rows,
        "ok": ok,
    }


def _format_stage(row: dict[str, Any], precision: str) -> list[str]:
    """One stage's lines of :func:`format_report`: bytes and memory per rank against the
    formulas, and the step's times."""
    b = row["bytes"]
    scale = "" if precision != "fp16" else f", loss scale {row['loss_scale']:g}"
    skipped = f", {row['skipped_steps']} steps skipped" if row["skipped_steps"] else ""
    schedule = row.get("schedule", "deepspeed")
    if row.get("fsdp2", {}).get("reduce_every_micro_batch"):
        schedule += "'s schedule reducing every micro-batch"
    else:
        schedule += "'s schedule"
    lines = [
        f"stage {row['name']}, {schedule} (Ψ = {row['numel']:,}, "
        f"Ψ_pad = {row['padded_numel']:,}, b = {row['itemsize']}, "
        f"K_s = {row['num_states']}{scale}{skipped})",
        f"  bytes sent in the last step {'':<6}" + "".join(f"{p:>12}" for p in b["phases"]),
    ]
    for r, (got, want) in enumerate(zip(b["measured"], b["formula"], strict=True)):
        verdict = "OK" if got == want else f"MISMATCH (formula {want})"
        lines.append(f"  rank {r:<28}" + "".join(f"{v:>12,}" for v in got) + f"   {verdict}")
    m = row["memory"]
    lines.append(f"  bytes held {'':<22}" + "".join(f"{c:>18}" for c in m["categories"]))
    for r, got in enumerate(m["measured"]):
        lines.append(f"  rank {r:<28}" + "".join(f"{v:>18,}" for v in got))
    verdict = "OK" if m["equal"] else "MISMATCH"
    lines.append(
        f"  {'formula':<33}" + "".join(f"{v:>18,}" for v in m["formula"]) + f"   {verdict}"
    )
    if "peak_gathered_params" in row:
        peaks = ", ".join(f"{v:,}" for v in row["peak_gathered_params"])
        lines.append(f"  peak gathered parameters (bytes, per rank): {peaks}")
    if "peak_accumulated_grads" in row:  # FSDP2: unsharded gradients kept between micro-batches
        kept = ", ".join(f"{v:,}" for v in row["peak_accumulated_grads"])
        lines.append(f"  unsharded gradients kept between micro-batches (bytes, per rank): {kept}")
    t = row["time"]
    predicted = "n/a" if t["alpha_beta_s"] is None else f"{t['alpha_beta_s'] * 1e3:.2f} ms"
    lines.append(
        f"  time per step {t['step_s'] * 1e3:.2f} ms; its collectives "
        f"{t['collectives_s'] * 1e3:.2f} ms measured, {predicted} α-β"
    )
    return lines


def format_report(report: dict[str, Any]) -> str:
    """The report as the text ``zerosim compare`` prints."""
    n, k = report["world_size"], report["accumulation"]
    precision = report.get("precision", "fp32")
    kind = report["dtype"] if precision == "fp32" else f"{precision} mixed precision"
    lines = [f"zerosim compare: {report['model']} on {n} ranks, {kind}, k = {k}"]
    fit = report["fit"]
    if fit is None:
        lines.append("α-β fit: none (one rank moves no bytes)")
    elif "error" in fit:
        lines.append(f"α-β fit failed: {fit['error']}")
    else:
        lines.append(
            f"α-β fit from all-gathers: α = {fit['alpha'] * 1e6:.1f} µs, "
            f"B = {fit['bandwidth'] / 1e9:.3f} GB/s "
            f"(rms residual {fit['residual_rms'] * 1e6:.1f} µs)"
        )
    for row in report["stages"]:
        lines += ["", *_format_stage(row, precision)]
    totals = _schedule_totals(report["stages"])
    if len(totals) > 1:
        lines += ["", "bytes rank 0 sent in the last step, by schedule (measured):"]
        names = list(totals)
        lines.append(f"  {'stage':<10}" + "".join(f"{s:>14}" for s in names) + f"{'ratio':>9}")
        for stage in totals[names[0]]:
            values = [totals[s].get(stage) for s in names]
            if None in values:
                continue
            ratio = f"{values[0] / values[1]:>9.3f}" if values[1] else ""
            lines.append(f"  {stage:<10}" + "".join(f"{v:>14,}" for v in values) + ratio)
    lines += ["", "all bytes and memory equal the formulas" if report["ok"] else "MISMATCH"]
    return "\n".join(lines)


def _schedule_totals(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """{schedule: {stage name: bytes rank 0 sent in the last step, all phases}}."""
    totals: dict[str, dict[str, int]] = {}
    for row in rows:
        sent = sum(row["bytes"]["measured"][0])
        totals.setdefault(row.get("schedule", "deepspeed"), {})[row["name"]] = sent
    return totals
