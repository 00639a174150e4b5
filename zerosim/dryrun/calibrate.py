"""Measure this machine for the dry run's time model: microbenchmarks only, never a training step.

``zerosim calibrate --out host.json [--ranks N]`` runs these and writes a cluster file in the
format of ``clusters/*.json`` (docs/dryrun.md), so that ``zerosim dryrun --cluster host.json``
predicts what ``zerosim train --json`` measures here. Each benchmark runs in the conditions of a
step: operands too large for the cache where they would be, a fresh output for every call.

- **matrix products** (``matmul``): float32 products at GPT-like shapes, (T, h) · (h, c·h), and
  square ones; FLOP/s = 2·m·k·n / seconds. ``device_flops`` is their median.
- **element-wise work** (``elementwise``): ``np.add`` of two arrays beyond the cache into a third
  written before (its pages' first touch is ``page_fault_s``'s, priced apart); bytes/s =
  3·n·4 / seconds. ``memory_bandwidth`` is the median over the large sizes.
- **a call's fixed cost** (``op_overhead_s``): ``np.add`` on one-element arrays with ``out=``,
  the part of every array operation that does not grow with its size.
- **matrix products by intensity** (``matmul_by_intensity``): every product measured, small
  ones and attention's batched ones (``batched``) too, as [FLOP per byte, FLOP/s].
- **zerosim's own Python calls** (``call_overhead_s``), **a fresh page's first touch**
  (``page_fault_s``, ``hugepage_fault_s``): what a NumPy step spends besides its array calls
  (``dryrun/host.py`` counts both in the dry run); on a machine that takes freed memory back (a
  virtual machine's free page reporting), a huge page's touch after that
  (``cold_hugepage_fault_s``) and how long a freed block stays (``reclaim_after_s``,
  ``measure_reclaim``).
- **collectives** (``collectives``, measured by ``measure_collectives`` on N ranks): zerosim's own
  ``MPIComm`` calls (argument checks, cross-rank check, ledger) over a grid of sizes, written as
  ``collectives_by_size``, from which the dry run prices a collective on the N ranks at its S;
  the α and bandwidth of the time model's ring formula c_α·α + c_β·S/B (``analysis.timing``)
  fitted to them by least squares, as ``intra_latency`` and ``intra_bandwidth``, for groups of
  another size.
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from zerosim.analysis.timing import alpha_beta_coefficients

# (tokens T, hidden h, columns c·h): the products of a GPT layer (QKV 3h, MLP 4h, output h)
GPT_SHAPES = [(512, 256, 768), (512, 256, 1024), (1024, 512, 1536), (1024, 512, 2048),
              (2048, 768, 3072)]  # fmt: skip
SQUARE_SIZES = [128, 256, 512, 1024]
SMALL_SHAPES = [(256, 128, 128), (256, 128, 384), (256, 128, 512), (64, 64, 64), (32, 32, 128)]
# (batch·heads, T, d, T) and (batch·heads, T, T, d): attention's batched products
ATTENTION_SHAPES = [(16, 64, 32, 64), (16, 64, 64, 32), (16, 128, 64, 128), (32, 128, 64, 128),
                    (32, 128, 128, 64)]  # fmt: skip
ELEMENTWISE_SIZES = [2**20, 2**22, 2**24]  # 4 MiB to 64 MiB per float32 operand
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
COLLECTIVE_SIZES = [2**k for k in range(2, 25, 2)]  # bytes: 4 B to 16 MiB


# called before each benchmark: a barrier while ``side_by_side`` runs them on every rank at once
_start_together: list[Callable[[], Any]] = []


@contextmanager
def side_by_side(comm: Any) -> Iterator[None]:
    """Within it, every benchmark starts on all of ``comm``'s ranks at once (a barrier before
    each), so that each rank measures its rates while the others run theirs: as in a step of
    N ranks, they share the memory bus and the last-level cache."""
    _start_together.append(comm.barrier)
    try:
        yield
    finally:
        _start_together.pop()


def seconds_per_call(fn: Callable[[], Any], budget_s: float, min_calls: int = 3) -> float:
    """The median CPU seconds of one ``fn()`` over repeats lasting about ``budget_s``: CPU time,
    not wall time, so that other processes holding a core of a shared machine do not count
    (run with one BLAS thread, ``OMP_NUM_THREADS=1``, as ``zerosim train``'s ranks are run)."""
    for barrier in _start_together:
        barrier()
    fn()  # first call: allocator and library warm-up
    times: list[float] = []
    spent = 0.0
    while spent < budget_s or len(times) < min_calls:
        start = time.process_time()
        fn()
        dt = max(time.process_time() - start, 1e-9)
        times.append(dt)
        spent += dt
    return statistics.median(times)


def measure_matmul(budget_s: float, shapes: list[tuple[int, int, int]] | None = None) -> list:
    """[[m, k, n, FLOP/s], …] of float32 products with a fresh output each and cold operands
    (``cold_pairs``)."""
    rows = []
    every = [*GPT_SHAPES, *SMALL_SHAPES, *((s, s, s) for s in SQUARE_SIZES)]
    for m, k, n in shapes or every:
        pairs = cold_pairs((m, k), (k, n))
        dt = seconds_per_call(lambda pairs=pairs: np.matmul(*next(pairs)), budget_s)
        rows.append([m, k, n, 2 * m * k * n / dt])
    return rows


def cold_pairs(first: tuple[int, ...], second: tuple[int, ...]) -> Iterator[tuple]:
    """Pairs of float32 operands of these shapes, cycled through ``cold_copies`` of them, so
    that each product finds its operands out of the cache, as a step's products do (a layer's
    weights and activations were last touched a layer or a pass before): small products run
    up to a third slower cold than on operands left in the cache by the previous call."""
    rng = np.random.default_rng(0)
    copies = cold_copies(4 * (math.prod(first) + math.prod(second)))
    pairs = [
        (
            rng.standard_normal(first, dtype=np.float32),
            rng.standard_normal(second, dtype=np.float32),
        )
        for _ in range(copies)
    ]
    return itertools.cycle(pairs)


def measure_batched_matmul(budget_s: float, shapes: list[tuple[int, ...]] | None = None) -> list:
    """[[batch, m, k, n, FLOP/s], …] of float32 batched products (attention's scores and
    context: (B·heads, T, d)·(B·heads, d, T) and back), where NumPy runs one small product per
    matrix of the batch; cold operands (``cold_pairs``)."""
    rows = []
    for b, m, k, n in shapes or ATTENTION_SHAPES:
        pairs = cold_pairs((b, m, k), (b, k, n))
        dt = seconds_per_call(lambda pairs=pairs: np.matmul(*next(pairs)), budget_s)
        rows.append([b, m, k, n, 2 * b * m * k * n / dt])
    return rows


def matmul_by_intensity(matmul: list, batched: list) -> list:
    """[[FLOP per byte, FLOP/s], …] of every measured product, by increasing intensity: the
    rate a host's time model reads for a product of that intensity (FLOPs over its operands'
    and result's bytes, as the meta tracker counts them). Small products run far below the
    large ones' rate (one BLAS call's fixed cost, no blocking to amortize), and a product's
    intensity is what tells them apart."""
    rates: dict[float, list[float]] = {}
    for b, m, k, n, rate in [[1, *row] for row in matmul] + batched:
        flops, nbytes = 2 * b * m * k * n, 4 * b * (m * k + k * n + m * n)
        rates.setdefault(round(flops / nbytes, 6), []).append(rate)
    return [[x, statistics.median(r)] for x, r in sorted(rates.items())]  # one rate a point


def measure_call_overhead(budget_s: float) -> tuple[float, int]:
    """(seconds of one of zerosim's own Python calls, calls timed): CPU seconds of a sample of
    zerosim's own code with no array work, over the calls ``host.PythonCalls`` counts in it
    (the hook off while timed). The sample is what runs between a step's array calls: the
    config's checks (small functions reading a few attributes and calling the next) and the
    model's walks over its modules and parameters (generators, as the hooks and the strategy
    walk them)."""
    from zerosim.config import load_config  # noqa: PLC0415
    from zerosim.dryrun.host import PythonCalls  # noqa: PLC0415
    from zerosim.nn import GPT  # noqa: PLC0415

    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3},
    }
    model = GPT(64, 16, 2, 2, 32)

    def sample() -> None:
        load_config(config, 2)
        for _ in range(10):
            for _ in model.named_parameters():
                pass
            for _ in model.modules():
                pass

    with PythonCalls() as counter:
        sample()
    return seconds_per_call(sample, budget_s) / counter.calls, counter.calls


