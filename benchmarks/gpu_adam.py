"""zerosim's fused Adam on a GPU (CuPy ElementwiseKernel) against the device's copy bandwidth.

    python benchmarks/gpu_adam.py [--numel 67108864] [--steps 20]

One float32 shard of ``--numel`` elements: the kernel reads parameter, gradient and both moments
and writes parameter and moments (7 array passes a step); its effective bandwidth is set beside
the device's copy bandwidth measured in the same run the way STREAM's Copy does (read one array,
write another: 2 passes), and the ratio is printed. Needs CuPy and a CUDA device (``pip install
zerosim[gpu]``); elsewhere it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
import time


def timed(fn, steps: int, sync) -> float:
    """Seconds per call of ``fn`` over ``steps`` calls after one warm-up, synchronized."""
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=2**26)
    parser.add_argument("--steps", type=int, default=20)
    a = parser.parse_args(argv)
    from zerosim.backend import gpu_available

    if not gpu_available():
        print("gpu_adam: no GPU (CuPy not installed or it sees no CUDA device)", file=sys.stderr)
        return 2
    import cupy

    from zerosim.optim import functional as F

    p, g, m, v = (cupy.ones(a.numel, dtype=cupy.float32) for _ in range(4))
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    step = iter(range(1, 10**9))
    sync = cupy.cuda.Device().synchronize
    adam = timed(lambda: F.adam(p, g, m, v, step=next(step), **kw), a.steps, sync)
    src, dst = cupy.ones(a.numel, dtype=cupy.float32), cupy.empty(a.numel, dtype=cupy.float32)
    copy = timed(lambda: cupy.copyto(dst, src), a.steps, sync)
    nbytes = 4 * a.numel
    adam_gbps, copy_gbps = 7 * nbytes / adam / 1e9, 2 * nbytes / copy / 1e9
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print("| device | numel | Adam ms/step | Adam GB/s | copy GB/s | Adam / copy |")
    print("|---|---|---|---|---|---|")
    print(
        f"| {name} | {a.numel:,} | {adam * 1e3:.2f} | {adam_gbps:.0f} | {copy_gbps:.0f} | "
        f"{adam_gbps / copy_gbps:.2f} |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
