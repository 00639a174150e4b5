"""The sharded optimizer step: the optimizer over this rank's shard, and the boundary work on it.

ZeRO's first idea (stage 1): a rank's optimizer steps only the elements it owns. Every stage
gives its optimizer not the module parameters but ``Tile`` objects: tiles of the elements this
rank steps (``.data`` a view of the flat parameters, or of the master copy; ``.grad`` a view of
the reduced gradient), at most ``sub_group_size`` elements each. The optimizer's update rules are
element-wise, so stepping tiles of a flat shard gives the same numbers as stepping whole
parameters. At the accumulation boundary the engine asks this part, in order: ``overflow()``
(any inf or nan?), ``grad_norm_sq`` or ``grad_norm_sq_parts`` (this rank's Σg², which the engine
all-reduces), ``unscale_grads`` (divide out the loss scale), ``clip(coef)``, then the optimizer's
``step()`` and ``master_to_params()``.

What a stage tells this part, once per class (``strategy.py``):

- ``partitions_optimizer_states``: False at stage 0 (every rank steps the whole flat buffer),
  True at stages 1-3 (each rank steps its owned shard: ``step_ranges``);
- ``partitions_params``: True at stage 3 (each parameter cut into N chunks), which LAMB and Muon
  read to know how a parameter is spread over the ranks;
- ``norm_per_group``: the gradient norm is sent as one partial sum (the paper's) or one per norm
  group (DeepSpeed's, ``ds_schedule.py``);
- ``grad_view(group, run)``: where the reduced gradient of a run of the flat buffer lies, and
  its layout part's ``master_grad_shard(group)`` (Megatron's persistent fp32 gradient shard).

Extensions plug in here, never by testing a stage: the master copy under mixed precision or
offload (``precision.py``), LAMB's per-parameter norms (``lamb.py``), Muon's whole-matrix updates
(``muon.py``, made when the norm is first asked for: DeepSpeed takes the norm over them), and the
NVMe swapper that steps one tile at a time (``offload.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zerosim.backend import item, xp_of
from zerosim.optim.lamb import Lamb
from zerosim.zero.ds_schedule import norm_parts
from zerosim.zero.lamb import LambNorms
from zerosim.zero.loss_scaler import overflow_flag
from zerosim.zero.muon import MuonUpdates
from zerosim.zero.partition import Range
from zerosim.zero.precision import MasterWeights


@dataclass(eq=False)
class Tile:
    """A tile of the elements this rank updates, as the optimizer sees it."""

    data: Any
    grad: Any


def sum_sq(v: Any) -> float:
    """Σ v² of a 1-D array as a Python float: BLAS's dot on NumPy, ``vecdot`` elsewhere."""
    if isinstance(v, np.ndarray):
        return float(np.vdot(v, v))
    return item(xp_of(v).vecdot(v, v))


def cut_into_tiles(ranges: Sequence[Range], tile: int) -> list[Range]:
    """Cut ranges into pieces of at most ``tile`` elements (``sub_group_size``)."""
    out = []
    for r in ranges:
        for start in range(r.start, r.stop, tile):
            out.append(Range(start, min(start + tile, r.stop)))
    return out


