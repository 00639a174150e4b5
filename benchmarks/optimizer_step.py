"""Optimizer-step bandwidth: zerosim's blocked update rules against numpy copy and torch.optim.

One step of Adam, AdamW and SGD with momentum on a flat float32 shard (what the ZeRO
engine steps on each rank). An update must read and write a fixed number of arrays per
element (Adam: read θ, g, m, v and write θ, m, v = 7 × 4 bytes), so its *effective
bandwidth* is those bytes ÷ the step time. The ceiling is what the machine can stream:
numpy's copy bandwidth (read + write), measured in the same run, before each case (the
best is kept). torch.optim's single-tensor (foreach=False) and foreach implementations step
the same data. Every time is the fastest of ``--repeats`` calls after a warm-up call (the
least disturbed by other processes on a shared machine).

    python benchmarks/optimizer_step.py --numel 8388608 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zerosim.optim as zo  # noqa: E402  (after the path set-up above)

try:
    import torch
except ImportError:  # torch is a test dependency only; the benchmark runs without it
    torch = None


@dataclass(eq=False)  # hashed by identity, as optimizer state is keyed
class Shard:
    """A flat master-weight slice as the ZeRO engine hands it to the optimizer."""

    data: np.ndarray
    grad: np.ndarray


# name, arrays read + written per element, zerosim factory, torch factory (same arguments)
CASES = [
    (
        "Adam",
        7,
        lambda p: zo.Adam([p], lr=1e-3),
        lambda p, fe: torch.optim.Adam([p], lr=1e-3, foreach=fe),
    ),
    (
        "AdamW",
        7,
        lambda p: zo.AdamW([p], lr=1e-3, weight_decay=0.01),
        lambda p, fe: torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, foreach=fe),
    ),
    (
        "SGD-momentum",
        5,
        lambda p: zo.SGD([p], lr=1e-3, momentum=0.9),
        lambda p, fe: torch.optim.SGD([p], lr=1e-3, momentum=0.9, foreach=fe),
    ),
]


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Fastest wall time of ``fn()`` over ``repeats`` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def copy_bandwidth(src: np.ndarray, repeats: int) -> float:
    """numpy copy bandwidth in bytes/s: ``src`` read and a new array of its size written."""
    dst = np.empty_like(src)
    return 2 * src.nbytes / best_seconds(lambda: np.copyto(dst, src), repeats)


def machine_note() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    torch_note = (
        f"torch {torch.__version__} ({torch.get_num_threads()} intra-op threads)"
        if torch is not None
        else "torch not installed"
    )
    return (
        f"{cpu}, {os.cpu_count()} logical CPUs, Python {platform.python_version()}, "
        f"numpy {np.__version__} (single-threaded), {torch_note}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=64 * 2**20, help="shard elements")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per measurement")
    parser.add_argument(
        "--torch-threads", type=int, default=None, help="torch intra-op threads (default: torch's)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if args.numel < 1 or args.repeats < 1:
        parser.error(f"--numel and --repeats must be >= 1; got {args.numel}, {args.repeats}")
    if torch is not None and args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)

    rng = np.random.default_rng(0)
    init = rng.standard_normal(args.numel, dtype=np.float32)
    grad = rng.standard_normal(args.numel, dtype=np.float32)

    copy_bw = 0.0
    rows = []
    for name, arrays, make_zerosim, make_torch in CASES:
        copy_bw = max(copy_bw, copy_bandwidth(init, args.repeats))
        moved = arrays * 4 * args.numel
        shard = Shard(init.copy(), grad)
        opt = make_zerosim(shard)
        ours = best_seconds(opt.step, args.repeats)
        del opt, shard
        theirs = {}
        if torch is not None:
            for label, foreach in (("torch single", False), ("torch foreach", True)):
                tp = torch.from_numpy(init.copy()).requires_grad_()
                tp.grad = torch.from_numpy(grad)
                topt = make_torch(tp, foreach)
                theirs[label] = best_seconds(topt.step, args.repeats)
                del topt, tp
        for impl, seconds in [("zerosim", ours), *theirs.items()]:
            rows.append((name, impl, seconds, moved / seconds, ours))

    print(f"optimizer step on a float32 shard of {args.numel:,} elements, best of {args.repeats}")
    print(f"machine: {machine_note()}")
    print(f"numpy copy bandwidth: {copy_bw / 1e9:.2f} GB/s (read + write, best before each case)")
    print()
    header = f"{'optimizer':<13} {'implementation':<14} {'ms/step':>9} {'GB/s':>7} {'÷ copy':>7}"
    header += f" {'zerosim speed-up':>17}"
    print(header)
    print("-" * len(header))
    for name, impl, seconds, bandwidth, ours in rows:
        speedup = "" if impl == "zerosim" else f"{seconds / ours:.2f}x"
        print(
            f"{name:<13} {impl:<14} {seconds * 1e3:>9.2f} {bandwidth / 1e9:>7.2f} "
            f"{bandwidth / copy_bw:>7.2f} {speedup:>17}"
        )
    print()
    print("GB/s: bytes the update must read + write (Adam/AdamW 7, SGD-momentum 5 float32")
    print("arrays per element) / time. zerosim speed-up: that row's time / zerosim's time.")
    if args.json:
        records = [
            {
                "optimizer": name,
                "implementation": impl,
                "numel": args.numel,
                "seconds": seconds,
                "gbps": bandwidth / 1e9,
                "copy_gbps": copy_bw / 1e9,
            }
            for name, impl, seconds, bandwidth, _ in rows
        ]
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
