"""Stage 3 with ZeRO++ (``zero_quantized_weights``, ``zero_hpz_partition_size``,
``zero_quantized_gradients``): what it changes in the paper's stage 3 (``stage3.py``), and why.

ZeRO++ (Wang et al. 2023, arXiv:2306.10209) keeps ZeRO-3's partition and memory and cuts its
cross-node traffic, 3M per step (forward all-gather, backward all-gather, gradient
reduce-scatter), to 0.75M by changing those three collectives, each independently:

* **qwZ** (``zero_quantized_weights``): each rank quantizes its chunk of a parameter to int8 in
  blocks of ``quantization_block_size`` elements, one float32 scale per block, before the forward
  all-gather; the int8 codes and the scales travel in two all-gathers and every rank dequantizes
  the whole parameter (``QuantizedGather``). 1 byte per element (+ 4 bytes per block) instead of
  b. DeepSpeed 0.19.8: ``partition_parameters.py``, ``all_gather_coalesced(..., quantize=True)``.
* **hpZ** (``zero_hpz_partition_size`` = g): besides its primary chunk (1/N of each parameter)
  each rank keeps a *secondary* chunk, 1/g of the parameter, cut within its group of g
  consecutive ranks (a node when g = ranks per node) from the forward gather
  (``SecondaryPartition``). The backward all-gather runs inside the group, on the secondary
  chunks: no backward byte crosses a node. DeepSpeed: ``partition_parameters.py``,
  ``ds_secondary_tensor``.
* **qgZ** (``zero_quantized_gradients``): each gradient bucket's reduce-scatter becomes a
  hierarchical all-to-all of int4 codes: quantize, all-to-all within the node, dequantize and
  sum, quantize again, all-to-all across nodes (between ranks with the same local index),
  dequantize and sum (``HierarchicalReducer``). DeepSpeed: ``stage3.py``, ``__avg_scatter_grads``
  → ``runtime/comm/coalesced_collectives.py``, ``all_to_all_quant_reduce``.

Under the paper's schedule (``Stage3ZeroPP``) everything else is the paper's stage 3:
per-parameter gathers around each use (``coordinator.py``) and static gradient buckets; the
byte formulas are ``zerosim.analysis.volume.zeropp_step_bytes``. Under DeepSpeed's
(``Stage3ZeroPPDeepSpeed``, the default) it is DeepSpeed's stage 3 (``stage3_deepspeed.py``):
a module's gathers coalesced and prefetched by trace, each call quantized once under qwZ and
taken from the secondary chunks wherever they are fresh (``ZeroPPCoalescedFetcher``), and the
open gradient bucket reduced by qgZ (``QuantizedOpenBucket``). The quantizers are ``zeropp.py``;
docs/zeropp.md lists what differs from DeepSpeed.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from zerosim.backend import array_module, flat, nbytes
from zerosim.meta.fusion import fused
from zerosim.nn import Parameter
from zerosim.zero.buckets import RankMajorReduceScatter, reduce_rows
from zerosim.zero.ds_schedule import DeepSpeedNormGroups
from zerosim.zero.offload import read_param_chunk
from zerosim.zero.schedule import deepspeed_stage3_checks
from zerosim.zero.stage3 import GatherEach, Stage3
from zerosim.zero.stage3_deepspeed import CoalescedFetcher, CoalescedGather, OpenBucket
from zerosim.zero.zeropp import (
    GRADIENT_BITS,
    GRADIENT_BLOCK_SIZE,
    SCALE_DTYPE,
    WEIGHT_BITS,
    WEIGHT_BLOCK_SIZE,
    dequantize,
    quantize,
)


class QuantizedGather:
    """qwZ: all-gather one parameter's chunks as int8 codes plus float32 scales (two
    all-gathers), then dequantize every rank's chunk into ``out`` (N · chunk elements)."""

    def __init__(self, comm: Any, out: Any, chunk: Any, overlap: bool, block_size: int) -> None:
        xp = array_module(chunk)
        self.out: Any = out  # the whole parameter, dequantized here
        self.width: int = chunk.size  # elements of each rank's chunk
        self.block: int = block_size  # elements per scale
        codes, scales = quantize(chunk, WEIGHT_BITS, block_size)
        # every rank's int8 codes, one row each
        self.codes: Any = xp.empty((comm.size, codes.shape[1]), dtype=codes.dtype)
        # every rank's float32 scales, one row each
        self.scales: Any = xp.empty((comm.size, scales.shape[1]), dtype=SCALE_DTYPE)
        start = comm.iall_gather if overlap else comm.all_gather
        # the two all-gathers (None once done)
        self.handles: list[Any] = [start(self.codes, flat(codes)), start(self.scales, scales)]
        # bytes of codes and scales, held while in flight
        self.nbytes: int = nbytes(self.codes) + nbytes(self.scales)

    def wait(self) -> None:
        for h in self.handles:
            if h is not None:
                h.wait()
        dequantize_into(self.out, self.codes, self.scales, self.width, self.block)


