"""LAMB's and Muon's cost under ZeRO, reported: formulas (``zerosim volume --optimizer``) and
runs measured against them (``zerosim compare --optimizer``).

The formulas are ``zerosim.analysis.whole_params``'s. ``volume_data`` lays Ψ out as M equal
square matrices (every one a Muon matrix, or a LAMB parameter) and gives, per stage, Adam's
bytes per step (DeepSpeed's schedule, rank 0) and what the optimizer adds. ``compare`` trains
the demo model with the optimizer at each ZeRO stage on a world and sets the ledger of the
last step beside the formulas: for Muon every phase at stages 0-2 and the ``muon`` and
``clip`` phases at stage 3, for LAMB the ``lamb_norms`` phase.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from zerosim.analysis import step_bytes
from zerosim.analysis.stages import ZERO_STAGES
from zerosim.analysis.whole_params import (
    lamb_norm_bytes,
    muon_extra_bytes,
    muon_offload_bytes,
    muon_step_bytes,
    split_parameters,
)
from zerosim.comm import Communicator
from zerosim.config.optimizer import uses_muon
from zerosim.engine import initialize
from zerosim.report.compare import build_model, gradient_order

OPTIMIZERS = ("lamb", "muon")
BUCKET = 20000  # reduce_bucket_size of compare's runs, as compare.py's
SECTIONS = {
    "lamb": {"type": "Lamb", "params": {"lr": 1e-3}},
    "muon": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 1e-3}},
}


def volume_data(params: int, dp: int, optimizer: str, matrices: int, itemsize: int) -> dict:
    """Per stage: Adam's bytes per step and rank (DeepSpeed's schedule, rank 0) and the extra
    bytes of ``optimizer`` for Ψ laid out as ``matrices`` equal square matrices."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)}, got {optimizer!r}")
    side = math.isqrt(max(1, params // max(1, matrices)))
    if matrices < 1 or side < 1:
        raise ValueError(f"--matrices must be between 1 and Ψ, got {matrices}")
    shapes = [(side, side)] * matrices
    numels = [side * side] * matrices
    rows = {}
    for stage in ZERO_STAGES:
        if stage < 3:
            adam = step_bytes(stage, dp, 0, itemsize, schedule="deepspeed", numels=numels)
        else:
            padded = sum(-(-m // dp) * dp for m in numels)
            adam = step_bytes(3, dp, padded, itemsize)
        row: dict[str, Any] = {"adam": sum(adam.values())}
        if optimizer == "lamb":
            split = len(split_parameters(numels, dp, stage))
            row.update(split=split, extra=lamb_norm_bytes(split, dp, 0))
        else:
            extra = muon_extra_bytes(stage, shapes, [True] * matrices, dp, 0, itemsize)
            row["extra"] = sum(extra.values())
            if stage in (1, 2):
                reduced = muon_extra_bytes(
                    stage,
                    shapes,
                    [True] * matrices,
                    dp,
                    0,
                    itemsize,
                    use_multi_rank_bucket_allreduce=False,
                )
                row["extra_reduce"] = sum(reduced.values())
            row["split"] = len(split_parameters(numels, dp, stage))
            if stage > 0:  # under optimizer offload: stages 1-2 gather the fp32 master's dtype
                master = itemsize if stage == 3 else max(itemsize, 4)
                row["offload"] = muon_offload_bytes(stage, numels, dp, master)
        rows[f"stage{stage}"] = row
    return {
        "optimizer": optimizer,
        "params": matrices * side * side,
        "shape": [side, side],
        "matrices": matrices,
        "world_size": dp,
        "itemsize": itemsize,
        "stages": rows,
    }


MUON_COLUMNS = f" {'reduce to owners':>17} {'offload gathers':>16}"


def format_volume(data: dict) -> str:
    name = {"lamb": "LAMB", "muon": "Muon"}[data["optimizer"]]
    side = data["shape"][0]
    lines = [
        f"{name} under ZeRO: bytes sent by rank 0 per step beyond Adam's, Ψ = "
        f"{data['params']:,} as {data['matrices']} matrices {side}×{side}, N = "
        f"{data['world_size']}, b = {data['itemsize']} (DeepSpeed's schedule)",
        f"{'stage':>9} {'split':>6} {'Adam':>16} {'extra':>14} {'extra / Adam':>13}"
        + (MUON_COLUMNS if data["optimizer"] == "muon" else ""),
    ]
    for stage, row in data["stages"].items():
        ratio = row["extra"] / row["adam"] if row["adam"] else 0.0
        line = f"{stage:>9} {row['split']:>6} {row['adam']:>16,} {row['extra']:>14,} {ratio:>13.4f}"
        if data["optimizer"] == "muon":
            line += f" {row['extra_reduce']:>17,}" if "extra_reduce" in row else f" {'':>17}"
            line += f" {row['offload']:>16,}" if "offload" in row else ""
        lines.append(line)
    lines.append(
        "split: parameters a partition boundary cuts (at stages 1-2 none when N divides M: the "
        "partitions then align with the matrices)"
    )
    if data["optimizer"] == "muon":
        lines += [
            "stages 1-2: split matrices are all-reduced to their owners; DeepSpeed's default",
            "(use_multi_rank_bucket_allreduce) all-reduces every slice anyway: the extra is the",
            "second group's norm scalar; 'reduce to owners' is the extra with it false",
            "stage 3: gradient and momentum chunks gathered, updates and momentums shared:",
            "≈ 4(N−1)/N·Ψ_muon·b",
            "offload gathers: the Muon step under optimizer offload (every rank gathers every",
            "rank's owned gradient and momentum slices, fp32 at stages 1-2): ≈ 2(N−1)/N·Ψ_muon",
            "elements, in place of stage 3's gathers above (not counted in 'extra')",
        ]
    else:
        lines.append("one all-reduce of 2 float64 sums per split parameter: 2(N−1)/N·16·split")
    return "\n".join(lines)


def _config(optimizer: str, stage: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": BUCKET}
    if optimizer == "muon" and stage == 3:
        zero["reduce_scatter"] = False  # DeepSpeed's rule for Muon
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "optimizer": SECTIONS[optimizer],
        "zero_allow_untested_optimizer": optimizer == "lamb",
        "zero_optimization": zero,
    }


def _predicted(optimizer: str, stage: int, net: Any, n: int, rank: int, order: list) -> dict:
    named = list(net.named_parameters())
    if optimizer == "lamb":
        split = len(split_parameters([p.numel for _, p in named], n, stage))
        return {"lamb_norms": lamb_norm_bytes(split, n, rank)}
    shapes = [p.shape for _, p in named]
    is_muon = [uses_muon(name, p.shape) for name, p in named]
    return muon_step_bytes(
        stage,
        shapes,
        is_muon,
        n,
        rank,
        4,
        order=order if stage == 2 else None,
        reduce_bucket_size=BUCKET,
    )


def compare(comm: Communicator, optimizer: str, model: str = "mlp", steps: int = 2) -> dict:
    """Train ``optimizer`` at stages 0-3 on ``comm``; the last step's ledger beside the formulas
    (collective: every rank gets the same report)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)}, got {optimizer!r}")
    rows = []
    for stage in ZERO_STAGES:
        net, data = build_model(model)
        order = gradient_order(net)
        engine, _, loader, _ = initialize(
            net, _config(optimizer, stage), comm=comm, training_data=data
        )
        batches = iter(loader)
        for _ in range(steps):
            comm.ledger.reset()
            x, y = next(batches)
            engine.backward(engine(x, y))
            engine.step()
        want = _predicted(optimizer, stage, net, comm.size, comm.rank, order)
        phases = list(want)
        mine = [comm.ledger.bytes_sent(phase=p) for p in phases]
        rows_bytes = np.empty((comm.size, len(phases)), dtype=np.int64)
        every_want = np.empty_like(rows_bytes)
        with comm.phase("report"):
            comm.all_gather(rows_bytes.reshape(-1), np.asarray(mine, dtype=np.int64))
            comm.all_gather(every_want.reshape(-1), np.asarray([want[p] for p in phases], np.int64))
        rows.append(
            {
                "stage": stage,
                "phases": phases,
                "measured": rows_bytes.tolist(),
                "formula": every_want.tolist(),
                "equal": bool((rows_bytes == every_want).all()),
            }
        )
    return {
        "optimizer": optimizer,
        "model": model,
        "world_size": comm.size,
        "stages": rows,
        "ok": all(r["equal"] for r in rows),
    }


def format_report(report: dict) -> str:
    lines = [
        f"{report['optimizer']} on {report['model']}, N = {report['world_size']}: bytes sent "
        "per rank in the last step, measured | formula"
    ]
    for row in report["stages"]:
        lines.append(f"stage {row['stage']}: " + ("equal" if row["equal"] else "DIFFERENT"))
        for rank, (got, want) in enumerate(zip(row["measured"], row["formula"], strict=True)):
            cells = ", ".join(
                f"{p} {g:,}" + ("" if g == w else f" (formula {w:,})")
                for p, g, w in zip(row["phases"], got, want, strict=True)
            )
            lines.append(f"  rank {rank}: {cells}")
    return "\n".join(lines)
