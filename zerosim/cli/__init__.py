"""The ``zerosim`` command (``python -m zerosim``): ``main.py`` parses and dispatches,
``train.py`` is the training demo (the main job), ``teaching.py`` the commands that print the
formulas and measurements (memory, volume, project, compare, plot). docs/cli.md."""

from zerosim.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
