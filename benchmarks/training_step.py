"""One training step of zerosim stages 0-3 against PyTorch's counterparts and DeepSpeed.

    python benchmarks/training_step.py [--ranks 2 4] [--steps 20] [--model mlp|gpt|both]
        [--stages 0 1 2 3] [--repeats 2] [--peers torch deepspeed] [--memory-ranks 1 2 4 8]
        [--check] [--profile [STAGE]] [--quick] [--json PATH]

For each N in ``--ranks``, model and configuration the driver launches ``--repeats`` separate
jobs of this file (``--worker``) per side, zerosim's, torch's and DeepSpeed's in turn (each
repeat starting one side later) so that a change in the machine's load hits all three, and so
that each peak RSS (``ru_maxrss``, a high-water mark) belongs to one configuration. Every job
trains the same model (same seed, same weights: the torch module is loaded from zerosim's
``state_dict``) on the same global batches (rank r takes rows [r·B/N, (r+1)·B/N) of each) with
Adam in float32 (lr 1e-3, no weight decay, so DeepSpeed's AdamW mode is plain Adam; no gradient
clipping):

    zerosim stage 0  <->  torch DistributedDataParallel (gloo)
    zerosim stage 1  <->  DDP + torch.distributed.optim.ZeroRedundancyOptimizer (gloo)
    zerosim stage 2  <->  FSDP2 ``fully_shard(reshard_after_forward=False)`` (gloo): gradients and
                          optimizer state sharded like ZeRO-2, but parameters are also sharded
                          between steps and all-gathered at each forward (SHARD_GRAD_OP-like).
    zerosim stage 3  <->  FSDP2 ``fully_shard(reshard_after_forward=True)`` (gloo): parameters
                          gathered per module before forward and again before backward.
    zerosim stage s  <->  DeepSpeed 0.19 stage s (gloo), for every s: the same engine_config().

DeepSpeed (``--peers``) runs on CPU: ``torchrun --nproc_per_node N`` launches the worker, which
calls ``deepspeed.init_distributed(dist_backend="gloo")`` and ``deepspeed.initialize`` on the
same torch module the torch peers train, with the very JSON config zerosim gets (zerosim's own
``"zerosim"`` section left out; ``engine_config``). Its optimizer is what DeepSpeed picks for
``"type": "Adam"`` by default: FusedAdam, whose CPU build is DeepSpeed's C++ kernel
(``csrc/cpu/adam/fused_adam.cpp``: one vectorised pass over each tensor, OpenMP over elements,
so one thread here). ``"torch_adam": true`` would swap in torch.optim.Adam, the kernel the torch
peers already run, so FusedAdam is the stronger and the more DeepSpeed-like choice; zerosim's
Adam is its fused one-pass kernel when numba is installed (docs/optim.md). DeepSpeed's comms
logger, wall-clock breakdown and flops profiler stay off (their defaults).

zerosim runs with its config defaults (ledger on, cross-rank argument check on, one bucket of
``reduce_bucket_size`` = 5e8 elements, ``overlap_comm`` off for stages 0-2) over ``MPIComm``;
zerosim workers never import torch, torch and DeepSpeed workers never import mpi4py (a torch
rank's rank and size come from mpirun's PMI_RANK / PMI_SIZE, DeepSpeed's from torchrun, the
rendezvous from MASTER_ADDR / MASTER_PORT). Every rank runs with one thread (OMP/OpenBLAS/MKL =
1, ``torch.set_num_threads(1)``).

Every side's workers run with glibc's allocator told to keep freed memory (``RETAIN_FREED``:
``MALLOC_MMAP_THRESHOLD_`` 1 GiB, ``MALLOC_TRIM_THRESHOLD_`` 4 GiB). By default glibc maps every
block over 32 MiB afresh and unmaps it when freed (or trims the heap), so a step that frees its
activations and allocates them again at the next step pays a page fault per 4 KiB page: on the
GPT at N = 2 that alone made zerosim's stage 0 about 1.1× DDP instead of about 0.9×. A Python
library frees its temporaries to the allocator where torch keeps a caching allocator of its own;
the setting gives both sides the same reuse. ``--glibc-default`` runs without it.

Step time: each step starts after a barrier and ends when ``step()`` returns; a step's time is
the slowest rank's; a job's figure is the median over ``--steps`` steps after ``--warmup``
warm-up steps, and the table gives the median over the repeats (a second table lists every
repeat's figure, so that the load's effect on each configuration is visible). Peak RSS is the
largest ``ru_maxrss`` over ranks and repeats; in brackets, its growth over the RSS the process had
once its libraries were imported (for torch this includes library code paged in at the first
kernels, tens of MiB; for zerosim, numba and the fused optimizer kernel it compiles at the first
step, about 100 MiB: 23 MiB with ``ZEROSIM_FUSED=0``; for DeepSpeed the baseline is taken after
``import deepspeed``, so its hundreds of MiB of libraries are in the total, not the bracket).
The last column is rank 0's loss at the last step on each side; ``--check`` also compares
zerosim's and torch's gradients at initialisation; ``--no-check`` runs zerosim without its
cross-rank argument check. ``--profile`` then runs zerosim once more under cProfile on rank 0 and
prints the top 15 functions by own time (time in a blocking collective includes waiting for
slower ranks).

Stage 3 runs with ``STAGE3`` below: every parameter partitioned (persistence threshold 0, as
FSDP shards every parameter), prefetch and non-blocking all-gathers on (``overlap_comm``, the
stage-3 default), and ``stage3_max_reuse_distance`` 0 so that, like FSDP2 with
``reshard_after_forward=True``, every module's parameters are gathered again for its backward:
zerosim and FSDP2 then send 3(N−1)/N·Ψ·b per rank per step (with DeepSpeed's default reuse
distance a model this small keeps every parameter gathered from forward to backward, which is
FSDP2's ``reshard_after_forward=False``). zerosim runs the ZeRO paper's collective schedule
(``"schedule": "paper"``) so that its bytes are the paper's and FSDP2's; DeepSpeed fetches by its
own trace and release rules, which zerosim's default ``"schedule": "deepspeed"`` reproduces and
which can send fewer bytes (on the ``--quick`` MLP, 2/3 of the paper's forward and backward
bytes). When stage 3 is among ``--stages`` two more tables follow:

* **Exposed communication** (``exposed_table``): stage 3 with ``overlap_comm`` on and off (the
  jobs without it run in the same repeat loop as the table's zerosim and torch jobs), and the same
  model at N = 1 as the compute-only reference. Its printed legend defines the columns: the
  ledger's time in collectives, the time a collective was in flight, the time each rank's thread
  was blocked in communication calls (measured by wrapping the communicator, ``time_blocked``),
  and the exposed time estimated against the N = 1 reference. Every stage-3 job, the table's
  included, does this bookkeeping (microseconds per step: two clock reads per call, one pass
  over the step's ledger records).
* **Model-state memory vs N** (``memory_table``): ``engine.memory_report()`` params + grads +
  master params + optimizer states per rank for N in ``--memory-ranks``, against N = 1; the
  expected ratio is 1/N up to padding, exactly (Ψ_pad(N)/N)/Ψ with stage 3's per-parameter
  padding Ψ_pad(N) = Σ_i ceil(numel_i/N)·N.

``--quick`` (the smoke test): MLP, N = 2, stage 3 only, 3 steps, one repeat, memory N = 1, 2, 4.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MLP_SIZES = [256, 1024, 512, 256, 10]  # 921,866 parameters
GPT_SHAPE = {"block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 96}  # ≈ 0.47 M parameters
GLOBAL_BATCH = {"mlp": 64, "gpt": 16}  # samples (sequences for gpt) per optimizer step
# glibc malloc settings for every worker (see the module's docstring): keep freed blocks for reuse.
RETAIN_FREED = {"MALLOC_MMAP_THRESHOLD_": "1073741824", "MALLOC_TRIM_THRESHOLD_": "4294967296"}
LR, SEED = 1e-3, 0
COUNTERPART = {
    0: "DDP",
    1: "DDP+ZeroRedundancyOptimizer",
    2: "FSDP2 (no reshard after fwd)",
    3: "FSDP2 (reshard after fwd)",
}
# Stage 3 as FSDP: every parameter sharded, re-gathered for backward; prefetch per ``--overlap``.
STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
MODEL_STATES = ("params", "grads", "master_params", "persistent_params")  # + optimizer_state.*
COMM_KEYS = ("ledger_ms", "in_flight_ms", "blocked_ms")  # stage 3's communication times


def engine_config(model: str, n: int, stage: int, overlap: bool = True) -> dict:
    """The DeepSpeed JSON config both engines get (zerosim adds its own section): float32 Adam,
    the global batch in one micro-batch per rank, ZeRO ``stage`` (stage 3 as ``STAGE3``), and no
    clipping (DeepSpeed 0.19's default ``gradient_clipping`` is 1.0; the torch peers do not
    clip, so with it two sides would train another model than the third)."""
    return {
        "train_batch_size": GLOBAL_BATCH[model],
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH[model] // n,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage} if stage < 3 else {**STAGE3, "overlap_comm": overlap},
        "steps_per_print": 10**9,
    }


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def build_model(name: str):
    """zerosim's model and the vocabulary size (None for the MLP), identical on every rank."""
    from zerosim.data import CharDataset
    from zerosim.nn import GPT, MLP

    if name == "mlp":
        return MLP(MLP_SIZES, seed=SEED), None
    vocab = CharDataset(block_size=GPT_SHAPE["block_size"]).vocab_size
    return GPT(vocab, **GPT_SHAPE, seed=SEED), vocab


