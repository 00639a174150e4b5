"""Stage 3 (P_os+g+p): parameters, gradients and optimizer state are all partitioned.

Each rank keeps only its chunk of every parameter (``ParamPartition``: DeepSpeed's per-parameter
partition, chunk_i = ceil(numel_i / N)), concatenated in one shard buffer of P = Ψ_pad / N
elements. That buffer is both the model's partitioned parameters and, in float32/float64 training,
the master weights the optimizer updates in place; there is no all-gather after the step. The
``ParamCoordinator`` gathers each module's parameters around its forward and its backward.

Gradients: as soon as a parameter's gradient is final (``GradReadyTracker``) it is packed into its
bucket (``reduce_bucket_size`` elements, last parameters first), rank-major, so that one even
reduce-scatter hands each rank the sum of its own chunks of the bucket, which it adds to its
gradient shard (P elements). Per micro-step, without reuse and with no persistent parameters:
forward all-gather (N−1)/N·Ψ_pad·b + backward all-gather (N−1)/N·Ψ_pad·b + reduce-scatter
(N−1)/N·Ψ_pad·b = 3(N−1)/N·Ψ_pad·b.

Parameters with at most ``stage3_param_persistence_threshold`` elements stay whole on every rank
(``persistent``, reported separately): the paper's schedule never gathers them around modules;
their gradients are reduce-scattered like the others, and after the step their updated chunks are
all-gathered back into the whole copies (phase ``step``): 2(N−1)/N·Ψ_persist·b per step. Under
DeepSpeed's schedule the whole copy is still their home, but the coordinator treats them as
DeepSpeed does, which partitions them at start-up: gathered (into that copy) with their module's
other parameters while the first micro-step records the trace and at any later fetch that finds
them released, never released once a trace is complete, whole again after each step.

ZeRO++ (``zerosim/zero/zeropp.py``, ``docs/zeropp.md``) changes three of these collectives:
with ``zero_quantized_weights`` the forward all-gather carries int8 codes and scales; with
``zero_hpz_partition_size`` = g > 1 the backward all-gather runs inside groups of g ranks on
secondary chunks cut from the forward gather; with ``zero_quantized_gradients`` each bucket is
reduced by a two-hop int4 all-to-all instead of the reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from zerosim.backend import assign, flat, nbytes, to_host, xp_of
from zerosim.nn import GradReadyTracker, Linear, Parameter
from zerosim.zero import zeropp
from zerosim.zero.buckets import MAX_IN_FLIGHT, BucketQueue
from zerosim.zero.coordinator import ParamCoordinator
from zerosim.zero.ds_coordinator import DeepSpeedCoordinator
from zerosim.zero.init import ParamChunk
from zerosim.zero.offload import read_param_chunk
from zerosim.zero.partition import Range, per_param_partition
from zerosim.zero.segments import Segment
from zerosim.zero.strategy import Strategy
from zerosim.zero.zeropp import HierarchicalReducer, QuantizedGather, SecondaryPartition


class ShardGroup:
    """One parameter group under stage 3: this rank's chunks of every parameter, end to end.

    Every field is declared here; ``Stage3.setup_gradients`` fills the gradient and bucket ones.
    """

    def __init__(self, named: list[tuple[str, Parameter]], strategy: Stage3, hyper: dict) -> None:
        comm = strategy.comm
        self.named_params = named
        self.hyper = hyper
        self.partition = part = per_param_partition([(n, p.shape) for n, p in named], comm.size)
        self.xp = xp_of(named[0][1].data)
        self.flat_param = self.xp.zeros(part.shard_numel, dtype=strategy.dtype)
        self.owned = [Range(0, part.shard_numel)]
        self.persistent_buffers: dict[int, Any] = {}  # id(param) -> its whole copy
        self.grad_shard: Any = None  # the reduced gradient of this rank's chunks
        self.master: Any = None  # fp32 master of the chunks (mixed precision, offload)
        self.master_grads: Any = None  # (never used at stage 3; declared for the base class)
        self.buckets: list[list[int]] = []  # static buckets (paper schedule): indices, last first
        self.bucket_of: dict[int, int] = {}  # parameter index -> its bucket
        self.buffers: dict[int, Any] = {}  # bucket -> its (N, width) buffer while being filled
        self.secondary: SecondaryPartition | None = None  # hpZ's secondary chunks
        for i, (name, p) in enumerate(named):
            full = None
            if p.partition is not None:  # built inside zero.Init: adopt this rank's chunk
                if p.partition.comm.size != comm.size or p.partition.chunk.size != part.chunks[i]:
                    raise ValueError(
                        f"parameter {name!r} was partitioned over {p.partition.comm.size} ranks "
                        f"by zero.Init; the engine runs on {comm.size}: build it with the "
                        "engine's communicator"
                    )
                self.chunk(i)[...] = p.partition.chunk
            else:
                full = self.xp.astype(flat(p.data), strategy.dtype)
                lo, n = comm.rank * part.chunks[i], part.valid(i, comm.rank)
                if n:  # a chunk of padding only (small parameter, many ranks) takes nothing
                    self.chunk(i)[:n] = full[lo : lo + n]
            if strategy.is_persistent(p):
                if full is None:  # persistent here, partitioned by zero.Init: gather it once
                    full = p.partition.gather()
                buf = self.xp.zeros(part.chunks[i] * comm.size, dtype=strategy.dtype)
                buf[: p.numel] = full
                self.persistent_buffers[id(p)] = buf
                p.data = self.xp.reshape(buf[: p.numel], p.shape)
                p.partition = None
            else:
                p.data = self.xp.empty(0, dtype=strategy.dtype)
                p.partition = ParamChunk(comm, p.numel, self.chunk(i))  # GatheredParameters
            p.grad = None

    def chunk(self, index: int) -> Any:
        """This rank's chunk of parameter ``index`` (a view of the shard buffer)."""
        start = self.partition.offsets[index]
        return self.flat_param[start : start + self.partition.chunks[index]]


