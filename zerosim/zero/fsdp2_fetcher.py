"""PyTorch FSDP2's parameter fetching (``zerosim.schedule: "fsdp2"``): one all-gather per
FSDP module, in ``param_dtype``, issued when and in the order torch 2.13 issues it
(``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``).

An *FSDP module* is what a torch user passes to ``fully_shard``: each transformer block, then the
model (the *root*, holding every parameter no block holds: embeddings, final norm, head). Its
parameters are in the module's ``named_parameters`` order. Each rank holds a chunk of every
parameter (``partition.dim0_partition``: ceil(dim0 / N) rows, padded); the FSDP module's all-gather
input is this rank's chunks end to end, cast to ``param_dtype`` (``foreach_all_gather``'s copy-in),
and the output is N such rows, rank-major, from which each parameter is cut (the copy-out).

When, as ``FSDPParamGroup`` does it with the defaults:

* forward: an FSDP module is gathered in its pre-forward (the root first, then each block); after
  its forward a block is freed again if ``reshard_after_forward`` (the root never is: torch's
  default for the root, whose parameters backward needs at once). No forward prefetch (torch's is
  opt-in).
* backward: each FSDP module's pre-backward gathers it if it was freed and then *prefetches* the
  FSDP module before it in forward order (``_backward_prefetch``): the root's pre-backward, first of
  all, prefetches the last block. After its backward an FSDP module is freed
  (``reshard_after_backward``; between accumulation micro-batches it may stay gathered) once its
  gradients were handed to the reducer (``stage3_fsdp2.ModuleReduceScatter``).
* ``reshard_after_forward`` = g, an integer between 1 and N (torch's post-forward mesh): after
  forward a block keeps a copy of its parameters sharded over its group of g consecutive ranks
  (ceil(dim0 / g) rows of each, ``_to_sharded_post_forward``), and its backward all-gather runs
  inside that group on those pieces, moving (g − 1)/g of the parameters instead of (N − 1)/N.
* floating-point inputs of an FSDP module's forward are cast to ``param_dtype``
  (MixedPrecisionPolicy's ``cast_forward_inputs``).
"""

from __future__ import annotations

from typing import Any

from array_api_compat import is_array_api_obj

from zerosim.backend import nbytes, xp_of
from zerosim.nn import Module, Parameter
from zerosim.nn.functional import is_floating
from zerosim.zero.fetcher import ParamFetcher
from zerosim.zero.partition import dim0_partition


class FsdpModule:
    """One FSDP module (what ``fully_shard`` was applied to): the module, its parameters and
    whether they are gathered."""

    def __init__(
        self, module: Module, params: list[Parameter], reshard_after_forward: bool | int
    ) -> None:
        self.module: Module = module  # what fully_shard was applied to
        # in the module's named_parameters order (the flat buffer's)
        self.params: list[Parameter] = params
        # True, False or a group size g
        self.reshard_after_forward: bool | int = reshard_after_forward
        self.gathered: bool = False  # the parameters' data are whole (or a gather is in flight)
        self.gather: Any = None  # (buffer, handle, group size, chunks) of a gather in flight
        self.post_forward_shard: Any = None  # int reshard: this rank's pieces, end to end
        self.gathered_nbytes: int = 0  # bytes of the gathered buffer while gathered
        self.post_forward_indices: list[int] = []  # where it sits in the forward order


def block_modules(model: Module) -> list[Module]:
    """The modules a torch user passes to ``fully_shard`` one by one: the children of
    ``model.blocks`` (a transformer) or of ``model.layers`` (an MLP) that hold parameters."""
    for name in ("blocks", "layers"):
        container = model._modules.get(name)
        if container is not None:
            return [m for m in container.children() if any(True for _ in m.parameters())]
    return []


def build_fsdp_modules(
    model: Module, reshard_after_forward: bool | int, blocks: list[Module] | None = None
) -> list[FsdpModule]:
    """The blocks (``blocks``, or ``block_modules(model)``), then the root with every parameter
    no block holds."""
    mods, taken = [], set()
    for block in block_modules(model) if blocks is None else blocks:
        params = [p for _, p in block.named_parameters()]
        taken.update(id(p) for p in params)
        mods.append(FsdpModule(block, params, reshard_after_forward))
    rest = [p for _, p in model.named_parameters() if id(p) not in taken]
    mods.append(FsdpModule(model, rest, False))  # the root: not resharded after forward
    return mods


