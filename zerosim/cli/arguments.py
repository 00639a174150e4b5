"""argparse types for the ``zerosim`` commands: a bad value is refused while the command line
is parsed (on every rank, before anything runs) with argparse's message, which names the
argument, the value and what is allowed: ``argument --steps: must be an integer >= 1, got 0``.
Bad input found later (a config file, a checkpoint folder) is refused by ``refuse``: one line,
exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from decimal import Decimal, InvalidOperation

# The largest Ψ the teaching commands accept: a million times the largest models trained so far,
# and small enough that every count they print is exact.
MAX_PARAMETERS = 10**18


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


def parameter_count(text: str) -> int:
    """A number of parameters Ψ: a whole number from 0 to ``MAX_PARAMETERS``, written as
    ``1000000``, ``1e6`` or ``7.5e9``, read exactly: ``123456789012345678`` stays that number,
    where a float would make it 123,456,789,012,345,680."""
    try:
        value = Decimal(text)
    except InvalidOperation:
        value = Decimal("NaN")
    if not (value.is_finite() and value == value.to_integral_value()):
        value = Decimal(-1)
    if not 0 <= value <= MAX_PARAMETERS:
        raise argparse.ArgumentTypeError(
            f"must be a whole number of parameters from 0 to 1e18 (such as 7.5e9), got {text!r}"
        )
    return int(value)


def refuse(command: str, message: str) -> int:
    """Write ``zerosim COMMAND: MESSAGE`` to stderr as one line and return exit code 2.

    The line and its newline go out in one write: under mpirun every rank may refuse at once,
    and a message and its newline written apart (``print`` does that) let two ranks' lines
    splice into one.
    """
    sys.stderr.write(f"zerosim {command}: {message}\n")
    sys.stderr.flush()
    return 2
