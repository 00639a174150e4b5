"""Stage 3 under DeepSpeed 0.19.8's schedule (``zerosim.schedule: "deepspeed"``, the default): what
it changes in the paper's stage 3 (``stage3.py``), and why.

The paper gathers each parameter in a call of its own around every module and reduce-scatters
gradients in buckets fixed at start-up. DeepSpeed issues other collectives for the same config,
and zerosim issues DeepSpeed's, call for call, so that DeepSpeed can be its oracle (tests/peer/
hold the two to DeepSpeed's comms logger). Four things change; the partition (chunk_i =
ceil(numel_i / N) of every parameter, end to end in one shard buffer) does not.

* **Fetches are coalesced and follow a trace** (``runtime/zero/partitioned_param_coordinator.py``:
  ``fetch_sub_module``, ``__params_to_release``; ``partition_parameters.py``:
  ``all_gather_coalesced``). A module's released parameters are gathered in ONE all-gather of
  each rank's chunks end to end; once the module order is recorded, the next uses are prefetched
  in one more call and parameters reused soon stay gathered. ``DeepSpeedCoordinator``
  (``ds_coordinator.py``) decides; ``start_coalesced_gather`` and ``finish_coalesced_gather``
  below move the bytes.
* **Gradient buckets are open, in hook order** (``runtime/zero/stage3.py``:
  ``reduce_independent_p_g_buckets_and_remove_grads``, ``__reduce_and_partition_ipg_grads``). A
  gradient joins the open bucket as soon as it is final; the bucket is reduced first when the
  gradient would take it past ``reduce_bucket_size`` elements (unpadded). At reduction the bucket
  is sorted by parameter (DeepSpeed's ``ds_id``) and each gradient padded to chunk_i · N, rank-major
  (``reduce_scatter_coalesced``). With ``reduce_scatter: false`` and contiguous gradients the
  bucket is all-reduced unpadded instead (``__avg_scatter_contiguous_grads``).
* **Hook order**: a Linear's weight gradient is final before its bias (DeepSpeed's zero.Init swaps
  in ``LinearFunctionForZeroStage3``, ``runtime/zero/linear.py``): ``deepspeed_grad_order``.
* **Persistent parameters** (``ds_persist``) are partitioned at start-up like the others
  (``partition_parameters.py``), so the coordinator fetches them with their module until the
  trace is complete; after each step DeepSpeed gathers them whole again (``stage3.py``:
  ``_post_step``). zerosim's whole copy stays their home: a gather writes into it, a release
  keeps it.

Bytes per micro-step with the defaults (prefetch bucket 5e7 ≥ Ψ, reuse distance 1e9, nothing
persistent), once the first micro-step has recorded the trace: one all-gather of the whole model
at the first module's fetch, nothing gathered in backward, and the reduce-scatters:

    (N−1)/N·Ψ_pad·b gathered + (N−1)/N·Ψ_pad·b reduce-scattered = 2(N−1)/N·Ψ_pad·b,

against the paper's 3(N−1)/N·Ψ_pad·b (docs/formulas.md has the general case).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from zerosim.backend import assign, flat, xp_of
from zerosim.nn import GradReadyTracker, Linear, Parameter
from zerosim.zero.buckets import MAX_IN_FLIGHT, pack_chunks, reduce_rows
from zerosim.zero.ds_coordinator import DeepSpeedCoordinator
from zerosim.zero.ds_schedule import DeepSpeedNormGroups
from zerosim.zero.fetcher import ParamFetcher
from zerosim.zero.offload import read_param_chunk
from zerosim.zero.reducer import GradReducer
from zerosim.zero.schedule import deepspeed_stage3_checks
from zerosim.zero.stage3 import Stage3


class CoalescedGather:
    """One coalesced all-gather in flight: its parameters, their chunk sizes, both buffers."""

    def __init__(
        self, params: list[Parameter], chunks: list[int], send: Any, buf: Any, handle: Any
    ) -> None:
        # in the order their chunks sit in each rank's segment
        self.params: list[Parameter] = params
        self.chunks: list[int] = chunks  # each parameter's chunk, elements
        self.send: Any = send  # this rank's chunks end to end (kept alive while in flight)
        self.buf: Any = buf  # N segments, one per rank
        self.handle: Any = handle  # the non-blocking all-gather, or None once complete


class ShardPieces:
    """Where one DeepSpeed bucket lands: ``pieces(out)`` hands each parameter's reduced chunk
    (``out[column : column + chunk]``) to the stage's ``land``."""

    def __init__(self, land: Any, slots: list[tuple[int, int, int, int]]) -> None:
        self.land: Any = land  # the stage's: land(group, shard position, values)
        # (group, chunk offset in its shard, chunk, column in the bucket)
        self.slots: list[tuple[int, int, int, int]] = slots

    def __call__(self, out: Any) -> None:
        for gi, start, chunk, column in self.slots:
            self.land(gi, start, out[column : column + chunk])


