"""Partition math: where each parameter lives in a flat buffer and which rank owns what.

Pure functions and small dataclasses, no communicator, so a notebook can print them.

**DeepSpeed layout** (stages 0-2). The parameters of a group are laid end to end in definition
order; the buffer is padded with zeros to Ψ_pad = ceil(Ψ / (a·N)) · a·N elements, and rank r owns
the contiguous shard [r·P, (r+1)·P) with P = Ψ_pad / N. DeepSpeed 0.19.8 pads to a multiple of 2·N
(a = ``DEEPSPEED_ALIGNMENT``, its ``nccl_start_alignment_factor``: every fp16 shard then starts
4-byte aligned for NCCL), which is what zerosim's "deepspeed" schedule does; the "paper" schedule
pads to N (a = 1). The whole buffer is one partition unit: ``Layout.units == [(0, Ψ_pad)]``.

**Megatron layout** (``zerosim.layout = "megatron"``, Megatron-LM's distributed optimizer). The
parameters are laid in *reverse* definition order (the order backward produces gradients) and cut
into buckets of about ``bucket_size`` elements at parameter boundaries; each bucket is padded to a
multiple of lcm(N, 128) and split evenly: rank r owns [start + r·L, start + (r+1)·L) of every
bucket, L = len / N, ignoring parameter boundaries. Megatron's four range maps per parameter are
given by ``megatron_range_maps``.

Gradient **buckets** for stages 0 and 2 (``reduction_buckets``) are runs of the flat buffer that
one collective reduces; they are built in reverse parameter order so the first bucket completes
first during backward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

DEEPSPEED_ALIGNMENT = 2  # DeepSpeed's nccl_start_alignment_factor: flat buffers pad to 2·N


class Range(NamedTuple):
    """Half-open element range [start, stop)."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    def intersect(self, other: Range) -> Range | None:
        lo, hi = max(self.start, other.start), min(self.stop, other.stop)
        return Range(lo, hi) if lo < hi else None


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in the flat buffer."""

    name: str
    index: int  # position in definition order
    shape: tuple[int, ...]
    range: Range


@dataclass(frozen=True)
class Layout:
    """A flat buffer: parameter slots, total padded size and the partition units.

    Each unit is a range whose length divides by N; rank r owns piece r of every unit.
    """

    slots: tuple[ParamSlot, ...]
    padded_numel: int
    units: tuple[Range, ...]
    world_size: int
    kind: str  # "deepspeed" or "megatron"

    @property
    def numel(self) -> int:
        """Ψ: parameter elements, without padding."""
        return sum(s.range.size for s in self.slots)

    @property
    def shard_numel(self) -> int:
        """Elements each rank owns (the same on every rank)."""
        return self.padded_numel // self.world_size

    def owned_ranges(self, rank: int) -> list[Range]:
        """The flat-buffer ranges ``rank`` owns, one per partition unit."""
        out = []
        for unit in self.units:
            piece = unit.size // self.world_size
            out.append(Range(unit.start + rank * piece, unit.start + (rank + 1) * piece))
        return out


def padded_size(numel: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ≥ numel (at least ``multiple`` when 0)."""
    if multiple < 1:
        raise ValueError(f"multiple must be ≥ 1, got {multiple}")
    return max(1, math.ceil(numel / multiple)) * multiple


def _slots(named_shapes: list[tuple[str, tuple[int, ...]]], order: list[int]) -> list[ParamSlot]:
    slots, offset = [], 0
    for i in order:
        name, shape = named_shapes[i]
        numel = math.prod(shape)
        slots.append(ParamSlot(name, i, tuple(shape), Range(offset, offset + numel)))
        offset += numel
    return slots


def round_robin_order(count: int, world_size: int) -> list[int]:
    """DeepSpeed's ``round_robin_gradients`` order of ``count`` parameters (stage_1_and_2.py,
    ``_round_robin_reorder``): parameter i joins list i mod N; the lists are laid end to end, each
    in definition order (N = 3: 0, 3, 6, …, 1, 4, 7, …, 2, 5, 8, …)."""
    return [i for first in range(min(world_size, count)) for i in range(first, count, world_size)]