def global_batches(name: str, steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every step's global batch (x, y); MLP: Gaussian inputs, GPT: windows of the corpus."""
    rng = np.random.default_rng(SEED + 1)
    b = GLOBAL_BATCH[name]
    if name == "mlp":
        return [
            (rng.standard_normal((b, MLP_SIZES[0]), dtype=np.float32), rng.integers(0, 10, b))
            for _ in range(steps)
        ]
    from zerosim.data import CharDataset

    data = CharDataset(block_size=GPT_SHAPE["block_size"])
    return [data[rng.integers(0, len(data), b)] for _ in range(steps)]


def my_rows(batch, rank: int, n: int):
    m = len(batch[0]) // n
    return batch[0][rank * m : (rank + 1) * m], batch[1][rank * m : (rank + 1) * m]


def timed(step, barrier, batches, rank: int, n: int) -> tuple[list[float], float]:
    """Per-step wall times on this rank (barrier before each step) and the last loss."""
    times, loss = [], float("nan")
    for batch in batches:
        x, y = my_rows(batch, rank, n)
        barrier()
        t0 = time.perf_counter()
        loss = step(x, y)
        times.append(time.perf_counter() - t0)
    return times, loss


def summary(times: np.ndarray, losses: list[float], rss, base, warmup: int, **extra) -> dict:
    """``times``: (ranks, steps). Median over steps after warm-up of the slowest rank."""
    return {
        "ms": 1e3 * float(np.median(times[:, warmup:].max(axis=0))),
        "rss_mib": [float(r) for r in rss],
        "base_mib": [float(b) for b in base],
        "loss": losses[0],
        **extra,
    }


# -- zerosim worker --------------------------------------------------------------------------------
BLOCKING = ("all_gather", "reduce_scatter", "reduce_scatter_v", "all_reduce", "broadcast")
NONBLOCKING = ("iall_gather", "ireduce_scatter", "ireduce_scatter_v", "iall_reduce")


def time_blocked(comm) -> list[float]:
    """Wrap ``comm``'s collectives so that the returned one-element list accumulates the seconds
    this rank's thread spends inside them: a blocking call whole (with the cross-rank argument
    check), a non-blocking one while it is issued and while ``wait()`` runs. Whatever the
    thread cannot spend computing is in it, waiting for slower ranks included."""
    blocked = [0.0]

    def timed_call(call):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                blocked[0] += time.perf_counter() - t0

        return run

    def timed_start(start):
        def run(*args, **kwargs):
            handle = timed_call(start)(*args, **kwargs)
            handle.wait = timed_call(handle.wait)
            return handle

        return run

    for name in BLOCKING:
        setattr(comm, name, timed_call(getattr(comm, name)))
    for name in NONBLOCKING:
        setattr(comm, name, timed_start(getattr(comm, name)))
    return blocked


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, stop) intervals: time with a collective in flight."""
    total, reach = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > reach:
            total += stop - max(start, reach)
            reach = stop
    return total


def model_state_bytes(report: dict[str, int]) -> int:
    """params + grads + master params (+ persistent params) + every optimizer state."""
    states = sum(v for k, v in report.items() if k.startswith("optimizer_state."))
    return states + sum(report.get(k, 0) for k in MODEL_STATES)


def zerosim_worker(a: argparse.Namespace) -> None:
    import cProfile
    import pstats

    from mpi4py import MPI

    from zerosim.comm import MPIComm
    from zerosim.engine import initialize

    mpi = MPI.COMM_WORLD
    rank, n = mpi.Get_rank(), mpi.Get_size()
    base = peak_rss_mib()
    model, _ = build_model(a.model)
    params = model.num_parameters()
    config = engine_config(a.model, n, a.stage, bool(a.overlap))
    config["zerosim"] = {"dtype": "float32", "schedule": "paper"}  # stage 3: FSDP2's bytes
    comm = MPIComm(validate=not a.no_check)
    engine, *_ = initialize(model, config, comm=comm)

    def step(x, y) -> float:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return float(loss)

    # stage 3, per step: ledger Σ wall_time and union of intervals (s), blocked (s), bytes sent
    per_step: list[tuple[float, float, float, int]] = []
    if a.stage == 3:
        blocked, plain_step = time_blocked(comm), step

        def step(x, y) -> float:
            comm.ledger.reset()
            blocked[0] = 0.0
            loss = plain_step(x, y)
            records = [r for r in comm.ledger.records if r.phase in ("forward", "backward")]
            spans = [(r.start, r.start + (r.wall_time or 0.0)) for r in records]
            per_step.append(
                (
                    sum(stop - start for start, stop in spans),
                    union_length(spans),
                    blocked[0],
                    sum(r.bytes_sent for r in records),
                )
            )
            return loss

    batches = global_batches(a.model, a.warmup + a.steps)
    profiler = cProfile.Profile() if a.prof and rank == 0 else None
    if profiler is not None:
        timed(step, mpi.Barrier, batches[: a.warmup], rank, n)
        profiler.enable()
        times, loss = timed(step, mpi.Barrier, batches[a.warmup :], rank, n)
        profiler.disable()
        times = [0.0] * a.warmup + times
    else:
        times, loss = timed(step, mpi.Barrier, batches, rank, n)
    extra = {}
    if a.stage == 3:
        comm_s = mpi.gather(per_step, root=0)
        extra = {
            "model_state_bytes": model_state_bytes(engine.memory_report()),
            "padded_numel": engine.strategy.padded_numel,
            "itemsize": engine.strategy.dtype.itemsize,
        }
    every = mpi.gather((times, loss, peak_rss_mib(), base), root=0)
    if rank != 0:
        return
    if profiler is not None:
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(15)
    t, losses, rss, bases = zip(*every, strict=True)
    if a.stage == 3:  # (ranks, steps, 4): median over measured steps of the mean over ranks
        measured = np.median(np.array(comm_s)[:, a.warmup :].mean(axis=0), axis=0)
        for i, key in enumerate(COMM_KEYS):
            extra[key] = 1e3 * float(measured[i])
        extra["bytes_sent"] = int(np.array(comm_s)[0, -1, 3])
    out = summary(np.array(t), losses, rss, bases, a.warmup, params=params, **extra)
    print(json.dumps(out), flush=True)


# -- torch worker ----------------------------------------------------------------------------------
def torch_modules():
    """nanoGPT-like torch modules whose parameter names are zerosim's (docs/nn.md)."""
    import torch
    from torch import nn
    from torch.nn import functional as F  # noqa: N812

    class TorchMLP(nn.Module):
        def __init__(self, sizes: list[int]) -> None:
            super().__init__()
            layers: list[nn.Module] = []
            for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
                layers += [nn.Linear(n_in, n_out)] + ([nn.ReLU()] if i < len(sizes) - 2 else [])
            self.layers = nn.Sequential(*layers)

        def forward(self, x, y):
            return F.cross_entropy(self.layers(x), y)

    class Attention(nn.Module):
        def __init__(self, c: int, heads: int) -> None:
            super().__init__()
            self.heads, self.c_attn, self.c_proj = heads, nn.Linear(c, 3 * c), nn.Linear(c, c)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.c_attn(x).split(c, dim=2)
            q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(y.transpose(1, 2).reshape(b, t, c))

    class FeedForward(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.c_fc, self.c_proj = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

        def forward(self, x):
            return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))

    class Block(nn.Module):
        def __init__(self, c: int, heads: int) -> None:
            super().__init__()
            self.ln_1, self.attn = nn.LayerNorm(c), Attention(c, heads)
            self.ln_2, self.mlp = nn.LayerNorm(c), FeedForward(c)

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class TorchGPT(nn.Module):
        def __init__(self, vocab: int, block_size: int, n_layer: int, n_head: int, n_embd: int):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block_size, n_embd)
            self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
            self.ln_f, self.lm_head = nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab, bias=False)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)

    return TorchMLP, TorchGPT


