"""What the mpirun tests launch: ``mpirun -n N python tests/helpers/mpi_worker.py CHECK [ARGS]``.

Each check runs on an ``MPIComm`` over COMM_WORLD; an assertion error on any rank aborts the job
(zerosim's abort hook), so the launching test sees a non-zero exit code and the rank's traceback.
"""

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import collective_checks  # noqa: E402

from zerosim.comm import MPIComm  # noqa: E402


def collectives(comm, mode):
    comm.collectives = mode
    checked = collective_checks.check_all_collectives(comm)
    collective_checks.check_in_place_all_gather(comm)
    collective_checks.check_split(comm)
    collective_checks.check_in_place_reduce_scatter(comm)
    collective_checks.check_reduce_scatter_v(comm)
    return checked


def raise_on_rank_1(comm):
    """Rank 1 fails while every other rank waits in an all-reduce that can never complete."""
    if comm.rank == 1:
        time.sleep(0.5)
        raise ValueError("deliberate failure on rank 1")
    comm.all_reduce(np.ones(4))
    return 0


def mismatched_sizes(comm):
    """Rank 0 passes a different size: every rank must get the same ValueError, no hang."""
    inp = np.ones(3 if comm.rank == 0 else 4)
    out = np.empty(comm.size * inp.size)
    try:
        comm.all_gather(out, inp)
    except ValueError as err:
        n = comm.size
        assert f"rank 0: all_gather(count={3 * n}" in str(err), err
        assert f"rank 1: all_gather(count={4 * n}" in str(err), err
        print(f"rank {comm.rank}: ValueError: {err}", flush=True)
        return 1
    raise AssertionError("mismatched sizes were not detected")


def engine_parity(comm):
    """Every stage and layout against the single-process run, with bytes and memory checks."""
    import engine_cases

    worst = 0.0
    variants = [
        dict(stage=0, model="gpt", accumulation=3, clip=0.5),
        dict(stage=1, model="mlp", optimizer="sgd"),
        dict(stage=2, model="gpt", accumulation=3, clip=0.05, overlap=True),
        dict(stage=2, model="mlp", overlap=False, collectives="ring"),
        dict(stage=1, layout="megatron", model="gpt", clip=1.0),
        dict(stage=2, model="mlp", dtype="float32", accumulation=3),
        dict(stage=3, model="gpt", accumulation=3, clip=0.5),
        dict(stage=3, model="mlp", persistence=40, overlap=False),
        dict(stage=3, model="gpt", prefetch=200, max_live=400, optimizer="sgd"),
        dict(stage=3, model="mlp", reuse=10**9, accumulation=3),
    ]
    for variant in variants:
        case = engine_cases.Case(steps=10, **variant)
        worst = max(worst, engine_cases.check_case(comm, case))
    return worst


# every stage, both layouts, accumulation, clipping, SGD and Adam: the device backends' cases
DEVICE_VARIANTS = [
    dict(stage=0, model="gpt", accumulation=2, clip=0.5),
    dict(stage=1, model="mlp", optimizer="sgd"),
    dict(stage=1, model="gpt", layout="megatron", clip=1.0),
    dict(stage=2, model="gpt", accumulation=2, clip=0.05),
    dict(stage=3, model="gpt", accumulation=2, clip=0.5),
    dict(stage=3, model="mlp", persistence=40, overlap=False),
]


def array_api_parity(comm):
    """Every stage on array_api_strict's non-host device against the NumPy run (same process)."""
    import engine_cases

    worst = 0.0
    for variant in DEVICE_VARIANTS:
        case = engine_cases.Case(steps=3, **variant)
        want = engine_cases.train_on(comm, case)["params"]
        got = engine_cases.train_on(comm, case.with_(backend="array_api_strict"))["params"]
        worst = max(worst, max(float(np.max(np.abs(got[k] - want[k]))) for k in want))
        # MPI reads host memory only: the device arrays were staged, the host scalars were not
        routes = {r.transport for r in comm.ledger.records}
        assert routes == {"staged", "host"}, routes
    return worst


