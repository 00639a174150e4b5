"""DeepSpeed's stage-3 parameter coordinator: coalesced fetches, prefetch by trace, reuse.

This is what DeepSpeed 0.19.8's ``PartitionedParameterCoordinator``
(``runtime/zero/partitioned_param_coordinator.py``) does, and so what ``Stage3DeepSpeed``
(``stage3_deepspeed.py``) issues under ``zerosim.schedule: "deepspeed"``; the paper's stage 3
and ZeRO++ keep ``coordinator.py``. Every module gets the four hooks, parameters or not
(DeepSpeed hooks every module; a module without parameters still counts as a step of the trace
and still starts a prefetch).

* **fetch** (before a module's forward or backward): the module's parameters that are released
  are all-gathered in ONE call (``all_gather_coalesced``: each rank's chunks end to end, a single
  parameter in a call of its own size); then, once a trace is complete, the parameters of the
  next steps of the trace are prefetched in ONE more call: queue entries are taken while fewer
  than min(``stage3_max_live_parameters`` − live, ``stage3_prefetch_bucket_size``) elements
  (whole parameters, ``numel``) are being prefetched. Prefetch does not need ``overlap_comm``.
* **release** (after a module's forward or backward): a parameter stays gathered if a prefetch
  already took a later use of it from the queue, or if it is used again within
  ``stage3_max_reuse_distance`` elements of the trace (DeepSpeed's ``__params_to_release``);
  the live cap plays no part here.
* **trace**: the first micro-step after a change records the module order (fetches on demand,
  everything released after use); the next ones follow it. A fetch that does not match the
  trace drops it: that micro-step goes on on demand, the next one records again.
* **persistent parameters** (``stage3_param_persistence_threshold``, DeepSpeed's ``ds_persist``)
  start released, as DeepSpeed partitions every parameter at start-up: a fetch or a prefetch
  gathers them with the others, a recording micro-step releases them after use, but once the
  trace is complete they are never released, nor among the backward leftovers. After each step
  they are whole again (``persistent_gathered``: DeepSpeed's ``_post_step`` gathers them); a step
  skipped on overflow leaves them released (``persistent_released``). zerosim's whole copy of a
  persistent parameter stays its home throughout: a gather writes into it, a release keeps it.

**A live cap below one module** stops every prefetch: while the module is gathered, live ≥ its
parameters > ``stage3_max_live_parameters``, so the budget above is negative. DeepSpeed's default
cap (1e9) is below one matrix of a large model (the 529.6B GPT's 4h² = 1.68e9-element MLP
weight), and DeepSpeed says nothing; ``binding_live_cap`` finds such a module and the
coordinator warns once, on rank 0.

Per micro-step with the defaults (prefetch bucket 5e7 ≥ Ψ, nothing persistent) this is one
all-gather of Ψ_pad, at the first module's fetch, and nothing in backward: (N−1)/N·Ψ_pad·b
gathered per micro-step, not the paper's 2(N−1)/N·Ψ_pad·b.
"""

from __future__ import annotations

import logging
import warnings
from collections import deque
from typing import Any

from array_api_compat import is_array_api_obj

from zerosim.backend import np_dtype
from zerosim.nn import Module, Parameter

log = logging.getLogger(__name__)

NEVER = -(10**10)  # DeepSpeed's "not fetched for any step yet"


