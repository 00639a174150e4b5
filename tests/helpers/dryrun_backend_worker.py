"""``mpirun -n 2 python tests/helpers/dryrun_backend_worker.py MODEL CONFIG.json``: one real NumPy
run, measured from outside zerosim with ``tracemalloc`` (NumPy reports every buffer it allocates
to it, in its own domain), traced from ``initialize`` on: the NumPy bytes live when the last of
two optimizer steps begins, and how far the traced memory rises above it during that step; and
the calls of numba's Adam kernel in that step, counted by wrapping the compiled function. Prints
``MEMORY <rank> <live bytes> <rise bytes> <kernel calls>``."""

import json
import sys
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from zerosim.comm import MPIComm  # noqa: E402
from zerosim.dryrun import recipe  # noqa: E402
from zerosim.engine import initialize  # noqa: E402
from zerosim.optim.functional import kernels  # noqa: E402
from zerosim.report import workloads  # noqa: E402


def main(model: str, config: str) -> None:
    comm = MPIComm()
    net, _ = workloads.build(model)
    cfg = json.loads(Path(config).read_text())
    seq = recipe(model).gpt.seq
    x = np.zeros((cfg["train_micro_batch_size_per_gpu"], seq), np.int64)
    calls = []
    adam = kernels.adam
    kernels.adam = lambda *args: (calls.append(1), adam(*args))[1]
    tracemalloc.start()  # the model's own arrays, made before, are freed once flattened
    engine, *_ = initialize(net, cfg, comm=comm)
    for step in range(2):
        if step == 1:
            numpy_only = tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)
            snapshot = tracemalloc.take_snapshot().filter_traces([numpy_only])
            live = sum(t.size for t in snapshot.traces)
            tracemalloc.reset_peak()
            start, _ = tracemalloc.get_traced_memory()
            calls.clear()
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
    _, peak = tracemalloc.get_traced_memory()
    print(f"MEMORY {comm.rank} {live} {peak - start} {len(calls)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