def deepspeed_grad_order(module: Any) -> tuple[str, ...]:
    """The order DeepSpeed's stage 3 finishes a module's gradients: a Linear's weight before its
    bias (its zero.Init swaps in ``LinearFunctionForZeroStage3``); other modules as in torch."""
    if isinstance(module, Linear):
        return ("weight", "bias")
    return tuple(getattr(module, "grad_ready_order", ()))


class OpenBucket(GradReducer):
    """DeepSpeed's stage-3 reducer: one open gradient bucket for every group, filled in the
    order backward finishes the gradients (a Linear's weight before its bias), reduced when the
    next gradient would overflow it and at the end of backward.

    On a GPU, with ``overlap_comm``, DeepSpeed runs all of a bucket's reduction on its
    reduction stream (``stage3.py``, ``__reduce_and_partition_ipg_grads`` under
    ``reduce_and_partition_stream``): the copy into the bucket, the collective (qgZ's kernels and
    all-to-alls), the landing; the host waits for that stream when backward ends
    (``independent_gradient_partition_epilogue``). Here every call still runs in order on the
    one thread; the engine notes where that stream's work starts and ends
    (``Communicator.note_stream``), which the dry run's time model reads."""

    collective = staticmethod(reduce_rows)  # a bucket's collective (ZeRO++'s qgZ swaps it)

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy)
        self.open_bucket: list[Parameter] = []  # parameters whose gradients it holds
        self.open_numel: int = 0  # their elements, unpadded
        self.tracker: GradReadyTracker | None = None  # attach(): says when a gradient is final

    def attach(self, model: Any) -> None:
        self.tracker = GradReadyTracker(model, self._ready, order=deepspeed_grad_order)

    def _ready(self, p: Parameter) -> None:
        """DeepSpeed's bucket rule (stage3.py, ``reduce_independent_p_g_buckets_and_remove_grads``):
        in the order gradients become ready, reduce the open bucket first if this gradient
        would take it past ``reduce_bucket_size`` elements (unpadded numel), then add it."""
        if p.grad is None:
            return
        full = self.open_numel + p.numel > self.strategy.zero.reduce_bucket_size
        if full and self.open_numel > 0:
            self.reduce()
        self.open_bucket.append(p)
        self.open_numel += p.numel

    def after_backward(self, boundary: bool) -> None:
        """DeepSpeed's backward epilogue: reduce the last bucket and wait for every one (on a
        GPU: for the reduction stream)."""
        self.tracker.reset()
        self.reduce()
        if self.strategy.zero.overlap_comm:
            self.strategy.comm.note_stream("sync")
        self.strategy.reduction.pending.complete()

    def reduce(self) -> None:
        """Reduce the open bucket (on a GPU under ``overlap_comm``: on the reduction stream):
        one reduce-scatter of each parameter's gradient padded to chunk_i·N and laid out
        rank-major (``reduce_scatter_coalesced``), Σ chunk_i·N elements; or the all-reduce
        below."""
        members, self.open_bucket, self.open_numel = self.open_bucket, [], 0
        if not members:
            return
        s, zero = self.strategy, self.strategy.zero
        if zero.overlap_comm:
            s.comm.note_stream("reduce")
        numel = sum(p.numel for p in members)
        contiguous = zero.contiguous_gradients and numel <= zero.reduce_bucket_size
        if not zero.reduce_scatter and contiguous:
            self.all_reduce_bucket(members, numel)
        else:
            members.sort(key=lambda p: s.where[id(p)])  # DeepSpeed sorts a bucket by ds_id
            buf, slots, width = pack_chunks(s, members, [p.grad for p in members])
            for p in members:
                p.grad = None
            reduce = partial(self.collective, s)
            s.reduction.reduce(buf, ShardPieces(s.land, slots), reduce, width)
        if zero.overlap_comm:
            s.comm.note_stream("compute")

    def all_reduce_bucket(self, members: list[Parameter], numel: int) -> None:
        """``reduce_scatter: false`` with contiguous gradients (DeepSpeed's
        ``__avg_scatter_contiguous_grads``): one all-reduce of the bucket's gradients end to end,
        unpadded, in the order they were added; each rank then keeps its chunk of each,
        elements [r·chunk_i, min((r + 1)·chunk_i, numel_i)) of parameter i."""
        s = self.strategy
        s.reduction.pending.complete(leave=MAX_IN_FLIGHT - 1)  # free a buffer
        buf = s.reduction.wire_buffer(numel)
        slots, at = [], 0  # (group, chunk offset in the shard, valid elements, bucket at)
        for p in members:
            gi, i = s.where[id(p)]
            assign(buf[at : at + p.numel], flat(p.grad))
            p.grad = None
            chunk = s.groups[gi].partition.chunks[i]
            lo = s.comm.rank * chunk
            valid = max(0, min(chunk, p.numel - lo))
            if valid:
                slots.append((gi, s.groups[gi].partition.offsets[i], valid, at + lo))
            at += p.numel
        s.reduction.reduce(buf, ShardPieces(s.land, slots), s.reduction.all_reduce)


