"""What every ZeRO strategy shares: flat buffers, the owned shard, and the parts a stage is given.

A strategy is built once by the engine. It lays each parameter group into a flat buffer
(``FlatGroup``) and points every module parameter's ``.data`` at its view of that buffer. The
optimizer step over the elements this rank updates is a part of its own beside the stages,
``ShardedStep`` (``zerosim/zero/sharded_step.py``: tiles of the shard, the gradient norm,
clipping, unscaling, master weights); the strategy builds it once its gradient storage exists and
keeps the optimizer it makes (``optimizer``).

The engine drives a strategy through a few calls. Once, after construction: ``attach(model)``
(stages that act during forward or backward install their module hooks). Every micro-step:
``before_forward()``, the model's forward, ``before_backward(boundary)``, the model's backward,
``after_backward(boundary)``. At the accumulation boundary the engine asks ``sharded_step`` for the
overflow flag, the norm, unscaling and clipping (``schedule.py`` says which checks), then
``optimizer.step()``, ``sharded_step.master_to_params()``, ``gather()``, ``zero_grad()``.
Subclasses, the paper's stages in ``stage0.py`` … ``stage3.py``, decide where gradients live
(each declares its per-group state in a ``FlatGroup`` subclass), where a reduced piece lands
(``land``) and what is gathered; how gradients are reduced is a part each is given, its
*reducer* (``reducer_cls``, ``zerosim/zero/reducer.py``: the paper's fixed buckets in
``buckets.py``, DeepSpeed's IPG buckets in ``ipg.py``, …), every reducer running the one reduce
sequence (``buckets.ReduceSequence``, ``self.reduction``); where parameters sit in the flat
buffers is another, its *layout* (``layout_cls``, ``zerosim/zero/layouts.py``: the paper's,
DeepSpeed's padding and round robin, Megatron's buckets). DeepSpeed's schedule and Megatron's
layout are the stages given other parts, and ``registry.py`` picks one for a config. A stage
tells the sharded step about itself by class attributes (``partitions_optimizer_states``,
``partitions_params``, ``norm_per_group``), never by its number.

Beside the flat buffers: the layout-free segments checkpoints are made of
(``zerosim/zero/segments.py``) and Muon's matrices (``zerosim/zero/muon.py``), which change both
how gradients are reduced (a split matrix's slices go to all its owners) and the step.

Offload (``zero.offload_optimizer`` / ``offload_param``, ``zerosim/zero/offload.py``): whenever
anything is offloaded the optimizer steps a separate master copy (of the model dtype in fp32/fp64
training), which lives in host memory or in swap files; ``sharded_step.master_to_params`` copies
it back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from zerosim.backend import nbytes, np_dtype, to_host, xp_of
from zerosim.comm import Communicator
from zerosim.nn import Parameter
from zerosim.zero.buckets import BufferPool, ReduceSequence
from zerosim.zero.layouts import FlatLayout
from zerosim.zero.muon import MuonUpdates, muon_groups
from zerosim.zero.offload import Offload
from zerosim.zero.partition import Layout, ParamSlot, Range
from zerosim.zero.reducer import GradReducer
from zerosim.zero.schedule import BoundaryChecks, BoundarySettings, paper_checks
from zerosim.zero.segments import Segment, flat_segments
from zerosim.zero.sharded_step import ShardedStep


class FlatGroup:
    """One parameter group laid end to end in a flat buffer; module params become views of it.

    The fields every flat-buffer stage has; a stage's subclass (``FullGradGroup``, ``Stage2Group``)
    adds its gradient storage.
    """

    def __init__(
        self,
        named_params: list[tuple[str, Parameter]],
        layout: Layout,
        dtype: Any,
        rank: int,
        hyper: dict[str, Any],
    ) -> None:
        # the group's parameters, by name
        self.named_params: list[tuple[str, Parameter]] = named_params
        self.layout: Layout = layout  # where each parameter sits, who owns what (partition.py)
        self.hyper: dict[str, Any] = hyper  # the group's hyperparameters (lr, …)
        first = named_params[0][1].data
        self.xp: Any = xp_of(first)  # the array module of its arrays
        # the parameters end to end, padded
        self.flat_param: Any = self.xp.zeros(layout.padded_numel, dtype=dtype)
        by_index = {slot.index: slot for slot in layout.slots}
        # by parameter index, where it sits
        self.slots: list[ParamSlot] = [by_index[i] for i in range(len(named_params))]
        for (_, p), slot in zip(named_params, self.slots, strict=True):
            view = self.flat_param[slot.range.start : slot.range.stop]
            view[...] = self.xp.reshape(p.data, (-1,))
            p.data = self.xp.reshape(view, p.shape)
        self.owned: list[Range] = layout.owned_ranges(rank)  # the flat ranges this rank owns
        self.master: Any = None  # the optimizer's master copy of them (zerosim/zero/precision.py)

    def param_view(self, index: int, flat: Any) -> Any:
        """Parameter ``index``'s piece of a flat buffer laid out like the parameters."""
        slot = self.slots[index]
        return xp_of(flat).reshape(flat[slot.range.start : slot.range.stop], slot.shape)


