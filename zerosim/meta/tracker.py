"""What a dry run counts while it runs: bytes allocated and freed, by category, and matmul FLOPs.

Every shape-only array (``zerosim/meta/array.py``) owns or views one ``Storage``; a storage is
one allocation. Creating it adds its bytes to the ``Tracker`` of this thread, and when the last
array viewing it is garbage collected (CPython frees it as soon as its last reference goes, as
NumPy frees a buffer) its bytes are subtracted again. So ``live`` follows what the same code
would hold on a real device, and ``peak`` is its high-water mark, in total and per category.

**Categories** say what an allocation is for. They are read from where it was made: the first
caller outside ``zerosim.meta`` and ``zerosim.backend``, looked up in ``SITE_RULES`` by module
and function (first match wins, cached per call site):

    parameters        the model's flat parameter buffers, stage 3's shards and persistent
                      copies, hpZ's secondary chunks, the layers' own parameter arrays
    gradients         flat gradient buffers and shards (``setup_gradients``), ``.grad`` arrays
    optimizer_states  the optimizer's state arrays (Adam's moments …) and fp32 master weights
    buckets           gradient bucket buffers (the pool of ``zerosim/zero/buckets.py``)
    gathered_params   stage 3's gathered parameters (and ZeRO++'s int8 gather buffers)
    activations       everything the layers allocate in forward and backward: the saved
                      activations and the layers' temporaries while they run
    temporaries       anything else (work buffers of the update rules, fp32 gradient copies
                      made at the step, the engine's casts)

**FLOPs**: every matrix product (``matmul``, ``@``) adds 2·m·k·n per product of an (m, k) and a
(k, n) matrix, over its batch dimensions, to ``matmul_flops``.

**Operations**: ``ops`` counts the array operations by kind (a ufunc's name such as ``multiply``,
``matmul``, a reduction's name, ``kernel`` for one call of a fused update rule, and the copies:
``astype``, ``copy``, a ``reshape`` or fancy index (``getitem``) that copies, ``setitem`` (a
write through an index), ``concatenate``, ``stack``, ``take``, ``add_at``; creating an array is
not one): the calls a backend makes, each with a fixed cost on top of its bytes; ``op_bytes`` the
bytes they read and wrote (operands and result; a matrix product's are priced by its FLOPs
instead and count none). How many ``setitem`` a step makes differs a little between ranks of one
class (the gradient pieces that land in a rank's shard), so a class's representative counts
its own, within a few per cent of each member's.

**The backend it stands for** (``Values.backend``): where zerosim's code branches on the array
type (``backend.is_host_array``: NumPy's cache-sized optimizer blocks and numba kernels, a few
layer shortcuts), a shape-only array takes the branch of the backend the dry run predicts,
``"numpy"`` (a CPU host) or ``"cupy"`` (a GPU), so its allocations and operations are that
backend's. ``"torch"`` stands for PyTorch's CUDA kernels, as the published runs of
``examples/published/`` ran: CuPy's branches, and each chain of a layer that is marked as one
kernel (``fusion.fused``: a GEMM's casts and bias, LayerNorm, GELU, the softmax cross-entropy)
counted as that one kernel, its inputs read and its outputs written once, instead of as the
chain's NumPy-style calls.

The rules of the dry run's data-dependent branches (``Values``) live here too: a shape-only
array has no values, so what the engine reads from one is a documented default.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer_states",
    "buckets",
    "gathered_params",
    "activations",
    "temporaries",
)

# (module prefix, function qualname prefix or "" for any, category): the first match decides.
SITE_RULES: tuple[tuple[str, str, str], ...] = (
    ("zerosim.nn.parameter", "accumulate_grad", "gradients"),
    ("zerosim.nn.state", "", "parameters"),  # Module.to: casting and moving parameters
    ("zerosim.nn.init", "", "parameters"),
    ("zerosim.nn", "", "activations"),
    ("zerosim.optim.functional.common", "_work_buffers", "temporaries"),
    ("zerosim.optim.functional.common", "make_scratch", "temporaries"),
    ("zerosim.optim.optimizer", "Optimizer._scratch_for", "temporaries"),  # the rules' work buffer
    ("zerosim.optim", "", "optimizer_states"),
    ("zerosim.zero.offload", "", "optimizer_states"),  # the master copy (new_master)
    ("zerosim.zero.buckets", "", "buckets"),
    ("zerosim.zero.ipg", "", "buckets"),
    ("zerosim.zero.stage3", "GatherEach.start_gather", "gathered_params"),
    ("zerosim.zero.stage3", "ShardGroup", "parameters"),
    ("zerosim.zero.stage3_deepspeed", "CoalescedFetcher.gather_chunks", "gathered_params"),
    ("zerosim.zero.stage3_zeropp", "ZeroPPFetcher.start_gather", "gathered_params"),
    ("zerosim.zero.stage3_zeropp", "SecondaryPartition", "parameters"),
    ("zerosim.zero.stage3_zeropp", "QuantizedGather", "gathered_params"),
    ("zerosim.zero.strategy", "FlatGroup", "parameters"),
    ("zerosim.zero.init", "", "parameters"),
)
_SKIPPED = ("zerosim.meta", "zerosim.backend")
_site_cache: dict[tuple[str, str], str] = {}


def category_of(module: str, qualname: str) -> str:
    """The category of an allocation made in ``module``'s function ``qualname``."""
    key = (module, qualname)
    found = _site_cache.get(key)
    if found is None:
        found = "temporaries"
        if qualname.endswith("setup_gradients") and module.startswith("zerosim.zero"):
            found = "gradients"
        else:
            for prefix, function, category in SITE_RULES:
                if module.startswith(prefix) and qualname.startswith(function):
                    found = category
                    break
        _site_cache[key] = found
    return found