def measure_page_faults(budget_s: float, nbytes: int = 64 << 20) -> dict[str, float]:
    """The CPU seconds of one first touch of a fresh page: a fresh anonymous mapping of
    ``nbytes`` (2 MiB-aligned), filled and unmapped, less the fill of a buffer already touched,
    over the minor faults the kernel counted (``ru_minflt``). Private, as malloc maps; once
    advised against huge pages (4 KiB pages: ``page_fault_s``), once for them where NumPy asks
    for them (``hugepage_fault_s``: 2 MiB pages, those the kernel gave as 4 KiB ones priced at
    ``page_fault_s``).

    The mapping is made here, not by ``np.empty``: glibc serves a request of any size from a
    freed heap chunk (or the heap's free top) that holds it, and after the products and
    element-wise calls ``measure_compute`` times first, the heap held one of 64 MiB: ``np.empty``
    then faulted no page at all, and the seconds over so few faults were noise (0 to 1,900 µs
    "a page")."""
    import mmap  # noqa: PLC0415
    import resource  # noqa: PLC0415

    from zerosim.dryrun.host import HUGE_PAGE, PAGE, numpy_hugepages  # noqa: PLC0415

    reused = np.ones(nbytes // 4, np.float32)
    fill = seconds_per_call(lambda: reused.fill(1.0), budget_s)

    def fresh(advice: int | None) -> None:
        with mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE) as mapping:
            whole = np.frombuffer(mapping, np.uint8)
            start = -whole.ctypes.data % HUGE_PAGE
            if advice is not None:  # Linux's; elsewhere the kernel's default
                mapping.madvise(advice, start, nbytes)
            whole[start : start + nbytes].view(np.float32).fill(1.0)
            del whole  # the mapping closes only once no array holds it

    def faults_and_seconds(advice: int | None) -> tuple[int, float]:
        """(minor faults of one fresh mapping, its extra seconds over a reused buffer)."""
        seconds = seconds_per_call(lambda: fresh(advice), budget_s)
        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        fresh(advice)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start
        return faults, max(seconds - fill, 1e-12)

    pages, seconds = faults_and_seconds(getattr(mmap, "MADV_NOHUGEPAGE", None))
    page_s = seconds / max(pages, 1)
    huge_s = None
    if numpy_hugepages():
        faults, seconds = faults_and_seconds(mmap.MADV_HUGEPAGE)
        # faults = small + huge over nbytes = small·PAGE + huge·HUGE_PAGE
        huge = max(0, (nbytes // PAGE - faults) // (HUGE_PAGE // PAGE - 1))
        small = max(0, faults - huge)
        # no huge page given (none free, or the kernel's setting): a 2 MiB region faults as
        # its 4 KiB pages
        huge_s = (
            max(seconds - small * page_s, 1e-12) / huge if huge else page_s * (HUGE_PAGE // PAGE)
        )
    return {"page_fault_s": page_s, "hugepage_fault_s": huge_s, "pages": pages, "fill_s": fill}


def measure_elementwise(budget_s: float, sizes: list[int] | None = None) -> list:
    """[[elements, bytes/s], …] of float32 ``a + b`` (3 arrays' bytes moved) into an output
    whose pages were touched before: the memory's bandwidth alone. A fresh output of 64 MiB is
    a fresh mapping at every call (beyond glibc's 32 MiB mmap ceiling), and its first touch
    would be counted twice: here and in the fresh pages the dry run prices apart."""
    rows = []
    for n in sizes or ELEMENTWISE_SIZES:
        a, b, out = np.ones(n, np.float32), np.ones(n, np.float32), np.ones(n, np.float32)
        dt = seconds_per_call(lambda a=a, b=b, out=out: np.add(a, b, out=out), budget_s)
        rows.append([n, 3 * 4 * n / dt])
    return rows


# elements of the calls ``measure_elementwise_by_size`` times: one element to 16 MiB of float32
# (a larger output is above glibc's 32 MiB mmap ceiling: a fresh mapping, its pages first
# touched by every call, which the dry run prices apart as fresh pages)
CALL_SIZES = [1, 2**4, 2**8, 2**10, 2**12, 2**14, 2**16, 2**18, 2**20, 2**22]
QUICK_CALL_SIZES = [1, 2**10, 2**16, 2**20]


def measure_elementwise_by_size(budget_s: float, sizes: list[int] | None = None) -> dict:
    """{rate class: [[bytes, seconds], …]}: one call's CPU seconds at each size, for each rate
    class the dry run's tracker tells apart (``meta.rate_class``): "native" float32 ``a + b``
    (3·4·n bytes), "bf16" ``x + x`` in bfloat16 (3·2·n), "to_bf16" ``a.astype(bfloat16)`` and
    "from_bf16" ``x.astype(float32)`` (4·n + 2·n each). In a step's conditions: a fresh output
    each call (NumPy's allocation with it) and cold operands, each call taking the next of
    enough copies to overflow the last-level cache (``cold_copies``), as a step reads what it
    wrote long before. From one element, where a call is its fixed cost, to 16 MiB, where it is
    the memory's bandwidth. With ``side_by_side`` each rank measures while the others run the
    same call."""
    table: dict[str, list] = {"native": [], "bf16": [], "to_bf16": [], "from_bf16": []}
    for n in sizes or CALL_SIZES:
        for rate, (call, nbytes) in _cold_calls(n).items():
            table[rate].append([nbytes, seconds_per_call(call, budget_s)])
    return table


def _cold_calls(n: int) -> dict[str, tuple[Callable[[], Any], int]]:
    """{rate class: (a call on n elements, the bytes it reads and writes)}, each call on the
    next of ``cold_copies`` operands."""
    from ml_dtypes import bfloat16  # noqa: PLC0415

    a = [np.ones(n, np.float32) for _ in range(cold_copies(8 * n))]
    cold_a, cold_x = itertools.cycle(a), itertools.cycle([v.astype(bfloat16) for v in a])
    return {
        "native": (lambda: np.add(next(cold_a), next(cold_a)), 12 * n),
        "bf16": (lambda: np.add(next(cold_x), next(cold_x)), 6 * n),
        "to_bf16": (lambda: next(cold_a).astype(bfloat16), 6 * n),
        "from_bf16": (lambda: next(cold_x).astype(np.float32), 6 * n),
    }


def cold_copies(nbytes: int) -> int:
    """How many copies of operands of ``nbytes`` a benchmark cycles through so that each call
    finds its operands out of the cache: twice the last-level cache's bytes (Linux's
    ``cache/index3/size``; 64 MiB where the system does not say), at least 2, at most 4,096."""
    try:
        size = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        cache = int(size.rstrip("K")) << 10 if size.endswith("K") else int(size)
    except (OSError, ValueError):
        cache = 32 << 20
    return max(2, min(4096, -(-2 * cache // max(nbytes, 1))))


def measure_op_overhead(budget_s: float) -> float:
    """Seconds of one ufunc call on one-element arrays (``out=`` given): a call's fixed cost."""
    a, out = np.ones(1, np.float32), np.empty(1, np.float32)

    def hundred() -> None:
        for _ in range(100):
            np.add(a, a, out=out)

    return seconds_per_call(hundred, budget_s) / 100


def measure_collectives(comm: Any, budget_s: float, sizes: list[int] | None = None) -> list:
    """[[op, S bytes, seconds], …] on ``comm`` (every rank calls it; rank 0's medians, each
    the slowest rank's time of that repeat): zerosim's calls with their checks and ledger.
    S is nccl-tests' size, as the ledger records it (an all-gather's output, a reduce-scatter's
    input, an all-reduce's and a broadcast's buffer)."""
    p = comm.size
    rows = []
    for op in COLLECTIVES:
        for size in sizes or COLLECTIVE_SIZES:
            n = max(p, size // 4 // p * p)  # float32 elements, a multiple of p
            full, part = np.ones(n, np.float32), np.ones(n // p, np.float32)
            call = {
                "all_reduce": lambda full=full: comm.all_reduce(full),
                "all_gather": lambda full=full, part=part: comm.all_gather(full, part),
                "reduce_scatter": lambda full=full, part=part: comm.reduce_scatter(part, full),
                "broadcast": lambda full=full: comm.broadcast(full, 0),
            }[op]
            dt = _synchronized_seconds(comm, call, budget_s)
            rows.append([op, 4 * n, dt])
            comm.ledger.reset()  # the ledger grows with every call: keep it small
    return rows


def collectives_by_size(rows: list) -> dict[str, list[list[float]]]:
    """{op: [[S bytes, seconds], …]} of ``measure_collectives``' rows, by increasing S: the
    table the dry run prices a collective on the calibrated ranks from (a size measured twice,
    where rounding to a multiple of the ranks made two sizes one, keeps its first time)."""
    table: dict[str, dict[int, float]] = {}
    for op, size, seconds in rows:
        table.setdefault(op, {}).setdefault(size, seconds)
    return {op: [[size, t] for size, t in sorted(times.items())] for op, times in table.items()}


def measure_one_rank_collective(comm: Any, budget_s: float) -> float:
    """CPU seconds of one of zerosim's collectives on a group of one rank (``comm`` split by
    rank): an all-gather of one float32, so that its copy is nothing and what is left is the
    call's fixed cost (zerosim's checks and ledger, and MPI's call on an ``MPIComm``; a one-rank
    ``LocalComm`` makes none). A step at N = 1 issues its collectives on such groups."""
    solo = comm.split(comm.rank, name="calibrate_one_rank")
    full, part = np.ones(1, np.float32), np.ones(1, np.float32)

    def hundred() -> None:
        for _ in range(100):
            solo.all_gather(full, part)
        solo.ledger.reset()

    return seconds_per_call(hundred, budget_s) / 100


def _synchronized_seconds(comm: Any, call: Callable[[], None], budget_s: float) -> float:
    """The median over repeats of the slowest rank's seconds for ``call``; every rank runs as
    many repeats (rank 0's budget decides, broadcast), each after a barrier."""
    call()
    repeats = np.array([0], np.int64)
    if comm.rank == 0:
        start = time.perf_counter()
        call()
        repeats[0] = max(3, min(200, int(budget_s / max(time.perf_counter() - start, 1e-6))))
    else:
        call()
    comm.broadcast(repeats, 0)
    times = np.empty(int(repeats[0]), np.float64)
    for i in range(times.size):
        comm.barrier()
        start = time.perf_counter()
        call()
        times[i] = time.perf_counter() - start
    slowest = np.empty_like(times)
    comm.mpi.Allreduce(times, slowest, op=_mpi_max())
    return float(np.median(slowest))


def _mpi_max() -> Any:
    from mpi4py import MPI  # noqa: PLC0415  (only under mpirun)

    return MPI.MAX


def fit_alpha_bandwidth(rows: list, p: int) -> tuple[float, float]:
    """α (s) and B (bytes/s) of t = c_α(op, p)·α + c_β(op, p)·S/B, by least squares on every
    measured (op, S, t) (broadcast as the time model prices it: a tree)."""
    a = np.array([alpha_beta_coefficients(op, p) for op, _, _ in rows], dtype=np.float64)
    sizes = np.array([s for _, s, _ in rows], dtype=np.float64)
    t = np.array([dt for _, _, dt in rows], dtype=np.float64)
    design = np.stack([a[:, 0], a[:, 1] * sizes], axis=1)
    weights = 1.0 / t  # relative errors: a 4-byte call counts as much as a 16 MiB one
    (alpha, inverse_bandwidth), *_ = np.linalg.lstsq(
        design * weights[:, None], t * weights, rcond=None
    )
    return max(float(alpha), 1e-9), 1.0 / max(float(inverse_bandwidth), 1e-15)


def cluster_file(
    ranks: int,
    matmul: list,
    elementwise: list,
    op_overhead_s: float,
    collectives: list,
    host: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The cluster file of this host (``timeline.load_cluster_model`` reads it); ``host``: what
    ``measure_host`` measured besides (Python calls, page faults, batched products)."""
    host = host or {}
    extra = {key: host[key] for key in HOST_RATES if host.get(key) is not None}
    if collectives:
        extra["collectives_by_size"] = collectives_by_size(collectives)
    if "batched" in host:
        extra["matmul_by_intensity"] = matmul_by_intensity(matmul, host["batched"])
    import platform  # noqa: PLC0415

    alpha, bandwidth = fit_alpha_bandwidth(collectives, ranks) if ranks > 1 else (1e-6, 1e10)
    large = [rate for n, rate in elementwise if n >= 2**22] or [r for _, r in elementwise]
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "name": f"this host ({platform.node()}): {ranks} rank(s), NumPy, measured by "
        "zerosim calibrate",
        "comment": "every rate measured here by microbenchmarks (zerosim/dryrun/calibrate.py), "
        "none fitted on a step time: device_flops the median float32 matmul rate, "
        "memory_bandwidth element-wise bytes/s beyond the cache, op_overhead_s one ufunc "
        "call's fixed cost, intra_latency/intra_bandwidth the ring formula fitted to zerosim's "
        "MPIComm collectives; device_memory_bytes the RAM shared by the ranks; "
        "call_overhead_s one of zerosim's own Python calls, page_fault_s and hugepage_fault_s "
        "the first touch of a fresh 4 KiB / 2 MiB page, cold_hugepage_fault_s and "
        "reclaim_after_s (where the machine takes freed memory back) the first touch of a "
        "2 MiB page it took back and how long a freed block stays, matmul_by_intensity the "
        "products' rate by FLOP per byte, elementwise_by_size one element-wise call's seconds by "
        "its bytes for each rate class (NumPy's float32 loops, bfloat16's, the casts into and "
        "out of it), collectives_by_size each of zerosim's collectives' seconds on all the "
        "ranks by S",
        "backend": "numpy",
        "nodes": 1,
        "devices_per_node": ranks,
        "intra_bandwidth": bandwidth,
        "inter_bandwidth": bandwidth,
        "intra_latency": alpha,
        "inter_latency": alpha,
        "device_flops": statistics.median(rate for *_, rate in matmul),
        "device_memory_bytes": memory // ranks,
        "memory_bandwidth": statistics.median(large),
        "op_overhead_s": op_overhead_s,
        "overlap": False,  # MPICH has no progress thread: a collective moves while it is waited
        **extra,
        "measurements": {
            "matmul": matmul,
            "elementwise": elementwise,
            "collectives": collectives,
            **{key: host[key] for key in ("batched", "calls", "faults", "probe_s") if key in host},
        },
    }


# the rates measure_host writes as they are
HOST_RATES = (
    "call_overhead_s",
    "page_fault_s",
    "hugepage_fault_s",
    "cold_hugepage_fault_s",
    "reclaim_after_s",
    "one_rank_collective_s",
    "elementwise_by_size",
)


def measure_compute(budget_s: float, quick: bool = False) -> dict[str, Any]:
    """Every rate measured in a rank's own process: ``matmul``, ``elementwise``,
    ``op_overhead_s`` and ``host`` (``measure_host``), the arguments ``cluster_file`` takes
    besides the collectives; ``quick``: small grids."""
    return {
        "matmul": measure_matmul(budget_s, GPT_SHAPES[:2] + [(256, 256, 256)] if quick else None),
        "elementwise": measure_elementwise(budget_s, [2**20, 2**22] if quick else None),
        "op_overhead_s": measure_op_overhead(budget_s),
        "host": {
            **measure_host(budget_s, quick),
            "elementwise_by_size": measure_elementwise_by_size(
                budget_s, QUICK_CALL_SIZES if quick else None
            ),
        },
    }


@cache
def _probe_operands() -> tuple[Any, Any, Any]:
    """A product's operands (a 64-token stretch of a hidden size 192 GPT's MLP) and a vector."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 192), dtype=np.float32)
    b = rng.standard_normal((192, 768), dtype=np.float32)
    return a, b, np.ones(4096, np.float32)


def _probe_call(x: Any) -> Any:
    """One Python call of the probe's sample, as a step's Python makes thousands."""
    return x


def speed_probe() -> float:
    """CPU seconds of a fixed sample of a step's work, the fastest of three runs: a few small
    products, a hundred element-wise calls and a thousand Python calls (about 2 ms here). It
    says how fast this machine runs now: on a virtual machine a like sample has moved by a third
    and more within seconds, with nothing else running and no CPU time taken from the process.
    ``zerosim calibrate`` writes its median as ``measurements.probe_s``; ``zerosim train
    --probe`` runs it after every optimizer step, so that a step measured while the machine ran
    at another speed than it was calibrated at can be told apart (benchmarks/dryrun_host.py)."""
    a, b, x = _probe_operands()
    best = math.inf
    for _ in range(3):
        start = time.process_time()
        for _ in range(4):
            a @ b
        for _ in range(100):
            np.add(x, x)
        for _ in range(1000):
            _probe_call(x)
        best = min(best, time.process_time() - start)
    return best


def measure_probe(budget_s: float) -> float:
    """The median ``speed_probe`` over repeats lasting about ``budget_s`` (after a barrier of
    the ranks, with ``side_by_side``: a step's ranks probe side by side too)."""
    for barrier in _start_together:
        barrier()
    probes = [speed_probe()]
    while sum(probes) < budget_s or len(probes) < 5:
        probes.append(speed_probe())
    return statistics.median(probes)


def measure_host(budget_s: float, quick: bool = False) -> dict[str, Any]:
    """What a NumPy step spends besides its array calls and products, and the batched
    products: the keys ``cluster_file`` takes as ``host``; ``quick`` leaves out the huge pages
    the machine takes back (``measure_reclaim``, some 15 seconds of waiting)."""
    call_s, calls = measure_call_overhead(budget_s)
    faults = measure_page_faults(budget_s)
    batched = measure_batched_matmul(budget_s, ATTENTION_SHAPES[:2] if quick else None)
    reclaim = {} if quick or faults["hugepage_fault_s"] is None else measure_reclaim()
    return {
        "call_overhead_s": call_s,
        "page_fault_s": faults["page_fault_s"],
        "hugepage_fault_s": faults["hugepage_fault_s"],
        **reclaim_rates(faults["hugepage_fault_s"], reclaim),
        "batched": batched,
        "calls": {"calls_timed": calls, "seconds_a_call": call_s},
        "faults": {**faults, **({"reclaim": reclaim} if reclaim else {})},
        "probe_s": measure_probe(budget_s),
    }


RECLAIM_IDLE_S = 3.0  # a freed block left this long is taken back where the machine does
RECLAIM_TRIES = 4  # touches after idling, at most: until two were taken back
RECLAIM_AGES_S = (0.5, 1.0, 1.5, 2.0, 2.5)  # how long freed blocks are left before a touch
RECLAIM_BYTES = 64 << 20
COLD = 2.0  # a touch this many times slower a page than right after a free was taken back


def touch_fresh(nbytes: int, huge: bool) -> float:
    """Seconds of the first touch of a fresh private mapping of ``nbytes`` advised for huge
    pages (``huge``) or against them, one byte a 4 KiB page (the kernel zeroes each page it
    gives), over its pages of that kind (2 MiB or 4 KiB); the mapping is freed again."""
    import mmap  # noqa: PLC0415

    from zerosim.dryrun.host import HUGE_PAGE, PAGE  # noqa: PLC0415

    with mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE) as mapping:
        mapping.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
        pages = np.frombuffer(mapping, np.uint8)
        start = time.perf_counter()
        pages[::PAGE] = 1
        seconds = time.perf_counter() - start
        del pages  # the mapping closes only once no array holds it
    return seconds / (nbytes // (HUGE_PAGE if huge else PAGE))


def _touch_huge(nbytes: int) -> float:
    """``touch_fresh`` of a mapping advised for huge pages: seconds a 2 MiB page."""
    return touch_fresh(nbytes, huge=True)


def measure_reclaim(nbytes: int = RECLAIM_BYTES) -> dict[str, Any]:
    """Whether this machine takes freed memory back, and when: a virtual machine with free page
    reporting (``virtio_balloon``'s, Linux's ``mm/page_reporting.c``) hands free 2 MiB blocks
    back to its host a while after they were freed, and the next fault on one pays the host's
    faults too. A fresh mapping is touched right after one of the same size was freed (``warm``,
    the kernel gives the blocks freed last first), and after the machine idled
    ``RECLAIM_IDLE_S``, up to ``RECLAIM_TRIES`` times until two touches were ``COLD`` times
    slower (``cold``, their mean; the worker that hands blocks back runs every few seconds and
    does not take every block on each pass: here the first idle of a process was often warm).
    Where one was, a touch after each of ``RECLAIM_AGES_S`` tells when: ``reclaim_after_s`` is
    halfway between the last age still warm and the first taken back (a freed block goes at any
    time in a window). Each value: seconds a 2 MiB page of the touch, one byte a 4 KiB page."""
    _touch_huge(nbytes)
    warm = _touch_huge(nbytes)
    cold: list[float] = []
    idle: list[float] = []
    while len(idle) < RECLAIM_TRIES and len(cold) < 2:
        time.sleep(RECLAIM_IDLE_S)
        idle.append(_touch_huge(nbytes))
        cold += [idle[-1]] if idle[-1] >= COLD * warm else []
    result: dict[str, Any] = {"warm_s": warm, "idle_s": idle, "ages": []}
    if not cold:
        return result  # nothing taken back
    result["cold_s"] = statistics.mean(cold)
    for age in RECLAIM_AGES_S:
        _touch_huge(nbytes)
        time.sleep(age)
        result["ages"].append([age, _touch_huge(nbytes)])
    taken = [age for age, s in result["ages"] if s >= COLD * warm] or [RECLAIM_IDLE_S]
    kept = [age for age, s in result["ages"] if s < COLD * warm and age < taken[0]] or [0.0]
    result["reclaim_after_s"] = (kept[-1] + taken[0]) / 2
    return result


def reclaim_rates(hugepage_fault_s: float | None, reclaim: dict[str, Any]) -> dict[str, float]:
    """The cluster file's ``cold_hugepage_fault_s`` (a warm huge page's fault plus what a block
    taken back adds to its touch) and ``reclaim_after_s``, where ``measure_reclaim`` found the
    machine takes blocks back; none otherwise."""
    if hugepage_fault_s is None or "reclaim_after_s" not in reclaim:
        return {}
    return {
        "cold_hugepage_fault_s": hugepage_fault_s + reclaim["cold_s"] - reclaim["warm_s"],
        "reclaim_after_s": reclaim["reclaim_after_s"],
    }
