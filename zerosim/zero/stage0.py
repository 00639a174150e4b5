"""Stage 0: plain data parallelism (ZeRO disabled), for reference.

Every rank holds the full parameters, the full gradients and the full optimizer state, and steps
all of it. Gradients live in one flat buffer (module ``.grad`` are views of it), padded to a
multiple of N so that the norm can be summed over owned shards. They are all-reduced once per
optimizer step, in the backward of the accumulation boundary: in buckets of
``reduce_bucket_size`` elements, each all-reduced as soon as every parameter in it has its final
gradient, in bucket order (non-blocking with ``overlap_comm``, then waited on at the end of
backward). Bucket boundaries fall on multiples of N, so each all-reduce sends exactly 2(N−1)/N of
its bytes: 2(N−1)/N · Ψ_pad per step in all. The buckets are the reducer this stage is given
(``BucketAllReduce``, ``zerosim/zero/buckets.py``); the reduced sums stay where they lie.

DeepSpeed 0.19.8 all-reduces after backward instead, in messages of its own size: the same stage
given another reducer, ``stage0_deepspeed.py``.
"""

from __future__ import annotations

from typing import Any

from zerosim.backend import nbytes
from zerosim.zero.buckets import BucketAllReduce
from zerosim.zero.partition import Range
from zerosim.zero.strategy import FlatGroup, FullGradGroup, Strategy


class Stage0(Strategy):
    """Full replicas; gradient all-reduce in the boundary backward."""

    stage = 0
    partitions_optimizer_states = False  # every rank steps the whole buffer (sharded_step.py)
    reported_norm = "none_in_one_precision"  # the client's torch optimizer keeps none
    group_cls = FullGradGroup
    reducer_cls = BucketAllReduce  # the paper's buckets of the gradient buffer, all-reduced

    def setup_gradients(self) -> None:
        """One full gradient buffer per group, laid out like the parameters; module ``.grad``
        are views of it."""
        for g in self.groups:
            g.flat_grad = g.xp.zeros_like(g.flat_param)
            for i, (_, p) in enumerate(g.named_params):
                p.grad = g.param_view(i, g.flat_grad)

    def land(self, group: int, start: int, values: Any) -> None:
        """A reduced copy (``communication_data_type``) is added back into its zeroed range."""
        self.groups[group].flat_grad[start : start + values.size] += values

    def before_backward(self, boundary: bool) -> None:
        self.reducer.before_backward(boundary)

    def after_backward(self, boundary: bool) -> None:
        """The boundary backward all-reduces every gradient; the sums over ranks become means."""
        self.reducer.after_backward(boundary)
        if boundary:
            for g in self.groups:
                self.average(g.flat_grad)

    def grad_view(self, group: FlatGroup, rng: Range) -> Any:
        return group.flat_grad[rng.start : rng.stop]

    def zero_grad(self) -> None:
        for g in self.groups:
            g.flat_grad[...] = 0

    def grad_bytes(self) -> int:
        return sum(nbytes(g.flat_grad) for g in self.groups)