def gradient_gap(zs_model, torch_model, x: np.ndarray, y: np.ndarray) -> float:
    """max |g_zerosim − g_torch| / max |g_torch| over all parameters, one micro-batch.

    Run with ``--check`` only: it keeps a zerosim forward's activations alive, which would
    count in the torch process's peak RSS.
    """
    import torch

    zs_model(x, y)
    zs_model.backward()
    torch_model(torch.from_numpy(x), torch.from_numpy(y)).backward()
    zs_grads = {name: p.grad for name, p in zs_model.named_parameters()}
    torch_grads = {name: p.grad.numpy() for name, p in torch_model.named_parameters()}
    scale = max(float(np.abs(g).max()) for g in torch_grads.values())
    gap = max(float(np.abs(zs_grads[k] - g).max()) for k, g in torch_grads.items())
    torch_model.zero_grad(set_to_none=True)
    return gap / scale


def torch_twin(a: argparse.Namespace, n: int):
    """The torch module with zerosim's initial weights, Ψ, whether it is the GPT, every step's
    global batch and (``--check``) the gradient gap at initialisation."""
    import torch

    zs_model, vocab = build_model(a.model)
    TorchMLP, TorchGPT = torch_modules()  # noqa: N806
    model = TorchMLP(MLP_SIZES) if vocab is None else TorchGPT(vocab, **GPT_SHAPE)
    state = {k: torch.from_numpy(np.array(v)) for k, v in zs_model.state_dict().items()}
    model.load_state_dict(state, strict=True)
    batches = global_batches(a.model, a.warmup + a.steps)
    check = gradient_gap(zs_model, model, *my_rows(batches[0], 0, n)) if a.check else None
    return model, zs_model.num_parameters(), vocab is not None, batches, check