class Stage3(Strategy):
    """Partitioned parameters gathered around each module; bucketed gradient reduce-scatter."""

    stage = 3
    partitions_optimizer_states = True
    partitions_params = True

    def __init__(
        self, *, quantization_block_size: int = zeropp.WEIGHT_BLOCK_SIZE, **kwargs: Any
    ) -> None:
        self.quantization_block_size = quantization_block_size  # ZeRO++ blocks (qwZ and qgZ)
        super().__init__(**kwargs)

    def is_persistent(self, p: Parameter) -> bool:
        return p.numel <= self.zero.stage3_param_persistence_threshold

    def make_group(self, named: list[tuple[str, Parameter]], hyper: dict[str, Any]) -> ShardGroup:
        return ShardGroup(named, self, hyper)

    def setup_gradients(self) -> None:
        self.where: dict[int, tuple[int, int]] = {}
        self.queues: list[BucketQueue] = []
        self.gathered: dict[int, Any] = {}
        self.released = self.groups[0].xp.empty(0, dtype=self.dtype)
        z = self.zero
        zeropp_on = (
            z.zero_quantized_weights or z.zero_quantized_gradients or z.zero_hpz_partition_size > 1
        )
        # DeepSpeed's coalesced fetches and hook-order buckets (ds_coordinator.py); ZeRO++ and the
        # paper's schedule keep per-parameter gathers and static buckets (coordinator.py).
        self.deepspeed = self.schedule == "deepspeed" and not zeropp_on
        for gi, g in enumerate(self.groups):
            g.grad_shard = g.xp.zeros(g.partition.shard_numel, dtype=self.dtype)
            for i, (_, p) in enumerate(g.named_params):
                self.where[id(p)] = (gi, i)
            if not self.deepspeed:  # static buckets, launched in order by a queue per group
                g.buckets = self._buckets(g)
                g.bucket_of = {i: k for k, members in enumerate(g.buckets) for i in members}
                members = [[id(g.named_params[i][1]) for i in b] for b in g.buckets]
                self.queues.append(BucketQueue(members, self._launcher(g)))
        self._setup_zeropp()
        self.ds_bucket: list[Parameter] = []  # DeepSpeed's open gradient bucket, in ready order
        self.ds_bucket_numel = 0

    def _setup_zeropp(self) -> None:
        """ZeRO++: the hpZ groups and secondary partitions, and qgZ's two-hop reducer."""
        self.in_backward = False
        self.weight_block_size = self.quantization_block_size
        size = self.zero.zero_hpz_partition_size
        self.hpz_comm = None
        if size > 1:
            self.hpz_comm = self.comm.split_by(lambda r: (r // size, r))
            for g in self.groups:
                numels = [p.numel for _, p in g.named_params]
                gathered = [not self.is_persistent(p) for _, p in g.named_params]
                g.secondary = SecondaryPartition(self.hpz_comm, numels, gathered, self.dtype, g.xp)
        self.grad_reducer = None
        if self.zero.zero_quantized_gradients:
            self.grad_reducer = HierarchicalReducer(
                self.comm, zeropp.GRADIENT_BITS, self.quantization_block_size
            )

    def _buckets(self, g: ShardGroup) -> list[list[int]]:
        """Consecutive parameter indices, last first, ≥ reduce_bucket_size padded elements each."""
        buckets, current, size = [], [], 0
        for i in reversed(range(len(g.named_params))):
            current.insert(0, i)
            size += g.partition.chunks[i] * self.comm.size
            if size >= self.zero.reduce_bucket_size:
                buckets.append(current)
                current, size = [], 0
        if current:
            buckets.append(current)
        return buckets

    def attach(self, model: Any) -> None:
        if self.deepspeed:
            self.coordinator = DeepSpeedCoordinator(self, model, self.zero)
            self.tracker = GradReadyTracker(model, self._ready_ds, order=deepspeed_grad_order)
        else:
            self.coordinator = ParamCoordinator(self, model, self.zero)
            self.tracker = GradReadyTracker(model, self._ready)

    # -- gathering (called by the coordinator) ---------------------------------------------------
    def start_gather(self, p: Parameter) -> Any:
        """Start gathering p: the primary chunks over every rank (int8 codes in forward under
        qwZ), or in backward under hpZ the fresh secondary chunks over the hpZ group."""
        gi, i = self.where[id(p)]
        g = self.groups[gi]
        secondary = g.secondary
        if self.in_backward and secondary is not None and secondary.fresh[i]:
            comm, chunk = secondary.comm, secondary.chunk(i)
        else:
            comm, chunk = self.comm, read_param_chunk(self, g, i)  # a file read under nvme
        buf = g.xp.empty(chunk.size * comm.size, dtype=self.dtype)
        self.gathered[id(p)] = buf
        if comm is self.comm and self.zero.zero_quantized_weights and not self.in_backward:
            pending = QuantizedGather(
                comm, buf, chunk, self.zero.overlap_comm, self.weight_block_size
            )
            self.track_transient(pending.nbytes)
            return pending
        if self.zero.overlap_comm:
            return comm.iall_gather(buf, chunk)
        comm.all_gather(buf, chunk)
        return None

    def finish_gather(self, p: Parameter, handle: Any) -> None:
        if handle is not None:
            handle.wait()
            if isinstance(handle, QuantizedGather):
                self.track_transient(-handle.nbytes)
        gi, i = self.where[id(p)]
        g = self.groups[gi]
        full = self.gathered[id(p)]
        secondary = g.secondary
        if secondary is not None and not secondary.fresh[i]:  # a full gather: cut the chunk
            secondary.store(i, full)
        p.data = g.xp.reshape(full[: p.numel], p.shape)

    def free(self, p: Parameter) -> None:
        self.gathered.pop(id(p), None)
        if self._persistent_buffer(p) is not None:
            return  # its whole copy stays: zerosim's home of a persistent parameter
        p.data = self.released  # no view of the gathered buffer survives, so it is freed

    def _persistent_buffer(self, p: Parameter) -> Any:
        """p's whole copy if p is persistent, else None."""
        gi, _ = self.where[id(p)]
        return self.groups[gi].persistent_buffers.get(id(p))

    def start_coalesced_gather(self, params: list[Parameter]) -> CoalescedGather:
        """Start ONE all-gather of several parameters (DeepSpeed's ``all_gather_coalesced``):
        each rank sends its chunks of them end to end, S = Σ chunk_i elements, and receives
        N·S, rank-major. One parameter alone is a call of its own chunk, as in DeepSpeed."""
        chunks = []
        for p in params:
            gi, i = self.where[id(p)]
            chunks.append(read_param_chunk(self, self.groups[gi], i))
        xp = xp_of(chunks[0])
        send = chunks[0] if len(chunks) == 1 else xp.concat(chunks)
        buf = xp.empty(send.size * self.comm.size, dtype=self.dtype)
        handle = None
        if self.zero.overlap_comm:
            handle = self.comm.iall_gather(buf, send)
        else:
            self.comm.all_gather(buf, send)
        return CoalescedGather(params, [c.size for c in chunks], send, buf, handle)

    def finish_coalesced_gather(self, gather: CoalescedGather) -> None:
        """Wait for a coalesced gather and give each of its parameters its whole value."""
        if gather.handle is not None:
            gather.handle.wait()
            gather.handle = None
        xp = xp_of(gather.buf)
        rows = xp.reshape(gather.buf, (self.comm.size, gather.send.size))
        column = 0
        for p, chunk in zip(gather.params, gather.chunks, strict=True):
            full = xp.reshape(rows[:, column : column + chunk], (-1,))  # a copy unless alone
            home = self._persistent_buffer(p)
            if home is not None:  # persistent: the gathered value lands in its whole copy
                home[...] = full
                full = home
            p.data = xp.reshape(full[: p.numel], p.shape)
            column += chunk

    # -- gradients -------------------------------------------------------------------------------
    def _ready(self, p: Parameter) -> None:
        gi, i = self.where[id(p)]
        g = self.groups[gi]
        b = g.bucket_of[i]
        self._pack(g, b, i, p)
        self.queues[gi].ready(p)

    def _ready_ds(self, p: Parameter) -> None:
        """DeepSpeed's bucket rule (stage3.py, ``reduce_independent_p_g_buckets_and_remove_grads``):
        in the order gradients become ready, reduce the open bucket first if this gradient
        would take it past ``reduce_bucket_size`` elements (unpadded numel), then add it."""
        if p.grad is None:
            return
        full = self.ds_bucket_numel + p.numel > self.zero.reduce_bucket_size
        if full and self.ds_bucket_numel > 0:
            self._reduce_ds_bucket()
        self.ds_bucket.append(p)
        self.ds_bucket_numel += p.numel

    def _reduce_ds_bucket(self) -> None:
        """One reduce-scatter of the open bucket: each parameter's gradient padded to
        chunk_i·N and laid out rank-major (``reduce_scatter_coalesced``), Σ chunk_i·N elements."""
        members, self.ds_bucket, self.ds_bucket_numel = self.ds_bucket, [], 0
        if not members:
            return
        zero = self.zero
        numel = sum(p.numel for p in members)
        contiguous = zero.contiguous_gradients and numel <= zero.reduce_bucket_size
        if not zero.reduce_scatter and contiguous:
            self._all_reduce_ds_bucket(members, numel)
            return
        members.sort(key=lambda p: self.where[id(p)])  # DeepSpeed sorts a bucket by ds_id
        slots = []  # (group, chunk offset in the shard, chunk, column in the bucket)
        width = 0
        for p in members:
            gi, i = self.where[id(p)]
            g = self.groups[gi]
            slots.append((g, g.partition.offsets[i], g.partition.chunks[i], width))
            width += g.partition.chunks[i]
        self.pending.complete(leave=MAX_IN_FLIGHT - 1)  # free a buffer
        buf = self.take_buffer((self.comm.size, width), self.wire_dtype(self.dtype))
        xp = xp_of(buf)
        for p, (_, _, chunk, column) in zip(members, slots, strict=True):
            block = buf[:, column : column + chunk]
            grad = flat(p.grad)
            rows, rest = divmod(p.numel, chunk) if chunk else (0, 0)
            assign(block[:rows, :], xp.reshape(grad[: rows * chunk], (rows, chunk)))
            if rest:  # the last chunk is partly padding, which stays zero
                assign(block[rows, :rest], grad[rows * chunk :])
            p.grad = None
        self.before_reduction(buf)
        out = self.take_buffer(width, buf.dtype)
        handle = None
        if self.zero.overlap_comm:
            handle = self.comm.ireduce_scatter(out, flat(buf))
        else:
            self.comm.reduce_scatter(out, flat(buf))
        dest = ShardSlices(
            [(g.grad_shard, start, chunk, column) for g, start, chunk, column in slots]
        )
        self.pending.add(handle, out, dest, (buf, out))

    def _all_reduce_ds_bucket(self, members: list[Parameter], numel: int) -> None:
        """``reduce_scatter: false`` with contiguous gradients (DeepSpeed's
        ``__avg_scatter_contiguous_grads``): one all-reduce of the bucket's gradients end to end,
        unpadded, in the order they were added; each rank then keeps its chunk of each,
        elements [r·chunk_i, min((r + 1)·chunk_i, numel_i)) of parameter i."""
        self.pending.complete(leave=MAX_IN_FLIGHT - 1)  # free a buffer
        buf = self.take_buffer(numel, self.wire_dtype(self.dtype))
        slots, at = [], 0  # (grad_shard, chunk offset in the shard, valid elements, bucket at)
        for p in members:
            gi, i = self.where[id(p)]
            g = self.groups[gi]
            assign(buf[at : at + p.numel], flat(p.grad))
            p.grad = None
            chunk = g.partition.chunks[i]
            lo = self.comm.rank * chunk
            valid = max(0, min(chunk, p.numel - lo))
            if valid:
                slots.append((g.grad_shard, g.partition.offsets[i], valid, at + lo))
            at += p.numel
        self.before_reduction(buf)
        handle = None
        if self.zero.overlap_comm:
            handle = self.comm.iall_reduce(buf)
        else:
            self.comm.all_reduce(buf)
        self.pending.add(handle, buf, ShardSlices(slots), (buf,))

    def _pack(self, g: ShardGroup, b: int, i: int, p: Parameter) -> None:
        """Copy p's gradient into bucket b's buffer, rank-major, and drop it."""
        if p.grad is None:
            return
        members = g.buckets[b]
        column = g.partition.offsets[i] - g.partition.offsets[members[0]]
        chunk = g.partition.chunks[i]
        block = self._bucket_buffer(g, b)[:, column : column + chunk]  # rank r's chunk in row r
        grad = flat(p.grad)
        rows, rest = divmod(p.numel, chunk) if chunk else (0, 0)
        assign(block[:rows, :], g.xp.reshape(grad[: rows * chunk], (rows, chunk)))
        if rest:  # the last chunk is partly padding, which stays zero
            assign(block[rows, :rest], grad[rows * chunk :])
        p.grad = None

    def _bucket_buffer(self, g: ShardGroup, b: int) -> Any:
        """Bucket b's (N, width) buffer, rank-major: taken from the pool when first needed."""
        if b not in g.buffers:
            width = sum(g.partition.chunks[j] for j in g.buckets[b])
            g.buffers[b] = self.take_buffer((self.comm.size, width), self.wire_dtype(self.dtype))
        return g.buffers[b]

    def _launcher(self, g: ShardGroup) -> Any:
        def launch(b: int) -> None:
            members = g.buckets[b]
            for j in members:  # gradients of parameters whose uses never completed
                self._pack(g, b, j, g.named_params[j][1])
            width = sum(g.partition.chunks[j] for j in members)
            buf = self._bucket_buffer(g, b)
            del g.buffers[b]
            self.pending.complete(leave=MAX_IN_FLIGHT - 1)  # free a buffer
            self.before_reduction(buf)
            out = self.take_buffer(width, buf.dtype)
            start = g.partition.offsets[members[0]]
            dest = g.grad_shard[start : start + width]
            handle = None
            if self.grad_reducer is not None:  # qgZ: blocking two-hop quantized all-to-all
                out[...] = g.xp.astype(self.grad_reducer.reduce(buf), out.dtype)
            elif self.zero.overlap_comm:
                handle = self.comm.ireduce_scatter(out, flat(buf))
            else:
                self.comm.reduce_scatter(out, flat(buf))
            self.pending.add(handle, out, dest, (buf, out))

        return launch

    def before_forward(self) -> None:
        self.in_backward = False
        self.coordinator.start_micro_step()

    def before_backward(self, boundary: bool) -> None:
        self.in_backward = True
        if not self.deepspeed:
            for q in self.queues:
                q.start()

    def after_backward(self, boundary: bool) -> None:
        self.tracker.reset()
        if self.deepspeed:
            self._reduce_ds_bucket()  # DeepSpeed's backward epilogue reduces the last bucket
        else:
            for q in self.queues:
                q.flush()
        self.pending.complete()
        self.coordinator.end_micro_step()
        self.in_backward = False
        if boundary:
            for g in self.groups:
                self.average(g.grad_shard)

    def grad_view(self, group: ShardGroup, rng: Range) -> Any:
        return group.grad_shard[rng.start : rng.stop]

    def gather(self) -> None:
        """After the step: refresh the whole copies of persistent parameters from the chunks;
        hpZ's secondary chunks are stale until the next forward gather cuts them again."""
        for g in self.groups:
            if g.secondary is not None:
                g.secondary.invalidate()
            for i, (_, p) in enumerate(g.named_params):
                if id(p) in g.persistent_buffers:
                    self.comm.all_gather(g.persistent_buffers[id(p)], g.chunk(i))
        if self.deepspeed:
            self.coordinator.persistent_gathered()

    def step_skipped(self) -> None:
        if self.deepspeed:
            self.coordinator.persistent_released()

    def zero_grad(self) -> None:
        for g in self.groups:
            g.grad_shard[...] = 0

    def grad_bytes(self) -> int:
        return sum(nbytes(g.grad_shard) for g in self.groups)

    # -- views for the engine, checkpoints and reports --------------------------------------------
    def segments(self, which: str = "owned") -> list[Segment]:
        if which not in ("owned", "stepped"):
            raise ValueError(f"which must be 'owned' or 'stepped', got {which!r}")
        out = []
        for gi, g in enumerate(self.groups):
            part = g.partition
            tiles = self.tile_ranges[gi]
            for i, name in enumerate(part.names):
                n = part.valid(i, self.comm.rank)
                local = Range(part.offsets[i], part.offsets[i] + n)
                first = self.comm.rank * part.chunks[i]
                for k, tile in enumerate(tiles):
                    x = tile.intersect(local)
                    if x is not None:
                        rng = Range(first + x.start - local.start, first + x.stop - local.start)
                        out.append(Segment(name, rng, gi, k, x.start - tile.start))
        return out

    def full_state_dict(self) -> dict[str, np.ndarray]:
        """Collective: every parameter all-gathered from its chunks (of the fp32 master under
        mixed precision), as host arrays."""
        out = {}
        dtype = self.master_dtype or self.dtype
        for g in self.groups:
            source = g.master if self.master_dtype is not None else g.flat_param
            for i, (name, p) in enumerate(g.named_params):
                start = g.partition.offsets[i]
                chunk = source[start : start + g.partition.chunks[i]]
                buf = xp_of(chunk).empty(g.partition.chunks[i] * self.comm.size, dtype=dtype)
                self.comm.all_gather(buf, chunk)
                out[name] = to_host(buf[: p.numel]).reshape(p.shape).copy()
        return out

    def iter_params(self) -> Iterator[tuple[str, np.ndarray]]:
        """Collective: each parameter all-gathered from its model-dtype chunks, one at a time,
        so no rank ever holds more than one full parameter here."""
        for g in self.groups:
            for i, (name, p) in enumerate(g.named_params):
                if id(p) in g.persistent_buffers:
                    yield name, to_host(g.persistent_buffers[id(p)][: p.numel]).reshape(p.shape)
                    continue
                buf = g.xp.empty(g.partition.chunks[i] * self.comm.size, dtype=self.dtype)
                self.comm.all_gather(buf, g.chunk(i))
                yield name, to_host(buf[: p.numel]).reshape(p.shape)
                del buf

    def memory_report(self) -> dict[str, int]:
        report = super().memory_report()
        report["persistent_params"] = sum(
            nbytes(b) for g in self.groups for b in g.persistent_buffers.values()
        )
        report["peak_gathered_params"] = self.coordinator.peak_live_bytes
        if self.hpz_comm is not None:
            report["hpz_secondary_params"] = sum(nbytes(g.secondary.buffer) for g in self.groups)
        return report

    @property
    def padded_numel(self) -> int:
        return sum(g.partition.padded_numel for g in self.groups)

    def persistent_padded_numel(self) -> int:
        """Ψ_persist: padded elements of the persistent parameters."""
        return sum(b.size for g in self.groups for b in g.persistent_buffers.values())


class CoalescedGather:
    """One coalesced all-gather in flight: its parameters, their chunk sizes, both buffers."""

    def __init__(
        self, params: list[Parameter], chunks: list[int], send: Any, buf: Any, handle: Any
    ) -> None:
        self.params = params  # in the order their chunks sit in each rank's segment
        self.chunks = chunks  # each parameter's chunk, elements
        self.send = send  # this rank's chunks end to end (kept alive while in flight)
        self.buf = buf  # N segments, one per rank
        self.handle = handle  # the non-blocking all-gather, or None once complete


class ShardSlices:
    """The destination of one DeepSpeed bucket: ``+= out`` adds each parameter's reduced chunk
    (``out[column : column + chunk]``) into its group's gradient shard."""

    def __init__(self, slots: list[tuple[Any, int, int, int]]) -> None:
        self.slots = slots  # (grad_shard, start, chunk, column)

    def __iadd__(self, out: Any) -> ShardSlices:
        for shard, start, chunk, column in self.slots:
            shard[start : start + chunk] += out[column : column + chunk]
        return self


def deepspeed_grad_order(module: Any) -> tuple[str, ...]:
    """The order DeepSpeed's stage 3 finishes a module's gradients: a Linear's weight before its
    bias (its zero.Init swaps in ``LinearFunctionForZeroStage3``); other modules as in torch."""
    if isinstance(module, Linear):
        return ("weight", "bias")
    return tuple(getattr(module, "grad_ready_order", ()))
