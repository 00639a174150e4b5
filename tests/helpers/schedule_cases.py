"""The configurations whose *schedule* the dry run is held to real mpirun runs on
(tests/test_dryrun_mpi.py): stages 2 and 3 under both schedules, with and without activation
recomputation, and stage 3 under DeepSpeed's schedule with a ``stage3_max_live_parameters`` below
the largest module's parameters (DeepSpeed's coordinator then prefetches nothing), and stage 3
under DeepSpeed's schedule with ZeRO++'s qgZ (and qwZ). On DeepSpeed's stage 3 with
``overlap_comm`` the engine notes each bucket's reduction as running on DeepSpeed's reduction
stream.

A schedule is the ordered list of one optimizer step's collective issues and waits, as
``schedule_of`` writes it: an issue as [op, phase, group, dtype, elements, blocking], a wait as
["wait", k] for the step's k-th issue (["wait", "earlier", op, group, elements] for a call issued
before the step), a stream note as ["stream", name]. Shared by the mpirun worker
(``schedule_worker.py``) and the test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import dryrun_cases
import numpy as np

from zerosim.nn import GPT

# (layers, hidden, vocab, sequence, heads): two blocks, so that recomputation has two to redo
SHAPE = (2, 8, 50, 16, 2)
MODEL_SPEC = "gpt:" + ",".join(str(v) for v in SHAPE)
MICRO_BATCH = 2
STEPS = 2  # the schedule of the second step: stage 3 recorded its module trace in the first
# below the largest module (the token embedding, 50 × 8 = 400 parameters), above every block's
# largest matrix: DeepSpeed's prefetch budget min(max_live − live, prefetch bucket) is negative
BINDING_MAX_LIVE = 300


@dataclass(frozen=True)
class Case:
    stage: int
    schedule: str
    recompute: bool = False
    max_live: int | None = None
    overlap: bool = True  # overlap_comm: non-blocking reductions, waited later
    qgz: bool = False  # ZeRO++'s quantized gradients (and weights)
    metrics: bool = False  # Composer's train metrics, synced over the ranks after the step

    @property
    def name(self) -> str:
        name = f"stage{self.stage}-{self.schedule}" + ("-recompute" if self.recompute else "")
        name += "" if self.max_live is None else f"-max_live{self.max_live}"
        name += "-qgz" if self.qgz else ""
        name += "-metrics" if self.metrics else ""
        return name + ("" if self.overlap else "-no_overlap")


def cases() -> list[Case]:
    """Both stages on both schedules; recomputation on both schedules at stage 3 (where it
    gathers the blocks again) and on DeepSpeed's at stage 2; the binding cap; the paper's stage 2
    without ``overlap_comm``, whose blocking reduce-scatters complete inside the call (no wait);
    qgZ on DeepSpeed's schedule; DeepSpeed's stage 1 (its IPG buckets reduced at the boundary,
    in the order backward finishes the gradients); Composer's two train metrics (their sync's
    barriers and all-gathers after the step)."""
    return [
        Case(1, "deepspeed"),
        Case(2, "paper"),
        Case(2, "paper", overlap=False),
        Case(2, "deepspeed"),
        Case(2, "deepspeed", recompute=True),
        Case(3, "paper"),
        Case(3, "paper", recompute=True),
        Case(3, "deepspeed"),
        Case(3, "deepspeed", recompute=True),
        Case(3, "deepspeed", max_live=BINDING_MAX_LIVE),
        Case(3, "deepspeed", qgz=True),
        Case(3, "deepspeed", metrics=True),
    ]


METRICS = ("LanguageCrossEntropy", "LanguagePerplexity")  # as the dry run's recipe names them


def config(case: Case) -> dict:
    zero = {"stage": case.stage, "reduce_bucket_size": 300, "overlap_comm": case.overlap}
    if case.stage == 3:
        zero.update(stage3_param_persistence_threshold=10, stage3_prefetch_bucket_size=400)
    if case.max_live is not None:
        zero["stage3_max_live_parameters"] = case.max_live
    if case.qgz:
        zero.update(zero_quantized_weights=True, zero_quantized_gradients=True)
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
        "zerosim": {"schedule": case.schedule},
    }


def build_model() -> GPT:
    return dryrun_cases.build_model(SHAPE)


def batch(rank: int, micro_step: int) -> np.ndarray:
    return dryrun_cases.batch(rank, micro_step, SHAPE, MICRO_BATCH)


def schedule_of(events: list[tuple[str, Any]]) -> list[list]:
    """``[("issue", record) | ("wait", record) | ("stream", name), …]`` (``ledger.events``) as
    the lists compared."""
    issued: dict[int, int] = {}
    out: list[list] = []
    for kind, r in events:
        if kind == "stream":
            out.append(["stream", r])
        elif kind == "issue":
            issued[id(r)] = len(issued)
            out.append([r.op, r.phase, r.group, r.dtype, r.elements, r.blocking])
        elif id(r) in issued:
            out.append(["wait", issued[id(r)]])
        else:
            out.append(["wait", "earlier", r.op, r.group, r.elements])
    return out
