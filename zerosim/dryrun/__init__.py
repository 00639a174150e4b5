"""The dry run: the engine over a virtual world of N ranks on shape-only arrays (docs/dryrun.md).

from zerosim.dryrun import dry_run
report = dry_run("gpt3-175b", 1024, "ds_config.json")   # what `zerosim dryrun --json` prints
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from zerosim.dryrun.report import summarize
from zerosim.dryrun.run import ModelRecipe, RankRun, recipe, records_of, run_world


def dry_run(
    model: str | ModelRecipe,
    world_size: int,
    config: dict | str | Path,
    *,
    micro_batch: int | None = None,
    recompute: bool = False,
    all_ranks: bool = False,
    steps: int = 2,
    overflow: bool = False,
    fill: float = 0.0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run ``model`` (a name ``recipe`` knows, or a recipe) on ``world_size`` virtual ranks with
    ``config`` (a DeepSpeed JSON config, dict or path; its ``zerosim.backend`` becomes "meta")
    for ``steps`` optimizer steps; return the report of the last one (docs/dryrun.md)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    runs, wall = run_world(
        recipe(model) if isinstance(model, str) else model,
        world_size,
        config,
        micro_batch=micro_batch,
        steps=steps,
        recompute=recompute,
        all_ranks=all_ranks,
        overflow=overflow,
        fill=fill,
        progress=progress,
    )
    return summarize(runs, world_size, wall, all_ranks)


__all__ = ["ModelRecipe", "RankRun", "dry_run", "recipe", "records_of", "run_world"]
