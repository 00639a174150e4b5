"""A cluster as the dry run's time model sees it, read from a file of cited physical rates.

**What a cluster file holds** (``clusters/*.json``, docs/dryrun.md). Numbers a person can look
up, each as ``{"value": …, "source": "address: quoted line"}``:

- the nodes and the devices on each (``nodes``, ``devices_per_node``);
- the intra-node link: ``intra_bandwidth`` (bytes/s each way per device, NVLink/NVSwitch) and
  ``intra_latency``;
- the inter-node network: ``nic_bandwidth`` (bytes/s of one NIC) and ``nics_per_node``, so that
  the ``devices_per_node`` devices of a node share ``nics_per_node`` NICs, and ``inter_latency``;
- the device: ``device_flops`` (16-bit tensor-core peak), ``device_flops_fp32``,
  ``device_memory_bytes`` and ``device_memory_bandwidth`` (the datasheet's bytes/s) with
  ``memory_efficiency``, the fraction of it a streaming kernel reaches (a measured STREAM-like
  rate over the datasheet's): their product is the roofline's bytes/s and the rate of
  element-wise work; and ``kernel_launch_s``, the fixed seconds of one kernel call: with it a
  GPU cluster prices every array operation that is not a matrix product (element-wise work, the
  optimizer step) as the kernels CuPy launches;
- the collective algorithm (``collective_algorithm``: NCCL's ``ring``) and what it reaches of
  the line rate: ``intra_efficiency`` and ``inter_efficiency`` at large messages, and
  ``bus_efficiency_by_size``, [[bytes, fraction], …] of that large-message bus bandwidth a
  collective of nccl-tests' size S reaches (interpolated in log S, held at the ends);
- at most one number no datasheet gives: ``software_factor``, the fraction of the roofline the
  matrix products of one software stack reach, fitted on ONE named published row.

A file with ``measurements`` (written by ``zerosim calibrate`` on this machine) may give plain
numbers, and ``inter_bandwidth`` per device instead of NICs, and a host's ``HOST_KEYS``. The two
factors of earlier files, ``compute_efficiency`` and ``network_efficiency``, are refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from zerosim.analysis.timing import CLUSTER_KEYS, Cluster
from zerosim.meta.tracker import PREDICTED_BACKENDS, RATE_CLASSES

# analysis.Cluster's keys as a file gives them: inter_bandwidth from the NICs or (a host) itself
NIC_KEYS = ("nic_bandwidth", "nics_per_node")  # inter_bandwidth = nics · nic_bandwidth / devices
MEMORY_KEY = "device_memory_bytes"
FP32_KEY = "device_flops_fp32"  # the fp32 peak, where device_flops is the 16-bit one
BACKEND_KEY = "backend"  # the code path a dry run follows: numpy | cupy | torch
GPU_BACKENDS = ("cupy", "torch")
# a host's rates (zerosim calibrate, docs/dryrun.md): bytes/s of element-wise work, seconds of
# one array call's fixed cost, and whether communication overlaps compute (MPICH: it does not);
# what a step spends besides array work: zerosim's own Python calls and fresh pages
HOST_KEYS = (
    "memory_bandwidth",
    "op_overhead_s",
    "overlap",
    "call_overhead_s",  # one of zerosim's own Python calls (dryrun/host.py)
    "page_fault_s",  # the first touch of a fresh 4 KiB page
    "hugepage_fault_s",  # the first touch of a fresh 2 MiB huge page
    "cold_hugepage_fault_s",  # … of one the machine had taken back (a VM's free page reporting)
    "reclaim_after_s",  # how long a freed 2 MiB block stays with the machine before that
    "matmul_by_intensity",  # [[FLOP per byte, FLOP/s], …]: a product's rate by its intensity
    "one_rank_collective_s",  # a collective on a group of one rank: its fixed cost
    "elementwise_by_size",  # {rate class: [[bytes, seconds], …]}: one call's time by its size
    "collectives_by_size",  # {op: [[S bytes, seconds], …]}: one collective on every rank
)
DICT_KEYS = ("elementwise_by_size", "collectives_by_size")  # rates whose value is a dict
MEASURED_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
HOST_SECONDS = (
    "op_overhead_s",
    "call_overhead_s",
    "page_fault_s",
    "hugepage_fault_s",
    "cold_hugepage_fault_s",
    "reclaim_after_s",
    "one_rank_collective_s",
)
KERNEL_KEY = "kernel_launch_s"  # a GPU's fixed seconds a kernel call: element-wise work priced
ATTENTION_KEY = "attention_efficiency"  # FlashAttention's own fraction of the peak, cited
RATE_KEYS = (
    "device_memory_bandwidth",
    "memory_efficiency",
    KERNEL_KEY,
    ATTENTION_KEY,
    "intra_efficiency",
    "inter_efficiency",
    "bus_efficiency_by_size",
    "collective_algorithm",
    "software_factor",
)
NOTE_KEYS = ("name", "comment", "calibration", "measurements")
RETIRED_KEYS = ("compute_efficiency", "network_efficiency")
ALGORITHMS = ("ring",)


@dataclass(frozen=True)
class ClusterModel:
    """A cluster's physical rates, the one software factor and, when known, each device's
    memory in bytes."""

    cluster: Cluster
    software_factor: float = 1.0  # fraction of the roofline the matrix products reach
    name: str = ""
    device_memory_bytes: float | None = None
    device_flops_fp32: float | None = None  # None: fp32 products at device_flops too
    device_memory_bandwidth: float | None = None  # None: products priced by FLOPs alone
    # of device_memory_bandwidth, a streaming kernel's; None: not given (all of it)
    memory_efficiency: float | None = None
    intra_efficiency: float = 1.0  # of the intra-node line rate, at large messages
    inter_efficiency: float = 1.0  # of the NICs' line rate, at large messages
    bus_efficiency_by_size: tuple[tuple[float, float], ...] = ()  # () : 1 at every size
    backend: str = "cupy"  # a host (zerosim calibrate): "numpy"; PyTorch's kernels: "torch"
    memory_bandwidth: float | None = None  # HOST_KEYS: None leaves element-wise work unpriced
    op_overhead_s: float | None = None
    overlap: bool = True
    kernel_launch_s: float | None = None  # a GPU's fixed cost of one kernel call
    attention_efficiency: float | None = None  # None: FlashAttention priced as products
    call_overhead_s: float | None = None  # HOST_KEYS: None leaves Python calls unpriced
    page_fault_s: float | None = None  # None leaves fresh pages unpriced
    hugepage_fault_s: float | None = None
    cold_hugepage_fault_s: float | None = None  # None: a huge page is never taken back
    reclaim_after_s: float | None = None
    one_rank_collective_s: float | None = None  # None: a one-rank collective costs its copy
    matmul_by_intensity: tuple[tuple[float, float], ...] = ()  # (): every product at the peak
    # ((rate class, ((bytes, seconds), …)), …): a call's measured time by its bytes
    elementwise_by_size: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] = ()
    # ((op, ((S bytes, seconds), …)), …): a collective's measured time on the file's ranks
    collectives_by_size: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] = ()

    @property
    def prices_elementwise(self) -> bool:
        """Whether element-wise operations cost time here: a calibrated host, or a GPU whose
        file gives a kernel call's cost and its memory bandwidth."""
        host = self.memory_bandwidth is not None or self.op_overhead_s is not None
        return host or self.prices_kernels

    @property
    def prices_kernels(self) -> bool:
        """Whether element-wise work is priced as a GPU's kernels (``kernel_launch_s`` a call,
        the bytes at ``device_memory_bandwidth``): a file for a GPU (CuPy's path or PyTorch's
        kernels) that gives both."""
        return (
            self.backend in GPU_BACKENDS
            and self.kernel_launch_s is not None
            and self.device_memory_bandwidth is not None
        )

    def __post_init__(self) -> None:
        for key in (
            "memory_bandwidth",
            *HOST_SECONDS,
            MEMORY_KEY,
            FP32_KEY,
            "device_memory_bandwidth",
            KERNEL_KEY,
        ):
            value = getattr(self, key)
            if value is not None and not _positive(value):
                raise ValueError(f"{key} must be a positive number, got {value!r}")
        if self.memory_efficiency is not None and self.device_memory_bandwidth is None:
            raise ValueError(
                f"memory_efficiency is a fraction of device_memory_bandwidth, which is not given "
                f"(memory_efficiency={self.memory_efficiency!r}): give both, or neither"
            )
        if self.backend not in PREDICTED_BACKENDS:
            raise ValueError(
                f"{BACKEND_KEY} must be one of {PREDICTED_BACKENDS}, got {self.backend!r}"
            )
        fractions = ("software_factor", "intra_efficiency", "inter_efficiency")
        for key in (*fractions, "memory_efficiency", ATTENTION_KEY):
            value = getattr(self, key)
            if key in ("memory_efficiency", ATTENTION_KEY) and value is None:
                continue
            if not (_positive(value) and value <= 1):
                raise ValueError(f"{key} must be in (0, 1], got {value!r}")
        points = self.matmul_by_intensity
        if [x for x, _ in points] != sorted({x for x, _ in points}) or not all(
            _positive(x) and _positive(rate) for x, rate in points
        ):
            raise ValueError(
                "matmul_by_intensity must be [[FLOP per byte, FLOP/s], …] with increasing "
                f"positive intensities and positive rates, got {points!r}"
            )
        _check_by_size("elementwise_by_size", self.elementwise_by_size, RATE_CLASSES, "native")
        _check_by_size("collectives_by_size", self.collectives_by_size, MEASURED_COLLECTIVES)
        sizes = [s for s, _ in self.bus_efficiency_by_size]
        if sizes != sorted(set(sizes)) or not all(
            _positive(s) and _positive(f) and f <= 1 for s, f in self.bus_efficiency_by_size
        ):
            raise ValueError(
                "bus_efficiency_by_size must be [[bytes, fraction], …] with increasing "
                f"positive sizes and fractions in (0, 1], got {self.bus_efficiency_by_size!r}"
            )

    @property
    def achievable_memory_bandwidth(self) -> float | None:
        """The device memory's bytes/s a kernel reaches: the datasheet's rate at
        ``memory_efficiency``; None where the file gives no rate."""
        if self.device_memory_bandwidth is None:
            return None
        fraction = 1.0 if self.memory_efficiency is None else self.memory_efficiency
        return self.device_memory_bandwidth * fraction

    def size_efficiency(self, size_bytes: float) -> float:
        """The fraction of the large-message bus bandwidth a collective of ``size_bytes`` reaches:
        ``bus_efficiency_by_size`` interpolated linearly in log size, held at its ends."""
        points = self.bus_efficiency_by_size
        if not points:
            return 1.0
        if size_bytes <= points[0][0]:
            return points[0][1]
        for (s0, f0), (s1, f1) in zip(points, points[1:], strict=False):
            if size_bytes <= s1:
                t = math.log(size_bytes / s0) / math.log(s1 / s0)
                return f0 + t * (f1 - f0)
        return points[-1][1]

    def matmul_rate(self, flops: float, nbytes: float) -> float:
        """A host's FLOP/s for a product of ``flops`` reading and writing ``nbytes``: the
        measured rate at its intensity (FLOP per byte), interpolated linearly in log intensity
        and held at the ends; the peak where the file has none."""
        points = self.matmul_by_intensity
        if not points or nbytes <= 0:
            return self.cluster.device_flops
        x = flops / nbytes
        if x <= points[0][0]:
            return points[0][1]
        for (x0, r0), (x1, r1) in zip(points, points[1:], strict=False):
            if x <= x1:
                return r0 + math.log(x / x0) / math.log(x1 / x0) * (r1 - r0)
        return points[-1][1]

    def elementwise_call_seconds(self, rate: str, nbytes: float) -> float:
        """A host's seconds of one element-wise call of rate class ``rate`` (``meta.rate_class``)
        moving ``nbytes``, from ``elementwise_by_size`` (``by_size``); a class not measured is
        priced as "native"."""
        table = dict(self.elementwise_by_size)
        return by_size(table.get(rate) or table["native"], nbytes)

    def collective_call_seconds(self, op: str, size_bytes: float) -> float | None:
        """A host's seconds of one collective ``op`` of S = ``size_bytes`` on all the ranks the
        file was measured on (``collectives_by_size``, by ``by_size``); None where not measured."""
        points = dict(self.collectives_by_size).get(op)
        return None if points is None else by_size(points, size_bytes)

    def for_dtype(self, model_dtype: str) -> ClusterModel:
        """The cluster as a run in ``model_dtype`` sees it: a float32 run's matrix products at the
        fp32 peak (``device_flops_fp32``, where the file gives it); 16-bit runs, whose products
        take 16-bit operands into tensor cores (zerosim upcasts them to accumulate in fp32, as
        those cores do), at ``device_flops``."""
        if model_dtype != "float32" or self.device_flops_fp32 is None:
            return self
        return replace(self, cluster=replace(self.cluster, device_flops=self.device_flops_fp32))

    def with_software_factor(self, factor: float) -> ClusterModel:
        return replace(self, software_factor=factor)

    def resized(self, world_size: int) -> ClusterModel:
        """The same nodes, as many as ``world_size`` ranks need."""
        nodes = -(-world_size // self.cluster.devices_per_node)
        return replace(self, cluster=replace(self.cluster, nodes=nodes))


def by_size(points: tuple[tuple[float, float], ...], nbytes: float) -> float:
    """The seconds of one call of ``nbytes`` from measured [[bytes, seconds], …]: linear in bytes
    between the two measured sizes around it (a fixed cost plus bytes at that range's rate), the
    smallest call's time below them, the largest one's rate beyond."""
    if nbytes <= points[0][0]:
        return points[0][1]
    for (b0, t0), (b1, t1) in zip(points, points[1:], strict=False):
        if nbytes <= b1:
            return t0 + (nbytes - b0) / (b1 - b0) * (t1 - t0)
    last_bytes, last_seconds = points[-1]
    return nbytes * last_seconds / last_bytes


def _check_by_size(key: str, table: tuple, names: tuple[str, ...], needed: str = "") -> None:
    """A ``*_by_size`` table: only ``names`` (``needed`` among them), each entry's sizes
    increasing and positive, its seconds positive."""
    found = [name for name, _ in table]
    if table and (not set(found) <= set(names) or (needed and needed not in found)):
        must = f"give {needed!r} and only" if needed else "give only"
        raise ValueError(f"{key} must {must} {list(names)}, got {found}")
    for name, points in table:
        sizes = [b for b, _ in points]
        if (
            not points
            or sizes != sorted(set(sizes))
            or not all(_positive(b) and _positive(t) for b, t in points)
        ):
            raise ValueError(
                f"{key}[{name!r}] must be [[bytes, seconds], …] with increasing "
                f"positive sizes and positive seconds, got {points!r}"
            )


def _positive(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and value > 0


# the cluster files shipped with zerosim, each number's source beside it (docs/dryrun.md)
CLUSTERS = Path(__file__).resolve().parent / "clusters"


def cluster_names() -> list[str]:
    """The names ``load_cluster_model`` takes for the shipped cluster files ("selene", …)."""
    return sorted(p.stem for p in CLUSTERS.glob("*.json"))


def load_cluster_model(path: str | Path) -> ClusterModel:
    """A ``ClusterModel`` from a cluster file (the module docstring says what it holds);
    unknown keys, retired keys and rates without a source are refused, naming the key.

    ``path``: a cluster JSON file, or the name of one shipped in ``zerosim/dryrun/clusters/``
    (``cluster_names()``: "selene", "zeropp_v100", …)."""
    if not Path(path).exists() and str(path) in cluster_names():
        path = CLUSTERS / f"{path}.json"
    if not Path(path).is_file():
        raise FileNotFoundError(
            f"cluster {str(path)!r}: no such file, and not one of the shipped clusters "
            f"{cluster_names()}"
        )
    spec = json.loads(Path(path).read_text())
    try:
        values = _values(spec)
        return _model(values, str(spec.get("name", "")))
    except (ValueError, TypeError) as err:
        raise ValueError(f"cluster file {path}: {err}") from None


def _values(spec: dict[str, Any]) -> dict[str, Any]:
    """Each rate's value, checked: known keys only, every rate with its source unless the file
    holds measurements of this machine (``zerosim calibrate``)."""
    retired = [k for k in RETIRED_KEYS if k in spec]
    if retired:
        raise ValueError(
            f"{retired} are no longer cluster keys: the rates are physical, each with its "
            "source, and the one fitted number is 'software_factor' (fitted on one named "
            "published row: benchmarks/dryrun_published.py)"
        )
    rates = [*CLUSTER_KEYS, *NIC_KEYS, MEMORY_KEY, FP32_KEY, *RATE_KEYS, *HOST_KEYS]
    unknown = sorted(set(spec) - {*rates, BACKEND_KEY, *NOTE_KEYS})
    if unknown:
        raise ValueError(
            f"unknown keys {unknown}; expected rates {rates}, {BACKEND_KEY!r} and notes "
            f"{list(NOTE_KEYS)}"
        )
    measured = "measurements" in spec
    values = {}
    for key in (k for k in rates if k in spec):
        entry = spec[key]
        if isinstance(entry, dict) and (key not in DICT_KEYS or "source" in entry):
            if not isinstance(entry.get("source"), str) or not entry["source"].strip():
                raise ValueError(f"{key!r} has no 'source' (where it was read, quoted)")
            if "value" not in entry:
                raise ValueError(f"{key!r} has a source but no 'value'")
            values[key] = entry["value"]
        elif measured:
            values[key] = entry
        else:
            raise ValueError(
                f"{key!r} is {entry!r} without a source: give it as "
                '{"value": ..., "source": "address: quoted line"}'
            )
    if BACKEND_KEY in spec:
        values[BACKEND_KEY] = spec[BACKEND_KEY]
    return values


def _model(values: dict[str, Any], name: str) -> ClusterModel:
    nics = [k for k in NIC_KEYS if k in values]
    if nics and "inter_bandwidth" in values:
        raise ValueError("give either 'inter_bandwidth' (per device) or the NICs, not both")
    if nics:
        if len(nics) < 2:
            raise ValueError(f"the NICs need both {list(NIC_KEYS)}, got only {nics}")
        per_device = values["nics_per_node"] * values["nic_bandwidth"]
        values["inter_bandwidth"] = per_device / values["devices_per_node"]
    missing = [k for k in CLUSTER_KEYS if k not in values]
    if missing:
        raise ValueError(f"missing keys {missing} (inter_bandwidth: or {list(NIC_KEYS)})")
    algorithm = values.get("collective_algorithm", "ring")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"collective_algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    return ClusterModel(
        Cluster(**{k: values[k] for k in CLUSTER_KEYS}),
        software_factor=values.get("software_factor", 1.0),
        name=name,
        device_memory_bytes=values.get(MEMORY_KEY),
        device_flops_fp32=values.get(FP32_KEY),
        device_memory_bandwidth=values.get("device_memory_bandwidth"),
        memory_efficiency=values.get("memory_efficiency"),
        intra_efficiency=values.get("intra_efficiency", 1.0),
        inter_efficiency=values.get("inter_efficiency", 1.0),
        bus_efficiency_by_size=tuple(tuple(p) for p in values.get("bus_efficiency_by_size", ())),
        backend=values.get(BACKEND_KEY, "cupy"),
        memory_bandwidth=values.get("memory_bandwidth"),
        overlap=bool(values.get("overlap", True)),
        kernel_launch_s=values.get(KERNEL_KEY),
        attention_efficiency=values.get(ATTENTION_KEY),
        **{key: values.get(key) for key in HOST_SECONDS},
        matmul_by_intensity=tuple(tuple(p) for p in values.get("matmul_by_intensity", ())),
        **{
            key: tuple(
                (name, tuple(tuple(p) for p in points))
                for name, points in values.get(key, {}).items()
            )
            for key in DICT_KEYS
        },
    )
