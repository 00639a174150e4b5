"""torch's FSDP2 side of the FSDP2 peer tests:
``torchrun --standalone --nproc_per_node N fsdp2_driver.py PLAN OUT``.

Runs every case of PLAN (JSON, see cases.py; each config selects ``"zerosim": {"schedule":
"fsdp2", "fsdp2": {...}}``) as a torch user runs FSDP2 on gloo: the torch twin of the case's
zerosim model (same initial weights, loaded by name), ``fully_shard`` on each transformer block
(each Linear of an MLP) and then on the root, with the case's ``reshard_after_forward`` and
``MixedPrecisionPolicy``, on a 1-D mesh or, with ``replicate`` > 1, HSDP's 2-D mesh
``(replicate, shard)``; the optimizer of the config over ``model.parameters()``; gradient
accumulation with ``set_requires_gradient_sync(False)`` on all but the last micro-batch (and
``set_reshard_after_backward(False)`` there when ``reshard_after_backward`` is false), or with
neither under ``reduce_every_micro_batch`` (torch's default: every micro-batch reduces); clipping
with ``clip_grad_norm_`` on the DTensor gradients.

Every collective torch issues while training is recorded in order by ``Recorder``, which wraps
the functions FSDP2 and DTensor call: ``dist.all_gather_single`` (FSDP2's all-gather of a unit),
``dist.reduce_scatter_single`` (its reduce-scatter), ``dist.all_reduce`` (HSDP's all-reduce
across replicas) and ``_functional_collectives.all_reduce`` (DTensor's reduction of a partial
value: the gradient norm). ``CommDebugMode`` counts the same step independently (its counts are
written beside the records, and the tests hold the two equal). Sizes follow zerosim's ledger:
the whole buffer of a call (an all-gather's output, a reduce-scatter's input).

Writes ``OUT/<case>.rank<r>.json`` (each micro-step's loss; per optimizer step the ordered
collectives, CommDebugMode's counts and the gradient norm), ``OUT/<case>.shard<r>.npz`` (this
rank's local shard of each parameter, ``to_local()``: its rows of dim 0, unpadded) and, on
rank 0, ``OUT/<case>.npz`` (the full fp32 weights after the last step, ``full_tensor()``).
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

# DTensor reduces a partial value (the gradient norm) through this module: the recorder wraps it
import torch.distributed._functional_collectives as funcol  # noqa: PLC2701
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.debug import CommDebugMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import gas, micro_batch, model_of, twin_of  # noqa: E402

DTYPES = {None: None, "float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULTS = {
    "reshard_after_forward": True,
    "param_dtype": None,
    "reduce_dtype": None,
    "replicate": 1,
    "reshard_after_backward": True,
    "reduce_every_micro_batch": False,
    "units": "blocks",
}
# CommDebugMode's names of the ops the recorder sees
DEBUG_NAMES = {
    "c10d._allgather_base_": "all_gather",
    "c10d._reduce_scatter_base_": "reduce_scatter",
    "c10d.allreduce_": "all_reduce",
    "c10d_functional.all_reduce": "all_reduce",
}


def fsdp2_settings(case: dict) -> dict[str, Any]:
    """The case's ``zerosim.fsdp2`` section with the interface's defaults filled in."""
    given = case["config"].get("zerosim", {}).get("fsdp2", {})
    return {**DEFAULTS, **given}


class Recorder:
    """Records each collective torch issues while ``on``: kind, dtype, bytes of the whole buffer,
    reduction op and the world ranks of its group, in the order they were issued."""

    def __init__(self) -> None:
        self.on = False
        self.calls: list[dict[str, Any]] = []
        self._originals: dict[tuple[Any, str], Any] = {}

    def install(self) -> None:
        self._wrap(dist, "all_gather_single", "all_gather", lambda a, k: (a[0], _group(a, k, 2)))
        self._wrap(dist, "reduce_scatter_single", "reduce_scatter", _reduce_scatter_args)
        self._wrap(dist, "all_reduce", "all_reduce", lambda a, k: (a[0], _group(a, k, 2)))
        self._wrap(funcol, "all_reduce", "all_reduce", _funcol_all_reduce_args)

    def uninstall(self) -> None:
        for (module, name), original in self._originals.items():
            setattr(module, name, original)
        self._originals.clear()

    def _wrap(self, module: Any, name: str, kind: str, describe) -> None:
        original = getattr(module, name)
        self._originals[(module, name)] = original

        def recorded(*args, **kwargs):
            if self.on:
                buffer, group = describe(args, kwargs)
                self.calls.append(
                    {
                        "op": kind,
                        "dtype": str(buffer.dtype).removeprefix("torch."),
                        "bytes": buffer.numel() * buffer.element_size(),
                        "reduce": None if kind == "all_gather" else _reduce_name(args, kwargs),
                        "ranks": dist.get_process_group_ranks(group),
                    }
                )
            return original(*args, **kwargs)

        setattr(module, name, recorded)

    def take(self) -> list[dict[str, Any]]:
        calls, self.calls = self.calls, []
        return calls


def _group(args: tuple, kwargs: dict, position: int) -> Any:
    group = kwargs.get("group", args[position] if len(args) > position else None)
    return group if group is not None else dist.group.WORLD


def _reduce_scatter_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor, Any]:
    return kwargs.get("input", args[1] if len(args) > 1 else None), _group(args, kwargs, 2)


def _funcol_all_reduce_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor, Any]:
    group = kwargs.get("group", args[2] if len(args) > 2 else None)
    if isinstance(group, tuple):  # (mesh, mesh dim), as DTensor passes it
        group = group[0].get_group(group[1])
    return args[0], group


def _reduce_name(args: tuple, kwargs: dict) -> str:
    op = kwargs.get("op", kwargs.get("reduceOp"))
    if op is None:
        op = next((a for a in args[1:] if isinstance(a, (str, dist.ReduceOp))), "sum")
    text = str(op).lower()
    for name in ("premul_sum", "avg", "sum"):
        if name in text:
            return name
    return text


def units_of(twin: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules a torch user gives ``fully_shard`` before the root: each transformer block, or
    each Linear of an MLP (its repeated layers)."""
    if hasattr(twin, "blocks"):
        return list(twin.blocks)
    return [m for m in twin.layers if isinstance(m, torch.nn.Linear)]


