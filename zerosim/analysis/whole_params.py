"""What sharding costs an optimizer whose update needs whole parameters: LAMB's norms, Muon's
matrices. Closed forms, held to the ledger by tests/test_analysis_whole_params.py.

ZeRO cuts the flat buffer anywhere, because Adam's update of an element needs that element
only. LAMB needs two norms of each whole parameter; Muon needs each whole matrix. A parameter
that more than one rank holds a piece of is *split* (``split_parameters``): at stage 0 none,
at stages 1-2 those a partition boundary cuts (at most N − 1 per flat buffer), at stage 3 every
parameter of two or more elements (each is cut into N chunks).

**LAMB** (``zerosim/zero/lamb.py``): one all-reduce per step of 2 float64 sums per split
parameter S, phase ``lamb_norms``: 2(N−1)/N · 16·S bytes sent per rank (``lamb_norm_bytes``).
Tiny next to the gradients, but a latency on the step's critical path.

**Muon** (``zerosim/zero/muon.py``, DeepSpeed 0.19.8's semantics). The model is laid out as
two groups (Muon's matrices sorted by shape, then the rest for Adam; ``muon_layout``), each a
flat buffer of its own, and each with a norm all-reduce of its own. Then, per step:

- stage 0: nothing more (each rank holds every matrix);
- stages 1-2: with DeepSpeed's default ``use_multi_rank_bucket_allreduce: true`` every slice is
  all-reduced anyway: nothing more but the second group's norm scalar and padding. With it
  false, a split matrix's slices, which would be reduced to their owner (≈ c bytes from every
  rank but the root), are all-reduced to all its owners (≈ 2(N−1)/N · c);
- stage 3: the step's sub-group loop, phase ``muon`` (``muon_stage3_messages``): for each run
  of matrices, all-gathers of the gradient chunks and of the momentum chunks, then per round of
  N matrices all-gathers of the updates and of the momentums: about 4(N−1)/N · Ψ_muon elements
  sent per rank (``muon_stage3_bytes``), two more all-gathers of the matrices than Adam's step.

``muon_step_bytes`` gives every phase of a Muon step, ``muon_extra_bytes`` the difference from
the same model trained with Adam (one group).

Under optimizer offload DeepSpeed makes the updates another way (``zerosim/zero/muon_offload.py``):
every rank gathers every rank's owned slices of the gradients and momentums, about
2(N−1)/N · Ψ_muon elements sent per rank and step (the gradient alone, half that, in the first
step at stages 1-2): ``muon_offload_bytes``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from zerosim.analysis.volume import (
    boundary_messages,
    clip_bytes,
    deepspeed_padded_numel,
    norm_messages,
    step_bytes,
)


def _prod(shape: Sequence[int]) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def split_parameters(numels: Sequence[int], world_size: int, stage: int) -> list[int]:
    """Indices of the parameters that more than one rank holds a piece of.

    ``numels`` in flat-buffer order (one DeepSpeed flat buffer at stages 1-2: padded to a
    multiple of 2N, partition r = [r·P, (r+1)·P)); at stage 3 each parameter is cut into N
    chunks of ⌈numel/N⌉, so those of 2 or more elements are split.
    """
    n = world_size
    if stage == 0 or n == 1:
        return []
    if stage == 3:
        return [i for i, m in enumerate(numels) if m >= 2]
    part = deepspeed_padded_numel(sum(numels), n) // n
    out, start = [], 0
    for i, m in enumerate(numels):
        if m and -(-(start + m) // part) - start // part > 1:
            out.append(i)
        start += m
    return out


def lamb_norm_bytes(split: int, world_size: int, rank: int) -> int:
    """Bytes ``rank`` sends per step for LAMB's norms: a ring all-reduce of 2·split float64."""
    from zerosim.comm.ring import model_bytes

    return model_bytes("all_reduce", 2 * split, world_size, rank, 8)[0] if split else 0


def muon_layout(shapes: Sequence[Sequence[int]], is_muon: Sequence[bool]) -> list[int]:
    """DeepSpeed's flat order of a Muon model, as model indices: the Muon matrices sorted by
    shape (as tuples, largest first, ties in model order: MuonWithAuxAdam's sort), then the
    others in model order."""
    muon = [i for i, m in enumerate(is_muon) if m]
    muon.sort(key=lambda i: tuple(shapes[i]), reverse=True)
    return muon + [i for i, m in enumerate(is_muon) if not m]


