"""``gradient_allreduce_op: "sum"``: the gradients of N ranks are summed, not averaged.

DeepSpeed 0.19.8 (``engine.allreduce_bucket``, ``stage_1_and_2.average_tensor`` and
``gradient_reduction_w_predivide``, with ``gradient_average`` False) then all-reduces or
reduce-scatters each gradient bucket as it is, without the 1/N, the prescale or the predivide
factor, at stages 0-2; it refuses "sum" at stage 3. Each rank's gradient is the mean over its
micro-batch, so the sum over N ranks is N times the mean over the global batch: the oracle is the
single-process run on the same global batches with every step's gradient multiplied by N (before
clipping, which sees the summed gradient). DeepSpeed's own weights are compared in
tests/peer/ (case ``s1_sgd_sum``).
"""

import pytest
from engine_cases import Case, max_rel_error, reference, tolerance, train_on
from mpi_helpers import run_mpi

import zerosim as zs

SUM = {"gradient_allreduce_op": "sum"}
CASES = [
    Case(stage=0, optimizer="sgd", steps=6, accumulation=2),
    Case(stage=1, optimizer="sgd", steps=6),
    Case(stage=1, optimizer="sgd", steps=6, layout="megatron", clip=0.5),
    Case(stage=2, optimizer="sgd", steps=6, accumulation=2, clip=0.05),
    Case(stage=2, optimizer="sgd", steps=6, overlap=False, schedule="paper"),
    Case(stage=2, optimizer="sgd", steps=6, predivide=4.0),  # read, and ignored as in DeepSpeed
    Case(stage=1, optimizer="sgd", steps=6, dtype="float32", prescale=True),
]


def _ids(case: Case) -> str:
    return f"s{case.stage}-{case.layout}-{case.schedule}-k{case.accumulation}-clip{case.clip}"


@pytest.mark.parametrize("case", CASES, ids=[f"{_ids(c)}-{i}" for i, c in enumerate(CASES)])
def test_sum_trains_as_one_process_whose_gradient_is_n_times_the_mean(case):
    n = 3
    with pytest.warns(UserWarning) if case.prescale or case.predivide != 1.0 else _no_warning():
        runs = zs.LocalWorld(n).run(train_on, case, SUM)
    want = reference(case, n, grad_factor=n)
    for rank, run in enumerate(runs):
        assert max_rel_error(run["params"], want) <= tolerance(case), rank
    # the factor matters: the averaged run is far from the summed one
    assert max_rel_error(reference(case, n), want) > 100 * tolerance(case)


def test_sum_sends_the_bytes_mean_sends():
    """Only the scaling changes: the same collectives of the same sizes."""
    case = Case(stage=2, optimizer="sgd", steps=2, accumulation=2)
    summed = zs.LocalWorld(3).run(train_on, case, SUM)
    averaged = zs.LocalWorld(3).run(train_on, case, {"gradient_allreduce_op": "mean"})
    assert [r["bytes"] for r in summed] == [r["bytes"] for r in averaged]


def test_one_rank_sum_is_mean():
    case = Case(stage=2, optimizer="sgd", steps=3)
    (run,) = zs.LocalWorld(1).run(train_on, case, SUM)
    assert max_rel_error(run["params"], reference(case, 1)) <= tolerance(case)


@pytest.mark.mpi
def test_sum_matches_n_times_the_gradient_under_mpirun_on_3_ranks():
    proc = run_mpi(3, ["tests/helpers/mpi_worker.py", "engine_sum"], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("OK rank") == 3


class _no_warning:
    """A context manager that turns a UserWarning into an error."""

    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("error", UserWarning)

    def __exit__(self, *exc):
        return self._catch.__exit__(*exc)
