"""Checkpoint runs shared by the LocalWorld tests, the mpirun tests and the kill test, and oracles.

``mpirun -n N python tests/helpers/ckpt_worker.py CHECK DIR [ARGS]`` runs a check on an MPIComm;
``python tests/helpers/ckpt_worker.py save_loop DIR`` trains on LocalWorld(2), saving after every
step, until the test kills it.

The oracles do not use the checkpoint code: ``snapshot`` reads each rank's owned master weights
and optimizer states through ``Strategy.segments`` and ``assemble`` puts the ranks' pieces into
whole arrays (each element exactly once); ``reference`` is a plain single-process loop that reads
the same global sample stream, whose micro-batch width may change mid-run (N·m before the save,
M·m after the load at M ranks).
"""

import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_cases import Case, build_model, config  # noqa: E402

from zerosim import LocalWorld, optim  # noqa: E402
from zerosim.checkpoint import CheckpointError  # noqa: E402
from zerosim.engine import initialize  # noqa: E402
from zerosim.nn import MLP  # noqa: E402

POOL = 4096


def pool(case: Case):
    rng = np.random.default_rng(11)
    if case.model == "mlp":
        return rng.standard_normal((POOL, 6)), rng.integers(0, 4, POOL)
    x = rng.integers(0, 13, (POOL, 5))
    return x, np.roll(x, -1, axis=1)


def make_engine(comm, case: Case):
    engine, *_ = initialize(build_model(case), config(case), comm=comm)
    return engine


def train_steps(engine, comm, case: Case, steps: int, start: int) -> int:
    """``steps`` optimizer steps over the global stream from sample ``start``; the next sample."""
    x, y = pool(case)
    m, width = case.micro, comm.size * case.micro
    for _ in range(steps * case.accumulation):
        at = start + comm.rank * m
        loss = engine(x[at : at + m], y[at : at + m])
        engine.backward(loss)
        engine.step()
        start += width
    return start


def snapshot(engine) -> dict:
    """This rank's owned pieces: {kind: [(name, start, stop, values)]} and per-group scalars."""
    strategy, opt = engine.strategy, engine.optimizer
    out: dict = {"master": []}
    for s in strategy.segments("owned"):
        tile = strategy.sharded_step.tiles[s.group][s.tile]
        cut = slice(s.offset, s.offset + s.size)
        piece = (s.name, s.param_range.start, s.param_range.stop)
        out["master"].append((*piece, np.array(tile.data[cut])))
        for k, v in opt.state.get(tile, {}).items():
            if isinstance(v, np.ndarray):
                out.setdefault(k, []).append((*piece, np.array(v[cut])))
    scalars = []
    for _g, tiles in enumerate(strategy.sharded_step.tiles):
        states = [opt.state.get(t, {}) for t in tiles]
        scalars.append(
            {k: v for st in states for k, v in st.items() if not isinstance(v, np.ndarray)}
        )
    out["scalars"] = scalars
    return out


def assemble(snapshots: list[dict], shapes: dict) -> dict:
    """Whole arrays from every rank's pieces; each element must come exactly once."""
    full: dict = {}
    for kind in snapshots[0]:
        if kind == "scalars":
            continue
        arrays = {n: np.full(math.prod(s), np.nan) for n, s in shapes.items()}
        count = {n: np.zeros(math.prod(s), dtype=int) for n, s in shapes.items()}
        for snap in snapshots:
            for name, start, stop, values in snap.get(kind, []):
                arrays[name][start:stop] = values
                count[name][start:stop] += 1
        present = [n for n in shapes if count[n].any()]  # a kind may exist for some groups only
        assert all((count[n] == 1).all() for n in present), kind
        full[kind] = {n: arrays[n].reshape(shapes[n]) for n in present}
    return full


def shapes_of(case: Case) -> dict:
    return {n: p.shape for n, p in build_model(case).named_parameters()}


