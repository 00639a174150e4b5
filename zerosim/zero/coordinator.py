"""Stage 3's parameter coordinator under the paper's schedule (``Stage3``, and ``Stage3ZeroPP``
whatever the schedule): gather a module's parameters before it runs, free them after.

Every module that owns parameters gets four hooks. Before its forward and before its backward the
coordinator *fetches* its parameters (an all-gather of each parameter's chunks straight into the
parameter's own buffer; ``param.data`` becomes a view of it); after its forward and after its
backward it *releases* them (``param.data`` becomes an empty array again). A parameter is in one of
three states: ``released`` (only this rank's chunk exists), ``inflight`` (a non-blocking all-gather
has been started), ``available`` (gathered).

The first micro-step records the order of fetches (the *trace*: one entry per module forward and
per module backward). On later micro-steps, while the order matches the trace:

* **prefetch**: at each fetch, non-blocking all-gathers start for the parameters of the next
  modules of the same pass in the trace, up to ``stage3_prefetch_bucket_size`` elements ahead,
  so communication overlaps the current module's compute (only with ``overlap_comm``);
* **reuse**: a parameter is kept gathered after a module if its next use comes before
  ``stage3_max_reuse_distance`` elements of other parameters have been fetched (so, with the
  default 1e9, small models keep every parameter from forward to backward and skip the backward
  all-gather, as DeepSpeed does);
* ``stage3_max_live_parameters`` caps the elements gathered or in flight: prefetching and reuse
  stop at the cap (the module about to run is always fetched).

If a fetch does not match the trace (the execution order changed), the trace is dropped, this
micro-step finishes with on-demand fetches (no prefetch, no reuse) and the next one records a new
trace. Every decision depends only on the trace and the states, which are the same on every rank,
so every rank issues the same collectives in the same order.
"""

from __future__ import annotations

import logging
from typing import Any

from zerosim.nn import Module, Parameter

log = logging.getLogger(__name__)


class ParamCoordinator:
    """Fetches, prefetches and releases the partitioned parameters of a stage-3 model."""

    def __init__(self, fetcher: Any, model: Module, zero: Any) -> None:
        strategy = fetcher.strategy
        self.fetcher: Any = fetcher  # moves the bytes: start_gather, finish_gather, free
        self.itemsize: int = strategy.dtype.itemsize  # bytes of a gathered element
        self.zero: Any = zero  # the zero_optimization settings
        # with overlap_comm: gather ahead along the trace
        self.prefetch: bool = bool(zero.overlap_comm) and zero.stage3_prefetch_bucket_size > 0
        self.modules: dict[int, list[Parameter]] = {}  # module id -> its partitioned parameters
        self.state: dict[int, str] = {}  # id(param) -> "released" | "inflight" | "available"
        self.handles: dict[int, Any] = {}  # id(param) -> its gather in flight
        self.live: int = 0  # elements gathered or in flight (persistent parameters excluded)
        self.peak_live_bytes: int = 0  # the high-water mark of live, in bytes
        self.trace: list[tuple[int, str]] = []  # (module id, "forward" | "backward")
        self.trace_valid: bool = False  # the recorded trace holds for later steps
        self.recording: bool = True  # this micro-step records the trace
        self.position: int = 0  # the next fetch's place in the trace
        for module in model.modules():
            own = [p for p in module._parameters.values() if not strategy.is_persistent(p)]
            if not own:
                continue
            self.modules[id(module)] = own
            for p in own:
                self.state[id(p)] = "released"
            module.register_forward_pre_hook(lambda m, args: self.fetch(m, "forward"))
            module.register_forward_hook(lambda m, args, out: self.release(m))
            module.register_full_backward_pre_hook(lambda m, grad: self.fetch(m, "backward"))
            module.register_full_backward_hook(lambda m, _gi, _go: self.release(m))
        # id(param) -> its elements
        self.numel: dict[int, int] = {id(p): p.numel for ps in self.modules.values() for p in ps}

    # -- the trace --------------------------------------------------------------------------------
    def start_micro_step(self) -> None:
        self.position = 0
        if not self.trace_valid:
            self.trace, self.recording = [], True

    def end_micro_step(self) -> None:
        """After backward: release everything and, after a recording pass, adopt the trace."""
        for p in [p for ps in self.modules.values() for p in ps]:
            self._drop(p)
        if self.recording:
            self.recording, self.trace_valid = False, True
        elif self.position != len(self.trace):
            self._invalidate("the micro-step made fewer fetches than the recorded trace")

    def _invalidate(self, why: str) -> None:
        if self.trace_valid:
            log.info("stage 3: recorded module order dropped (%s); fetching on demand", why)
        self.trace_valid = False

    def _advance(self, module: Module, kind: str) -> None:
        if self.recording:
            self.trace.append((id(module), kind))
        elif self.trace_valid:
            if self.position >= len(self.trace) or self.trace[self.position] != (id(module), kind):
                self._invalidate("the module order changed")
        self.position += 1

    # -- fetch and release -----------------------------------------------------------------------
    def fetch(self, module: Module, kind: str) -> None:
        self._advance(module, kind)
        own = self.modules[id(module)]
        for p in own:
            if self.state[id(p)] == "released":
                self._start(p)
        if self.trace_valid and self.prefetch:
            self._prefetch_after(self.position - 1)
        for p in own:
            self._finish(p)

    def release(self, module: Module) -> None:
        for p in self.modules[id(module)]:
            if not self._reuse_soon(p):
                self._drop(p)

    def _start(self, p: Parameter) -> None:
        self.handles[id(p)] = self.fetcher.start_gather(p)
        self.state[id(p)] = "inflight"
        self.live += p.numel
        self.peak_live_bytes = max(self.peak_live_bytes, self.live * self.itemsize)

    def _finish(self, p: Parameter) -> None:
        if self.state[id(p)] == "inflight":
            self.fetcher.finish_gather(p, self.handles.pop(id(p)))
            self.state[id(p)] = "available"

    def _drop(self, p: Parameter) -> None:
        if self.state[id(p)] == "released":
            return
        self._finish(p)  # a prefetch that was never used still has to complete
        self.fetcher.free(p)
        self.state[id(p)] = "released"
        self.live -= p.numel

    def _prefetch_after(self, position: int) -> None:
        """Start gathers for the next modules of the same pass (forward or backward) in the trace.

        Prefetch stops at the end of the pass so every byte is labelled with the phase that
        uses it (the ledger's forward/backward split stays exact).
        """
        budget = self.zero.stage3_prefetch_bucket_size
        kind = self.trace[position][1]
        for module_id, next_kind in self.trace[position + 1 :]:
            if next_kind != kind:
                return
            for p in self.modules[module_id]:
                if self.state[id(p)] != "released":
                    continue
                if p.numel > budget or self.live + p.numel > self.zero.stage3_max_live_parameters:
                    return
                budget -= p.numel
                self._start(p)

    def _reuse_soon(self, p: Parameter) -> bool:
        """Whether p's next use in the trace comes within the reuse distance (and the cap)."""
        if not self.trace_valid or self.live > self.zero.stage3_max_live_parameters:
            return False
        between = 0
        for module_id, _ in self.trace[self.position :]:
            params = self.modules[module_id]
            if any(q is p for q in params):
                return between < self.zero.stage3_max_reuse_distance
            between += sum(q.numel for q in params)
        return False
