"""What every ZeRO strategy shares: flat buffers, the owned shard, and the optimizer over it.

A strategy is built once by the engine. It lays each parameter group into a flat buffer
(``FlatGroup``) and points every module parameter's ``.data`` at its view of that buffer. It then
hands the optimizer not the module parameters but ``Shard`` objects: tiles of the elements this
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
``optimizer.step()``, ``master_to_params()``, ``gather()``, ``zero_grad()``. Subclasses (one per
stage, in this package) decide where gradients live, how they are reduced and what is gathered;
the bucket machinery that stages 0, 2 and 3 share is ``zerosim/zero/buckets.py``, DeepSpeed's
gradient buckets of stages 1-2 are ``zerosim/zero/ipg.py``. ``schedule`` ("deepspeed" or "paper",
``zerosim/zero/schedule.py``) says whose collectives a stage issues.

Optimizers that need whole parameters get what a shard lacks here: LAMB's per-parameter norms
(``zerosim/zero/lamb.py``) and Muon's whole matrices (``zerosim/zero/muon.py``, whose updates are
made when the norm is first asked for: DeepSpeed takes the norm over them).

Offload (``zero.offload_optimizer`` / ``offload_param``, ``zerosim/zero/offload.py``): whenever
anything is offloaded the optimizer steps a separate master copy (of the model dtype in fp32/fp64
training), which lives in host memory or in swap files; ``master_to_params`` copies it back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zerosim.backend import item, move_like, nbytes, np_dtype, to_host, xp_of
from zerosim.comm import Communicator
from zerosim.nn import Parameter
from zerosim.zero.buckets import BufferPool, PendingReductions
from zerosim.zero.lamb import LambNorms
from zerosim.zero.muon import MuonUpdates, muon_groups
from zerosim.zero.offload import Offload
from zerosim.zero.partition import (
    DEEPSPEED_ALIGNMENT,
    Layout,
    Range,
    deepspeed_layout,
    deepspeed_sub_groups,
)
from zerosim.zero.schedule import SCHEDULES


@dataclass(frozen=True)
class Segment:
    """A run of one parameter's elements held in one optimizer shard.

    ``param_range`` counts elements of the flattened parameter (``name``); they sit at
    ``offset`` … ``offset + size`` of ``strategy.shards[group][shard]`` (its ``.data`` and every
    optimizer state array). Segments are the layout-free view that checkpoints use: a checkpoint
    written by any stage and world size is a set of (name, range) → arrays.
    """

    name: str
    param_range: Range
    group: int
    shard: int
    offset: int

    @property
    def size(self) -> int:
        return self.param_range.size


@dataclass(eq=False)
class Shard:
    """A tile of the elements this rank updates, as the optimizer sees it."""

    data: Any
    grad: Any


class FlatGroup:
    """One parameter group laid end to end in a flat buffer; module params become views of it.

    Every field a stage may fill is declared here (None or empty where a stage has no such thing).
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
        self.flat_grad: Any = None  # stages 0-1: gradients laid out like flat_param
        self.grad_shard: Any = None  # stage 2: the reduced gradient of the owned shard
        self.master: Any = None  # fp32 master of the stepped ranges (mixed precision, offload)
        self.master_grads: Any = None  # Megatron's fp16 recipe: a persistent fp32 gradient shard
        self.buckets: list[Range] = []  # stage 2: the reduction buckets of the flat buffer
        self.bucket_counts: list[list[int]] = []  # stage 2: per bucket, each rank's piece of it
        self.bucket_of: list[int] = []  # stage 2: parameter index -> its bucket
        self.bucket_params: list[list[int]] = []  # stage 2: bucket -> its parameter indices
        self.buffers: dict[int, Any] = {}  # stage 2: bucket -> its buffer while being filled

    def param_view(self, index: int, flat: Any) -> Any:
        """Parameter ``index``'s piece of a flat buffer laid out like the parameters."""
        slot = self.slots[index]
        return xp_of(flat).reshape(flat[slot.range.start : slot.range.stop], slot.shape)


def sum_sq(v: Any) -> float:
    """Σ v² of a 1-D array as a Python float: BLAS's dot on NumPy, ``vecdot`` elsewhere."""
    if isinstance(v, np.ndarray):
        return float(np.vdot(v, v))
    return item(xp_of(v).vecdot(v, v))


