"""Freed memory taken back: what touching it again costs, by how long it was left free.

    python benchmarks/page_reclaim.py [--ages 0.05 0.1 0.3 1 3] [--repeats 3] [--json PATH]

A virtual machine with free page reporting hands free memory back to its host a while after it
was freed, and the next first touch of it pays the host's fault as well (``zerosim calibrate``'s
``measure_reclaim`` times this for 2 MiB pages, and the dry run prices it: docs/dryrun.md, "A
host"). Here both kinds are timed by the age of the freed memory: a fresh mapping (16 MiB
advised against huge pages, 64 MiB advised for them: ``calibrate.touch_fresh``) is touched right
after one of the same size was freed ("warm"), and again after the process left it free for each
age, once asleep (``time.sleep``) and once busy (spinning on a small array), so that the memory's
age and the CPU's idling can be told apart. Prints µs a page, the median of ``--repeats``. Where
nothing is taken back every age costs the warm touch. About a minute at the default ages; Linux
only (it advises pages with ``madvise``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zerosim.dryrun.calibrate import touch_fresh  # noqa: E402

SIZES = {False: 16 << 20, True: 64 << 20}  # bytes of the mapping: 4 KiB pages, 2 MiB pages


def busy(seconds: float) -> None:
    """Keep the CPU busy for ``seconds`` without touching fresh memory."""
    end, work = time.perf_counter() + seconds, np.ones(1024)
    while time.perf_counter() < end:
        work += 1.0


def after(huge: bool, age: float, wait) -> float:
    """Seconds a page of a fresh mapping touched ``age`` seconds after one of the same size was
    freed, the process spending them in ``wait``."""
    touch_fresh(SIZES[huge], huge)
    wait(age)
    return touch_fresh(SIZES[huge], huge)


def measure(ages: list[float], repeats: int) -> list[dict]:
    rows = []
    for huge in (False, True):
        for age in [0.0, *ages]:
            asleep = [after(huge, age, time.sleep) for _ in range(repeats)]
            spinning = [after(huge, age, busy) for _ in range(repeats)]
            rows.append(
                {
                    "page": "2 MiB" if huge else "4 KiB",
                    "age_s": age,
                    "asleep_us": statistics.median(asleep) * 1e6,
                    "busy_us": statistics.median(spinning) * 1e6,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ages", type=float, nargs="+", default=[0.05, 0.1, 0.3, 1.0, 3.0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    for name, value in (("--repeats", args.repeats), *(("--ages", a) for a in args.ages)):
        if value < (1 if name == "--repeats" else 0):
            allowed = "at least 1" if name == "--repeats" else "0 or more seconds"
            parser.error(f"{name} must be {allowed}; got {value}")
    rows = measure(args.ages, args.repeats)
    print(f"{'page':>6} {'left free s':>11} {'asleep µs':>10} {'busy µs':>10}")
    for r in rows:
        print(f"{r['page']:>6} {r['age_s']:>11.2f} {r['asleep_us']:>10.2f} {r['busy_us']:>10.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
