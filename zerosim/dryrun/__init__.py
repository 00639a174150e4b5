"""The dry run: the engine over a virtual world of N ranks on shape-only arrays (docs/dryrun.md).

from zerosim.dryrun import dry_run
report = dry_run("gpt3-175b", 1024, "examples/ds_config_dryrun_bf16.json")  # what --json prints
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from time import perf_counter
from typing import Any

from zerosim.dryrun.plots import plot_step_memory
from zerosim.dryrun.report import against_device, step_time, summarize
from zerosim.dryrun.run import ModelRecipe, RankRun, recipe, records_of, run_world
from zerosim.dryrun.timeline import ClusterModel, chrome_trace, load_cluster_model
from zerosim.nn.description import ModelDescription

# The steps a dry run on a calibrated host runs: zerosim train's step_s leaves out its first two
# (``WARMUP_STEPS``), so the third is the first step it times. A step's allocations settle by
# then (glibc's mmap threshold rises as mappings are freed, over the first steps).
HOST_STEPS = 3


def dry_run(
    model: str | ModelDescription | ModelRecipe,
    world_size: int,
    config: dict | str | Path,
    *,
    micro_batch: int | None = None,
    recompute: bool = False,
    all_ranks: bool = False,
    steps: int | None = None,
    overflow: bool = False,
    fill: float = 0.0,
    cluster: str | Path | ClusterModel | None = None,
    trace: str | Path | None = None,
    plot: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
    backend: str | None = None,
) -> dict[str, Any]:
    """Run ``model`` (a name or description ``recipe`` knows, or a recipe) on ``world_size``
    virtual ranks with ``config`` (a DeepSpeed JSON config, dict or path; its ``zerosim.backend``
    becomes "meta") for ``steps`` optimizer steps (None: ``HOST_STEPS`` on a host's NumPy path,
    else 2); return the report of the last one (docs/dryrun.md). With ``cluster`` (a cluster
    JSON or a ``ClusterModel``) the report has the step's ``time``, and ``trace`` / ``plot``
    write the simulated step as a Chrome trace / the memory over it; where the cluster gives
    its device memory, ``fits_device`` says whether every rank's peak fits (false: a step that
    would not start, its time only what it would take). ``backend`` ("numpy", "cupy" or
    "torch") is the array backend the run stands for, whose code path the shape-only arrays
    follow (memory, operations; "torch": CuPy's, each fused chain of a layer one kernel,
    ``meta.fusion``); None follows the cluster's (a host from ``zerosim calibrate``: numpy;
    the published GPU clusters: cupy or torch), else cupy. ``wall_s`` is the whole call's
    cost here, ``ranks_wall_s`` the ranks' runs alone."""
    start = perf_counter()
    if (trace or plot) and cluster is None:
        raise ValueError("trace and plot draw the simulated step: give a cluster too")
    if isinstance(cluster, str | Path):
        cluster = load_cluster_model(cluster)
    if backend is None:
        backend = "cupy" if cluster is None else cluster.backend
    steps = _steps(steps, host=cluster is not None and backend == "numpy")
    _check_positive_ints(world_size=world_size, steps=steps)
    model = model if isinstance(model, ModelRecipe) else recipe(model)
    runs, ranks_wall = run_world(
        model,
        world_size,
        config,
        micro_batch=micro_batch,
        steps=steps,
        recompute=recompute,
        all_ranks=all_ranks,
        overflow=overflow,
        fill=fill,
        memory_events=plot is not None,
        progress=progress,
        backend=backend,
        op_events=cluster is not None and cluster.prices_elementwise,
    )
    report = {**summarize(runs, world_size, ranks_wall, all_ranks), "backend": backend}
    if cluster is not None:
        report = _with_time(report, runs, cluster, model, recompute, trace, plot)
    report["wall_s"] = round(perf_counter() - start, 3)
    return report


def _with_time(
    report: dict[str, Any],
    runs: list[tuple[list[int], RankRun]],
    cluster: ClusterModel,
    model: ModelRecipe,
    recompute: bool,
    trace: str | Path | None,
    plot: str | Path | None,
) -> dict[str, Any]:
    """The report with the step simulated on ``cluster`` (and the trace and plot written)."""
    world_size = report["world_size"]
    if cluster.device_memory_bytes is not None:
        report = against_device(report, cluster.device_memory_bytes)
    report["time"], step = step_time(
        runs, world_size, cluster, model, recompute, spans=bool(trace or plot)
    )
    title = f"{model.name}, {world_size} ranks"
    if trace is not None:
        Path(trace).write_text(json.dumps(chrome_trace(step, title)))
    if plot is not None:
        plot_step_memory(step, plot, title, cluster.device_memory_bytes)
    return report


def _steps(steps: int | None, host: bool) -> int:
    """``steps``, or when None ``HOST_STEPS`` on a host's NumPy path, else 2."""
    return (HOST_STEPS if host else 2) if steps is None else steps


def _check_positive_ints(**values: Any) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


__all__ = [
    "ClusterModel",
    "ModelRecipe",
    "RankRun",
    "dry_run",
    "load_cluster_model",
    "recipe",
    "records_of",
    "run_world",
]