def mesh_of(settings: dict[str, Any]):
    """A 1-D mesh over the world, or HSDP's ``(replicate, shard)`` mesh."""
    n, replicate = dist.get_world_size(), int(settings["replicate"])
    if replicate == 1:
        return init_device_mesh("cpu", (n,))
    return init_device_mesh("cpu", (replicate, n // replicate), mesh_dim_names=("rep", "shard"))


def shard(twin: torch.nn.Module, settings: dict[str, Any]) -> None:
    """``fully_shard`` each unit with the case's ``reshard_after_forward``, then the root with
    torch's default (the root is not resharded after forward: its parameters would be gathered
    again at once for backward)."""
    mesh = mesh_of(settings)
    policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[settings["param_dtype"]], reduce_dtype=DTYPES[settings["reduce_dtype"]]
    )
    for unit in units_of(twin):
        fully_shard(
            unit,
            mesh=mesh,
            reshard_after_forward=settings["reshard_after_forward"],
            mp_policy=policy,
        )
    fully_shard(twin, mesh=mesh, mp_policy=policy)


def optimizer_of(config: dict, params) -> torch.optim.Optimizer:
    """The config's optimizer as DeepSpeed builds it with ``torch_adam``: Adam in AdamW mode
    (DeepSpeed's default ``adam_w_mode``) is ``torch.optim.AdamW``; torch's defaults otherwise."""
    spec = config["optimizer"]
    kind, hyper = spec["type"].lower(), dict(spec.get("params", {}))
    hyper.pop("torch_adam", None)
    adam_w_mode = hyper.pop("adam_w_mode", True)
    if kind == "adamw" or (kind == "adam" and adam_w_mode):
        return torch.optim.AdamW(params, **hyper)
    if kind == "adam":
        return torch.optim.Adam(params, **hyper)
    if kind == "sgd":
        return torch.optim.SGD(params, **hyper)
    raise ValueError(f"optimizer.type {spec['type']!r}: the FSDP2 driver runs Adam, AdamW, SGD")


def micro_step(twin, case, step: int, micro: int, settings: dict[str, Any]) -> float:
    """One micro-batch: forward, and backward of loss / gradient_accumulation_steps (as
    DeepSpeed scales it), reducing gradients only on the last micro-batch (on every one under
    ``reduce_every_micro_batch``)."""
    last = micro == gas(case) - 1
    if gas(case) > 1 and not settings["reduce_every_micro_batch"]:
        twin.set_requires_gradient_sync(last)
        if not settings["reshard_after_backward"]:
            twin.set_reshard_after_backward(last)
    x, y = micro_batch(case, step, micro, dist.get_rank())
    loss = twin(torch.tensor(x), torch.tensor(y))
    (loss / gas(case)).backward()
    return float(loss)


def train_step(twin, optimizer, case: dict, step: int, recorder: Recorder) -> dict[str, Any]:
    """One optimizer step: its micro-steps' losses, the gradient norm, the collectives in order
    and CommDebugMode's counts of them. With clipping the norm is ``clip_grad_norm_``'s, over the
    DTensor gradients (its all-reduce is part of the step); without, training takes no norm, and
    the same norm is taken outside the records and counts, for the comparison only."""
    clip = float(case["config"].get("gradient_clipping", 0.0))
    settings, losses, count = fsdp2_settings(case), [], {}
    recorder.on = True
    for micro in range(gas(case)):  # one CommDebugMode a forward: its module tracker
        with CommDebugMode() as debug:  # fails on a second forward in the same context
            losses.append(micro_step(twin, case, step, micro, settings))
        add_counts(count, debug)
    recorder.on = clip > 0
    with CommDebugMode() if clip > 0 else contextlib.nullcontext() as debug:
        if clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(twin.parameters(), clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in twin.parameters()])
    if clip > 0:
        add_counts(count, debug)
    recorder.on = True
    with CommDebugMode() as debug:  # the optimizer's step on the shards: no collective
        optimizer.step()
        optimizer.zero_grad()
    add_counts(count, debug)
    recorder.on = False
    norm = float(norm.full_tensor())
    return {"losses": losses, "norm": norm, "calls": recorder.take(), "counts": count}


