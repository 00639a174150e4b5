"""The configurations the dry run is held to real mpirun runs on (tests/test_dryrun_mpi.py).

Every stage, both schedules, fp32 and bf16, and at stage 3 ZeRO++ on and off (qwZ, qgZ and, where
N is even, hpZ over pairs of ranks), for a GPT small enough that one mpirun launch per world size
trains all of them. Shared by the mpirun worker (``dryrun_worker.py``, the real runs) and the test
(the dry runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zerosim.nn import GPT

# the GPT both sides build: (layers, hidden, vocab, sequence, heads), as `zerosim dryrun --model`
SHAPE = (1, 8, 50, 16, 2)
MODEL_SPEC = "gpt:" + ",".join(str(v) for v in SHAPE)
MICRO_BATCH = 2
STEPS = 1  # one optimizer step of two micro-steps: stage 3 records its module trace in the first
FIELDS = (
    "op phase group dtype elements size_bytes bytes_sent bytes_recv peers step blocking "
    "intra_bytes inter_bytes"
).split()


@dataclass(frozen=True)
class Case:
    stage: int
    schedule: str
    dtype: str  # "fp32" or "bf16"
    zeropp: bool = False

    @property
    def name(self) -> str:
        return f"stage{self.stage}-{self.schedule}-{self.dtype}" + (
            "-zero++" if self.zeropp else ""
        )


def cases() -> list[Case]:
    out = []
    for stage in (0, 1, 2, 3):
        for schedule in ("paper", "deepspeed"):
            for dtype in ("fp32", "bf16"):
                for zeropp in (False, True) if stage == 3 else (False,):
                    out.append(Case(stage, schedule, dtype, zeropp))
    return out


def config(case: Case, n: int) -> dict:
    zero = {"stage": case.stage, "reduce_bucket_size": 300, "overlap_comm": True}
    if case.stage == 3:
        zero.update(stage3_param_persistence_threshold=10, stage3_prefetch_bucket_size=400)
    if case.zeropp:
        zero.update(zero_quantized_weights=True, zero_quantized_gradients=True)
        if n % 2 == 0:
            zero["zero_hpz_partition_size"] = 2
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
        "zerosim": {"schedule": case.schedule},
    }
    if case.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def build_model(shape: tuple[int, ...] = SHAPE) -> GPT:
    layers, hidden, vocab, seq, heads = shape
    return GPT(vocab, seq, layers, heads, hidden, seed=1)


def batch(rank: int, micro_step: int, shape=SHAPE, micro_batch: int = MICRO_BATCH) -> np.ndarray:
    """Token ids of ``rank``'s micro-step, the same on every side that asks."""
    rng = np.random.default_rng(1000 * rank + micro_step)
    return rng.integers(0, shape[2], (micro_batch, shape[3]))


def record_key(r) -> list:
    return [getattr(r, f) for f in FIELDS]
