"""DeepSpeed's keys for what zerosim does not build: each one declared, none ignored in silence.

DeepSpeed 0.19.8 reads keys for much more than ZeRO: monitors and profilers, other kinds of
parallelism, data pipelines, a graph compiler, I/O tuning. tests/helpers/deepspeed_keys.py finds
every key DeepSpeed's config readers and pydantic models read, in DeepSpeed's code, and
tests/test_deepspeed_config.py fails on one zerosim does not declare. This module declares the
ones whose feature zerosim does not build, with the reason, in three kinds:

- **refused** (``refuse=True``): a value that would change what DeepSpeed computes (another
  parallelism, per-op autocast, curriculum data, client-managed accumulation) is a ConfigError
  naming the key;
- **warned about** (``inert``): a value whose DeepSpeed behaviour zerosim does not have, but
  that only observes or tunes the run (a monitor, a profiler, I/O or checkpoint-writer
  tuning), gives one UserWarning naming the key and the reason;
- **no effect, as in DeepSpeed**: keys DeepSpeed reads without acting on them in any run
  zerosim can make (they belong to features zerosim refuses, or DeepSpeed never uses them);
  their docs say so.

A feature section is read as DeepSpeed reads it: the pydantic ones (monitors, comms logger,
compile, hybrid engine) key by key, strictly, unknown keys refused (``CLOSED``); the ones read
with ``dict.get`` key by key with zerosim's strict parsers. Sections with many keys that only
matter once the feature is on (``autotuning``, ``data_efficiency``, ``expert_parallel``,
``pipeline``, ``tensor_parallel``, ...) are read as a whole (``whole_section``): zerosim checks
that they are JSON objects, looks at the switches that turn the feature on, and no further.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from zerosim.backend import PRECISION_DTYPES
from zerosim.config.values import (
    Parser,
    Section,
    any_value,
    choice,
    flag,
    integer,
    knob,
    lax_boolean,
    lax_integer,
    number,
    optional,
    section,
    text,
    whole_section,
)
from zerosim.errors import ConfigError

NOT_NULL = "DeepSpeed's model requires a value for this field"
# DeepSpeed's DtypeEnum: the names its data_types and torch_autocast keys take (exactly).
DTYPE_NAMES = {
    "float16": ("torch.float16", "fp16", "float16", "half"),
    "float32": ("torch.float32", "fp32", "float32", "float"),
    "int8": ("torch.int8", "int8"),
    "bfloat16": ("torch.bfloat16", "bf16", "bfloat16"),
}
_DTYPE = choice(*(name for names in DTYPE_NAMES.values() for name in names), any_case=False)


def dtype_of(name: str) -> str:
    """The dtype a DtypeEnum name stands for ('bf16' → 'bfloat16')."""
    return next(dtype for dtype, names in DTYPE_NAMES.items() if name in names)


def _string() -> Parser:
    """A string (empty allowed), as a pydantic ``str`` field takes it."""

    def convert(value: Any, path: str) -> str:
        if not isinstance(value, str):
            raise ConfigError(path, value, "a string")
        return value

    return Parser("a string", convert)


def _strings(item: Parser | None = None) -> Parser:
    """A list of strings (each one ``item`` allows), kept as a tuple."""
    allowed = "a list of strings" + (f", each {item.allowed}" if item else "")

    def convert(value: Any, path: str) -> tuple[str, ...]:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(path, value, allowed)
        if item is not None:
            for index, name in enumerate(value):
                item(name, f"{path}[{index}]")
        return tuple(value)

    return Parser(allowed, convert)


def _auto_or_strings() -> Parser:
    """'auto' or a list of strings (DeepSpeed's data_types.keep_in_fp32_modules)."""
    names = _strings()
    allowed = f"'auto' or {names.allowed}"

    def convert(value: Any, path: str) -> Any:
        if value == "auto":
            return value
        if not isinstance(value, list):
            raise ConfigError(path, value, allowed)
        return names(value, path)

    return Parser(allowed, convert)


# The keys of a section that DeepSpeed reads only once the section's switch is on: zerosim
# checks them and has DeepSpeed's behaviour for every value while the switch is off (and warns
# about, or refuses, the switch itself).
_ONCE_ON = "read by DeepSpeed only once the section's feature is on"


def _later(default: Any, parser: Parser, doc: str, **extra: Any) -> Any:
    """A key read only once its section's feature is on (see ``_ONCE_ON``)."""
    extra.setdefault("inert", _ONCE_ON)
    extra.setdefault("reproduces", any_value)
    return knob(default, parser, doc, **extra)


def _pflag(default: bool, doc: str, **extra: Any) -> Any:
    """A boolean of a DeepSpeed pydantic section (lax, not null)."""
    return _later(default, lax_boolean(), doc, null=NOT_NULL, **extra)


def _pint(default: int, doc: str, minimum: int | None = None) -> Any:
    """An integer of a DeepSpeed pydantic section (lax, not null)."""
    return _later(default, lax_integer(minimum), doc, null=NOT_NULL)


def _pstr(default: str | None, doc: str) -> Any:
    """A string of a DeepSpeed pydantic section; null only where the field is Optional."""
    if default is None:
        return _later(None, optional(_string()), doc)
    return _later(default, _string(), doc, null=NOT_NULL)


def _switch(why: str, refuse: bool = False) -> Any:
    """The ``enabled`` key of a dict.get section: warned about (or refused) when on."""
    return knob(
        False, flag(), "turns the feature on", inert=why, reproduces=(False,), refuse=refuse
    )


def _tuning(default: Any, parser: Parser, doc: str, why: str) -> Any:
    """A dict.get key that tunes something zerosim does not have: warned about off its default."""
    return knob(default, parser, doc, inert=why, reproduces=(default,))


# --- switches of whole sections ----------------------------------------------------------------


def _get(mapping: Any, *path: str) -> Any:
    """``mapping[path[0]][path[1]]...``, or None where a part is missing."""
    for key in path:
        mapping = mapping.get(key) if isinstance(mapping, Mapping) else None
    return mapping


def _truthy(mapping: Any, *path: str) -> bool:
    """The value at ``path`` is truthy, as DeepSpeed tests its switches."""
    return bool(_get(mapping, *path))


def _any_enabled(value: Any) -> bool:
    """Some ``enabled`` key, at any depth, is truthy (data_efficiency's several switches)."""
    if not isinstance(value, Mapping):
        return False
    return bool(value.get("enabled")) or any(_any_enabled(v) for v in value.values())


def _tensor_parallel_on(value: Any) -> bool:
    """``autotp_size``, or ``tp_size`` in ``tp`` (its alias ``tensor_parallel``), above 1."""
    sizes = [_get(value, "autotp_size")]
    sizes += [_get(value, name, "tp_size") for name in ("tp", "tensor_parallel")]
    for size in sizes:
        try:
            if size is not None and float(size) > 1:  # pydantic reads "2" and 2.0 as 2
                return True
        except (TypeError, ValueError):
            return True  # not a size DeepSpeed would take: not one zerosim may ignore
    return False


# --- sections read key by key -------------------------------------------------------------------

_MONITOR = "zerosim writes no {}: engine.wall_clock and the ledger (comm.ledger) hold its numbers"


@dataclass(frozen=True)
class TensorBoardConfig(Section):
    """``tensorboard``: DeepSpeed's TensorBoard writer."""

    CLOSED: ClassVar[bool] = True
    enabled: bool = _pflag(
        False,
        "write TensorBoard events",
        inert=_MONITOR.format("TensorBoard events"),
        reproduces=(False,),
    )
    output_path: str = _pstr("", "folder of the event files (read once enabled)")
    job_name: str = _pstr("DeepSpeedJobName", "run name (read once enabled)")


@dataclass(frozen=True)
class CSVMonitorConfig(Section):
    """``csv_monitor``: DeepSpeed's CSV writer."""

    CLOSED: ClassVar[bool] = True
    enabled: bool = _pflag(
        False, "write CSV files", inert=_MONITOR.format("CSV monitor files"), reproduces=(False,)
    )
    output_path: str = _pstr("", "folder of the CSV files (read once enabled)")
    job_name: str = _pstr("DeepSpeedJobName", "run name (read once enabled)")


@dataclass(frozen=True)
class WandbConfig(Section):
    """``wandb``: DeepSpeed's Weights & Biases logger."""

    CLOSED: ClassVar[bool] = True
    enabled: bool = _pflag(
        False, "log to W&B", inert=_MONITOR.format("W&B logs"), reproduces=(False,)
    )
    group: str | None = _pstr(None, "W&B group (read once enabled)")
    team: str | None = _pstr(None, "W&B team (read once enabled)")
    project: str = _pstr("deepspeed", "W&B project (read once enabled)")


@dataclass(frozen=True)
class CometConfig(Section):
    """``comet``: DeepSpeed's Comet logger."""

    CLOSED: ClassVar[bool] = True
    enabled: bool = _pflag(
        False, "log to Comet", inert=_MONITOR.format("Comet logs"), reproduces=(False,)
    )
    samples_log_interval: int = _pint(100, "samples between logs (read once enabled)")
    project: str | None = _pstr(None, "read once enabled")
    workspace: str | None = _pstr(None, "read once enabled")
    api_key: str | None = _pstr(None, "read once enabled")
    experiment_name: str | None = _pstr(None, "read once enabled")
    experiment_key: str | None = _pstr(None, "read once enabled")
    online: bool | None = _later(None, optional(lax_boolean()), "read once enabled")
    mode: str | None = _pstr(None, "read once enabled")


@dataclass(frozen=True)
class CommsLoggerConfig(Section):
    """``comms_logger``: DeepSpeed's log of its collectives."""

    CLOSED: ClassVar[bool] = True
    enabled: bool = _pflag(
        False,
        "log every collective",
        inert="zerosim's ledger (comm.ledger) records every collective, always",
        reproduces=(False,),
    )
    prof_all: bool = _pflag(True, "log every op (read once enabled)")
    prof_ops: tuple[str, ...] = _later(
        (), _strings(), "ops to log (read once enabled)", null=NOT_NULL
    )
    verbose: bool = _pflag(False, "print each op (read once enabled)")
    debug: bool = _pflag(False, "name the caller (read once enabled)")


_COMPILE = "read by DeepCompile (deepcompile: true), not built"


@dataclass(frozen=True)
class CompileConfig(Section):
    """``compile``: DeepCompile, which compiles the engine's graph at ``engine.compile()``."""

    CLOSED: ClassVar[bool] = True
    deepcompile: bool = _pflag(
        False,
        "turns DeepCompile on",
        inert="DeepCompile acts on an engine compiled with engine.compile(), which zerosim's "
        "engine does not have",
        reproduces=(False,),
    )
    autoep_non_moe: bool = _pflag(False, _COMPILE)
    free_activation: bool = _pflag(False, _COMPILE)
    free_activation_threshold: int = _pint(10 * 1024 * 1024, _COMPILE)
    offload_activation: bool = _pflag(False, _COMPILE)
    offload_activation_pin_memory: bool = _pflag(True, _COMPILE)
    offload_opt_states: bool = _pflag(False, _COMPILE)
    double_buffer: bool = _pflag(True, _COMPILE)
    symmetric_memory: bool = _pflag(False, _COMPILE)
    debug_log: bool = _pflag(False, _COMPILE)
    offload_parameters: bool = _pflag(False, _COMPILE)
    sync_before_reduce: bool = _pflag(False, _COMPILE)
    sync_after_reduce: bool = _pflag(False, _COMPILE)
    sync_before_allgather: bool = _pflag(False, _COMPILE)
    sync_after_allgather: bool = _pflag(False, _COMPILE)
    keep_int_input_tensors: bool = _pflag(True, _COMPILE)
    keep_all_input_tensors: bool = _pflag(False, _COMPILE)
    passes: tuple[str, ...] | None = _later(
        None, optional(_strings(choice("z1", "z3", "autosp", "autotp", any_case=False))), _COMPILE
    )


@dataclass(frozen=True)
class HybridEngineConfig(Section):
    """``hybrid_engine``: DeepSpeed's engine that also generates (RLHF), switching layouts."""

    CLOSED: ClassVar[bool] = True
    enabled: bool = _pflag(
        False,
        "turns the hybrid engine on",
        inert="zerosim's engine trains and has no generate(); training is the same",
        reproduces=(False,),
    )
    max_out_tokens: int = _pint(512, "read once enabled", minimum=1)
    inference_tp_size: int = _pint(1, "read once enabled")
    release_inference_cache: bool = _pflag(False, "read once enabled")
    pin_parameters: bool = _pflag(True, "read once enabled")
    tp_gather_partition_size: int = _pint(8, "read once enabled")
    enable_cuda_graph: bool = _pflag(False, "read once enabled")


_CHECKPOINTING = (
    "configures deepspeed.checkpointing.checkpoint, which zerosim's models do not call "
    "(zerosim.nn.checkpoint recomputes a module from its input, kept on the rank whole)"
)


@dataclass(frozen=True)
class ActivationCheckpointingConfig(Section):
    """``activation_checkpointing``: settings of DeepSpeed's checkpointing API."""

    partition_activations: bool = _tuning(
        False, flag(), "split kept inputs over ranks", _CHECKPOINTING
    )
    contiguous_memory_optimization: bool = _tuning(False, flag(), "one buffer", _CHECKPOINTING)
    cpu_checkpointing: bool = _tuning(False, flag(), "keep inputs on the host", _CHECKPOINTING)
    number_checkpoints: int | None = _tuning(
        None, optional(integer(0)), "checkpoints per forward", _CHECKPOINTING
    )
    synchronize_checkpoint_boundary: bool = _tuning(False, flag(), "synchronise", _CHECKPOINTING)
    profile: bool = _tuning(False, flag(), "time the recomputation", _CHECKPOINTING)


_AIO = "tunes DeepSpeed's async I/O for nvme offload; zerosim's nvme files are memory maps"


@dataclass(frozen=True)
class AioConfig(Section):
    """``aio``: DeepSpeed's async I/O library (nvme offload)."""

    block_size: int = _tuning(1_048_576, integer(1), "bytes per request", _AIO)
    queue_depth: int = _tuning(8, integer(1), "requests in flight", _AIO)
    intra_op_parallelism: int = _tuning(1, integer(1), "threads per request", _AIO)
    single_submit: bool = _tuning(False, flag(), "submit one request at a time", _AIO)
    overlap_events: bool = _tuning(True, flag(), "overlap submission and completion", _AIO)
    use_gds: bool = _tuning(False, flag(), "GPUDirect Storage", _AIO)


_PROFILER = (
    "DeepSpeed's FLOPs profiler is not built (zerosim's dry run counts the FLOPs of every "
    "matmul: docs/dryrun.md)"
)


@dataclass(frozen=True)
class FlopsProfilerConfig(Section):
    """``flops_profiler``: DeepSpeed's FLOPs profiler (it also turns wall_clock_breakdown on)."""

    enabled: bool = _switch(_PROFILER)
    recompute_fwd_factor: float = _later(0.0, number(0), "read once enabled")
    profile_step: int = _later(1, integer(1), "read once enabled")
    module_depth: int = _later(-1, integer(-1), "read once enabled")
    top_modules: int = _later(1, integer(1), "read once enabled")
    detailed: bool = _later(True, flag(), "read once enabled")
    output_file: str | None = _later(None, optional(text()), "read once enabled")


@dataclass(frozen=True)
class TorchAutocastConfig(Section):
    """``torch_autocast``: run the model under torch.autocast (each op in its own precision)."""

    enabled: bool = _switch(
        "torch.autocast's per-op precision is not built: zerosim computes every op in the "
        "model dtype (use the fp16 or bf16 section)",
        refuse=True,
    )
    dtype: str | None = _later(None, optional(_DTYPE), "autocast dtype (read once enabled)")
    lower_precision_safe_modules: tuple[str, ...] | None = _later(
        None, optional(_strings()), "module classes cast down (read once enabled)"
    )


_BUFFERS = "zerosim keeps a module's buffers in the dtype the model built them in"


@dataclass(frozen=True)
class DataTypesConfig(Section):
    """``data_types``: dtypes DeepSpeed lets the config choose apart from fp16 / bf16."""

    grad_accum_dtype: str | None = knob(
        None,
        optional(_DTYPE),
        "dtype gradients accumulate in; null: the model dtype (zerosim's only choice: another "
        "is an error)",
    )
    param_dtype: str | None = knob(
        None,
        optional(_DTYPE),
        "the model dtype, restated; must match fp16 / bf16 (an error otherwise, as in DeepSpeed)",
    )
    buffer_dtype: str | None = _tuning(None, optional(_DTYPE), "dtype of buffers", _BUFFERS)
    keep_in_fp32_modules: Any = knob(
        "auto",
        _auto_or_strings(),
        "buffers kept in float32 under fp16 / bf16",
        inert=_BUFFERS,
        reproduces=("auto",),
    )


@dataclass(frozen=True)
class ThroughputTimerConfig(Section):
    """``timers.throughput``: DeepSpeed's samples-per-second log."""

    CLOSED: ClassVar[bool] = True
    enabled: bool = _pflag(
        True,
        "log throughput",
        inert="zerosim logs no throughput (engine.wall_clock has the times; steps_per_print "
        "logs the loss)",
        reproduces=(False,),
    )
    synchronized: bool = _pflag(True, "synchronise the device before timing (read once enabled)")


@dataclass(frozen=True)
class TimersConfig(Section):
    """``timers``: DeepSpeed's timers."""

    throughput: ThroughputTimerConfig = knob(
        ThroughputTimerConfig(),
        section(ThroughputTimerConfig),
        "the throughput timer",
        null="DeepSpeed builds its model from this object and fails on null",
    )


# --- the top-level keys ---------------------------------------------------------------------------

_MOE = "expert parallelism (MoE), which zerosim does not build"
_GC = "zerosim leaves Python's garbage collector as it is"


@dataclass(frozen=True, kw_only=True)
class DeepSpeedFeatures:
    """DeepSpeed's top-level keys for what zerosim does not build (``Config`` inherits them)."""

    managed_gradient_accumulation: bool = knob(
        True,
        flag(),
        "false: the client owns the accumulation boundary and every step() updates",
        inert="zerosim's engine steps at every gradient_accumulation_steps-th micro-step; the "
        "client-managed boundary is not built",
        reproduces=(True,),
        refuse=True,
    )
    data_parallel_size: int | None = knob(
        None,
        optional(integer(1)),
        "read by deepspeed.initialize beside sequence_parallel_size: the data-parallel side of "
        "its (data_parallel, sequence_parallel) device mesh, so world size / "
        "sequence_parallel_size (checked in load_config; warned about without the other)",
    )
    sequence_parallel_size: int = knob(
        1,
        integer(1),
        "ranks per sequence-parallel group (DeepSpeed's data-parallel size is world / this)",
        inert="sequence parallelism (Ulysses) is not built",
        reproduces=(1,),
        refuse=True,
    )
    seq_parallel_communication_data_type: str | None = knob(
        "fp32",
        optional(choice(*PRECISION_DTYPES)),
        "dtype of sequence parallelism's all-to-alls",
        inert="no effect without sequence parallelism, as in DeepSpeed",
        reproduces=any_value,
    )
    use_data_before_expert_parallelism: bool = knob(
        False,
        flag(),
        "the order of data- and expert-parallel ranks",
        inert=f"no effect without {_MOE}, as in DeepSpeed",
        reproduces=any_value,
    )
    disable_allgather: bool = knob(
        False,
        flag(),
        "disable the all-gather",
        inert="no effect, as in DeepSpeed 0.19.8, which reads it and never uses it",
        reproduces=any_value,
    )
    dump_state: bool = knob(
        False,
        flag(),
        "print the engine's state at initialize",
        inert="zerosim prints no engine state (print(engine.config) shows the config)",
        reproduces=(False,),
    )
    memory_breakdown: bool = knob(
        False,
        flag(),
        "log memory use around forward, backward and step",
        inert="zerosim logs no memory use (engine.memory_report() has each rank's bytes)",
        reproduces=(False,),
    )
    disable_python_gc: bool = knob(
        False,
        flag(),
        "turn Python's cyclic garbage collector off (DeepSpeed's engine.collect_python_gc() "
        "then collects; zerosim's engine has no such method)",
        inert=_GC,
        reproduces=(False,),
    )
    dataloader_drop_last: bool = knob(
        False,
        flag(),
        "DeepSpeed's loader: drop (true) or keep short (false) an incomplete last micro-batch",
        inert="zerosim's loader (training_data=) drops an incomplete last global batch, so that "
        "every step has the whole batch (docs/data.md)",
        reproduces=(),
    )
    log_level: str | None = knob(
        None,
        optional(choice("debug", "info", "warning", "error", "critical")),
        "DeepSpeed's logger level",
        inert="zerosim logs through Python's logging: set the level of the 'zerosim' logger",
        reproduces=(None,),
    )
    vocabulary_size: int | None = knob(
        None,
        optional(integer(1)),
        "read by DeepSpeed only for a hint when it is not a multiple of 8",
        inert="zerosim gives no Tensor Core hint",
        reproduces=(None,),
    )
    activation_checkpointing: ActivationCheckpointingConfig = knob(
        ActivationCheckpointingConfig(),
        section(ActivationCheckpointingConfig),
        "DeepSpeed's activation checkpointing API",
        null="DeepSpeed reads keys of it and fails on null",
    )
    aio: AioConfig = knob(AioConfig(), section(AioConfig), "async I/O; null: defaults")
    flops_profiler: FlopsProfilerConfig = knob(
        FlopsProfilerConfig(),
        section(FlopsProfilerConfig),
        "the FLOPs profiler",
        null="DeepSpeed reads keys of it and fails on null",
    )
    comms_logger: CommsLoggerConfig = knob(
        CommsLoggerConfig(),
        section(CommsLoggerConfig),
        "the collectives log",
        null="DeepSpeed builds its model from this object and fails on null",
    )
    tensorboard: TensorBoardConfig = knob(
        TensorBoardConfig(), section(TensorBoardConfig), "TensorBoard monitor", null=NOT_NULL
    )
    wandb: WandbConfig = knob(WandbConfig(), section(WandbConfig), "W&B monitor", null=NOT_NULL)
    csv_monitor: CSVMonitorConfig = knob(
        CSVMonitorConfig(), section(CSVMonitorConfig), "CSV monitor", null=NOT_NULL
    )
    comet: CometConfig = knob(CometConfig(), section(CometConfig), "Comet monitor", null=NOT_NULL)
    compile: CompileConfig = knob(
        CompileConfig(),
        section(CompileConfig),
        "DeepCompile",
        null="DeepSpeed builds its model from this object and fails on null",
    )
    hybrid_engine: HybridEngineConfig = knob(
        HybridEngineConfig(),
        section(HybridEngineConfig),
        "the hybrid (train and generate) engine",
        null="DeepSpeed builds its model from this object and fails on null",
    )
    timers: TimersConfig = knob(
        TimersConfig(),
        section(TimersConfig),
        "DeepSpeed's timers",
        null="DeepSpeed reads keys of it and fails on null",
    )
    torch_autocast: TorchAutocastConfig = knob(
        TorchAutocastConfig(),
        section(TorchAutocastConfig),
        "torch.autocast",
        null="DeepSpeed reads keys of it and fails on null",
    )
    data_types: DataTypesConfig = knob(
        DataTypesConfig(),
        section(DataTypesConfig),
        "gradient accumulation, parameter and buffer dtypes",
        null="DeepSpeed reads keys of it and fails on null",
    )
    autotuning: Any = whole_section(
        "DeepSpeed's autotuner",
        lambda value: _truthy(value, "enabled"),
        "the autotuner is not built (with autotuning.enabled DeepSpeed's engine profiles "
        "some steps, writes its metrics and ends the job)",
        refuse=True,
        off="enabled false or absent",
    )
    data_efficiency: Any = whole_section(
        "curriculum learning, dynamic batching, random-LTD",
        _any_enabled,
        "DeepSpeed's data efficiency library is not built: any of its 'enabled' switches would "
        "change which samples or tokens each step trains on",
        refuse=True,
        off="every 'enabled' switch in it false or absent",
    )
    expert_parallel: Any = whole_section(
        "AutoEP: expert parallelism for MoE models",
        lambda value: _truthy(value, "enabled"),
        "expert parallelism (MoE) is not built",
        refuse=True,
        off="enabled false or absent",
        null=None,  # DeepSpeed reads a null section as the defaults
    )
    tensor_parallel: Any = whole_section(
        "AutoTP: tensor parallelism",
        _tensor_parallel_on,
        "tensor parallelism is not built",
        refuse=True,
        off="autotp_size and tp.tp_size (alias tensor_parallel.tp_size) <= 1 or absent",
    )
    weight_quantization: Any = whole_section(
        "weight quantization at initialisation (quantized_initialization) or after it",
        lambda value: (
            _truthy(value, "quantized_initialization") or _truthy(value, "post_init_quant")
        ),
        "weight quantization is not built (zerosim would train unquantized weights)",
        refuse=True,
        off="quantized_initialization and post_init_quant false or absent",
    )
    pipeline: Any = whole_section(
        "pipeline parallelism's settings",
        lambda value: bool(value),
        "read only by DeepSpeed's PipelineEngine, for a PipelineModule model; zerosim has no "
        "pipeline parallelism",
        refuse=False,
    )
    datastates_ckpt: Any = whole_section(
        "the DataStates checkpoint engine; any value but false turns it on",
        lambda value: value is not False,
        "zerosim writes its own checkpoint files",
        refuse=False,
        objects_only=False,
        null="DeepSpeed takes null as on; write true (zerosim then warns) or false",
    )


def check_features(cfg: Any) -> None:
    """The rules of these keys that involve other sections (called by ``load_config``)."""
    types = cfg.data_types
    for key, name in (
        ("grad_accum_dtype", types.grad_accum_dtype),
        ("param_dtype", types.param_dtype),
    ):
        if name is not None and dtype_of(name) != cfg.model_dtype:
            why = (
                "zerosim accumulates gradients in the model dtype"
                if key == "grad_accum_dtype"
                else "DeepSpeed asserts it matches the fp16 / bf16 mode"
            )
            raise ConfigError(
                f"data_types.{key}",
                name,
                f"null or a name of the model dtype {cfg.model_dtype} ({why})",
            )
