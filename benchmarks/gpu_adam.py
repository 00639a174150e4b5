"""zerosim on a GPU: its fused Adam against the device's copy bandwidth and torch's fused Adam, and
a training step of a ~100M-parameter GPT against torch's, all measured in the same run.

    python benchmarks/gpu_adam.py [--numel 67108864] [--steps 20] [--gpt small|tiny|none]
        [--gpt-steps 5] [--warmup 2] [--device cuda|cpu] [--check]

**Adam.** One float32 shard of ``--numel`` elements updated by ``zerosim.optim.functional.adam``
(on CuPy arrays: one ``ElementwiseKernel``, optim/functional/cupy_kernels.py). An Adam step reads
parameter, gradient and both moments and writes parameter and moments: 7 array passes. Its
effective bandwidth is set beside the device's copy bandwidth measured in the same run the way
STREAM's Copy does (read one array, write another: 2 passes), and its time beside torch's
``torch.optim.Adam(fused=True)`` on a parameter of the same size with the same hyperparameters
(torch's ``_fused_adam`` kernel makes the same 7 passes).

**GPT step.** GPT-2 small's body (12 layers, 12 heads, 768 wide) with a vocabulary of 8,192 and
256 positions, untied: Ψ = 97.8M parameters (``--gpt tiny``: a small one, for checking this
script). zerosim's engine trains it on one rank at stage 0 in float32 with Adam (the backend
``cupy``, or ``numpy`` with ``--device cpu``), and torch trains the same module structure
(benchmarks/training_step.py's ``torch_modules``), loaded with zerosim's initial weights, with
``Adam(fused=True)`` on the same device, on the same batches of 8 sequences of 256 random tokens
(uniform over the vocabulary, seeded by the step). Neither uses TF32 (CuPy's and torch's default
for float32 matrix products). The figure is the median step time after ``--warmup`` steps (the
first ones compile CuPy's kernels), with tokens per second, the model FLOP rate at 6Ψ per token
(forward 2Ψ, backward 4Ψ; attention's T² terms left out) and the ratio to torch's time. Both
losses at the last step are printed: from the same weights on the same data they agree to float32
rounding, which shows that both timed the same computation (``--check`` exits 1 where they
differ by more than 1e-3 relative).

``--device cpu`` runs the same measurements on the host (NumPy arrays, torch on the CPU): a check
of this script's code where no GPU is (tests/test_gpu_check.py); its figures are not a GPU's.
With ``--device cuda`` (the default) it needs CuPy and a CUDA device (``pip install
zerosim[gpu]``) and torch with CUDA for the torch columns; without a GPU it says so and exits
with status 2, and with ``--check`` but no torch that can use CUDA (nothing to compare the losses
with) it exits 1. benchmarks/gpu_check.sh runs it on a GPU machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (n_layer, n_head, n_embd, vocabulary, positions, micro-batch) of each GPT size
GPT_SHAPES = {"small": (12, 12, 768, 8192, 256, 8), "tiny": (2, 2, 32, 64, 16, 2)}
ADAM = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
GPT_LR = 3e-4
LOSS_AGREEMENT = 1e-3  # --check: |zerosim − torch| / torch, last step's loss


def timed(fn: Callable[[], object], steps: int, sync: Callable[[], None]) -> float:
    """Seconds per call of ``fn`` over ``steps`` calls after one warm-up, synchronized."""
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return (time.perf_counter() - start) / steps


def device(name: str) -> SimpleNamespace:
    """The array module, the synchronisation and the torch device of ``--device``."""
    if name == "cpu":
        return SimpleNamespace(xp=np, sync=lambda: None, torch="cpu", backend="numpy", name="host")
    import cupy  # noqa: PLC0415  (GPU-only)

    props = cupy.cuda.runtime.getDeviceProperties(0)
    return SimpleNamespace(
        xp=cupy,
        sync=cupy.cuda.Device().synchronize,
        torch="cuda",
        backend="cupy",
        name=props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
    )


def torch_or_none(dev: SimpleNamespace) -> Any:
    """torch, when it is installed and can use the device; else None (its columns say so)."""
    try:
        import torch  # noqa: PLC0415  (the baseline, optional)
    except ImportError:
        return None
    if dev.torch == "cuda" and not torch.cuda.is_available():
        return None
    return torch


def torch_sync(torch: Any, dev: SimpleNamespace) -> Callable[[], None]:
    return torch.cuda.synchronize if dev.torch == "cuda" else (lambda: None)


# -- Adam on one shard ---------------------------------------------------------------------------
def adam_row(dev: SimpleNamespace, numel: int, steps: int) -> str:
    """One table row: zerosim's Adam, the copy bandwidth and torch's fused Adam on ``numel``."""
    from zerosim.optim import functional as F  # noqa: PLC0415

    xp = dev.xp
    p, g, m, v = (xp.ones(numel, dtype=xp.float32) for _ in range(4))
    step = iter(range(1, 10**9))
    adam = timed(lambda: F.adam(p, g, m, v, step=next(step), **ADAM), steps, dev.sync)
    src, dst = xp.ones(numel, dtype=xp.float32), xp.empty(numel, dtype=xp.float32)
    copy = timed(lambda: xp.copyto(dst, src), steps, dev.sync)
    nbytes = 4 * numel
    adam_gbps, copy_gbps = 7 * nbytes / adam / 1e9, 2 * nbytes / copy / 1e9
    torch = torch_or_none(dev)
    if torch is None:
        torch_cells = "torch with this device not installed | – | –"
    else:
        param = torch.nn.Parameter(torch.ones(numel, device=dev.torch))
        param.grad = torch.ones_like(param)
        opt = torch.optim.Adam(
            [param], lr=ADAM["lr"], betas=(ADAM["beta1"], ADAM["beta2"]), eps=ADAM["eps"],
            weight_decay=ADAM["weight_decay"], fused=True,
        )  # fmt: skip
        fused = timed(opt.step, steps, torch_sync(torch, dev))
        torch_cells = f"{fused * 1e3:.3f} | {7 * nbytes / fused / 1e9:.0f} | {adam / fused:.2f}"
    return (
        f"| {dev.name} | {numel:,} | {adam * 1e3:.3f} | {adam_gbps:.0f} | {copy_gbps:.0f} | "
        f"{adam_gbps / copy_gbps:.2f} | {torch_cells} |"
    )


# -- a GPT training step -----------------------------------------------------------------------
def batches(vocab: int, seq: int, micro: int, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``count`` batches of random tokens (uniform over the vocabulary, seeded by the step)."""
    out = []
    for s in range(count):
        tokens = np.random.default_rng(s).integers(0, vocab, (micro, seq + 1))
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def zerosim_gpt(dev: SimpleNamespace, shape: tuple, data: list) -> tuple[list[float], float, dict]:
    """zerosim's engine on ``dev``: step times (s), the last loss, and the initial weights."""
    import zerosim as zs  # noqa: PLC0415

    n_layer, n_head, n_embd, vocab, seq, micro = shape
    model = zs.nn.GPT(vocab, seq, n_layer, n_head, n_embd, seed=0)
    weights = {k: np.array(v) for k, v in model.state_dict().items()}  # for torch's twin
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "optimizer": {"type": "Adam", "params": {"lr": GPT_LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 0},
        "zerosim": {"backend": dev.backend, "dtype": "float32"},
    }
    engine, *_ = zs.initialize(model, config, comm=zs.LocalWorld(1).comms()[0])
    times, loss = [], float("nan")
    for x, y in data:
        dev.sync()
        start = time.perf_counter()
        out = engine(x, y)
        engine.backward(out)
        engine.step()
        loss = float(out)
        dev.sync()
        times.append(time.perf_counter() - start)
    return times, loss, weights


