"""``mpirun -n 2 python tests/helpers/walk_worker.py OUT.json``: the call stack at the MPI call.

For stage 2 and stage 3 under both schedules with ``overlap_comm: true``, and for stage 2 with
DeepSpeed's defaults (no ``zerosim`` key, no ``overlap_comm``: what runs when nothing is chosen),
the Python frames between ``Engine.backward`` and the first mpi4py call of a gradient reduction
(and, at stage 3, of a parameter gather) made during backward, as (file relative to the
repository, function qualname) pairs. The MPI communicator under zerosim's ``MPIComm`` is
wrapped so that every call records its stack; only zerosim's own frames are kept.

At stage 2 it also records where the reduced gradient lands: the frames of the first in-place
ufunc (``dest += out``) whose output is a view of a group's ``grad_shard`` during backward. Each
``grad_shard`` is swapped after ``initialize`` for a view of the same memory that records
(``Landing``), so the numbers do not change.
"""

import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

import zerosim as zs
from zerosim.comm import MPIComm
from zerosim.nn.models import MLP

ROOT = Path(__file__).resolve().parents[2]


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


class Landing(np.ndarray):
    """A view of a ``grad_shard`` that records the stack of each in-place ufunc writing into it
    while ``RECORDING`` is set, then computes as a plain array would."""

    RECORDING = False
    stacks: list = []

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        if Landing.RECORDING and out and any(isinstance(o, Landing) for o in out):
            Landing.stacks.append(frames(sys._getframe(1)))
        plain = [i.view(np.ndarray) if isinstance(i, Landing) else i for i in inputs]
        if out is None:
            return getattr(ufunc, method)(*plain, **kwargs)
        plain_out = tuple(o.view(np.ndarray) if isinstance(o, Landing) else o for o in out)
        getattr(ufunc, method)(*plain, out=plain_out, **kwargs)
        return out[0] if len(out) == 1 else out


def config(stage, schedule):
    """overlap_comm and a small bucket for the chosen schedules; DeepSpeed's defaults else."""
    if schedule == "default":
        zero = {"stage": stage}
    else:
        zero = {
            "stage": stage,
            "overlap_comm": True,
            "reduce_bucket_size": 64,
            "stage3_param_persistence_threshold": 0,
        }
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
    }
    if schedule != "default":
        cfg["zerosim"] = {"schedule": schedule}
    return cfg


def walk(stage, schedule):
    rec = RecordingComm(MPI.COMM_WORLD)
    comm = MPIComm(rec)
    model = MLP([6, 9, 5, 4], seed=3)
    engine, *_ = zs.initialize(model=model, config=config(stage, schedule), comm=comm)
    for g in engine.strategy.groups:
        if getattr(g, "grad_shard", None) is not None:
            g.grad_shard = g.grad_shard.view(Landing)
    rng = np.random.default_rng(comm.rank)
    x, y = rng.standard_normal((4, 6)), rng.integers(0, 4, 4)
    loss = engine(x, y)
    Landing.stacks.clear()
    rec.recording = Landing.RECORDING = True
    engine.backward(loss)
    rec.recording = Landing.RECORDING = False
    engine.step()
    names = [name for name, _ in rec.stacks]
    reduction = next((s for n, s in rec.stacks if "reduce" in n.lower()), names)
    gather = next((s for n, s in rec.stacks if "gather" in n.lower()), names)
    landing = Landing.stacks[0] if Landing.stacks else "no write into grad_shard"
    return {
        "reduction": reduction,
        "gather": gather if stage == 3 else None,
        "landing": landing if stage == 2 else None,
    }


if __name__ == "__main__":
    cases = [(stage, schedule) for stage in (2, 3) for schedule in ("paper", "deepspeed")]
    cases.append((2, "default"))
    result = {f"{stage} {schedule}": walk(stage, schedule) for stage, schedule in cases}
    if MPI.COMM_WORLD.Get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(result, indent=1))
