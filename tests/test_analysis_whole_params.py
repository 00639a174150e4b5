"""The closed forms of zerosim/analysis/whole_params.py against the ledger of real runs.

Muon and the same model and config under Adam (tests/helpers/zero_muon_cases.py) train on
a LocalWorld; every phase of a Muon step equals ``muon_step_bytes`` (stages 0-2; at stage 3 its
own phase ``muon`` and the norm scalars), and the Muon run's bytes less the Adam run's equal
``muon_extra_bytes``. LAMB's norm all-reduce equals ``lamb_norm_bytes`` of ``split_parameters``,
whose count also equals the one tests/helpers/zero_lamb_cases.py derives on its own. By hand: stage
3's Muon step on N equal matrices sends 4(N−1)/N · Ψ_muon elements.
"""

from __future__ import annotations

import engine_cases
import pytest
import zero_lamb_cases
import zero_muon_cases
from engine_cases import Case

import zerosim as zs
from zerosim.analysis.whole_params import (
    lamb_norm_bytes,
    muon_extra_bytes,
    muon_offload_bytes,
    muon_stage3_bytes,
    muon_step_bytes,
    split_parameters,
)
from zerosim.config.optimizer import uses_muon

CASES = [
    dict(stage=0, model="gpt"),
    dict(stage=1, model="gpt", overlap=False),
    dict(stage=1, model="mlp", bucket=30),
    dict(stage=2, model="gpt", accumulation=2, clip=0.5),
    dict(stage=2, model="mlp", bucket=20),
    dict(stage=3, model="gpt", bucket=200),
    dict(stage=3, model="mlp", sub_group_size=40),
]
SWITCHES = [{}, {"use_multi_rank_bucket_allreduce": False}]


def model_layout(case: Case) -> tuple[list, list]:
    named = list(engine_cases.build_model(case).named_parameters())
    return [p.shape for _, p in named], [uses_muon(n, p.shape) for n, p in named]


def formula_kwargs(case: Case, zero: dict) -> dict:
    kwargs = dict(
        accumulation=case.accumulation,
        clip=case.clip,
        float64=case.dtype == "float64",
        reduce_bucket_size=case.bucket,
        sub_group_size=case.sub_group_size,
    )
    if case.stage in (1, 2):
        grad_order = case.stage == 2 or case.overlap
        kwargs["order"] = engine_cases.gradient_order(case) if grad_order else None
        kwargs["overlap_comm"] = case.overlap
        kwargs.update(zero)
    return kwargs


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("zero", SWITCHES, ids=["allreduce", "reduce"])
@pytest.mark.parametrize("variant", CASES, ids=[str(c) for c in CASES])
def test_muon_bytes_equal_their_closed_forms(variant, zero, n):
    if zero and variant["stage"] not in (1, 2):
        pytest.skip("use_multi_rank_bucket_allreduce is read at stages 1-2")
    case = Case(optimizer="muon", steps=2, **variant)
    muon = zs.LocalWorld(n).run(zero_muon_cases.train, case, **zero)
    adam_case = case.with_(optimizer="adam")
    adam = zs.LocalWorld(n).run(zero_muon_cases.train, adam_case, **zero)  # same config
    shapes, is_muon = model_layout(case)
    kwargs = formula_kwargs(case, zero)
    for rank in range(n):
        want = muon_step_bytes(case.stage, shapes, is_muon, n, rank, 8, **dict(kwargs))
        extra = muon_extra_bytes(case.stage, shapes, is_muon, n, rank, 8, **dict(kwargs))
        for step in range(case.steps):
            got = muon[rank]["bytes"][step]
            for phase, value in want.items():
                assert got[phase] == value, (rank, step, phase, got, want)
            base = adam[rank]["bytes"][step]
            for phase, value in extra.items():
                if phase == "muon" or case.stage < 3 or phase == "clip":
                    assert got[phase] - base.get(phase, 0) == value, (rank, phase, got, base)
        if zero:  # split matrices all-reduced where their slices would be reduced to one
            assert extra["backward"] > 0, extra
    if case.stage == 3:
        assert extra["muon"] > 0 and extra["clip"] >= 0
    if case.stage == 0:
        assert all(v == 0 for v in extra.values()), extra


def test_stage_3_muon_sends_four_times_the_matrices_on_equal_matrices():
    """N equal matrices of m elements (N | m): one run, one round. Each rank sends (N−1)/N of
    each all-gather's buffer: gradient chunks and momentum chunks (N·m each: the run's whole
    matrices), then updates and momentums (N·m each): 4 · (N−1)/N · N·m = 4(N−1)/N · Ψ_muon."""
    for n in (2, 3, 4):
        m = 12 * n
        numels = [m] * n
        psi = sum(numels)
        assert muon_stage3_bytes(numels, n, itemsize=1) == 4 * (n - 1) * psi // n


@pytest.mark.parametrize("variant", zero_lamb_cases.VARIANTS, ids=str)
@pytest.mark.parametrize("n", [2, 3])
def test_lamb_norm_bytes_count_the_split_parameters(variant, n):
    case = Case(optimizer="lamb", **variant)
    numels = [p.numel for _, p in engine_cases.build_model(case).named_parameters()]
    split = split_parameters(numels, n, case.stage)
    assert len(split) == zero_lamb_cases.split_parameters(case, n)
    out = zs.LocalWorld(n).run(engine_cases.train, case.with_(steps=2))
    for rank in range(n):
        want = lamb_norm_bytes(len(split), n, rank)
        assert out[rank]["lamb_norm_bytes"] == [want, want]
        if split:  # ≈ 2(N−1)/N · 16 bytes per split parameter, within a chunk's rounding
            assert abs(want - 2 * (n - 1) / n * 16 * len(split)) <= 16


@pytest.mark.timeout(30)
def test_muon_offload_bytes_of_a_matrix_of_2e17_elements_count_its_gathers_without_listing_them():
    """One matrix of M = 2·10^17 elements on N = 2 (each rank owns 10^17), fp32, after the first
    step (k = 2): C = 64 MiB / ((N + 1)·k·4) = 2,796,202 elements, ⌈10^17 / C⌉ all-gathers of
    N·k·C, each rank sending half of each (a list of them would not fit in memory)."""
    c = 64 * 2**20 // (3 * 2 * 4)
    gathers = -(-(10**17) // c)
    assert muon_offload_bytes(1, [2 * 10**17], 2, 4) == gathers * (2 * 2 * c // 2) * 4