def run_case(case: dict, out: Path, recorder: Recorder) -> None:
    rank = dist.get_rank()
    twin = twin_of(case, model_of(case))
    shard(twin, fsdp2_settings(case))
    optimizer = optimizer_of(case["config"], twin.parameters())
    steps = [train_step(twin, optimizer, case, step, recorder) for step in range(case["steps"])]
    result = {
        "losses": [loss for s in steps for loss in s["losses"]],
        "norms": [s["norm"] for s in steps],
        "steps": [s["calls"] for s in steps],
        "debug_counts": [s["counts"] for s in steps],
        "settings": fsdp2_settings(case),
    }
    local = {n: p.to_local().detach().float().numpy().copy() for n, p in twin.named_parameters()}
    full = {n: p.full_tensor().detach().float().numpy().copy() for n, p in twin.named_parameters()}
    (out / f"{case['name']}.rank{rank}.json").write_text(json.dumps(result))
    np.savez(out / f"{case['name']}.shard{rank}.npz", **local)
    if rank == 0:
        np.savez(out / f"{case['name']}.npz", **full)
    del twin, optimizer
    gc.collect()


def add_counts(count: dict[str, int], debug: CommDebugMode) -> None:
    """Add CommDebugMode's calls by kind, in the recorder's names, to ``count``."""
    for op, calls in debug.get_comm_counts().items():
        name = DEBUG_NAMES.get(str(op), str(op))
        count[name] = count.get(name, 0) + calls


def main() -> int:
    plan, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    recorder = Recorder()
    recorder.install()
    try:
        for case in plan["cases"]:
            run_case(case, out, recorder)
    finally:
        recorder.uninstall()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
