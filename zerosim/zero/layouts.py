"""How a stage's flat buffers are laid out: the *layout*, a part a stage is given.

A layout says where each parameter sits in its group's flat buffer, how the buffer is padded
and cut into partition units (``partition.Layout``), and what gradient storage comes with it. The
stage says what it does with the buffer (stage 1 reduce-scatters each unit in place, stage 2
reduces buckets of it, …); ``registry.py`` gives each stage class its layout (``layout_cls``).

- ``FlatLayout`` (the paper's): the parameters end to end in definition order, padded to a
  multiple of N, one contiguous shard per rank; the whole buffer is one unit.
- ``DeepSpeedLayout`` (DeepSpeed 0.19.8's stages 1-2, ``stage_1_and_2.py``): the same, padded to
  a multiple of 2·N (``nccl_start_alignment_factor = 2``: every fp16 shard then starts on a
  4-byte boundary) and, with ``round_robin_gradients``, the parameters laid round robin over the
  ranks (``_round_robin_reorder``) so that each rank's shard holds every N-th parameter.
- ``MegatronLayout`` (Megatron-LM's distributed optimizer, ``zerosim.layout = "megatron"``, stage
  1): the parameters in reverse order (the order backward finishes them) cut into buckets, each
  padded to lcm(N, 128) and split evenly over the ranks, so the units are the buckets. Under
  mixed precision it keeps its own gradient storage: with bf16 it accumulates and reduces
  gradients in an fp32 buffer (the optimizer uses the owned piece of it directly: 6 + 12/d bytes
  per parameter); with fp16 it keeps fp16 gradients and a persistent fp32 "main grad" shard
  (4 + 16/d). ``range_maps()`` gives its four range maps for this rank.

Stage 3 partitions each parameter, not a flat buffer (``stage3.ShardGroup``): it keeps the
paper's layout part only for what every stage asks of it (no fp32 gradient shard).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zerosim.nn import Parameter
from zerosim.zero.partition import (
    DEEPSPEED_ALIGNMENT,
    Layout,
    MegatronRanges,
    deepspeed_layout,
    megatron_layout,
    megatron_range_maps,
)


class FlatLayout:
    """The paper's flat buffers: definition order, padded to a multiple of N, one unit."""

    alignment = 1  # flat buffers pad to a multiple of this times N

    def __init__(self, strategy: Any) -> None:
        self.strategy: Any = strategy  # the stage: its communicator, dtypes and zero settings
        # the dtype of a full gradient buffer (stages 0-1): the model dtype
        self.grad_dtype: np.dtype = strategy.dtype
        # per group, a persistent gradient shard in the master dtype ([]: none is kept; the
        # sharded step casts gradients at step time, precision.py)
        self.master_grads: list[Any] = []

    def round_robin(self) -> bool:
        """Whether parameters are laid round robin over the ranks (the paper's: never)."""
        return False

    def lay_out(self, named: list[tuple[str, Parameter]]) -> Layout:
        """Where each parameter of one group sits in its flat buffer, and who owns what."""
        shapes = [(n, p.shape) for n, p in named]
        size = self.strategy.comm.size
        return deepspeed_layout(shapes, size, self.alignment, self.round_robin())

    def keep_master_grads(self, groups: list[Any]) -> None:  # noqa: B027 (none by default)
        """Once the gradient buffers exist: allocate any persistent gradient shard."""

    def master_grad_shard(self, group: int) -> Any:
        """Group ``group``'s persistent gradient shard in the master dtype, or None."""
        return self.master_grads[group] if self.master_grads else None


class DeepSpeedLayout(FlatLayout):
    """DeepSpeed's flat buffers at stages 1-2: padded to 2·N, optionally round robin."""

    alignment = DEEPSPEED_ALIGNMENT

    def round_robin(self) -> bool:
        """``round_robin_gradients``: parameters laid out round robin over the ranks."""
        return bool(self.strategy.zero.round_robin_gradients)


class MegatronLayout(FlatLayout):
    """Megatron's buckets as partition units, and its mixed-precision gradient storage."""

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy)
        master = strategy.master_dtype
        self.bf16: bool = master is not None and strategy.dtype.name == "bfloat16"  # fp32 buffers
        if self.bf16:
            self.grad_dtype = master  # gradients accumulate and are reduced in fp32

    def lay_out(self, named: list[tuple[str, Parameter]]) -> Layout:
        shapes = [(n, p.shape) for n, p in named]
        s = self.strategy
        return megatron_layout(shapes, s.comm.size, s.zero.reduce_bucket_size)

    def keep_master_grads(self, groups: list[Any]) -> None:
        """fp16 training: a persistent fp32 gradient shard per group, over its owned pieces."""
        master = self.strategy.master_dtype
        if master is None or self.bf16:
            return
        for g in groups:
            self.master_grads.append(g.xp.zeros(sum(r.size for r in g.owned), dtype=master))

    def range_maps(self) -> list[dict[str, MegatronRanges]]:
        """Megatron's (world, world_in_bucket, local, param) ranges per group for this rank."""
        s = self.strategy
        return [megatron_range_maps(g.layout, s.comm.rank) for g in s.groups]
