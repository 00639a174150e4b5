"""GPT forward+backward throughput of zerosim.nn next to numpy's matmul and torch (CPU).

One training step's matmul FLOPs (forward 2·m·k·n per matmul, backward twice that) divided
by the measured time of ``loss = model(idx, targets); model.backward()``. Baselines measured
in the same run: numpy's matmul on the model's largest Linear shape ((B·T, C) @ (C, 4C)),
and the same model written in torch (explicit attention, same structure) on the same number
of threads. Numpy's BLAS thread count is fixed when numpy loads (set OPENBLAS_NUM_THREADS /
OMP_NUM_THREADS before starting); torch is set to the same count.

    python benchmarks/model_step.py --n-layer 6 --n-embd 384 --n-head 6 --block-size 256
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zerosim.nn as nn  # noqa: E402


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-head", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=384)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    p.add_argument("--no-torch", action="store_true", help="skip the torch baseline")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    return p.parse_args(argv)


def step_flops(a: argparse.Namespace) -> float:
    """Matmul FLOPs of one forward+backward (backward = 2 × forward: dX and dW / dQ and dK)."""
    bt, c = a.batch_size * a.block_size, a.n_embd
    linear = 2 * bt * 12 * c * c  # c_attn 3C², c_proj C², c_fc 4C², mlp c_proj 4C²
    attention = 2 * 2 * a.batch_size * a.block_size**2 * c  # q kᵀ and P v, all heads
    forward = a.n_layer * (linear + attention) + 2 * bt * c * a.vocab_size
    return 3.0 * forward


def seconds(fn: Callable[[], object], repeat: int = 1) -> float:
    """Best wall time of ``repeat`` calls."""
    best = math.inf
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_baseline(a: argparse.Namespace) -> tuple[Callable[[], object], float]:
    """numpy matmul on the model's largest Linear shape, and its FLOPs."""
    rng = np.random.default_rng(0)
    m, k, n = a.batch_size * a.block_size, a.n_embd, 4 * a.n_embd
    x = rng.standard_normal((m, k)).astype(a.dtype)
    w = rng.standard_normal((n, k)).astype(a.dtype)
    return (lambda: x @ w.T), 2.0 * m * k * n


def zerosim_step(a: argparse.Namespace, idx: np.ndarray, targets: np.ndarray):
    model = nn.GPT(a.vocab_size, a.block_size, a.n_layer, a.n_head, a.n_embd, dtype=a.dtype)

    def step() -> None:
        model.zero_grad()
        model(idx, targets)
        model.backward()

    return model, step


def torch_step(a: argparse.Namespace, model: nn.GPT, idx: np.ndarray, targets: np.ndarray):
    import torch  # noqa: PLC0415  (optional baseline)
    import torch.nn.functional as F  # noqa: N812, PLC0415

    torch.set_num_threads(threads())
    dt = {"float32": torch.float32, "float64": torch.float64}[a.dtype]
    params = {
        k: torch.tensor(np.asarray(v), requires_grad=True) for k, v in model.state_dict().items()
    }
    h = a.n_head

    def forward(ids: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        x = params["wte.weight"][ids] + params["wpe.weight"][:t]
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        for i in range(a.n_layer):
            p = lambda name, i=i: params[f"blocks.{i}.{name}"]  # noqa: E731
            u = F.layer_norm(x, (a.n_embd,), p("ln_1.weight"), p("ln_1.bias"))
            q, k, v = F.linear(u, p("attn.c_attn.weight"), p("attn.c_attn.bias")).split(a.n_embd, 2)
            q, k, v = (z.view(b, t, h, -1).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
            att = F.softmax(att.masked_fill(mask, float("-inf")), dim=-1)
            y = (att @ v).transpose(1, 2).reshape(b, t, a.n_embd)
            x = x + F.linear(y, p("attn.c_proj.weight"), p("attn.c_proj.bias"))
            u = F.layer_norm(x, (a.n_embd,), p("ln_2.weight"), p("ln_2.bias"))
            u = F.gelu(F.linear(u, p("mlp.c_fc.weight"), p("mlp.c_fc.bias")), approximate="tanh")
            x = x + F.linear(u, p("mlp.c_proj.weight"), p("mlp.c_proj.bias"))
        x = F.layer_norm(x, (a.n_embd,), params["ln_f.weight"], params["ln_f.bias"])
        logits = F.linear(x, params["lm_head.weight"])
        return F.cross_entropy(logits.view(-1, a.vocab_size), tgt.view(-1), ignore_index=-1)

    ids, tgt = torch.tensor(idx), torch.tensor(targets)
    assert all(v.dtype == dt for v in params.values())

    def step() -> None:
        for v in params.values():
            v.grad = None
        forward(ids, tgt).backward()

    return step


def threads() -> int:
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        if os.environ.get(var):
            return int(os.environ[var])
    return os.cpu_count() or 1


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, a.vocab_size, (a.batch_size, a.block_size))
    targets = rng.integers(0, a.vocab_size, (a.batch_size, a.block_size))
    flops = step_flops(a)
    model, zerosim = zerosim_step(a, idx, targets)
    matmul, matmul_flops = matmul_baseline(a)
    runs = {"zerosim GPT forward+backward": zerosim}
    if not a.no_torch:
        try:
            runs["torch GPT forward+backward"] = torch_step(a, model, idx, targets)
        except ImportError:
            print("torch is not installed: no torch baseline")
    for fn in (matmul, *runs.values()):
        fn()  # warm-up: allocations, BLAS buffers
    # Interleaved: each repetition times the matmul right before each model step, so a
    # machine shared with other jobs slows both alike and the ratio stays meaningful.
    times: dict[str, list[float]] = {name: [] for name in runs}
    ratios: dict[str, list[float]] = {name: [] for name in runs}
    matmul_rates = []
    for _ in range(a.steps):
        for name, fn in runs.items():
            rate = matmul_flops / seconds(matmul, repeat=5)
            matmul_rates.append(rate)
            times[name].append(seconds(fn))
            ratios[name].append(flops / times[name][-1] / rate)
    print(
        f"GPT n_layer={a.n_layer} n_head={a.n_head} n_embd={a.n_embd} "
        f"block_size={a.block_size} vocab={a.vocab_size} batch={a.batch_size} {a.dtype}; "
        f"{model.num_parameters() / 1e6:.2f}M parameters; {flops / 1e9:.1f} GFLOP per step "
        f"(matmuls); {threads()} threads; medians of {a.steps} interleaved repetitions"
    )
    print(f"{'':34} {'s/step':>8} {'GFLOP/s':>9} {'vs matmul':>10}")
    matmul_gflops = statistics.median(matmul_rates) / 1e9
    print(f"{'numpy matmul (B*T, C) @ (C, 4C)':34} {'':8} {matmul_gflops:9.1f} {1.0:10.2f}")
    records = [{"name": "numpy matmul", "seconds": None, "gflops": matmul_gflops, "vs_matmul": 1.0}]
    for name in runs:
        t = statistics.median(times[name])
        print(f"{name:34} {t:8.3f} {flops / t / 1e9:9.1f} {statistics.median(ratios[name]):10.2f}")
        records.append(
            {
                "name": name.removesuffix(" GPT forward+backward"),
                "seconds": t,
                "gflops": flops / t / 1e9,
                "vs_matmul": statistics.median(ratios[name]),
            }
        )
    if a.json:
        Path(a.json).write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