@fused("dequantize")
def dequantize_into(out: Any, codes: Any, scales: Any, width: int, block_size: int) -> None:
    """qwZ's rows of int8 codes dequantized straight into ``out`` in its dtype: one kernel that
    reads the codes and scales and writes ``out`` (DeepSpeed's ``dequantize`` writes the
    gathered buffer in the model dtype). Returns nothing: ``out``, counted once as the argument
    it writes through, is the result."""
    rows = dequantize(codes, scales, width, WEIGHT_BITS, block_size)
    out[...] = array_module(rows).astype(flat(rows), out.dtype)


class SecondaryPartition:
    """hpZ: this rank's secondary chunks (1/g of each gathered parameter) and their group.

    Parameter i is zero-padded to g · chunk'_i, chunk'_i = ceil(numel_i / g) under the paper's
    schedule and N · chunk_i / g under DeepSpeed's (its ``_partition_param_sec`` cuts the
    primary partition's padded size); group rank j keeps elements [j · chunk'_i, (j + 1) ·
    chunk'_i). A chunk is *fresh* once it has been cut from a full gather of the current
    parameters; the optimizer step makes every chunk stale, and the next full all-gather
    (dequantized under qwZ, as in DeepSpeed) refreshes it. Persistent parameters are never
    gathered and get an empty chunk.
    """

    def __init__(
        self,
        comm: Any,
        numels: list[int],
        gathered: list[bool],
        dtype: Any,
        xp: Any,
        padded: list[int] | None = None,
    ) -> None:
        """``padded``: each parameter's elements as the secondary chunks cut it, g · chunk'_i
        (None: ceil(numel_i / g) a chunk; DeepSpeed cuts the primary's padding, N · chunk_i)."""
        self.comm: Any = comm  # the hpZ group of g ranks
        g = comm.size
        padded = padded or [g * max(1, math.ceil(n / g)) for n in numels]
        self.chunks: list[int] = [  # each parameter's secondary chunk (0: never gathered)
            m // g if keep else 0 for m, keep in zip(padded, gathered, strict=True)
        ]
        self.numels: list[int] = numels  # each parameter's elements
        # where each chunk starts in buffer
        self.offsets: list[int] = [sum(self.chunks[:i]) for i in range(len(numels))]
        # this rank's secondary chunks, end to end
        self.buffer: Any = xp.zeros(sum(self.chunks), dtype=dtype)
        # per parameter: its chunk holds this step's values
        self.fresh: list[bool] = [False] * len(numels)

    def chunk(self, i: int) -> Any:
        return self.buffer[self.offsets[i] : self.offsets[i] + self.chunks[i]]

    def store(self, i: int, full: Any) -> None:
        """Cut this rank's secondary chunk of parameter i from its gathered ``full`` buffer."""
        lo = self.comm.rank * self.chunks[i]
        valid = max(0, min(self.chunks[i], self.numels[i] - lo))
        mine = self.chunk(i)
        if valid:  # a chunk past the parameter's end is padding only
            mine[:valid] = full[lo : lo + valid]
        mine[valid:] = 0
        self.fresh[i] = True

    def invalidate(self) -> None:
        self.fresh = [False] * len(self.fresh)


