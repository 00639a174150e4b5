"""A nan or an inf in one rank's micro-batch, in-process and under ``mpirun``.

``mpirun -n N python tests/helpers/nonfinite_worker.py SCHEDULE…`` runs ``check_every_config`` for
those schedules on COMM_WORLD; test_nonfinite.py runs the same functions on a ``LocalWorld``.

Each run trains an MLP for ``STEPS`` optimizer steps of two micro-batches per rank, and may put
a nan or an inf into one input of one rank's first micro-batch of step ``BAD_STEP``. The oracle
for a skipped step is a clean run that never saw that step's data: the same engine, config and
micro-batches, with step ``BAD_STEP`` left out of the loop. Skipping must leave nothing behind
(weights, fp32 master, optimizer state and step count, gradients, LR schedule), so the two runs
end with the same weights, bit for bit.

When DeepSpeed 0.19.8 skips (``deepspeed_skips``, read from its source; zerosim/zero/schedule.py
cites the lines): stage 0 only under fp16/bf16 (``FP16_UnfusedOptimizer``); stages 1-2 unless
bf16 runs without ``bf16.check_grad_overflow`` (``stage_1_and_2.step`` skips on the overflow
flag or on an inf/nan norm, the latter skipped for bf16 only with the check); stage 3 at every
precision (``stage3.step``). zerosim's paper schedule skips at every stage and precision.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from zerosim.engine import initialize  # noqa: E402
from zerosim.nn import MLP  # noqa: E402

STEPS = 5
BAD_STEP = 2
BAD_RANK = 1
MICRO = 2  # samples per micro-batch
ACCUMULATION = 2
WARMUP = {
    "warmup_min_lr": 1e-3,
    "warmup_max_lr": 1e-2,
    "warmup_num_steps": 4,
    "warmup_type": "linear",
}
PRECISIONS = ("fp32", "bf16", "bf16_unchecked", "fp16")
PRECISION_SECTIONS = {
    "fp32": {},
    "bf16": {"bf16": {"enabled": True}},
    "bf16_unchecked": {"bf16": {"enabled": True, "check_grad_overflow": False}},
    # a static scale: the skip must not change it, so the clean run's later steps see the same
    # scale (the dynamic scaler's reaction is test_nonfinite.py's loss-scale test)
    "fp16": {"fp16": {"enabled": True, "loss_scale": 256}},
}


def deepspeed_skips(stage: int, precision: str, schedule: str = "deepspeed") -> bool:
    """Whether DeepSpeed 0.19.8 (or zerosim's paper schedule) skips a step whose gradients hold
    inf/nan; the module docstring says where in DeepSpeed's source each answer comes from."""
    if schedule == "paper":
        return True
    if stage == 0:
        return precision != "fp32"
    if stage in (1, 2):
        return precision != "bf16_unchecked"
    return True


def config(stage: int, precision: str, schedule: str = "deepspeed", **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUMULATION,
        "gradient_clipping": 1.0,
        "steps_per_print": None,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": WARMUP},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
        "zerosim": {"schedule": schedule},
        **PRECISION_SECTIONS[precision],
    }


def micro_batch(step: int, micro: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([7, step, micro, rank])
    return rng.standard_normal((MICRO, 6)).astype(np.float32), rng.integers(0, 4, MICRO)


def train(comm, cfg: dict, steps: list[int], bad: float | None = None, at=(BAD_STEP,)) -> dict:
    """Train on the data of ``steps`` (in order); with ``bad``, rank BAD_RANK's first
    micro-batch of each step in ``at`` holds it in one input. Returns the weights and what the
    engine reports after each step."""
    engine, *_ = initialize(MLP([6, 9, 5, 4], seed=3), cfg, comm=comm)
    scales, norms, skipped, lrs = [], [], [], []
    with np.errstate(all="ignore"):  # the poisoned step's arithmetic warns, as it should
        for step in steps:
            for micro in range(ACCUMULATION):
                x, y = micro_batch(step, micro, comm.rank)
                if bad is not None and step in at and (micro, comm.rank) == (0, BAD_RANK):
                    x[1, 3] = bad
                engine.backward(engine(x, y))
                engine.step()
            scales.append(engine.loss_scale)
            norms.append(engine.get_global_grad_norm())
            skipped.append(engine.skipped_steps)
            lrs.append(engine.get_lr()[0])
        weights = engine.full_state_dict()
    return {"weights": weights, "scales": scales, "norms": norms, "skipped": skipped, "lrs": lrs}


def check_config(comm, stage: int, precision: str, schedule: str = "deepspeed") -> bool:
    """Run the clean run without step BAD_STEP, and a nan and an inf run; assert what DeepSpeed
    does. Returns whether the step was skipped."""
    cfg = config(stage, precision, schedule)
    where = f"stage {stage}, {precision}, {schedule} schedule"
    kept = [s for s in range(STEPS) if s != BAD_STEP]
    clean = train(comm, cfg, kept)
    skips = deepspeed_skips(stage, precision, schedule)
    for bad in (math.nan, math.inf):
        got = train(comm, cfg, list(range(STEPS)), bad)
        what = f"{where}, {bad} on rank {BAD_RANK}"
        if skips:
            for name, want in clean["weights"].items():
                assert np.array_equal(got["weights"][name], want), (what, name)
            assert got["skipped"] == [0] * BAD_STEP + [1] * (STEPS - BAD_STEP), (what, got)
            assert got["norms"][BAD_STEP] == math.inf, (what, got["norms"])
            for key in ("scales", "lrs"):  # the skipped step changes neither
                want = clean[key][:BAD_STEP] + [clean[key][BAD_STEP - 1]] + clean[key][BAD_STEP:]
                assert got[key] == want, (what, key, got[key], want)
        else:  # DeepSpeed lets it through: so does zerosim, and says so in the weights
            assert got["skipped"][-1] == 0, (what, got["skipped"])
            # DeepSpeed's ZeRO optimizers report a nan norm as inf; stage 0 in fp32 none
            assert got["norms"][BAD_STEP] == (None if stage == 0 else math.inf), what
            assert not all(np.isfinite(w).all() for w in got["weights"].values()), what
    return skips


def check_every_config(comm, schedules: tuple[str, ...] = ("deepspeed", "paper")) -> int:
    """``check_config`` for every stage and precision; returns how many runs skipped."""
    skipped = 0
    for schedule in schedules:
        for stage in (0, 1, 2, 3):
            for precision in PRECISIONS:
                skipped += check_config(comm, stage, precision, schedule)
    return skipped


if __name__ == "__main__":
    from zerosim.comm import MPIComm

    world = MPIComm()
    count = check_every_config(world, tuple(sys.argv[1:]))
    print(f"OK rank {world.rank} skipped {count}", flush=True)
