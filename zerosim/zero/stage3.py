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

The gathers are the stage's fetcher (``GatherEach`` below, ``fetcher.py``), the buckets its
reducer (``buckets.RankMajorReduceScatter``); each reduced row lands through ``Stage3.land``.
Beside this file, the same stage given other parts: DeepSpeed 0.19.8's schedule
(``stage3_deepspeed.py``: coalesced fetches, prefetch by trace, buckets in hook order) and ZeRO++
(``stage3_zeropp.py``: quantized and hierarchical gathers, quantized gradient reduction).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from zerosim.backend import flat, nbytes, to_host, xp_of
from zerosim.nn import Parameter
from zerosim.zero.buckets import RankMajorReduceScatter
from zerosim.zero.coordinator import ParamCoordinator
from zerosim.zero.fetcher import ParamFetcher
from zerosim.zero.init import ParamChunk
from zerosim.zero.offload import read_param_chunk
from zerosim.zero.partition import ParamPartition, Range
from zerosim.zero.segments import Segment
from zerosim.zero.sharded_step import sum_sq
from zerosim.zero.strategy import Strategy


class ShardGroup:
    """One parameter group under stage 3: this rank's chunks of every parameter, end to end.

    Every field is declared here; ``Stage3.setup_gradients`` fills ``grad_shard``.
    """

    def __init__(self, named: list[tuple[str, Parameter]], strategy: Stage3, hyper: dict) -> None:
        comm = strategy.comm
        self.named_params: list[tuple[str, Parameter]] = named  # the group's parameters, by name
        self.hyper: dict = hyper  # the group's hyperparameters (lr, …)
        part = strategy.make_partition([(n, p.shape) for n, p in named])
        self.partition: ParamPartition = part  # each parameter's chunks and their offsets
        self.xp: Any = xp_of(named[0][1].data)  # the array module of its arrays
        # this rank's chunks of every parameter, end to end
        self.flat_param: Any = self.xp.zeros(part.shard_numel, dtype=strategy.dtype)
        # the whole shard: every chunk here is this rank's
        self.owned: list[Range] = [Range(0, part.shard_numel)]
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


class GatherEach(ParamFetcher):
    """The paper's fetcher: each parameter gathered in a call of its own, every rank's chunk
    straight into one buffer of N · chunk elements, and freed after use; ``ParamCoordinator``
    (``coordinator.py``) decides when, with prefetch and reuse once the module order is known."""

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy)
        s = strategy
        self.released: Any = s.groups[0].xp.empty(0, dtype=s.dtype)  # a released param's data
        self.gathered: dict[int, Any] = {}  # id(param) -> its gathered buffer

    def attach(self, model: Any) -> None:
        self.coordinator = ParamCoordinator(self, model, self.strategy.zero)

    def start_gather(self, p: Parameter) -> Any:
        """Start gathering p: every rank's chunk of it, into a buffer of N · chunk elements."""
        s = self.strategy
        gi, i = s.where[id(p)]
        g = s.groups[gi]
        chunk = read_param_chunk(s, g, i)  # a file read under offload_param: nvme
        buf = g.xp.empty(chunk.size * s.comm.size, dtype=s.dtype)
        self.gathered[id(p)] = buf
        return s.start_or_run(s.comm.iall_gather, s.comm.all_gather, buf, chunk)

    def finish_gather(self, p: Parameter, handle: Any) -> None:
        """Wait for p's gather; p's data becomes a view of the gathered buffer."""
        if handle is not None:
            handle.wait()
        full = self.gathered[id(p)]
        p.data = xp_of(full).reshape(full[: p.numel], p.shape)

    def free(self, p: Parameter) -> None:
        self.gathered.pop(id(p), None)
        p.data = self.released  # no view of the gathered buffer survives, so it is freed


