"""Cross-rank consistency checks of ``initialize``: every rank loaded the same config and built
the same model. Each is one all-reduce of a hash (phase ``init``); only on a mismatch do the ranks
exchange what they hold, so that every rank raises the same error naming what differs.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from zerosim.comm import Communicator
from zerosim.comm.gather import gather_text
from zerosim.config import Config
from zerosim.errors import ConfigError
from zerosim.nn import Module

# Keys that may differ from rank to rank: node-local paths (each node its own NVMe, its own flight
# folder); a bad one is caught where it is used, naming the rank (offload.check_nvme_paths).
PER_RANK_KEYS = (
    "zero_optimization.offload_optimizer.nvme_path",
    "zero_optimization.offload_param.nvme_path",
    "zerosim.flight_dir",
)


def _hash(text: str) -> int:
    """56 bits of ``text``'s SHA-256: an int64 whose negation is one too."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def _same_everywhere(comm: Communicator, mine: int) -> bool:
    """Whether every rank holds ``mine``: one max all-reduce of (mine, −mine)."""
    both = np.array([mine, -mine], dtype=np.int64)
    comm.all_reduce(both, op="max")
    return bool(both[0] == -both[1] == mine)


def check_same_model(model: Module, comm: Communicator) -> None:
    """One all-reduce of a layout fingerprint; on mismatch every rank raises naming the diffs."""
    with comm.phase("init"):
        fingerprint = ";".join(f"{n}:{p.shape}:{p.dtype}" for n, p in model.named_parameters())
        if _same_everywhere(comm, _hash(fingerprint)):
            return
        # Rare path: exchange every rank's parameter list to say what differs.
        text = "\n".join(f"{n} {p.shape} {p.dtype}" for n, p in model.named_parameters())
        tables = [set(t.splitlines()) for t in gather_text(comm, text)]
    differing = sorted({line.split(" ")[0] for t in tables for line in t ^ tables[0]})
    raise ValueError(
        f"the model differs across ranks (build the same architecture on every rank); "
        f"parameters whose name, shape or dtype differ from rank 0's: {differing}"
    )


def flat_keys(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} → {"a.b": 1}: the dotted key paths the errors name."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flat_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check_same_config(cfg: Config, comm: Communicator) -> None:
    """Every rank loaded the same config (defaults filled in): one all-reduce of a hash of its
    canonical JSON; on a mismatch every rank raises one ConfigError naming the differing keys
    and each rank's value, before any state is built."""
    if comm.size == 1:
        return
    flat = {k: v for k, v in flat_keys(cfg.to_dict()).items() if k not in PER_RANK_KEYS}
    text = json.dumps(flat, sort_keys=True, default=repr)
    with comm.phase("init"):
        if _same_everywhere(comm, _hash(text)):
            return
        tables = [json.loads(t) for t in gather_text(comm, text)]  # rare path: say what differs
    keys = sorted({k for t in tables for k in t.keys() | tables[0].keys()})
    differing = [k for k in keys if any(t.get(k, "<absent>") != tables[0].get(k) for t in tables)]
    details = []
    for key in differing[:8]:
        ranks_of: dict[str, list[int]] = {}
        for r, t in enumerate(tables):
            ranks_of.setdefault(json.dumps(t.get(key, "<absent>")), []).append(r)
        details.append(f"{key}: " + ", ".join(f"{v} on ranks {rs}" for v, rs in ranks_of.items()))
    more = f" (and {len(differing) - 8} more)" if len(differing) > 8 else ""
    raise ConfigError(
        f"the config differs across ranks (every rank must load the same config); keys whose "
        f"value differs: {differing}{more} — " + "; ".join(details)
    )
