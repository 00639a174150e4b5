"""zerosim/zero/partition.py held to expectations derived without it.

Each expectation comes from elsewhere: element-by-element counting (which rank owns flat element
e: the shard whose [r·P, (r+1)·P) holds it), the closed forms of the module's docstring worked
out by hand, or DeepSpeed 0.19.8's own functions (its alignment padding, its round-robin order, its
stage-3 sub-groups), called on tensors. Hypothesis draws the shapes: odd world sizes, world sizes
larger than the model, empty and one-element parameters.
"""

from __future__ import annotations

import math
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerosim.zero.partition import (
    DEEPSPEED_ALIGNMENT,
    Range,
    chunk_numel,
    deepspeed_layout,
    deepspeed_sub_groups,
    megatron_layout,
    megatron_range_maps,
    padded_size,
    per_param_partition,
    piece_counts,
    reduction_buckets,
    round_robin_order,
)

SHAPE = st.one_of(
    st.tuples(st.integers(1, 40)),
    st.tuples(st.integers(1, 9), st.integers(1, 9)),
    st.just((1,)),
    st.just((0,)),  # an empty parameter (a bias of size 0) takes no element
)
SHAPES = st.lists(SHAPE, min_size=1, max_size=8).map(
    lambda shapes: [(f"p{i}", shape) for i, shape in enumerate(shapes)]
)
WORLD = st.integers(1, 9)  # odd sizes and sizes above Ψ included


def _numels(named_shapes):
    return [math.prod(shape) for _, shape in named_shapes]


def _owner_by_element(layout):
    """For every flat element, the ranks whose owned ranges hold it (counted one by one)."""
    holders = [[] for _ in range(layout.padded_numel)]
    for rank in range(layout.world_size):
        for piece in layout.owned_ranges(rank):
            for e in range(piece.start, piece.stop):
                holders[e].append(rank)
    return holders


# -- padding ------------------------------------------------------------------------------------


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_padded_size_is_the_smallest_multiple_at_or_above(numel, multiple):
    found = padded_size(numel, multiple)
    by_search = next(k for k in range(multiple, numel + 2 * multiple, multiple) if k >= numel)
    assert found == by_search


@pytest.mark.parametrize("multiple", [0, -2])
def test_padded_size_refuses_a_multiple_below_1(multiple):
    with pytest.raises(ValueError, match=f"multiple must be ≥ 1, got {multiple}"):
        padded_size(10, multiple)


def test_deepspeed_pads_to_twice_the_world_size_as_its_alignment_padding_does():
    """DeepSpeed's ``get_alignment_padding`` (stage_1_and_2.py) with alignment
    nccl_start_alignment_factor · N = 2N, on real tensors of the same sizes."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is the oracle (pip install -e '.[test]')")
    torch = pytest.importorskip("torch")
    from deepspeed.runtime.zero.stage_1_and_2 import get_alignment_padding

    for sizes in ([137], [6, 9, 5, 4], [1], [3, 3, 3], [128, 1], [7] * 11):
        tensors = [torch.zeros(n) for n in sizes]
        for n in (1, 2, 3, 4, 5, 7, 8):
            layout = deepspeed_layout(
                [(f"p{i}", (k,)) for i, k in enumerate(sizes)], n, alignment=DEEPSPEED_ALIGNMENT
            )
            padding = get_alignment_padding(tensors, DEEPSPEED_ALIGNMENT * n)
            assert layout.padded_numel == sum(sizes) + padding, (sizes, n)


def test_the_papers_padding_is_to_a_multiple_of_n():
    # Ψ = 137 (MLP 6-9-5-4 with biases): N = 4 → 140, N = 3 → 138, N = 1 → 137
    shapes = [("w", (137,))]
    assert [deepspeed_layout(shapes, n).padded_numel for n in (1, 3, 4, 8)] == [137, 138, 140, 144]
    # DeepSpeed's 2N: N = 4 → 144, N = 3 → 138, N = 1 → 138
    aligned = [deepspeed_layout(shapes, n, alignment=2).padded_numel for n in (1, 3, 4)]
    assert aligned == [138, 138, 144]


# -- DeepSpeed's flat layout (stages 0-2) -------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(SHAPES, WORLD, st.sampled_from([1, DEEPSPEED_ALIGNMENT]))
def test_every_flat_element_is_owned_by_exactly_one_rank(named_shapes, n, alignment):
    layout = deepspeed_layout(named_shapes, n, alignment=alignment)
    psi = sum(_numels(named_shapes))
    assert layout.numel == psi
    assert layout.padded_numel >= psi and layout.padded_numel % (alignment * n) == 0
    assert layout.padded_numel - psi < alignment * n or psi == 0
    assert all(len(h) == 1 for h in _owner_by_element(layout))
    shard = layout.padded_numel // n
    assert layout.shard_numel == shard
    for rank in range(n):  # one contiguous shard per rank, in rank order
        assert layout.owned_ranges(rank) == [Range(rank * shard, (rank + 1) * shard)]


@settings(max_examples=60, deadline=None)
@given(SHAPES, WORLD)
def test_slots_lie_end_to_end_in_definition_order(named_shapes, n):
    layout = deepspeed_layout(named_shapes, n)
    offset = 0
    for i, ((name, shape), slot) in enumerate(zip(named_shapes, layout.slots, strict=True)):
        assert (slot.name, slot.index, slot.shape) == (name, i, shape)
        assert slot.range == Range(offset, offset + math.prod(shape))
        offset += math.prod(shape)


def test_an_empty_model_still_has_one_padded_element_per_rank_and_alignment():
    layout = deepspeed_layout([], 3, alignment=2)
    assert (layout.numel, layout.padded_numel, layout.shard_numel) == (0, 6, 2)
    assert layout.slots == ()


@pytest.mark.parametrize("count, n", [(0, 3), (1, 4), (5, 1), (7, 3), (9, 3), (10, 4), (3, 8)])
def test_round_robin_order_is_deepspeeds(count, n):
    """DeepSpeed's ``_round_robin_reorder`` (stage_1_and_2.py) returns the reordered tensors;
    the order of their original indices is zerosim's order."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is the oracle (pip install -e '.[test]')")
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    reordered, _ = DeepSpeedZeroOptimizer._round_robin_reorder(None, list(range(count)), n)
    assert round_robin_order(count, n) == reordered


