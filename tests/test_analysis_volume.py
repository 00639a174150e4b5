"""zerosim.analysis.volume: the paper's schedule and DeepSpeed's, against numbers written out here
(the measured side is tests/helpers/engine_cases.py's check_case, which holds every engine run's
ledger to these formulas, and tests/peer/test_deepspeed_collectives.py, which holds the engine to
DeepSpeed's own comms logger)."""

from __future__ import annotations

import random

import pytest

from zerosim import analysis
from zerosim.analysis import (
    clip_bytes,
    collective_schedule,
    deepspeed_bucketed_step_bytes,
    deepspeed_gradient_messages,
    deepspeed_padded_numel,
    deepspeed_stage0_messages,
    step_bytes,
)
from zerosim.analysis.volume import DEEPSPEED_BUCKET, counted_runs

MLP = [740, 37, 185, 5]  # MLP [20, 37, 5]: Ψ = 967


def test_deepspeed_pads_to_a_multiple_of_2n():
    assert [deepspeed_padded_numel(967, n) for n in (1, 2, 3, 4)] == [968, 968, 972, 968]


def test_deepspeeds_gradient_messages_are_the_ones_its_comms_logger_printed():
    """DeepSpeed 0.19.8, N = 3, stage 2: bucket 5e8 one all-reduce of 967 elements (3868 B);
    bucket 300: 227, 324, 324, 92; the same as reduces to ranks 2, 0, 1, 2 without
    use_multi_rank_bucket_allreduce."""
    assert deepspeed_gradient_messages(MLP, 3) == [("all_reduce", 967, None)]
    small = deepspeed_gradient_messages(MLP, 3, reduce_bucket_size=300)
    assert small == [("all_reduce", m, None) for m in (227, 324, 324, 92)]
    reduce = deepspeed_gradient_messages(
        MLP, 3, reduce_bucket_size=300, use_multi_rank_bucket_allreduce=False
    )
    assert reduce == [("reduce", 227, 2), ("reduce", 324, 0), ("reduce", 324, 1), ("reduce", 92, 2)]
    whole = deepspeed_gradient_messages(MLP, 3, reduce_bucket_size=300, reduce_scatter=False)
    assert whole == [("all_reduce", 227, None), ("all_reduce", 740, None)]


def test_deepspeeds_stage_0_message_is_cut_only_past_5e8_elements():
    assert deepspeed_stage0_messages(MLP) == [967]
    assert deepspeed_stage0_messages([3 * 10**8, 3 * 10**8, 10]) == [6 * 10**8, 10]


def test_paper_step_bytes_are_2_n_minus_1_over_n_psi_pad_at_stages_0_to_2():
    for stage in (0, 1, 2):
        got = step_bytes(stage, 4, 1000, 4)
        assert sum(got.values()) == 2 * 3 * 1000 // 4 * 4
    assert step_bytes(2, 4, 1000, 4, 3) == {"forward": 0, "backward": 9000, "step": 3000}


def test_deepspeeds_stages_1_and_2_cost_3_n_minus_1_over_n_psi_with_its_defaults():
    """Ψ = 1200 on N = 4 (the all-reduce's chunks divide evenly; Ψ_pad = 1200 is a multiple
    of 8): all-reduce 2·3/4·1200, all-gather 3/4·1200, in 4-byte elements."""
    numels = [1000, 200]
    for stage, k in ((1, 1), (1, 3), (2, 1), (2, 3)):
        got = step_bytes(stage, 4, 0, 4, k, schedule="deepspeed", numels=numels)
        reduces = k if stage == 2 else 1
        assert got == {"forward": 0, "backward": reduces * 1800 * 4, "step": 900 * 4}
    assert step_bytes(0, 4, 0, 4, schedule="deepspeed", numels=numels)["backward"] == 1800 * 4


def test_deepspeeds_all_reduce_bytes_follow_the_ring_chunks_on_every_rank():
    """967 elements on N = 3: chunks 323, 322, 322; rank r sends 2·967 − c_r − c_{r+1}."""
    chunks = [323, 322, 322]
    for rank in range(3):
        got = step_bytes(0, 3, 0, 4, schedule="deepspeed", numels=MLP, rank=rank)
        assert got["backward"] == (2 * 967 - chunks[rank] - chunks[(rank + 1) % 3]) * 4


def test_a_reduce_costs_its_buffer_on_every_rank_but_the_root():
    """[5, 6, 5] on N = 2 (Ψ = 16, P = 8), reduced last parameter first: owner runs 1:5, 0:3,
    1:3, 0:5; owner 1 appears first, so a reduce of 8 to rank 1, then one of 8 to rank 0."""
    numels, n = [5, 6, 5], 2
    switches = {"use_multi_rank_bucket_allreduce": False}
    calls = collective_schedule(2, 0, schedule="deepspeed", numels=numels, world_size=n, **switches)
    assert [(c.op, c.elements, c.root) for c in calls] == [
        ("reduce", 8, 1),
        ("reduce", 8, 0),
        ("all_gather", 16, None),
    ]
    for rank in range(n):
        got = step_bytes(2, n, 0, 1, schedule="deepspeed", numels=numels, rank=rank, **switches)
        assert got["backward"] == 8  # the reduce whose root it is not


def test_stage_3_is_the_same_in_both_schedules():
    paper = step_bytes(3, 4, 1000, 4, 2, 200)
    assert step_bytes(3, 4, 1000, 4, 2, 200, schedule="deepspeed") == paper