def allocation_site(depth: int = 2) -> tuple[str, str]:
    """(module, function qualname) of the first caller outside zerosim.meta and zerosim.backend."""
    frame = sys._getframe(depth)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(_SKIPPED):
            return module, frame.f_code.co_qualname
        frame = frame.f_back
    return "", ""


class Tracker:
    """Live and peak bytes, in total and per category, and the matmul FLOPs of one dry run."""

    def __init__(self) -> None:
        self.live = dict.fromkeys(CATEGORIES, 0)
        self.peak = dict.fromkeys(CATEGORIES, 0)
        self.live_total = 0
        self.peak_total = 0
        self.allocations = 0
        self.matmul_flops = 0
        self.product_bytes = 0  # operand and result bytes of the product being notified
        self.storage = 0  # id() of the storage being allocated or freed, while notified
        self.ops: dict[str, int] = {}  # array operations by kind (module docstring)
        self.op_bytes = 0  # the bytes they read and wrote
        self.op_class = "native"  # the rate class of the operation being notified
        self.fused_depth = 0  # > 0 inside a chain counted as one kernel (``fusion.fused``)
        self.in_kernel = False  # inside a fused chain that is a kernel (not an epilogue)
        # called as listener(kind, amount, category) for "alloc", "free" and "matmul" events,
        # and listener("op", bytes, operation kind) for each array operation
        self.listeners: list[Callable[[str, int, str], None]] = []

    def allocate(self, nbytes: int, category: str, storage: int = 0) -> None:
        self.allocations += 1
        self.storage = storage
        live = self.live[category] + nbytes
        self.live[category] = live
        if live > self.peak[category]:
            self.peak[category] = live
        self.live_total += nbytes
        if self.live_total > self.peak_total:
            self.peak_total = self.live_total
        for listener in self.listeners:
            listener("alloc", nbytes, category)

    def free(self, nbytes: int, category: str, storage: int = 0) -> None:
        self.storage = storage
        self.live[category] -= nbytes
        self.live_total -= nbytes
        for listener in self.listeners:
            listener("free", nbytes, category)

    def matmul(self, flops: int, nbytes: int = 0, kernel: str = "") -> None:
        """Count one matrix product of ``flops`` that reads its operands and writes its result,
        ``nbytes`` together (what a roofline prices it by: ``dryrun/timeline.py``); ``kernel``
        names a fused kernel whose products these are ("attention": FlashAttention's), which
        a cluster may price at that kernel's own rate."""
        self.matmul_flops += flops
        self.product_bytes = nbytes
        for listener in self.listeners:
            listener("matmul", flops, kernel)

    def op(self, kind: str, nbytes: int = 0, rate: str = "native") -> None:
        """Count one array operation of ``kind`` that reads and writes ``nbytes``, of the rate
        class ``rate`` (``rate_class``). Inside a chain counted as one kernel
        (``fused_depth``) only a matrix product's launch counts: the chain's own kernel is
        counted when it ends (``kernel_op``)."""
        if self.fused_depth and kind != "matmul":
            return
        self.kernel_op(kind, nbytes, rate)

    def kernel_op(self, kind: str, nbytes: int, rate: str = "native") -> None:
        """Count one operation of ``kind``, inside a fused chain or not (``op``)."""
        self.ops[kind] = self.ops.get(kind, 0) + 1
        self.op_bytes += nbytes
        self.op_class = rate
        for listener in self.listeners:
            listener("op", nbytes, kind)

    def reset_peaks(self) -> None:
        """Peaks from now on: each starts at what is live now."""
        self.peak = dict(self.live)
        self.peak_total = self.live_total

    def snapshot(self) -> dict[str, object]:
        return {
            "live_bytes": self.live_total,
            "peak_bytes": self.peak_total,
            "live": dict(self.live),
            "peak": dict(self.peak),
            "allocations": self.allocations,
            "matmul_flops": self.matmul_flops,
            "ops": dict(self.ops),
            "op_bytes": self.op_bytes,
        }