def deepspeed_layout(
    named_shapes: list[tuple[str, tuple[int, ...]]],
    world_size: int,
    alignment: int = 1,
    round_robin: bool = False,
) -> Layout:
    """Definition order (``round_robin``: DeepSpeed's ``round_robin_order``), padded to a
    multiple of ``alignment``·N, one contiguous shard per rank (``alignment`` =
    ``DEEPSPEED_ALIGNMENT`` for DeepSpeed's own padding)."""
    count = len(named_shapes)
    order = round_robin_order(count, world_size) if round_robin else list(range(count))
    slots = _slots(named_shapes, order)
    total = slots[-1].range.stop if slots else 0
    padded = padded_size(total, alignment * world_size)
    return Layout(tuple(slots), padded, (Range(0, padded),), world_size, "deepspeed")


def megatron_layout(
    named_shapes: list[tuple[str, tuple[int, ...]]], world_size: int, bucket_size: int
) -> Layout:
    """Reverse order, buckets at parameter boundaries, each padded to lcm(N, 128)."""
    align = math.lcm(world_size, 128)
    slots: list[ParamSlot] = []
    units: list[Range] = []
    offset = bucket_start = 0
    order = list(range(len(named_shapes)))[::-1]
    for k, i in enumerate(order):
        name, shape = named_shapes[i]
        numel = math.prod(shape)
        slots.append(ParamSlot(name, i, tuple(shape), Range(offset, offset + numel)))
        offset += numel
        if offset - bucket_start >= bucket_size or k == len(order) - 1:
            stop = bucket_start + padded_size(offset - bucket_start, align)
            units.append(Range(bucket_start, stop))
            offset = bucket_start = stop
    if not units:
        units.append(Range(0, align))
    return Layout(tuple(slots), units[-1].stop, tuple(units), world_size, "megatron")


@dataclass(frozen=True)
class MegatronRanges:
    """Megatron's four range maps for one parameter and one rank (empty when not owned).

    world: the owned part in the whole grad buffer; world_in_bucket: the same relative to the
    bucket start; local: relative to the rank's shard of the bucket; param: within the parameter.
    """

    world: Range
    world_in_bucket: Range
    local: Range
    param: Range


def megatron_range_maps(layout: Layout, rank: int) -> dict[str, MegatronRanges]:
    """For each parameter that overlaps ``rank``'s shards, Megatron's four ranges."""
    maps = {}
    for unit, owned in zip(layout.units, layout.owned_ranges(rank), strict=True):
        for slot in layout.slots:
            part = slot.range.intersect(owned)
            if part is None:
                continue
            maps[slot.name] = MegatronRanges(
                world=part,
                world_in_bucket=Range(part.start - unit.start, part.stop - unit.start),
                local=Range(part.start - owned.start, part.stop - owned.start),
                param=Range(part.start - slot.range.start, part.stop - slot.range.start),
            )
    return maps


def reduction_buckets(layout: Layout, bucket_size: int, multiple: int = 1) -> list[Range]:
    """Runs of the flat buffer, last parameters first, of about ``bucket_size`` elements.

    Boundaries fall on parameter boundaries rounded up to ``multiple`` (so a bucket's length
    divides by N when ``multiple`` = N); the buckets tile [0, Ψ_pad) exactly, padding included.
    """
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be ≥ 1, got {bucket_size}")
    cuts = {0, layout.padded_numel}
    stop = layout.padded_numel
    for slot in sorted(layout.slots, key=lambda s: s.range.start, reverse=True):
        start = slot.range.start - slot.range.start % multiple
        if stop - start >= bucket_size:
            cuts.add(start)
            stop = start
    edges = sorted(cuts)
    buckets = [Range(a, b) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]
    return buckets[::-1]


def piece_counts(bucket: Range, layout: Layout) -> list[int]:
    """How many elements of ``bucket`` each rank owns (for an uneven reduce-scatter)."""
    owned = [layout.owned_ranges(r) for r in range(layout.world_size)]
    return [
        sum(x.size for o in owned[r] if (x := bucket.intersect(o)) is not None)
        for r in range(layout.world_size)
    ]


