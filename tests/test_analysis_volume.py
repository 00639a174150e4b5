"""zerosim.analysis.volume: the paper's schedule and DeepSpeed's, against numbers written out here
(the measured side is tests/engine_cases.py's check_case, which holds every engine run's ledger
to these formulas, and tests/peer/test_deepspeed_collectives.py, which holds the engine to
DeepSpeed's own comms logger)."""

from __future__ import annotations

import pytest

from zerosim import analysis
from zerosim.analysis import (
    clip_bytes,
    collective_schedule,
    deepspeed_gradient_messages,
    deepspeed_padded_numel,
    deepspeed_stage0_messages,
    step_bytes,
)

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


def test_the_schedule_is_checked():
    with pytest.raises(ValueError, match="schedule must be one of"):
        collective_schedule(1, 8, schedule="megatron")
    with pytest.raises(ValueError, match="needs numels and world_size"):
        collective_schedule(1, 8, schedule="deepspeed")
