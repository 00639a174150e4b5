"""Stage 3 under PyTorch FSDP2's schedule (``zerosim.schedule: "fsdp2"``): what it changes in the
paper's stage 3 (``stage3.py``), and why.

FSDP2 (``torch.distributed.fsdp.fully_shard``, torch 2.13) shards the same three model states as the
paper's stage 3, but a torch user groups parameters by *FSDP module* (each transformer block, then
the root model) and FSDP2 moves each FSDP module in one collective. zerosim issues its collectives
call for call so that torch can be its oracle. ``Stage3FSDP2`` is the paper's ``Stage3`` given two
parts, and its constructor only reads FSDP2's settings: the fetcher (``fsdp2_fetcher.ModuleGather``:
how parameters are cut, what is gathered when, in which dtype, and whether parameters stay gathered
between micro-batches) and the reducer (``ModuleReduceScatter`` below: when and how gradients are
reduced, averaged as they land, HSDP's replicas). What changes:

* **The partition is per parameter along dim 0** (``partition.dim0_partition``, DTensor's
  ``Shard(0)``; the fetcher's ``partition_rule``, with no persistent parameters): chunk_i =
  ceil(dim0_i / N) rows of parameter i, padded with zero rows, instead of ceil(numel_i / N)
  elements. The chunks are the *sharded parameters* and, in the dtype they were
  built in (float32), the optimizer's weights: no separate master copy, whatever ``param_dtype``.
* **One all-gather per FSDP module, in param_dtype** (``fsdp2_fetcher.ModuleGather``): the FSDP
  module's chunks cast to ``param_dtype`` and gathered together; in forward before the FSDP module
  runs, in backward again if ``reshard_after_forward`` freed it, the next FSDP module prefetched as
  FSDP2 does.
* **One reduce-scatter per FSDP module, in reduce_dtype** (``ModuleReduceScatter`` below,
  ``_fsdp_collectives.foreach_reduce``): after the FSDP module's backward its gradients, each padded
  to N · chunk_i, are cast to ``reduce_dtype`` and laid rank-major (rank r's chunks of every
  parameter end to end in row r); one reduce-scatter hands each rank its row. FSDP2 asks the
  collective for the average (``ReduceOp.AVG`` for float32 and bfloat16): zerosim sums, then divides
  the row by N in ``reduce_dtype``, and adds it into the float32 gradient shard.
* **Gradient accumulation** runs as ``set_requires_gradient_sync(False)`` on every micro-batch but
  the last: no reduce-scatter, the unsharded gradients are kept, upcast to ``reduce_dtype``
  (``FSDPParam.to_accumulated_grad_if_needed``) and summed; the last micro-batch reduces the sum.
  With ``reshard_after_backward`` false the parameters also stay gathered between micro-batches.
  With ``reduce_every_micro_batch`` (torch's default, FSDP1's under Composer) every micro-batch
  reduce-scatters and its rows are added into the gradient shard: k times the reduce-scatter
  bytes, and no unsharded gradient waits between micro-batches.

HSDP (``replicate`` R > 1, torch's 2-D mesh [R, N / R]): the stage runs inside its row of N / R
ranks (its shard group: the partition, the gathers, the reduce-scatters, the gradient norm), and
each reduced row is all-reduced down its column (the R replicas) as soon as it is reduced.

Bytes one rank sends per step (b_p, b_r: bytes of param_dtype and reduce_dtype; U FSDP modules, FSDP
module u of S_u = Σ chunk_i elements per rank; k micro-batches; blocks resharded after forward):

    forward all-gather     k · Σ_u (N−1)·S_u·b_p
    backward all-gather    k · Σ_blocks (N−1)·S_u·b_p           (none when not resharded)
    reduce-scatter         Σ_u (N−1)·S_u·b_r                     (once, at the last micro-batch)
"""

from __future__ import annotations

from functools import partial
from typing import Any

from zerosim.backend import assign, nbytes, resolve_dtype, xp_of
from zerosim.nn import Parameter
from zerosim.zero.buckets import pack_chunks, reduce_rows
from zerosim.zero.fsdp2_fetcher import FsdpModule, ModuleGather
from zerosim.zero.reducer import GradReducer
from zerosim.zero.schedule import fsdp2_checks
from zerosim.zero.stage3 import Stage3


class AveragedRow:
    """Where one FSDP module's reduced row lands: divided by the shard group's size in
    ``reduce_dtype`` (FSDP2's average); under HSDP all-reduced across the replicas and divided by
    their number; then each parameter's chunk ``row[column : column + chunk]`` handed to the
    stage's ``land``."""

    def __init__(self, strategy: Any, slots: list[tuple[int, int, int, int]]) -> None:
        # its land(group, shard position, values), its groups of ranks
        self.strategy: Any = strategy
        # (group, chunk offset in its shard, chunk, column in the row)
        self.slots: list[tuple[int, int, int, int]] = slots

    def __call__(self, row: Any) -> None:
        s = self.strategy
        row /= s.comm.size
        if s.replicate_comm is not None:  # HSDP: the replicas' rows averaged
            s.replicate_comm.all_reduce(row)
            row /= s.replicate_comm.size
        for gi, start, chunk, column in self.slots:
            s.land(gi, start, row[column : column + chunk])


