"""Muon under ZeRO, as DeepSpeed 0.19.8 runs it: the update of a matrix needs the whole matrix.

Muon's update (``zerosim.optim.functional.muon_update``) runs Newton–Schulz on a parameter's
whole gradient matrix. ZeRO's flat partitions cut matrices anywhere, so a rank that owns a slice
must first get the rest. DeepSpeed does it two ways, and so does ``MuonUpdates``:

**Stages 1-2** (``stage_1_and_2.py``: ``average_tensor``, ``get_flat_partition``). A matrix cut
by a partition boundary is *split*; the slices of its gradient in an IPG bucket go to every rank
that owns a piece of it (its "copy ranks"), by all-reduce, even where DeepSpeed would otherwise
reduce each slice to its one owner (``use_multi_rank_bucket_allreduce: false``; with the
default, true, every slice is all-reduced anyway and splitting costs no extra byte). Each of
those ranks then holds the whole reduced gradient, keeps the whole matrix's momentum (a
partition's momentum buffer is as long as the matrices that overlap it, not the partition),
orthogonalizes the whole matrix, and keeps the slice of the update it owns. The bucket plan is
``zerosim/zero/ipg.py``'s (``copy_ranks``); ``receive`` takes the copied slices.

**Stage 3** (``stage3.py``: ``_apply_muon_to_accumulated_grads``, ``_muon_update_sub_group``).
Every parameter is cut into N chunks, so every matrix is split. At the step, per sub-group and
per run of parameters up to ``reduce_bucket_size`` elements: one all-gather of the gradient
chunks and one of the momentum chunks (every rank now holds the run's whole gradients and
momentums); then, N matrices at a time, rank r orthogonalizes matrix r of the round and two
all-gathers share the updates and momentums; each rank keeps its chunks. DeepSpeed refuses
Muon with ``reduce_scatter`` here.

**Optimizer offload** (stages 1-3): DeepSpeed's other path, ``zerosim/zero/muon_offload.py``
(every rank gathers every matrix; the momentum partitioned as the parameters are).

**Stage 0** (no ZeRO: DeepSpeed's ``MuonWithAuxAdam`` on whole matrices). Every rank holds
every matrix; the update is made in the optimizer's step, after clipping (``before_step``).

Which of the three a strategy runs, it says by what it partitions: nothing (stage 0,
``whole``), the optimizer states over a flat buffer (stages 1-2, ``flat``) or every parameter
(``partitions_params``, stage 3, ``chunked``).

At stages 1-3 the update is made when the engine first asks for the gradient norm (or, without
one, unscales): DeepSpeed takes the norm, and clips, over the *updates* of the Muon matrices.
Newton–Schulz returns the same update at any loss scale, so the update written into the
gradient storage does not carry the scale the other gradients carry: DeepSpeed marks such a
group ("lacks loss scale") and multiplies its norm, and its fp32 gradient, by the scale before
unscaling. zerosim leaves the update unscaled (``lacks_scale``: the sharded step,
``sharded_step.py``, does not unscale that group), the same numbers; under fp16 the scaled
update would not even fit the gradient's dtype. The optimizer steps θ ← θ·(1 − lr·λ) −
lr·update. Collectives made here are in the ledger under phase ``muon``.

**Precision** (DeepSpeed's dtypes under bf16 / fp16). Stage 0: its FP16_UnfusedOptimizer hands
MuonWithAuxAdam fp32 copies of the whole matrices, unscaled and clipped, so the momentum and
the update are fp32 (the master dtype), as in fp32 training. Stages 1-2: ``muon_update`` runs
on the reduced gradient in its own dtype, with the momentum in that dtype
(``_muon_momentum_buffer``: it follows the gradient). Stage 3: the gradient and momentum
chunks are all-gathered, and the update made, in ``communication_data_type`` (the model dtype
unless set), the momentum kept in it. Newton–Schulz itself runs in its method's dtype
(``functional.muon.ns_compute_dtype``). A step the loss scaler skips leaves the momentum as it
was (DeepSpeed stages it and commits it only when the step survives): here the updates are
made only after the overflow check, and ``step_skipped`` drops the copied slices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from zerosim.backend import flat, nbytes
from zerosim.optim.functional.common import state_dtype
from zerosim.optim.functional.muon import muon_update
from zerosim.zero.muon_offload import OffloadedMuon
from zerosim.zero.partition import deepspeed_sub_groups

PHASE = "muon"


@dataclass
class Matrix:
    """A parameter of a Muon group: where it is, who owns pieces of it, and what this rank keeps."""

    name: str
    group: int
    index: int
    shape: tuple[int, ...]
    owners: frozenset[int]  # stages 1-2: the ranks whose partition overlaps it
    momentum: Any = None  # stages 0-2: the whole matrix's momentum, on every owner
    copies: Any = None  # stages 1-2, split matrices: the reduced slices other ranks own
    start: int = 0  # stages 0-2: where it starts in its group's flat buffer
    span: tuple[int, int] | None = None  # offloaded stages 1-2: the elements this rank owns
    spans: dict[int, tuple[int, int]] | None = None  # … and each owner (``spans_of``)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape))

    @property
    def split(self) -> bool:
        """More than one rank owns a piece of it (stage 0: every rank holds it whole)."""
        return len(self.owners) > 1


def muon_groups(strategy: Any) -> list[int]:
    """Indices of the strategy's parameter groups that use Muon."""
    return [gi for gi, g in enumerate(strategy.groups) if g.hyper.get("use_muon")]


