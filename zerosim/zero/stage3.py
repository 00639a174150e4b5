"""Stage 3 (P_os+g+p), the ZeRO paper's schedule: parameters, gradients and optimizer state are all
partitioned, and each module's parameters are gathered only while it runs.

Each rank keeps only its chunk of every parameter (``ParamPartition``: DeepSpeed's per-parameter
partition, chunk_i = ceil(numel_i / N)), concatenated in one shard buffer of P = Ψ_pad / N
elements. That buffer is both the model's partitioned parameters and, in float32/float64 training,
the master weights the optimizer updates in place; there is no all-gather after the step.

Parameters: the ``ParamCoordinator`` (``coordinator.py``) gathers each module's parameters before
its forward and before its backward, one all-gather per parameter of chunk_i elements per rank
straight into the parameter's buffer, and releases them after (with prefetch and reuse once the
module order is known).

Gradients: as soon as a parameter's gradient is final (``GradReadyTracker``) it is packed into its
bucket (``reduce_bucket_size`` elements, last parameters first), rank-major, so that one even
reduce-scatter hands each rank the sum of its own chunks of the bucket, which it adds to its
gradient shard (P elements).

Bytes one rank sends per micro-step, without reuse and with no persistent parameters, b bytes
per element:

    forward all-gather     Σ_i (N−1)·chunk_i·b = (N−1)/N·Ψ_pad·b
    backward all-gather    (N−1)/N·Ψ_pad·b                       (the same gathers again)
    reduce-scatter         (N−1)/N·Ψ_pad·b                       (every bucket: N rows of chunks)
    in all                 3(N−1)/N·Ψ_pad·b

Parameters with at most ``stage3_param_persistence_threshold`` elements stay whole on every rank
(``persistent``, reported separately): they are never gathered around modules; their gradients
are reduce-scattered like the others, and after the step their updated chunks are all-gathered
back into the whole copies (phase ``step``): 2(N−1)/N·Ψ_persist·b per step.

Beside this file, as subclasses of ``Stage3``: DeepSpeed 0.19.8's schedule (``stage3_deepspeed.py``:
coalesced fetches, prefetch by trace, buckets in hook order) and ZeRO++ (``stage3_zeropp.py``:
quantized and hierarchical gathers, quantized gradient reduction).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import numpy as np

from zerosim.backend import assign, flat, nbytes, to_host, xp_of
from zerosim.nn import GradReadyTracker, Parameter
from zerosim.zero.buckets import MAX_IN_FLIGHT, BucketQueue
from zerosim.zero.coordinator import ParamCoordinator
from zerosim.zero.init import ParamChunk
from zerosim.zero.offload import read_param_chunk
from zerosim.zero.partition import Range, per_param_partition
from zerosim.zero.segments import Segment
from zerosim.zero.strategy import Strategy


class ShardGroup:
    """One parameter group under stage 3: this rank's chunks of every parameter, end to end.

    Every field is declared here; ``Stage3.setup_gradients`` fills ``grad_shard``.
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


def static_buckets(chunks: list[int], world_size: int, bucket_size: int) -> list[list[int]]:
    """The paper's gradient buckets of one group: consecutive parameter indices, taken from the
    last parameter back, each bucket closed once it holds ≥ ``bucket_size`` padded elements
    (Σ chunk_i · N). Returns the buckets in launch order, each in ascending index order."""
    buckets, current, size = [], [], 0
    for i in reversed(range(len(chunks))):
        current.insert(0, i)
        size += chunks[i] * world_size
        if size >= bucket_size:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def pack_rank_major(block: Any, grad: Any) -> None:
    """Write a flat gradient into an (N, chunk) block, chunk r in row r: what rank r will own.

    The last chunk is partly padding (and a small parameter may leave whole rows of it), which
    stays as it was: zero in a freshly taken bucket buffer."""
    chunk = block.shape[1]
    rows, rest = divmod(grad.size, chunk) if chunk else (0, 0)
    assign(block[:rows, :], xp_of(block).reshape(grad[: rows * chunk], (rows, chunk)))
    if rest:
        assign(block[rows, :rest], grad[rows * chunk :])


class RankMajorBuckets:
    """One group's gradient buckets under the paper's schedule: fixed at start-up, filled as the
    gradients arrive, launched by ``queue`` strictly in bucket order."""

    def __init__(self, g: ShardGroup, world_size: int, bucket_size: int, launch: Callable) -> None:
        self.members = static_buckets(g.partition.chunks, world_size, bucket_size)  # indices
        self.bucket_of = {i: k for k, members in enumerate(self.members) for i in members}
        self.buffers: dict[int, Any] = {}  # bucket -> its (N, width) buffer while being filled
        ids = [[id(g.named_params[i][1]) for i in members] for members in self.members]
        self.queue = BucketQueue(ids, launch)


