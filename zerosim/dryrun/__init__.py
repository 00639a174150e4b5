"""The dry run: the engine over a virtual world of N ranks on shape-only arrays (docs/dryrun.md).

from zerosim.dryrun import dry_run
report = dry_run("gpt3-175b", 1024, "ds_config.json")   # a dict: what --json prints
"""

from zerosim.dryrun.run import ModelRecipe, RankRun, recipe, records_of, run_world

__all__ = ["ModelRecipe", "RankRun", "recipe", "records_of", "run_world"]