class CoalescedFetcher(ParamFetcher):
    """DeepSpeed's fetcher: ``DeepSpeedCoordinator`` (``ds_coordinator.py``) decides which
    parameters to gather when; each decision is ONE coalesced all-gather, moved here."""

    coordinator_kind = "deepspeed"

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy)
        s = strategy
        self.released: Any = s.groups[0].xp.empty(0, dtype=s.dtype)  # a released param's data

    def attach(self, model: Any) -> None:
        self.coordinator = DeepSpeedCoordinator(self, model, self.strategy.zero)

    def start_coalesced_gather(self, params: list[Parameter]) -> CoalescedGather:
        """Start ONE all-gather of several parameters (DeepSpeed's ``all_gather_coalesced``):
        each rank sends its chunks of them end to end, S = Σ chunk_i elements, and receives
        N·S, rank-major. One parameter alone is a call of its own chunk, as in DeepSpeed."""
        s = self.strategy
        chunks = []
        for p in params:
            gi, i = s.where[id(p)]
            chunks.append(read_param_chunk(s, s.groups[gi], i))
        return self.gather_chunks(params, chunks, s.comm)

    def gather_chunks(
        self, params: list[Parameter], chunks: list[Any], comm: Any
    ) -> CoalescedGather:
        """Start ONE all-gather over ``comm`` of ``chunks`` (one per parameter) end to end."""
        s = self.strategy
        xp = xp_of(chunks[0])
        send = chunks[0] if len(chunks) == 1 else xp.concat(chunks)
        buf = xp.empty(send.size * comm.size, dtype=s.dtype)
        handle = self.start_all_gather(comm, buf, send)
        return CoalescedGather(params, [c.size for c in chunks], send, buf, handle)

    def start_all_gather(self, comm: Any, buf: Any, send: Any) -> Any:
        """The all-gather of one call: started under ``overlap_comm``, else run (None)."""
        return self.strategy.start_or_run(comm.iall_gather, comm.all_gather, buf, send)

    def finish_coalesced_gather(self, gather: CoalescedGather) -> None:
        """Wait for a coalesced gather and give each of its parameters its whole value."""
        if gather.handle is not None:
            gather.handle.wait()
            gather.handle = None
        xp = xp_of(gather.buf)
        rows = xp.reshape(gather.buf, (-1, gather.send.size))  # one row per rank of its group
        column = 0
        for p, chunk in zip(gather.params, gather.chunks, strict=True):
            full = xp.reshape(rows[:, column : column + chunk], (-1,))  # a copy unless alone
            home = self.persistent_buffer(p)
            if home is not None:  # persistent: the gathered value lands in its whole copy
                home[...] = full
                full = home
            p.data = xp.reshape(full[: p.numel], p.shape)
            column += chunk

    def free(self, p: Parameter) -> None:
        if self.persistent_buffer(p) is None:  # a persistent one keeps its whole copy
            p.data = self.released

    def persistent_buffer(self, p: Parameter) -> Any:
        """p's whole copy if p is persistent, else None."""
        gi, _ = self.strategy.where[id(p)]
        return self.strategy.groups[gi].persistent_buffers.get(id(p))

    def after_step(self) -> None:
        """Every persistent parameter is whole again (DeepSpeed's ``_post_step``)."""
        self.coordinator.persistent_gathered()

    def step_skipped(self) -> None:
        self.coordinator.persistent_released()


class Stage3DeepSpeed(DeepSpeedNormGroups, Stage3):
    """Stage 3 with DeepSpeed's coalesced fetches and its open gradient bucket."""

    boundary_rule = staticmethod(deepspeed_stage3_checks)

    reducer_cls = OpenBucket  # DeepSpeed's open gradient bucket, in hook order
    fetcher_cls = CoalescedFetcher  # DeepSpeed's coalesced gathers, prefetched by trace
