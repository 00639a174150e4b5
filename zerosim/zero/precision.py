"""Master weights: the optimizer's own copy of the elements a rank steps, and its gradients.

Under mixed precision (fp16/bf16 model, fp32 optimizer) and whenever anything is offloaded, the
optimizer does not step the model-dtype flat parameters. It steps a separate master copy of the
ranges this rank updates, in ``master_dtype`` (fp32, or the model dtype under offload), which
lives where ``zerosim/zero/offload.py`` puts it (device, host memory or swap files). Per step:

1. ``unscale``: each tile's ``.grad`` becomes the unscaled gradient in the master dtype: the
   gradient storage itself where it already has that dtype (Megatron's fp32 buffers), a stage's
   persistent fp32 gradient shard where it keeps one (Megatron's fp16 recipe), else a transient
   fp32 copy freed after the step, as DeepSpeed's ZeRO makes (``unscale_and_clip_grads`` over
   ``single_partition_of_fp32_groups``' gradients in ``stage_1_and_2.py``).
2. the optimizer steps the master.
3. ``to_params``: the master is rounded into the model-dtype parameters (``copy_to_params``, also
   after a checkpoint load has written the master) and the transient gradients are freed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zerosim.backend import move_like, nbytes, np_dtype, to_host, xp_of
from zerosim.zero.partition import Range


class MasterWeights:
    """The master copy of one sharded step's stepped ranges; see the module docstring."""

    def __init__(self, step: Any, dtype: Any) -> None:
        self.step: Any = step  # the sharded step (sharded_step.py) whose tiles step this copy
        self.strategy: Any = step.strategy  # where gradients lie (grad_view), where it lives
        self.dtype: Any = dtype  # the master's dtype (fp32, or the model's under offload)
        self.transient: list[Any] = []  # unscale's fp32 gradient copies, until the step ends

    def allocate(self, gi: int, g: Any, cut: Sequence[Range]) -> list[Any]:
        """Allocate group ``gi``'s master (``g.master``) holding the model's values of the
        tiles ``cut``; one view of it per tile (their gradients come at step time)."""
        s = self.strategy
        g.master = s.offload.new_master(gi, sum(t.size for t in cut), self.dtype, g.xp)
        views, at = [], 0
        for t in cut:
            g.master[at : at + t.size] = move_like(g.flat_param[t.start : t.stop], g.master)
            views.append(g.master[at : at + t.size])
            at += t.size
        return views

    def unscale(self, inv_scale: float) -> None:
        """Give each tile the unscaled gradient of its run in the master dtype."""
        s, step = self.strategy, self.step
        on_host = s.offload.optimizer != "none"  # the step runs in host memory
        self.transient = []
        for gi, (g, tiles, cut) in enumerate(
            zip(s.groups, step.tiles, step.tile_ranges, strict=True)
        ):
            persistent = s.layout.master_grad_shard(gi)
            at, inv = 0, step.group_inv_scale(gi, inv_scale)  # 1 for Muon's updates
            for tile, t in zip(tiles, cut, strict=True):
                view = s.grad_view(g, t)
                if np_dtype(view.dtype) == self.dtype and xp_of(view) is xp_of(tile.data):
                    tile.grad = view  # gradient storage of the master dtype: use it in place
                elif persistent is not None:  # a persistent fp32 gradient shard
                    tile.grad = persistent[at : at + t.size]
                    tile.grad[...] = view
                else:  # a transient fp32 copy, freed after the step (DeepSpeed's way)
                    source = to_host(view) if on_host else view
                    tile.grad = xp_of(source).astype(source, self.dtype)
                    self.transient.append(tile.grad)
                    s.track_transient(nbytes(tile.grad))
                tile.grad *= inv
                at += t.size

    def to_params(self) -> None:
        """After the update: round the master into the parameters; free the gradients."""
        self.copy_to_params()
        for grad in self.transient:
            self.strategy.track_transient(-nbytes(grad))
        self.transient = []
        for tiles in self.step.tiles:
            for tile in tiles:
                tile.grad = None

    def copy_to_params(self) -> None:
        """Copy (round) the master into the stepped ranges of the model-dtype parameters."""
        s, step = self.strategy, self.step
        for g, tiles, cut in zip(s.groups, step.tiles, step.tile_ranges, strict=True):
            for tile, t in zip(tiles, cut, strict=True):
                g.flat_param[t.start : t.stop] = move_like(tile.data, g.flat_param)
        s.offload.after_update()
