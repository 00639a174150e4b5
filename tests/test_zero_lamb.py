"""LAMB under ZeRO stages 0-3 equals its single-process run (tests/helpers/zero_lamb_cases.py), in
one process (LocalWorld) and under a real mpirun, with the partial-norm all-reduce counted."""

from __future__ import annotations

import engine_cases
import pytest
import zero_lamb_cases
from engine_cases import Case, build_model
from mpi_helpers import run_mpi

import zerosim as zs
from zerosim.zero import lamb as zero_lamb


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize(
    "variant", zero_lamb_cases.VARIANTS, ids=[str(v) for v in zero_lamb_cases.VARIANTS]
)
def test_lamb_at_every_stage_equals_the_single_process_run(n, variant):
    case = Case(optimizer="lamb", steps=6, **variant)
    errors = zs.LocalWorld(n).run(zero_lamb_cases.check_lamb, case)
    assert max(errors) <= (1e-10 if case.dtype == "float64" else 1e-5)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_without_the_norm_reduction_a_split_parameter_gets_another_trust_ratio(stage, monkeypatch):
    """Each rank's own slice norms in place of the whole parameter's: the run departs from the
    single-process one, so the reduction is what makes LAMB under ZeRO right."""
    monkeypatch.setattr(zero_lamb.LambNorms, "reduce", lambda self, sums: sums)
    case = Case(optimizer="lamb", steps=3, stage=stage, model="mlp")
    outs = zs.LocalWorld(2).run(engine_cases.train, case)
    err = engine_cases.max_rel_error(outs[0]["params"], engine_cases.reference(case, 2))
    assert err > 1e-6


def test_a_parameter_held_whole_by_one_rank_is_not_in_the_message():
    """Stages 1-2 exchange sums only for the parameters a partition boundary cuts."""
    case = Case(optimizer="lamb", stage=2, model="gpt")
    total = len(list(build_model(case).named_parameters()))  # 29, each of 2 or more elements
    assert 0 < zero_lamb_cases.split_parameters(case, 2) <= 2  # one boundary, in 1 or 2 params
    assert zero_lamb_cases.split_parameters(case.with_(stage=3), 2) == total
    assert zero_lamb_cases.split_parameters(case.with_(stage=0), 2) == 0


def test_lamb_with_nvme_optimizer_offload_is_refused(tmp_path):
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Lamb"},
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        },
    }
    with pytest.raises(zs.ConfigError, match="offload_optimizer.device"):
        zs.initialize(zs.nn.MLP([4, 3]), config, comm=zs.LocalWorld(1).comms()[0])


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_lamb_at_every_stage_equals_the_single_process_run_under_mpirun(n):
    proc = run_mpi(n, ["tests/helpers/zero_lamb_cases.py"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("OK rank") == n
