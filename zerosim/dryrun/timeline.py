"""The dry run's time model: one step of a rank's trace, simulated on a described cluster.

**The trace.** While a representative runs its last step, the dry run writes what the engine
issues, in the order it issues it: compute (the FLOPs of the matrix products between two
collective events), each collective as it is issued (``VirtualComm``'s ("issue", i)) and each
wait on a non-blocking one (("wait", i)): so stage 3's prefetches, ``overlap_comm``'s bucket
reductions and their order are the engine's own.

**The cluster.** ``ClusterModel``: ``analysis.Cluster`` (nodes × devices, intra/inter-node α and
bandwidth per device, device FLOP/s) plus two achieved-efficiency factors,
``compute_efficiency`` (the fraction of peak FLOP/s the matrix products reach) and
``network_efficiency`` (the fraction of link bandwidth a collective reaches), and optionally
``device_memory_bytes``, what one device holds (a rank whose peak exceeds it would not start:
the report says so), and ``device_flops_fp32``, the fp32 peak at which a float32 run's matrix
products are timed (``device_flops`` is the 16-bit tensor-core peak; a file without it times
both at that). Rank r sits on node r // devices_per_node. A collective on a group takes the α-β
time of ``analysis.timing`` for that group: one node's ring at intra-node α and bandwidth; over
several nodes with k ranks each, the two-level decomposition of ``Cluster.collective_time`` (k
intra-node rings and k inter-node rings of one rank per node); unevenly placed groups, a flat
ring at inter-node α and bandwidth. ``reduce`` costs a broadcast, ``barrier`` a broadcast of
nothing.

**The step.** Two streams, as a GPU has: compute runs the trace's compute in order; every
collective goes on one communication stream, in issue order, starting when it is issued and the
stream is free. A blocking collective holds compute until it ends; a wait holds compute until
its collective ends. step = when both streams are done; exposed communication = step − compute.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from zerosim.analysis.timing import Cluster, collective_time

CLUSTER_KEYS = (
    "nodes",
    "devices_per_node",
    "intra_bandwidth",
    "inter_bandwidth",
    "intra_latency",
    "inter_latency",
    "device_flops",
)
EFFICIENCY_KEYS = ("compute_efficiency", "network_efficiency")
MEMORY_KEY = "device_memory_bytes"
FP32_KEY = "device_flops_fp32"  # the fp32 peak, where device_flops is the 16-bit one
NOTE_KEYS = ("name", "comment", "calibration")


@dataclass(frozen=True)
class ClusterModel:
    """A cluster, the fractions of its peak compute and bandwidth a step achieves and, when
    known, each device's memory in bytes."""

    cluster: Cluster
    compute_efficiency: float = 1.0
    network_efficiency: float = 1.0
    name: str = ""
    device_memory_bytes: float | None = None
    device_flops_fp32: float | None = None  # None: fp32 products at device_flops too

    def __post_init__(self) -> None:
        for key in EFFICIENCY_KEYS:
            value = getattr(self, key)
            if not 0 < value <= 1:
                raise ValueError(f"{key} must be in (0, 1], got {value!r}")
        memory = self.device_memory_bytes
        if memory is not None and (
            isinstance(memory, bool) or not isinstance(memory, int | float) or not memory > 0
        ):
            raise ValueError(f"{MEMORY_KEY} must be a positive number of bytes, got {memory!r}")
        fp32 = self.device_flops_fp32
        if fp32 is not None and (
            isinstance(fp32, bool) or not isinstance(fp32, int | float) or not fp32 > 0
        ):
            raise ValueError(f"{FP32_KEY} must be a positive FLOP/s, got {fp32!r}")

    def for_dtype(self, model_dtype: str) -> ClusterModel:
        """The cluster as a run in ``model_dtype`` sees it: a float32 run's matrix products at the
        fp32 peak (``device_flops_fp32``, where the file gives it); 16-bit runs, whose products
        take 16-bit operands into tensor cores (zerosim upcasts them to accumulate in fp32, as
        those cores do), at ``device_flops``."""
        if model_dtype != "float32" or self.device_flops_fp32 is None:
            return self
        return replace(self, cluster=replace(self.cluster, device_flops=self.device_flops_fp32))

    def with_efficiencies(self, compute: float, network: float) -> ClusterModel:
        return replace(self, compute_efficiency=compute, network_efficiency=network)

    def resized(self, world_size: int) -> ClusterModel:
        """The same nodes, as many as ``world_size`` ranks need."""
        g = self.cluster.devices_per_node
        c = self.cluster
        nodes = -(-world_size // g)
        cluster = Cluster(
            nodes, g, c.intra_bandwidth, c.inter_bandwidth, c.intra_latency, c.inter_latency,
            c.device_flops,
        )  # fmt: skip
        return replace(self, cluster=cluster)


# the cluster files shipped with zerosim, each number's source in its "comment" (docs/dryrun.md)
CLUSTERS = Path(__file__).resolve().parent / "clusters"


def cluster_names() -> list[str]:
    """The names ``load_cluster_model`` takes for the shipped cluster files ("selene", …)."""
    return sorted(p.stem for p in CLUSTERS.glob("*.json"))


def load_cluster_model(path: str | Path) -> ClusterModel:
    """A ``ClusterModel`` from JSON: ``Cluster``'s seven keys, optionally the two efficiencies
    (default 1), ``device_memory_bytes`` and ``name``/``comment``/``calibration`` notes; other
    keys are refused.

    ``path``: a cluster JSON file, or the name of one shipped in ``zerosim/dryrun/clusters/``
    (``cluster_names()``: "selene", "zeropp_v100")."""
    if not Path(path).exists() and str(path) in cluster_names():
        path = CLUSTERS / f"{path}.json"
    if not Path(path).is_file():
        raise FileNotFoundError(
            f"cluster {str(path)!r}: no such file, and not one of the shipped clusters "
            f"{cluster_names()}"
        )
    spec = json.loads(Path(path).read_text())
    optional = [*EFFICIENCY_KEYS, MEMORY_KEY, FP32_KEY]
    unknown = sorted(set(spec) - {*CLUSTER_KEYS, *optional, *NOTE_KEYS})
    missing = [k for k in CLUSTER_KEYS if k not in spec]
    if unknown or missing:
        raise ValueError(
            f"cluster file {path}: unknown keys {unknown}, missing keys {missing}; expected "
            f"{list(CLUSTER_KEYS)}, optionally {optional} and {list(NOTE_KEYS)}"
        )
    cluster = Cluster(**{k: spec[k] for k in CLUSTER_KEYS})
    extra = {k: float(spec[k]) for k in EFFICIENCY_KEYS if k in spec}
    try:
        return ClusterModel(
            cluster,
            **extra,
            name=str(spec.get("name", "")),
            device_memory_bytes=spec.get(MEMORY_KEY),
            device_flops_fp32=spec.get(FP32_KEY),
        )
    except ValueError as err:
        raise ValueError(f"cluster file {path}: {err}") from None


def group_seconds(model: ClusterModel, op: str, size_bytes: float, members: tuple[int, ...]):
    """Seconds for one collective of ``size_bytes`` (nccl-tests' S) on the ranks ``members``."""
    p = len(members)
    if p <= 1:
        return 0.0
    c, eff = model.cluster, model.network_efficiency
    op = {"reduce": "broadcast", "barrier": "broadcast"}.get(op, op)
    size = 0.0 if op == "barrier" else size_bytes
    nodes, k = placement(members, c.devices_per_node)
    if nodes == 1:
        return collective_time(op, size, p, c.intra_latency, c.intra_bandwidth * eff)
    if k:
        group = Cluster(
            nodes, k, c.intra_bandwidth * eff, c.inter_bandwidth * eff, c.intra_latency,
            c.inter_latency, c.device_flops,
        )  # fmt: skip
        return group.collective_time(op, size)
    return collective_time(op, size, p, c.inter_latency, c.inter_bandwidth * eff)


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

    def as_dict(self) -> dict[str, float]:
        return {
            "step_s": self.step_s,
            "compute_s": self.compute_s,
            "comm_s": self.comm_s,
            "exposed_comm_s": self.exposed_comm_s,
        }


def simulate(
    events: list[tuple[str, Any]], calls: list[Any], model: ClusterModel, spans: bool = False
) -> StepTime:
    """Run one step's ``events`` (("compute", flops), ("issue", i), ("wait", i), ("memory",
    live bytes)) on ``model``; ``calls[i]`` is the collective of index i (``VirtualComm.calls``)."""
    rate = model.cluster.device_flops * model.compute_efficiency
    now = free = compute = comm = 0.0  # compute stream, comm stream free at, busy totals
    ends: dict[int, float] = {}
    out_spans: list[tuple[str, str, float, float]] = []
    memory: list[tuple[float, int]] = []
    phases: list[tuple[float, str]] = []
    for kind, value in events:
        if kind == "compute":
            dt = value / rate
            if spans:
                out_spans.append(("compute", "matmul", now, now + dt))
            now += dt
            compute += dt
        elif kind == "issue":
            call = calls[value]
            r = call.record
            dt = group_seconds(model, r.op, r.size_bytes, call.comm.members)
            start = max(now, free)
            free = ends[value] = start + dt
            comm += dt
            if spans:
                out_spans.append(("comm", f"{r.op} {r.phase} {r.group}", start, free))
                if not phases or phases[-1][1] != r.phase:
                    phases.append((now, r.phase))
            if r.blocking:
                now = free
        elif kind == "wait":
            now = max(now, ends[value])
        elif kind == "memory":
            memory.append((now, value))
    step = max(now, free)
    if memory:
        memory.append((step, memory[-1][1]))  # held until the step ends
    return StepTime(step, compute, comm, step - compute, out_spans, memory, phases)


def chrome_trace(step: StepTime, name: str = "rank 0") -> dict[str, Any]:
    """The simulated step as a Chrome/Perfetto trace (one track per stream, µs)."""
    tracks = {"compute": 1, "comm": 2}
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