class HierarchicalReducer:
    """qgZ: the reduce-scatter of a rank-major gradient bucket as a two-hop quantized all-to-all.

    Nodes come from ``comm.node_of`` (every rank on one node when unknown) and must have equal
    sizes: n nodes of L ranks, node a holding ranks m_a[0] < … < m_a[L−1]. Hop 1 runs on the
    ranks of one node: rank (a, j) sends local rank i the rows m_0[i], …, m_{n−1}[i] and gets back
    the node's n partial sums of rows m_0[j], …, m_{n−1}[j]. Hop 2 runs on the ranks with local
    index j, one per node: row m_b[j] goes to node b. Each rank ends with the sum of its own row,
    as a reduce-scatter would leave it (the paper's "tensor slice reordering" is the row order of
    hop 1). Codes are int4 in blocks of ``GRADIENT_BLOCK_SIZE`` per row; sums are float32.

    Bytes one rank sends for rows of w elements, Q(w) = ceil(w / 2) + 4 · ceil(w / B):
        hop 1 (intra-node)  (L − 1) · n · Q(w)        hop 2 (inter-node)  (n − 1) · Q(w)
    in all (N − 1) · Q(w): ≈ 1/4 of a 16-bit reduce-scatter's (N − 1) · 2w.
    """

    def __init__(self, comm: Any, bits: int = GRADIENT_BITS, block_size: int = GRADIENT_BLOCK_SIZE):
        nodes = comm.node_of or (0,) * comm.size
        labels = sorted(set(nodes))
        members = [[r for r in range(comm.size) if nodes[r] == label] for label in labels]
        sizes = sorted({len(m) for m in members})
        if len(sizes) != 1:
            raise ValueError(
                "zero_quantized_gradients needs the same number of ranks on every node; got "
                f"node sizes {[len(m) for m in members]} (set zerosim.ranks_per_node)"
            )
        self.bits: int = bits  # bits per quantized code
        self.block: int = block_size  # elements per scale
        self.nodes: int = len(members)  # the number of nodes
        self.local: int = sizes[0]  # ranks per node
        node = [labels.index(nodes[r]) for r in range(comm.size)]  # node index of each rank
        local = [members[node[r]].index(r) for r in range(comm.size)]  # index within it
        self.intra: Any = comm.split_by(lambda r: (node[r], r))  # the ranks of this node
        # the ranks of this local index, one per node
        self.inter: Any = comm.split_by(lambda r: (local[r], node[r]))
        # the ranks in the order the two hops deliver rows
        self.order: list[int] = [
            members[b][i] for i in range(self.local) for b in range(self.nodes)
        ]

    def reduce(self, rows: Any) -> Any:
        """rows: (N, w), row q is what rank q owns; returns the float32 sum of this rank's row.
        Three kernels as DeepSpeed's ``all_to_all_quant_reduce`` runs them (``swizzle_quant``,
        ``quantized_reduction``, ``dequantize``), each one ``fused`` kernel on PyTorch's path."""
        width = rows.shape[1]
        codes, scales = swizzle_quantize(rows, self.order, self.bits, self.block)
        codes, scales = self._hop(self.intra, codes, scales)
        codes, scales = quantized_reduction(codes, scales, width, self.bits, self.block, self.local)
        codes, scales = self._hop(self.inter, codes, scales)
        rows = dequantize(codes, scales, width, self.bits, self.block)
        return array_module(rows).sum(rows, axis=0)

    def _hop(self, comm: Any, codes: Any, scales: Any) -> tuple[Any, Any]:
        """One hop: the codes and the scales, each in an all-to-all over ``comm``."""
        xp = array_module(codes)
        got_codes, got_scales = xp.empty_like(codes), xp.empty_like(scales)
        comm.all_to_all(got_codes, codes)
        comm.all_to_all(got_scales, scales)
        return got_codes, got_scales


@fused("swizzle_quant")
def swizzle_quantize(rows: Any, order: list[int], bits: int, block_size: int) -> tuple[Any, Any]:
    """qgZ's first kernel: ``rows`` (N, w) reordered as the two hops deliver them, then
    quantized (DeepSpeed's ``swizzle_quant``: the reorder and the quantization in one pass)."""
    xp = array_module(rows)
    ordered = rows[order] if xp is np else xp.take(rows, xp.asarray(order, dtype=np.int64), axis=0)
    return quantize(ordered, bits, block_size)


