"""What every ZeRO strategy shares: flat buffers, the owned shard, and the optimizer over it.

A strategy is built once by the engine. It lays each parameter group into a flat buffer
(``FlatGroup``) and points every module parameter's ``.data`` at its view of that buffer. It then
hands the optimizer not the module parameters but ``Tile`` objects: tiles of the elements this
rank updates (``.data`` a view of the flat parameters, ``.grad`` a view of the reduced gradient),
at most ``sub_group_size`` elements each. The optimizer's update rules are element-wise, so
stepping tiles of a flat shard gives the same numbers as stepping whole parameters.

The engine drives a strategy through a few calls. Once, after construction: ``attach(model)``
(stages that act during forward or backward install their module hooks). Every micro-step:
``before_forward()``, the model's forward, ``before_backward(boundary)``, the model's backward,
``after_backward(boundary)``. At the accumulation boundary: ``overflow()`` and
``grad_norm_sq(inv_scale)`` (or ``grad_norm_sq_parts``, one per norm group) when the schedule's
checks ask for them (``schedule.py``; the engine all-reduces them), ``unscale_grads(inv_scale)``,
``clip(coef)``,
``optimizer.step()``, ``master_to_params()``, ``gather()``, ``zero_grad()``. Subclasses, the
paper's stages in ``stage0.py`` … ``stage3.py``, decide where gradients live (each declares its
per-group state in a ``FlatGroup`` subclass), where a reduced piece lands (``land``) and what is
gathered; how gradients are reduced is a part each is given, its *reducer* (``reducer_cls``,
``zerosim/zero/reducer.py``: the paper's fixed buckets in ``buckets.py``, DeepSpeed's IPG
buckets in ``ipg.py``, …), every reducer running the one reduce sequence
(``buckets.ReduceSequence``, ``self.reduction``). DeepSpeed's schedule and Megatron's layout are
the stages given other parts, and ``registry.py`` picks one for a config.

Beside the flat buffers: the optimizer's master copy under mixed precision or offload
(``zerosim/zero/precision.py``) and the layout-free segments checkpoints are made of
(``zerosim/zero/segments.py``).

Optimizers that need whole parameters get what a shard lacks here: LAMB's per-parameter norms
(``zerosim/zero/lamb.py``) and Muon's whole matrices (``zerosim/zero/muon.py``, whose updates are
made when the norm is first asked for: DeepSpeed takes the norm over them).

Offload (``zero.offload_optimizer`` / ``offload_param``, ``zerosim/zero/offload.py``): whenever
anything is offloaded the optimizer steps a separate master copy (of the model dtype in fp32/fp64
training), which lives in host memory or in swap files; ``master_to_params`` copies it back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zerosim.backend import item, nbytes, np_dtype, to_host, xp_of
from zerosim.comm import Communicator
from zerosim.nn import Parameter
from zerosim.zero.buckets import BufferPool, ReduceSequence
from zerosim.zero.lamb import LambNorms
from zerosim.zero.muon import MuonUpdates, muon_groups
from zerosim.zero.offload import Offload
from zerosim.zero.partition import Layout, Range, deepspeed_layout
from zerosim.zero.precision import MasterWeights
from zerosim.zero.reducer import GradReducer
from zerosim.zero.schedule import BoundaryChecks, BoundarySettings, paper_checks
from zerosim.zero.segments import Segment, flat_segments


@dataclass(eq=False)
class Tile:
    """A tile of the elements this rank updates, as the optimizer sees it."""

    data: Any
    grad: Any


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
        self.named_params = named_params
        self.layout = layout
        self.hyper = hyper
        first = named_params[0][1].data
        self.xp = xp_of(first)
        self.flat_param = self.xp.zeros(layout.padded_numel, dtype=dtype)
        by_index = {slot.index: slot for slot in layout.slots}
        self.slots = [by_index[i] for i in range(len(named_params))]
        for (_, p), slot in zip(named_params, self.slots, strict=True):
            view = self.flat_param[slot.range.start : slot.range.stop]
            view[...] = self.xp.reshape(p.data, (-1,))
            p.data = self.xp.reshape(view, p.shape)
        self.owned = layout.owned_ranges(rank)  # the flat ranges this rank owns
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


def sum_sq(v: Any) -> float:
    """Σ v² of a 1-D array as a Python float: BLAS's dot on NumPy, ``vecdot`` elsewhere."""
    if isinstance(v, np.ndarray):
        return float(np.vdot(v, v))
    return item(xp_of(v).vecdot(v, v))


def param_positions(groups: Sequence[Any]) -> dict[int, tuple[int, int]]:
    """id(parameter) -> (its group, its index in the group): where a hook's parameter lives."""
    return {
        id(p): (gi, i) for gi, g in enumerate(groups) for i, (_, p) in enumerate(g.named_params)
    }


def tiles(ranges: Sequence[Range], tile: int) -> list[Range]:
    """Cut ranges into pieces of at most ``tile`` elements (``sub_group_size``)."""
    out = []
    for r in ranges:
        for start in range(r.start, r.stop, tile):
            out.append(Range(start, min(start + tile, r.stop)))
    return out