def reference(case: Case, widths: list[int]):
    """Single process: step t reads ``accumulation`` micro-batches of ``widths[t]`` samples."""
    model = build_model(case)
    params = list(model.parameters())
    if case.optimizer == "adam":  # DeepSpeed's Adam section defaults to AdamW mode
        opt = optim.AdamW(params, lr=3e-2, weight_decay=0.01)
    else:
        opt = optim.SGD(params, lr=5e-2, momentum=0.9)
    x, y = pool(case)
    at = 0
    for w in widths:
        for _ in range(case.accumulation):
            model(x[at : at + w], y[at : at + w])
            model.backward(grad_scale=1.0 / case.accumulation)
            at += w
        if case.clip > 0:
            norm = math.sqrt(sum(float(np.vdot(p.grad, p.grad)) for p in params))
            if case.clip / (norm + 1e-6) < 1:
                for p in params:
                    p.grad *= case.clip / (norm + 1e-6)
        opt.step()
        opt.zero_grad()
    named = dict(model.named_parameters())
    states: dict = {"master": {n: p.data.copy() for n, p in named.items()}}
    for n, p in named.items():
        for k, v in opt.state[p].items():
            if isinstance(v, np.ndarray):
                states.setdefault(k, {})[n] = v.copy()
    return states


def rel_error(got: dict, want: dict) -> float:
    scale = max(float(np.abs(w).max()) for w in want.values())
    return max(float(np.abs(got[k] - want[k]).max()) for k in want) / scale


# -- runs (fn(comm, ...) for LocalWorld.run and for the mpirun checks) ----------------------------
def save_run(comm, case: Case, steps: int, ckpt: str):
    engine = make_engine(comm, case)
    nxt = train_steps(engine, comm, case, steps, 0)
    engine.save_checkpoint(ckpt, client_state={"next_sample": nxt})
    return snapshot(engine)


def load_run(comm, case: Case, ckpt: str, steps: int):
    engine = make_engine(comm, case)
    _, client = engine.load_checkpoint(ckpt)
    loaded = snapshot(engine)
    loaded_full = engine.full_state_dict()
    train_steps(engine, comm, case, steps, client["next_sample"])
    return loaded, loaded_full, engine.full_state_dict(), engine.global_steps


SAVE_CASE = Case(model="gpt", stage=2, optimizer="adam", clip=0.5, bucket=40)
LOAD_CASES = {
    "1": SAVE_CASE.with_(stage=1),
    "megatron": SAVE_CASE.with_(stage=1, layout="megatron"),
}


def mpi_save(comm, ckpt):
    save_run(comm, SAVE_CASE, 4, ckpt)
    return "saved"


def mpi_load(comm, ckpt, saved_n, variant):
    """Load what ``mpi_save`` wrote at ``saved_n`` ranks; check against the reference."""
    case, m = LOAD_CASES[variant], SAVE_CASE.micro
    _, loaded_full, final, steps = load_run(comm, case, ckpt, 10)
    before = reference(case, [int(saved_n) * m] * 4)["master"]
    after = reference(case, [int(saved_n) * m] * 4 + [comm.size * m] * 10)["master"]
    assert steps == 14, steps
    assert rel_error(loaded_full, before) < 1e-12, rel_error(loaded_full, before)
    assert rel_error(final, after) < 1e-12, rel_error(final, after)
    return rel_error(final, after)


def mpi_load_corrupt(comm, ckpt, bad_file):
    """Every rank must raise a CheckpointError naming the corrupted file."""
    try:
        load_run(comm, SAVE_CASE, ckpt, 1)
    except CheckpointError as err:
        assert bad_file in str(err), err
        print(f"rank {comm.rank}: {type(err).__name__}: {err}", flush=True)
        return "raised"
    raise AssertionError("the corrupted file was not detected")


def mpi_save_too_large(comm, ckpt, bad_rank):
    """Save at step 2; then rank ``bad_rank`` may write files of at most 1 KiB (RLIMIT_FSIZE:
    the kernel's EFBIG, as a full disk's ENOSPC, at a real write) and the save of step 3
    fails. Every rank must raise an OSError naming the file; the folder must hold exactly the
    step-2 save, which must load."""
    import resource

    engine = make_engine(comm, SAVE_CASE)
    nxt = train_steps(engine, comm, SAVE_CASE, 2, 0)
    engine.save_checkpoint(ckpt)
    before = snapshot(engine)
    train_steps(engine, comm, SAVE_CASE, 1, nxt)
    if comm.rank == int(bad_rank):
        resource.setrlimit(
            resource.RLIMIT_FSIZE, (1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1])
        )
    try:
        engine.save_checkpoint(ckpt)
    except OSError as err:
        print(f"rank {comm.rank}: {type(err).__name__}: {err}", flush=True)
    else:
        raise AssertionError("the save did not fail")
    comm.barrier()  # rank 0 has removed the unfinished save
    left = sorted(p.name for p in Path(ckpt).iterdir())
    assert left == ["global_step2", "latest"], left
    again = make_engine(comm, SAVE_CASE)
    again.load_checkpoint(ckpt)
    for kind, pieces in before.items():
        if kind != "scalars":
            for (name, *_, want), (_, *_, got) in zip(pieces, snapshot(again)[kind], strict=True):
                assert np.array_equal(got, want), name
    return "kept"