@fused("quantized_reduction")
def quantized_reduction(
    codes: Any, scales: Any, width: int, bits: int, block_size: int, parts: int
) -> tuple[Any, Any]:
    """qgZ's second kernel: the rows of ``parts`` senders dequantized, summed in float32 and
    quantized again (DeepSpeed's ``quantized_reduction``, one pass): (parts · n, w) → (n, w)."""
    rows = dequantize(codes, scales, width, bits, block_size)
    xp = array_module(rows)
    partial = xp.sum(xp.reshape(rows, (parts, -1, width)), axis=0)
    return quantize(partial, bits, block_size)


class SecondaryChunks:
    """hpZ's part of a stage-3 fetcher (mixed in before it): the group of g =
    ``zero_hpz_partition_size`` consecutive ranks, each shard group's secondary chunks (cut as
    DeepSpeed cuts them where ``deepspeed_cut``), stale after every step, and their bytes in
    the memory report. Without hpZ the group is None and every entry of ``secondary`` too."""

    deepspeed_cut = False  # the secondary chunks: ceil(numel_i / g), or DeepSpeed's N·c_i / g

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy)
        s, size = strategy, strategy.zero.zero_hpz_partition_size
        self.hpz_comm: Any = None  # hpZ: this rank's group of `size` consecutive ranks
        self.secondary: list[SecondaryPartition | None] = [None] * len(s.groups)  # per group
        if size <= 1:
            return
        self.hpz_comm = s.comm.split_by(lambda r: (r // size, r))
        for gi, g in enumerate(s.groups):
            numels = [p.numel for _, p in g.named_params]
            gathered = [not s.is_persistent(p) for _, p in g.named_params]
            padded = [s.comm.size * c for c in g.partition.chunks] if self.deepspeed_cut else None
            self.secondary[gi] = SecondaryPartition(
                self.hpz_comm, numels, gathered, s.dtype, g.xp, padded
            )

    def after_step(self) -> None:
        """hpZ's secondary chunks are stale after the step, until the next full gather cuts
        them again."""
        super().after_step()
        for secondary in self.secondary:
            if secondary is not None:
                secondary.invalidate()

    def memory(self) -> dict[str, int]:
        report = super().memory()
        if self.hpz_comm is not None:
            report["hpz_secondary_params"] = sum(nbytes(s.buffer) for s in self.secondary)
        return report


class QuantizedGradients:
    """qgZ for a stage-3 reducer whose collective is ``collective(strategy, out, rows)`` on a
    rank-major bucket: the two-hop quantized all-to-all when qgZ is on, else the reduce-scatter
    (``reduce_rows``) both use (mixed in before the paper's buckets or DeepSpeed's open bucket)."""

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy)
        # qgZ: the two-hop quantized all-to-all, built at attach()
        self.qgz: HierarchicalReducer | None = None

    def attach(self, model: Any) -> None:
        """The bucket hooks; under qgZ its two groups of ranks, split after hpZ's (the fetcher,
        built with the stage), so the ledger names them world/split2 and world/split3."""
        super().attach(model)
        s = self.strategy
        if s.zero.zero_quantized_gradients:
            self.qgz = HierarchicalReducer(s.comm, GRADIENT_BITS, s.quantization_block_size)

    def collective(self, strategy: Any, out: Any, buf: Any) -> Any:
        """qgZ's collective of a rank-major bucket: the blocking two-hop quantized all-to-all
        (``HierarchicalReducer``) when qgZ is on, else the reduce-scatter."""
        if self.qgz is None:
            return reduce_rows(strategy, out, buf)
        out[...] = array_module(out).astype(self.qgz.reduce(buf), out.dtype)
        return None


class QuantizedBuckets(QuantizedGradients, RankMajorReduceScatter):
    """The paper's rank-major buckets, each reduced under qgZ by the two-hop quantized
    all-to-all instead of a reduce-scatter."""


class QuantizedOpenBucket(QuantizedGradients, OpenBucket):
    """DeepSpeed's open gradient bucket (sorted by parameter, each gradient padded to
    N · chunk_i, rank-major), reduced under qgZ by the two-hop quantized all-to-all
    (DeepSpeed's ``__avg_scatter_grads`` → ``all_to_all_quant_reduce``); on a GPU, on
    DeepSpeed's reduction stream as every bucket of ``OpenBucket``."""


class ZeroPPFetcher(SecondaryChunks, GatherEach):
    """The paper's per-parameter gathers, with qwZ's int8 forward gather and hpZ's secondary
    chunks: after a full gather each rank keeps 1/g of the parameter, and in backward the
    parameter is gathered from those within the hpZ group of g ranks."""

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy)
        self.in_backward: bool = False  # hpZ gathers secondary chunks in backward; qwZ only forward

    def start_gather(self, p: Parameter) -> Any:
        """Start gathering p: the primary chunks over every rank (int8 codes in forward under
        qwZ), or in backward under hpZ the fresh secondary chunks over the hpZ group."""
        s = self.strategy
        gi, i = s.where[id(p)]
        g, secondary = s.groups[gi], self.secondary[gi]
        if self.in_backward and secondary is not None and secondary.fresh[i]:
            comm, chunk = secondary.comm, secondary.chunk(i)
        else:
            comm, chunk = s.comm, read_param_chunk(s, g, i)  # a file read under nvme
        buf = g.xp.empty(chunk.size * comm.size, dtype=s.dtype)
        self.gathered[id(p)] = buf
        if comm is s.comm and s.zero.zero_quantized_weights and not self.in_backward:
            pending = QuantizedGather(
                comm, buf, chunk, s.zero.overlap_comm, s.quantization_block_size
            )
            s.track_transient(pending.nbytes)
            return pending
        return s.start_or_run(comm.iall_gather, comm.all_gather, buf, chunk)

    def finish_gather(self, p: Parameter, handle: Any) -> None:
        """The paper's, after which a full gather's parameter gives hpZ its secondary chunk."""
        super().finish_gather(p, handle)
        if isinstance(handle, QuantizedGather):
            self.strategy.track_transient(-handle.nbytes)
        gi, i = self.strategy.where[id(p)]
        secondary = self.secondary[gi]
        if secondary is not None and not secondary.fresh[i]:  # a full gather: cut the chunk
            secondary.store(i, self.gathered[id(p)])

    def start_micro_step(self) -> None:
        self.in_backward = False
        super().start_micro_step()

    def start_backward(self, boundary: bool) -> None:
        self.in_backward = True

    def end_micro_step(self) -> None:
        super().end_micro_step()
        self.in_backward = False