def tiles(ranges: Sequence[Range], tile: int) -> list[Range]:
    """Cut ranges into pieces of at most ``tile`` elements (``sub_group_size``)."""
    out = []
    for r in ranges:
        for start in range(r.start, r.stop, tile):
            out.append(Range(start, min(start + tile, r.stop)))
    return out


class Strategy(ABC):
    """Base class of the ZeRO stages; see the module docstring for the call sequence."""

    stage = -1

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
        schedule: str = "deepspeed",
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        self.schedule = schedule  # whose collectives: DeepSpeed's or the paper's (schedule.py)
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
        self.layout_kind = layout
        self.groups = [self.make_group(named, hyper) for named, hyper in groups]
        # Muon's matrices (zero/muon.py): before the gradients, whose reduction they change
        self.muon = MuonUpdates(self) if muon_groups(self) else None
        self.offload.params_to_files(self.groups)
        self.live_transient = 0
        self._transient_grads: list[Any] = []  # unscale_grads's fp32 copies, until the step ends
        self.peak_transient = 0
        xp = self.groups[0].xp if self.groups else np
        self.pool = BufferPool(xp, self.dtype)  # gradient bucket buffers (stages 0, 2 and 3)
        self.pending = PendingReductions(self.give_buffer)  # launched bucket reductions
        self.setup_gradients()
        param_groups = []
        self.shards: list[list[Shard]] = []
        self.tile_ranges: list[list[Range]] = []
        for gi, g in enumerate(self.groups):
            cut = tiles(self.step_ranges(g), zero.sub_group_size)
            if self.master_dtype is None:  # the stepped parameters are their own master
                shards = [Shard(g.flat_param[t.start : t.stop], self.grad_view(g, t)) for t in cut]
            else:  # an fp32 master copy of the stepped ranges; fp32 gradients made at step time
                numel = sum(t.size for t in cut)
                g.master = self.offload.new_master(gi, numel, self.master_dtype, g.xp)
                shards, at = [], 0
                for t in cut:
                    g.master[at : at + t.size] = move_like(g.flat_param[t.start : t.stop], g.master)
                    shards.append(Shard(g.master[at : at + t.size], None))
                    at += t.size
            self.shards.append(shards)
            self.tile_ranges.append(cut)
            param_groups.append({"params": shards, **g.hyper})
        self.optimizer = optimizer_cls(param_groups)
        if hasattr(self.optimizer, "piece_map"):  # LAMB: each parameter's norms (zero/lamb.py)
            self.optimizer.piece_map = LambNorms(self)
        if self.muon is not None and self.stage == 0:  # whole matrices: made in the step
            self.optimizer.before_step = self.muon.before_step
        self.offload.attach_optimizer(self)

    # -- what a stage decides ------------------------------------------------------------------
    def make_group(self, named: list[tuple[str, Parameter]], hyper: dict[str, Any]) -> Any:
        """Lay one parameter group out (stages 0-2: a FlatGroup of the whole group)."""
        return FlatGroup(named, self.make_layout(named), self.dtype, self.comm.rank, hyper)

    def make_layout(self, named: list[tuple[str, Parameter]]) -> Layout:
        shapes = [(n, p.shape) for n, p in named]
        return deepspeed_layout(shapes, self.comm.size, self.alignment, self.round_robin)

    @property
    def round_robin(self) -> bool:
        """``round_robin_gradients`` (DeepSpeed's stages 1-2): parameters laid out round robin."""
        return (
            self.stage in (1, 2)
            and self.schedule == "deepspeed"
            and bool(self.zero.round_robin_gradients)
        )

    @property
    def alignment(self) -> int:
        """Flat buffers pad to a multiple of this times N: DeepSpeed's 2 (``deepspeed``
        schedule) or 1 (``paper``)."""
        return DEEPSPEED_ALIGNMENT if self.schedule == "deepspeed" else 1

    def attach(self, model: Any) -> None:  # noqa: B027 (a no-op by default)
        """Once, after construction: install module hooks (stages that reduce or gather
        during forward and backward)."""

    @abstractmethod
    def setup_gradients(self) -> None:
        """Allocate gradient storage and point parameters' ``.grad`` where backward writes."""

    @abstractmethod
    def grad_view(self, group: FlatGroup, rng: Range) -> Any:
        """The reduced, averaged gradient of flat-buffer range ``rng`` (an owned range)."""

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

    def step_skipped(self) -> None:  # noqa: B027  (optional hook)
        """Called instead of the step and ``gather`` when an overflow skips the step."""

    @abstractmethod
    def zero_grad(self) -> None:
        """Clear the gradients for the next accumulation window."""

    @abstractmethod
    def grad_bytes(self) -> int:
        """Bytes of gradient storage this rank keeps between micro-steps."""

    # -- shared ---------------------------------------------------------------------------------
    def segments(self, which: str = "owned") -> list[Segment]:
        """The parameter element runs this rank holds in its optimizer shards.

        ``which="owned"``: the elements this rank owns (each element of the model appears on
        exactly one rank: what a checkpoint saves). ``which="stepped"``: every element this rank's
        optimizer updates (the same except at stage 0, where every rank steps everything: what
        a checkpoint load must fill).
        """
        if which not in ("owned", "stepped"):
            raise ValueError(f"which must be 'owned' or 'stepped', got {which!r}")
        out = []
        for gi, g in enumerate(self.groups):
            wanted = g.owned if which == "owned" else self.step_ranges(g)
            tile_ranges = self.tile_ranges[gi]
            for want in wanted:
                for k, tile in enumerate(tile_ranges):
                    part = tile.intersect(want)
                    if part is None:
                        continue
                    for slot in g.slots:
                        x = slot.range.intersect(part)
                        if x is not None:
                            rng = Range(x.start - slot.range.start, x.stop - slot.range.start)
                            out.append(Segment(slot.name, rng, gi, k, x.start - tile.start))
        return out

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
            total += part * self._inv_scale(gi, inv_scale) ** 2
        return total

    def grad_norm_sq_parts(self, inv_scale: float = 1.0) -> list[float]:
        """This rank's partial Σg² (unscaled) per DeepSpeed norm group: DeepSpeed's ZeRO takes
        each group's norm with an all-reduce of its own (``get_grad_norm_direct``), a group
        being a parameter group at stages 1-2 and a sub-group of one at stage 3
        (``deepspeed_sub_groups``). The paper's schedule sums them all in one message."""
        if self.schedule == "paper":
            return [self.grad_norm_sq(inv_scale)]
        if self.muon is not None:
            self.muon.make_updates()
        parts = []
        for gi, g in enumerate(self.groups):
            inv2 = self._inv_scale(gi, inv_scale) ** 2
            if not hasattr(g, "partition"):  # stages 1-2: the group's owned ranges
                parts.append(sum(sum_sq(self._norm_view(g, rng)) for rng in g.owned) * inv2)
                continue
            for sub in deepspeed_sub_groups(g.partition.chunks, self.zero.sub_group_size):
                lo = g.partition.offsets[sub[0]]
                hi = g.partition.offsets[sub[-1]] + g.partition.chunks[sub[-1]]
                parts.append(sum_sq(self._norm_view(g, Range(lo, hi))) * inv2)
        return parts

    def _inv_scale(self, group: int, inv_scale: float) -> float:
        """The factor that unscales ``group``'s gradients: 1 for Muon updates, which carry no
        loss scale (zero/muon.py, ``lacks_scale``)."""
        return 1.0 if self.muon is not None and self.muon.lacks_scale(group) else inv_scale

    def _norm_view(self, g: Any, rng: Range) -> Any:
        v = self.grad_view(g, rng)
        return v if self.master_dtype is None else g.xp.astype(v, self.master_dtype)

    def overflow(self, whole: bool = False) -> float:
        """1.0 when this rank's owned reduced gradients (with ``whole``: all it steps) hold an
        inf or a nan, else 0.0."""
        from zerosim.zero.loss_scaler import overflow_flag

        ranges = [(g, r) for g in self.groups for r in (self.step_ranges(g) if whole else g.owned)]
        return overflow_flag([self.grad_view(g, r) for g, r in ranges])

    def unscale_grads(self, inv_scale: float) -> None:
        """Give the optimizer unscaled gradients (fp32 copies under mixed precision)."""
        if self.muon is not None:  # Muon's updates, if no norm was taken (then: next step)
            self.muon.make_updates()
            self.muon.step_done()
        if self.master_dtype is None:
            for gi, shards in enumerate(self.shards):
                inv = self._inv_scale(gi, inv_scale)
                if inv != 1.0:
                    for s in shards:
                        s.grad *= inv
            return
        on_host = self.offload.optimizer != "none"  # the step runs in host memory
        self._transient_grads = []
        for gi, (g, shards, cut) in enumerate(
            zip(self.groups, self.shards, self.tile_ranges, strict=True)
        ):
            at, inv = 0, self._inv_scale(gi, inv_scale)
            for s, t in zip(shards, cut, strict=True):
                view = self.grad_view(g, t)
                if np_dtype(view.dtype) == self.master_dtype and xp_of(view) is xp_of(s.data):
                    s.grad = view  # fp32 gradient storage next to the master: use it in place
                elif g.master_grads is not None:  # a persistent fp32 gradient shard
                    s.grad = g.master_grads[at : at + t.size]
                    s.grad[...] = view
                else:  # a transient fp32 copy, freed after the step (DeepSpeed's way)
                    source = to_host(view) if on_host else view
                    s.grad = xp_of(source).astype(source, self.master_dtype)
                    self._transient_grads.append(s.grad)
                    self.track_transient(nbytes(s.grad))
                s.grad *= inv
                at += t.size

    def master_to_params(self) -> None:
        """After the update: round the fp32 master into the model-dtype parameters."""
        if self.master_dtype is None:
            return
        self.params_from_master()
        for grad in self._transient_grads:  # the fp32 copies unscale_grads made
            self.track_transient(-nbytes(grad))
        self._transient_grads = []
        for shards in self.shards:
            for s in shards:
                s.grad = None

    def params_from_master(self) -> None:
        """Copy (round) the master into the stepped ranges of the model-dtype parameters.

        After every step (``master_to_params``), and after a checkpoint load has written the
        master: then the parameters must follow before ``gather()``.
        """
        if self.master_dtype is None:
            return
        for g, shards, cut in zip(self.groups, self.shards, self.tile_ranges, strict=True):
            for s, t in zip(shards, cut, strict=True):
                g.flat_param[t.start : t.stop] = move_like(s.data, g.flat_param)
        self.offload.after_update()

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

    def take_buffer(self, shape: int | tuple[int, ...], dtype: Any = None) -> Any:
        """A zero-filled bucket buffer from the pool (zerosim/zero/buckets.py); its bytes are
        the pool's (``bucket_buffers``), not transient."""
        return self.pool.take(shape, dtype)

    def give_buffer(self, view: Any) -> None:
        """Give a buffer from ``take_buffer`` back to the pool."""
        self.pool.give(view)

    def track_transient(self, nbytes: int) -> None:
        """Count bytes of a temporary buffer allocated (+) or freed (−)."""
        self.live_transient += nbytes
        self.peak_transient = max(self.peak_transient, self.live_transient)

    def full_state_dict(self) -> dict[str, np.ndarray]:
        """{name: host copy of the full parameter}, from the fp32 master under mixed precision.

        Every rank holds the full model-dtype parameters here; the master exists only for the
        stepped ranges, so under mixed precision it is all-gathered (one per partition unit).
        """
        out = {}
        for g in self.groups:
            full = g.flat_param
            if self.master_dtype is not None:
                full = xp_of(g.master).zeros(g.layout.padded_numel, dtype=self.master_dtype)
                ranges = self.step_ranges(g)
                if len(ranges) == 1 and ranges[0].size == full.size:  # stage 0: all of it
                    full[...] = g.master
                else:
                    at = 0
                    for unit, own in zip(g.layout.units, g.owned, strict=True):
                        self.comm.all_gather(
                            full[unit.start : unit.stop], g.master[at : at + own.size]
                        )
                        at += own.size
            for i, (name, _) in enumerate(g.named_params):
                out[name] = to_host(g.param_view(i, full)).copy()
        return out

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
        if any(g.master_grads is not None for g in self.groups):
            report["master_grads"] = sum(nbytes(g.master_grads) for g in self.groups)
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