class Stage3(Strategy):
    """Partitioned parameters gathered around each module; bucketed gradient reduce-scatter."""

    stage = 3
    partitions_optimizer_states = True
    partitions_params = True
    adopts_zero_init = True  # zero.Init cuts parameters as this stage does (ceil(numel / N))
    reducer_cls = RankMajorReduceScatter  # the paper's fixed buckets, rank-major
    fetcher_cls: type[ParamFetcher] = GatherEach  # the paper's per-parameter gathers

    def is_persistent(self, p: Parameter) -> bool:
        """Whether p stays whole on every rank: at most ``stage3_param_persistence_threshold``
        elements, where the fetcher keeps such parameters (FSDP2's does not)."""
        threshold = self.zero.stage3_param_persistence_threshold
        return self.fetcher_cls.keeps_persistent and p.numel <= threshold

    def make_partition(self, named_shapes: list[tuple[str, tuple[int, ...]]]) -> ParamPartition:
        """How each parameter is cut into chunks: as the fetcher gathers them (the paper's and
        DeepSpeed's: ceil(numel_i / N) elements; FSDP2's: ceil(dim0_i / N) rows)."""
        return self.fetcher_cls.partition_rule(named_shapes, self.comm.size)

    def make_group(self, named: list[tuple[str, Parameter]], hyper: dict[str, Any]) -> ShardGroup:
        return ShardGroup(named, self, hyper)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # gathers and releases parameters around modules (its hooks: attach())
        self.fetcher: ParamFetcher = self.fetcher_cls(self)

    def setup_gradients(self) -> None:
        """Every group's gradient shard (this rank's chunks of every parameter's gradient)."""
        for g in self.groups:
            g.grad_shard = g.xp.zeros(g.partition.shard_numel, dtype=self.dtype)

    def attach(self, model: Any) -> None:
        """The fetcher's hooks (gather before a module runs, release after), then the
        reducer's (a gradient is final)."""
        self.fetcher.attach(model)
        self.reducer.attach(model)

    def land(self, group: int, start: int, values: Any) -> None:
        """This rank's reduced chunks (``values``, from shard position ``start``) are added
        into its gradient shard (they accumulate across micro-steps)."""
        self.groups[group].grad_shard[start : start + values.size] += values

    # -- the engine's calls ----------------------------------------------------------------------
    def before_forward(self) -> None:
        self.fetcher.start_micro_step()

    def before_backward(self, boundary: bool) -> None:
        self.fetcher.start_backward(boundary)
        self.reducer.before_backward(boundary)

    def after_backward(self, boundary: bool) -> None:
        """The reducer has summed every gradient into the gradient shard; every gathered
        parameter is released; at the boundary the sums over ranks become means (unless the
        reducer landed them as means already)."""
        self.reducer.after_backward(boundary)
        self.fetcher.end_micro_step()
        if boundary and not self.reducer.lands_averaged:
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
        self.fetcher.after_step()

    def step_skipped(self) -> None:
        super().step_skipped()
        self.fetcher.step_skipped()

    def zero_grad(self) -> None:
        for g in self.groups:
            g.grad_shard[...] = 0

    def grad_bytes(self) -> int:
        return sum(nbytes(g.grad_shard) for g in self.groups)

    # -- views for the engine, checkpoints and reports --------------------------------------------
    def gathered_dtype(self) -> np.dtype:
        return self.fetcher.gather_dtype

    def segments(self, which: str = "owned") -> list[Segment]:
        """Each chunk's runs in this rank's tiles. Where shards are replicated (HSDP) every
        replica steps its own copy and the first owns them (what a checkpoint saves)."""
        if which not in ("owned", "stepped"):
            raise ValueError(f"which must be 'owned' or 'stepped', got {which!r}")
        if which == "owned" and self.reducer.replica():
            return []
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

    def param_grad_norms_sq(self, inv_scale: float = 1.0) -> list[float]:
        """This rank's Σg² of each parameter's chunk, in the model's order (padding is 0): the
        partial ‖g‖² per parameter that torch's ``clip_grad_norm_`` sums over ranks (FSDP2)."""
        out = []
        for g in self.groups:
            part = g.partition
            for i in range(len(part.names)):
                start = part.offsets[i]
                out.append(sum_sq(g.grad_shard[start : start + part.chunks[i]]) * inv_scale**2)
        return out

    def local_shards(self) -> dict[str, Any]:
        """{name: this rank's chunk of the parameter}, unpadded (empty past the last element);
        cut into rows when the chunks are whole rows, as under FSDP2's dim-0 partition, where it
        is torch's ``DTensor.to_local()``."""
        out = {}
        for g in self.groups:
            part = g.partition
            for i, name in enumerate(part.names):
                shape, valid = part.shapes[i], part.valid(i, self.comm.rank)
                chunk = g.chunk(i)[:valid]
                row = part.numels[i] // shape[0] if shape and shape[0] else 1  # elements a row
                if row and part.chunks[i] % row == 0:
                    out[name] = g.xp.reshape(chunk, (valid // row, *shape[1:]))
                else:
                    out[name] = chunk
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
        report.update(self.fetcher.memory())
        report.update(self.reducer.memory())
        return report

    @property
    def padded_numel(self) -> int:
        return sum(g.partition.padded_numel for g in self.groups)

    def persistent_padded_numel(self) -> int:
        """Ψ_persist: padded elements of the persistent parameters."""
        return sum(b.size for g in self.groups for b in g.persistent_buffers.values())