# -- resuming at another world size: which samples every rank reads ----------------------------
class RecordingDataset:
    """Random MLP samples that remember the index array of every batch read from them."""

    def __init__(self, length: int) -> None:
        rng = np.random.default_rng(11)
        self.x, self.y = rng.standard_normal((length, 6)), rng.integers(0, 4, length)
        self.read: list[list[int]] = []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, idx):
        self.read.append(np.asarray(idx).tolist())
        return self.x[idx], self.y[idx]


def mpi_resume_stream(comm, out, launch, targets):
    """One launch of a chain of ``zerosim train`` runs: for each config ``out/<policy>.json``
    train to global step ``targets[policy]`` (resuming from ``out/<policy>`` when a previous
    launch saved there), save, and write the indices this rank read to
    ``out/<policy>.launch<launch>.rank<r>.json``."""
    from zerosim.cli import build_parser
    from zerosim.cli import train as train_demo

    for policy, target in json.loads(targets).items():
        ckpt = Path(out) / policy
        data = RecordingDataset(int((Path(out) / "length").read_text()))
        train_demo.build = lambda args, data=data: (MLP([6, 9, 4], seed=3), data)
        argv = ["train", "--quiet", "--steps", str(target), "--config", f"{ckpt}.json"]
        argv += ["--save", str(ckpt)]
        if (ckpt / "latest").exists():
            argv += ["--resume", str(ckpt)]
        train_demo.train(comm, build_parser().parse_args(argv))
        path = Path(out) / f"{policy}.launch{launch}.rank{comm.rank}.json"
        path.write_text(json.dumps(data.read))
    return "trained"


# -- the kill test's subject ------------------------------------------------------------------
BIG = Case(model="big", stage=2, micro=4)


def big_engine(comm, sizes=(128, 512, 512, 10)):
    model = MLP(list(sizes), seed=5, dtype="float64")  # 334,346 parameters by default
    engine, *_ = initialize(model, config(BIG), comm=comm)
    return engine


def big_steps(engine, comm, steps):
    rng = np.random.default_rng(engine.global_steps * 100 + comm.rank)
    width = engine.module.layers[0].weight.shape[1]
    for _ in range(steps):
        x, y = rng.standard_normal((BIG.micro, width)), rng.integers(0, 10, BIG.micro)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()


def save_loop(comm, ckpt, every_state=None):
    engine = big_engine(comm)
    for k in range(1, 400):
        big_steps(engine, comm, 1)
        if every_state is not None:  # the in-process oracle: no saving, keep chosen steps
            if k in every_state:
                every_state[k] = engine.full_state_dict()
            if k >= max(every_state):
                return
            continue
        engine.save_checkpoint(ckpt)
        if comm.rank == 0:
            shutil.rmtree(Path(ckpt) / f"global_step{k - 2}", ignore_errors=True)  # keep two
            print(f"saved {k}", flush=True)


CHECKS = {
    "save": mpi_save,
    "load": mpi_load,
    "load_corrupt": mpi_load_corrupt,
    "resume_stream": mpi_resume_stream,
    "save_too_large": mpi_save_too_large,
}

if __name__ == "__main__":
    if sys.argv[1] == "save_loop":
        LocalWorld(2).run(save_loop, sys.argv[2])
        time.sleep(60)  # never reached in the test: it is killed first
    else:
        from zerosim.comm import MPIComm

        comm = MPIComm()
        result = CHECKS[sys.argv[1]](comm, *sys.argv[2:])
        print(f"OK rank {comm.rank} result {result}", flush=True)
