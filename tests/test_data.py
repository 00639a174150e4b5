"""Tests for zerosim.data: the distributed sampler, the loader, and the datasets."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerosim.data import (
    ArrayDataset,
    CharDataset,
    DataLoader,
    DistributedBatchSampler,
    build_loader,
    load_corpus,
    make_classification,
    make_regression,
)

WORLD_SIZES = [1, 2, 3, 4, 8]


def _samplers(length, micro, world, accum=1, **kw):
    return [
        DistributedBatchSampler(length, micro, world, rank, accum, **kw) for rank in range(world)
    ]


def _indexed_dataset(length):
    """x[i] = (i, 2i), y[i] = i: every batch says which samples it holds."""
    i = np.arange(length)
    return ArrayDataset(np.stack([i, 2 * i], axis=1).astype(np.float64), i)


# -- the split across ranks ---------------------------------------------------------


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("drop_last", [True, False])
def test_ranks_micro_batches_partition_every_global_batch(world, drop_last):
    length, micro, accum = 101, 3, 2  # 101 is prime: no world size divides it
    samplers = _samplers(length, micro, world, accum, seed=7, drop_last=drop_last)
    g = micro * accum * world
    steps = length // g if drop_last else math.ceil(length / g)
    assert samplers[0].steps_per_epoch == steps
    for step in range(steps):
        parts = [s.micro_batch(step, j) for s in samplers for j in range(accum)]
        assert all(len(p) == micro for p in parts)
        union = np.sort(np.concatenate(parts))
        np.testing.assert_array_equal(union, np.sort(samplers[0].global_batch(step)))
    # Over the epoch: with drop_last every index at most once; without, every index
    # at least once and exactly steps·G − length repeats from wrapping around.
    everything = np.concatenate([np.concatenate(list(s)) for s in samplers])
    counts = np.bincount(everything, minlength=length)
    assert counts.sum() == steps * g
    if drop_last:
        assert counts.max() == 1
    else:
        assert counts.min() == 1
        assert (counts - 1).sum() == steps * g - length


@settings(max_examples=60, deadline=None)
@given(
    length=st.integers(1, 200),
    micro=st.integers(1, 5),
    world=st.sampled_from(WORLD_SIZES),
    accum=st.integers(1, 3),
    drop_last=st.booleans(),
)
def test_rank_positions_follow_the_documented_table(length, micro, world, accum, drop_last):
    g = micro * accum * world
    if drop_last and length < g:
        return
    for rank, sampler in enumerate(
        _samplers(length, micro, world, accum, shuffle=False, drop_last=drop_last)
    ):
        batches = np.stack(list(sampler))
        for step in range(sampler.steps_per_epoch):
            for j in range(accum):
                # positions [(j·N + r)·m, (j·N + r + 1)·m) of global batch `step`,
                # wrapped around the dataset when padding (shuffle=False: order = range)
                start = step * g + (j * world + rank) * micro
                expected = np.arange(start, start + micro) % length
                np.testing.assert_array_equal(batches[step * accum + j], expected)
                np.testing.assert_array_equal(sampler.micro_batch(step, j), expected)


@settings(max_examples=40, deadline=None)
@given(
    length=st.integers(8, 150),
    micro=st.integers(1, 4),
    world=st.sampled_from(WORLD_SIZES),
    accum=st.integers(1, 3),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_union_of_ranks_at_micro_step_equals_one_process_with_n_times_the_micro_batch(
    length, micro, world, accum, drop_last, seed
):
    if drop_last and length < micro * accum * world:
        return
    data = _indexed_dataset(length)
    kw = dict(gradient_accumulation_steps=accum, seed=seed, drop_last=drop_last)
    ranks = [list(build_loader(data, micro, world, r, **kw)) for r in range(world)]
    single = list(build_loader(data, micro * world, 1, 0, **kw))
    assert all(len(batches) == len(single) for batches in ranks)
    for t, (x1, y1) in enumerate(single):
        np.testing.assert_array_equal(np.concatenate([b[t][0] for b in ranks]), x1)
        np.testing.assert_array_equal(np.concatenate([b[t][1] for b in ranks]), y1)


def test_order_is_deterministic_from_seed_and_epoch():
    a = DistributedBatchSampler(64, 4, world_size=2, rank=1, seed=3)
    b = DistributedBatchSampler(64, 4, world_size=2, rank=1, seed=3)
    for epoch in range(3):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        np.testing.assert_array_equal(np.stack(list(a)), np.stack(list(b)))
    orders = [a.epoch_order(e) for e in range(3)]
    assert all(np.array_equal(np.sort(o), np.arange(64)) for o in orders)  # permutations
    assert not np.array_equal(orders[0], orders[1])
    assert not np.array_equal(orders[1], orders[2])
    other_seed = DistributedBatchSampler(64, 4, world_size=2, rank=1, seed=4)
    assert not np.array_equal(other_seed.epoch_order(0), orders[0])
    unshuffled = DistributedBatchSampler(64, 4, shuffle=False)
    np.testing.assert_array_equal(unshuffled.epoch_order(5), np.arange(64))


def test_drop_last_false_pads_by_wrapping_to_the_start_of_the_permutation():
    sampler = DistributedBatchSampler(10, 2, world_size=3, seed=1, drop_last=False)
    order = sampler.epoch_order()
    assert sampler.steps_per_epoch == 2 and len(sampler) == 2
    perm = order[:10]
    np.testing.assert_array_equal(np.sort(perm), np.arange(10))
    np.testing.assert_array_equal(order[10:], perm[:2])  # positions 10, 11 → perm[0], perm[1]
    dropped = DistributedBatchSampler(10, 2, world_size=3, seed=1, drop_last=True)
    assert dropped.steps_per_epoch == 1
    np.testing.assert_array_equal(dropped.epoch_order(), perm[:6])


def test_global_batch_larger_than_dataset_wraps_several_times_or_is_rejected():
    sampler = DistributedBatchSampler(3, 4, world_size=2, shuffle=False, drop_last=False)
    np.testing.assert_array_equal(sampler.global_batch(0), [0, 1, 2, 0, 1, 2, 0, 1])
    with pytest.raises(ValueError, match="dataset_len=3 is smaller than the global batch"):
        DistributedBatchSampler(3, 4, world_size=2, drop_last=True)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(rank=4, world_size=4), ValueError, r"rank must be in \[0, world_size=4\), got 4"),
        (dict(rank=-1), ValueError, "rank must be >= 0, got -1"),
        (dict(micro_batch_size=0), ValueError, "micro_batch_size must be >= 1, got 0"),
        (dict(world_size=0), ValueError, "world_size must be >= 1, got 0"),
        (dict(gradient_accumulation_steps=0), ValueError, "gradient_accumulation_steps"),
        (dict(dataset_len=0), ValueError, "dataset_len must be >= 1, got 0"),
        (dict(micro_batch_size=2.0), TypeError, "micro_batch_size must be an int, got 2.0"),
        (dict(seed=-3), ValueError, "seed must be >= 0, got -3"),
    ],
)
def test_sampler_rejects_bad_arguments_naming_them(kwargs, error, match):
    args = dict(dataset_len=32, micro_batch_size=2, world_size=2, rank=0) | kwargs
    with pytest.raises(error, match=match):
        DistributedBatchSampler(**args)


def test_micro_batch_rejects_step_and_micro_step_out_of_range():
    sampler = DistributedBatchSampler(20, 2, gradient_accumulation_steps=2)  # 5 steps
    with pytest.raises(IndexError, match=r"step must be in \[0, 5\), got 5"):
        sampler.micro_batch(5, 0)
    with pytest.raises(IndexError, match="micro_step must be in"):
        sampler.micro_batch(0, 2)


# -- the loader -------------------------------------------------------------------------


def test_loader_yields_dataset_rows_of_the_sampled_indices_and_moves_to_next_epoch():
    data = _indexed_dataset(50)
    loader = build_loader(data, 4, world_size=3, rank=2, gradient_accumulation_steps=2, seed=9)
    assert len(loader) == (50 // 24) * 2
    first = list(loader)
    assert len(first) == len(loader)
    expected = loader.sampler.rank_batches(0)
    for (x, y), idx in zip(first, expected, strict=True):
        np.testing.assert_array_equal(y, idx)
        np.testing.assert_array_equal(x, np.stack([idx, 2 * idx], axis=1))
    assert loader.state_dict() == {
        "epoch": 1,
        "position": 0,
        "batch_start": 0,
        "dataset_len": 50,
        "shuffle": True,
        "seed": 9,
    }
    second = [y for _, y in loader]
    np.testing.assert_array_equal(np.stack(second), loader.sampler.rank_batches(1))
    assert not np.array_equal(np.stack(second), np.stack([y for _, y in first]))


def test_resume_from_state_dict_gives_the_same_remaining_batches():
    data = _indexed_dataset(97)
    make = lambda: build_loader(data, 2, 4, 1, gradient_accumulation_steps=3, seed=5)  # noqa: E731
    loader = make()
    it = iter(loader)
    for _ in range(4):
        next(it)
    state = loader.state_dict()
    # 4 micro-steps of 2·4 samples; the global batch in progress began after 3 (k = 3)
    assert (state["epoch"], state["position"], state["batch_start"]) == (0, 4 * 2 * 4, 3 * 2 * 4)
    rest = [y for _, y in it] + [y for _, y in loader]  # rest of epoch 0, all of epoch 1
    resumed = make()
    resumed.load_state_dict(state)
    again = [y for _, y in resumed] + [y for _, y in resumed]
    assert len(again) == len(rest)
    for a, b in zip(again, rest, strict=True):
        np.testing.assert_array_equal(a, b)


def test_resume_with_another_world_size_continues_at_the_same_sample():
    data = _indexed_dataset(120)
    kw = dict(gradient_accumulation_steps=2, seed=11)
    four = [build_loader(data, 2, 4, r, **kw) for r in range(4)]
    iters = [iter(loader) for loader in four]
    for it in iters:
        for _ in range(3):
            next(it)
    state = four[0].state_dict()
    assert all(loader.state_dict() == state for loader in four)
    rest_four = [[y for _, y in it] for it in iters]
    two = [build_loader(data, 4, 2, r, **kw) for r in range(2)]
    for loader in two:
        loader.load_state_dict(state)
    rest_two = [[y for _, y in loader] for loader in two]
    for t in range(len(rest_four[0])):
        union_four = np.concatenate([rest_four[r][t] for r in range(4)])
        union_two = np.concatenate([rest_two[r][t] for r in range(2)])
        np.testing.assert_array_equal(union_four, union_two)


def _stream_rows(length, seed, epoch, start, micro, world, accum, rank, drop_last):
    """Oracle from the documented definition (not from zerosim.data): rank ``rank``'s index
    arrays for the rest of ``epoch`` when global batches of G = m·k·N are laid from position
    ``start`` of the permutation default_rng((seed, epoch)).permutation(length)."""
    perm = np.random.default_rng((seed, epoch)).permutation(length)
    g = micro * accum * world
    rows, at = [], start
    while at + g <= length or (not drop_last and at < length):
        for j in range(accum):
            first = at + (j * world + rank) * micro
            rows.append(perm[np.arange(first, first + micro) % length])
        at += g
    return rows


def _read(loader, rows):
    """The next ``rows`` index arrays (y of the indexed dataset) this loader yields."""
    it = iter(loader)
    return [next(it)[1] for _ in range(rows)]


@settings(max_examples=60, deadline=None)
@given(
    length=st.integers(30, 160),
    before=st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 3)),
    after=st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 3)),
    steps=st.integers(0, 4),
    drop_last=st.booleans(),
)
def test_resume_at_any_world_size_reads_every_sample_of_the_stream_once(
    length, before, after, steps, drop_last
):
    """Save after ``steps`` global steps with (m, N, k) = ``before``; resume with ``after``:
    the resumed ranks read the rest of the epoch from the saved position on, laid in their
    own global batches, whether or not the position is a multiple of their sizes."""
    (m, n, k), (m2, n2, k2) = before, after
    g, g2 = m * n * k, m2 * n2 * k2
    if drop_last and (length < g or length < g2):
        return
    steps = min(steps, -(-length // g) if not drop_last else length // g)
    data, seed = _indexed_dataset(length), 7
    kw = dict(seed=seed, drop_last=drop_last)
    saving = [build_loader(data, m, n, r, gradient_accumulation_steps=k, **kw) for r in range(n)]
    for r, loader in enumerate(saving):
        got = _read(loader, steps * k)
        want = _stream_rows(length, seed, 0, 0, m, n, k, r, drop_last)[: steps * k]
        np.testing.assert_array_equal(np.reshape(got, (-1, m)), np.reshape(want, (-1, m)))
    state = saving[0].state_dict()
    assert all(loader.state_dict() == state for loader in saving)
    assert state["position"] == state["batch_start"] == steps * g
    for r in range(n2):
        loader = build_loader(data, m2, n2, r, gradient_accumulation_steps=k2, **kw)
        loader.load_state_dict(state)
        want = _stream_rows(length, seed, 0, steps * g, m2, n2, k2, r, drop_last)
        # the rest of epoch 0 (when the saving run read it to its end, iterating would
        # start epoch 1: there is no rest)
        rest = [y for _, y in loader] if want else []
        assert len(rest) == len(want)
        for a, b in zip(rest, want, strict=True):
            np.testing.assert_array_equal(a, b)
        first_of_next = next(iter(loader))[1]  # then epoch 1 from its first position
        want_next = _stream_rows(length, seed, 1, 0, m2, n2, k2, r, drop_last)[0]
        np.testing.assert_array_equal(first_of_next, want_next)


def test_position_that_does_not_divide_the_new_micro_step_starts_a_global_batch_there():
    """The issue's case: 4 ranks × micro-batch 4 saved at position 640; 3 ranks resume."""
    data = _indexed_dataset(1000)
    state = {"epoch": 0, "position": 640, "batch_start": 640, "dataset_len": 1000}
    state |= {"shuffle": True, "seed": 0}
    perm = np.random.default_rng((0, 0)).permutation(1000)
    for r in range(3):
        loader = build_loader(data, 4, world_size=3, rank=r)
        loader.load_state_dict(state)  # 640 = 53·12 + 4: not a multiple of m·N = 12
        first, second = _read(loader, 2)
        np.testing.assert_array_equal(first, perm[640 + 4 * r : 644 + 4 * r])
        np.testing.assert_array_equal(second, perm[652 + 4 * r : 656 + 4 * r])
        assert loader.state_dict()["position"] == 640 + 2 * 12


