"""The engine under a real mpirun: every stage equals the single-process run; errors end the job."""

import time

import pytest
from mpi_helpers import run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_stage_matches_single_process_run_under_mpirun(n):
    proc = run_mpi(n, ["tests/helpers/mpi_worker.py", "engine_parity"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("OK rank") == n


def test_bad_config_fails_on_every_rank_and_ends_the_job():
    t0 = time.monotonic()
    proc = run_mpi(3, ["tests/helpers/mpi_worker.py", "engine_config_error"], timeout=120)
    assert proc.returncode != 0 and time.monotonic() - t0 < 60
    assert "ConfigError" in proc.stderr and "train_batch_size" in proc.stderr
    assert "OK rank" not in proc.stdout


def test_a_model_that_differs_across_ranks_ends_the_job_naming_the_parameter():
    t0 = time.monotonic()
    proc = run_mpi(3, ["tests/helpers/mpi_worker.py", "engine_model_differs"], timeout=120)
    assert proc.returncode != 0 and time.monotonic() - t0 < 60
    assert "differs across ranks" in proc.stderr and "layers.0.weight" in proc.stderr
    assert "OK rank" not in proc.stdout