class Stage3(Strategy):
    """Partitioned parameters gathered around each module; bucketed gradient reduce-scatter."""

    stage = 3
    partitions_optimizer_states = True
    partitions_params = True

    def is_persistent(self, p: Parameter) -> bool:
        return p.numel <= self.zero.stage3_param_persistence_threshold

    def make_group(self, named: list[tuple[str, Parameter]], hyper: dict[str, Any]) -> ShardGroup:
        return ShardGroup(named, self, hyper)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.released = self.groups[0].xp.empty(0, dtype=self.dtype)  # a released param's data
        self.gathered: dict[int, Any] = {}  # id(param) -> its gathered buffer
        self.buckets: list[RankMajorBuckets] = [  # per group, its static gradient buckets
            RankMajorBuckets(
                g, self.comm.size, self.zero.reduce_bucket_size, partial(self._launch_bucket, gi)
            )
            for gi, g in enumerate(self.groups)
        ]
        self.coordinator: Any = None  # attach(): gathers and releases parameters around modules
        self.tracker: GradReadyTracker | None = None  # attach(): says when a gradient is final

    def setup_gradients(self) -> None:
        """Every group's gradient shard (this rank's chunks of every parameter's gradient)."""
        for g in self.groups:
            g.grad_shard = g.xp.zeros(g.partition.shard_numel, dtype=self.dtype)

    def attach(self, model: Any) -> None:
        self.coordinator = ParamCoordinator(self, model, self.zero)
        self.tracker = GradReadyTracker(model, self._ready)

    # -- gathering (called by the coordinator) ---------------------------------------------------
    def start_gather(self, p: Parameter) -> Any:
        """Start gathering p: every rank's chunk of it, into a buffer of N · chunk elements."""
        gi, i = self.where[id(p)]
        g = self.groups[gi]
        chunk = read_param_chunk(self, g, i)  # a file read under offload_param: nvme
        buf = g.xp.empty(chunk.size * self.comm.size, dtype=self.dtype)
        self.gathered[id(p)] = buf
        return self.start_or_run(self.comm.iall_gather, self.comm.all_gather, buf, chunk)

    def finish_gather(self, p: Parameter, handle: Any) -> None:
        """Wait for p's gather; p's data becomes a view of the gathered buffer."""
        if handle is not None:
            handle.wait()
        full = self.gathered[id(p)]
        p.data = xp_of(full).reshape(full[: p.numel], p.shape)

    def free(self, p: Parameter) -> None:
        self.gathered.pop(id(p), None)
        p.data = self.released  # no view of the gathered buffer survives, so it is freed

    # -- gradients -------------------------------------------------------------------------------
    def _ready(self, p: Parameter) -> None:
        gi, i = self.where[id(p)]
        self._pack(gi, i, p)
        self.buckets[gi].queue.ready(p)

    def _pack(self, gi: int, i: int, p: Parameter) -> None:
        """Copy p's gradient into its bucket's buffer, rank-major, and drop it."""
        if p.grad is None:
            return
        part, buckets = self.groups[gi].partition, self.buckets[gi]
        b = buckets.bucket_of[i]
        column = part.offsets[i] - part.offsets[buckets.members[b][0]]
        block = self._bucket_buffer(gi, b)[:, column : column + part.chunks[i]]
        pack_rank_major(block, flat(p.grad))
        p.grad = None

    def _bucket_buffer(self, gi: int, b: int) -> Any:
        """Bucket b's (N, width) buffer, rank-major: taken from the pool when first needed."""
        part, buckets = self.groups[gi].partition, self.buckets[gi]
        if b not in buckets.buffers:
            width = sum(part.chunks[j] for j in buckets.members[b])
            shape = (self.comm.size, width)
            buckets.buffers[b] = self.wire_buffer(shape)
        return buckets.buffers[b]

    def _launch_bucket(self, gi: int, b: int) -> None:
        """Reduce-scatter bucket b of group gi; its reduced row joins the gradient shard."""
        g, members = self.groups[gi], self.buckets[gi].members[b]
        for j in members:  # gradients of parameters whose uses never completed
            self._pack(gi, j, g.named_params[j][1])
        width = sum(g.partition.chunks[j] for j in members)
        buf = self._bucket_buffer(gi, b)
        del self.buckets[gi].buffers[b]
        self.pending.complete(leave=MAX_IN_FLIGHT - 1)  # free a buffer
        start = g.partition.offsets[members[0]]  # this rank's row lands in its gradient shard
        self.reduce_bucket(buf, g.grad_shard[start : start + width], self.reduce_rows, width)

    def reduce_rows(self, out: Any, buf: Any) -> Any:
        """Sum a rank-major (N, width) bucket over ranks into ``out`` (this rank's row): the
        reduce-scatter's handle, or None once it is done."""
        return self.start_or_run(
            self.comm.ireduce_scatter, self.comm.reduce_scatter, out, flat(buf)
        )

    def flush_buckets(self) -> None:
        """End of backward: launch every bucket not launched yet."""
        for buckets in self.buckets:
            buckets.queue.flush()

    # -- the engine's calls ----------------------------------------------------------------------
    def before_forward(self) -> None:
        self.coordinator.start_micro_step()

    def before_backward(self, boundary: bool) -> None:
        for buckets in self.buckets:
            buckets.queue.start()

    def after_backward(self, boundary: bool) -> None:
        self.tracker.reset()
        self.flush_buckets()
        self.pending.complete()
        self.coordinator.end_micro_step()
        if boundary:
            for g in self.groups:
                self.average(g.grad_shard)

    def grad_view(self, group: ShardGroup, rng: Range) -> Any:
        return group.grad_shard[rng.start : rng.stop]

    def gather(self) -> None:
        """After the step: refresh the whole copies of persistent parameters from the chunks."""
        for g in self.groups:
            for i, (_, p) in enumerate(g.named_params):
                if id(p) in g.persistent_buffers:
                    self.comm.all_gather(g.persistent_buffers[id(p)], g.chunk(i))

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
            tiles = self.sharded_step.tile_ranges[gi]
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
        return report

    @property
    def padded_numel(self) -> int:
        return sum(g.partition.padded_numel for g in self.groups)

    def persistent_padded_numel(self) -> int:
        """Ψ_persist: padded elements of the persistent parameters."""
        return sum(b.size for g in self.groups for b in g.persistent_buffers.values())