class MuonUpdates:
    """One strategy's Muon matrices, their momentum, and how their updates are made."""

    PHASE = PHASE  # the ledger phase of the collectives made here

    def __init__(self, strategy: Any) -> None:
        self.strategy: Any = strategy  # its groups, dtypes and offload; grad_view at the step
        self.comm: Any = strategy.comm  # the collectives of phase ``muon``
        # how the matrices are held (module docstring): exactly one of the three is True
        self.whole: bool = not strategy.partitions_optimizer_states  # every rank steps them all
        self.chunked: bool = strategy.partitions_params  # each cut into N chunks (stage 3)
        self.flat: bool = not (self.whole or self.chunked)  # cut by flat partitions (stages 1-2)
        self.made: bool = False  # this step's updates are in the gradient storage
        self.groups: list[int] = muon_groups(strategy)  # indices of the Muon parameter groups
        self.matrices: list[Matrix] = []  # every matrix of those groups, in order
        self.where: dict[tuple[int, int], Matrix] = {}  # (group, index) -> its matrix
        n, rank = self.comm.size, self.comm.rank
        offload = strategy.offload
        # optimizer offload: DeepSpeed's other path (zero/muon_offload.py)
        self.offloaded: OffloadedMuon | None = (
            OffloadedMuon(self) if offload.optimizer != "none" else None
        )
        self.momentum_on_nvme: bool = (  # the momentum lives in swap files
            offload.optimizer == "nvme" and not strategy.zero.save_muon_momentum_buffer_in_memory
        )
        self.momentum_dtype: np.dtype = self._momentum_dtype()  # the dtype the momentum is kept in
        for gi in self.groups:
            g = strategy.groups[gi]
            for i, (name, p) in enumerate(g.named_params):
                owners = frozenset(range(n))
                start = 0
                if self.flat:
                    slot = g.slots[i]
                    start = slot.range.start
                    owners = frozenset(
                        r
                        for r in range(n)
                        if any(slot.range.intersect(o) for o in g.layout.owned_ranges(r))
                    )
                m = Matrix(name, gi, i, tuple(p.shape), owners, start=start)
                self.matrices.append(m)
                self.where[(gi, i)] = m
                if self.offloaded is not None and not self.chunked:  # what each rank gathers
                    m.spans = self.spans_of(m)
                if self.chunked or rank not in owners:
                    continue
                if self.offloaded is not None:  # the slice it owns, in host memory
                    m.span = m.spans[rank]
                    m.momentum = np.zeros(m.span[1] - m.span[0], dtype=self.momentum_dtype)
                    continue
                m.momentum = g.xp.zeros(m.shape, dtype=self.momentum_dtype)
                if m.split and self.flat:
                    m.copies = g.xp.zeros(m.numel, dtype=strategy.dtype)
        # stage 3: each rank keeps the momentum of its chunks, laid out as its gradient shard
        self.momentum3: dict[int, Any] = {
            gi: self._momentum3(gi) for gi in self.groups if self.chunked
        }

    def _momentum3(self, gi: int) -> Any:
        """Stage 3's momentum of group ``gi``: the device's memory, host memory under offload,
        a swap file under nvme offload unless ``save_muon_momentum_buffer_in_memory``."""
        numel = self.strategy.groups[gi].partition.shard_numel
        if self.momentum_on_nvme:
            store = self.strategy.offload.optimizer_store
            return store.array(f"group{gi}.muon_momentum", numel, self.momentum_dtype)
        xp = np if self.offloaded is not None else self.strategy.groups[gi].xp
        return xp.zeros(numel, dtype=self.momentum_dtype)

    def _momentum_dtype(self) -> np.dtype:
        """Stage 0: the master dtype; stages 1-2: the gradient's (the model dtype), the master's
        under offload; stage 3: the communication dtype (module docstring)."""
        s = self.strategy
        if self.whole:
            return state_dtype(s.dtype)
        if self.flat and self.offloaded is not None:
            return np.dtype(s.master_dtype or s.dtype)
        if self.chunked and s.comm_dtype is not None:
            return s.comm_dtype
        return s.dtype

    def lacks_scale(self, group: int) -> bool:
        """Whether ``group``'s gradient storage holds Muon updates, which carry no loss scale
        (stages 1-3): the sharded step neither unscales them nor their norm."""
        return not self.whole and group in self.groups

    # -- stages 1-2: the bucket plan's copy ranks and the copied slices --------------------------
    def copy_ranks(self, group: int, index: int) -> frozenset[int] | None:
        """The ranks that receive every slice of parameter ``index`` of ``group``: the owners
        of a split Muon matrix; None for any other parameter (each slice to its owner)."""
        m = self.where.get((group, index))
        return m.owners if m is not None and m.split and self.flat else None

    def receive(self, group: int, flat_start: int, values: Any) -> None:
        """A reduced slice of a split Muon matrix that another rank owns: keep it (summed over
        micro-steps, as the owner sums its own)."""
        for m in self.matrices:
            if m.group == group and m.start <= flat_start < m.start + m.numel:
                if m.copies is None:
                    return  # offload: DeepSpeed all-reduces them all the same, and gathers
                at = flat_start - m.start
                m.copies[at : at + values.size] += values
                return
        raise AssertionError(f"no Muon matrix of group {group} holds element {flat_start}")

    # -- making the updates ---------------------------------------------------------------------
    def make_updates(self, inv_scale: float = 1.0) -> None:
        """Stages 1-3: replace each Muon matrix's owned gradient by its update (which carries no
        loss scale: ``lacks_scale``). ``inv_scale`` unscales the gradients first under offload
        (DeepSpeed's path there, zero/muon_offload.py); without, they enter scaled."""
        if self.made or self.whole:
            return
        self.made = True
        if self.offloaded is not None:
            self.offloaded.make_updates(inv_scale)
            return
        if self.chunked:
            self._stage3()
            return
        s = self.strategy
        for m in self.matrices:
            if m.momentum is None:
                continue
            g = s.groups[m.group]
            full = g.xp.zeros(m.numel, dtype=s.dtype)
            if m.split:
                s.average(m.copies)
                full[...] = m.copies
                m.copies[...] = 0
            owned = self.owned_parts(m)
            for part in owned:
                full[part.start - m.start : part.stop - m.start] = s.grad_view(g, part)
            update = flat(self.update(m.group, full.reshape(m.shape), m.momentum))
            for part in owned:
                s.grad_view(g, part)[...] = update[part.start - m.start : part.stop - m.start]

    def step_done(self) -> None:
        """After the optimizer step: the next step makes its own updates."""
        self.made = False

    def step_skipped(self) -> None:
        """A step the loss scaler skipped: no update was made (the momentum is as it was), and
        the slices copied for it are dropped with the other gradients."""
        self.made = False
        for m in self.matrices:
            if m.copies is not None:
                m.copies[...] = 0

    def before_step(self, optimizer: Any) -> None:
        """Stage 0: each matrix's update from its whole (clipped, unscaled) gradient, written
        into the gradients of the optimizer's tiles (DeepSpeed's MuonWithAuxAdam on whole
        matrices)."""
        s = self.strategy
        pieces: dict[str, list] = {}
        for seg in s.segments("stepped"):
            pieces.setdefault(seg.name, []).append(seg)
        tiles = s.sharded_step.tiles
        for m in self.matrices:
            g = s.groups[m.group]
            full = None
            for seg in pieces.get(m.name, []):
                grad = tiles[seg.group][seg.tile].grad
                if full is None:
                    full = g.xp.zeros(m.numel, dtype=grad.dtype)
                full[seg.param_range.start : seg.param_range.stop] = grad[
                    seg.offset : seg.offset + seg.size
                ]
            if full is None:
                continue
            update = flat(self.update(m.group, full.reshape(m.shape), m.momentum))
            for seg in pieces[m.name]:
                grad = tiles[seg.group][seg.tile].grad
                grad[seg.offset : seg.offset + seg.size] = update[
                    seg.param_range.start : seg.param_range.stop
                ]

    def update(self, group: int, grad: Any, momentum: Any) -> Any:
        """Muon's update of one whole matrix (``momentum`` updated in place)."""
        hyper = self.strategy.optimizer.param_groups[group]
        return muon_update(grad, momentum, beta=hyper["momentum"], ns_method=hyper["ns_method"])

    def owned_parts(self, m: Matrix) -> list[Any]:
        """Stages 1-2: the flat ranges of matrix ``m`` this rank owns."""
        g = self.strategy.groups[m.group]
        slot = g.slots[m.index].range
        return [x for own in g.owned if (x := slot.intersect(own)) is not None]

    def spans_of(self, m: Matrix) -> dict[int, tuple[int, int]]:
        """Stages 1-2: {owner: (start, stop)}, the elements of ``m`` each owner holds (one run
        each: DeepSpeed's partitions are contiguous)."""
        g = self.strategy.groups[m.group]
        slot = g.slots[m.index].range
        out = {}
        for r in sorted(m.owners):
            runs = [x for own in g.layout.owned_ranges(r) if (x := slot.intersect(own))]
            assert len(runs) == 1, f"rank {r} owns {len(runs)} runs of {m.name}"
            out[r] = (runs[0].start - m.start, runs[0].stop - m.start)
        return out

    # -- stage 3: DeepSpeed's sub-group loop ----------------------------------------------------
    def _stage3(self) -> None:
        s, comm = self.strategy, self.comm
        for gi in self.groups:
            g = s.groups[gi]
            for run in self.stage3_runs(g):
                with comm.phase(PHASE):
                    grads = self._gather_chunks(g, run, g.grad_shard)
                    moms = self._gather_chunks(g, run, self.momentum3[gi])
                    for base in range(0, len(run), comm.size):
                        self._round(gi, run[base : base + comm.size], grads, moms, base)
                for k, i in enumerate(run):
                    part = g.partition
                    lo, n = comm.rank * part.chunks[i], part.valid(i, comm.rank)
                    at = part.offsets[i]
                    update = g.xp.astype(flat(grads[k]), g.grad_shard.dtype)
                    g.grad_shard[at : at + n] = update[lo : lo + n]
                    self.momentum3[gi][at : at + n] = flat(moms[k])[lo : lo + n]

    def stage3_runs(self, g: Any) -> list[list[int]]:
        """Parameter indices of each all-gather run: DeepSpeed's sub-groups (parameters taken
        until their chunks reach ``sub_group_size``), each cut into runs of parameters whose
        elements stay within ``reduce_bucket_size`` (at least one parameter a run)."""
        zero, part = self.strategy.zero, g.partition
        sub_groups = deepspeed_sub_groups(part.chunks, zero.sub_group_size)
        runs = []
        for sub in sub_groups:
            start = 0
            while start < len(sub):
                end, numel = start, 0
                while end < len(sub) and (
                    end == start or numel + part.numels[sub[end]] <= zero.reduce_bucket_size
                ):
                    numel += part.numels[sub[end]]
                    end += 1
                runs.append(sub[start:end])
                start = end
        return runs

    def _gather_chunks(self, g: Any, run: list[int], shard: Any) -> list[Any]:
        """One all-gather of this rank's chunks of the run's parameters, in the momentum's dtype
        (DeepSpeed's communication dtype); the whole matrices."""
        part, n = g.partition, self.comm.size
        local = g.xp.concat(
            [shard[part.offsets[i] : part.offsets[i] + part.chunks[i]] for i in run]
        )
        local = g.xp.astype(local, self.momentum_dtype)
        out = g.xp.empty(n * local.size, dtype=local.dtype)
        self.comm.all_gather(out, local)
        whole, at = [], 0
        for i in run:
            c = part.chunks[i]
            pieces = [out[r * local.size + at : r * local.size + at + c] for r in range(n)]
            whole.append(g.xp.concat(pieces)[: part.numels[i]].reshape(part.shapes[i]))
            at += c
        return whole

    def _round(self, gi: int, members: list[int], grads: list, moms: list, base: int) -> None:
        """Rank r orthogonalizes member r; two all-gathers give every rank every update and
        momentum (padded to the largest member when the shapes differ or the round is short)."""
        comm, g = self.comm, self.strategy.groups[gi]
        n, rank = comm.size, comm.rank
        if rank < len(members):
            k = base + rank
            grads[k] = self.update(gi, grads[k], moms[k])
        shapes = [grads[base + j].shape for j in range(len(members))]
        width = max(int(np.prod(sh)) for sh in shapes)  # the size of each when they are alike
        for arrays in (grads, moms):
            local = g.xp.zeros(width, dtype=arrays[base].dtype)
            if rank < len(members):
                mine = flat(arrays[base + rank])
                local[: mine.size] = mine
            out = g.xp.empty(n * width, dtype=local.dtype)
            comm.all_gather(out, local)
            for j in range(len(members)):
                numel = int(np.prod(shapes[j]))
                arrays[base + j] = out[j * width : j * width + numel].reshape(shapes[j])

    # -- checkpoints (zerosim/checkpoint/sharded.py) --------------------------------------------
    def held(self) -> list[tuple[Matrix, int, int]]:
        """(matrix, start, stop): the elements of each matrix whose momentum this rank keeps
        (stages 0-2: every element of the matrices it owns; stage 3: its chunk)."""
        out = []
        for m in self.matrices:
            if not self.chunked:
                if m.momentum is not None:
                    out.append((m, *(m.span or (0, m.numel))))
                continue
            part, rank = self.strategy.groups[m.group].partition, self.comm.rank
            lo, n = rank * part.chunks[m.index], part.valid(m.index, rank)
            if n > 0:
                out.append((m, lo, lo + n))
        return out

    def _momentum_flat(self, m: Matrix, start: int, stop: int) -> tuple[Any, int, int]:
        """(flat array, a, b): elements [start, stop) of ``m``'s momentum are array[a:b]."""
        if not self.chunked:
            at = m.span[0] if m.span is not None else 0
            return flat(m.momentum), start - at, stop - at
        part = self.strategy.groups[m.group].partition
        base = part.offsets[m.index] - self.comm.rank * part.chunks[m.index]
        return self.momentum3[m.group], base + start, base + stop

    def read_momentum(self, name: str, start: int, stop: int) -> Any:
        """Elements [start, stop) of matrix ``name``'s momentum (this rank keeps them)."""
        m = next(m for m in self.matrices if m.name == name)
        array, a, b = self._momentum_flat(m, start, stop)
        return array[a:b]

    def write_momentum(self, name: str, start: int, values: Any) -> None:
        """Set elements [start, start + len(values)) of matrix ``name``'s momentum."""
        m = next(m for m in self.matrices if m.name == name)
        if self.offloaded is not None:  # a loaded momentum: gathered from the first step on
            self.offloaded.momentum_exists = True
        if not self.chunked:
            whole, a, b = self._momentum_flat(m, start, start + values.size)
            whole[a:b] = values
            m.momentum[...] = whole.reshape(m.momentum.shape)  # flat() may have copied
            return
        array, a, b = self._momentum_flat(m, start, start + values.size)
        array[a:b] = values

    # -- memory -----------------------------------------------------------------------------------
    def momentum_arrays(self) -> list[Any]:
        """The arrays holding this rank's momentum (where they live: ``Offload.split``)."""
        whole = [m.momentum for m in self.matrices if m.momentum is not None]
        return whole + list(self.momentum3.values())

    def memory(self) -> dict[str, int]:
        """{optimizer_state.momentum_buffer, muon_gradient_copies}: bytes this rank keeps."""
        momentum = sum(nbytes(a) for a in self.momentum_arrays())
        copies = sum(nbytes(m.copies) for m in self.matrices if m.copies is not None)
        return {"optimizer_state.momentum_buffer": momentum, "muon_gradient_copies": copies}