class ZeroPPCoalescedFetcher(SecondaryChunks, CoalescedFetcher):
    """DeepSpeed's coalesced fetches (``ds_coordinator.py``) with ZeRO++'s gathers, as
    DeepSpeed 0.19.8 runs them (``partition_parameters.py``, ``_all_gather_coalesced``):

    * a parameter whose hpZ secondary chunk is fresh is gathered from it, within its hpZ group,
      forward or backward (DeepSpeed uses ``ds_secondary_tensor`` whenever it is set); the
      others from their primary chunks over every rank. A call mixing both is two gathers;
    * under qwZ every coalesced gather, primary or secondary, is quantized: the chunks end to
      end, quantized once, then two all-gathers, the int8 codes and the float32 scales;
    * the secondary chunks are cut from each full gather and are stale after the step.
    """

    deepspeed_cut = True  # N·c_i / g, DeepSpeed's ``_partition_param_sec``

    def _fresh(self, p: Parameter) -> bool:
        gi, i = self.strategy.where[id(p)]
        return self.secondary[gi] is not None and self.secondary[gi].fresh[i]

    def start_coalesced_gather(self, params: list[Parameter]) -> Any:
        """Start the gathers of ``params``: one call of the fresh secondary chunks (hpZ), one of
        the others' primary chunks; a ``CoalescedGathers`` of the one or two."""
        fresh = [p for p in params if self._fresh(p)]
        primary = [p for p in params if not self._fresh(p)]
        secondary = self._start_secondary(fresh) if fresh else None
        full = super().start_coalesced_gather(primary) if primary else None
        return CoalescedGathers(params, secondary, full)

    def _start_secondary(self, params: list[Parameter]) -> CoalescedGather:
        """One call of ``params``' fresh secondary chunks within the hpZ group."""
        where = self.strategy.where
        chunks = [self.secondary[gi].chunk(i) for gi, i in (where[id(p)] for p in params)]
        return self.gather_chunks(params, chunks, self.hpz_comm)

    def start_all_gather(self, comm: Any, buf: Any, send: Any) -> Any:
        """qwZ: the call quantized once and gathered as codes and scales; else DeepSpeed's."""
        s = self.strategy
        if not s.zero.zero_quantized_weights:
            return super().start_all_gather(comm, buf, send)
        handle = QuantizedGather(comm, buf, send, s.zero.overlap_comm, s.quantization_block_size)
        s.track_transient(handle.nbytes)
        return handle

    def finish_coalesced_gather(self, gathers: Any) -> None:
        """Wait for each part, give its parameters their values; the full gather's parameters
        give hpZ their secondary chunks."""
        for gather in gathers.parts():
            quantized = gather.handle if isinstance(gather.handle, QuantizedGather) else None
            super().finish_coalesced_gather(gather)  # a QuantizedGather's wait dequantizes
            if quantized is not None:
                self.strategy.track_transient(-quantized.nbytes)
        if gathers.full is None:
            return
        for p in gathers.full.params:
            gi, i = self.strategy.where[id(p)]
            secondary = self.secondary[gi]
            if secondary is not None and secondary.chunks[i] and not secondary.fresh[i]:
                secondary.store(i, flat(p.data))


