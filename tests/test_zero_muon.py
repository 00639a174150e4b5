"""Muon under ZeRO stages 0-3 equals its single-process oracle (tests/zero_muon_cases.py), in
one process (LocalWorld) and under a real mpirun; what splitting a matrix costs, counted."""

from __future__ import annotations

import math

import engine_cases
import numpy as np
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


def test_a_checkpoint_of_a_muon_engine_is_refused_not_saved_without_its_momentum(tmp_path):
    case = Case(optimizer="muon", stage=2, model="mlp")
    engine, *_ = zs.initialize(
        engine_cases.build_model(case),
        zero_muon_cases.config(case),
        comm=zs.LocalWorld(1).comms()[0],
    )
    with pytest.raises(NotImplementedError, match="momentum"):
        engine.save_checkpoint(tmp_path)
    with pytest.raises(NotImplementedError, match="load_optimizer_states"):
        engine.load_checkpoint(tmp_path)


def expected_muon_memory(case: Case, n: int, rank: int) -> tuple[int, int]:
    """(momentum bytes, copied-gradient bytes) of ``rank``, from the shapes alone: stage 0 every
    matrix; stages 1-2 every matrix overlapping the rank's partition of the Muon group's flat
    buffer (matrices sorted by shape, padded to 2N, P = Ψ_pad/N), whole (DeepSpeed's momentum
    buffer is Σ numel of the partition's parameters), plus the whole gradient of each split one;
    stage 3 the rank's chunks ⌈numel/N⌉."""
    named = engine_cases.build_model(case).named_parameters()
    shapes = sorted(
        (tuple(p.shape) for name, p in named if p.ndim == 2 and "lm_head" not in name),
        reverse=True,
    )
    numels = [math.prod(s) for s in shapes]
    b = np.dtype(case.dtype).itemsize
    if case.stage == 0:
        return sum(numels) * b, 0
    if case.stage == 3:
        return sum(-(-m // n) for m in numels) * b, 0
    total = sum(numels)
    part = -(-total // (2 * n)) * 2 * n // n
    momentum = copies = start = 0
    for m in numels:
        touched = range(start // part, -(-(start + m) // part))
        if rank in touched:
            momentum += m * b
            copies += m * b if len(touched) > 1 else 0
        start += m
    return momentum, copies


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_the_momentum_is_kept_whole_on_every_owner_at_stages_1_2_and_partitioned_at_3(stage, model):
    case = Case(optimizer="muon", steps=1, stage=stage, model=model)
    out = zs.LocalWorld(3).run(zero_muon_cases.train, case)
    for rank in range(3):
        mem = out[rank]["memory"]
        want = expected_muon_memory(case, 3, rank)
        assert (mem["optimizer_state.momentum_buffer"], mem["muon_gradient_copies"]) == want