def test_loader_rejects_bad_state_and_mismatched_dataset():
    loader = build_loader(_indexed_dataset(40), 2, world_size=2, seed=4)  # micro-step = 4
    base = loader.state_dict()
    with pytest.raises(ValueError, match=r"state\['position'\]=6 is 2 samples into the global"):
        loader.load_state_dict({**base, "position": 6, "batch_start": 4})
    with pytest.raises(ValueError, match=r"batch_start'\]=8 must be at most state\['position'\]=4"):
        loader.load_state_dict({**base, "position": 4, "batch_start": 8})
    with pytest.raises(ValueError, match=r"state\['dataset_len'\]=41, but this loader's"):
        loader.load_state_dict({**base, "dataset_len": 41})
    with pytest.raises(ValueError, match=r"state\['seed'\]=5, but this loader's seed is 4"):
        loader.load_state_dict({**base, "seed": 5})
    with pytest.raises(KeyError, match="missing"):
        loader.load_state_dict({"epoch": 0})
    assert loader.state_dict() == base  # nothing changed by the refused states
    loader.load_state_dict({"epoch": 0, "position": 6})  # an older state: a boundary at 6
    assert loader.state_dict()["batch_start"] == 6
    with pytest.raises(ValueError, match="does not match len"):
        DataLoader(_indexed_dataset(41), loader.sampler)


