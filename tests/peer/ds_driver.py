"""DeepSpeed's side of the peer tests: ``torchrun --nproc_per_node N ds_driver.py PLAN OUT``.

Runs every case of PLAN (JSON, see cases.py) with DeepSpeed on gloo, one engine after another in
one launch: the torch twin of the case's zerosim model (same initial weights, loaded by name),
the case's config with the comms logger on, the case's data. Writes ``OUT/<case>.rank<r>.json``
(each micro-step's loss; after each optimizer step its collectives from the comms logger, the
reported gradient norm, the loss scale and the skipped steps so far) and, on rank 0,
``OUT/<case>.npz`` (the fp32 weights after the last step: ``safe_get_full_fp32_param`` under
ZeRO, the module's parameters at stage 0).

fp16: DeepSpeed's CPU accelerator says it has fp16 only where oneDNN has fp16 matrix products
(``torch.ops.mkldnn._is_mkldnn_fp16_supported()``: true on CPUs with AMX-FP16, false on most
others), and its engines run on CPU either way. So this driver pins
``get_accelerator().is_fp16_supported`` for each case, undone after it: True for fp16 cases
(fp16 training and the dynamic loss scaler are then compared end to end), False for every other
one, whatever the CPU. The answer matters beyond fp16: DeepSpeed's Muon runs its Gram
Newton-Schulz in fp16 where the accelerator says yes, else in fp32 (``ns_compute_dtype``), and
zerosim's Muon runs it in fp32, DeepSpeed's choice without fp16 matrix products; unpinned, every
Muon case differed by about 1e-4 in its losses on a CPU with AMX-FP16.

One engine per process, as a user's program has: stage 3 replaces ``torch.nn.functional.linear``
with its own (``zero3_linear_wrap``; DeepSpeed: "This will persist unless manually reset"),
whose backward hands a Linear's weight and bias gradients over in another order, so a stage 1-2
engine built after a stage-3 one in the same process cuts its gradient buckets otherwise (seen:
a reduce of 820 bytes became 760 + 60). The driver puts torch's linear back after each case.
"""

from __future__ import annotations

import gc
import json
import logging
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import TESTS, gas, micro_batch, model_of, twin_of  # noqa: E402

sys.path.insert(0, str(TESTS))
import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
from deepspeed.comm import comm as ds_comm  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402


def comms_snapshot() -> dict[str, dict[str, int]]:
    """{op: {message bytes: calls}} since the last snapshot (the comms logger's counts)."""
    logger = ds_comm.comms_logger
    out = {
        op: {str(size): v[0] for size, v in sizes.items()}
        for op, sizes in logger.comms_dict.items()
    }
    logger.comms_dict.clear()
    return out


def run_case(case: dict, out: Path) -> None:
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    fp16 = bool(case["config"].get("fp16", {}).get("enabled"))
    accelerator.is_fp16_supported = lambda: fp16  # pinned whatever the CPU: module docstring
    try:
        _run_case(case, out)
    finally:  # only for that case: Muon's Newton-Schulz picks fp16 where the accelerator says so
        vars(accelerator).pop("is_fp16_supported", None)
        restore_torch_linear()


def restore_torch_linear() -> None:
    """Undo stage 3's process-wide ``torch.nn.functional.linear`` patch (module docstring)."""
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses

    original = getattr(InsertPostInitMethodToModuleSubClasses, "linear_bk", None)
    if original is not None:
        torch.nn.functional.linear = original


def _run_case(case: dict, out: Path) -> None:
    rank = dist.get_rank()
    cfg = dict(case["config"], comms_logger={"enabled": True, "prof_all": True})
    twin = twin_of(case, model_of(case))
    engine, *_ = deepspeed.initialize(model=twin, model_parameters=twin.parameters(), config=cfg)
    dtype = next(engine.module.parameters()).dtype
    init = comms_snapshot()
    losses, steps, norms, scales, skips = [], [], [], [], []
    for step in range(case["steps"]):
        for micro in range(gas(case)):
            x, y = micro_batch(case, step, micro, rank)
            tx = torch.tensor(x)
            tx = tx.to(dtype) if tx.is_floating_point() else tx
            loss = engine(tx, torch.tensor(y))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        steps.append(comms_snapshot())
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
        # ZeRO's optimizers and the fp16/bf16 wrappers hold the scale; the client's torch
        # optimizer (stage 0 in fp32) has none: 1
        scales.append(float(getattr(engine.optimizer, "loss_scale", 1.0)))
        skips.append(int(engine.skipped_steps))
    weights = {}
    # DeepSpeed 0.19.8's safe_get_full_fp32_param maps a parameter to another's fp32 slice when
    # round_robin_gradients reorders the flat buffer (wpe reads back a LayerNorm weight, while
    # training, and so the losses, are right): read the module's own fp32 parameters there
    round_robin = cfg["zero_optimization"].get("round_robin_gradients", False)
    for name, p in engine.module.named_parameters():
        full = None if round_robin else safe_get_full_fp32_param(p)
        full = p.detach() if full is None else full
        weights[name] = full.float().numpy().copy()
    result = {"losses": losses, "steps": steps, "init": init, "clip": engine.gradient_clipping()}
    result["skipped"] = int(getattr(engine, "skipped_steps", 0))
    result["norms"], result["scales"], result["skips"] = norms, scales, skips
    (out / f"{case['name']}.rank{rank}.json").write_text(json.dumps(result))
    if rank == 0:
        np.savez(out / f"{case['name']}.npz", **weights)
    engine.destroy()
    del engine
    gc.collect()


def main() -> int:
    plan, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    for case in plan["cases"]:
        run_case(case, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
