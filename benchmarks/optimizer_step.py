"""Optimizer-step bandwidth: zerosim's update rules against the copy bandwidth and torch.optim.

One step of Adam, AdamW and SGD with momentum on a flat float32 shard (what the ZeRO
engine steps on each rank). An update must read and write a fixed number of arrays per
element (Adam: read θ, g, m, v and write θ, m, v = 7 × 4 bytes), so its *effective
bandwidth* is those bytes ÷ the step time. The ceiling is the machine's copy bandwidth,
counted as STREAM's Copy kernel counts it (McCalpin, "STREAM: Sustainable Memory Bandwidth
in High Performance Computers"): ``a[i] = b[i]`` over arrays far larger than the caches,
2 × the array's bytes moved (one read, one write) ÷ the best time; here ``numpy.copyto``
of the shard, timed in turn with the steps of every case (the best is kept).

Implementations, each on one thread:

- ``zerosim``: the rule as it runs by default, the fused numba kernel when numba is
  installed (zerosim.optim.functional.fused), else the NumPy blocks;
- ``zerosim numpy``: the NumPy blocks, forced (``ZEROSIM_FUSED=0``), when numba is installed;
- ``torch single`` / ``torch foreach`` / ``torch fused``: torch.optim with foreach=False,
  foreach=True and fused=True (torch's fused CPU kernel), with ``torch.set_num_threads``
  (default 1; restored afterwards).

The implementations of one case and the copy are timed in turns, one call each per round in
a shuffled order, and each keeps its fastest of ``--repeats`` rounds after a warm-up call
(the least disturbed by other processes on a shared machine). The first zerosim step, timed
apart, includes loading the compiled kernel (or compiling it when numba's cache is empty).

    python benchmarks/optimizer_step.py --numel 16777216 --repeats 15
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zerosim.optim as zo  # noqa: E402  (after the path set-up above)
from zerosim.optim.functional import fused  # noqa: E402

try:
    import torch
except ImportError:  # torch is a test dependency only; the benchmark runs without it
    torch = None


@dataclass(eq=False)  # hashed by identity, as optimizer state is keyed
class Tile:
    """A flat master-weight slice as the ZeRO engine hands it to the optimizer."""

    data: np.ndarray
    grad: np.ndarray


# name, arrays read + written per element, zerosim factory, torch factory (same arguments)
CASES = [
    (
        "Adam",
        7,
        lambda p: zo.Adam([p], lr=1e-3),
        lambda p, kw: torch.optim.Adam([p], lr=1e-3, **kw),
    ),
    (
        "AdamW",
        7,
        lambda p: zo.AdamW([p], lr=1e-3, weight_decay=0.01),
        lambda p, kw: torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, **kw),
    ),
    (
        "SGD-momentum",
        5,
        lambda p: zo.SGD([p], lr=1e-3, momentum=0.9),
        lambda p, kw: torch.optim.SGD([p], lr=1e-3, momentum=0.9, **kw),
    ),
]
TORCH_VARIANTS = {
    "torch single": {"foreach": False},
    "torch foreach": {"foreach": True},
    "torch fused": {"fused": True},
}


def best_in_turns(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each function's fastest time over ``repeats`` rounds of one call each (after a warm-up
    call each), in a new order every round (seeded), so that a disturbance of the machine
    hits every function alike, whatever its place in the round."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    order = list(fns)
    rng = random.Random(0)
    for _ in range(repeats):
        rng.shuffle(order)
        for name in order:
            start = time.perf_counter()
            fns[name]()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def stream_copy(src: np.ndarray) -> Callable[[], None]:
    """STREAM's Copy kernel, ``dst[i] = src[i]``: it moves 2 × ``src.nbytes`` per call."""
    dst = np.empty_like(src)
    return lambda: np.copyto(dst, src)


def machine_note(torch_threads: int | None) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    torch_note = (
        f"torch {torch.__version__} ({torch_threads} intra-op thread(s))"
        if torch is not None
        else "torch not installed"
    )
    if fused.fused_enabled():
        import numba

        ours = f"zerosim: fused numba {numba.__version__} kernels, one thread"
    else:
        ours = "zerosim: NumPy blocks, one thread (numba not installed or ZEROSIM_FUSED=0)"
    return (
        f"{cpu}, {os.cpu_count()} logical CPUs, Python {platform.python_version()}, "
        f"numpy {np.__version__} (single-threaded); {ours}; {torch_note}"
    )


