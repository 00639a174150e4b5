"""A GPT of GPT-2 small's shape (124M parameters) trained at stage 3 on 8 ranks of this machine.

    python -m benchmarks.large_gpt [--ranks 8] [--steps 3] [--warmup 2] [--seq 128]
        [--micro-batch 1] [--n-layer 12] [--n-head 12] [--n-embd 768] [--vocab 50304]
        [--bucket 1e7] [--max-live 5e7] [--glibc-default] [--json PATH]

What zerosim does at a size that matters. ``mpirun -n N`` ranks of this file (``--worker``) build
the model inside ``zerosim.zero.Init``, so no rank ever holds the whole model (every parameter is
cut to the rank's chunk as its module creates it; docs/engine.md, "Building a model
partitioned"), and train it at stage 3 with Adam in float32 on synthetic tokens (uniform over the
vocabulary, from ``default_rng([step, rank])``). The default shape is nanoGPT's GPT-2 small: 12
layers, 12 heads, 768 wide, vocabulary 50304, ``lm_head`` tied to ``wte``; with a position table
of ``--seq`` = 128 rows instead of 1024, Ψ = 123,787,776. The sequence and the micro-batch (1) are
kept small so that a step takes seconds on 2 cores: 8 ranks · 1 · 128 = 1,024 tokens per step.

Config (``config``): ZeRO stage 3 with every parameter partitioned (persistence threshold 0),
each module's parameters gathered again for its backward (``stage3_max_reuse_distance`` 0 and
the paper's collective schedule, ``"schedule": "paper"``: 3(N−1)/N·Ψ·b per rank per step),
gradient buckets and prefetch of ``--bucket`` elements, and at most ``--max-live`` elements
gathered at once (``stage3_max_live_parameters``; prefetch stops there). With DeepSpeed's
defaults (buckets of 5e8, reuse distance and live cap 1e9) a model of this size keeps all of its
parameters gathered from forward to backward and fills one model-sized bucket: every rank would
hold the whole model again.

Step time: each step starts after a barrier and ends when ``step()`` returns; a step's time is
the slowest rank's; the figure is the median over ``--steps`` steps after ``--warmup`` (the first
steps record stage 3's trace, fill the bucket pool and page in the buffers). Tokens per second =
N · micro-batch · seq / step time; the model FLOP rate is the usual 6Ψ per token (forward 2Ψ,
backward 4Ψ; attention's T² terms left out).

Memory per rank against the ZeRO paper's formula for stage 3 with fp32 Adam (Rajbhandari et al.
2020, §5): 16Ψ_pad/N bytes (4 parameter + 4 gradient + 4 + 4 Adam moments per element of the
rank's shard; Ψ_pad = Σ_i ceil(numel_i/N)·N). ``engine.memory_report()`` counts those model
states (they equal the formula to the byte) and the buffers besides them: the gradient bucket
pool (``bucket_buffers``) and the most gathered parameters alive at once
(``peak_gathered_params``). The measured figure is each process's peak RSS (``ru_maxrss``) over
the RSS it had after start-up (libraries imported, the fused Adam kernel compiled, as in
tests/helpers/zero_init_worker.py); it also holds what no formula counts: activations, a gathered
parameter's full-size gradient before it is packed into a bucket, MPI's buffers, and freed
blocks the allocator keeps (the workers run with training_step.py's ``RETAIN_FREED``, as the
training-step benchmark does; ``--glibc-default`` runs without it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.training_step import RETAIN_FREED  # noqa: E402

MIB = 2**20
SHAPE = ("n_layer", "n_head", "n_embd", "vocab", "seq", "micro_batch")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def config(a: argparse.Namespace) -> dict:
    """Stage 3, fp32 Adam, every parameter partitioned and re-gathered for backward; buckets,
    prefetch and the live cap sized for a rank that should hold about 1/N of the model."""
    return {
        "train_micro_batch_size_per_gpu": a.micro_batch,
        "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": a.bucket,
            "stage3_prefetch_bucket_size": a.bucket,
            "stage3_max_live_parameters": a.max_live,
            "stage3_max_reuse_distance": 0,
            "stage3_param_persistence_threshold": 0,
        },
        "steps_per_print": 10**9,
        "zerosim": {"dtype": "float32", "schedule": "paper"},  # the paper's 3(N−1)/N·Ψ·b
    }


def worker(a: argparse.Namespace) -> None:
    """One rank: build inside zero.Init, train, and (rank 0) print every rank's figures as JSON."""
    from mpi4py import MPI

    import zerosim as zs
    from zerosim.comm import MPIComm

    comm = MPIComm()
    warm = zs.nn.Parameter(np.zeros(4, np.float32))  # compile the fused Adam kernel (start-up)
    warm.grad = np.ones(4, np.float32)
    zs.optim.Adam([warm]).step()
    base = peak_rss_bytes()
    cfg = config(a)
    t0 = time.perf_counter()
    with zs.zero.Init(comm=comm, config=cfg):
        model = zs.nn.GPT(a.vocab, a.seq, a.n_layer, a.n_head, a.n_embd, tie_weights=True)
    build_s, build_rss = time.perf_counter() - t0, peak_rss_bytes()
    engine, *_ = zs.initialize(model, cfg, comm=comm)
    times, losses = [], []
    for step in range(a.warmup + a.steps):
        rng = np.random.default_rng([step, comm.rank])
        x, y = rng.integers(0, a.vocab, (2, a.micro_batch, a.seq))
        MPI.COMM_WORLD.Barrier()
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    mine = {
        "times": times,
        "loss": losses[-1],
        "build_s": build_s,
        "base": base,
        "build_rss": build_rss,
        "peak_rss": peak_rss_bytes(),
        "report": engine.memory_report(),
    }
    every = MPI.COMM_WORLD.gather(mine, root=0)
    if comm.rank == 0:
        whole = {"params": model.num_parameters(), "padded_numel": engine.strategy.padded_numel}
        print(json.dumps({**whole, "ranks": every}), flush=True)


