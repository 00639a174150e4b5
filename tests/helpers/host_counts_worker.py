"""``mpirun -n 1 python tests/helpers/host_counts_worker.py MODEL CONFIG.json``: one real NumPy
run of three optimizer steps; during the last, zerosim's own Python calls counted by the dry
run's profile hook (``dryrun.host.PythonCalls``) and the minor page faults the kernel counted
(``ru_minflt``). Prints ``COUNTS <calls> <minor faults>``."""

import json
import resource
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from zerosim.comm import MPIComm  # noqa: E402
from zerosim.dryrun import recipe  # noqa: E402
from zerosim.dryrun.host import PythonCalls  # noqa: E402
from zerosim.engine import initialize  # noqa: E402
from zerosim.report import workloads  # noqa: E402


def main(model: str, config: str) -> None:
    net, _ = workloads.build(model)
    cfg = json.loads(Path(config).read_text())
    x = np.zeros((cfg["train_micro_batch_size_per_gpu"], recipe(model).gpt.seq), np.int64)
    engine, *_ = initialize(net, cfg, comm=MPIComm())
    for step in range(3):
        if step == 2:
            counter = PythonCalls().__enter__()
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
    counter.__exit__()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    print(f"COUNTS {counter.calls} {faults}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