def device_parity(comm, backend, dtype):
    """Every stage on a device backend (``cupy``; ``array_api_strict`` runs the same code on the
    host) in ``dtype`` against the NumPy float64 run. Returns, per case, the device run's largest
    difference from that run and the NumPy run's in ``dtype`` (float32 rounding: what the device
    is judged against; 0 for float64), as ``device/host`` pairs, then the routes the device runs'
    collectives took (comm/cuda.py)."""
    import engine_cases

    pairs, routes = [], set()
    for variant in DEVICE_VARIANTS:
        case = engine_cases.Case(steps=3, **variant)
        reference = engine_cases.train_on(comm, case)["params"]
        host = engine_cases.train_on(comm, case.with_(dtype=dtype))["params"]
        device = engine_cases.train_on(comm, case.with_(dtype=dtype, backend=backend))["params"]
        routes |= {r.transport for r in comm.ledger.records}  # the device run's calls
        pairs.append(
            f"{_largest_difference(device, reference)}/{_largest_difference(host, reference)}"
        )
    return f"{','.join(pairs)} {','.join(sorted(routes))}"


def _largest_difference(got, want):
    return max(float(np.max(np.abs(got[k].astype(np.float64) - want[k]))) for k in want)


def gpu_transport(comm):
    """An all-reduce and an all-gather of CuPy arrays; returns the transport the ledger names."""
    import cupy

    from zerosim.backend import local_rank

    cupy.cuda.Device(local_rank() % cupy.cuda.runtime.getDeviceCount()).use()  # one GPU a rank
    buf = cupy.full(1000, float(comm.rank + 1))
    comm.all_reduce(buf)
    assert float(buf[0]) == comm.size * (comm.size + 1) / 2
    out = cupy.empty(2 * comm.size)
    comm.all_gather(out, cupy.full(2, float(comm.rank)))
    assert cupy.asnumpy(out).tolist() == [float(r) for r in range(comm.size) for _ in (0, 1)]
    (route,) = {r.transport for r in comm.ledger.records}
    return route


def engine_config_error(comm):
    """A bad config: every rank raises ConfigError before building anything; the job aborts."""
    from zerosim.engine import initialize
    from zerosim.nn import MLP

    initialize(
        MLP([4, 3]),
        {
            "train_batch_size": 7,
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        },
        comm=comm,
    )


def engine_model_differs(comm):
    """Rank 1 builds another model: every rank raises naming the parameter; the job aborts."""
    from zerosim.engine import initialize
    from zerosim.nn import MLP

    model = MLP([4, 5 if comm.rank == 1 else 3, 2], seed=0)
    initialize(
        model,
        {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
        comm=comm,
    )


def engine_sum(comm):
    """gradient_allreduce_op "sum" at stages 0-2: the single-process run with N times the
    gradient (tests/test_gradient_allreduce_op.py)."""
    import engine_cases

    worst = 0.0
    for variant in (dict(stage=0), dict(stage=1, accumulation=2), dict(stage=2, clip=0.05)):
        case = engine_cases.Case(optimizer="sgd", steps=6, **variant)
        out = engine_cases.train_on(comm, case, {"gradient_allreduce_op": "sum"})
        want = engine_cases.reference(case, comm.size, grad_factor=comm.size)
        err = engine_cases.max_rel_error(out["params"], want)
        assert err <= engine_cases.tolerance(case), (case, err)
        worst = max(worst, err)
    return worst


CHECKS = {
    "engine_sum": engine_sum,
    "engine_model_differs": engine_model_differs,
    "engine_parity": engine_parity,
    "array_api_parity": array_api_parity,
    "device_parity": device_parity,
    "gpu_transport": gpu_transport,
    "engine_config_error": engine_config_error,
    "collectives": collectives,
    "raise_on_rank_1": raise_on_rank_1,
    "mismatched_sizes": mismatched_sizes,
}

if __name__ == "__main__":
    comm = MPIComm()
    result = CHECKS[sys.argv[1]](comm, *sys.argv[2:])
    print(f"OK rank {comm.rank} result {result}", flush=True)