def muon_stage3_messages(
    numels: Sequence[int],
    world_size: int,
    reduce_bucket_size: int = 500_000_000,
    sub_group_size: int = 1_000_000_000,
) -> list[int]:
    """Elements of each all-gather buffer (N × what each rank contributes) of stage 3's Muon
    step, for the Muon group's matrices ``numels`` in flat order.

    Sub-groups as ``norm_messages`` cuts them; each into runs of matrices that stay within
    ``reduce_bucket_size`` elements (at least one a run). A run of chunks L = Σ ⌈numel/N⌉: two
    all-gathers of N·L (gradient, momentum chunks); then per round of up to N of its matrices,
    two of N·w, w the round's largest matrix (updates, momentums; padded where they differ).
    """
    n = world_size
    chunks = [-(-m // n) for m in numels]
    subs: list[list[int]] = []
    if sub_group_size >= sum(chunks):
        subs = [list(range(len(numels)))]
    else:
        current, size = [], 0
        for i, c in enumerate(chunks):
            current.append(i)
            size += c
            if size >= sub_group_size or i == len(chunks) - 1:
                subs.append(current)
                current, size = [], 0
    out = []
    for sub in subs:
        start = 0
        while start < len(sub):
            end, held = start, 0
            while end < len(sub) and (
                end == start or held + numels[sub[end]] <= reduce_bucket_size
            ):
                held += numels[sub[end]]
                end += 1
            run = sub[start:end]
            out += [n * sum(chunks[i] for i in run)] * 2
            for base in range(0, len(run), n):
                width = max(numels[i] for i in run[base : base + n])
                out += [n * width] * 2
            start = end
    return out


def muon_stage3_bytes(numels: Sequence[int], world_size: int, itemsize: int, **cuts: int) -> int:
    """Bytes each rank sends in stage 3's Muon step (phase ``muon``): (N−1)/N of each buffer of
    ``muon_stage3_messages``; ≈ 4(N−1)/N · Ψ_muon · itemsize."""
    n = world_size
    return sum((n - 1) * (m // n) * itemsize for m in muon_stage3_messages(numels, n, **cuts))


MUON_GATHER_BYTES = 64 * 2**20  # DeepSpeed's cap on a Muon all-gather buffer under offload


def muon_offload_messages(
    stage: int,
    numels: Sequence[int],
    world_size: int,
    itemsize: int,
    *,
    first_step: bool = False,
    sub_group_size: int = 1_000_000_000,
) -> list[tuple[int, int]]:
    """(elements of an all-gather buffer (N × what each rank sends), how many such all-gathers
    in a row) of the Muon step under optimizer offload (DeepSpeed's
    ``_apply_muon_updates_cpu_offload``), for the Muon group's matrices ``numels`` in flat
    order; ``itemsize``: the master's bytes per element at stages 1-2 (DeepSpeed's fp32
    partition), the model's at stage 3.

    Stages 1-2: the group's flat buffer padded to a multiple of 2N, rank r owning
    [r·P, (r+1)·P). Matrices in batches of at most B = 64 MiB / (2·itemsize) elements (a larger
    one alone); for a batch, M = the most elements of it any rank owns, k = 1 array on the first
    step (the gradient; the momentum does not exist yet) and 2 after, C = min(M, 64 MiB /
    ((N + 1)·k·itemsize)): ⌈M / C⌉ all-gathers of N·k·C. Stage 3: per sub-group (cut as
    ``norm_messages``), one all-gather of N·2·Σ⌈numel/N⌉ (the gradient and momentum chunks; the
    momentum exists from the start). One rank: none.
    """
    n = world_size
    if n == 1:
        return []
    if stage < 3:
        return _offload_messages12(numels, n, itemsize, 1 if first_step else 2)
    chunks = [-(-m // n) for m in numels]
    if sub_group_size >= sum(chunks):
        return [(n * 2 * sum(chunks), 1)]
    out, held = [], 0
    for i, c in enumerate(chunks):
        held += c
        if held >= sub_group_size or i == len(chunks) - 1:
            out.append((n * 2 * held, 1))
            held = 0
    return out


def _offload_messages12(
    numels: Sequence[int], n: int, itemsize: int, k: int
) -> list[tuple[int, int]]:
    """Stages 1-2 of ``muon_offload_messages``, with k arrays gathered."""
    part = deepspeed_padded_numel(sum(numels), n) // n
    starts = [0, *itertools.accumulate(numels)][: len(numels)]
    cap = max(1, MUON_GATHER_BYTES // (2 * itemsize))
    batches: list[list[int]] = [[]]
    total = 0
    for i, m in enumerate(numels):
        if batches[-1] and total + m > cap:
            batches.append([])
            total = 0
        batches[-1].append(i)
        total += m
    out = []
    for batch in batches:
        owned = [
            sum(
                max(0, min(starts[i] + numels[i], (r + 1) * part) - max(starts[i], r * part))
                for i in batch
            )
            for r in range(n)
        ]
        most = max(owned)
        c = min(most, max(1, MUON_GATHER_BYTES // ((n + 1) * k * itemsize)))
        out.append((n * k * c, -(-most // c)))
    return out


def muon_offload_bytes(
    stage: int, numels: Sequence[int], world_size: int, itemsize: int, **kwargs: Any
) -> int:
    """Bytes each rank sends in the Muon step under optimizer offload (phase ``muon``): (N−1)/N
    of each buffer of ``muon_offload_messages``. Every rank gathers every matrix: about
    2(N−1)/N · Ψ_muon elements a step (stage 3: in the model dtype; stages 1-2: fp32), where
    without offload stages 1-2 send nothing more and stage 3 about twice as much."""
    n = world_size
    messages = muon_offload_messages(stage, numels, n, itemsize, **kwargs)
    return sum(repeats * (n - 1) * (m // n) * itemsize for m, repeats in messages)


def _muon_clip_bytes(
    stage: int,
    numels: list[int],
    groups: list[int],
    world_size: int,
    rank: int,
    clip: float,
    float64: bool,
    sub_group_size: int,
) -> int:
    """Bytes of the gradient-norm all-reduces: one per (sub-)group of the Muon and the other
    parameters (``norm_messages``), none when nothing clips."""
    per_group = [[m for m, g in zip(numels, groups, strict=True) if g == h] for h in (0, 1)]
    per_group = [g for g in per_group if g]
    checks = boundary_messages(stage, schedule="deepspeed", clip=clip, float64=float64)
    if "clip" not in checks:
        return 0
    norms = norm_messages(stage, per_group, world_size, sub_group_size=sub_group_size)
    return norms * clip_bytes(world_size, rank, checks["clip"])


def muon_step_bytes(
    stage: int,
    shapes: Sequence[Sequence[int]],
    is_muon: Sequence[bool],
    world_size: int,
    rank: int,
    itemsize: int,
    *,
    accumulation: int = 1,
    order: Sequence[int] | None = None,
    clip: float = 1.0,
    float64: bool = False,
    reduce_bucket_size: int = 500_000_000,
    sub_group_size: int = 1_000_000_000,
    **switches: object,
) -> dict[str, int]:
    """{phase: bytes ``rank`` sends} in one step of a Muon model under DeepSpeed's schedule.

    Stages 0-2: ``step_bytes`` of the two groups in ``muon_layout`` order, the Muon matrices'
    slices ``copied`` to all their owners; ``order`` is the order backward finishes gradients,
    as model indices. Stage 3: only "muon" (the sub-group loop) and "clip"; the other phases
    are those of the same model under Adam (per-parameter chunks: the split changes nothing
    there). "clip": one norm all-reduce per (sub-)group (``norm_messages``).
    """
    flat = muon_layout(shapes, is_muon)
    numels = [_prod(shapes[i]) for i in flat]
    groups = [0 if is_muon[i] else 1 for i in flat]
    where = {model: at for at, model in enumerate(flat)}
    clip_sent = _muon_clip_bytes(
        stage, numels, groups, world_size, rank, clip, float64, sub_group_size
    )
    if stage == 3:
        muon = [m for m, g in zip(numels, groups, strict=True) if g == 0]
        cuts = {"reduce_bucket_size": reduce_bucket_size, "sub_group_size": sub_group_size}
        return {"clip": clip_sent, "muon": muon_stage3_bytes(muon, world_size, itemsize, **cuts)}
    flat_order = None if order is None else [where[i] for i in order]
    copied = {at for at, g in enumerate(groups) if g == 0}
    phases = step_bytes(
        stage,
        world_size,
        0,
        itemsize,
        accumulation,
        schedule="deepspeed",
        numels=numels,
        rank=rank,
        order=flat_order,
        reduce_bucket_size=reduce_bucket_size,
        groups=groups,
        copied=copied,
        **switches,
    )
    return {"clip": clip_sent, **phases, "muon": 0}


def muon_extra_bytes(
    stage: int,
    shapes: Sequence[Sequence[int]],
    is_muon: Sequence[bool],
    world_size: int,
    rank: int,
    itemsize: int,
    **kwargs: object,
) -> dict[str, int]:
    """{phase: bytes} a Muon step sends beyond the same model's Adam step (one group, no
    copies), per rank: ``muon_step_bytes`` less ``step_bytes``' Adam (stages 0-2); at stage 3
    the ``muon`` phase and the extra norm scalars."""
    muon = muon_step_bytes(stage, shapes, is_muon, world_size, rank, itemsize, **kwargs)
    order = kwargs.pop("order", None)
    clip = kwargs.pop("clip", 1.0)
    float64 = kwargs.pop("float64", False)
    sub_group_size = kwargs.get("sub_group_size", 1_000_000_000)
    numels = [_prod(s) for s in shapes]
    checks = boundary_messages(stage, schedule="deepspeed", clip=clip, float64=float64)
    norms = norm_messages(stage, [numels], world_size, sub_group_size=sub_group_size)  # type: ignore[arg-type]
    adam = {"clip": norms * clip_bytes(world_size, rank, checks["clip"]) if "clip" in checks else 0}
    if stage < 3:
        accumulation = kwargs.pop("accumulation", 1)
        kwargs.pop("sub_group_size", None)
        adam.update(
            step_bytes(
                stage,
                world_size,
                0,
                itemsize,
                accumulation,  # type: ignore[arg-type]
                schedule="deepspeed",
                numels=numels,
                rank=rank,
                order=order,
                **kwargs,
            )
        )
    return {phase: value - adam.get(phase, 0) for phase, value in muon.items()}