def torch_report(a: argparse.Namespace, times, loss, base: float, **extra) -> None:
    """Gather every rank's times, loss and RSS over torch.distributed; rank 0 prints the JSON."""
    import torch.distributed as dist

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (times, loss, peak_rss_mib(), base))
    if dist.get_rank() == 0:
        t, losses, rss, bases = zip(*every, strict=True)
        print(json.dumps(summary(np.array(t), losses, rss, bases, a.warmup, **extra)), flush=True)
    dist.barrier()


def torch_worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    rank, n = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    import zerosim.nn  # noqa: F401  (imported before the baseline, as in the zerosim worker)

    base = peak_rss_mib()
    model, params, gpt, batches, check = torch_twin(a, n)
    if a.stage >= 2:  # stage 2: SHARD_GRAD_OP-like; stage 3: FULL_SHARD-like
        mesh = init_device_mesh("cpu", (n,))
        reshard = a.stage == 3
        for layer in model.blocks if gpt else model.layers:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
        if a.stage == 1:
            optimizer = ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.Adam, lr=LR
            )
        else:
            optimizer = torch.optim.Adam(model.parameters(), lr=LR)

    def step(x, y) -> float:
        loss = model(torch.from_numpy(x), torch.from_numpy(y))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    times, loss = timed(step, dist.barrier, batches, rank, n)
    torch_report(a, times, loss, base, params=params, grad_gap=check)
    dist.destroy_process_group()