# How fast a host runs an element-wise call depends on the dtypes it touches. NumPy's own
# dtypes run NumPy's loops ("native"); ml_dtypes' types (bfloat16, float8) are user-defined
# dtypes that NumPy runs element by element through ml_dtypes' functions: arithmetic in one
# ("bf16", six to ten times slower a byte than float32's), a cast into one from a NumPy dtype
# ("to_bf16") and reading one into a NumPy dtype, a cast up or an operand cast first
# ("from_bf16"). A copy within one dtype is NumPy's copy ("native").
RATE_CLASSES = ("native", "bf16", "to_bf16", "from_bf16")


def rate_class(sources: Iterable[Any], result: Any, copy: bool = False) -> str:
    """The rate class (``RATE_CLASSES``) of an operation reading the dtypes ``sources`` and
    writing ``result``'s dtype; ``copy``: it moves elements without arithmetic (a cast, a
    copy, a write through an index)."""
    emulated_in = any(_emulated(d) for d in sources)
    if _emulated(result):
        return "native" if copy and emulated_in else "to_bf16" if copy else "bf16"
    return "from_bf16" if emulated_in else "native"


def _emulated(dtype: Any) -> bool:
    """Whether ``dtype`` is a user-defined NumPy dtype (ml_dtypes' bfloat16 and float8)."""
    return getattr(dtype, "isbuiltin", 1) == 2


class Storage:
    """One allocation of ``nbytes``, counted in its tracker from creation until it is freed."""

    __slots__ = ("nbytes", "category", "tracker")

    def __init__(self, nbytes: int, category: str | None = None) -> None:
        self.nbytes = nbytes
        self.tracker = current()
        self.category = category or category_of(*allocation_site(3))
        self.tracker.allocate(nbytes, self.category, id(self))

    def __del__(self) -> None:
        tracker = getattr(self, "tracker", None)
        if tracker is not None:
            tracker.free(self.nbytes, self.category, id(self))


@dataclass
class Values:
    """What the engine reads from an array that holds no values (the data-dependent branches).

    ``overflow``: the answer of every inf/nan test (``isfinite``, ``isnan``, ``isinf``): False,
    the default, means every gradient is finite, so an fp16/bf16 overflow check never skips a
    step; True makes every step an overflow (skipped, the loss scale backs off).
    ``fill``: every other value read (``float(x)``, ``bool(x)``, a small array brought to the
    host): the loss, Σg² and so the gradient norm, token ids' bounds. 0.0, the default, gives
    a norm of 0, so gradient clipping never scales (its collective still runs); a value above
    (gradient_clipping)² makes every step clip. Counts (``count_nonzero``) are of every element.
    ``backend``: the array backend the run stands for, ``"numpy"``, ``"cupy"`` (the default) or
    ``"torch"`` (the module docstring): the branch a shape-only array takes where the code asks
    ``backend.is_host_array``, and with ``"torch"`` each fused chain counted as one kernel.
    """

    overflow: bool = False
    fill: float = 0.0
    read_limit: int = field(default=1 << 20)  # elements a host read may return
    backend: str = "cupy"

    def __post_init__(self) -> None:
        if self.backend not in PREDICTED_BACKENDS:
            raise ValueError(
                f"backend must be one of {list(PREDICTED_BACKENDS)}, got {self.backend!r}"
            )


# the backends a dry run can stand for
PREDICTED_BACKENDS = ("numpy", "cupy", "torch")

_local = threading.local()


def current() -> Tracker:
    """This thread's tracker (one is made on first use)."""
    tracker = getattr(_local, "tracker", None)
    if tracker is None:
        tracker = _local.tracker = Tracker()
    return tracker


def values() -> Values:
    """This thread's rules for data-dependent reads."""
    found = getattr(_local, "values", None)
    if found is None:
        found = _local.values = Values()
    return found


@contextmanager
def tracking(tracker: Tracker | None = None, **rules: object) -> Iterator[Tracker]:
    """Count the allocations made inside the block in ``tracker`` (a new one by default), with
    the ``Values`` rules given (``overflow=``, ``fill=``, ``backend=``); both are restored
    afterwards."""
    tracker = Tracker() if tracker is None else tracker
    before_tracker = getattr(_local, "tracker", None)
    before_values = getattr(_local, "values", None)
    _local.tracker = tracker
    _local.values = Values(**rules)  # type: ignore[arg-type]
    try:
        yield tracker
    finally:
        _local.tracker = before_tracker
        _local.values = before_values
