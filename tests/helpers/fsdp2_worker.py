"""One rank of the FSDP2 parity job: ``mpirun -n 3 python tests/helpers/fsdp2_worker.py``.

Trains the GPT and the MLP of ``engine_cases`` under ``zerosim.schedule: "fsdp2"`` (float64;
reshard after forward on and off, accumulation with clipping) over MPI and compares the weights
with the one-process run on the same global batches; prints ``FSDP2 OK`` on each rank.
Used by tests/test_fsdp2.py.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))  # tests/helpers
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository
sys.path.insert(0, HERE)

import engine_cases as ec  # noqa: E402

from zerosim.comm import MPIComm  # noqa: E402
from zerosim.engine import initialize  # noqa: E402

CASES = [
    (ec.Case(stage=3, steps=5, model="gpt", accumulation=2, clip=0.5), {}),
    (ec.Case(stage=3, steps=5, model="gpt"), {"reshard_after_forward": False}),
    (ec.Case(stage=3, steps=5, model="mlp", accumulation=2), {"reshard_after_backward": False}),
]


def main() -> None:
    comm = MPIComm()
    for case, fsdp2 in CASES:
        cfg = ec.config(case.with_(schedule="fsdp2"))
        cfg["zerosim"]["fsdp2"] = fsdp2
        engine, *_ = initialize(ec.build_model(case), cfg, comm=comm)
        x, y = ec.data(case, comm.size)
        for s in range(case.steps):
            ec.optimizer_step(engine, comm, case, x, y, s)
        err = ec.max_rel_error(engine.full_state_dict(), ec.reference(case, comm.size))
        if not err < 1e-12:
            raise SystemExit(f"rank {comm.rank}: {case} {fsdp2}: relative error {err:.3e}")
    print(f"FSDP2 OK rank {comm.rank}", flush=True)


if __name__ == "__main__":
    main()
