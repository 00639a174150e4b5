"""A nan or an inf gradient never reaches the weights where DeepSpeed 0.19.8 would skip the step
(DESIGN.md invariant 5), and does where it would not: tests/helpers/nonfinite_worker.py says how,
and runs here on a LocalWorld and under mpirun. tests/peer/test_deepspeed_parity.py holds the same
injections to DeepSpeed's own weights, skipped steps, loss scale and collectives."""

from __future__ import annotations

import math

import numpy as np
import pytest
from mpi_helpers import run_mpi
from nonfinite_worker import (
    BAD_STEP,
    PRECISIONS,
    STEPS,
    check_config,
    config,
    deepspeed_skips,
    train,
)

import zerosim as zs


@pytest.mark.parametrize("schedule", ["deepspeed", "paper"])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_nan_or_inf_in_one_ranks_micro_batch_is_skipped_where_deepspeed_skips(
    stage, precision, schedule
):
    """Skipped: the weights equal a clean run that never saw the step, skipped_steps is 1, the
    loss scale and the LR schedule did not move. Not skipped (DeepSpeed's stage 0 in fp32, its
    stages 1-2 in bf16 without check_grad_overflow): the nan reaches the weights there too."""
    skipped = zs.LocalWorld(3).run(check_config, stage, precision, schedule)
    assert skipped == [deepspeed_skips(stage, precision, schedule)] * 3


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_dynamic_loss_scale_after_nan_steps_is_deepspeeds(stage):
    """fp16 from 2**8, a nan at steps 1 and 3. DeepSpeed's stage 0 (FP16_UnfusedOptimizer's
    ``_update_scale``) halves on every skipped step; stages 1-3 (DynamicLossScaler, hysteresis 2
    by default) let the first skip through and halve on the second. bf16: the scale stays 1."""
    fp16 = config(stage, "fp16")
    fp16["fp16"] = {"enabled": True, "initial_scale_power": 8}
    bf16 = config(stage, "bf16")

    def fn(comm):
        every = list(range(STEPS))
        return [train(comm, cfg, every, math.nan, at=(1, 3)) for cfg in (fp16, bf16)]

    want = [256, 128, 128, 64, 64] if stage == 0 else [256, 256, 256, 128, 128]
    for got16, got_bf16 in zs.LocalWorld(2).run(fn):
        assert got16["scales"] == want and got16["skipped"] == [0, 1, 1, 2, 2]
        assert got_bf16["scales"] == [1.0] * STEPS and got_bf16["skipped"] == [0, 1, 1, 2, 2]
        for weights in (got16["weights"], got_bf16["weights"]):
            assert all(np.isfinite(w).all() for w in weights.values())


@pytest.mark.parametrize("stage", [1, 2])
def test_without_a_gradient_norm_only_the_overflow_flag_skips(stage):
    """``zero_optimization.compute_grad_norm: false`` (no clipping): DeepSpeed's stages 1-2 have
    no norm to judge, so in fp32 the nan is stepped into the weights; in bf16 the overflow flag
    still skips, and the reported norm stays None."""

    def fn(comm):
        out = []
        for precision in ("fp32", "bf16"):
            cfg = config(stage, precision, compute_grad_norm=False)
            cfg["gradient_clipping"] = 0.0
            out.append(train(comm, cfg, list(range(STEPS)), math.nan))
        return out

    for fp32, bf16 in zs.LocalWorld(3).run(fn):
        assert fp32["skipped"][-1] == 0
        assert not all(np.isfinite(w).all() for w in fp32["weights"].values())
        assert bf16["skipped"][-1] == 1 and bf16["norms"][BAD_STEP] is None
        assert all(np.isfinite(w).all() for w in bf16["weights"].values())


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("n, schedules", [(3, ["deepspeed"]), (2, ["deepspeed", "paper"])])
def test_every_stage_and_precision_skips_as_deepspeed_under_mpirun(n, schedules):
    """The first test's checks, every stage and precision, on N real processes."""
    proc = run_mpi(n, ["tests/helpers/nonfinite_worker.py", *schedules], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    skips = sum(
        deepspeed_skips(stage, precision, schedule)
        for schedule in schedules
        for stage in (0, 1, 2, 3)
        for precision in PRECISIONS
    )
    for r in range(n):
        assert f"OK rank {r} skipped {skips}" in proc.stdout, proc.stdout[-3000:]
