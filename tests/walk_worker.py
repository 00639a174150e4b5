"""``mpirun -n 2 python tests/walk_worker.py OUT.json``: the call stack at the MPI call.

For stage 2 and stage 3 under both schedules, the Python frames between ``Engine.backward`` and
the first mpi4py call of a gradient reduction (and, at stage 3, of a parameter gather) made
during backward, as (file relative to the repository, function qualname) pairs. The MPI
communicator under zerosim's ``MPIComm`` is wrapped so that every call records its stack; only
zerosim's own frames are kept.
"""

import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

import zerosim as zs
from zerosim.comm import MPIComm
from zerosim.nn.models import MLP

ROOT = Path(__file__).resolve().parent.parent


class RecordingComm:
    """Stands in for an mpi4py communicator: delegates everything, records the stack of calls."""

    def __init__(self, mpi):
        self._mpi, self.stacks = mpi, []
        self.recording = False

    def __getattr__(self, name):
        value = getattr(self._mpi, name)
        if not (self.recording and name[0].isupper() and callable(value)):
            return value

        def call(*args, **kwargs):
            self.stacks.append((name, frames(sys._getframe(1))))
            return value(*args, **kwargs)

        return call


def frames(frame):
    """zerosim's frames from the outermost down to ``frame``, as (path, qualname)."""
    out = []
    while frame is not None:
        path = Path(frame.f_code.co_filename).resolve()
        if ROOT / "zerosim" in path.parents:
            out.append((str(path.relative_to(ROOT)), frame.f_code.co_qualname))
        frame = frame.f_back
    return out[::-1]


def walk(stage, schedule):
    rec = RecordingComm(MPI.COMM_WORLD)
    comm = MPIComm(rec)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": True,
            "reduce_bucket_size": 64,
            "stage3_param_persistence_threshold": 0,
        },
        "zerosim": {"schedule": schedule},
    }
    model = MLP([6, 9, 5, 4], seed=3)
    engine, *_ = zs.initialize(model=model, config=config, comm=comm)
    rng = np.random.default_rng(comm.rank)
    x, y = rng.standard_normal((4, 6)), rng.integers(0, 4, 4)
    loss = engine(x, y)
    rec.recording = True
    engine.backward(loss)
    rec.recording = False
    engine.step()
    names = [name for name, _ in rec.stacks]
    reduction = next((s for n, s in rec.stacks if "reduce" in n.lower()), names)
    gather = next((s for n, s in rec.stacks if "gather" in n.lower()), names)
    return {"reduction": reduction, "gather": gather if stage == 3 else None}


if __name__ == "__main__":
    cases = [(stage, schedule) for stage in (2, 3) for schedule in ("paper", "deepspeed")]
    result = {f"{stage} {schedule}": walk(stage, schedule) for stage, schedule in cases}
    if MPI.COMM_WORLD.Get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(result, indent=1))