# -- datasets -----------------------------------------------------------------------------


def test_array_dataset_batched_indexing_matches_per_sample_indexing():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(30, 3, 2)), rng.integers(0, 5, size=30)
    ds = ArrayDataset(x, y)
    idx = np.array([4, 0, 29, 4])
    bx, by = ds[idx]
    np.testing.assert_array_equal(bx, np.stack([x[i] for i in idx]))
    np.testing.assert_array_equal(by, [y[i] for i in idx])
    with pytest.raises(IndexError, match=r"in \[0, 30\)"):
        ds[np.array([30])]
    with pytest.raises(ValueError, match="same number of samples"):
        ArrayDataset(x, y[:-1])


def test_make_classification_is_deterministic_and_separable():
    a = make_classification(600, 5, 4, seed=1)
    b = make_classification(600, 5, 4, seed=1)
    c = make_classification(600, 5, 4, seed=2)
    np.testing.assert_array_equal(a.x, b.x)
    np.testing.assert_array_equal(a.y, b.y)
    assert not np.array_equal(a.x, c.x)
    assert a.x.shape == (600, 5) and a.x.dtype == np.float32 and a.y.dtype == np.int64
    assert set(np.unique(a.y)) == {0, 1, 2, 3}
    # nearest class mean (fitted on the first half, scored on the second) beats chance
    centres = np.stack([a.x[:300][a.y[:300] == k].mean(0) for k in range(4)])
    dist = ((a.x[300:, None, :] - centres[None]) ** 2).sum(-1)
    assert (dist.argmin(1) == a.y[300:]).mean() > 0.8