def deepspeed_worker(a: argparse.Namespace) -> None:
    """DeepSpeed's engine on the torch twin with ``engine_config`` (no zerosim section), launched
    by torchrun; its Adam is DeepSpeed's default for ``"type": "Adam"``, the CPU FusedAdam."""
    import logging

    import deepspeed
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    rank, n = dist.get_rank(), dist.get_world_size()

    import zerosim.nn  # noqa: F401  (imported before the baseline, as in the zerosim worker)

    base = peak_rss_mib()
    model, params, _, batches, _ = torch_twin(a, n)
    config = engine_config(a.model, n, a.stage, bool(a.overlap))
    engine, optimizer, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    inner = getattr(optimizer, "optimizer", optimizer)  # ZeRO wraps the basic optimizer

    def step(x, y) -> float:
        loss = engine(torch.from_numpy(x), torch.from_numpy(y))
        engine.backward(loss)
        engine.step()
        return loss.item()

    times, loss = timed(step, dist.barrier, batches, rank, n)
    torch_report(a, times, loss, base, params=params, optimizer=type(inner).__name__)
    engine.destroy()
    dist.destroy_process_group()


# -- driver ----------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    a: argparse.Namespace,
    n: int,
    model: str,
    impl: str,
    stage: int,
    overlap: bool = True,
    steps: int | None = None,
    warmup: int | None = None,
) -> dict:
    """One job of ``n`` ranks (``mpirun -n n``; DeepSpeed's under ``torchrun --nproc_per_node
    n``); its JSON summary, or {"error": ...} and its profile lines.

    ``overlap`` is stage 3's ``overlap_comm``; ``steps`` and ``warmup`` default to ``a``'s."""
    steps, warmup = a.steps if steps is None else steps, a.warmup if warmup is None else warmup
    port = str(free_port())
    if impl == "deepspeed":
        # --standalone: torchrun binds a port the OS picks (no race for a port chosen here)
        cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone"]
        cmd += ["--nproc_per_node", str(n), __file__]
    else:
        mpirun = Path(sys.executable).parent / "mpirun"
        cmd = [str(mpirun if mpirun.exists() else "mpirun"), "-n", str(n), sys.executable]
        cmd += [__file__]
    cmd += ["--worker", impl, "--model", model, "--stage", str(stage)]
    cmd += ["--steps", str(steps), "--warmup", str(warmup), "--overlap", str(int(overlap))]
    cmd += ["--prof"] if a.prof else []
    cmd += ["--check"] if a.check and impl == "torch" else []
    cmd += ["--no-check"] if a.no_check and impl == "zerosim" else []
    one = {f"{v}_NUM_THREADS": "1" for v in ("OMP", "OPENBLAS", "MKL")}
    one.update({} if a.glibc_default else RETAIN_FREED)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **one)
    if impl == "deepspeed":  # no accelerator probing; DeepSpeed's deprecation warnings off
        env.update(DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.timeout)
    lines = run.stdout.splitlines()
    found = [json.loads(line) for line in lines if line.startswith("{")]
    errors = [line for line in (run.stderr + run.stdout).splitlines() if "terminate" in line]
    tail = (errors or [line for line in run.stderr.splitlines() if line.strip()] or ["-"])[-1]
    if not found:
        return {"error": f"rc {run.returncode}: {tail[:200]}"}
    # torch's gloo teardown sometimes aborts at exit ("terminate called without an active
    # exception"), after rank 0 has printed: the measurement is complete, the exit is noted.
    note = f"rc {run.returncode} after reporting: {tail[:120]}" if run.returncode else ""
    return {**found[-1], "note": note, "log": [x for x in lines if not x.startswith("{")]}