class CoalescedGathers:
    """The one or two gathers of one coalesced fetch under ZeRO++ (hpZ's secondary, the
    primary), seen by the coordinator as one handle for all of ``params``."""

    def __init__(
        self,
        params: list[Parameter],
        secondary: CoalescedGather | None,
        full: CoalescedGather | None,
    ) -> None:
        self.params: list[Parameter] = params  # every parameter of the fetch
        # the gather of the fresh secondary chunks, within the hpZ group
        self.secondary: CoalescedGather | None = secondary
        self.full: CoalescedGather | None = full  # the others' primary chunks, over every rank

    def parts(self) -> list[CoalescedGather]:
        """The gathers made, the secondary first (the order they were started in)."""
        return [g for g in (self.secondary, self.full) if g is not None]


class Stage3ZeroPP(Stage3):
    """The paper's stage 3 with ZeRO++'s quantized and hierarchical collectives."""

    reducer_cls = QuantizedBuckets  # the paper's buckets; qgZ's all-to-all when it is on
    fetcher_cls = ZeroPPFetcher  # the paper's gathers; qwZ's and hpZ's when they are on

    def __init__(self, *, quantization_block_size: int = WEIGHT_BLOCK_SIZE, **kwargs: Any) -> None:
        """``quantization_block_size`` (``zerosim.quantization_block_size``): elements per
        scale, read by the fetcher (qwZ) and the reducer (qgZ) as they are built."""
        self.quantization_block_size: int = quantization_block_size
        super().__init__(**kwargs)


class Stage3ZeroPPDeepSpeed(DeepSpeedNormGroups, Stage3ZeroPP):
    """ZeRO++ under DeepSpeed's schedule: DeepSpeed's coalesced, prefetched gathers with qwZ and
    hpZ (``ZeroPPCoalescedFetcher``), its open gradient bucket reduced by qgZ
    (``QuantizedOpenBucket``), and the gradient norm all-reduced once per sub-group
    (``ds_schedule.py``), as DeepSpeed 0.19.8's stage 3 does."""

    boundary_rule = staticmethod(deepspeed_stage3_checks)

    reducer_cls = QuantizedOpenBucket  # DeepSpeed's open bucket; qgZ's all-to-all when on
    fetcher_cls = ZeroPPCoalescedFetcher  # DeepSpeed's coalesced gathers; qwZ's and hpZ's
