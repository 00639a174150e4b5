"""Hand-made cluster files for tests: every rate given with a source, as the loader asks."""

from __future__ import annotations

import json
from pathlib import Path

NOTES = ("name", "comment", "calibration", "measurements", "backend")


def sourced(spec: dict) -> dict:
    """``spec`` with each rate as {"value": …, "source": …} (notes and backend as they are)."""
    return {
        k: v if k in NOTES else {"value": v, "source": "hand-made for this test"}
        for k, v in spec.items()
    }


def write_cluster(path: Path, **spec) -> Path:
    """Write ``spec`` as a cluster file whose every rate cites its (hand-made) source."""
    path.write_text(json.dumps(sourced(spec)))
    return path
