"""``mpirun -n N python tests/helpers/schedule_worker.py OUT``: every schedule case trained
for real.

Each rank trains every configuration of ``schedule_cases`` on an MPIComm of its own (so that each
case's sub-groups are numbered from 1), records the last optimizer step's collective issues and
waits (``ledger.events``) and writes ``OUT/rank<R>.json``: per case, that schedule.
"""

import json
import sys
from pathlib import Path

from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))

import schedule_cases  # noqa: E402

from zerosim.comm import MPIComm  # noqa: E402
from zerosim.dryrun.run import recompute_blocks  # noqa: E402
from zerosim.engine import initialize  # noqa: E402
from zerosim.nn import no_grad  # noqa: E402
from zerosim.nn.metrics import METRICS, step_metrics  # noqa: E402


def main(out: Path) -> None:
    results = {}
    rank = MPI.COMM_WORLD.Get_rank()
    for case in schedule_cases.cases():
        comm = MPIComm(MPI.COMM_WORLD.Dup())
        model = schedule_cases.build_model()
        if case.recompute:
            recompute_blocks(model, case.name)
        metrics = [METRICS[name]() for name in schedule_cases.METRICS] if case.metrics else []
        model.keep_output = bool(metrics)
        engine, *_ = initialize(model, schedule_cases.config(case), comm=comm)
        micro = 0
        for step in range(schedule_cases.STEPS):
            if step == schedule_cases.STEPS - 1:
                comm.ledger.events = []
            for metric in metrics:  # as zerosim train --metrics runs them
                metric.reset()
            for _ in range(engine.gradient_accumulation_steps):
                x = schedule_cases.batch(rank, micro)
                engine.backward(engine(x, x))
                with no_grad():
                    for metric in metrics:
                        metric.update(model.output, x)
                engine.step()
                micro += 1
            step_metrics(metrics, comm)
        results[case.name] = schedule_cases.schedule_of(comm.ledger.events)
        comm.ledger.events = None
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    print(f"OK rank {rank}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