class FullGradGroup(FlatGroup):
    """A parameter group whose rank keeps full gradients (stages 0 and 1): its flat parameters
    and a gradient buffer laid out like them."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.flat_grad: Any = None  # setup_gradients: gradients laid out like flat_param


def param_positions(groups: Sequence[Any]) -> dict[int, tuple[int, int]]:
    """id(parameter) -> (its group, its index in the group): where a hook's parameter lives."""
    return {
        id(p): (gi, i) for gi, g in enumerate(groups) for i, (_, p) in enumerate(g.named_params)
    }


def flat_full_state(strategy: Any) -> dict[str, np.ndarray]:
    """{name: host copy of the full parameter}, from the fp32 master under mixed precision.

    Every rank holds the full model-dtype parameters here; the master exists only for the
    stepped ranges, so under mixed precision it is all-gathered (one per partition unit).
    """
    out = {}
    for g in strategy.groups:
        full = g.flat_param
        if strategy.master_dtype is not None:
            full = xp_of(g.master).zeros(g.layout.padded_numel, dtype=strategy.master_dtype)
            ranges = strategy.sharded_step.step_ranges(g)
            if len(ranges) == 1 and ranges[0].size == full.size:  # every rank steps all of it
                full[...] = g.master
            else:
                at = 0
                for unit, own in zip(g.layout.units, g.owned, strict=True):
                    strategy.comm.all_gather(
                        full[unit.start : unit.stop], g.master[at : at + own.size]
                    )
                    at += own.size
        for i, (name, _) in enumerate(g.named_params):
            out[name] = to_host(g.param_view(i, full)).copy()
    return out


