"""LAMB under ZeRO: each parameter's norms, when a rank holds only a slice of it.

LAMB scales a parameter's step by ‖θ‖/‖u‖ (``zerosim.optim.functional.lamb``). Under ZeRO the
optimizer steps shards of a flat buffer, and a partition boundary may cut a parameter in two:
no rank then has its norms. ``LambNorms`` gives the optimizer (``Lamb.piece_map``) what it needs:

- ``pieces(shard)``: which parameter each run of a shard belongs to, so the optimizer sums
  θ² and u² per parameter over the runs it holds;
- ``reduce(sums)``: the partial sums of every *split* parameter (one held by more than one
  rank) added over the ranks by one all-reduce of 2 float64 values per split parameter, in
  the ledger under phase ``lamb_norms``. A parameter held whole by one rank needs nothing.

So LAMB under ZeRO costs, per step, one all-reduce of 16·S bytes (S split parameters):
2(N−1)/N · 16·S bytes sent per rank on the ring (``analysis.volume.lamb_norm_bytes``). At stage
0 every rank holds every parameter whole, S = 0; at stages 1-2 only the parameters cut by a
partition boundary are split (at most N − 1 per group); at stage 3 every parameter of more than
one element is cut into N chunks, so S is nearly the number of parameters. Which of these a
strategy is, it says by what it partitions (``partitions_optimizer_states``,
``partitions_params``).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np

from zerosim.errors import ConfigError

PHASE = "lamb_norms"


def holders(strategy: Any, group: Any) -> list[int]:
    """How many ranks step a piece of each parameter of ``group`` (from the layout alone: every
    rank computes the same answer without a message)."""
    n = strategy.comm.size
    if not strategy.partitions_optimizer_states:  # every rank steps every parameter whole
        return [1] * len(group.named_params)
    if strategy.partitions_params:  # parameter i cut into N chunks (stage 3)
        return [
            sum(group.partition.valid(i, r) > 0 for r in range(n))
            for i in range(len(group.named_params))
        ]
    owned = [group.layout.owned_ranges(r) for r in range(n)]
    return [
        sum(any(slot.range.intersect(o) is not None for o in owned[r]) for r in range(n))
        for slot in group.slots
    ]


class LambNorms:
    """LAMB's ``piece_map`` for a ZeRO strategy (see the module docstring)."""

    def __init__(self, strategy: Any) -> None:
        if strategy.offload.optimizer == "nvme":
            raise ConfigError(
                "zero_optimization.offload_optimizer.device",
                "nvme",
                "'none' or 'cpu' with Lamb (the NVMe swapper steps a shard part by part; the "
                "trust ratio needs every slice of a parameter at once)",
            )
        self.comm: Any = strategy.comm  # the all-reduce of the split parameters' sums
        # id(tile) -> (parameter name, start, stop) of each run of the tile
        self._pieces: dict[int, list[tuple[Hashable, int, int]]] = {}
        for seg in strategy.segments("stepped"):
            tile = strategy.sharded_step.tiles[seg.group][seg.tile]
            self._pieces.setdefault(id(tile), []).append(
                (seg.name, seg.offset, seg.offset + seg.size)
            )
        self.split: list[str] = [  # the parameters no rank steps whole, in one order everywhere
            name
            for g in strategy.groups
            for (name, _), count in zip(g.named_params, holders(strategy, g), strict=True)
            if count > 1
        ]

    def pieces(self, tile: Any) -> list[tuple[Hashable, int, int]]:
        return self._pieces.get(id(tile), [])

    def reduce(self, sums: dict[Hashable, list[float]]) -> dict[Hashable, list[float]]:
        """Add the split parameters' partial sums over the ranks (one all-reduce)."""
        if not self.split:
            return sums
        message = np.zeros((len(self.split), 2), dtype=np.float64)
        for k, name in enumerate(self.split):
            if name in sums:
                message[k] = sums[name]
        with self.comm.phase(PHASE):
            self.comm.all_reduce(message.reshape(-1))
        out = dict(sums)
        for k, name in enumerate(self.split):
            if name in sums:
                out[name] = [float(message[k, 0]), float(message[k, 1])]
        return out