def test_make_regression_is_linear_plus_noise_of_the_requested_size():
    exact = make_regression(200, 6, n_targets=2, noise=0.0, seed=3, dtype="float64")
    assert exact.y.shape == (200, 2)
    design = np.hstack([exact.x, np.ones((200, 1))])
    coef, *_ = np.linalg.lstsq(design, exact.y, rcond=None)
    np.testing.assert_allclose(design @ coef, exact.y, atol=1e-10)
    noisy = make_regression(4000, 6, n_targets=2, noise=0.5, seed=3, dtype="float64")
    design = np.hstack([noisy.x, np.ones((4000, 1))])
    coef, *_ = np.linalg.lstsq(design, noisy.y, rcond=None)
    assert abs((noisy.y - design @ coef).std() - 0.5) < 0.02
    again = make_regression(4000, 6, n_targets=2, noise=0.5, seed=3, dtype="float64")
    np.testing.assert_array_equal(again.y, noisy.y)
    assert not np.array_equal(make_regression(50, 6, seed=4).y, make_regression(50, 6).y)


# -- text ----------------------------------------------------------------------------------


def test_shipped_corpus_is_large_ascii_and_far_from_uniform():
    text = load_corpus()
    assert len(text.encode("utf-8")) >= 60_000
    assert text.isascii()
    ds = CharDataset(block_size=8)
    assert ds.vocab_size == len(set(text))
    # Bigram conditional entropy H(next | previous) in nats, from counts: a character
    # model can learn to that level, far below the uniform guess log(vocab_size).
    v = ds.vocab_size
    pairs = np.bincount(ds.ids[:-1] * v + ds.ids[1:], minlength=v * v).reshape(v, v)
    joint = pairs / pairs.sum()
    cond = pairs / np.maximum(pairs.sum(1, keepdims=True), 1)
    mask = pairs > 0
    bigram_entropy = -(joint[mask] * np.log(cond[mask])).sum()
    assert bigram_entropy < 0.65 * math.log(v)