def combine(runs: list[dict]) -> dict:
    """Median step (and stage-3 communication) times over repeats; the largest peak RSS; notes."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return runs[0] if runs else {}  # every run failed; or none was launched (--peers)
    worst = max(good, key=lambda r: max(r["rss_mib"]))
    notes = "; ".join(r.get("note") or r.get("error", "") for r in runs)
    times = {k: float(np.median([r[k] for r in good])) for k in ("ms", *COMM_KEYS) if k in good[0]}
    return {**worst, **times, "runs_ms": [r["ms"] for r in good], "note": notes.strip("; ")}


def rss_cell(r: dict) -> str:
    if "rss_mib" not in r:
        return "n/a"
    worst = int(np.argmax(r["rss_mib"]))
    return f"{r['rss_mib'][worst]:.0f} (+{r['rss_mib'][worst] - r['base_mib'][worst]:.1f})"


def ratio_cell(zs: dict, peer: dict) -> str:
    return f"{zs['ms'] / peer['ms']:.2f}" if "ms" in zs and "ms" in peer else "n/a"


def row(n: int, model: str, stage: int, zs: dict, th: dict, ds: dict) -> str:
    """A main-table row; a peer that was not run (``--peers``) or failed shows n/a."""
    params = zs.get("params", th.get("params", ds.get("params", 0)))
    ms = [f"{r['ms']:.1f}" if "ms" in r else "n/a" for r in (zs, th, ds)]
    loss = " / ".join(f"{r['loss']:.4f}" if "loss" in r else "n/a" for r in (zs, th, ds))
    return (
        f"| {n} | {model} | {params:,} | {stage} | {ms[0]} | {COUNTERPART[stage]} | {ms[1]} | "
        f"{ms[2]} | {ratio_cell(zs, th)} | {ratio_cell(zs, ds)} | {rss_cell(zs)} | "
        f"{rss_cell(th)} | {rss_cell(ds)} | {loss} |"
    )


def record(n: int, model: str, stage: int, zs: dict, th: dict, ds: dict) -> dict:
    """A main-table row for ``--json``: step times in ms (None when a side failed or did not run);
    ``ratio`` is zerosim / torch counterpart, ``ratio_deepspeed`` zerosim / DeepSpeed."""
    ratio = {
        key: zs["ms"] / peer["ms"] if "ms" in zs and "ms" in peer else None
        for key, peer in (("ratio", th), ("ratio_deepspeed", ds))
    }
    return {
        "n": n,
        "model": model,
        "stage": stage,
        "params": zs.get("params", th.get("params", ds.get("params"))),
        "counterpart": COUNTERPART[stage],
        "peers": [p for p, r in (("torch", th), ("deepspeed", ds)) if r],
        "zerosim_ms": zs.get("ms"),
        "torch_ms": th.get("ms"),
        "deepspeed_ms": ds.get("ms"),
        **ratio,
        "runs_ms": {
            k: r.get("runs_ms", []) for k, r in (("zerosim", zs), ("torch", th), ("deepspeed", ds))
        },
        "zerosim_rss_mib": max(zs["rss_mib"]) if "rss_mib" in zs else None,
        "torch_rss_mib": max(th["rss_mib"]) if "rss_mib" in th else None,
        "deepspeed_rss_mib": max(ds["rss_mib"]) if "rss_mib" in ds else None,
    }


def repeats_table(records: list[dict]) -> list[str]:
    """Each job's step time (ms, in launch order) beside the median the main table shows: how
    far the machine's load moved one configuration between repeats."""
    lines = [
        "Step time of each repeat (ms, in launch order; the main table gives their median):",
        "",
        "| N | model | stage | zerosim | torch counterpart | DeepSpeed |",
        "|---|---|---|---|---|---|",
    ]
    for r in records:
        cells = [", ".join(f"{ms:.1f}" for ms in r["runs_ms"][k]) or "–" for k in r["runs_ms"]]
        lines.append(f"| {r['n']} | {r['model']} | {r['stage']} | {' | '.join(cells)} |")
    return lines


