"""Muon under ZeRO stages 0-3 equals its single-process oracle (tests/zero_muon_cases.py), in
one process (LocalWorld) and under a real mpirun; what splitting a matrix costs, counted."""

from __future__ import annotations

import engine_cases
import pytest
import zero_muon_cases
from engine_cases import Case
from mpi_helpers import run_mpi

import zerosim as zs


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize(
    "variant", zero_muon_cases.VARIANTS, ids=[str(v) for v in zero_muon_cases.VARIANTS]
)
def test_muon_at_every_stage_equals_the_single_process_run(n, variant):
    case = Case(optimizer="muon", steps=4, **variant)
    zs.LocalWorld(n).run(zero_muon_cases.check_muon, case)


@pytest.mark.parametrize("stage", [1, 2])
def test_split_matrices_reach_every_owner_when_slices_are_reduced_to_one(stage):
    """use_multi_rank_bucket_allreduce false: each owner's slices are reduced to it, but a
    split Muon matrix's slices are all-reduced, so each of its owners orthogonalizes it."""
    case = Case(optimizer="muon", steps=3, stage=stage, model="gpt", accumulation=2)
    zs.LocalWorld(3).run(zero_muon_cases.check_muon, case, use_multi_rank_bucket_allreduce=False)


def test_the_stage_0_oracle_differs_from_the_zero_oracle_when_clipping_bites():
    """DeepSpeed clips raw gradients at stage 0 and Muon's updates under ZeRO: with a small
    gradient_clipping the two runs really part (so the cases above tell them apart)."""
    case = Case(optimizer="muon", steps=3, model="mlp", clip=0.05)
    zero0 = zero_muon_cases.reference(case.with_(stage=0), 2)
    zero2 = zero_muon_cases.reference(case.with_(stage=2), 2)
    assert engine_cases.max_rel_error(zero0, zero2) > 1e-3


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_muon_at_every_stage_equals_the_single_process_run_under_mpirun(n):
    proc = run_mpi(n, ["tests/zero_muon_cases.py"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("OK rank") == n