class ModuleGather(ParamFetcher):
    """FSDP2's fetcher: one all-gather of an FSDP module's chunks in ``param_dtype``; see the
    module docstring for when."""

    coordinator_kind = "fsdp2"
    partition_rule = staticmethod(dim0_partition)  # DTensor's Shard(0): ceil(dim0_i / N) rows
    keeps_persistent = False  # FSDP2 shards every parameter of an FSDP module

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy)
        s = strategy
        self.gather_dtype = s.param_dtype  # the all-gather's and the computation's dtype
        self.released: Any = s.groups[0].xp.empty(0, dtype=s.param_dtype)  # a freed param's data
        self.fsdp_modules: list[FsdpModule] = []  # attach(): the blocks, then the root
        self.forward_order: list[FsdpModule] = []  # post-forward order, this micro-step
        self.keep_after_backward: bool = False  # between micro-batches: reshard_after_backward off
        self.live: int = 0  # bytes of gathered parameters and post-forward pieces
        self.peak_live_bytes: int = 0  # the most ``live`` has been
        # int reshard_after_forward g: the group of g consecutive ranks this rank belongs to
        self.post_forward_comm: Any = None
        if not isinstance(s.reshard_after_forward, bool):
            g = s.reshard_after_forward
            self.post_forward_comm = s.comm.split_by(lambda r: (r // g, r % g), "post_forward")

    def attach(self, model: Any) -> None:
        self.coordinator = self  # the fetcher decides itself; it keeps peak_live_bytes
        s = self.strategy
        self.fsdp_modules = build_fsdp_modules(model, s.reshard_after_forward, s.blocks)
        for mod in self.fsdp_modules:
            m = mod.module
            m.register_forward_pre_hook(lambda _m, args, mod=mod: self.pre_forward(mod, args))
            m.register_forward_hook(lambda _m, args, out, mod=mod: self.post_forward(mod))
            m.register_full_backward_pre_hook(lambda _m, g, mod=mod: self.pre_backward(mod))
            m.register_full_backward_hook(lambda _m, _gi, _go, mod=mod: self.post_backward(mod))

    # -- the hooks ---------------------------------------------------------------------------------
    def pre_forward(self, mod: FsdpModule, args: tuple) -> tuple:
        self.unshard(mod)
        self.wait(mod)
        if self.gather_dtype == self.strategy.dtype:
            return args
        return tuple(
            xp_of(a).astype(a, self.gather_dtype)
            if is_array_api_obj(a) and is_floating(a.dtype)
            else a
            for a in args
        )

    def post_forward(self, mod: FsdpModule) -> None:
        if mod.reshard_after_forward is True:
            self.reshard(mod)
        elif mod.reshard_after_forward is not False:
            self.reshard_to_group(mod)
        mod.post_forward_indices.append(len(self.forward_order))
        self.forward_order.append(mod)

    def pre_backward(self, mod: FsdpModule) -> None:
        """Gather the FSDP module if it was freed, then prefetch the one before it in forward
        order."""
        self.unshard(mod)
        self.wait(mod)
        if mod.post_forward_indices:
            index = mod.post_forward_indices.pop()
            if index > 0:
                self.unshard(self.forward_order[index - 1])

    def post_backward(self, mod: FsdpModule) -> None:
        if not self.keep_after_backward:
            self.reshard(mod)

    # -- the engine's calls ------------------------------------------------------------------------
    def start_backward(self, boundary: bool) -> None:
        """Between micro-batches (not at the boundary) parameters stay gathered when
        ``reshard_after_backward`` is off (torch: ``set_reshard_after_backward(False)``)."""
        self.keep_after_backward = not (boundary or self.strategy.reshard_after_backward)

    def start_micro_step(self) -> None:
        self.forward_order = []
        for mod in self.fsdp_modules:
            mod.post_forward_indices = []

    def end_micro_step(self) -> None:
        """After backward (the reducer is done): every FSDP module freed unless kept for the
        next micro-batch."""
        if not self.keep_after_backward:
            for mod in self.fsdp_modules:
                self.reshard(mod)

    def memory(self) -> dict[str, int]:
        return {"peak_gathered_params": self.peak_live_bytes}

    # -- moving the bytes --------------------------------------------------------------------------
    def unshard(self, mod: FsdpModule) -> None:
        """Start the FSDP module's all-gather (nothing if it is gathered or on its way): this
        rank's chunks end to end in ``param_dtype``, S = Σ chunk_i elements; N·S come back. After
        an int reshard, the gather of the post-forward pieces inside the group of g ranks."""
        if mod.gathered or not mod.params:
            return
        s = self.strategy
        comm, send = s.comm, mod.post_forward_shard
        if send is None:
            where = [s.where[id(p)] for p in mod.params]
            chunks = [s.groups[gi].chunk(i) for gi, i in where]
            sizes = [c.size for c in chunks]
            xp = xp_of(chunks[0])
            send = xp.astype(xp.concat(chunks) if len(chunks) > 1 else chunks[0], self.gather_dtype)
        else:
            comm, sizes = self.post_forward_comm, self.post_forward_chunks(mod)
            mod.post_forward_shard = None
            self.live -= nbytes(send)
        buf = xp_of(send).empty(send.size * comm.size, dtype=self.gather_dtype)
        handle = s.start_or_run(comm.iall_gather, comm.all_gather, buf, send)
        mod.gather = (buf, handle, comm.size, sizes)
        mod.gathered = True
        mod.gathered_nbytes = nbytes(buf)
        self.live += nbytes(buf)
        self.peak_live_bytes = max(self.peak_live_bytes, self.live)

    def wait(self, mod: FsdpModule) -> None:
        """Finish the FSDP module's gather: each parameter cut from the rows (its data a copy)."""
        if mod.gather is None:
            return
        buf, handle, ranks, sizes = mod.gather
        mod.gather = None
        if handle is not None:
            handle.wait()
        xp = xp_of(buf)
        rows = xp.reshape(buf, (ranks, -1))
        column = 0
        for p, chunk in zip(mod.params, sizes, strict=True):
            full = xp.reshape(rows[:, column : column + chunk], (-1,))
            p.data = xp.reshape(full[: p.numel], p.shape)
            column += chunk

    def reshard(self, mod: FsdpModule) -> None:
        """Free the FSDP module's gathered parameters and pieces: only this rank's chunks stay."""
        if mod.post_forward_shard is not None:
            self.live -= nbytes(mod.post_forward_shard)
            mod.post_forward_shard = None
        if not mod.gathered:
            return
        self.wait(mod)
        mod.gathered = False
        self.live -= mod.gathered_nbytes
        for p in mod.params:
            p.data = self.released

    def reshard_to_group(self, mod: FsdpModule) -> None:
        """int reshard_after_forward g: keep this rank's piece of every parameter, ceil(dim0 / g)
        rows cut as the group of g ranks cuts it (zero rows past the end), then free the rest."""
        if not mod.gathered:
            return
        self.wait(mod)
        comm, xp = self.post_forward_comm, xp_of(mod.params[0].data)
        pieces = []
        for p, chunk in zip(mod.params, self.post_forward_chunks(mod), strict=True):
            piece = xp.zeros(chunk, dtype=self.gather_dtype)
            lo = comm.rank * chunk
            valid = max(0, min(chunk, p.numel - lo))
            if valid:
                piece[:valid] = xp.reshape(p.data, (-1,))[lo : lo + valid]
            pieces.append(piece)
        self.reshard(mod)
        mod.post_forward_shard = xp.concat(pieces) if len(pieces) > 1 else pieces[0]
        self.live += nbytes(mod.post_forward_shard)

    def post_forward_chunks(self, mod: FsdpModule) -> list[int]:
        """Each parameter's piece under the group of g ranks: ceil(dim0 / g) rows."""
        shapes = [(str(i), p.shape) for i, p in enumerate(mod.params)]
        return list(dim0_partition(shapes, self.post_forward_comm.size).chunks)
