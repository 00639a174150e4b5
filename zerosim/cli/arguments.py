"""argparse types for the ``zerosim`` commands: a bad value is refused while the command line
is parsed (on every rank, before anything runs) with argparse's message, which names the
argument, the value and what is allowed: ``argument --steps: must be an integer >= 1, got 0``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An integer ``>= minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value

    return parse


def parameter_count(text: str) -> float:
    """A number of parameters Ψ: a whole number >= 0, written as ``1000000`` or ``1e6``."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0 and value.is_integer()):
        raise argparse.ArgumentTypeError(
            f"must be a whole number of parameters >= 0 (such as 1e6), got {text!r}"
        )
    return value
