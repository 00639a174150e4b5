"""LAMB under ZeRO stages 0-3: the runs the LocalWorld test and the mpirun job share.

``mpirun -n N python tests/helpers/zero_lamb_cases.py`` runs ``check_all`` on an MPIComm. Each case
trains with the engine and is held (``engine_cases.check_case``) to the single-process run of
``zerosim.optim.Lamb`` on whole parameters, to the byte formulas of training's own phases and
to the memory formulas; then the partial-norm all-reduce (phase ``lamb_norms``) to its count,
derived here from the model's shapes: one all-reduce per step of 2 float64 sums per parameter
that more than one rank holds a piece of.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_cases  # noqa: E402
from engine_cases import Case  # noqa: E402

from zerosim.comm.ring import model_bytes  # noqa: E402

VARIANTS = [
    dict(stage=0, model="gpt", sub_group_size=7, clip=0.5),  # tiles cut parameters, no message
    dict(stage=1, model="mlp", overlap=False),
    dict(stage=1, model="gpt", accumulation=2, clip=0.05),
    dict(stage=2, model="gpt", accumulation=3),
    dict(stage=2, model="mlp", dtype="float32", sub_group_size=13),
    dict(stage=3, model="mlp", persistence=40),
    dict(stage=3, model="gpt", sub_group_size=11, clip=0.5),
]


def split_parameters(case: Case, n: int) -> int:
    """How many parameters more than one rank holds a piece of, from the shapes alone.

    Stage 0: none (every rank steps everything). Stages 1-2: DeepSpeed's flat buffer in
    definition order, partition r = [r·P, (r+1)·P) with P = Ψ_pad/N: a parameter is split when
    a multiple of P falls strictly inside it. Stage 3: each parameter is cut into N chunks of
    ⌈numel/N⌉, so every parameter of 2 or more elements is split.
    """
    numels = [p.numel for _, p in engine_cases.build_model(case).named_parameters()]
    if case.stage == 0 or n == 1:
        return 0
    if case.stage == 3:
        return sum(m >= 2 for m in numels)
    padded, _ = engine_cases.shapes_padded(case, n)
    size = padded // n
    split, start = 0, 0
    for m in numels:
        stop = start + m
        split += math.ceil(stop / size) - start // size > 1  # partitions it touches
        start = stop
    return split


def check_lamb(comm, case: Case) -> float:
    """Parity, training's bytes and memory, and the partial-norm all-reduce of every step."""
    out = engine_cases.train(comm, case)
    err = engine_cases.check_case(comm, case, out=out)
    s = split_parameters(case, comm.size)
    want = 0 if s == 0 else model_bytes("all_reduce", 2 * s, comm.size, comm.rank, 8)[0]
    assert out["lamb_norm_bytes"] == [want] * case.steps, (case, s, out["lamb_norm_bytes"])
    assert case.stage in (0,) or comm.size == 1 or s > 0  # the reduction was exercised
    return err


def check_all(comm) -> float:
    return max(check_lamb(comm, Case(optimizer="lamb", steps=6, **v)) for v in VARIANTS)


if __name__ == "__main__":
    from zerosim.comm import MPIComm

    comm = MPIComm()
    print(f"OK rank {comm.rank} result {check_all(comm)}", flush=True)
