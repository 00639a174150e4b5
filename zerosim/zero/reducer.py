"""How a stage's gradients are summed over ranks: the *reducer*, a part a stage is given.

A stage says what it keeps and where a reduced gradient lands (its ``land``); a reducer says when
gradients are reduced and in which collectives. The paper's reducers are its fixed buckets
(``buckets.py``: all-reduced in place at stage 0, reduce-scattered at stage 2, rank-major at stage
3) and stage 1's reduce-scatter of each partition unit (``stage1.py``); DeepSpeed 0.19.8's are its
IPG buckets (``ipg.py``), its stage-0 all-reduce after backward (``stage0_deepspeed.py``) and its
open stage-3 bucket (``stage3_deepspeed.py``). The stage class names its reducer
(``reducer_cls``); ``registry.py`` picks the class.

A new reducer (PyTorch FSDP2's per-unit reduction, say) subclasses ``GradReducer`` and provides:

- ``__init__(strategy)``: build its buckets from ``strategy.groups`` (nothing allocated yet:
  bucket memory is taken from the strategy's pool when first filled);
- ``attach(model)``: install the module hooks it needs (``GradReadyTracker``), if any;
- ``before_backward(boundary)`` and ``after_backward(boundary)``: the second reduces whatever is
  left and waits until every reduced piece has landed (the stage averages after it);
- ``bucket_pieces()``: each bucket's piece per rank when pieces are uneven (the dry run), else [];
- ``lands_averaged`` (a class attribute, stage 3): True when each reduced piece is already the
  mean as it lands (FSDP2 divides each reduced row by N), so the stage does not average again;
- ``replica()``: which copy of its shards this rank holds where shards are replicated (HSDP's
  replicas, FSDP2's ``replicate``), 0 where they are not: only replica 0 owns them (checkpoints).

Every reduction goes through the strategy's one reduce sequence, ``strategy.reduction``
(``buckets.ReduceSequence``: ``wire_buffer`` from the pool → ``reduce``: ``before_reduction`` →
the collective started → pending), with a ``land`` callable saying where the result goes on
this rank, usually ``partial(strategy.land, group, start)``: the stage's ``land`` says what a
reduced piece does there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class GradReducer(ABC):
    """A stage's gradient reduction; see the module docstring for what a reducer provides."""

    lands_averaged = False  # each piece lands as the sum over ranks: the stage averages it

    def __init__(self, strategy: Any) -> None:
        self.strategy: Any = strategy  # the stage: its groups, its pool and its reduce sequence

    def attach(self, model: Any) -> None:  # noqa: B027 (a no-op by default)
        """Once, after construction: install module hooks (reducers that act during backward)."""

    def before_backward(self, boundary: bool) -> None:  # noqa: B027 (a no-op by default)
        """Called before the model's backward of every micro-step."""

    @abstractmethod
    def after_backward(self, boundary: bool) -> None:
        """Called after it: reduce what is left; every reduced piece has landed on return."""

    def memory(self) -> dict[str, int]:
        """``peak_*`` bytes the reducer held for a while beyond its buckets (none by default)."""
        return {}

    def bucket_pieces(self) -> list[list[int]]:
        """Each bucket's piece per rank where buckets are cut unevenly over the ranks (the
        paper's stage 2); the dry run runs ranks with equal pieces once."""
        return []

    def replica(self) -> int:
        """Which copy of its shards this rank holds (0: the owner; shards are not replicated)."""
        return 0