# -- stage 3: exposed communication and model-state memory -----------------------------------------
def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def exposed_table(a: argparse.Namespace, models: list[str], stage3: dict) -> tuple[list[str], dict]:
    """Stage 3 with prefetch/overlap on and off (``stage3``: the main loop's results by (N, model),
    {"on": ..., "off": ...}), and the same model at N = 1 (run here); the printed lines and a
    stage-3 result by (N, model) for the memory table."""
    cores = usable_cores()
    runs = {key: pair["on"] for key, pair in stage3.items()}
    lines = [
        "",
        "Stage 3 exposed communication (per step; prefetch on = overlap_comm true: non-blocking "
        "all-gathers of the next modules; off = blocking on-demand gathers):",
        "",
        "| N | model | prefetch | step ms | in collectives ms (ledger Σ fwd+bwd) | a collective "
        "in flight ms | blocked in comm calls ms | compute est. ms | exposed est. ms "
        "(step − compute) | fwd+bwd bytes / 3(N−1)/N·Ψ_pad·b |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model in models:
        one = combine([launch(a, 1, model, "zerosim", 3) for _ in range(a.repeats)])
        runs[(1, model)] = one
        lines.append(
            f"| 1 | {model} | – | {one.get('ms', float('nan')):.1f} | compute-only "
            "reference | | | | | |"
        )
        for n in a.ranks:
            compute = one.get("ms", float("nan")) / n * max(1.0, n / cores)
            for label in ("on", "off"):
                r = stage3[(n, model)][label]
                if "ms" not in r:
                    lines.append(f"| {n} | {model} | {label} | {r.get('error', 'missing')} |")
                    continue
                formula = 3 * (n - 1) / n * r["padded_numel"] * r["itemsize"]
                volume = f"{r['bytes_sent'] / formula:.3f}" if formula else "–"
                lines.append(
                    f"| {n} | {model} | {label} | {r['ms']:.1f} | {r['ledger_ms']:.1f} | "
                    f"{r['in_flight_ms']:.1f} | {r['blocked_ms']:.1f} | {compute:.1f} | "
                    f"{r['ms'] - compute:.1f} | {volume} |"
                )
    over = [n for n in a.ranks if n > cores]
    lines += [
        "",
        "- step: the slowest rank's step time (as above); the other times are means over ranks "
        "(medians over steps and repeats).",
        "- in collectives: the ledger's wall_time summed over the step's forward and backward "
        "records. A non-blocking all-gather counts from its issue to its wait(), so with "
        "prefetch this includes the compute it overlapped, and gathers in flight together are "
        "counted once each: it can exceed the step. a collective in flight: the length of the "
        "union of those intervals, at most the step; an upper bound on exposed communication.",
        "- blocked: seconds the rank's thread spent inside communication calls (issuing and "
        "waiting for non-blocking ones, blocking ones whole, the cross-rank argument check and "
        "the clip all-reduce included), mean over ranks: the communication compute did not "
        "hide, measured directly, waiting for slower ranks included.",
        f"- compute est. = T(N=1)/N · max(1, N/C) with C = {cores} usable cores: the same model "
        "and global batch on one rank (no communication), split over N ranks, slowed by N/C when "
        "N ranks share C cores; exposed est. = step − compute est. It overstates the exposed "
        "time where work does not shrink with N (packing gathered-size gradients) and can even "
        "be negative: the reference runs in other jobs, at another moment of the machine's load, "
        "and a smaller batch per rank may run faster per sample. blocked needs no reference.",
        "- By default MPICH progresses a non-blocking collective only inside MPI calls (no "
        "asynchronous progress thread), so a prefetched all-gather moves most of its data when "
        "it is waited on: what prefetch saves here is mostly the wait for the slowest rank at "
        "each blocking gather, not transfer time hidden behind compute.",
    ]
    if over:
        lines.append(
            f"- N = {', '.join(map(str, over))} > C = {cores}: ranks time-share the cores, so "
            "there is no idle core for communication to hide behind and little true overlap is "
            "possible: a rank blocked in a collective mostly waits for other ranks' compute, "
            "and while it waits MPICH keeps polling, taking CPU from the ranks that compute."
        )
    return lines, runs


def memory_table(a: argparse.Namespace, models: list[str], runs: dict) -> list[str]:
    """Model-state bytes per rank for N in ``--memory-ranks`` against N = 1 (1/N up to padding)."""
    lines = [
        "",
        "Stage 3 model-state memory per rank (engine.memory_report(): params + grads + master "
        "params + optimizer states; float32 Adam, persistence threshold 0):",
        "",
        "| N | model | Ψ | Ψ_pad(N) | model states per rank (bytes) | ratio to N=1 | 1/N | "
        "(Ψ_pad(N)/N)/Ψ |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model in models:
        for n in sorted(set(a.memory_ranks) | {1}):
            if (n, model) not in runs:  # memory needs only the optimizer states: one step
                runs[(n, model)] = launch(a, n, model, "zerosim", 3, steps=1, warmup=0)
        base = runs[(1, model)].get("model_state_bytes")
        for n in sorted(a.memory_ranks):
            r = runs[(n, model)]
            if "model_state_bytes" not in r or not base:
                lines.append(f"| {n} | {model} | {r.get('error', 'missing')} |")
                continue
            psi = r["params"]
            lines.append(
                f"| {n} | {model} | {psi:,} | {r['padded_numel']:,} | "
                f"{r['model_state_bytes']:,} | {r['model_state_bytes'] / base:.6f} | "
                f"{1 / n:.6f} | {r['padded_numel'] / n / psi:.6f} |"
            )
    lines.append(
        "- Ψ_pad(N) = Σ_i ceil(numel_i/N)·N (stage 3 pads each parameter, so Ψ_pad(1) = Ψ). "
        "Activations, gathered parameters and libraries are not model states: peak RSS (the "
        "first table) does not fall as 1/N."
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=20, help="timed steps after warm-up")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--model", choices=["mlp", "gpt", "both"], default="both")
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    p.add_argument("--repeats", type=int, default=2, help="mpirun jobs per configuration")
    p.add_argument(
        "--peers",
        nargs="*",
        choices=["torch", "deepspeed"],
        default=["torch", "deepspeed"],
        help="the peers zerosim is timed against (default both)",
    )
    p.add_argument(
        "--memory-ranks",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8],
        help="world sizes of the stage-3 model-state memory table",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: mlp, N=2, stage 3, 3 steps, 1 repeat, memory at N=1, 2, 4",
    )
    p.add_argument(
        "--profile",
        type=int,
        nargs="?",
        const=0,
        choices=[0, 1, 2, 3],
        help="then cProfile zerosim at this stage (default 0) on rank 0, N = first of --ranks",
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds per mpirun job")
    p.add_argument("--worker", choices=["zerosim", "torch", "deepspeed"], help=argparse.SUPPRESS)
    p.add_argument("--stage", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--prof", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--overlap", type=int, default=1, choices=[0, 1], help=argparse.SUPPRESS)
    p.add_argument(
        "--check",
        action="store_true",
        help="also compare torch's and zerosim's gradients at initialisation (adds to RSS)",
    )
    p.add_argument(
        "--no-check",
        action="store_true",
        help="run zerosim without its cross-rank argument check (MPIComm(validate=False))",
    )
    p.add_argument(
        "--glibc-default",
        action="store_true",
        help="run the workers with glibc's default malloc thresholds (see RETAIN_FREED)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the main table's rows as JSON")
    a = p.parse_args(argv)
    if a.worker:
        a.model = a.model if a.model != "both" else "mlp"
        workers = {"zerosim": zerosim_worker, "torch": torch_worker, "deepspeed": deepspeed_worker}
        workers[a.worker](a)
        return 0
    if a.quick:
        a.ranks, a.model, a.stages, a.memory_ranks = [2], "mlp", [3], [1, 2, 4]
        a.steps, a.warmup, a.repeats = 3, 1, 1
    for flag, values in (("--ranks", a.ranks), ("--memory-ranks", a.memory_ranks)):
        for n in values:
            if n < 1 or max(GLOBAL_BATCH.values()) % n or min(GLOBAL_BATCH.values()) % n:
                p.error(f"{flag}: {n} does not divide the global batches {GLOBAL_BATCH}")
    models = ["mlp", "gpt"] if a.model == "both" else [a.model]
    t0, load = time.perf_counter(), os.getloadavg()[0]
    lines = [
        "| N | model | params | stage | zerosim ms/step | torch counterpart | torch ms/step | "
        "DeepSpeed ms/step | ratio zerosim/torch | ratio zerosim/DeepSpeed | zerosim peak RSS "
        "MiB (+training) | torch peak RSS MiB (+training) | DeepSpeed peak RSS MiB (+training) | "
        "last loss zerosim / torch / DeepSpeed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    records: list[dict] = []  # --json: one per row of the main table
    records_ds: list[dict] = []  # DeepSpeed's combined result of each row
    stage3: dict[tuple[int, str], dict] = {}
    for n in a.ranks:
        for model in models:
            for stage in a.stages:
                runs: dict[str, list[dict]] = {"zerosim": [], "torch": [], "deepspeed": []}
                off_runs: list[dict] = []  # stage 3 without prefetch/overlap
                sides = ["zerosim", *a.peers]
                for i in range(a.repeats):  # interleaved, so that a change in load hits all,
                    for impl in sides[i % len(sides) :] + sides[: i % len(sides)]:  # rotated
                        runs[impl].append(launch(a, n, model, impl, stage))
                    if stage == 3:
                        off_runs.append(launch(a, n, model, "zerosim", 3, overlap=False))
                zs, th, ds = (combine(runs[k]) for k in ("zerosim", "torch", "deepspeed"))
                lines.append(row(n, model, stage, zs, th, ds))
                records.append(record(n, model, stage, zs, th, ds))
                records_ds.append(ds)
                if stage == 3:
                    stage3[(n, model)] = {"on": zs, "off": combine(off_runs)}
                if th.get("grad_gap") is not None:
                    notes.append(
                        f"- gradient check, N={n}, {model}, stage {stage}: max |g_zerosim − "
                        f"g_torch| / max |g_torch| = {th['grad_gap']:.2e}"
                    )
                for r, who in ((zs, "zerosim"), (th, "torch"), (ds, "DeepSpeed")):
                    if r.get("note") or "error" in r:
                        what = r.get("note") or r["error"]
                        notes.append(f"- {who}, N={n}, {model}, stage {stage}: {what}")
    if a.repeats > 1:
        lines += ["", *repeats_table(records)]
    used = sorted({r["optimizer"] for r in records_ds if "optimizer" in r})
    if used:
        notes.append(f"- DeepSpeed's optimizer (the class its engine built): {', '.join(used)}")
    print("\n".join(lines + ([""] + notes if notes else [])), flush=True)
    if 3 in a.stages:
        more, runs = exposed_table(a, models, stage3)
        print("\n".join(more + memory_table(a, models, runs)))
    if a.json:
        Path(a.json).write_text(json.dumps(records, indent=1) + "\n")
    print(
        f"\n{time.perf_counter() - t0:.0f} s; load average 1 min {load:.2f} at start, "
        f"{os.getloadavg()[0]:.2f} at end, {os.cpu_count()} CPUs; glibc malloc "
        + ("defaults" if a.glibc_default else " ".join(f"{k}={v}" for k, v in RETAIN_FREED.items()))
    )
    if a.profile is not None:
        a.prof = True
        for model in models:
            out = launch(a, a.ranks[0], model, "zerosim", a.profile)
            print(
                f"\ncProfile of zerosim stage {a.profile}, {model}, N={a.ranks[0]}, rank 0, "
                f"{a.steps} steps (by tottime):"
            )
            print("\n".join(out.get("log", [out.get("error", "")])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