class ModuleReduceScatter(GradReducer):
    """FSDP2's reducer: one reduce-scatter of each FSDP module's gradients after its backward, at
    the last micro-batch of an accumulation window; before it, gradients are summed locally."""

    lands_averaged = True  # each reduced row divided by N as it lands (FSDP2's ReduceOp.AVG)

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy)
        self.boundary: bool = True  # this micro-batch ends the window: reduce
        self.accumulated: dict[int, Any] = {}  # id(param) -> its summed gradient, reduce_dtype
        self.peak_accumulated_bytes: int = 0  # the most ``accumulated`` has held

    def attach(self, model: Any) -> None:
        for mod in self.strategy.fetcher.fsdp_modules:
            mod.module.register_full_backward_hook(
                lambda _m, _gi, _go, mod=mod: self.post_backward(mod)
            )

    def before_backward(self, boundary: bool) -> None:
        self.boundary = boundary or self.strategy.reduce_every_micro_batch

    def post_backward(self, mod: FsdpModule) -> None:
        """The FSDP module's gradients are final: summed into the accumulated ones (reduce_dtype),
        and at the last micro-batch reduced."""
        reduce_dtype = self.strategy.reduce_dtype
        ready: list[tuple[Parameter, Any]] = []
        for p in mod.params:
            grad, p.grad = p.grad, None
            total = self.accumulated.pop(id(p), None)
            if total is not None and grad is not None:
                assign(total, total + grad)
            elif grad is not None:
                total = xp_of(grad).astype(grad, reduce_dtype)
            if total is None:  # unused in this backward: FSDP2 leaves it out of the reduction
                continue
            if self.boundary:
                ready.append((p, total))
            else:
                self.accumulated[id(p)] = total
        if ready:
            self.reduce(ready)

    def reduce(self, ready: list[tuple[Parameter, Any]]) -> None:
        """One reduce-scatter of an FSDP module's gradients: each padded to N · chunk_i,
        rank-major."""
        s = self.strategy
        buf, slots, width = pack_chunks(s, [p for p, _ in ready], [g for _, g in ready])
        s.reduction.reduce(buf, AveragedRow(s, slots), partial(reduce_rows, s), width)
        if s.replicate_comm is not None:  # FSDP2 all-reduces a row as soon as it is reduced
            s.reduction.pending.complete()

    def after_backward(self, boundary: bool) -> None:
        """Every reduce-scatter of this backward has landed; before the last micro-batch, every
        unsharded gradient is kept until the next."""
        self.strategy.reduction.pending.complete()
        held = sum(nbytes(g) for g in self.accumulated.values())
        self.peak_accumulated_bytes = max(self.peak_accumulated_bytes, held)

    def memory(self) -> dict[str, int]:
        """The unsharded gradients kept between micro-batches (reduce_dtype), at their most."""
        return {"peak_accumulated_grads": self.peak_accumulated_bytes}

    def replica(self) -> int:
        """HSDP: this rank's row of the mesh (every replica holds the same shards)."""
        replicas = self.strategy.replicate_comm
        return 0 if replicas is None else replicas.rank


class Stage3FSDP2(Stage3):
    """Stage 3 with FSDP2's dim-0 shards, per-FSDP-module all-gathers and reduce-scatters."""

    adopts_zero_init = False  # zero.Init cuts ceil(numel / N) elements, FSDP2 dim-0 rows
    reducer_cls = ModuleReduceScatter  # one reduce-scatter per FSDP module, in reduce_dtype
    fetcher_cls = ModuleGather  # one all-gather per FSDP module, in param_dtype
    boundary_rule = staticmethod(fsdp2_checks)  # a norm only to clip: torch's clip_grad_norm_

    def __init__(
        self,
        *,
        reshard_after_forward: bool | int = True,
        param_dtype: str | None = None,
        reduce_dtype: str | None = None,
        reshard_after_backward: bool = True,
        reduce_every_micro_batch: bool = False,
        replicate: int = 1,
        blocks: list[Any] | None = None,
        **kwargs: Any,
    ) -> None:
        dtype = resolve_dtype(kwargs["dtype"])
        # MixedPrecisionPolicy: the gather's and the computation's dtype, the reduction's
        self.param_dtype: Any = dtype if param_dtype is None else resolve_dtype(param_dtype)
        self.reduce_dtype: Any = (
            self.param_dtype if reduce_dtype is None else resolve_dtype(reduce_dtype)
        )
        world = kwargs["comm"]
        if replicate < 1 or world.size % replicate:
            raise ValueError(f"replicate={replicate!r}: a divisor of the world size {world.size}")
        shard = world.size // replicate  # the mesh [replicate, shard], rank = i · shard + j
        # torch's rule: an int g reshards to groups of g ranks, a divisor of the shard group;
        # 1 means False, the shard group's size True
        if not isinstance(reshard_after_forward, bool):
            if reshard_after_forward < 1 or shard % reshard_after_forward:
                raise ValueError(
                    f"reshard_after_forward={reshard_after_forward!r}: true, false or a divisor "
                    f"of the shard group's size {shard}"
                )
            if reshard_after_forward in (1, shard):
                reshard_after_forward = reshard_after_forward == shard
        # the blocks' (the root: never)
        self.reshard_after_forward: bool | int = reshard_after_forward
        self.reshard_after_backward: bool = reshard_after_backward  # between micro-batches
        # reduce-scatter after every micro-batch (torch's default), not only the last
        self.reduce_every_micro_batch: bool = reduce_every_micro_batch
        # the modules fully_shard was applied to before the root (None: each transformer block)
        self.blocks: list[Any] | None = blocks
        # HSDP: the stage runs in its shard group (row i of the mesh); rows are averaged across
        # the replicas (column j) after each reduce-scatter
        self.replicate_comm: Any = None
        if replicate > 1:
            kwargs["comm"] = world.split_by(lambda r: (r // shard, r % shard), name="shard")
            self.replicate_comm = world.split_by(
                lambda r: (r % shard, r // shard), name="replicate"
            )
        kwargs["comm_dtype"] = self.reduce_dtype  # the dtype gradients travel in
        super().__init__(**kwargs)
