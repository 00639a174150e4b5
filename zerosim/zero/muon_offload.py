"""Muon under optimizer offload, as DeepSpeed 0.19.8 runs it: what changes from ``zero/muon.py``.

With ``offload_optimizer`` (``cpu`` at stages 1-3, ``nvme`` at stage 3) DeepSpeed makes Muon's
updates in its own way (``_apply_muon_updates_cpu_offload`` in ``stage_1_and_2.py`` and in
``stage3.py``), just before the gradient norm, when the step survived the overflow check:

* **Every rank orthogonalizes every matrix.** Each rank owns slices of the Muon matrices (its
  partition); one all-gather of every rank's owned slices of the gradients, and of the
  momentum, gives every rank every whole matrix; each runs Newton–Schulz on all of them and
  keeps the slice of the update, and of the new momentum, it owns. Without offload, by contrast,
  only a split matrix's owners get it (stages 1-2) or rank r takes matrix r of a round (stage 3).
* **The momentum is partitioned as the parameters are.** A rank keeps the momentum of the
  elements it owns (stages 1-2: a slice of each matrix, in the master dtype, fp32; stage 3: its
  chunks, in ``communication_data_type``), not whole matrices.
* **The gradients are unscaled first** (divided by the loss scale; Newton–Schulz would drop the
  scale anyway, the momentum would not).

Stages 1-2 gather per batch of matrices (at most 64 MiB / (2·b) elements, b the master's bytes
per element; a larger matrix alone), each batch in chunks of C = min(M, 64 MiB / ((N + 1)·k·b))
elements a rank, M the most elements any rank owns of the batch, k the arrays gathered: the
gradient alone in the first step (the momentum does not exist yet: DeepSpeed creates it zeroed
there, with nothing to gather), gradient and momentum after. One all-gather of k·C elements a
rank per chunk. The split matrices' slices are still all-reduced to all their owners in the
backward pass (DeepSpeed's bucket plan does not look at offload); the copies go unused.

Stage 3 gathers per ``sub_group_size`` sub-group: one all-gather of the rank's chunks of every
matrix of the sub-group, gradients then momentums (k = 2 from the first step: DeepSpeed creates
the momentum with the sub-group), in the model dtype (its ``gradient_accumulation_dtype``).
Under ``nvme`` the momentum lives in a swap file beside the sub-group's optimizer states, read
and written around the update, unless ``save_muon_momentum_buffer_in_memory`` keeps it in
host memory.

The update carries no loss scale here either (``MuonUpdates.lacks_scale``): DeepSpeed scales it
up and its unscale divides the scale out again, the same numbers for a power-of-two scale. Its
fp32 update goes into an fp32 gradient; zerosim writes it into the gradient storage, of the model
dtype, so under bf16 / fp16 the update is rounded to it (docs/config.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zerosim.backend import flat, move_like, to_host
from zerosim.zero.partition import deepspeed_sub_groups

BATCH_BYTES = 64 * 2**20  # DeepSpeed's _muon_allgather_max_buffer_bytes


def batches(numels: list[int], itemsize: int) -> list[list[int]]:
    """Indices of the matrices of each gather batch (``_muon_param_batches``): taken in order
    until the next would pass 64 MiB / (2·itemsize) elements; a larger one alone."""
    cap = max(1, BATCH_BYTES // (2 * itemsize))
    out: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, numel in enumerate(numels):
        if current and total + numel > cap:
            out.append(current)
            current, total = [], 0
        current.append(i)
        total += numel
    return [*out, current] if current else out


def chunk_numel(rank_numels: list[int], world: int, arrays: int, itemsize: int) -> int:
    """Elements a rank sends per all-gather of a batch (``_muon_all_gather_partitions``)."""
    most = max(rank_numels)
    return min(most, max(1, BATCH_BYTES // ((world + 1) * arrays * itemsize)))


class OffloadedMuon:
    """The updates of one strategy's Muon matrices under optimizer offload (module docstring)."""

    def __init__(self, muon: Any) -> None:
        self.muon: Any = muon  # the matrices (zero/muon.py) whose updates are made here
        # stage 3 creates the momentum with the sub-group; stages 1-2 at the first update
        self.momentum_exists: bool = muon.chunked

    def make_updates(self, inv_scale: float) -> None:
        if self.muon.chunked:  # stage 3: every parameter cut into N chunks
            self._stage3(inv_scale)
        else:
            self._stages12(inv_scale)
        self.momentum_exists = True

    # -- stages 1-2 -------------------------------------------------------------------------------
    def _stages12(self, inv_scale: float) -> None:
        mu, s = self.muon, self.muon.strategy
        dtype = np.dtype(mu.momentum_dtype)  # the master's: DeepSpeed's fp32 partition
        for gi in mu.groups:
            g = s.groups[gi]
            matrices = [m for m in mu.matrices if m.group == gi]
            for batch in batches([m.numel for m in matrices], dtype.itemsize):
                members = [matrices[i] for i in batch]
                grads, moms = self._gather12(g, members, dtype)
                for m, grad, mom in zip(members, grads, moms, strict=True):
                    grad *= inv_scale
                    mom = g.xp.reshape(mom, m.shape)  # a view: updated in place
                    update = flat(mu.update(gi, g.xp.reshape(grad, m.shape), mom))
                    if m.span is None:
                        continue  # this rank owns no slice of it
                    a, b = m.span
                    view = s.grad_view(g, mu.owned_parts(m)[0])
                    view[...] = g.xp.astype(update[a:b], view.dtype)
                    m.momentum[...] = to_host(flat(mom)[a:b])  # host memory

    def _gather12(self, g: Any, members: list[Any], dtype: np.dtype) -> tuple[list, list]:
        """Every member's whole gradient and momentum (zeros before the first update), from
        every rank's owned slices, in chunks (module docstring)."""
        mu = self.muon
        n, rank, xp = mu.comm.size, mu.comm.rank, g.xp
        arrays = 2 if self.momentum_exists else 1
        # per rank, the slices it owns: (member, start in the matrix, start in the packing, size)
        slices: list[list[tuple[int, int, int, int]]] = [[] for _ in range(n)]
        packed = [0] * n
        for k, m in enumerate(members):
            for r, (a, b) in sorted(m.spans.items()):
                slices[r].append((k, a, packed[r], b - a))
                packed[r] += b - a
        grads = [xp.zeros(m.numel, dtype=dtype) for m in members]
        moms = [xp.zeros(m.numel, dtype=dtype) for m in members]
        mine = []  # this rank's (gradient, momentum) slices, in packing order
        for k, *_ in slices[rank]:
            m = members[k]
            view = mu.strategy.grad_view(g, mu.owned_parts(m)[0])
            mine.append((xp.astype(view, dtype), move_like(m.momentum, view)))
        if n == 1:  # DeepSpeed gathers nothing on one rank
            for (k, a, _, size), (grad, mom) in zip(slices[rank], mine, strict=True):
                grads[k][a : a + size] = grad
                moms[k][a : a + size] = mom
            return grads, moms
        chunk = chunk_numel(packed, n, arrays, dtype.itemsize)
        local = xp.empty(arrays * chunk, dtype=dtype)
        out = xp.empty(n * local.size, dtype=dtype)
        for lo in range(0, max(packed), chunk):
            hi = lo + chunk
            local[...] = 0
            for (_, _, at, size), sources in zip(slices[rank], mine, strict=True):
                a, b = max(lo, at), min(hi, at + size)
                for j, source in enumerate(sources[:arrays]):
                    if a < b:
                        local[j * chunk + a - lo : j * chunk + b - lo] = source[a - at : b - at]
            with mu.comm.phase(mu.PHASE):
                mu.comm.all_gather(out, local)
            for r in range(n):
                for k, start, at, size in slices[r]:
                    a, b = max(lo, at), min(hi, at + size)
                    if a >= b:
                        continue
                    for j, target in enumerate((grads, moms)[:arrays]):
                        src = r * local.size + j * chunk + a - lo
                        target[k][start + a - at : start + b - at] = out[src : src + b - a]
        return grads, moms

    # -- stage 3 ----------------------------------------------------------------------------------
    def _stage3(self, inv_scale: float) -> None:
        mu, s = self.muon, self.muon.strategy
        rank = mu.comm.rank
        for gi in mu.groups:
            g = s.groups[gi]
            part, momentum = g.partition, mu.momentum3[gi]
            for sub in deepspeed_sub_groups(part.chunks, s.zero.sub_group_size):
                spans = [(part.offsets[i], part.offsets[i] + part.chunks[i]) for i in sub]
                rows = self._gather3(g, spans, momentum)
                half, at = rows.shape[1] // 2, 0
                for i, (a, b) in zip(sub, spans, strict=True):
                    c, numel, shape = part.chunks[i], part.numels[i], part.shapes[i]
                    grad = flat(rows[:, at : at + c])[:numel] * inv_scale
                    mom = g.xp.reshape(flat(rows[:, half + at : half + at + c])[:numel], shape)
                    update = flat(mu.update(gi, g.xp.reshape(grad, shape), mom))
                    own, valid = rank * c, part.valid(i, rank)
                    padded = g.xp.zeros(c, dtype=g.grad_shard.dtype)  # DeepSpeed's zero padding
                    padded[:valid] = g.xp.astype(update[own : own + valid], g.grad_shard.dtype)
                    g.grad_shard[a:b] = padded
                    kept = np.zeros(c, dtype=momentum.dtype)  # host memory (or its file)
                    kept[:valid] = to_host(flat(mom)[own : own + valid])
                    momentum[a:b] = kept
                    at += c
                if mu.momentum_on_nvme:  # the sub-group's momentum written back to its file
                    s.offload.optimizer_store.bytes_written += self._nbytes(spans, momentum)

    def _gather3(self, g: Any, spans: list[tuple[int, int]], momentum: Any) -> Any:
        """(N, 2·L): every rank's chunks of a sub-group's matrices, gradients then momentums,
        in the model dtype (DeepSpeed's ``gradient_accumulation_dtype``), one row a rank."""
        mu, s = self.muon, self.muon.strategy
        xp, n = g.xp, mu.comm.size
        if mu.momentum_on_nvme:  # the sub-group's momentum read from its file
            s.offload.optimizer_store.bytes_read += self._nbytes(spans, momentum)
        grads = [xp.astype(g.grad_shard[a:b], s.dtype) for a, b in spans]
        moms = [xp.astype(move_like(momentum[a:b], g.grad_shard), s.dtype) for a, b in spans]
        local = xp.concat(grads + moms)
        gathered = xp.empty(n * local.size, dtype=local.dtype)
        if n == 1:  # DeepSpeed gathers nothing on one rank
            gathered[...] = local
        else:
            with mu.comm.phase(mu.PHASE):
                mu.comm.all_gather(gathered, local)
        return xp.reshape(gathered, (n, local.size))

    @staticmethod
    def _nbytes(spans: list[tuple[int, int]], momentum: Any) -> int:
        return sum(b - a for a, b in spans) * momentum.dtype.itemsize