def cut_tiles(strategy: Any) -> tuple[list[list[Tile]], list[list[Range]]]:
    """Cut each group's stepped ranges into ``sub_group_size`` tiles (``Tile``: a view of
    the flat parameters and of the reduced gradient, or of the master copy); per group, the
    tiles and their runs of the flat buffer."""
    all_tiles, all_ranges = [], []
    for gi, g in enumerate(strategy.groups):
        cut = tiles(strategy.step_ranges(g), strategy.zero.sub_group_size)
        if strategy.master_weights is None:  # the stepped parameters are their own master
            shards = [Tile(g.flat_param[t.start : t.stop], strategy.grad_view(g, t)) for t in cut]
        else:  # a master copy of the stepped ranges; its gradients made at step time
            shards = [Tile(view, None) for view in strategy.master_weights.allocate(gi, g, cut)]
        all_tiles.append(shards)
        all_ranges.append(cut)
    return all_tiles, all_ranges


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
            ranges = strategy.step_ranges(g)
            if len(ranges) == 1 and ranges[0].size == full.size:  # stage 0: all of it
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
    reported_norm = "after_scale_update"  # get_global_grad_norm()'s, see engine/reporting.py
    alignment = 1  # flat buffers pad to a multiple of this times N (the paper: N)
    round_robin = False  # parameters in definition order (DeepSpeed's may lay them round robin)
    group_cls: type = FlatGroup  # what a stage keeps per parameter group
    boundary_rule = staticmethod(paper_checks)  # schedule.py's table: DeepSpeed's classes own
    reducer_cls: type[GradReducer] = GradReducer  # the part that reduces gradients (reducer.py)

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
        self.comm = comm
        self.prescale, self.predivide = bool(prescale), float(predivide)
        # gradient_allreduce_op: True for 'mean' (the sum over ranks / N), False for 'sum'
        self.gradient_average = bool(gradient_average)
        # communication_data_type: gradients are cast to it for their reduction (None: reduced
        # in their buffer's own dtype, the model dtype or fp32 for Megatron's bf16 buffers)
        self.comm_dtype = None if comm_dtype is None else np.dtype(comm_dtype)
        self.zero = zero
        self.dtype = np.dtype(dtype)
        self.offload = Offload(zero, comm.rank)
        master = np.dtype(master_dtype) if master_dtype is not None else self.dtype
        separate = master != self.dtype or self.offload.active  # mixed precision or offload
        self.master_dtype = master if separate else None
        self.master_weights = MasterWeights(self, master) if separate else None
        self.layout_kind = layout
        self.groups = [self.make_group(named, hyper) for named, hyper in groups]
        self.where = param_positions(self.groups)  # id(param) -> (group, index)
        # Muon's matrices (zero/muon.py): before the gradients, whose reduction they change
        self.muon = MuonUpdates(self) if muon_groups(self) else None
        self.offload.params_to_files(self.groups)
        self.live_transient = 0
        self.peak_transient = 0
        xp = self.groups[0].xp if self.groups else np
        self.pool = BufferPool(xp, self.dtype)  # gradient bucket buffers (ZeRO-R's, buckets.py)
        self.reduction = ReduceSequence(self, self.pool)  # the reduce sequence, reductions pending
        self.setup_gradients()
        # per group, the optimizer's tiles (``Tile``) of this rank's stepped ranges and their runs
        # of the flat buffer (``cut_tiles``)
        self.shards: list[list[Tile]]
        self.tile_ranges: list[list[Range]]
        self.shards, self.tile_ranges = cut_tiles(self)
        self.optimizer = self.build_optimizer(optimizer_cls)
        self.offload.attach_optimizer(self)
        self.reducer: GradReducer = self.reducer_cls(self)  # how gradients are summed over ranks

    def build_optimizer(self, optimizer_cls: type) -> Any:
        """The optimizer over every group's tiles, with the group's hyperparameters."""
        param_groups = [
            {"params": shards, **g.hyper}
            for g, shards in zip(self.groups, self.shards, strict=True)
        ]
        optimizer = optimizer_cls(param_groups)
        if hasattr(optimizer, "piece_map"):  # LAMB: each parameter's norms (zero/lamb.py)
            optimizer.piece_map = LambNorms(self)
        if self.muon is not None and self.stage == 0:  # whole matrices: made in the step
            optimizer.before_step = self.muon.before_step
        return optimizer

    # -- what a stage decides ------------------------------------------------------------------
    def make_group(self, named: list[tuple[str, Parameter]], hyper: dict[str, Any]) -> Any:
        """Lay one parameter group out (stages 0-2: a FlatGroup of the whole group)."""
        return self.group_cls(named, self.make_layout(named), self.dtype, self.comm.rank, hyper)

    def make_layout(self, named: list[tuple[str, Parameter]]) -> Layout:
        shapes = [(n, p.shape) for n, p in named]
        return deepspeed_layout(shapes, self.comm.size, self.alignment, self.round_robin)

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

    def step_ranges(self, group: FlatGroup) -> list[Range]:
        """The flat-buffer ranges this rank's optimizer updates (its owned shard)."""
        return group.owned

    def before_forward(self) -> None:  # noqa: B027 (a no-op by default)
        """Called before the model's forward of every micro-step."""

    def before_backward(self, boundary: bool) -> None:  # noqa: B027  (optional hook)
        """Called before the model's backward of every micro-step."""

    def after_backward(self, boundary: bool) -> None:  # noqa: B027  (optional hook)
        """Called after it: reduce what must be reduced at this micro-step."""

    def gather(self) -> None:  # noqa: B027  (optional hook)
        """After the optimizer step: bring every rank's updated shard to every rank."""

    def step_skipped(self) -> None:
        """Called instead of the step and ``gather`` when an overflow skips the step: Muon's
        copied gradient slices go with the rest. Stages with more to drop extend it."""
        if self.muon is not None:
            self.muon.step_skipped()

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
        """The parameter element runs this rank holds in its optimizer shards
        (``zerosim/zero/segments.py``: ``which`` is "owned" or "stepped")."""
        return flat_segments(self, which)

    def grad_norm_sq(self, inv_scale: float = 1.0, whole: bool = False) -> float:
        """This rank's partial sum of squared (unscaled) gradients over its owned ranges (with
        ``whole``: over every range it steps, which at stage 0 is the whole reduced gradient).
        Muon's matrices hold their updates by then (stages 1-3, DeepSpeed's norm)."""
        if self.muon is not None:
            self.muon.make_updates()
        total = 0.0
        for gi, g in enumerate(self.groups):
            part = 0.0
            for rng in self.step_ranges(g) if whole else g.owned:
                v = self.grad_view(g, rng)
                if self.master_dtype is not None:
                    v = g.xp.astype(v, self.master_dtype)
                part += sum_sq(v)
            total += part * self.group_inv_scale(gi, inv_scale) ** 2
        return total

    def grad_norm_sq_parts(self, inv_scale: float = 1.0) -> list[float]:
        """This rank's partial Σg² (unscaled) per norm message: the paper's schedule sums every
        group in one. DeepSpeed's sends one per norm group (``ds_schedule.DeepSpeedNormGroups``)."""
        return [self.grad_norm_sq(inv_scale)]

    def group_inv_scale(self, group: int, inv_scale: float) -> float:
        """The factor that unscales ``group``'s gradients: 1 for Muon updates, which carry no
        loss scale (zero/muon.py, ``lacks_scale``)."""
        return 1.0 if self.muon is not None and self.muon.lacks_scale(group) else inv_scale

    def range_sum_sq(self, g: Any, rng: Range) -> float:
        """Σg² of the reduced gradient of flat range ``rng`` (in the master dtype, if any)."""
        v = self.grad_view(g, rng)
        return sum_sq(v if self.master_dtype is None else g.xp.astype(v, self.master_dtype))

    def overflow(self, whole: bool = False) -> float:
        """1.0 when this rank's owned reduced gradients (with ``whole``: all it steps) hold an
        inf or a nan, else 0.0."""
        from zerosim.zero.loss_scaler import overflow_flag

        ranges = [(g, r) for g in self.groups for r in (self.step_ranges(g) if whole else g.owned)]
        return overflow_flag([self.grad_view(g, r) for g, r in ranges])

    def unscale_grads(self, inv_scale: float) -> None:
        """Give the optimizer unscaled gradients (in the master dtype when there is a master)."""
        if self.muon is not None:  # Muon's updates, if no norm was taken (then: next step)
            self.muon.make_updates()
            self.muon.step_done()
        if self.master_weights is not None:
            self.master_weights.unscale(inv_scale)
            return
        for gi, shards in enumerate(self.shards):
            inv = self.group_inv_scale(gi, inv_scale)
            if inv != 1.0:
                for s in shards:
                    s.grad *= inv

    def master_to_params(self) -> None:
        """After the update: round the master (if any) into the model-dtype parameters."""
        if self.master_weights is not None:
            self.master_weights.to_params()

    def params_from_master(self) -> None:
        """Copy (round) the master into the stepped ranges of the parameters: also after a
        checkpoint load has written the master, before ``gather()``."""
        if self.master_weights is not None:
            self.master_weights.copy_to_params()

    def master_grad_shard(self, group: Any) -> Any:
        """A persistent gradient shard in the master dtype, if the stage keeps one (Megatron's
        fp16 recipe, ``stage1_megatron.py``); None: gradients are cast at step time."""
        return None

    def clip(self, coef: float) -> None:
        """Multiply every gradient this rank steps by ``coef``."""
        for shards in self.shards:
            for s in shards:
                s.grad *= coef

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
        master_grads = [self.master_grad_shard(g) for g in self.groups]
        if any(m is not None for m in master_grads):
            report["master_grads"] = sum(nbytes(m) for m in master_grads if m is not None)
        for group, shards in zip(self.optimizer.param_groups, self.shards, strict=True):
            for key in self.optimizer.state_keys(group):
                total = sum(
                    nbytes(self.optimizer.state[s][key])
                    for s in shards
                    if s in self.optimizer.state and key in self.optimizer.state[s]
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
        return sum(r.size for g in self.groups for r in self.step_ranges(g))
