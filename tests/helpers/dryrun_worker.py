"""``mpirun -n N python tests/helpers/dryrun_worker.py OUT``: every dry-run case trained for real.

Each rank trains every configuration of ``dryrun_cases`` on an MPIComm of its own (so that each
case's sub-groups are numbered from 1) and writes ``OUT/rank<R>.json``: per case, its ledger
records (the fields the dry run must reproduce) and its ``memory_report()``.
"""

import json
import sys
from pathlib import Path

from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dryrun_cases  # noqa: E402

from zerosim.comm import MPIComm  # noqa: E402
from zerosim.engine import initialize  # noqa: E402


def main(out: Path) -> None:
    results = {}
    rank = MPI.COMM_WORLD.Get_rank()
    for case in dryrun_cases.cases():
        comm = MPIComm(MPI.COMM_WORLD.Dup())
        engine, *_ = initialize(
            dryrun_cases.build_model(), dryrun_cases.config(case, comm.size), comm=comm
        )
        micro = 0
        for _ in range(dryrun_cases.STEPS * engine.gradient_accumulation_steps):
            x = dryrun_cases.batch(rank, micro)
            loss = engine(x, x)
            engine.backward(loss)
            engine.step()
            micro += 1
        results[case.name] = {
            "records": [dryrun_cases.record_key(r) for r in comm.ledger.records],
            "memory": engine.memory_report(),
        }
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    print(f"OK rank {rank}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