class DeepSpeedCoordinator:
    """Fetches, prefetches and releases stage-3 parameters as DeepSpeed 0.19.8 does."""

    def __init__(self, fetcher: Any, model: Module, zero: Any) -> None:
        strategy = fetcher.strategy
        self.fetcher: Any = fetcher  # moves the bytes: start_coalesced_gather, finish_…, free
        self.itemsize: int = strategy.dtype.itemsize  # bytes of a gathered element
        self.zero: Any = zero  # the zero_optimization settings
        self.modules: dict[int, list[Parameter]] = {}  # module id -> its own parameters
        self.order: dict[int, int] = {}  # parameter id -> definition order (DeepSpeed's ds_id)
        self.state: dict[int, str] = {}  # "released" | "inflight" | "available"
        self.persistent: set[int] = set()  # ids of the persistent parameters (ds_persist)
        self.inflight: dict[int, Any] = {}  # parameter id -> its coalesced gather
        self.active: dict[int, set[int]] = {}  # parameter id -> modules running with it
        self.live: int = 0  # elements gathered or in flight (DeepSpeed's __n_available_params)
        self.peak_live_bytes: int = 0  # the high-water mark of live, in bytes
        self.mode: str = "invalid"  # "invalid" -> "record" -> "complete" (DeepSpeed's trace modes)
        self.trace: list[int] = []  # module ids, one per fetch
        self.param_trace: list[tuple[Parameter, int]] = []  # (parameter, step of that use)
        self.queue: deque[tuple[Parameter, int]] = deque()  # the trace's uses still to prefetch
        self.fetched_for: dict[int, int] = {}  # parameter id -> latest step taken off the queue
        self.step: int = 0  # fetches so far in this micro-step (the trace's clock)
        for p in model.parameters():
            self.order.setdefault(id(p), len(self.order))
        for module in model.modules():
            own = [p for p in module._parameters.values() if p is not None]
            self.modules[id(module)] = own
            for p in own:
                self.state[id(p)] = "released"  # persistent ones too: DeepSpeed partitions all
                self.active[id(p)] = set()
                if strategy.is_persistent(p):
                    self.persistent.add(id(p))
            module.register_forward_pre_hook(self._forward_pre)
            module.register_forward_hook(lambda m, args, out: self.release(m))
            module.register_full_backward_pre_hook(lambda m, grad: self.fetch(m))
            module.register_full_backward_hook(lambda m, _gi, _go: self._backward_post(m))
        self.model: Module = model  # the model whose modules are hooked
        binding = binding_live_cap(model, zero.stage3_max_live_parameters)
        if binding is not None and strategy.comm.rank == 0:
            name, numel = binding
            warnings.warn(
                f"zero_optimization.stage3_max_live_parameters={zero.stage3_max_live_parameters:,}"
                f" is below the {numel:,} parameters of module {name!r}, the largest fetched "
                "at once: DeepSpeed's prefetch budget, min(max_live - live, "
                "stage3_prefetch_bucket_size), is negative while it is gathered, so nothing is "
                f"prefetched then; set it to at least {numel:,} to prefetch",
                UserWarning,
                stacklevel=2,
            )
        self.inputs: set[int] = set()  # ids of the model's own inputs in this forward
        self.grad_input: dict[int, bool] = {}  # module id -> an input of it needs a gradient

    # -- DeepSpeed's post-backward hook runs only for a module with an input that needs a gradient
    def _forward_pre(self, module: Module, args: tuple) -> None:
        """Note whether any input of ``module`` needs a gradient (DeepSpeed's post-backward
        function is applied to the inputs that do; without one, the module's parameters wait for
        the backward leftovers), then fetch. The model's own inputs and integer arrays do not;
        any other floating-point array is taken to come from the parameters."""
        if module is self.model:
            self.inputs = {id(a) for a in _arrays(args)}
        self.grad_input[id(module)] = any(
            id(a) not in self.inputs and np_dtype(a.dtype).kind not in "biu" for a in _arrays(args)
        )
        self.fetch(module)

    def _backward_post(self, module: Module) -> None:
        if self.grad_input.get(id(module), True):
            self.release(module)

    # -- the trace (DeepSpeed's reset_step, at the start of each forward) -------------------------
    def start_micro_step(self) -> None:
        self._drop_inflight()
        self.live = 0  # DeepSpeed's reset_step zeroes __n_available_params
        if self.mode == "record":
            self.param_trace = [
                (p, step) for step, m in enumerate(self.trace) for p in self._sorted(m)
            ]
            self.mode = "complete"
        elif self.mode == "invalid":
            self.trace, self.mode = [], "record"
        self.queue = deque(self.param_trace)
        self.fetched_for = {}
        self.step = 0

    def end_micro_step(self) -> None:
        """After backward: release what is still gathered (DeepSpeed: backward leftovers),
        persistent parameters excepted (``release_backward_leftovers`` skips them)."""
        self._drop_inflight()
        for params in self.modules.values():
            for p in params:
                self.active[id(p)].clear()
                if id(p) not in self.persistent:
                    self._release(p)

    def persistent_released(self) -> None:
        """A step skipped on overflow: DeepSpeed's ``step`` has partitioned every parameter and
        returns before gathering the persistent ones; their next fetch gathers them."""
        for pid in self.persistent:
            if self.state[pid] == "available":
                self.state[pid] = "released"

    def persistent_gathered(self) -> None:
        """After the optimizer step (DeepSpeed's ``_post_step``): every persistent parameter is
        whole again, gathered one by one outside the coordinator, and stays so."""
        for pid in self.persistent:
            if self.state[pid] == "released":
                self.state[pid] = "available"

    def _sorted(self, module_id: int) -> list[Parameter]:
        return sorted(self.modules[module_id], key=lambda p: self.order[id(p)])

    # -- fetch and release -----------------------------------------------------------------------
    def fetch(self, module: Module) -> None:
        mid = id(module)
        if self.mode == "record":
            self.trace.append(mid)
        elif self.mode == "complete":
            if self.step >= len(self.trace) or self.trace[self.step] != mid:
                log.info("stage 3: recorded module order dropped; fetching on demand")
                self.mode, self.trace, self.param_trace = "invalid", [], []
                self.queue = deque()
                self._drop_inflight()
        own = self._sorted(mid)
        self._gather([p for p in own if self.state[id(p)] == "released"])
        for p in own:
            self.active[id(p)].add(mid)
            self._finish(p)
        if self.mode == "complete":
            self._prefetch(own)
        self.step += 1

    def _prefetch(self, own: list[Parameter]) -> None:
        """Take this module's uses off the queue, then prefetch the next ones (one call)."""
        pending = {id(p) for p in own if self.fetched_for.get(id(p), NEVER) < self.step}
        taken: set[int] = set()
        while self.queue and len(taken) < len(pending):
            p, step = self.queue.popleft()
            self.fetched_for[id(p)] = step
            taken.add(id(p))
        budget = min(
            self.zero.stage3_max_live_parameters - self.live, self.zero.stage3_prefetch_bucket_size
        )
        chosen: dict[int, Parameter] = {}  # by id, in the order taken
        numel = 0
        while self.queue and numel < budget:
            p, step = self.queue.popleft()
            self.fetched_for[id(p)] = max(self.fetched_for.get(id(p), NEVER), step)
            if self.state.get(id(p)) == "released" and id(p) not in chosen:
                chosen[id(p)] = p
                numel += p.numel
        self._gather(sorted(chosen.values(), key=lambda p: self.order[id(p)]))

    def release(self, module: Module) -> None:
        mid = id(module)
        keep = self._kept(mid) if self.mode == "complete" else set()
        for p in self.modules[mid]:
            self.active[id(p)].discard(mid)
            if id(p) not in keep:
                self._release(p)

    def _kept(self, module_id: int) -> set[int]:
        """Parameters of the module not to release now (DeepSpeed's __params_to_release):
        persistent ones, those a prefetch took a later use of, those reused soon."""
        own = self.modules[module_id]
        keep = {id(p) for p in own if self.fetched_for.get(id(p), NEVER) > self.step}
        keep |= {id(p) for p in own if id(p) in self.persistent}
        traversed = 0
        for later in self.trace[self.step :]:
            if traversed >= self.zero.stage3_max_reuse_distance:
                break
            for q in self.modules[later]:
                keep.add(id(q))
                traversed += q.numel
        return keep & {id(p) for p in own}

    # -- gathers ---------------------------------------------------------------------------------
    def _gather(self, params: list[Parameter]) -> None:
        if not params:
            return
        handle = self.fetcher.start_coalesced_gather(params)
        for p in params:
            self.inflight[id(p)] = handle
            self.state[id(p)] = "inflight"
            self.live += p.numel
        self.peak_live_bytes = max(self.peak_live_bytes, self.live * self.itemsize)

    def _finish(self, p: Parameter) -> None:
        if self.state[id(p)] == "inflight":
            handle = self.inflight[id(p)]
            self.fetcher.finish_coalesced_gather(handle)
            for q in handle.params:
                self.inflight.pop(id(q), None)
                self.state[id(q)] = "available"

    def _release(self, p: Parameter) -> None:
        if self.state[id(p)] == "available" and not self.active[id(p)]:
            self.fetcher.free(p)
            self.state[id(p)] = "released"
            self.live -= p.numel

    def _drop_inflight(self) -> None:
        """Complete every gather still in flight and release its parameters."""
        for pid in list(self.inflight):
            handle = self.inflight.get(pid)  # None: finished with an earlier one's gather
            if handle is not None:
                self._finish(handle.params[0])
                for q in handle.params:
                    self._release(q)


def binding_live_cap(model: Module, max_live: int) -> tuple[str, int] | None:
    """(name, parameters) of the largest module fetched at once (its own parameters, as DeepSpeed
    gathers them) when it has more than ``max_live``, else None. The first of equals is named;
    a shared parameter counts in every module that holds it (each fetch gathers it)."""
    name, numel = max(
        (
            (n, sum(p.numel for p in m._parameters.values() if p is not None))
            for n, m in model.named_modules()
        ),
        key=lambda item: item[1],
    )
    return (name or "(the model)", numel) if numel > max_live else None


def _arrays(args: Any) -> list[Any]:
    """The arrays in a hook's arguments, through tuples, lists and dicts."""
    if isinstance(args, (tuple, list)):
        return [a for x in args for a in _arrays(x)]
    if isinstance(args, dict):
        return [a for x in args.values() for a in _arrays(x)]
    return [args] if is_array_api_obj(args) else []
