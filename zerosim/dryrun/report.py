"""The dry run's report: per class of rank, what the engine held, sent and computed, beside the
formulas (the object ``zerosim dryrun --json`` prints; docs/dryrun.md lists its fields)."""

from __future__ import annotations

import json
from typing import Any

from zerosim import analysis
from zerosim.analysis.volume import stage3_backward_gathers
from zerosim.dryrun.run import ModelRecipe, RankRun, host_peak_rss_bytes
from zerosim.dryrun.timeline import ClusterModel, StepTime, host_breakdown, simulate

GIB = 2**30

# memory_report() entries that are model states (the rest are buffers, peaks and the like)
MODEL_STATES = (
    "params",
    "persistent_params",
    "hpz_secondary_params",
    "grads",
    "master_params",
    "master_grads",
)


def model_states_bytes(report: dict[str, int]) -> int:
    """Parameters (partitioned, persistent, hpZ's secondary), gradients, master weights and
    optimizer states: what ZeRO partitions."""
    states = sum(v for k, v in report.items() if k.startswith("optimizer_state."))
    return states + sum(report.get(k, 0) for k in MODEL_STATES)


def formulas(facts: dict[str, Any], world_size: int) -> dict[str, Any]:
    """The ZeRO paper's model states and bytes per step (Ψ padded as the engine pads it), and
    DeepSpeed's estimator, for this run's stage, dtypes and world."""
    n, stage = world_size, facts["stage"]
    psi, padded = facts["params"], facts["padded_params"]
    states = analysis.zero_model_states(
        padded,
        n,
        stage,
        param_bytes=facts["param_bytes"],
        master_bytes=facts["master_bytes"],
        state_bytes=4 if facts["master_bytes"] else facts["param_bytes"],
        num_states=facts["num_states"],
    )
    gathered = padded - facts["persistent_padded_params"]
    backward = (
        bool(stage3_backward_gathers("paper", facts["zero"], gathered)) if stage == 3 else True
    )
    sent = analysis.step_bytes(
        stage,
        n,
        padded,
        facts["comm_bytes"],
        facts["accumulation"],
        facts["persistent_padded_params"],
        backward,
        schedule="paper",
    )
    per_node = facts["ranks_per_node"] or n
    nodes = max(1, -(-n // per_node))
    estimator = None
    if stage == 3:
        _, estimator, _ = analysis.estimate_zero3_model_states_mem_needs(
            psi, facts["largest_layer_params"], min(per_node, n), nodes, False, False
        )
    elif stage in (1, 2):
        _, estimator = analysis.estimate_zero2_model_states_mem_needs(
            psi, min(per_node, n), nodes, cpu_offload=False
        )
    out = {
        "paper": {"model_states_bytes": int(states.total), "bytes_sent": sent},
        "deepspeed_estimator": {"model_states_bytes": estimator},
    }
    if (flops := model_flops(facts)) is not None:
        out["model_flops"] = flops
    return out


def model_flops(facts: dict[str, Any]) -> int | None:
    """The model FLOPs of one step of a transformer (its family's count per token,
    ``analysis.transformer_flops_per_token``, times the step's tokens); None for other models."""
    desc = facts.get("description")
    if desc is None:
        return None
    tokens = facts["micro_batch"] * facts["accumulation"] * desc.seq
    return analysis.transformer_flops_per_token(desc, facts.get("recompute", False)) * tokens


def step_time(
    runs: list[tuple[list[int], RankRun]],
    world_size: int,
    cluster: ClusterModel,
    model: ModelRecipe | None = None,
    recompute: bool = False,
    spans: bool = False,
) -> tuple[dict[str, Any], StepTime]:
    """The ``time`` entry: each representative's last step simulated on ``cluster`` (resized to
    ``world_size`` ranks), the slowest one reported (every rank waits for it at the next
    collective), with model TFLOP/s per device: the family's model FLOPs for a transformer
    (``model_flops``; Narayanan et al.'s eq. 3 for a GPT), else the counted matmul FLOPs, over
    the step time. Matrix products run at the peak of the run's dtype
    (``ClusterModel.for_dtype``: fp32 runs at ``device_flops_fp32``). ``fits_device``: every
    representative's step peak fits the cluster's device memory (true where the file gives
    none); where it is false the step would not start, and its times are only what it would
    take."""
    resized = cluster.resized(world_size).for_dtype(runs[0][1].facts["model_dtype"])
    slowest, run = max(
        ((simulate(run.events, run.comm.calls, resized, spans), run) for _, run in runs),
        key=lambda pair: pair[0].step_s,
    )
    facts = {**runs[0][1].facts, "recompute": recompute}
    if model is not None and model.desc is not None:
        facts["description"] = model.desc
    counted = model_flops(facts)
    flops = float(run.step_flops if counted is None else counted)
    peak = max(r.tracker["peak_bytes"] for _, r in runs)
    memory = cluster.device_memory_bytes
    time = {
        **slowest.as_dict(),
        "peak_bytes": peak,
        "fits_device": memory is None or peak <= memory,
        "tflops_per_device": flops / slowest.step_s / 1e12 if slowest.step_s else 0.0,
        "counted_tflops_per_device": run.step_flops / slowest.step_s / 1e12
        if slowest.step_s
        else 0.0,
        "cluster": {
            "name": cluster.name,
            "nodes": resized.cluster.nodes,
            "devices_per_node": resized.cluster.devices_per_node,
            "device_flops": resized.cluster.device_flops,  # the peak of the run's dtype
            "software_factor": cluster.software_factor,
        },
    }
    if cluster.prices_elementwise:  # a host: what its compute stream spent the step on
        time["host"] = host_breakdown(run.events, resized, slowest.cold_huge_pages)
    return time, slowest


def against_device(report: dict[str, Any], device_memory_bytes: float) -> dict[str, Any]:
    """The report with each entry's ``fits_device`` (its step's peak at most the device's memory)
    and, where it does not, ``would_not_start``; ``fits_device`` at the top is every entry's.
    ``init_peak_bytes`` is not compared: it counts zerosim's ``initialize`` without ``zero.Init``,
    which a real run avoids."""
    ranks = []
    for entry in report["ranks"]:
        fits = entry["peak_bytes"] <= device_memory_bytes
        verdict = {"fits_device": fits}
        if not fits:
            verdict["would_not_start"] = (
                f"peak {entry['peak_bytes'] / GIB:.3g} GiB > device "
                f"{device_memory_bytes / GIB:.3g} GiB"
            )
        ranks.append({**entry, **verdict})
    return {
        **report,
        "ranks": ranks,
        "device_memory_bytes": device_memory_bytes,
        "fits_device": all(e["fits_device"] for e in ranks),
    }


def summarize(
    runs: list[tuple[list[int], RankRun]], world_size: int, ranks_wall_s: float, all_ranks: bool
) -> dict[str, Any]:
    """The report: ranks grouped by everything it shows (members of a class of rank that also
    send the same bytes), with the formulas beside them. ``wall_s`` is ``ranks_wall_s`` until
    ``dry_run`` sets it to its whole cost."""
    first = runs[0][1]
    facts = first.facts
    entries: dict[tuple, dict[str, Any]] = {}
    for members, run in runs:
        for r in members:
            sent = run.comm.bytes_by_phase(r, step=run.last_step)
            sent.pop("init", None)  # initialize()'s calls share step 0 with the first step
            by_phase = {phase: t["sent"] for phase, t in sorted(sent.items())}
            received = {phase: t["recv"] for phase, t in sorted(sent.items())}
            inter = {phase: t["inter"] for phase, t in sorted(sent.items())}
            entry = _entry(run, by_phase, received, inter)
            key = json.dumps(entry, sort_keys=True)  # ranks showing the same are one entry
            entries.setdefault(key, entry)["ranks"].append(r)
    return {
        "world_size": world_size,
        "params": facts["params"],
        "padded_params": facts["padded_params"],
        "stage": facts["stage"],
        "schedule": facts["schedule"],
        "dtype": facts["model_dtype"],
        "micro_batch": facts["micro_batch"],
        "accumulation": facts["accumulation"],
        "ranks_run": len(runs),
        "all_ranks": all_ranks,
        "wall_s": round(ranks_wall_s, 3),
        "ranks_wall_s": round(ranks_wall_s, 3),
        "host_peak_rss_bytes": host_peak_rss_bytes(),
        "ranks": sorted(entries.values(), key=lambda e: e["ranks"][0]),
        "formula": formulas(facts, world_size),
    }


def _entry(
    run: RankRun, by_phase: dict[str, int], received: dict[str, int], inter: dict[str, int]
) -> dict[str, Any]:
    tracker = run.tracker
    return {
        "ranks": [],
        "model_states_bytes": model_states_bytes(run.memory),
        "peak_bytes": tracker["peak_bytes"],
        "step_start_bytes": run.step_start_bytes,
        "activation_peak_bytes": tracker["peak"]["activations"],
        "peak_bytes_by_category": tracker["peak"],
        "init_peak_bytes": run.init_peak_bytes,
        "memory_report": run.memory,
        "bytes_sent": by_phase,
        "bytes_received": received,
        "inter_node_bytes_sent": inter,
        "flops": run.step_flops,
        "ops": run.tracker["ops"],
    }
