"""Muon under ZeRO stages 0-3: the runs the LocalWorld test and the mpirun job share, and their
single-process oracle.

``mpirun -n N python tests/helpers/zero_muon_cases.py`` runs ``check_all`` on an MPIComm. The
oracle, ``reference``, is written here without the engine or zerosim/zero/muon.py: the model on the
global batch, whole gradients, ``functional.muon_update`` on each Muon matrix with its own
momentum, ``functional.adam`` on the rest, and DeepSpeed's two clipping rules: at stage 0 its
engine clips the raw gradients before ``MuonWithAuxAdam.step`` makes the updates; at stages
1-3 ZeRO makes the updates first and takes the norm, and clips, over them.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_cases  # noqa: E402
from engine_cases import Case  # noqa: E402

from zerosim.optim import functional as F  # noqa: E402

LR, ADAM_LR, WEIGHT_DECAY = 0.02, 1e-2, 0.01
PHASES = ("forward", "backward", "step", "clip", "muon")
# reduce_bucket_size in the cases is small (engine_cases: 50 elements), so buckets and runs are
# many and cut matrices; reduce: DeepSpeed's per-owner reduces, where split matrices differ.
VARIANTS = [
    dict(stage=0, model="gpt", sub_group_size=7, clip=0.5),
    dict(stage=0, model="mlp", accumulation=2),
    dict(stage=1, model="mlp"),
    dict(stage=1, model="gpt", clip=0.5, accumulation=2),
    dict(stage=2, model="gpt", accumulation=3),
    dict(stage=2, model="mlp", clip=2.0, overlap=False),
    dict(stage=3, model="mlp"),
    dict(stage=3, model="gpt", clip=0.5, sub_group_size=40, accumulation=2),
]


def muon_section() -> dict:
    return {"type": "Muon", "params": {"lr": LR, "adam_lr": ADAM_LR, "weight_decay": WEIGHT_DECAY}}


def config(case: Case, **zero) -> dict:
    """engine_cases' config with a Muon section (or, for ``optimizer="adam"``, its Adam one)."""
    cfg = engine_cases.config(case)
    if case.optimizer == "muon":
        cfg["optimizer"] = muon_section()
    cfg["zero_allow_untested_optimizer"] = False
    half = {"bfloat16": "bf16", "float16": "fp16"}.get(case.dtype)
    if half is not None:  # 16-bit training: its section, float32 master weights
        cfg[half] = {"enabled": True, **({"initial_scale_power": 8} if half == "fp16" else {})}
    if case.stage == 3:
        cfg["zero_optimization"]["reduce_scatter"] = False  # DeepSpeed's rule for Muon
    cfg["zero_optimization"].update(zero)
    return cfg


def reference(case: Case, n: int) -> dict[str, np.ndarray]:
    """The single-process run on the same global batches (module docstring)."""
    model = engine_cases.build_model(case)
    named = list(model.named_parameters())
    muon = [p for name, p in named if p.ndim == 2 and "lm_head" not in name]
    adam = [p for _, p in named if all(p is not q for q in muon)]
    momentum = {id(p): np.zeros_like(p.data) for p in muon}
    moments = {id(p): (np.zeros_like(p.data), np.zeros_like(p.data)) for p in adam}
    x, y = engine_cases.data(case, n)
    width = n * case.micro
    for s in range(case.steps):
        for j in range(case.accumulation):
            at = (s * case.accumulation + j) * width
            model(x[at : at + width], y[at : at + width])
            model.backward(grad_scale=1.0 / case.accumulation)
        if case.stage == 0:  # DeepSpeed's engine clips the raw gradients, then Muon steps
            _clip([p.grad for _, p in named], case.clip)
            directions = {id(p): F.muon_update(p.grad, momentum[id(p)]) for p in muon}
        else:  # ZeRO: the updates first, then the norm over them
            directions = {id(p): F.muon_update(p.grad, momentum[id(p)]) for p in muon}
            _clip([directions[id(p)] for p in muon] + [p.grad for p in adam], case.clip)
        for p in muon:
            F.muon_apply(p.data, directions[id(p)], lr=LR, weight_decay=WEIGHT_DECAY)
        for p in adam:
            m, v = moments[id(p)]
            F.adam(p.data, p.grad, m, v, step=s + 1, lr=ADAM_LR, beta1=0.9, beta2=0.95,
                   eps=1e-10, weight_decay=WEIGHT_DECAY, decoupled_weight_decay=True)  # fmt: skip
        for _, p in named:
            p.grad[...] = 0
    return {name: p.data.copy() for name, p in named}


