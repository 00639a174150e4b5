"""zerosim's side of the peer tests: ``mpirun -n N python zs_driver.py PLAN OUT``.

The same cases, configs and data as ds_driver.py, on zerosim's engine. Writes
``OUT/<case>.rank<r>.json`` (each micro-step's loss; after each optimizer step its collectives
from the ledger, by op and message size as DeepSpeed's comms logger counts them, and the ledger
phases they carry, the reported gradient norm, the loss scale and the skipped steps so far) and,
on rank 0,
``OUT/<case>.npz`` (the fp32 weights after the last step, ``engine.full_state_dict()``).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import gas, micro_batch, model_of, zerosim_config  # noqa: E402

import zerosim as zs  # noqa: E402
from zerosim.comm import MPIComm  # noqa: E402


def ledger_snapshot(comm) -> tuple[dict[str, dict[str, int]], list[str], list[dict]]:
    """{op: {buffer bytes S: calls}} of this rank's ledger since the last snapshot (the test
    converts S to DeepSpeed's message-size convention), the phases the records carry, and the
    calls in order (op, dtype, S, group, peers: what the FSDP2 tests compare with torch's)."""
    out: dict[str, dict[str, int]] = {}
    calls = []
    for r in comm.ledger.records:
        sizes = out.setdefault(r.op, {})
        sizes[str(r.size_bytes)] = sizes.get(str(r.size_bytes), 0) + 1
        call = {"op": r.op, "dtype": r.dtype, "bytes": r.size_bytes, "group": r.group}
        calls.append(dict(call, peers=r.peers))
    phases = sorted({r.phase for r in comm.ledger.records})
    comm.ledger.reset()
    return out, phases, calls


def run_case(case: dict, out: Path, comm) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zs.initialize(model_of(case), zerosim_config(case), comm=comm)
    comm.ledger.reset()
    losses, steps, phases, norms, scales, skips, calls = [], [], [], [], [], [], []
    for step in range(case["steps"]):
        for micro in range(gas(case)):
            x, y = micro_batch(case, step, micro, comm.rank)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        collectives, labels, ordered = ledger_snapshot(comm)
        steps.append(collectives)
        calls.append(ordered)
        phases.append(labels)
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
        scales.append(float(engine.loss_scale))
        skips.append(int(engine.skipped_steps))
    weights = engine.full_state_dict()
    result = {"losses": losses, "steps": steps, "skipped": int(engine.skipped_steps)}
    result["phases"], result["calls"] = phases, calls
    result["norms"], result["scales"], result["skips"] = norms, scales, skips
    (out / f"{case['name']}.rank{comm.rank}.json").write_text(json.dumps(result))
    if comm.rank == 0:
        np.savez(out / f"{case['name']}.npz", **weights)
    # stage 3: this rank's chunk of each parameter (FSDP2: its rows, as ``DTensor.to_local()``)
    local_shards = getattr(engine.strategy, "local_shards", None)
    if local_shards is not None:
        np.savez(out / f"{case['name']}.shard{comm.rank}.npz", **local_shards())


def main() -> int:
    plan, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    comm = MPIComm()
    for case in plan["cases"]:
        run_case(case, out, comm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