def zerosim_steps(make: Callable, init: np.ndarray, grad: np.ndarray) -> dict[str, Callable]:
    """zerosim's step on a fresh shard, on the default path and (with numba) on NumPy's."""
    paths = {"zerosim": None}
    if fused.fused_enabled():
        paths["zerosim numpy"] = False
    steps = {}
    for label, path in paths.items():
        opt = make(Tile(init.copy(), grad))

        def step(opt=opt, path=path) -> None:
            with fused.use_fused(path):
                opt.step()

        steps[label] = step
    return steps


def torch_steps(make: Callable, init: np.ndarray, grad: np.ndarray) -> dict[str, Callable]:
    steps = {}
    for label, kwargs in TORCH_VARIANTS.items():
        tp = torch.from_numpy(init.copy()).requires_grad_()
        tp.grad = torch.from_numpy(grad)
        steps[label] = make(tp, kwargs).step
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=2**24, help="shard elements")
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if args.numel < 1 or args.repeats < 1 or args.torch_threads < 1:
        parser.error(
            f"--numel, --repeats and --torch-threads must be >= 1; got {args.numel}, "
            f"{args.repeats}, {args.torch_threads}"
        )
    threads_before = torch.get_num_threads() if torch is not None else None
    if torch is not None:
        torch.set_num_threads(args.torch_threads)
    try:
        rows, copy_bw, first = measure(args.numel, args.repeats)
    finally:
        if torch is not None:
            torch.set_num_threads(threads_before)
    report(rows, copy_bw, first, args)
    return 0


def measure(numel: int, repeats: int) -> tuple[list[tuple], float, float]:
    """Rows (optimizer, implementation, seconds, GB/s, zerosim's seconds), the copy bandwidth
    and the first zerosim step's time."""
    rng = np.random.default_rng(0)
    init = rng.standard_normal(numel, dtype=np.float32)
    grad = rng.standard_normal(numel, dtype=np.float32)
    first_shard = Tile(init.copy(), grad)
    first_opt = CASES[0][2](first_shard)
    start = time.perf_counter()
    first_opt.step()
    first = time.perf_counter() - start
    del first_opt, first_shard

    copy_seconds = float("inf")
    rows = []
    for name, arrays, make_zerosim, make_torch in CASES:
        steps = zerosim_steps(make_zerosim, init, grad)
        if torch is not None:
            steps.update(torch_steps(make_torch, init, grad))
        seconds = best_in_turns({**steps, "copy": stream_copy(init)}, repeats)
        copy_seconds = min(copy_seconds, seconds.pop("copy"))
        del steps
        moved = arrays * 4 * numel
        for impl, s in seconds.items():
            rows.append((name, impl, s, moved / s, seconds["zerosim"]))
    return rows, 2 * init.nbytes / copy_seconds, first


def report(rows: list[tuple], copy_bw: float, first: float, args: argparse.Namespace) -> None:
    print(f"optimizer step on a float32 shard of {args.numel:,} elements, best of {args.repeats}")
    print(f"machine: {machine_note(args.torch_threads)}")
    print(f"copy bandwidth (STREAM Copy, 2 arrays counted): {copy_bw / 1e9:.2f} GB/s")
    print(f"first zerosim step (loading or compiling the kernel): {first:.2f} s")
    print()
    header = f"{'optimizer':<13} {'implementation':<14} {'ms/step':>9} {'GB/s':>7} {'÷ copy':>7}"
    header += f" {'÷ zerosim':>10}"
    print(header)
    print("-" * len(header))
    for name, impl, seconds, bandwidth, ours in rows:
        print(
            f"{name:<13} {impl:<14} {seconds * 1e3:>9.2f} {bandwidth / 1e9:>7.2f} "
            f"{bandwidth / copy_bw:>7.2f} {seconds / ours:>9.2f}x"
        )
    print()
    print("GB/s: bytes the update must read + write (Adam/AdamW 7, SGD-momentum 5 float32")
    print("arrays per element) / time. ÷ zerosim: that row's time / zerosim's time (above 1:")
    print("zerosim is faster). One thread on each side.")
    fused_rows = {r[0]: r[2] / r[4] for r in rows if r[1] == "torch fused"}
    if fused_rows:
        ratios = ", ".join(f"{name} {1 / ratio:.2f}" for name, ratio in fused_rows.items())
        print(f"zerosim time / torch fused time: {ratios}")
    if args.json:
        records = [
            {
                "optimizer": name,
                "implementation": impl,
                "numel": args.numel,
                "seconds": seconds,
                "gbps": bandwidth / 1e9,
                "copy_gbps": copy_bw / 1e9,
                "threads": args.torch_threads if impl.startswith("torch") else 1,
            }
            for name, impl, seconds, bandwidth, _ in rows
        ]
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
