"""MPIComm under a real mpirun: the same collective checks as LocalWorld, and failure handling."""

import time

import pytest
from mpi_helpers import run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("collectives", ["native", "ring"])
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_every_collective_matches_numpy_and_ledger_formula_under_mpirun(n, collectives):
    proc = run_mpi(n, ["tests/helpers/mpi_worker.py", "collectives", collectives])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("OK rank") == n


def test_exception_on_one_rank_aborts_the_job_quickly_with_its_traceback():
    t0 = time.monotonic()
    proc = run_mpi(3, ["tests/helpers/mpi_worker.py", "raise_on_rank_1"], timeout=60)
    assert time.monotonic() - t0 < 30
    assert proc.returncode != 0
    assert "[zerosim rank 1] uncaught exception" in proc.stderr
    assert "deliberate failure on rank 1" in proc.stderr
    assert "OK rank" not in proc.stdout


def test_mismatched_sizes_are_detected_on_every_rank_under_mpirun():
    proc = run_mpi(3, ["tests/helpers/mpi_worker.py", "mismatched_sizes"], timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ValueError: ranks of group 'world' called different") == 3
