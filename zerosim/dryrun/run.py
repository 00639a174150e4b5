"""The dry run: zerosim's engine over a virtual world of N ranks on shape-only arrays.

For each rank it runs, the dry run builds the model without values (``backend.shape_only_init``),
calls ``zerosim.initialize`` with the config's ``zerosim.backend`` set to ``"meta"`` on that
rank's ``VirtualComm``, and trains ``steps`` optimizer steps of ``gradient_accumulation_steps``
micro-batches of zeros (token ids, or features and class ids), counting every allocation
and matrix product (``zerosim.meta.Tracker``) and recording every collective in its ledger.

**Classes of rank.** Ranks whose *program* is the same (the same calls in the same order, the same
allocations) need not all run: one representative per class runs, and each other member's
records are the representative's with its own sub-groups and bytes (``VirtualComm.as_rank``).
Which ranks may differ is read from rank 0's strategy (``fingerprint``): the first rank, the
last rank (its chunks carry the padding), and, where a stage sizes a buffer by the rank's piece
of a bucket (stage 2's reduce-scatter under the paper's schedule), those pieces. With
``all_ranks`` every rank runs; tests hold the two modes to each other and to real ``mpirun`` runs.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from zerosim import meta
from zerosim.backend import shape_only_init
from zerosim.comm.record import Record
from zerosim.comm.virtual import VirtualComm, VirtualWorld
from zerosim.config import load_config, read_config_file
from zerosim.config.values import as_mapping
from zerosim.dryrun.host import MallocModel, PythonCalls, numpy_hugepages
from zerosim.engine import Engine, initialize
from zerosim.nn import GPT, MLP, Module, Transformer, checkpoint, no_grad
from zerosim.nn.description import ModelDescription
from zerosim.nn.metrics import METRICS, step_metrics


@dataclass(frozen=True)
class ModelRecipe:
    """How to build a model without values and what one micro-batch of it looks like."""

    name: str
    build: Callable[[], Module]
    batch: Callable[[int], tuple[Any, Any]]  # micro-batch size → (x, y), shape-only
    gpt: Any = None  # the GPTShape, for GPT models
    desc: ModelDescription | None = None  # the transformer's description (a GPT's too)
    # the trainer's metrics (``zerosim.nn.metrics.METRICS`` names), updated from the logits
    # after every micro-batch's backward, as Composer's trainer updates its train metrics
    metrics: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = [name for name in self.metrics if name not in METRICS]
        if unknown:
            raise ValueError(
                f"ModelRecipe metrics {unknown} are not metrics; allowed: {sorted(METRICS)}"
            )


def recipe(spec: Any, name: str | None = None) -> ModelRecipe:
    """``gpt``/``mlp`` (``zerosim train``'s models), a GPT preset, ``gpt:L,H,V,S[,HEADS]``, a
    ``GPTShape`` (then ``name`` names it; a shape's ``tied`` is kept, as ``gpt:…`` cannot say),
    or a model description: a ``ModelDescription``, a ``zerosim.nn.PRESETS`` name (Llama, MPT,
    BLOOM; also ``-tiny``) or a JSON/hjson description file."""
    from zerosim.analysis.presets import PRESETS, GPTShape, gpt_shape

    xp = meta.NAMESPACE
    if isinstance(spec, ModelDescription):
        return _description_recipe(spec)
    if isinstance(spec, GPTShape):
        shape, spec = spec, name or repr(spec)
    elif spec == "mlp":  # report.workloads' MLP
        sizes = [32, 256, 256, 10]
        return ModelRecipe(
            spec,
            lambda: MLP(sizes),
            lambda b: (xp.zeros((b, sizes[0]), np.float32), xp.zeros((b,), np.int64)),
        )
    elif spec == "gpt":  # zerosim train's GPT at its defaults (--block-size 32 … --n-embd 64)
        from zerosim.data import CharDataset

        shape = GPTShape(2, 64, 4, CharDataset(block_size=32).vocab_size, 32, tied=False)
    elif spec in PRESETS or spec.startswith("gpt:"):
        shape = gpt_shape(spec)
    else:  # a model description: a zerosim.nn preset (or its -tiny) or a JSON/hjson file
        return _description_recipe(spec)

    def build() -> Module:
        s = shape
        return GPT(s.vocab, s.seq, s.layers, s.heads, s.hidden, tie_weights=s.tied)

    def batch(b: int) -> tuple[Any, Any]:
        ids = xp.zeros((b, shape.seq), np.int64)
        return ids, xp.zeros((b, shape.seq), np.int64)

    s = shape
    desc = GPT.description(s.vocab, s.seq, s.layers, s.heads, s.hidden, tie_weights=s.tied)
    return ModelRecipe(spec, build, batch, shape, desc)


def _description_recipe(spec: str | ModelDescription) -> ModelRecipe:
    """The recipe of ``Transformer(describe(spec))``; a name that is neither a description nor
    a GPT is refused with the GPT forms and the description presets both named."""
    from zerosim.analysis.presets import PRESETS as GPT_PRESETS
    from zerosim.nn import PRESETS as DESCRIPTIONS
    from zerosim.nn import describe

    given = isinstance(spec, ModelDescription)
    named = given or spec in DESCRIPTIONS or spec.removesuffix("-tiny") in DESCRIPTIONS
    if not (named or Path(spec).is_file()):
        raise ValueError(
            f"--model {spec!r} is not a model; allowed: {sorted(GPT_PRESETS)}, 'gpt', 'mlp', "
            f"gpt:LAYERS,HIDDEN,VOCAB,SEQ[,HEADS], a model preset ({', '.join(DESCRIPTIONS)}, "
            "each also as NAME-tiny) or a model-description file"
        )
    desc = describe(spec)
    xp = meta.NAMESPACE

    def batch(b: int) -> tuple[Any, Any]:
        return xp.zeros((b, desc.seq), np.int64), xp.zeros((b, desc.seq), np.int64)

    return ModelRecipe(desc.name, lambda: Transformer(desc), batch, desc=desc)


@dataclass
class RankRun:
    """What one virtual rank's run left: its communicator (and ledger), its memory, its counts."""

    rank: int
    comm: VirtualComm
    memory: dict[str, int]
    tracker: dict[str, Any]  # meta.Tracker.snapshot() after the run, peaks over the last step
    init_peak_bytes: int  # the peak while the model was built and the engine initialized
    step_flops: int  # matmul FLOPs of the last step
    last_step: int  # the ledger step of the last optimizer step's records
    fingerprint: list[tuple] = field(default_factory=list)  # rank 0 only: every rank's
    facts: dict[str, Any] = field(default_factory=dict)  # rank 0 only: engine_facts
    # the last step as the time model reads it (dryrun/timeline.py): ("compute", {(flops,
    # bytes): products}), ("attention", {(flops, bytes): kernels}),
    # ("issue", i), ("wait", i) and, when asked for, ("memory", live bytes)
    events: list[tuple[str, Any]] = field(default_factory=list)
    step_start_bytes: int = 0  # live bytes when the last step began (its peak rises from here)


def _prepare_config(config: dict | str | Path, micro_batch: int | None) -> dict:
    """The config as a dict on the shape-only backend: a file is read as ``zerosim train`` reads
    one (``read_config_file``: JSON or hjson, errors naming the file)."""
    raw = read_config_file(config) if isinstance(config, str | Path) else config
    cfg = dict(as_mapping(raw, "" if isinstance(config, dict) else str(config)))
    cfg["zerosim"] = {**cfg.get("zerosim", {}), "backend": "meta"}
    if micro_batch is not None:
        cfg["train_micro_batch_size_per_gpu"] = int(micro_batch)
        cfg.pop("train_batch_size", None)  # it would pin the old micro-batch
    return cfg


def fingerprint(engine: Engine, world_size: int) -> list[tuple]:
    """Every rank's class key: ranks with equal keys run the same program (module docstring)."""
    pieces = engine.strategy.bucket_pieces()
    return [(r == 0, r == world_size - 1, tuple(c[r] for c in pieces)) for r in range(world_size)]


def run_rank(
    world: VirtualWorld,
    rank: int,
    model: ModelRecipe,
    config: dict,
    *,
    steps: int = 2,
    recompute: bool = False,
    overflow: bool = False,
    fill: float = 0.0,
    memory_events: bool = False,
    backend: str = "cupy",
    op_events: bool = False,
) -> RankRun:
    """Build, initialize and train virtual rank ``rank`` for ``steps`` optimizer steps, writing
    the last one's events (with every change of the live bytes when ``memory_events``), on the
    code path of ``backend`` ("numpy", "cupy" or "torch", ``meta.Values.backend``), and with
    ``op_events`` the element-wise operations between collectives (a host's time model prices
    them)."""
    comm = world.comm(rank)
    with meta.tracking(overflow=overflow, fill=fill, backend=backend) as tracker:
        # a host's fresh pages: glibc's malloc replayed over every allocation of the run
        pages = FreshPages(MallocModel(numpy_hugepages()), tracker) if op_events else None
        if pages is not None:
            tracker.listeners.append(pages.listen)
        with shape_only_init():
            net = model.build()
        if recompute:
            recompute_blocks(net, model.name)
        metrics = [METRICS[name]() for name in model.metrics]
        net.keep_output = bool(metrics)
        engine, *_ = initialize(net, config, comm=comm)
        init_peak = tracker.peak_total
        x, y = model.batch(engine.config.train_micro_batch_size_per_gpu)
        for _ in range(steps - 1):
            _train_step(engine, x, y, metrics)
        tracker.reset_peaks()  # the last step is the one measured and written as events
        step_start = tracker.live_total
        flops_before = tracker.matmul_flops
        last_step = engine.global_steps
        events = _traced_step(engine, (x, y, metrics), tracker, pages, memory_events, op_events)
        result = RankRun(
            rank,
            comm,
            engine.memory_report(),
            tracker.snapshot(),
            init_peak,
            tracker.matmul_flops - flops_before,
            last_step,
            events=events,
            step_start_bytes=step_start,
        )
        if rank == 0:
            result.fingerprint = fingerprint(engine, world.size)
            result.facts = {**engine_facts(engine), "recompute": recompute}
        del engine, net
    return result


def _traced_step(
    engine: Engine, batch: tuple, tracker: meta.Tracker, pages: Any, memory: bool, ops: bool
) -> list[tuple[str, Any]]:
    """Run the last step of ``batch`` (x, y and the metrics), writing its events
    (``RankRun.events``); with ``ops`` (a host's time model) also its array operations,
    zerosim's own Python calls and its fresh pages."""
    tracker.ops.clear()  # the operations of the last step
    tracker.op_bytes = 0
    events: list[tuple[str, Any]] = []
    tracker.listeners.append(_event_writer(events, tracker, memory, ops))
    if pages is not None:
        pages.events = events
    comm = engine.comm
    comm.record_events(events)
    with PythonCalls(events) if ops else nullcontext():
        _train_step(engine, *batch)
    comm.record_events(None)
    tracker.listeners.clear()
    return events


class FreshPages:
    """A tracker listener replaying allocations through ``MallocModel``; while ``events`` is
    set, each allocation's faults go into the trace as ("faults", (4 KiB, 2 MiB)), and the
    huge pages an unmapping gives back to the kernel as ("unmapped", 2 MiB pages)."""

    def __init__(self, malloc: MallocModel, tracker: meta.Tracker) -> None:
        self.malloc = malloc
        self.tracker = tracker
        self.events: list | None = None

    def listen(self, kind: str, nbytes: int, category: str) -> None:
        if kind == "free":
            huge = self.malloc.free(nbytes, self.tracker.storage)
            if huge:
                self._write("unmapped", huge)
        elif kind == "alloc":
            small, huge = self.malloc.allocate(nbytes, self.tracker.storage)
            if small or huge:
                self._write("faults", (small, huge))

    def _write(self, kind: str, value: Any) -> None:
        """Add ``value`` to the trace, to the event before it when that is of the same kind."""
        if self.events is None:
            return
        if self.events and self.events[-1][0] == kind:
            before = self.events[-1][1]
            if kind == "faults":
                value = (before[0] + value[0], before[1] + value[1])
            else:
                value += before
            self.events[-1] = (kind, value)
        else:
            self.events.append((kind, value))


def recompute_blocks(net: Module, name: str) -> None:
    """Wrap every transformer block of ``net`` in activation checkpointing."""
    blocks = getattr(net, "blocks", None)
    if blocks is None:
        raise ValueError(f"recompute needs a model with transformer blocks, not {name}")
    for i, block in enumerate(blocks):
        blocks[i] = checkpoint(block)


def _train_step(engine: Engine, x: Any, y: Any, metrics: list) -> None:
    """One optimizer step: ``gradient_accumulation_steps`` micro-batches of (x, y), each
    ``metrics`` updated from the micro-batch's logits after its backward (Composer's order),
    reset before the first and computed over every rank after the step (``zerosim train
    --metrics`` runs the same). The model keeps those logits until its next forward has made
    new ones, as Composer's ``state.outputs`` holds them until ``state.outputs =
    model(batch)`` replaces them."""
    for metric in metrics:
        metric.reset()
    for _ in range(engine.config.gradient_accumulation_steps):
        loss = engine(x, y)
        engine.backward(loss)
        if metrics:
            with no_grad():
                for metric in metrics:
                    metric.update(engine.module.output, y)
        engine.step()
    step_metrics(metrics, engine.comm)


def compute_dtype(cfg: Any) -> str:
    """The dtype the layers compute in: the model's, or under schedule fsdp2 its ``param_dtype``
    (the shards stay float32 and are cast at the gather, so a bf16 policy multiplies in bf16)."""
    if cfg.zerosim.schedule == "fsdp2" and cfg.zerosim.fsdp2.param_dtype is not None:
        return cfg.zerosim.fsdp2.param_dtype
    return cfg.model_dtype


def engine_facts(engine: Engine) -> dict[str, Any]:
    """What the formulas need, read from an initialized engine (rank 0's)."""
    cfg, strategy, model = engine.config, engine.strategy, engine.module
    zero = cfg.zero_optimization
    params = sum(p.numel for p in model.parameters())
    largest = max(sum(p.numel for p in m._parameters.values() if p) for m in model.modules())
    report = strategy.memory_report()
    persistent = getattr(strategy, "persistent_padded_numel", lambda: 0)()
    return {
        "params": params,
        "padded_params": strategy.padded_numel,
        "persistent_padded_params": persistent,
        "largest_layer_params": largest,
        "stage": zero.stage,
        "schedule": cfg.zerosim.schedule,
        "model_dtype": compute_dtype(cfg),
        "param_bytes": np.dtype(strategy.dtype).itemsize,
        "comm_bytes": (strategy.comm_dtype or np.dtype(strategy.dtype)).itemsize,
        "master_bytes": None if strategy.master_dtype is None else strategy.master_dtype.itemsize,
        "num_states": sum(1 for k in report if k.startswith("optimizer_state.")),
        "micro_batch": cfg.train_micro_batch_size_per_gpu,
        "accumulation": cfg.gradient_accumulation_steps,
        "ranks_per_node": cfg.zerosim.ranks_per_node,
        "zero": zero,
        "description": getattr(model, "desc", None),  # a Transformer's (GPT's too), else None
    }


def _event_writer(events: list, tracker: meta.Tracker, memory: bool, ops: bool) -> Callable:
    """A tracker listener: each matrix product counted into the last compute event (a new one
    after a collective event) as {(FLOPs, bytes): products}, FlashAttention's into an
    ("attention", {(FLOPs, bytes): kernels}) event the same way, with ``ops`` every other array
    operation added into this stretch's ("elementwise", (operations, bytes)) event, and with
    ``memory`` the live bytes after every allocation and free."""

    def write(kind: str, amount: int, category: str) -> None:
        if kind == "matmul":  # products counted by (FLOPs, bytes): a roofline prices each
            stretch = "attention" if category == "attention" else "compute"
            if not events or events[-1][0] != stretch:
                events.append((stretch, {}))
            products = events[-1][1]
            key = (amount, tracker.product_bytes)
            products[key] = products.get(key, 0) + 1
        elif kind == "op":
            if ops:
                _add_elementwise(events, amount, tracker.op_class)
        elif memory:
            events.append(("memory", tracker.live_total))

    return write


def _add_elementwise(events: list, nbytes: int, rate: str) -> None:
    """One operation of ``nbytes`` and rate class ``rate`` into this stretch's elementwise
    event: ("elementwise", (operations, bytes, sizes)), ``sizes`` the same counts by rate class
    and size, {(rate class, bytes' bit length): [operations, bytes]}, what a host prices."""
    i = _stretch_elementwise(events)
    if i is None:
        events.append(("elementwise", (0, 0, {})))
        i = -1
    count, total, sizes = events[i][1]
    events[i] = ("elementwise", (count + 1, total + nbytes, sizes))
    tally = sizes.setdefault((rate, nbytes.bit_length()), [0, 0])
    tally[0] += 1
    tally[1] += nbytes


def _stretch_elementwise(events: list) -> int | None:
    """The index of the elementwise event of the stretch since the last collective event (the
    last event, or the one before a compute event), or None."""
    for i in (-1, -2):
        if len(events) < -i or events[i][0] not in ("compute", "attention", "elementwise"):
            return None
        if events[i][0] == "elementwise":
            return i
    return None


def classes_of(keys: list[tuple]) -> list[list[int]]:
    """Ranks grouped by equal keys, in order of their first rank."""
    groups: dict[tuple, list[int]] = {}
    for r, key in enumerate(keys):
        groups.setdefault(key, []).append(r)
    return list(groups.values())


def run_world(
    model: ModelRecipe,
    world_size: int,
    config: dict | str | Path,
    *,
    micro_batch: int | None = None,
    steps: int = 2,
    recompute: bool = False,
    all_ranks: bool = False,
    overflow: bool = False,
    fill: float = 0.0,
    memory_events: bool = False,
    progress: Callable[[str], None] | None = None,
    backend: str = "cupy",
    op_events: bool = False,
) -> tuple[list[tuple[list[int], RankRun]], float]:
    """Run the representatives (or every rank) on the code path of ``backend`` ("numpy",
    "cupy" or "torch"): [(member ranks, the run standing for them)] and the wall time in seconds."""
    say = progress or (lambda _: None)
    cfg = _prepare_config(config, micro_batch)
    load_config(cfg, world_size)  # a bad config fails here, before any rank runs
    world = VirtualWorld(world_size)
    start = time.perf_counter()
    options = dict(
        steps=steps, recompute=recompute, overflow=overflow, fill=fill,
        memory_events=memory_events, backend=backend, op_events=op_events,
    )  # fmt: skip
    say(f"rank 0 of {world_size}: building {model.name} and running {steps} step(s)")
    first = run_rank(world, 0, model, cfg, **options)
    if all_ranks:
        members = [[r] for r in range(world_size)]
    else:
        members = classes_of(first.fingerprint)
    say(
        f"{len(members)} {'ranks' if all_ranks else 'classes of rank'} to run"
        f" ({time.perf_counter() - start:.1f} s so far)"
    )
    runs = [(members[0], first)]
    for k, group in enumerate(members[1:], start=2):
        say(f"{'rank' if all_ranks else 'class'} {k}/{len(members)}: rank {group[0]}")
        runs.append((group, run_rank(world, group[0], model, cfg, **options)))
    return runs, time.perf_counter() - start


def records_of(run: RankRun, rank: int) -> list[Record]:
    """Rank ``rank``'s ledger records: the run's own, or rewritten for another member."""
    return list(run.comm.ledger.records) if rank == run.rank else run.comm.as_rank(rank)


def host_peak_rss_bytes() -> int:
    """This process's high-water mark of resident memory (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
