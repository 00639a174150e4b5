"""Stage 2 (P_os+g): optimizer state and gradients are partitioned.

Each rank keeps only the gradient of its owned shard (``grad_shard``, P = Ψ_pad / N elements,
accumulated across micro-steps). During every backward, as soon as all parameters of a bucket
(last parameters first, cut at a parameter's start once a bucket holds ``reduce_bucket_size``
elements or more: ``partition.reduction_buckets``) have their final gradients, they are
copied into a bucket buffer, the module gradients are dropped, and the bucket is reduce-scattered
in bucket order: each rank receives the sum over ranks of the part of the bucket it owns.
Ownership is DeepSpeed's contiguous [r·P, (r+1)·P), so a bucket's parts are uneven; this is a
true reduce-scatter with uneven pieces (MPI_Reduce_scatter). Over a step's buckets rank r sends
Σ_b (|b| − c_{b,r}) = Ψ_pad − P = (N−1)/N · Ψ_pad, the same as one even reduce-scatter.

The buckets are the reducer this stage is given (``BucketReduceScatter``,
``zerosim/zero/buckets.py``); where its pieces land is this stage's ``land``. With accumulation k
every micro-step reduces, so a step sends k·(N−1)/N · Ψ_pad in
reduce-scatters plus (N−1)/N · Ψ_pad in the all-gather: (k+1)(N−1)/N · Ψ_pad.

DeepSpeed 0.19.8 all-reduces IPG buckets instead, about 1.5× the bytes: ``stage2_deepspeed.py``.
"""

from __future__ import annotations

from typing import Any

from zerosim.backend import nbytes
from zerosim.zero.buckets import BucketReduceScatter
from zerosim.zero.partition import Range
from zerosim.zero.strategy import FlatGroup, Strategy


class Stage2Group(FlatGroup):
    """A parameter group at stage 2: its flat parameters and the gradient of its owned shard."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.grad_shard: Any = None  # setup_gradients: the reduced gradient of the owned shard


class Stage2(Strategy):
    """Partitioned gradients: bucketed reduce-scatter during every backward."""

    stage = 2
    partitions_optimizer_states = True
    reported_norm = "before_scale_update"  # DeepSpeed's stage_1_and_2.py
    group_cls = Stage2Group
    reducer_cls = BucketReduceScatter  # the paper's fixed buckets, reduce-scattered

    def setup_gradients(self) -> None:
        """The owned shard's gradient only; module gradients go once they are in a bucket."""
        for g in self.groups:
            (own,) = g.owned
            g.grad_shard = g.xp.zeros(own.size, dtype=self.dtype)
            for _, p in g.named_params:
                p.grad = None

    def land(self, group: int, start: int, values: Any) -> None:
        """This rank's reduced piece of a bucket is added into its gradient shard (it
        accumulates across micro-steps)."""
        g = self.groups[group]
        (own,) = g.owned
        g.grad_shard[start - own.start : start - own.start + values.size] += values

    def before_backward(self, boundary: bool) -> None:
        self.reducer.before_backward(boundary)

    def after_backward(self, boundary: bool) -> None:
        """Every backward the reducer sums the gradients into the owned shard; at the boundary
        the sums over ranks become means."""
        self.reducer.after_backward(boundary)
        if boundary:
            for g in self.groups:
                self.average(g.grad_shard)

    def grad_view(self, group: FlatGroup, rng: Range) -> Any:
        (own,) = group.owned
        return group.grad_shard[rng.start - own.start : rng.stop - own.start]

    def gather(self) -> None:
        """After the step: the flat parameter buffer all-gathered from the owners' updated
        shards."""
        for g in self.groups:
            (own,) = g.owned
            self.comm.all_gather(g.flat_param, g.flat_param[own.start : own.stop])

    def zero_grad(self) -> None:
        for g in self.groups:
            g.grad_shard[...] = 0
            for _, p in g.named_params:
                p.grad = None

    def grad_bytes(self) -> int:
        return sum(nbytes(g.grad_shard) for g in self.groups)