def _clip(arrays: list[np.ndarray], max_norm: float) -> None:
    """The engine's rule: scale by max_norm / (‖·‖ + 1e-6) when that is below 1."""
    if max_norm <= 0:
        return
    norm = math.sqrt(sum(float(np.vdot(a, a)) for a in arrays))
    coef = max_norm / (norm + 1e-6)
    if coef < 1:
        for a in arrays:
            a *= coef


def train(comm, case: Case, **zero) -> dict:
    """Train with the engine; the weights, the ledger's bytes by phase and the memory report."""
    from zerosim.engine import initialize

    engine, *_ = initialize(engine_cases.build_model(case), config(case, **zero), comm=comm)
    x, y = engine_cases.data(case, comm.size)
    width = comm.size * case.micro
    phases = []
    for s in range(case.steps):
        comm.ledger.reset()
        for j in range(case.accumulation):
            at = (s * case.accumulation + j) * width + comm.rank * case.micro
            loss = engine(x[at : at + case.micro], y[at : at + case.micro])
            engine.backward(loss)
            engine.step()
        phases.append({p: comm.ledger.bytes_sent(phase=p) for p in PHASES})
    return {
        "params": engine.full_state_dict(),
        "bytes": phases,
        "memory": engine.memory_report(),
        "strategy": engine.strategy,
    }


def run_steps(engine, comm, case: Case, steps: range) -> None:
    """Optimizer steps ``steps`` of ``case`` (each rank its micro-batches of the global batch)."""
    x, y = engine_cases.data(case, comm.size)
    for s in steps:
        engine_cases.optimizer_step(engine, comm, case, x, y, s)


def save_after(comm, case: Case, k: int, directory: str, **zero) -> dict:
    """Train ``k`` steps, save a checkpoint (tag "muon"), then train to the end: the weights of
    the uninterrupted run."""
    from zerosim.engine import initialize

    engine, *_ = initialize(engine_cases.build_model(case), config(case, **zero), comm=comm)
    run_steps(engine, comm, case, range(k))
    engine.save_checkpoint(directory, tag="muon")
    run_steps(engine, comm, case, range(k, case.steps))
    return engine.full_state_dict()


def resume_from(comm, case: Case, k: int, directory: str, **zero) -> dict:
    """A fresh engine (any N, stage, precision, offload) loads the checkpoint of step ``k`` and
    trains to the end; its weights."""
    from zerosim.engine import initialize

    engine, *_ = initialize(engine_cases.build_model(case), config(case, **zero), comm=comm)
    engine.load_checkpoint(directory, tag="muon")
    assert engine.global_steps == k
    run_steps(engine, comm, case, range(k, case.steps))
    return engine.full_state_dict()


def check_muon(comm, case: Case, **zero) -> float:
    out = train(comm, case, **zero)
    err = engine_cases.max_rel_error(out["params"], reference(case, comm.size))
    # Newton–Schulz runs in float32 ("gram") even for float64 weights, and float32 rounding of
    # a sum computed in another order changes the result in its last bits: 1e-6 of the scale
    assert err <= 1e-6, (case, comm.size, err)
    return err


def check_all(comm) -> float:
    worst = 0.0
    for v in VARIANTS:
        case = Case(optimizer="muon", steps=4, **v)
        worst = max(worst, check_muon(comm, case))
        if v["stage"] in (1, 2):
            worst = max(worst, check_muon(comm, case, use_multi_rank_bucket_allreduce=False))
        if v["stage"] == 3:  # ZeRO++'s hpZ over the whole world (N = 2, 3): exact
            worst = max(worst, check_muon(comm, case, zero_hpz_partition_size=comm.size))
    return worst


# the mpirun checkpoint job: saved by N = 2 at stage 2 after step RESUME_AT, resumed by N = 3
# at stage 3 (the same global batch of 6)
RESUME_AT = 2
SAVED_BY = Case(optimizer="muon", steps=5, stage=2, model="gpt", micro=3, accumulation=2)
RESUMED_BY = SAVED_BY.with_(stage=3, micro=2)


if __name__ == "__main__":
    from zerosim.comm import MPIComm

    comm = MPIComm()
    if len(sys.argv) > 2 and sys.argv[1] == "save":
        save_after(comm, SAVED_BY, RESUME_AT, sys.argv[2])
        print(f"OK rank {comm.rank} saved", flush=True)
    elif len(sys.argv) > 2 and sys.argv[1] == "resume":
        got = resume_from(comm, RESUMED_BY, RESUME_AT, sys.argv[2])
        err = engine_cases.max_rel_error(got, reference(SAVED_BY, 2))
        assert err <= 1e-6, err
        print(f"OK rank {comm.rank} resumed {err}", flush=True)
    else:
        print(f"OK rank {comm.rank} result {check_all(comm)}", flush=True)
