"""DeepSpeed's gradient reduction at stages 1 and 2 (the "deepspeed" schedule): IPG buckets.

DeepSpeed 0.19.8 (``deepspeed/runtime/zero/stage_1_and_2.py``) does not reduce-scatter a
gradient bucket at stages 1 and 2. Parameters join an *independent partition gradient* (IPG)
bucket one at a time, in the order their gradients are reduced: stage 2 as backward finishes
them, every micro-step; stage 1 at the accumulation boundary, in definition order (as backward
finishes them with ``overlap_comm``). Before a parameter of n elements joins a bucket that holds
e, the bucket is reduced if e + n > ``reduce_bucket_size`` (so a bucket holds at most that many
elements, unless it is one larger parameter); the last bucket is reduced when backward ends.

A bucket is cut into *slices*: the runs of each parameter that one rank's partition owns
(partition r = [r·P, (r+1)·P) of its group's flat buffer), consecutive runs of one owner merged
(``average_tensor``). How the slices travel, by DeepSpeed's switches:

    contiguous_gradients  reduce_scatter  use_multi_rank_bucket_allreduce  per bucket
    true                  true            true (the default)               all_reduce of runs of
                                                                           slices, a run closed
                                                                           once it holds more than
                                                                           reduce_bucket_size
    true                  true            false                            per owner, in order of
                                                                           its first slice:
                                                                           reduce(root=owner) of
                                                                           runs of its slices
    true                  false           any                              all_reduce of the bucket
    false                 any             any                              all_reduce of the bucket

After an all-reduce every rank keeps the slices it owns; after a reduce only the root has them.
With the defaults a bucket is one all-reduce, so every gradient element is all-reduced once:
2(N−1)/N · Ψ per reduction where the paper's reduce-scatter sends (N−1)/N · Ψ_pad.

``plan_bucket`` is the pure part (what a notebook can print); ``IpgBuckets`` runs it for a stage;
``IpgAtBoundary`` (stage 1) and ``IpgInBackward`` (stage 2) are the reducers a stage is given
(``reducer.py``): when gradients join the bucket, each reduced piece landing through the stage's
``land``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

from zerosim.backend import assign, flat
from zerosim.nn import GradReadyTracker, Parameter
from zerosim.zero.buckets import MAX_IN_FLIGHT
from zerosim.zero.reducer import GradReducer


class BucketGradient(NamedTuple):
    """A parameter in a bucket: its group and where it starts in the group's flat buffer;
    ``copy_ranks`` the ranks that receive every slice of it (a split Muon matrix's owners,
    ``zerosim/zero/muon.py``), None for a parameter whose slices go to their owners only."""

    group: int
    flat_start: int
    numel: int
    copy_ranks: frozenset[int] | None = None


class Piece(NamedTuple):
    """A run of one parameter that one partition owns: ``size`` elements at ``bucket_start`` of
    the bucket, which are elements ``flat_start`` … of group ``group``'s flat buffer, for the
    ranks ``copy_ranks`` (the owner alone, or every owner of a split Muon matrix)."""

    owner: int
    bucket_start: int
    size: int
    group: int
    flat_start: int
    copy_ranks: frozenset[int]


@dataclass(frozen=True)
class OwnerRun:
    """Consecutive pieces of one owner: one contiguous run of the bucket."""

    owner: int
    bucket_start: int
    size: int
    pieces: tuple[Piece, ...]

    @property
    def copy_ranks(self) -> frozenset[int]:
        return self.pieces[0].copy_ranks


@dataclass(frozen=True)
class Reduction:
    """One collective of a bucket: ``op`` "all_reduce" (``root`` None) or "reduce" to ``root``,
    over the concatenation of ``slices`` (a contiguous run of the bucket for an all-reduce)."""

    op: str
    root: int | None
    slices: tuple[OwnerRun, ...]

    @property
    def numel(self) -> int:
        return sum(s.size for s in self.slices)


def bucket_pieces(entries: list[BucketGradient], partition_sizes: list[int]) -> list[Piece]:
    """Each entry cut at the partition boundaries of its group (P = ``partition_sizes[group]``)."""
    pieces, at = [], 0
    for e in entries:
        size = partition_sizes[e.group]
        start, stop = e.flat_start, e.flat_start + e.numel
        while start < stop:
            owner = start // size
            end = min((owner + 1) * size, stop)
            copy = e.copy_ranks or frozenset((owner,))
            pieces.append(
                Piece(owner, at + start - e.flat_start, end - start, e.group, start, copy)
            )
            start = end
        at += e.numel
    return pieces


def merge_slices(pieces: list[Piece]) -> list[OwnerRun]:
    """Consecutive pieces of one owner, for the same ranks, become one slice (DeepSpeed merges
    them)."""
    slices: list[OwnerRun] = []
    for p in pieces:
        if slices and slices[-1].owner == p.owner and slices[-1].copy_ranks == p.copy_ranks:
            last = slices[-1]
            slices[-1] = OwnerRun(
                last.owner, last.bucket_start, last.size + p.size, (*last.pieces, p)
            )
        else:
            slices.append(OwnerRun(p.owner, p.bucket_start, p.size, (p,)))
    return slices


def _runs(slices: list[OwnerRun], limit: int) -> list[tuple[OwnerRun, ...]]:
    """Runs of slices, each closed once it holds more than ``limit`` elements (DeepSpeed's
    ``allreduce_and_scatter`` / ``allreduce_no_retain``: the test is ``numel > limit``)."""
    runs, run, numel = [], [], 0
    for s in slices:
        run.append(s)
        numel += s.size
        if numel > limit:
            runs.append(tuple(run))
            run, numel = [], 0
    if run:
        runs.append(tuple(run))
    return runs


def plan_bucket(
    entries: list[BucketGradient],
    partition_sizes: list[int],
    reduce_bucket_size: int,
    *,
    reduce_scatter: bool = True,
    use_multi_rank_bucket_allreduce: bool = True,
    contiguous_gradients: bool = True,
) -> list[Reduction]:
    """The collectives DeepSpeed issues for one IPG bucket (the table in the module docstring)."""
    slices = merge_slices(bucket_pieces(entries, partition_sizes))
    if not slices:
        return []
    if not (contiguous_gradients and reduce_scatter):
        return [Reduction("all_reduce", None, tuple(slices))]
    if use_multi_rank_bucket_allreduce:
        return [Reduction("all_reduce", None, run) for run in _runs(slices, reduce_bucket_size)]

    # per owner a reduce to it; the slices of split Muon matrices, which every owner of the
    # matrix needs, are all-reduced together; in the order each first appears in the bucket
    def key(s: OwnerRun) -> int | None:
        return None if len(s.copy_ranks) > 1 else s.owner

    return [
        Reduction("all_reduce" if root is None else "reduce", root, run)
        for root in dict.fromkeys(key(s) for s in slices)
        for run in _runs([s for s in slices if key(s) == root], reduce_bucket_size)
    ]


class IpgBuckets:
    """A stage's IPG bucket: ``add`` parameters' gradients as they are reduced, ``finish`` at the
    end of backward. ``deliver(group, flat_start, values)`` receives each reduced piece this rank
    owns (values are the sum over ranks, in the bucket's dtype).

    ``strategy`` lends its reduce sequence (``strategy.reduction``: pooled buffers, scaling,
    reductions pending), the communicator, the wire dtype and overlap-or-block (``start_or_run``);
    ``flat_starts[g][i]`` is where parameter i of group g starts in its flat buffer;
    ``partition_sizes[g]`` is P of group g.
    """

    def __init__(
        self,
        strategy: Any,
        flat_starts: list[list[int]],
        partition_sizes: list[int],
        deliver: Callable[[int, int, Any], None],
    ) -> None:
        zero = strategy.zero
        self.strategy: Any = strategy  # the stage: its pool, its reduce sequence
        self.comm: Any = strategy.comm  # the ranks a bucket is reduced over
        # per group, each parameter's start in the flat buffer
        self.flat_starts: list[list[int]] = flat_starts
        # per group, P: the elements of one rank's partition
        self.partition_sizes: list[int] = partition_sizes
        # deliver(group, start, values): a piece lands
        self.deliver: Callable[[int, int, Any], None] = deliver
        # reduce_bucket_size: a bucket goes before it would overflow this
        self.limit: int = int(zero.reduce_bucket_size)
        self.switches: dict[str, bool] = dict(  # DeepSpeed's switches that choose the collective
            reduce_scatter=bool(zero.reduce_scatter),
            use_multi_rank_bucket_allreduce=bool(zero.use_multi_rank_bucket_allreduce),
            contiguous_gradients=bool(zero.contiguous_gradients),
        )
        self.muon: Any = strategy.muon  # split Muon matrices go to all their owners
        self.entries: list[BucketGradient] = []  # the bucket being filled
        self.grads: list[Any] = []  # their gradients (flattened views), until the bucket goes
        self.numel: int = 0  # their elements

    def add(self, group: int, index: int, grad: Any) -> None:
        """Parameter ``index`` of ``group`` joins the bucket (which is reduced first if full)."""
        numel = int(grad.size)
        if numel == 0:
            return
        if self.numel + numel > self.limit:
            self.reduce()
        copy = None if self.muon is None else self.muon.copy_ranks(group, index)
        self.entries.append(BucketGradient(group, self.flat_starts[group][index], numel, copy))
        self.grads.append(flat(grad))
        self.numel += numel

    def reduce(self) -> None:
        """Reduce the bucket being filled (nothing when empty).

        On a GPU, with ``overlap_comm``, DeepSpeed copies each gradient into the bucket on the
        compute stream and reduces the bucket on its reduction stream (``average_tensor``: that
        stream waits for the compute stream, and the compute stream first waits for that stream,
        so one bucket's reduction is in flight at a time). Here every call runs in order on the
        one thread; the engine notes where that stream's work starts and ends
        (``Communicator.note_stream``), which the dry run's time model reads."""
        if not self.entries:
            return
        plan = plan_bucket(self.entries, self.partition_sizes, self.limit, **self.switches)
        s = self.strategy
        wire = s.wire_dtype(self.grads[0].dtype)
        bucket = s.reduction.take(self.numel, wire)
        at = 0
        for g in self.grads:
            assign(bucket[at : at + g.size], g)
            at += g.size
        self.entries, self.grads, self.numel = [], [], 0
        on_stream = s.zero.overlap_comm  # on a GPU: on DeepSpeed's reduction stream
        if on_stream:
            self.comm.note_stream("reduce_in_turn")
        for i, r in enumerate(plan):
            last = i == len(plan) - 1
            self._start_reduction(r, bucket, last)
        if on_stream:
            self.comm.note_stream("compute")

    def _start_reduction(self, r: Reduction, bucket: Any, last: bool) -> None:
        """Start one collective of a bucket (the strategy's reduce sequence: each message is
        scaled as it goes, so every element of the bucket once); the bucket buffer is given back
        with its last."""
        s = self.strategy
        s.reduction.pending.complete(leave=MAX_IN_FLIGHT - 1)
        first, stop = r.slices[0].bucket_start, r.slices[-1].bucket_start + r.slices[-1].size
        if stop - first == r.numel:  # contiguous in the bucket: reduce it in place
            message, extra = bucket[first:stop], ()
        else:  # a reduce of one owner's scattered slices: flatten them (DeepSpeed does too)
            message = s.reduction.take(r.numel, bucket.dtype)
            at = 0
            for sl in r.slices:
                message[at : at + sl.size] = bucket[sl.bucket_start : sl.bucket_start + sl.size]
                at += sl.size
            extra = (message,)
        views = extra + ((bucket,) if last else ())
        mine = r.root is None or r.root == self.comm.rank  # a reduce leaves nothing elsewhere
        land = Delivery(self, r) if mine else None
        s.reduction.reduce(message, land, partial(self.collective, r), pooled=views)

    def collective(self, r: Reduction, out: Any, message: Any) -> Any:
        """A reduce-sequence collective: the message all-reduced or reduced to ``r.root``, in
        place, as ``r.op`` says."""
        s, comm = self.strategy, self.comm
        if r.op == "all_reduce":
            return s.start_or_run(comm.iall_reduce, comm.all_reduce, message)
        return s.start_or_run(comm.ireduce, comm.reduce, message, r.root)

    def finish(self) -> None:
        """End of backward: reduce the last bucket and wait for every collective (on a GPU:
        ``independent_gradient_partition_epilogue`` synchronizes the device)."""
        self.reduce()
        if self.strategy.zero.overlap_comm:
            self.comm.note_stream("sync")
        self.strategy.reduction.pending.complete()


class Delivery:
    """Where a reduced message of ``IpgBuckets`` goes on this rank: ``delivery(message)`` (what
    ``PendingReductions`` does once it completes) hands each piece of it this rank receives to
    the stage's ``deliver`` (the piece's owner) or to Muon (a split matrix's other owners)."""

    def __init__(self, ipg: IpgBuckets, reduction: Reduction) -> None:
        self.ipg: IpgBuckets = ipg  # the buckets the message came from
        self.reduction: Reduction = reduction  # which pieces of the message this rank keeps

    def __call__(self, message: Any) -> None:
        rank, at = self.ipg.comm.rank, 0
        for sl in self.reduction.slices:
            if rank in sl.copy_ranks:  # its owner, or a Muon matrix's other owners
                deliver = self.ipg.deliver if sl.owner == rank else self.ipg.muon.receive
                for p in sl.pieces:
                    start = at + p.bucket_start - sl.bucket_start
                    deliver(p.group, p.flat_start, message[start : start + p.size])
            at += sl.size


def ipg_buckets(strategy: Any) -> IpgBuckets:
    """A stage's IPG bucket over its flat buffers, each reduced piece landing in the stage."""
    starts = [[slot.range.start for slot in g.slots] for g in strategy.groups]
    sizes = [g.layout.shard_numel for g in strategy.groups]
    return IpgBuckets(strategy, starts, sizes, strategy.land)


class IpgAtBoundary(GradReducer):
    """DeepSpeed's stage-1 reducer: at the boundary the gradients join IPG buckets as backward
    finishes them (with ``overlap_comm``, its hooks), the rest after backward in definition order
    (``reduce_gradients``); the module gradients stay (they accumulate across micro-steps)."""

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy)
        self.ipg: IpgBuckets = ipg_buckets(strategy)  # the bucket being filled
        self.reducing: bool = False  # with overlap_comm: only the boundary backward reduces
        self.added: set[int] = set()  # id(param) of gradients added in this boundary backward
        self.tracker: GradReadyTracker | None = None  # attach(), with overlap_comm

    def attach(self, model: Any) -> None:
        if self.strategy.zero.overlap_comm:  # reduce as backward finishes each gradient
            self.tracker = GradReadyTracker(model, self._ready)

    def _ready(self, p: Parameter) -> None:
        if self.reducing:
            self._add(*self.strategy.where[id(p)])

    def _add(self, gi: int, i: int) -> None:
        g = self.strategy.groups[gi]
        self.ipg.add(gi, i, g.param_view(i, g.flat_grad))
        self.added.add(id(g.named_params[i][1]))

    def before_backward(self, boundary: bool) -> None:
        self.reducing = boundary

    def after_backward(self, boundary: bool) -> None:
        if self.tracker is not None:
            self.tracker.reset()
        if not boundary:
            return
        self.reducing = False
        for gi, g in enumerate(self.strategy.groups):  # definition order (all of them, or the
            for i, (_, p) in enumerate(g.named_params):  # ones backward did not finish)
                if id(p) not in self.added:
                    self._add(gi, i)
        self.added.clear()
        self.ipg.finish()


class IpgInBackward(GradReducer):
    """DeepSpeed's stage-2 reducer: during every backward each gradient joins the IPG bucket as
    soon as it is final (its module copy is then dropped); after backward the rest, last first
    (``independent_gradient_partition_epilogue``)."""

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy)
        self.ipg: IpgBuckets = ipg_buckets(strategy)  # the bucket being filled
        self.added: set[int] = set()  # id(param) of gradients added in this backward
        self.tracker: GradReadyTracker | None = None  # attach(): says when a gradient is final

    def attach(self, model: Any) -> None:
        self.tracker = GradReadyTracker(model, self._ready)

    def _ready(self, p: Parameter) -> None:
        """The gradient joins the IPG bucket; the module's copy goes."""
        if p.grad is None:
            return
        gi, i = self.strategy.where[id(p)]
        self.ipg.add(gi, i, p.grad)
        self.added.add(id(p))
        p.grad = None

    def after_backward(self, boundary: bool) -> None:
        self.tracker.reset()
        for g in self.strategy.groups:  # parameters whose uses never completed, last first
            for _, p in reversed(g.named_params):
                if id(p) not in self.added:
                    self._ready(p)
        self.added.clear()
        self.ipg.finish()