def launch(a: argparse.Namespace) -> dict:
    """``mpirun -n --ranks`` workers of this file; rank 0's JSON."""
    mpirun = Path(sys.executable).parent / "mpirun"
    cmd = [str(mpirun if mpirun.exists() else "mpirun"), "-n", str(a.ranks), sys.executable]
    cmd += [__file__, "--worker"]
    for key in (*SHAPE, "steps", "warmup", "bucket", "max_live"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(a, key))]
    env = dict(os.environ, **{f"{v}_NUM_THREADS": "1" for v in ("OMP", "OPENBLAS", "MKL")})
    env.update({} if a.glibc_default else RETAIN_FREED)
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.timeout)
    found = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
    if run.returncode or not found:
        tail = (run.stdout[-2000:] + run.stderr[-4000:]).strip()
        raise RuntimeError(f"mpirun exited with {run.returncode}:\n{tail}")
    return found[-1]


def summarise(a: argparse.Namespace, out: dict) -> dict:
    """The benchmark's row: step time, tokens/s, and per rank the memory against the formula."""
    ranks, n = out["ranks"], a.ranks
    slowest = np.max([r["times"] for r in ranks], axis=0)  # (steps,): each step's slowest rank
    step_s = float(np.median(slowest[a.warmup :]))
    tokens = n * a.micro_batch * a.seq
    report = ranks[0]["report"]
    states = sum(v for k, v in report.items() if k.startswith("optimizer_state."))
    states += report["params"] + report["grads"] + report.get("master_params", 0)
    return {
        "n": n,
        "params": out["params"],
        "padded_numel": out["padded_numel"],
        "shape": {k: getattr(a, k) for k in SHAPE},
        "tokens_per_step": tokens,
        "step_times": [float(t) for t in slowest],
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "gflops": 6 * out["params"] * tokens / step_s / 1e9,
        "formula": 16 * out["padded_numel"] // n,
        "model_states": states,
        "buffers": [
            r["report"]["bucket_buffers"] + r["report"]["peak_gathered_params"] for r in ranks
        ],
        "bucket_buffers": report["bucket_buffers"],
        "peak_gathered": report["peak_gathered_params"],
        "rss_growth": [r["peak_rss"] - r["base"] for r in ranks],
        "build_growth": [r["build_rss"] - r["base"] for r in ranks],
        "build_s": max(r["build_s"] for r in ranks),
        "full_model": 4 * out["params"],
        "loss": ranks[0]["loss"],
    }