def torch_gpt(torch: Any, dev: SimpleNamespace, shape: tuple, data: list, weights: dict):
    """torch's twin of the model on ``dev``, from zerosim's weights: step times and last loss."""
    from benchmarks.training_step import torch_modules  # noqa: PLC0415

    n_layer, n_head, n_embd, vocab, seq, _ = shape
    _, TorchGPT = torch_modules()  # noqa: N806
    model = TorchGPT(vocab, seq, n_layer, n_head, n_embd)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=True)
    model.to(dev.torch)
    opt = torch.optim.Adam(model.parameters(), lr=GPT_LR, weight_decay=0.0, fused=True)
    sync = torch_sync(torch, dev)
    times, loss = [], float("nan")
    for x, y in data:
        ids, targets = (torch.from_numpy(a).to(dev.torch) for a in (x, y))
        sync()
        start = time.perf_counter()
        out = model(ids, targets)
        out.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = out.item()
        sync()
        times.append(time.perf_counter() - start)
    return times, loss


def gpt_rows(
    dev: SimpleNamespace, size: str, warmup: int, steps: int
) -> tuple[list[str], float | None]:
    """The GPT table's rows (zerosim, torch) and the relative gap between their last losses
    (None without torch)."""
    shape = GPT_SHAPES[size]
    n_layer, n_head, n_embd, vocab, seq, micro = shape
    data = batches(vocab, seq, micro, warmup + steps)
    zs_times, zs_loss, weights = zerosim_gpt(dev, shape, data)
    psi = sum(w.size for w in weights.values())
    tokens = micro * seq
    zs_step = statistics.median(zs_times[warmup:])
    rows = [
        f"| zerosim ({dev.backend}, stage 0) | {dev.name} | {psi:,} | {tokens} | "
        f"{zs_step * 1e3:.1f} | {tokens / zs_step:,.0f} | {6 * psi * tokens / zs_step / 1e12:.2f} "
        f"| {zs_times[0]:.1f} | {zs_loss:.5f} | 1.00 |"
    ]
    torch = torch_or_none(dev)
    if torch is None:
        rows.append("| torch | torch with this device not installed | | | | | | | | |")
        return rows, None
    th_times, th_loss = torch_gpt(torch, dev, shape, data, weights)
    th_step = statistics.median(th_times[warmup:])
    rows.append(
        f"| torch (Adam fused) | {dev.name} | {psi:,} | {tokens} | {th_step * 1e3:.1f} | "
        f"{tokens / th_step:,.0f} | {6 * psi * tokens / th_step / 1e12:.2f} | {th_times[0]:.1f} | "
        f"{th_loss:.5f} | {zs_step / th_step:.2f} |"
    )
    return rows, abs(zs_loss - th_loss) / abs(th_loss)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=2**26)
    parser.add_argument("--steps", type=int, default=20, help="Adam steps timed")
    parser.add_argument("--gpt", choices=[*GPT_SHAPES, "none"], default="small")
    parser.add_argument("--gpt-steps", type=int, default=5, help="GPT steps timed")
    parser.add_argument("--warmup", type=int, default=2, help="GPT steps before the timed ones")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--check", action="store_true", help="exit 1 if the losses disagree")
    a = parser.parse_args(argv)
    if a.device == "cuda":
        from zerosim.backend import gpu_available  # noqa: PLC0415

        if not gpu_available():
            print(
                "gpu_adam: no GPU (CuPy not installed or it sees no CUDA device); "
                "--device cpu runs this script's code on the host",
                file=sys.stderr,
            )
            return 2
    dev = device(a.device)
    print("Adam on one float32 shard (7 passes a step; copy: 2 passes):\n")
    print(
        "| device | numel | zerosim Adam ms/step | zerosim GB/s | copy GB/s | zerosim / copy | "
        "torch fused Adam ms/step | torch GB/s | zerosim time / torch time |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print(adam_row(dev, a.numel, a.steps), flush=True)
    if a.gpt == "none":
        return 0
    print(f"\nGPT training step ({a.gpt}; median of {a.gpt_steps} steps after {a.warmup}):\n")
    print(
        "| run | device | Ψ | tokens/step | ms/step | tokens/s | model TFLOP/s | first step s "
        "| last loss | time / torch's |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows, gap = gpt_rows(dev, a.gpt, a.warmup, a.gpt_steps)
    print("\n".join(rows))
    if gap is None:
        print("\nlast losses: no torch to compare with", flush=True)
        if a.check and dev.torch == "cuda":  # a GPU check that compared nothing
            print("gpu_adam: --check: torch cannot use CUDA here, nothing to compare with",
                  file=sys.stderr)  # fmt: skip
            return 1
        return 0
    print(f"\nlast losses, |zerosim − torch| / torch = {gap:.2e}", flush=True)
    if a.check and gap > LOSS_AGREEMENT:
        print(f"gpu_adam: the losses differ by more than {LOSS_AGREEMENT:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