def test_round_robin_layout_lays_parameters_in_that_order():
    named = [(f"p{i}", (i + 1,)) for i in range(7)]
    layout = deepspeed_layout(named, 3, round_robin=True)
    assert [s.index for s in layout.slots] == [0, 3, 6, 1, 4, 2, 5]
    starts = [s.range.start for s in layout.slots]
    sizes = [s.range.size for s in layout.slots]
    assert starts == [sum(sizes[:k]) for k in range(7)]


# -- Megatron's layout --------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(SHAPES, WORLD, st.integers(1, 200))
def test_megatron_buckets_are_padded_to_lcm_n_128_and_owned_once(named_shapes, n, bucket_size):
    layout = megatron_layout(named_shapes, n, bucket_size)
    align = math.lcm(n, 128)
    assert [s.index for s in layout.slots] == list(range(len(named_shapes)))[::-1]
    edges = [layout.units[0].start] + [u.stop for u in layout.units]
    assert edges[0] == 0 and edges[-1] == layout.padded_numel
    assert all(a.stop == b.start for a, b in zip(layout.units, layout.units[1:], strict=False))
    assert all(u.size % align == 0 and u.size > 0 for u in layout.units)
    for slot in layout.slots:  # a parameter lies inside one bucket
        assert sum(1 for u in layout.units if slot.range.intersect(u)) <= 1
    assert all(len(h) == 1 for h in _owner_by_element(layout))
    for rank in range(n):  # piece r of every bucket, L = len / N
        want = [
            Range(u.start + rank * u.size // n, u.start + (rank + 1) * u.size // n)
            for u in layout.units
        ]
        assert layout.owned_ranges(rank) == want


def test_megatron_closes_a_bucket_once_it_holds_bucket_size_elements():
    # reverse order: p2 (10), p1 (20), p0 (30); bucket_size 25: [p2, p1] = 30 ≥ 25 closes, pads to
    # 128; p0 starts the next bucket at 128 and is the last: [128, 256)
    layout = megatron_layout([("p0", (30,)), ("p1", (20,)), ("p2", (10,))], 2, 25)
    assert layout.units == (Range(0, 128), Range(128, 256))
    assert [(s.name, s.range) for s in layout.slots] == [
        ("p2", Range(0, 10)),
        ("p1", Range(10, 30)),
        ("p0", Range(128, 158)),
    ]


@settings(max_examples=60, deadline=None)
@given(SHAPES, st.integers(1, 7), st.integers(1, 300))
def test_megatron_range_maps_cover_every_parameter_element_once(named_shapes, n, bucket_size):
    layout = megatron_layout(named_shapes, n, bucket_size)
    covered = {s.name: [0] * s.range.size for s in layout.slots}
    for rank in range(n):
        owned = layout.owned_ranges(rank)
        for name, r in megatron_range_maps(layout, rank).items():
            slot = next(s for s in layout.slots if s.name == name)
            unit, shard = next(
                (u, o) for u, o in zip(layout.units, owned, strict=True) if r.world.intersect(o)
            )
            assert r.world.size == r.world_in_bucket.size == r.local.size == r.param.size > 0
            assert r.world_in_bucket.start == r.world.start - unit.start
            assert r.local.start == r.world.start - shard.start
            assert r.param.start == r.world.start - slot.range.start
            for e in range(r.param.start, r.param.stop):
                covered[name][e] += 1
    assert all(count == 1 for counts in covered.values() for count in counts)


# -- gradient buckets ---------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(SHAPES, WORLD, st.integers(1, 120), st.booleans())
def test_reduction_buckets_tile_the_buffer_last_parameters_first(named_shapes, n, size, by_n):
    layout = deepspeed_layout(named_shapes, n)
    multiple = n if by_n else 1
    buckets = reduction_buckets(layout, size, multiple)
    in_order = buckets[::-1]  # the first bucket reduced holds the last parameters
    assert in_order[0].start == 0 and in_order[-1].stop == layout.padded_numel
    assert all(
        a.stop == b.start and a.size > 0 for a, b in zip(in_order, in_order[1:], strict=False)
    )
    starts = {s.range.start - s.range.start % multiple for s in layout.slots}
    for b in buckets[:-1]:  # every bucket but the one at 0 holds bucket_size or more …
        assert b.size >= size
        assert b.start in starts and b.start % multiple == 0
        # … and is the shortest such run: no parameter start inside it would have done
        assert not any(b.start < s < b.stop and b.stop - s >= size for s in starts)
    if by_n:  # each bucket's length divides by N: an even reduce-scatter
        assert all(b.size % n == 0 for b in buckets)


@pytest.mark.parametrize("bucket_size", [0, -1])
def test_reduction_buckets_refuse_a_size_below_1(bucket_size):
    layout = deepspeed_layout([("w", (8,))], 2)
    with pytest.raises(ValueError, match=f"bucket_size must be ≥ 1, got {bucket_size}"):
        reduction_buckets(layout, bucket_size)


@settings(max_examples=60, deadline=None)
@given(SHAPES, WORLD, st.integers(1, 60))
def test_piece_counts_count_each_ranks_elements_of_a_bucket(named_shapes, n, size):
    layout = deepspeed_layout(named_shapes, n)
    holders = _owner_by_element(layout)
    for bucket in reduction_buckets(layout, size):
        by_count = [0] * n
        for e in range(bucket.start, bucket.stop):
            by_count[holders[e][0]] += 1
        assert piece_counts(bucket, layout) == by_count


# -- stage 3: every parameter cut into N chunks -------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(SHAPES, WORLD)
def test_stage_3_chunks_hold_each_parameter_element_once(named_shapes, n):
    part = per_param_partition(named_shapes, n)
    numels = _numels(named_shapes)
    assert part.numels == tuple(numels)
    for i, numel in enumerate(numels):
        chunk = part.chunks[i]
        # DeepSpeed's _padding_size (partition_parameters.py): pad to a multiple of N, then / N
        pad = (n - numel % n) % n
        assert chunk == ((numel + pad) // n if numel else 1)  # an empty parameter: 1 element
        owners = [0] * numel
        for rank in range(n):  # rank r holds elements [r·chunk, (r+1)·chunk) of the padded one
            real = [e for e in range(rank * chunk, (rank + 1) * chunk) if e < numel]
            assert part.valid(i, rank) == len(real)
            for e in real:
                owners[e] += 1
        assert owners == [1] * numel
    assert part.offsets == tuple(sum(part.chunks[:i]) for i in range(len(numels)))
    assert part.shard_numel == sum(part.chunks)
    assert part.padded_numel == n * sum(part.chunks)


def test_chunk_numel_is_ceil_and_at_least_one():
    assert [chunk_numel(k, 4) for k in (0, 1, 3, 4, 5, 8, 9)] == [1, 1, 1, 1, 2, 2, 3]
    assert chunk_numel(137, 1) == 137


@pytest.mark.parametrize(
    "chunks, size",
    [
        ([5, 5, 5], 100),
        ([5, 5, 5], 15),
        ([5, 5, 5], 10),
        ([4, 7, 1, 9, 2], 8),
        ([3], 1),
        ([1] * 6, 2),
    ],
)
def test_sub_groups_are_deepspeeds(chunks, size):
    """DeepSpeed's ``_create_fp16_sub_groups`` (stage3.py) on stand-ins whose
    ``partition_numel()`` is the chunk."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is the oracle (pip install -e '.[test]')")
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    params = [
        types.SimpleNamespace(index=i, partition_numel=lambda c=c: c) for i, c in enumerate(chunks)
    ]
    optimizer = types.SimpleNamespace(sub_group_size=size)
    groups = DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups(optimizer, params)
    assert deepspeed_sub_groups(chunks, size) == [[p.index for p in g] for g in groups]