class ShardedStep:
    """One strategy's optimizer step over the tiles of its shard; see the module docstring."""

    def __init__(self, strategy: Any, muon: MuonUpdates | None) -> None:
        self.strategy: Any = strategy  # the stage: its groups, where reduced gradients lie
        self.muon: MuonUpdates | None = muon  # Muon's whole-matrix updates (zero/muon.py)
        # the optimizer's own copy of the stepped ranges (mixed precision, offload), or None
        self.master_weights: MasterWeights | None = (
            None if strategy.master_dtype is None else MasterWeights(self, strategy.master_dtype)
        )
        # per group, the optimizer's tiles of this rank's stepped ranges and their runs of the
        # flat buffer
        self.tiles: list[list[Tile]]
        self.tile_ranges: list[list[Range]]
        self.tiles, self.tile_ranges = self.cut_tiles()

    def step_ranges(self, group: Any) -> list[Range]:
        """The flat-buffer ranges this rank's optimizer updates: its owned shard, or the whole
        buffer where optimizer states are not partitioned (stage 0: every rank steps all)."""
        if self.strategy.partitions_optimizer_states:
            return group.owned
        return [Range(0, group.layout.padded_numel)]

    def cut_tiles(self) -> tuple[list[list[Tile]], list[list[Range]]]:
        """Cut each group's stepped ranges into ``sub_group_size`` tiles (``Tile``: a view of
        the flat parameters and of the reduced gradient, or of the master copy); per group, the
        tiles and their runs of the flat buffer."""
        s = self.strategy
        all_tiles, all_ranges = [], []
        for gi, g in enumerate(s.groups):
            cut = cut_into_tiles(self.step_ranges(g), s.zero.sub_group_size)
            if self.master_weights is None:  # the stepped parameters are their own master
                tiles = [Tile(g.flat_param[t.start : t.stop], s.grad_view(g, t)) for t in cut]
            else:  # a master copy of the stepped ranges; its gradients made at step time
                tiles = [Tile(view, None) for view in self.master_weights.allocate(gi, g, cut)]
            all_tiles.append(tiles)
            all_ranges.append(cut)
        return all_tiles, all_ranges

    def make_optimizer(self, optimizer_cls: type) -> Any:
        """The optimizer over every group's tiles, with the group's hyperparameters; LAMB gets
        each parameter's norms over the ranks (zero/lamb.py), and Muon, where every rank holds
        whole matrices, makes its updates inside the optimizer's step (zero/muon.py)."""
        param_groups = [
            {"params": tiles, **g.hyper}
            for g, tiles in zip(self.strategy.groups, self.tiles, strict=True)
        ]
        optimizer = optimizer_cls(param_groups)
        if isinstance(optimizer, Lamb):  # the trust ratio needs each parameter's norms
            optimizer.piece_map = LambNorms(self.strategy)
        if self.muon is not None and self.muon.whole:  # every rank holds whole matrices
            optimizer.before_step = self.muon.before_step
        return optimizer

    # -- the boundary, in the engine's order ------------------------------------------------------
    def overflow(self, whole: bool = False) -> float:
        """1.0 when this rank's owned reduced gradients (with ``whole``: all it steps) hold an
        inf or a nan, else 0.0."""
        s = self.strategy
        ranges = [(g, r) for g in s.groups for r in (self.step_ranges(g) if whole else g.owned)]
        return overflow_flag([s.grad_view(g, r) for g, r in ranges])

    def grad_norm_sq(self, inv_scale: float = 1.0, whole: bool = False) -> float:
        """This rank's partial sum of squared (unscaled) gradients over its owned ranges (with
        ``whole``: over every range it steps, which at stage 0 is the whole reduced gradient).
        Muon's matrices hold their updates by then (DeepSpeed's norm is over them)."""
        if self.muon is not None:
            self.muon.make_updates()
        total = 0.0
        for gi, g in enumerate(self.strategy.groups):
            part = 0.0
            for rng in self.step_ranges(g) if whole else g.owned:
                part += self.range_sum_sq(g, rng)
            total += part * self.group_inv_scale(gi, inv_scale) ** 2
        return total

    def grad_norm_sq_parts(self, inv_scale: float = 1.0) -> list[float]:
        """This rank's partial Σg² (unscaled) per norm message: the paper's schedule sums every
        group in one; DeepSpeed's sends one per norm group (``ds_schedule.norm_parts``)."""
        if self.strategy.norm_per_group:
            return norm_parts(self, inv_scale)
        return [self.grad_norm_sq(inv_scale)]

    def range_sum_sq(self, g: Any, rng: Range) -> float:
        """Σg² of the reduced gradient of flat range ``rng`` (in the master dtype, if any)."""
        v = self.strategy.grad_view(g, rng)
        dtype = self.strategy.master_dtype
        return sum_sq(v if dtype is None else g.xp.astype(v, dtype))

    def group_inv_scale(self, group: int, inv_scale: float) -> float:
        """The factor that unscales ``group``'s gradients: 1 for Muon updates, which carry no
        loss scale (zero/muon.py, ``lacks_scale``)."""
        return 1.0 if self.muon is not None and self.muon.lacks_scale(group) else inv_scale

    def unscale_grads(self, inv_scale: float) -> None:
        """Give the optimizer unscaled gradients (in the master dtype when there is a master)."""
        if self.muon is not None:  # Muon's updates, if no norm was taken (then: next step)
            self.muon.make_updates()
            self.muon.step_done()
        if self.master_weights is not None:
            self.master_weights.unscale(inv_scale)
            return
        for gi, tiles in enumerate(self.tiles):
            inv = self.group_inv_scale(gi, inv_scale)
            if inv != 1.0:
                for t in tiles:
                    t.grad *= inv

    def clip(self, coef: float) -> None:
        """Multiply every gradient this rank steps by ``coef``."""
        for tiles in self.tiles:
            for t in tiles:
                t.grad *= coef

    def master_to_params(self) -> None:
        """After the update: round the master (if any) into the model-dtype parameters."""
        if self.master_weights is not None:
            self.master_weights.to_params()

    def params_from_master(self) -> None:
        """Copy (round) the master into the stepped ranges of the parameters: also after a
        checkpoint load has written the master, before the strategy's ``gather()``."""
        if self.master_weights is not None:
            self.master_weights.copy_to_params()

    def step_skipped(self) -> None:
        """An overflow skipped the step: Muon's copied gradient slices go with the rest."""
        if self.muon is not None:
            self.muon.step_skipped()