def print_tables(a: argparse.Namespace, row: dict) -> None:
    n, mib = row["n"], lambda b: f"{b / MIB:,.1f}"
    print(
        f"GPT of {a.n_layer} layers, {a.n_head} heads, {a.n_embd} wide, vocabulary {a.vocab} "
        f"(lm_head tied to wte), {a.seq} positions: Ψ = {row['params']:,} parameters "
        f"({mib(row['full_model'])} MiB in fp32). Stage 3 on {n} ranks "
        f"({os.cpu_count()} CPUs), Adam in fp32, built inside zero.Init in {row['build_s']:.1f} s; "
        f"micro-batch {a.micro_batch} × {a.seq} tokens per rank = {row['tokens_per_step']:,} "
        f"tokens per step; reduce/prefetch buckets {a.bucket:,.0f} elements, at most "
        f"{a.max_live:,.0f} gathered.\n"
    )
    times = ", ".join(f"{t:.2f}" for t in row["step_times"])
    print("| N | Ψ | tokens/step | s/step (median) | tokens/s | model GFLOP/s (6Ψ/token) |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {n} | {row['params']:,} | {row['tokens_per_step']:,} | {row['step_s']:.2f} | "
        f"{row['tokens_per_s']:.1f} | {row['gflops']:.2f} |"
    )
    print(
        f"\nEvery step's time (slowest rank, s; the first {a.warmup} are warm-up): {times}. "
        f"Last loss {row['loss']:.4f} (ln V = {np.log(a.vocab):.4f}: random tokens).\n"
    )
    print(
        "| rank | model states MiB (memory_report) | 16Ψ_pad/N MiB | buffers MiB (bucket pool + "
        "peak gathered) | peak RSS growth MiB | ratio peak / (16Ψ/N + buffers) | peak while "
        "building MiB | whole model fp32 MiB |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rank, (buffers, grown, built) in enumerate(
        zip(row["buffers"], row["rss_growth"], row["build_growth"], strict=True)
    ):
        print(
            f"| {rank} | {mib(row['model_states'])} | {mib(row['formula'])} | {mib(buffers)} | "
            f"{mib(grown)} | {grown / (row['formula'] + buffers):.2f} | {mib(built)} | "
            f"{mib(row['full_model'])} |"
        )
    print(
        f"\n- buffers: bucket pool {mib(row['bucket_buffers'])} MiB, peak gathered parameters "
        f"{mib(row['peak_gathered'])} MiB (the tied embedding alone is "
        f"{mib(4 * a.vocab * a.n_embd)} MiB). Peak RSS growth: over the RSS after start-up; it "
        "also holds activations, the gathered-size gradient of the parameter being reduced, "
        "MPI's buffers and blocks the allocator keeps."
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="timed steps after warm-up")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (= block_size)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--bucket", type=float, default=1e7, help="reduce and prefetch bucket size")
    p.add_argument("--max-live", type=float, default=5e7, help="stage3_max_live_parameters")
    p.add_argument("--glibc-default", action="store_true", help="without RETAIN_FREED")
    p.add_argument("--timeout", type=float, default=1200, help="seconds for the mpirun job")
    p.add_argument("--json", metavar="PATH", help="also write the row as JSON (a list of one)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.bucket, a.max_live = int(a.bucket), int(a.max_live)
    if a.worker:
        worker(a)
        return 0
    load, t0 = os.getloadavg()[0], time.perf_counter()
    row = summarise(a, launch(a))
    print_tables(a, row)
    print(
        f"\n{time.perf_counter() - t0:.0f} s; load average 1 min {load:.2f} at start, "
        f"{os.getloadavg()[0]:.2f} at end"
    )
    if a.json:
        Path(a.json).write_text(json.dumps([row], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
