"""Segments: the layout-free view of the elements a rank holds, what checkpoints are made of.

A checkpoint written by any stage and world size is a set of (parameter name, range of its
flattened elements) → arrays. A ``Segment`` says where such a run sits in this rank's optimizer
tiles (``sharded_step.py``); ``flat_segments`` lists them for the flat-buffer stages (0-2; stage
3 lists its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerosim.zero.partition import Range


@dataclass(frozen=True)
class Segment:
    """A run of one parameter's elements held in one tile of the optimizer's.

    ``param_range`` counts elements of the flattened parameter (``name``); they sit at
    ``offset`` … ``offset + size`` of the tile ``strategy.sharded_step.tiles[group][tile]`` (its
    ``.data`` and every optimizer state array).
    """

    name: str
    param_range: Range
    group: int
    tile: int  # the tile's index in its group (``ShardedStep.tiles[group]``)
    offset: int

    @property
    def size(self) -> int:
        return self.param_range.size


def flat_segments(strategy: Any, which: str = "owned") -> list[Segment]:
    """The parameter element runs ``strategy`` holds in its optimizer's tiles.

    ``which="owned"``: the elements this rank owns (each element of the model appears on exactly
    one rank: what a checkpoint saves). ``which="stepped"``: every element this rank's optimizer
    updates (the same except at stage 0, where every rank steps everything: what a checkpoint
    load must fill).
    """
    if which not in ("owned", "stepped"):
        raise ValueError(f"which must be 'owned' or 'stepped', got {which!r}")
    out, step = [], strategy.sharded_step
    for gi, g in enumerate(strategy.groups):
        wanted = g.owned if which == "owned" else step.step_ranges(g)
        tile_ranges = step.tile_ranges[gi]
        for want in wanted:
            for k, tile in enumerate(tile_ranges):
                part = tile.intersect(want)
                if part is None:
                    continue
                for slot in g.slots:
                    x = slot.range.intersect(part)
                    if x is not None:
                        rng = Range(x.start - slot.range.start, x.stop - slot.range.start)
                        out.append(Segment(slot.name, rng, gi, k, x.start - tile.start))
    return out
