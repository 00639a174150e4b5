"""The dry run's time model: one step of a rank's trace, simulated on a described cluster.

**The trace.** While a representative runs its last step, the dry run writes what the engine
issues, in the order it issues it: compute (the FLOPs of the matrix products between two
collective events), each collective as it is issued (``VirtualComm``'s ("issue", i)) and each
wait on a non-blocking one (("wait", i)): so stage 3's prefetches, ``overlap_comm``'s bucket
reductions and their order are the engine's own.

**The cluster.** ``ClusterModel`` (``dryrun/cluster.py``): physical rates read from a file
that cites each one, and at most one fitted number, the software factor. Rank r sits on node
r // devices_per_node.

**Collectives: NCCL's ring over the node hierarchy.** A collective of S bytes (nccl-tests' S)
on p ranks takes c_α(p)·α + c_β(p)·S / (B · e(S)) (``analysis.timing``'s coefficients), where
e(S) is ``bus_efficiency_by_size`` (published nccl-tests figures) and B the ring's bus
bandwidth. NCCL orders one ring through each node in turn, so every step moves a chunk over
every hop at once: inside a node over NVLink, between nodes over the NICs. The hops run
together, pipelined, so the ring goes at its slowest hop, and the intra- and inter-node parts
are NOT added in series:

- on one node: B = intra_bandwidth · intra_efficiency, α = intra_latency;
- over several nodes with k ranks on each (k > 1): everything the ring carries enters a node
  through its NICs, and the group's k ranks own k shares of them (every other group of the
  same shape runs the same collective at the same time), so B = min(intra_bandwidth ·
  intra_efficiency, k · inter_bandwidth · inter_efficiency), where inter_bandwidth is one
  device's share, nics_per_node · nic_bandwidth / devices_per_node;
- one rank per node, or ranks unevenly placed: every hop crosses the network, B = one share.

α is a hop's latency as NCCL's tuning model sums them along the ring's path (``hop_latency``):
of a ring all-gather's p − 1 hops over M nodes, M − 1 cross the network (inter_latency) and the
rest stay on NVLink (intra_latency). An all-to-all is a pairwise exchange, not a ring: over
nodes, each rank's bytes off its node go through its own NIC share (``all_to_all_seconds``).

What it leaves out: NCCL's tree all-reduce and its protocol switches (LL, LL128, Simple) by
size, except as far as the measured e(S) shows them; contention between different groups'
collectives running at once. ``reduce`` costs a broadcast, ``barrier`` a broadcast of nothing.

**Matrix products by roofline.** A stretch of compute is {(FLOPs, bytes): products}; each
product takes max(FLOPs / peak of the run's dtype, bytes / the achievable memory bandwidth:
``device_memory_bandwidth`` · ``memory_efficiency``), and the
stretch that sum over ``software_factor``, the one number no datasheet gives (the fraction of
the roofline one software stack reaches), fitted on one named published row. FlashAttention's
fused kernels come as ("attention", {(FLOPs, bytes): kernels}): where the file cites the
kernel's own efficiency (``attention_efficiency``, its authors' measured fraction of the peak)
they run at that rate, not over the software factor; else they are priced as products.

**A GPU's other work** (a file for CuPy's path with ``kernel_launch_s``): every other array
operation between two collective events is a kernel, ("elementwise", (calls, bytes)) priced at
``kernel_launch_s`` a call plus its bytes at the achievable memory bandwidth
(``kernel_seconds``).
The calls include each matrix product's own launch (no bytes: those are the roofline's).

**The step.** Two streams, as a GPU has: compute runs the trace's compute in order; every
collective goes on one communication stream, in issue order, starting when it is issued and the
stream is free. A blocking collective holds compute until it ends; a wait holds compute until
its collective ends. step = when both streams are done; exposed communication = step − compute.

**DeepSpeed's reduction stream.** Where the engine notes that a GPU would run a stretch of work
on DeepSpeed's reduction stream (each gradient bucket's reduction at stage 3 under DeepSpeed's
schedule with ``overlap_comm``: ("stream", "reduce") … ("stream", "compute"),
``Communicator.note_stream``), that stretch runs on a third stream, in order: it starts once
the compute issued before it is done (DeepSpeed's ``wait_stream``) and the stream is free; its
kernels take that stream's time, not compute's; its collectives go on the communication stream
from there, each holding the reduction stream until it ends, blocking or not (NCCL's kernel
runs on the stream it is issued on); a wait inside a stretch holds that stream. Before a new
stretch the host waits for the oldest one if more than two are in flight
(``max_param_reduce_events``), and ("stream", "sync") holds compute until the stream is done
(the backward epilogue's ``synchronize``). Stages 1 and 2 under DeepSpeed's schedule with
``overlap_comm`` note each IPG bucket's reduction ("stream", "reduce_in_turn") … ("stream",
"compute"): the same stretch, but before it the compute stream waits for the reduction stream
to be done (``stage_1_and_2.py``, ``average_tensor``: ``current_stream().wait_stream(stream)``),
so one bucket's reduction is in flight at a time. The reduction stream's unhidden time counts as
exposed. Live bytes keep the host's clock, compute's, inside a stretch too: the host allocates
as it issues.

**A host** (a cluster file written by ``zerosim calibrate``, ``HOST_KEYS``): the trace also has
("elementwise", (operations, bytes)) events, every array operation between two collective
events that is not a matrix product, priced at ``op_overhead_s`` a call plus the bytes at
``memory_bandwidth``; and with ``overlap`` false (MPICH has no progress thread) a non-blocking
collective moves only while it is waited: it starts at its wait, not at its issue. What the
engine spends besides array work (``dryrun/host.py``): ("python", calls), zerosim's own Python
calls, at ``call_overhead_s`` each, and ("faults", (pages, huge pages)), the first touch of fresh
buffers, at ``page_fault_s`` per 4 KiB page and ``hugepage_fault_s`` per 2 MiB one; on a
machine that takes freed memory back (``reclaim_after_s``: a virtual machine's free page
reporting), a 2 MiB page not served from the blocks given back (("unmapped", huge pages))
less than that before costs ``cold_hugepage_fault_s`` (``_FreshMemory``). With
``matmul_by_intensity`` each product runs at the rate measured for its FLOP per byte (small
products far below large ones) instead of the roofline. A gather or
reduce-scatter on a group of one rank is the copy of its S bytes into the output that MPI (and
a one-rank ``LocalComm``, as ``zerosim train`` runs at N = 1) makes: read and written once
each, one element-wise call of 2·S bytes priced by ``elementwise_by_size`` (2·S at
``memory_bandwidth`` in a file without it); an all-reduce, a reduce or a broadcast on one rank
moves nothing. Every collective on one rank also costs ``one_rank_collective_s``, the fixed
cost of such a call.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from zerosim.analysis.timing import collective_time
from zerosim.dryrun.cluster import (
    CLUSTER_KEYS,
    CLUSTERS,
    HOST_KEYS,
    ClusterModel,
    cluster_names,
    load_cluster_model,
)

__all__ = [
    "CLUSTERS",
    "CLUSTER_KEYS",
    "HOST_KEYS",
    "ClusterModel",
    "StepTime",
    "chrome_trace",
    "cluster_names",
    "group_seconds",
    "hop_latency",
    "host_breakdown",
    "host_product_seconds",
    "host_seconds",
    "kernel_seconds",
    "load_cluster_model",
    "simulate",
]


def group_seconds(model: ClusterModel, op: str, size_bytes: float, members: tuple[int, ...]):
    """Seconds for one collective of ``size_bytes`` (nccl-tests' S) on the ranks ``members``:
    c_α(p)·α + c_β(p)·S / (B · efficiency(S)), the ring's bus bandwidth B as the module
    docstring derives it and α the mean latency of a hop along the path (``hop_latency``);
    an all-to-all over nodes by ``all_to_all_seconds``; on one rank, MPI's own copy
    (``self_copy_seconds``: 0 on a cluster without a host's rates); on a host whose file
    measured this collective on as many ranks as the group has (``collectives_by_size``), the
    measured time at S."""
    p = len(members)
    if p <= 1:
        return self_copy_seconds(model, op, size_bytes)
    c = model.cluster
    size = 0.0 if op == "barrier" else size_bytes
    op = {"reduce": "broadcast", "barrier": "broadcast"}.get(op, op)
    nodes, k = placement(members, c.devices_per_node)
    if model.collectives_by_size and nodes == 1 and p == c.devices_per_node:
        measured = model.collective_call_seconds(op, size)
        if measured is not None:
            return measured
    intra = c.intra_bandwidth * model.intra_efficiency
    nic = c.inter_bandwidth * model.inter_efficiency  # one device's share of its node's NICs
    if nodes > 1 and k > 1 and op == "all_to_all":
        return all_to_all_seconds(model, size, p, k, intra, nic)
    alpha = hop_latency(model, op, p, nodes, k)
    if nodes == 1:
        bus = intra
    elif k > 1:  # one ring through every node: NVLink hops and node crossings run at once
        bus = min(intra, k * nic)
    else:  # one rank per node, or unevenly placed: every hop crosses the network
        bus = nic
    return collective_time(op, size, p, alpha, bus * model.size_efficiency(size))


def hop_latency(model: ClusterModel, op: str, p: int, nodes: int, k: int) -> float:
    """The mean latency of one of a collective's c_α(p) hops, as NCCL's tuning model sums them
    (src/graph/tuning.cc: ``latencies += (nsteps-nInterSteps)*intraLat + nInterSteps*interLat``,
    nInterSteps = nNodes − 1 of a ring all-gather's p − 1 steps): a chunk travels the ring's
    path, so only the node crossings pay the network's latency, the other hops NVLink's. A
    ring over ``nodes`` nodes: (p − nodes)·intra_latency + (nodes − 1)·inter_latency over p − 1
    hops (an all-reduce's 2(p − 1) the same ratio); an all-to-all's p − 1 peers: k − 1 on the
    node, p − k off it. A broadcast (zerosim's binomial tree) keeps the network's latency."""
    c = model.cluster
    if nodes == 1:
        return c.intra_latency
    if op == "broadcast":
        return c.inter_latency
    inter_hops = p - k if op == "all_to_all" and k > 0 else nodes - 1
    return ((p - 1 - inter_hops) * c.intra_latency + inter_hops * c.inter_latency) / (p - 1)


def all_to_all_seconds(
    model: ClusterModel, size: float, p: int, k: int, intra: float, nic: float
) -> float:
    """An all-to-all of S bytes over nodes of k ranks each (pairwise exchange, p − 1 steps):
    each rank sends S/p to every peer, (k − 1)·S/p over NVLink and (p − k)·S/p through its own
    share of the NICs, both at once, so the slower of the two binds; a ring's k-fold sharing of
    a node's NICs does not apply, as every byte off the node is the sender's own."""
    alpha = hop_latency(model, "all_to_all", p, p // k, k)
    efficiency = model.size_efficiency(size)
    beta = max((k - 1) * size / (p * intra), (p - k) * size / (p * nic)) / efficiency
    return (p - 1) * alpha + beta


def compute_seconds(model: ClusterModel, products: Any) -> float:
    """Seconds of one stretch of matrix products by roofline: each product takes the longer of
    its FLOPs at the dtype's peak and its bytes at the device's memory bandwidth, over the
    software factor. ``products``: {(FLOPs, bytes): count}, or FLOPs alone (priced at peak)."""
    peak = model.cluster.device_flops
    if not isinstance(products, dict):
        return products / (peak * model.software_factor)
    return _roofline_seconds(model, products, peak) / model.software_factor


def attention_seconds(model: ClusterModel, kernels: dict) -> float:
    """Seconds of a stretch of FlashAttention kernels ({(FLOPs, bytes): kernels}): where the
    cluster file cites the kernel's own efficiency (``attention_efficiency``, a fraction of the
    dtype's peak measured by the kernel's authors), each takes the longer of its FLOPs at that
    rate and its bytes at the memory bandwidth, not over the software factor, which is fitted
    for the products and would count the kernel's own shortfall twice; else it is priced as
    products (``compute_seconds``)."""
    if model.attention_efficiency is None:
        return compute_seconds(model, kernels)
    return _roofline_seconds(
        model, kernels, model.cluster.device_flops * model.attention_efficiency
    )


def _roofline_seconds(model: ClusterModel, products: dict, rate: float) -> float:
    """Σ count · max(FLOPs / ``rate``, bytes / the achievable memory bandwidth) over {(FLOPs,
    bytes): count}; without a memory bandwidth, the FLOPs alone."""
    bandwidth = model.achievable_memory_bandwidth
    return sum(
        count * max(flops / rate, nbytes / bandwidth if bandwidth else 0.0)
        for (flops, nbytes), count in products.items()
    )


def elementwise_seconds(
    model: ClusterModel, operations: int, nbytes: int, sizes: dict | None = None
) -> float:
    """Seconds of ``operations`` array calls moving ``nbytes``: on a GPU as kernels
    (``kernel_seconds``); on a host that measured calls by size (``elementwise_by_size``) each
    call at its own size and rate class (``sizes``: {(rate class, bytes' bit length):
    [calls, bytes]}, a bin's calls at their mean size); else each call's fixed cost plus the
    bytes at the memory bandwidth, where the cluster file gives them (``HOST_KEYS``)."""
    if model.prices_kernels:
        return kernel_seconds(model, operations, nbytes)
    if model.elementwise_by_size and sizes:
        return sum(
            calls * model.elementwise_call_seconds(rate, total / calls)
            for (rate, _), (calls, total) in sizes.items()
        )
    fixed = operations * (model.op_overhead_s or 0.0)
    return fixed + (nbytes / model.memory_bandwidth if model.memory_bandwidth else 0.0)


def kernel_seconds(model: ClusterModel, kernels: int, nbytes: int) -> float:
    """Seconds of ``kernels`` GPU kernel calls that read and write ``nbytes`` in all:
    kernels · ``kernel_launch_s`` + nbytes / (``device_memory_bandwidth`` ·
    ``memory_efficiency``). Element-wise work is memory-bound (a few FLOPs an element against an
    A100's 2 TB/s), so its bytes at the rate a streaming kernel reaches of the HBM's are its
    time; the fixed cost of a call is what a kernel of a few elements still takes. Both at the
    file's cited rates, not over the software factor, which is the matrix products' alone."""
    launches = kernels * model.kernel_launch_s
    return launches + nbytes / model.achievable_memory_bandwidth


def host_seconds(model: ClusterModel, kind: str, value: Any, cold: int = 0) -> float:
    """Seconds of a host's work besides array operations (module docstring): ("python", calls)
    or ("faults", (4 KiB pages, 2 MiB pages)), ``cold`` of the 2 MiB pages at
    ``cold_hugepage_fault_s``; 0 where the cluster file does not price it."""
    if kind == "python":
        return value * (model.call_overhead_s or 0.0)
    pages, huge = value
    warm_s = model.hugepage_fault_s or 0.0
    cold_s = model.cold_hugepage_fault_s or warm_s
    return pages * (model.page_fault_s or 0.0) + (huge - cold) * warm_s + cold * cold_s


# collectives that copy their input into a separate output on a group of one rank
SELF_COPIES = ("all_gather", "reduce_scatter")


def self_copy_seconds(model: ClusterModel, op: str, size_bytes: float) -> float:
    """A collective on one rank, on a host: its fixed cost (``one_rank_collective_s``, where
    measured), and the copy of the S bytes of a gather or a reduce-scatter from input to
    output, reading and writing each: one native element-wise call of 2·S bytes at its size
    (``elementwise_by_size``), else 2·S at the memory bandwidth. An in-place all-reduce,
    reduce or broadcast moves nothing."""
    fixed = model.one_rank_collective_s or 0.0
    if op not in SELF_COPIES:
        return fixed
    if model.elementwise_by_size:
        return fixed + model.elementwise_call_seconds("native", 2 * size_bytes)
    if model.memory_bandwidth:
        return fixed + 2 * size_bytes / model.memory_bandwidth
    return fixed


@lru_cache(maxsize=4096)
def placement(members: tuple[int, ...], devices_per_node: int) -> tuple[int, int]:
    """(nodes the ranks ``members`` span, ranks on each when every node holds as many, else 0).
    Cached: a step issues thousands of collectives on a few groups, and counting a group of
    1,024 ranks by node for each was most of a simulated step's time."""
    per_node = Counter(m // devices_per_node for m in members)
    counts = set(per_node.values())
    return len(per_node), counts.pop() if len(counts) == 1 else 0


@dataclass
class StepTime:
    """One simulated step: seconds, and the spans of each stream (for a Chrome trace)."""

    step_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    spans: list[tuple[str, str, float, float]] = field(default_factory=list)  # stream, name, …
    memory: list[tuple[float, int]] = field(default_factory=list)  # (time, live bytes)
    # (time, phase) where the phase of the issued collectives changes (forward, backward, step…)
    phases: list[tuple[float, str]] = field(default_factory=list)
    reduce_s: float = 0.0  # busy time of the kernels on DeepSpeed's reduction stream (stage 3)
    cold_huge_pages: int = 0  # fresh 2 MiB pages the machine had taken back (``_FreshMemory``)
    # (time, 2 MiB pages) this step gave back to the kernel, for the step after it
    unmapped: list[tuple[float, int]] = field(default_factory=list)

    def as_dict(self) -> dict[str, float]:
        return {
            "step_s": self.step_s,
            "compute_s": self.compute_s,
            "comm_s": self.comm_s,
            "exposed_comm_s": self.exposed_comm_s,
            "reduce_s": self.reduce_s,
        }


# the events the compute stream runs, one after another
COMPUTE_KINDS = ("compute", "attention", "elementwise", "python", "faults")


def simulate(
    events: list[tuple[str, Any]], calls: list[Any], model: ClusterModel, spans: bool = False
) -> StepTime:
    """Run one step's ``events`` (("compute", {(flops, bytes): products} or flops),
    ("attention", {(flops, bytes): kernels}), ("elementwise", (operations, bytes)),
    ("python", calls), ("faults", (pages, huge pages)), ("unmapped", huge pages), ("issue",
    i), ("wait", i), ("memory", live bytes), ("stream", "reduce" | "reduce_in_turn" | "compute"
    | "sync")) on ``model``; ``calls[i]`` is the collective of index i (``VirtualComm.calls``).

    On a host that takes freed memory back (``reclaim_after_s``), a step in a run of steps
    faults again the huge pages the step before it gave back: the step is run once with every
    huge page warm, then again with the pages the run before gave back one step earlier, until
    its length settles (``_FreshMemory``)."""
    step = _simulate(events, calls, model, spans, _FreshMemory(model, warm=True))
    if not (model.reclaim_after_s and step.unmapped):
        return step
    for _ in range(SETTLE_PASSES):
        before = [(t - step.step_s, pages) for t, pages in step.unmapped]
        last, step = step, _simulate(events, calls, model, spans, _FreshMemory(model, before))
        if abs(step.step_s - last.step_s) <= SETTLED * step.step_s:
            break
    return step


SETTLE_PASSES = 4  # at most: each pass takes the last one's step length
SETTLED = 0.01  # … and stops when the step changed by less than this


def _simulate(
    events: list[tuple[str, Any]],
    calls: list[Any],
    model: ClusterModel,
    spans: bool,
    fresh: _FreshMemory,
) -> StepTime:
    """``simulate``'s one run of the step, its fresh huge pages priced by ``fresh``."""
    now = compute = 0.0  # the compute stream's clock and busy time
    stream = _CommStream(spans)
    reduction = _ReductionStream()  # DeepSpeed's, where the engine notes it
    pending: dict[int, tuple[float, str]] = {}  # without overlap: issued, moved when waited
    memory: list[tuple[float, int]] = []
    phases: list[tuple[float, str]] = []
    for kind, value in events:
        if kind == "stream":  # a host runs everything on its one thread, in order
            now = reduction.note(value, now) if model.overlap else now
            continue
        # the stream this event runs on and its clock: the reduction stream inside its stretch
        lane, at = ("reduce", reduction.clock) if reduction.open else ("compute", now)
        if kind == "unmapped":
            fresh.give_back(value, at)
        elif kind in COMPUTE_KINDS:  # elementwise, python, faults: a host's rates, else free
            cold = fresh.cold(value[1], at) if kind == "faults" else 0
            dt = _compute_stream_seconds(model, kind, value, cold)
            if spans:
                stream.spans.append((lane, "matmul" if kind == "compute" else kind, at, at + dt))
            at += dt
            if reduction.open:
                reduction.busy += dt
            else:
                compute += dt
        elif kind == "issue":
            r = calls[value].record
            dt = group_seconds(model, r.op, r.size_bytes, calls[value].comm.members)
            label = f"{r.op} {r.phase} {r.group}"
            if spans and (not phases or phases[-1][1] != r.phase):
                phases.append((at, r.phase))
            if model.overlap or r.blocking:
                end = stream.run(value, dt, label, at)
                at = end if r.blocking or reduction.open else at
            else:  # no progress thread: it moves when it is waited
                pending[value] = (dt, label)
        elif kind == "wait":
            for i in sorted(i for i in pending if i <= value):  # MPI progresses these in order
                stream.run(i, *pending.pop(i), at)
            at = max(at, stream.ends[value])
        elif kind == "memory":
            memory.append((now, value))  # the host allocates as it issues: compute's clock
        reduction.clock, now = (at, now) if reduction.open else (reduction.clock, at)
    for i in sorted(pending):  # issued and never waited in this step: moved at its end
        stream.run(i, *pending.pop(i), now)
    step = max(now, stream.free, reduction.free)
    if memory:
        memory.append((step, memory[-1][1]))  # held until the step ends
    return StepTime(
        step, compute, stream.busy, step - compute, stream.spans, memory, phases,
        reduction.busy, fresh.cold_pages, fresh.unmapped,
    )  # fmt: skip


def host_product_seconds(model: ClusterModel, products: dict) -> float:
    """Seconds of a stretch of matrix products on a host whose file measured products by
    intensity (``matmul_by_intensity``): each at the rate measured for its FLOP per byte."""
    return sum(
        count * flops / model.matmul_rate(flops, nbytes)
        for (flops, nbytes), count in products.items()
    )


def host_breakdown(
    events: list[tuple[str, Any]], model: ClusterModel, cold: int = 0
) -> dict[str, Any]:
    """What a host's compute stream spends its step on, by kind: the seconds of the products,
    element-wise operations, zerosim's own Python calls and fresh pages (``cold`` of the huge
    pages taken back by the machine: ``StepTime.cold_huge_pages``), and their counts."""
    seconds = dict.fromkeys(COMPUTE_KINDS, 0.0)
    calls = pages = huge = 0
    for kind, value in events:
        if kind in seconds and kind != "faults":  # the faults: all at once, below
            seconds[kind] += _compute_stream_seconds(model, kind, value)
        if kind == "python":
            calls += value
        elif kind == "faults":
            pages, huge = pages + value[0], huge + value[1]
    return {
        "products_s": seconds["compute"] + seconds["attention"],
        "elementwise_s": seconds["elementwise"],
        "python_s": seconds["python"],
        "faults_s": host_seconds(model, "faults", (pages, huge), cold),
        "python_calls": calls,
        "fresh_pages": pages,
        "fresh_huge_pages": huge,
        "cold_huge_pages": cold,
    }


def _compute_stream_seconds(model: ClusterModel, kind: str, value: Any, cold: int = 0) -> float:
    """Seconds of one compute-stream event; ``cold``: of a ("faults", …) event's huge pages,
    those the machine had taken back (``_FreshMemory``)."""
    if kind in ("compute", "attention"):
        if model.matmul_by_intensity and isinstance(value, dict):  # a host: by intensity
            return host_product_seconds(model, value)
        return (compute_seconds if kind == "compute" else attention_seconds)(model, value)
    if kind == "elementwise":
        return elementwise_seconds(model, *value)
    return host_seconds(model, kind, value, cold)


class _FreshMemory:
    """Which fresh 2 MiB pages of a step the machine had taken back (``reclaim_after_s``).

    A virtual machine with free page reporting (``virtio_balloon``'s, Linux's
    ``mm/page_reporting.c``) hands free 2 MiB blocks back to its host a while after they were
    freed; the next fault on such a block pays the host's own faults too
    (``cold_hugepage_fault_s``). The kernel gives a huge page from the blocks freed last first.
    So a huge page a step faults is warm while a block given back (``give_back``: the
    ("unmapped", pages) events, this step's and, at its start, the step before's) less than
    ``reclaim_after_s`` ago is left, and cold after. ``warm``: every huge page warm (a machine
    that takes nothing back, or the first of ``simulate``'s runs)."""

    def __init__(self, model: ClusterModel, before: list | None = None, warm: bool = False):
        self.after = None if warm else model.reclaim_after_s
        self.free: list[list[float]] = [[t, pages] for t, pages in before or []]  # oldest first
        self.unmapped: list[tuple[float, int]] = []  # this step's, for the step after it
        self.cold_pages = 0

    def give_back(self, pages: int, now: float) -> None:
        self.free.append([now, pages])
        self.unmapped.append((now, pages))

    def cold(self, huge: int, now: float) -> int:
        """Of ``huge`` fresh 2 MiB pages faulted at ``now``, those that are cold; the warm ones
        take their blocks."""
        if self.after is None:
            return 0
        while huge and self.free and now - self.free[-1][0] < self.after:
            taken = min(huge, self.free[-1][1])
            huge -= taken
            self.free[-1][1] -= taken
            if not self.free[-1][1]:
                self.free.pop()
        self.cold_pages += huge
        return huge


class _CommStream:
    """The communication stream: collectives one after another, each from when it may start."""

    def __init__(self, spans: bool) -> None:
        self.free = 0.0  # when the stream is free
        self.busy = 0.0  # seconds it moved data
        self.ends: dict[int, float] = {}  # call index → when it ended
        self.keep = spans
        self.spans: list[tuple[str, str, float, float]] = []  # compute's spans are kept here too

    def run(self, index: int, seconds: float, label: str, now: float) -> float:
        """Run call ``index`` for ``seconds`` from max(now, free); return when it ends."""
        start = max(now, self.free)
        self.free = self.ends[index] = start + seconds
        self.busy += seconds
        if self.keep:
            self.spans.append(("comm", label, start, self.free))
        return self.free


class _ReductionStream:
    """DeepSpeed's reduction stream (stage 3's ``reduce_and_partition_stream``, stages 1 and 2's
    ``reduction_stream``): the stretches of a step noted ("stream", "reduce" or
    "reduce_in_turn") … ("stream", "compute"), run in order on it."""

    MAX_EVENTS = 2  # DeepSpeed's max_param_reduce_events: more in flight, and the host waits

    def __init__(self) -> None:
        self.open = False  # inside a stretch: its events run on this stream
        self.clock = 0.0  # this stream's clock, while a stretch is open
        self.free = 0.0  # when its last stretch ends
        self.busy = 0.0  # seconds of its kernels
        self.ends: deque[float] = deque()  # when each stretch still in flight ends, oldest first

    def note(self, name: str, now: float) -> float:
        """Apply the note ``name`` at compute's clock ``now``; return compute's clock after it
        (the host may wait)."""
        if name == "reduce":  # __reduce_and_partition_ipg_grads
            while self.ends and self.ends[0] <= now:  # the events already reached
                self.ends.popleft()
            if len(self.ends) > self.MAX_EVENTS:  # the host waits for the oldest
                now = max(now, self.ends.popleft())
            self.open, self.clock = True, max(now, self.free)  # wait_stream(compute)
        elif name == "reduce_in_turn":  # stages 1 and 2's average_tensor: compute waits for
            now = max(now, self.free)  # the stream (current_stream().wait_stream), then the
            self.ends.clear()  # stream for compute: one bucket in flight
            self.open, self.clock = True, now
        elif name == "compute":  # the stretch ends; its event is recorded
            self.open, self.free = False, self.clock
            self.ends.append(self.clock)
        elif name == "sync":  # the backward epilogue: the host waits for the stream
            now = max(now, self.free)
        else:
            raise ValueError(
                f"a stream note is 'reduce', 'reduce_in_turn', 'compute' or 'sync'; got {name!r}"
            )
        return now


def chrome_trace(step: StepTime, name: str = "rank 0") -> dict[str, Any]:
    """The simulated step as a Chrome/Perfetto trace (one track per stream, µs)."""
    tracks = {"compute": 1, "comm": 2}
    if any(stream == "reduce" for stream, *_ in step.spans):
        tracks["reduce"] = 3
    out = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": name}},
        *(
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": stream}}
            for stream, tid in tracks.items()
        ),
    ]
    for stream, label, start, stop in step.spans:
        out.append(
            {
                "ph": "X",
                "name": label,
                "pid": 1,
                "tid": tracks[stream],
                "ts": start * 1e6,
                "dur": (stop - start) * 1e6,
            }
        )
    return {"traceEvents": out, "displayTimeUnit": "ms"}
