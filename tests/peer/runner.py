"""Run a plan of peer cases on both sides: DeepSpeed (or torch's FSDP2) under torchrun, zerosim
under mpirun.

One launch per side covers every case of the plan (DeepSpeed's start-up is most of its time),
so a pytest session pays two launches per world size, not two per case. The FSDP2 cases run each
side on its own (``run_fsdp2_side``, ``run_zerosim_side``), so torch's side is checked even when
zerosim's fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from mpi_helpers import ROOT, run_mpi

HERE = Path(__file__).resolve().parent
NAMES = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}


# A build of one of DeepSpeed's CPU ops (fused_adam, the shared-memory communicator) takes a minute
# or two here; a lock file older than this was left by a process killed while building or loading.
STALE_LOCK_S = 15 * 60


def clear_stale_extension_locks(now: float | None = None) -> list[Path]:
    """Remove the lock files torch's extension builder left behind, and return them.

    DeepSpeed builds its CPU ops on first use with ``torch.utils.cpp_extension``, which holds a
    ``lock`` file in the op's build folder while it builds or loads it. A process killed there
    (a test run interrupted, a time limit) leaves the file, and every later launch waits for it
    to go away, for ever. Only files older than ``STALE_LOCK_S`` are removed: a build under way
    is younger."""
    root = Path(
        os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    )
    now = time.time() if now is None else now
    stale = [p for p in root.glob("**/lock") if now - p.stat().st_mtime > STALE_LOCK_S]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def run_deepspeed(n: int, plan: Path, out: Path, timeout: float = 1200) -> None:
    """``torchrun --standalone --nproc_per_node n ds_driver.py plan out``; raises with its output
    on failure.

    ``--standalone``: torchrun's rendezvous binds a port the OS picks, so no other process can take
    it between choosing and binding (a port chosen here and passed as ``--master_port`` could be,
    and once was: EADDRINUSE)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", str(n)]
    cmd += [str(HERE / "ds_driver.py"), str(plan), str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for lock in clear_stale_extension_locks():
        print(f"removed a stale build lock of DeepSpeed's CPU ops: {lock}", file=sys.stderr)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(
            f"DeepSpeed run failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
            f"{proc.stderr[-6000:]}"
        )


def run_zerosim(n: int, plan: Path, out: Path, timeout: float = 1200) -> None:
    proc = run_mpi(n, [str(HERE / "zs_driver.py"), str(plan), str(out)], timeout=timeout)
    if proc.returncode:
        raise RuntimeError(
            f"zerosim run failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )


def run_fsdp2(n: int, plan: Path, out: Path, timeout: float = 1200) -> None:
    """``torchrun --standalone --nproc_per_node n fsdp2_driver.py plan out``: torch's
    ``fully_shard`` on gloo; raises with its output on failure."""
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", str(n)]
    cmd += [str(HERE / "fsdp2_driver.py"), str(plan), str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(
            f"torch FSDP2 run failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
            f"{proc.stderr[-6000:]}"
        )


def write_plan(cases: list[dict], work: Path) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    plan = work / "plan.json"
    plan.write_text(json.dumps({"cases": cases}))
    return plan


def read_side(n: int, cases: list[dict], out: Path) -> dict[str, dict]:
    """{case name: {"ranks": per-rank JSON, "weights": full weights, "shards": each rank's
    local shards (None where a side wrote none)}} of one side's output folder."""
    import numpy as np

    def load(path: Path) -> dict | None:
        if not path.exists():
            return None
        with np.load(path) as f:
            return {k: f[k] for k in f.files}

    results: dict[str, dict] = {}
    for case in cases:
        name = case["name"]
        ranks = [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(n)]
        shards = [load(out / f"{name}.shard{r}.npz") for r in range(n)]
        results[name] = {"ranks": ranks, "weights": load(out / f"{name}.npz"), "shards": shards}
    return results


def run_fsdp2_side(n: int, cases: list[dict], work: Path) -> dict[str, dict]:
    """torch's FSDP2 side of a plan of FSDP2 cases (``read_side``'s results)."""
    plan = write_plan(cases, work)
    (work / "torch").mkdir(parents=True, exist_ok=True)
    run_fsdp2(n, plan, work / "torch")
    return read_side(n, cases, work / "torch")


def run_zerosim_side(n: int, cases: list[dict], work: Path) -> dict[str, dict]:
    """zerosim's side of the same plan (``zerosim.schedule`` "fsdp2") under mpirun."""
    plan = write_plan(cases, work)
    (work / "zs").mkdir(parents=True, exist_ok=True)
    run_zerosim(n, plan, work / "zs")
    return read_side(n, cases, work / "zs")


def run_both(n: int, cases: list[dict], work: Path) -> dict[str, dict]:
    """{case name: {"ds": {...}, "zs": {...}}} with each side's per-rank JSON and weights."""
    work.mkdir(parents=True, exist_ok=True)
    for case in cases:  # hpZ over the whole world: the one hpZ size every N of the plan allows
        if case.pop("hpz_is_world", False):
            case["config"]["zero_optimization"]["zero_hpz_partition_size"] = n
    plan = work / "plan.json"
    plan.write_text(json.dumps({"cases": cases}))
    sides = {"ds": work / "ds", "zs": work / "zs"}
    for out in sides.values():
        out.mkdir(parents=True, exist_ok=True)
    run_deepspeed(n, plan, sides["ds"])
    run_zerosim(n, plan, sides["zs"])
    results: dict[str, dict] = {}
    for case in cases:
        name = case["name"]
        results[name] = {}
        for side, out in sides.items():
            ranks = [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(n)]
            import numpy as np

            with np.load(out / f"{name}.npz") as f:
                weights = {k: f[k] for k in f.files}
            results[name][side] = {"ranks": ranks, "weights": weights}
    return results


def deepspeed_step(step: dict, stage: int) -> dict[str, dict[int, int]]:
    """{op: {message bytes: calls}} of DeepSpeed's comms logger, stage 3's broadcasts left out."""
    out: dict[str, dict[int, int]] = {}
    for op, sizes in step.items():
        if op == "broadcast" and stage == 3:
            continue
        merged = out.setdefault(NAMES.get(op, op), {})  # Muon's stage 3 logs both all-gathers
        for size, calls in sizes.items():
            merged[int(size)] = merged.get(int(size), 0) + calls
    return out


def zerosim_step(step: dict, n: int) -> dict[str, dict[int, int]]:
    """The same from zerosim's ledger (buffer bytes S), in DeepSpeed's size convention."""
    out: dict[str, dict[int, int]] = {}
    for op, sizes in step.items():
        per = n if op == "all_gather" else 1
        out[op] = {int(size) // per: calls for size, calls in sizes.items()}
    return out