def test_char_dataset_round_trips_and_shifts_targets_by_one():
    text = "the quick brown fox jumps over the lazy dog, twice: THE END.\n"
    ds = CharDataset(text, block_size=5)
    assert ds.vocab_size == len(set(text))
    assert [ds.itos[ds.stoi[c]] for c in "fox"] == list("fox")
    assert ds.decode(ds.encode(text)) == text
    assert len(ds) == len(text) - 5
    idx = np.array([0, 17, len(ds) - 1])
    x, y = ds[idx]
    assert x.shape == y.shape == (3, 5) and x.dtype == y.dtype == np.int64
    for row, i in enumerate(idx):
        assert ds.decode(x[row]) == text[i : i + 5]
        assert ds.decode(y[row]) == text[i + 1 : i + 6]
    with pytest.raises(IndexError):
        ds[np.array([len(ds)])]
    with pytest.raises(ValueError, match="not in the vocabulary"):
        ds.encode("xyz!")


def test_char_dataset_reads_a_user_file_given_as_path(tmp_path: Path):
    path = tmp_path / "tiny.txt"
    path.write_text("abcabcabd\n", encoding="utf-8")
    for ds in (CharDataset(path, block_size=3), CharDataset.from_file(str(path), block_size=3)):
        assert ds.vocab_size == 5
        assert ds.decode(ds.ids) == "abcabcabd\n"
    with pytest.raises(ValueError, match="block_size=3 needs at least 4"):
        CharDataset("ab", block_size=3)


def test_char_dataset_loads_through_the_distributed_loader():
    ds = CharDataset(block_size=16)
    loader = build_loader(ds, 4, world_size=2, rank=1, seed=0)
    x, y = next(iter(loader))
    assert x.shape == y.shape == (4, 16)
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