def test_boundary_messages_and_clip_bytes():
    assert analysis.boundary_messages(2, schedule="paper", precision="fp16") == {
        "clip": 8,
        "overflow": 8,
    }
    assert analysis.boundary_messages(2, schedule="deepspeed", float64=True) == {"clip": 8}
    assert [clip_bytes(4, r, 4) for r in range(4)] == [4, 8, 8, 4]
    # FSDP2 (torch's clip_grad_norm_ on DTensors): no flag, a float32 norm element per parameter
    # and only to clip; a ring all-reduce sends each of its E elements 2(N − 1) times in all
    assert analysis.boundary_messages(3, schedule="fsdp2", clip=0.0) == {}
    assert analysis.boundary_messages(3, schedule="fsdp2", clip=1.0) == {"clip": 4}
    assert analysis.boundary_messages(3, schedule="fsdp2", float64=True) == {"clip": 8}
    assert sum(clip_bytes(3, r, 4, elements=29) for r in range(3)) == 2 * 2 * 29 * 4


def test_the_schedule_is_checked():
    with pytest.raises(ValueError, match="schedule must be one of"):
        collective_schedule(1, 8, schedule="megatron")
    with pytest.raises(ValueError, match="needs numels and world_size"):
        collective_schedule(1, 8, schedule="deepspeed")


# -- sizes far beyond a real model: per bucket size, not per bucket ------------------------------
def test_counted_runs_are_deepspeeds_message_cutting_over_the_repeated_sizes():
    rng = random.Random(0)
    for _ in range(500):
        pairs = [(rng.randint(0, 12), rng.randint(0, 9)) for _ in range(rng.randint(0, 4))]
        limit = rng.randint(1, 30)
        sizes = [size for size, repeats in pairs for _ in range(repeats) if size]
        want: dict[int, int] = {}
        for run in _cut(sizes, limit):
            want[run] = want.get(run, 0) + 1
        assert counted_runs(pairs, limit) == want, (pairs, limit)


def _cut(sizes: list[int], limit: int) -> list[int]:
    """DeepSpeed's cutting written out again: a message closed once it holds more than limit."""
    out, held = [], 0
    for size in sizes:
        held += size
        if held > limit:
            out.append(held)
            held = 0
    return out + ([held] if held else [])


@pytest.mark.parametrize("buckets, rest", [(0, 0), (0, 7), (1, 0), (1, 5), (2, 3), (3, 0), (5, 9)])
def test_bucketed_step_bytes_equal_step_bytes_over_the_listed_buckets(buckets, rest):
    numels = [m for m in [DEEPSPEED_BUCKET] * buckets + [rest] if m]
    psi = sum(numels)
    for stage in (0, 1, 2):
        for n, k in ((1, 1), (2, 3), (3, 1), (8, 2)):
            for rank in sorted({0, n // 2, n - 1}):
                want = step_bytes(stage, n, 0, 4, k, schedule="deepspeed", numels=numels, rank=rank)
                assert deepspeed_bucketed_step_bytes(stage, n, psi, 4, k, rank) == want


def test_bucketed_step_bytes_at_1e18_equal_the_ring_formulas_written_out():
    """Ψ = 10^18 + 1 on N = 3: 2·10^9 buckets of 5e8 (chunks 166,666,667 ×2 and 166,666,666:
    rank 0 sends 2·5e8 − 2·166,666,667 = 666,666,666 elements each) and one of 1 element (rank 0
    holds it, rank 1 none: 2 − 1 − 0 = 1); the all-gather sends 2/3 of Ψ_pad = ⌈Ψ/6⌉·6."""
    psi = 10**18 + 1
    backward = (2 * 10**9 * 666_666_666 + 1) * 2
    gather = 2 * (-(-psi // 6) * 6 // 3) * 2
    got = {s: deepspeed_bucketed_step_bytes(s, 3, psi, 2, accumulation=4) for s in (0, 1, 2)}
    assert got[1] == {"forward": 0, "backward": backward, "step": gather}
    assert got[2] == {"forward": 0, "backward": 4 * backward, "step": gather}
    # stage 0: 10^9 messages of two buckets (chunks 333,333,334 / …33 / …33: rank 0 sends
    # 2·10^9 − 333,333,334 − 333,333,333), then the 1-element rest alone
    pair = 2 * 10**9 - 333_333_334 - 333_333_333
    assert got[0] == {"forward": 0, "backward": (10**9 * pair + 1) * 2, "step": 0}


@pytest.mark.timeout(30)
def test_deepspeed_messages_of_20000_parameters_take_linear_time():
    """Each parameter's offset in its group's buffer is a running sum (it was summed again for
    every parameter: 20,000 of them took minutes)."""
    numels = [1000] * 20_000
    messages = deepspeed_gradient_messages(numels, 8, reduce_bucket_size=10**6)
    assert sum(m for _, m, _ in messages) == sum(numels)


def test_fsdp2_step_bytes_needs_the_group_shards_of_an_int_reshard():
    from zerosim.analysis import fsdp2_step_bytes

    with pytest.raises(ValueError, match="reshard_after_forward=2: an int needs group_shards"):
        fsdp2_step_bytes([10, 4], 4, 2, 4, reshard_after_forward=2)
    # blocks of 10 elements per rank at N = 4 keep 20 per rank in pairs: (2−1)·2 bytes·20 each
    got = fsdp2_step_bytes([10, 4], 4, 2, 4, reshard_after_forward=2, group_shards=[20, 8])
    assert got == {"forward": 3 * 2 * 14, "backward": 1 * 2 * 20 + 3 * 4 * 14, "step": 0}