class Strategy(ABC):
    """Base class of the ZeRO stages; see the module docstring for the call sequence."""

    stage = -1
    partitions_optimizer_states = False  # stages 1-3: each rank keeps the states of its shard
    partitions_params = False  # stage 3: each rank holds a chunk of every parameter (swaps .data)
    adopts_zero_init = False  # takes over the chunks of a model built inside zero.Init
    norm_per_group = False  # one norm message (the paper's); DeepSpeed's: one per norm group
    reported_norm = "after_scale_update"  # get_global_grad_norm()'s, see engine/reporting.py
    group_cls: type = FlatGroup  # what a stage keeps per parameter group
    layout_cls: type[FlatLayout] = FlatLayout  # the part that lays out flat buffers (layouts.py)
    boundary_rule = staticmethod(paper_checks)  # schedule.py's table: DeepSpeed's classes own
    reducer_cls: type[GradReducer] = GradReducer  # the part that reduces gradients (reducer.py)
    fetcher_cls: type | None = None  # stage 3's part that gathers parameters (fetcher.py)

    @classmethod
    def boundary_checks(cls, **settings: Any) -> BoundaryChecks:
        return cls.boundary_rule(BoundarySettings(**settings))  # the boundary's flag and norm

    def __init__(
        self,
        *,
        groups: list[tuple[list[tuple[str, Parameter]], dict[str, Any]]],
        comm: Communicator,
        zero: Any,
        dtype: Any,
        optimizer_cls: type,
        layout: str = "deepspeed",
        master_dtype: Any = None,
        comm_dtype: Any = None,
        prescale: bool = False,
        predivide: float = 1.0,
        gradient_average: bool = True,
    ) -> None:
        self.comm: Communicator = comm  # the data-parallel ranks
        self.prescale: bool = bool(prescale)  # prescale_gradients: divide by N before reducing
        self.predivide: float = float(predivide)  # gradient_predivide_factor
        # gradient_allreduce_op: True for 'mean' (the sum over ranks / N), False for 'sum'
        self.gradient_average: bool = bool(gradient_average)
        # communication_data_type: gradients are cast to it for their reduction (None: reduced
        # in their buffer's own dtype, the model dtype or fp32 for Megatron's bf16 buffers)
        self.comm_dtype: np.dtype | None = None if comm_dtype is None else np.dtype(comm_dtype)
        self.zero: Any = zero  # the zero_optimization settings
        self.dtype: np.dtype = np.dtype(dtype)  # the model dtype: parameters and gradients
        self.offload: Offload = Offload(zero, comm.rank)  # what is offloaded, and its stores
        master = np.dtype(master_dtype) if master_dtype is not None else self.dtype
        separate = master != self.dtype or self.offload.active  # mixed precision or offload
        # the dtype the optimizer steps a separate master copy in (sharded_step.py), or None
        self.master_dtype: np.dtype | None = master if separate else None
        self.layout_kind: str = layout  # the config's layout name (checkpoints and reports)
        self.layout: FlatLayout = self.layout_cls(self)  # how the flat buffers are laid out
        # the parameter groups, laid out (group_cls or ShardGroup)
        self.groups: list[Any] = [self.make_group(named, hyper) for named, hyper in groups]
        # id(param) -> (group, index)
        self.where: dict[int, tuple[int, int]] = param_positions(self.groups)
        # Muon's matrices (zero/muon.py), or None: they change the reduction and the step
        self.muon: MuonUpdates | None = MuonUpdates(self) if muon_groups(self) else None
        self.offload.params_to_files(self.groups)
        self.live_transient: int = 0  # bytes of temporary buffers alive now
        self.peak_transient: int = 0  # their high-water mark
        xp = self.groups[0].xp if self.groups else np
        # gradient bucket buffers (ZeRO-R's, buckets.py)
        self.pool: BufferPool = BufferPool(xp, self.dtype)
        # the reduce sequence, reductions pending
        self.reduction: ReduceSequence = ReduceSequence(self, self.pool)
        self.setup_gradients()
        # the sharded optimizer step: this rank's stepped ranges cut into tiles (sharded_step.py)
        self.sharded_step: ShardedStep = ShardedStep(self, self.muon)
        self.optimizer: Any = self.sharded_step.make_optimizer(optimizer_cls)  # over its tiles
        self.offload.attach_optimizer(self)
        self.reducer: GradReducer = self.reducer_cls(self)  # how gradients are summed over ranks

    # -- what a stage decides ------------------------------------------------------------------
    def make_group(self, named: list[tuple[str, Parameter]], hyper: dict[str, Any]) -> Any:
        """Lay one parameter group out (stages 0-2: a FlatGroup of the whole group, laid out
        as the layout part says)."""
        return self.group_cls(named, self.layout.lay_out(named), self.dtype, self.comm.rank, hyper)

    def attach(self, model: Any) -> None:
        """Once, after construction: install module hooks (the reducer's, for reducers that act
        during backward)."""
        self.reducer.attach(model)

    @abstractmethod
    def setup_gradients(self) -> None:
        """Allocate gradient storage and point parameters' ``.grad`` where backward writes."""

    @abstractmethod
    def grad_view(self, group: FlatGroup, rng: Range) -> Any:
        """The reduced, averaged gradient of flat-buffer range ``rng`` (an owned range)."""

    @abstractmethod
    def land(self, group: int, start: int, values: Any) -> None:
        """Where a reduced piece lands: ``values``, the sum over ranks of elements ``start`` …
        of group ``group``'s gradients (flat-buffer positions; shard positions at stage 3),
        which this rank keeps. Each stage says: added into its gradient shard (stages 2-3),
        written into its gradient buffer (stages 0-1)."""

    def before_forward(self) -> None:  # noqa: B027 (a no-op by default)
        """Called before the model's forward of every micro-step."""

    def before_backward(self, boundary: bool) -> None:  # noqa: B027  (optional hook)
        """Called before the model's backward of every micro-step."""

    def after_backward(self, boundary: bool) -> None:  # noqa: B027  (optional hook)
        """Called after it: reduce what must be reduced at this micro-step."""

    def gather(self) -> None:  # noqa: B027  (optional hook)
        """After the optimizer step: bring every rank's updated shard to every rank."""

    def step_skipped(self) -> None:
        """Called instead of the step and ``gather`` when an overflow skips the step: the
        sharded step drops what it made for it. Stages with more to drop extend it."""
        self.sharded_step.step_skipped()

    @abstractmethod
    def zero_grad(self) -> None:
        """Clear the gradients for the next accumulation window."""

    @abstractmethod
    def grad_bytes(self) -> int:
        """Bytes of gradient storage this rank keeps between micro-steps."""

    # -- shared ---------------------------------------------------------------------------------
    def bucket_pieces(self) -> list[list[int]]:
        """Each reduction bucket's piece per rank, where buckets are cut unevenly over the ranks
        (the paper's stage 2); the dry run runs ranks with equal pieces once."""
        return self.reducer.bucket_pieces()

    def segments(self, which: str = "owned") -> list[Segment]:
        """The parameter element runs this rank holds in its optimizer's tiles
        (``zerosim/zero/segments.py``: ``which`` is "owned" or "stepped")."""
        return flat_segments(self, which)

    def gathered_dtype(self) -> np.dtype:
        """The dtype a gathered parameter's data has: the model dtype (stage 3: its fetcher's
        ``gather_dtype``, FSDP2's param_dtype, which its all-gather casts to)."""
        return self.dtype

    def before_reduction(self, grads: Any) -> None:
        """Scale gradients about to be summed over ranks, as DeepSpeed does: with
        ``prescale_gradients`` divide by N; with ``gradient_predivide_factor`` f multiply by 1/f
        (then ``average`` multiplies by f/N); by default leave them (``average`` divides by N).
        With ``gradient_allreduce_op: "sum"`` neither scales: DeepSpeed's stages 0-2 then sum
        unscaled, prescale and predivide factor unread."""
        if not self.gradient_average:
            return
        if self.prescale:
            grads /= self.comm.size
        elif self.predivide != 1.0:
            grads *= 1.0 / self.predivide

    def average(self, grads: Any) -> None:
        """Turn the sum over ranks into the mean (what ``before_reduction`` left to do)."""
        if self.prescale or not self.gradient_average:
            return
        if self.predivide == 1.0:
            grads /= self.comm.size
        elif self.predivide != self.comm.size:
            grads *= self.predivide / self.comm.size

    def wire_dtype(self, grads: Any) -> np.dtype:
        """The dtype gradients of this dtype are reduced in (communication_data_type)."""
        return np_dtype(grads) if self.comm_dtype is None else self.comm_dtype

    def start_or_run(self, start: Callable[..., Any], run: Callable[..., None], *args: Any) -> Any:
        """Overlap or block: with ``overlap_comm`` start the collective (``start``, non-blocking)
        and return its handle; without, run it to completion (``run``) and return None."""
        if self.zero.overlap_comm:
            return start(*args)
        run(*args)
        return None

    def track_transient(self, nbytes: int) -> None:
        """Count bytes of a temporary buffer allocated (+) or freed (−)."""
        self.live_transient += nbytes
        self.peak_transient = max(self.peak_transient, self.live_transient)

    def full_state_dict(self) -> dict[str, np.ndarray]:
        """{name: host copy of the full parameter}, from the fp32 master under mixed precision
        (``flat_full_state``)."""
        return flat_full_state(self)

    def iter_params(self) -> Iterator[tuple[str, np.ndarray]]:
        """(name, host copy of the full parameter in the model dtype), one at a time. Every
        rank holds the full parameters here (stage 3 gathers each one: a collective)."""
        for g in self.groups:
            for i, (name, _) in enumerate(g.named_params):
                yield name, to_host(g.param_view(i, g.flat_param))

    def memory_report(self) -> dict[str, int]:
        """Bytes of the arrays this rank holds, by category; no two categories count the same
        array, so the values add up to what the strategy holds. ``peak_*`` entries are the
        high-water marks of memory held only for a while (bucket buffers in use are inside
        ``bucket_buffers``, not in ``peak_transient``). Where it lives: ``placement``.
        """
        report = {
            "params": sum(nbytes(g.flat_param) for g in self.groups),
            "grads": self.grad_bytes(),
            "master_params": sum(nbytes(g.master) for g in self.groups if g.master is not None),
        }
        if self.layout.master_grads:  # Megatron's fp16 recipe keeps an fp32 gradient shard
            report["master_grads"] = sum(nbytes(m) for m in self.layout.master_grads)
        tiles_of_groups = self.sharded_step.tiles
        for group, tiles in zip(self.optimizer.param_groups, tiles_of_groups, strict=True):
            for key in self.optimizer.state_keys(group):
                total = sum(
                    nbytes(self.optimizer.state[t][key])
                    for t in tiles
                    if t in self.optimizer.state and key in self.optimizer.state[t]
                )
                name = f"optimizer_state.{key}"
                report[name] = report.get(name, 0) + total
        if self.muon is not None:  # whole matrices' momentum (stages 0-2), copied gradients
            for key, value in self.muon.memory().items():
                report[key] = report.get(key, 0) + value
        report["peak_transient"] = self.peak_transient
        report["bucket_buffers"] = self.pool.nbytes
        report["swap_buffers"] = self.offload.swap_nbytes()
        return report

    def placement(self) -> dict[str, int]:
        """{device_bytes, host_bytes, nvme_bytes}: the model states (params, grads, master
        params and grads, optimizer states) and the nvme swap buffers, by where they live
        (docs/offload.md)."""
        return self.offload.split(self, self.memory_report())

    def close(self) -> None:
        """Remove this rank's nvme swap files now (also done at exit); see docs/offload.md."""
        self.offload.close()

    @property
    def padded_numel(self) -> int:
        return sum(g.layout.padded_numel for g in self.groups)

    @property
    def shard_numel(self) -> int:
        return sum(r.size for g in self.groups for r in self.sharded_step.step_ranges(g))
