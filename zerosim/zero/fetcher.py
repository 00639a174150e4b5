"""How stage 3 brings a module's partitioned parameters in before it runs: the *fetcher*, a part
the stage is given.

Stage 3 keeps only this rank's chunk of every parameter; the fetcher makes each one whole while
a module needs it and releases it after. The paper's fetcher gathers each parameter in a call of
its own around every module (``stage3.GatherEach``, with ``coordinator.py`` deciding when);
DeepSpeed 0.19.8's coalesces a module's gathers and prefetches along a recorded trace
(``stage3_deepspeed.CoalescedFetcher``, with ``ds_coordinator.py``); ZeRO++'s quantizes the
gathers and keeps a secondary partition for backward (``stage3_zeropp.ZeroPPFetcher`` on the
paper's, ``ZeroPPCoalescedFetcher`` on DeepSpeed's).
The stage class names its fetcher (``fetcher_cls``); ``registry.py`` picks the class.

A new fetcher (PyTorch FSDP2's per-unit all-gather, say) subclasses ``ParamFetcher`` and
provides:

- ``partition_rule`` (a class attribute): how each parameter is cut into the chunks it gathers,
  ``partition.per_param_partition`` (ceil(numel / N) elements) unless it gathers other chunks
  (FSDP2's ``dim0_partition``: ceil(dim0 / N) rows); the stage cuts its shards by it;
- ``keeps_persistent`` (a class attribute): whether parameters of at most
  ``stage3_param_persistence_threshold`` elements stay whole, never gathered (FSDP2: none do);
- ``__init__(strategy)``: its state (no hooks yet), and ``gather_dtype``, the dtype a gathered
  parameter's data has (the model dtype unless it casts, as FSDP2's ``param_dtype`` does);
- ``attach(model)``: install the module hooks that fetch and release, and set ``coordinator``
  (whatever keeps ``peak_live_bytes``, the high-water mark of gathered bytes);
- ``start_micro_step()`` before forward, ``start_backward(boundary)`` before backward and
  ``end_micro_step()`` after it (every parameter released again, unless the fetcher keeps them
  gathered for the next micro-step: FSDP2 without ``reshard_after_backward``);
- ``after_step()`` once the step's updated chunks are in place, ``step_skipped()`` when an
  overflow skips the step;
- ``memory()``: the bytes it reports beside the stage's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from zerosim.zero.partition import per_param_partition


class ParamFetcher(ABC):
    """Stage 3's parameter fetching; see the module docstring for what a fetcher provides."""

    # whose coordinator decides when parameters are gathered (the byte formulas of
    # analysis/volume.py follow it): the paper's (coordinator.py) or DeepSpeed's trace
    coordinator_kind = "paper"
    partition_rule = staticmethod(per_param_partition)  # the chunks: ceil(numel_i / N) elements
    keeps_persistent = True  # small parameters stay whole (stage3_param_persistence_threshold)

    def __init__(self, strategy: Any) -> None:
        self.strategy: Any = strategy  # the stage: its groups, its communicator, its chunks
        self.coordinator: Any = None  # attach(): decides when to fetch and release
        self.gather_dtype: Any = strategy.dtype  # the dtype of a gathered parameter's data

    @abstractmethod
    def attach(self, model: Any) -> None:
        """Install the module hooks that fetch and release; set ``coordinator``."""

    def start_micro_step(self) -> None:
        self.coordinator.start_micro_step()

    def start_backward(self, boundary: bool) -> None:  # noqa: B027 (a no-op by default)
        """Before the model's backward (``boundary``: it ends the accumulation window)."""

    def end_micro_step(self) -> None:
        """After backward: every gathered parameter released."""
        self.coordinator.end_micro_step()

    def after_step(self) -> None:  # noqa: B027 (a no-op by default)
        """After the optimizer step, once every rank's updated chunks are in place."""

    def step_skipped(self) -> None:  # noqa: B027 (a no-op by default)
        """Instead of the step, when an overflow skips it."""

    def memory(self) -> dict[str, int]:
        """Bytes the fetcher reports: the high-water mark of gathered parameters."""
        return {"peak_gathered_params": self.coordinator.peak_live_bytes}


def coordinator_kind(strategy: Any) -> str:
    """ "paper" or "deepspeed": whose coordinator gathers the strategy's parameters (the
    paper's where no parameter is partitioned)."""
    fetcher = strategy.fetcher_cls
    return "paper" if fetcher is None else fetcher.coordinator_kind