@dataclass(frozen=True)
class ParamPartition:
    """Stage 3: every parameter cut into N equal chunks (DeepSpeed's per-parameter partition).

    Parameter i (numel_i elements) is zero-padded to chunk_i · N with chunk_i = ceil(numel_i / N);
    rank r holds elements [r·chunk_i, (r+1)·chunk_i) of it, at ``offsets[i]`` of its shard buffer
    (the concatenation of its chunks of every parameter, P = Σ chunk_i elements). So
    Ψ_pad = N · P = Σ_i ceil(numel_i / N) · N, and gathering parameter i is one even all-gather of
    chunk_i elements per rank straight into the parameter's own padded buffer.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    numels: tuple[int, ...]
    chunks: tuple[int, ...]
    offsets: tuple[int, ...]
    world_size: int

    @property
    def shard_numel(self) -> int:
        return sum(self.chunks)

    @property
    def padded_numel(self) -> int:
        return self.world_size * self.shard_numel

    def valid(self, index: int, rank: int) -> int:
        """How many of rank's chunk_i elements of parameter ``index`` are real (not padding)."""
        return max(0, min(self.chunks[index], self.numels[index] - rank * self.chunks[index]))


def chunk_numel(numel: int, world_size: int) -> int:
    """Elements of each rank's chunk of one parameter at stage 3: ceil(numel / N), at least 1."""
    return max(1, math.ceil(numel / world_size))


def per_param_partition(
    named_shapes: list[tuple[str, tuple[int, ...]]], world_size: int
) -> ParamPartition:
    """DeepSpeed stage 3's partition: each parameter split into N chunks of ceil(numel / N)."""
    numels = [math.prod(shape) for _, shape in named_shapes]
    return partition_of(named_shapes, [chunk_numel(n, world_size) for n in numels], world_size)


def partition_of(
    named_shapes: list[tuple[str, tuple[int, ...]]], chunks: list[int], world_size: int
) -> ParamPartition:
    """The partition that gives parameter i ``chunks[i]`` elements on each rank, end to end."""
    offsets = [sum(chunks[:i]) for i in range(len(chunks))]
    return ParamPartition(
        tuple(n for n, _ in named_shapes),
        tuple(tuple(s) for _, s in named_shapes),
        tuple(math.prod(shape) for _, shape in named_shapes),
        tuple(chunks),
        tuple(offsets),
        world_size,
    )


def dim0_partition(
    named_shapes: list[tuple[str, tuple[int, ...]]], world_size: int
) -> ParamPartition:
    """PyTorch FSDP2's partition (``Shard(0)``, ``_fsdp_param.py``): each parameter cut along its
    first dimension into N chunks of ceil(dim0 / N) rows (torch.chunk's split), every chunk padded
    to that many rows. chunk_i = ceil(dim0_i / N) · numel_i / dim0_i elements; rank r holds the
    rows [r · ceil(dim0 / N), …) that exist, and a rank past the last row holds padding only. A
    1-D parameter is cut as DeepSpeed cuts it; a 2-D one pads whole rows, so Ψ_pad can exceed
    DeepSpeed's Σ ceil(numel_i / N) · N."""
    numels = [math.prod(shape) for _, shape in named_shapes]
    chunks = []
    for (_, shape), numel in zip(named_shapes, numels, strict=True):
        rows = shape[0] if shape else 1
        chunks.append(max(1, math.ceil(rows / world_size)) * (numel // rows if rows else 1))
    return partition_of(named_shapes, chunks, world_size)


def deepspeed_sub_groups(chunks: Sequence[int], sub_group_size: int) -> list[list[int]]:
    """Stage 3: DeepSpeed's sub-groups of one parameter group (``_create_fp16_sub_groups``):
    parameter indices taken in order until their chunks hold ``sub_group_size`` elements or
    more; the whole group when it fits. Each is stepped, and its norm all-reduced, on its own."""
    if sub_group_size >= sum(chunks):
        return [list(range(len(chunks)))]
    groups, current, size = [], [], 0
    for i, chunk in enumerate(chunks):
        current.append(i)
        size += chunk
        if size >= sub_group_size or i == len(chunks) - 1:
            groups.append(current)
            current, size = [], 0
    return groups
