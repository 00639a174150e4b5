"""DeepSpeed's JSON config, read into typed frozen objects and validated before anything is built.

``load_config(config, world_size)`` is a pure function: the engine calls it first on every
rank, so every rank raises the same ``ConfigError`` before any buffer or communicator is
touched. Key names and defaults are DeepSpeed 0.19.8's (deepspeed/runtime/config.py,
constants.py, zero/config.py), and so is the decision to accept or reject: the tests hold
``load_config`` + ``initialize`` to DeepSpeed's own parser on a corpus of configs, and list
every case where zerosim is stricter, with the reason (tests/test_deepspeed_config.py). The
sections live in ``sections.py`` and ``optimizer.py``, the parsing primitives in ``values.py``,
and ``docs/config.md`` lists every key.

The batch triple follows DeepSpeed's ``_set_batch_related_parameters``: with world size N,

    train_batch_size == train_micro_batch_size_per_gpu × gradient_accumulation_steps × N

and a missing member is inferred with floor division in DeepSpeed's order (so a product that
does not divide is caught by the equality check, with the numbers in the message).
"""

from __future__ import annotations

import difflib
import json
import numbers
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from zerosim.backend import PRECISION_DTYPES
from zerosim.config.features import DeepSpeedFeatures, check_features
from zerosim.config.optimizer import (
    DEEPSPEED_SCHEDULERS,
    ZERO_SUPPORTED_OPTIMIZERS,
    OptimizerConfig,
    SchedulerConfig,
    check_whole_parameter_rules,
)
from zerosim.config.sections import (
    BF16Config,
    CheckpointConfig,
    FP16Config,
    LossScaleSettings,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ZeroConfig,
    ZerosimConfig,
)
from zerosim.config.values import (
    Parser,
    any_value,
    as_mapping,
    choice,
    find_unknown_keys,
    flag,
    inert_keys_given,
    integer,
    knob,
    knob_fields,
    knobs_to_dict,
    known_key_paths,
    number,
    optional,
    read_knobs,
    section,
    to_plain,
)
from zerosim.errors import ConfigError

__all__ = [
    "BF16Config",
    "CheckpointConfig",
    "Config",
    "FP16Config",
    "LossScaleSettings",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZeroConfig",
    "ZerosimConfig",
    "load_config",
    "read_config_file",
    "resolve_batch_size",
]

COMMUNICATION_DTYPES = PRECISION_DTYPES  # communication_data_type's values
# gradient_allreduce_op's values (DeepSpeed's GRADIENT_ALLREDUCE_OP_SUPPORTED, read in any case)
GRADIENT_ALLREDUCE_OPS = ("mean", "sum")
# Top-level sections DeepSpeed 0.19.8 removed (runtime/config.py _REMOVED_TOP_LEVEL_CONFIG_KEYS):
# it raises DeepSpeedConfigError when one is present, so zerosim does too.
REMOVED_TOP_LEVEL_KEYS = (
    "amp",
    "compression_training",
    "curriculum_learning",
    "eigenvalue",
    "elasticity",
    "graph_harvesting",
    "nebula",
    "progressive_layer_drop",
    "quantize_training",
    "sparse_attention",
    "sparse_gradients",
)
# Why null is an error for some top-level keys: DeepSpeed reads them with dict.get, keeps the
# None and fails on it, at load or at the first step.
_NULL_FAILS_AT_STEP = "DeepSpeed keeps null as None and fails on it at the first step"
_NULL_FAILS = "DeepSpeed reads keys of this section and fails on null"


def _zero_section() -> Parser:
    """``zero_optimization`` is an object, or DeepSpeed's legacy bool (true → stage 1)."""

    def convert(value: Any, path: str) -> ZeroConfig:
        if isinstance(value, bool):
            return ZeroConfig.from_dict({"stage": int(value)}, path)
        return ZeroConfig.from_dict(value, path)

    return Parser("a JSON object, or true (stage 1) / false (stage 0)", convert, ZeroConfig)


_BATCH = optional(integer(1))


@dataclass(frozen=True)
class Config(DeepSpeedFeatures):
    """The whole config. Fields are DeepSpeed's top-level keys; ``world_size`` is the one
    ``load_config`` checked the batch triple against. Build it with ``load_config``. The keys
    of DeepSpeed's features zerosim does not build come from ``DeepSpeedFeatures``
    (features.py)."""

    world_size: int
    train_batch_size: int = knob(None, _BATCH, "global batch; inferred when absent")
    train_micro_batch_size_per_gpu: int = knob(None, _BATCH, "per-rank micro-batch")
    gradient_accumulation_steps: int = knob(None, _BATCH, "micro-steps per optimizer step")
    gradient_clipping: float = knob(
        1.0, number(0), "max global gradient norm; 0 = off", null=_NULL_FAILS_AT_STEP
    )
    steps_per_print: int | None = knob(
        None, optional(integer(1)), "log every this many steps; null = never"
    )
    wall_clock_breakdown: bool = knob(
        False,
        flag(),
        "time forward/backward/step",
        null="DeepSpeed ors it with a bool and fails on null",
    )
    prescale_gradients: bool = knob(False, flag(), "divide gradients before reducing")
    gradient_predivide_factor: float = knob(
        1.0,
        number(0, above=True),
        "multiply by 1/this before the sum, by this/N after",
        null=_NULL_FAILS_AT_STEP,
    )
    gradient_allreduce_op: str = knob(
        "mean",
        choice(*GRADIENT_ALLREDUCE_OPS),
        "how gradients combine over ranks: 'mean' (the sum / N) or 'sum' (stages 0-2)",
        null="DeepSpeed accepts only 'mean' or 'sum' and fails on null",
    )
    communication_data_type: str | None = knob(
        None, optional(choice(*COMMUNICATION_DTYPES)), "dtype of gradient collectives"
    )
    zero_allow_untested_optimizer: bool = knob(
        False, flag(), "allow optimizers DeepSpeed has not tested with ZeRO (stage >= 1)"
    )
    zero_force_ds_cpu_optimizer: bool = knob(
        True,
        flag(),
        "with offload_optimizer, refuse an optimizer object passed to initialize() (DeepSpeed "
        "asks for its CPU Adam); false allows it",
    )
    optimizer: OptimizerConfig | None = knob(
        None, section(OptimizerConfig), "None: pass optimizer= to initialize()", null=_NULL_FAILS
    )
    scheduler: SchedulerConfig | None = knob(
        None,
        section(SchedulerConfig),
        "None: pass lr_scheduler= or no schedule",
        null=_NULL_FAILS,
    )
    zero_optimization: ZeroConfig = knob(
        ZeroConfig(), _zero_section(), "ZeRO stage and knobs", null=_NULL_FAILS
    )
    allgather_size: int = knob(
        500_000_000,
        integer(0),
        "legacy: allgather_bucket_size of 'zero_optimization: true'",
        inert="no effect, as zero_optimization.allgather_bucket_size (DeepSpeed 0.19.8 "
        "all-gathers each group in one call whatever it says)",
        reproduces=any_value,
    )
    fp16: FP16Config = knob(
        FP16Config(), section(FP16Config), "float16 mixed precision", null=_NULL_FAILS
    )
    bf16: BF16Config = knob(BF16Config(), section(BF16Config), "bfloat16", aliases=("bfloat16",))
    checkpoint: CheckpointConfig = knob(
        CheckpointConfig(), section(CheckpointConfig), "checkpoint", null=_NULL_FAILS
    )
    zerosim: ZerosimConfig = knob(ZerosimConfig(), section(ZerosimConfig), "zerosim's own knobs")

    @property
    def mixed_precision(self) -> str | None:
        """'fp16', 'bf16', or None when training in one precision."""
        if self.fp16.enabled:
            return "fp16"
        return "bf16" if self.bf16.enabled else None

    @property
    def model_dtype(self) -> str:
        """Dtype of module parameters, activations and gradients."""
        if self.mixed_precision is None:
            return self.zerosim.dtype
        return PRECISION_DTYPES[self.mixed_precision]

    @property
    def master_dtype(self) -> str:
        """Dtype of master weights and optimizer states: float32 under mixed precision."""
        return "float32" if self.mixed_precision else self.zerosim.dtype

    @property
    def communication_dtype(self) -> str:
        """Dtype gradients are reduced in: communication_data_type, else the model dtype."""
        if self.communication_data_type is None:
            return self.model_dtype
        return COMMUNICATION_DTYPES[self.communication_data_type]

    def loss_scaler(self) -> LossScaleSettings | None:
        """The fp16 loss scaler settings at this ZeRO stage, or None without fp16."""
        if not self.fp16.enabled:
            return None
        return self.fp16.loss_scaler(self.zero_optimization.stage)

    def to_dict(self) -> dict[str, Any]:
        """A DeepSpeed-style dict; ``load_config(c.to_dict(), c.world_size) == c``."""
        return knobs_to_dict(self)


def resolve_batch_size(
    train: int | None, micro: int | None, accumulation: int | None, world_size: int
) -> tuple[int, int, int]:
    """DeepSpeed's batch-triple inference and check → (train, micro, accumulation).

    Given two or three members, the missing one is inferred (floor division); given only
    train_batch_size or only the micro-batch, accumulation is 1. Then every member must be
    >= 1 and train == micro × accumulation × world_size.
    """
    inferred = ""  # "<key> inferred as <formula>", for the messages
    if train is not None and micro is not None and accumulation is None:
        accumulation = train // micro // world_size
        inferred = (
            f"gradient_accumulation_steps inferred as train_batch_size {train} // "
            f"train_micro_batch_size_per_gpu {micro} // world_size {world_size}"
        )
    elif train is not None and micro is None:
        accumulation = 1 if accumulation is None else accumulation
        micro = train // world_size // accumulation
        inferred = (
            f"train_micro_batch_size_per_gpu inferred as train_batch_size {train} // "
            f"world_size {world_size} // gradient_accumulation_steps {accumulation}"
        )
    elif train is None and micro is not None:
        accumulation = 1 if accumulation is None else accumulation
        train = micro * accumulation * world_size
    elif train is None:
        raise ConfigError(
            "train_batch_size",
            None,
            "train_batch_size or train_micro_batch_size_per_gpu, or both "
            "(gradient_accumulation_steps alone does not fix the batch)",
            got="neither train_batch_size nor train_micro_batch_size_per_gpu is given",
        )
    for key, value in (
        ("gradient_accumulation_steps", accumulation),
        ("train_micro_batch_size_per_gpu", micro),
    ):
        if value < 1:
            raise ConfigError(key, value, "an integer >= 1", got=f"got {value} ({inferred})")
    product = micro * accumulation * world_size
    if train != product:
        raise ConfigError(
            "train_batch_size",
            train,
            "train_micro_batch_size_per_gpu × gradient_accumulation_steps × world_size = "
            f"{micro} × {accumulation} × {world_size} = {product}"
            + (f" ({inferred})" if inferred else ""),
        )
    return train, micro, accumulation


def _check_consistency(cfg: Config) -> None:
    """Rules across sections: combinations that do not exist in DeepSpeed or in zerosim."""
    zero, sim, n = cfg.zero_optimization, cfg.zerosim, cfg.world_size
    if cfg.fp16.enabled and cfg.bf16.enabled:
        raise ConfigError("bf16.enabled", True, "false when fp16.enabled is true (one 16-bit mode)")
    _check_deepspeed_engine_rules(cfg)
    check_features(cfg)
    check_whole_parameter_rules(cfg)
    if sim.layout == "megatron" and zero.stage != 1:
        raise ConfigError(
            "zero_optimization.stage",
            zero.stage,
            "1 with zerosim.layout 'megatron' (Megatron's distributed optimizer shards the "
            "optimizer state only: ZeRO-1 semantics)",
        )
    if n % min(zero.zero_hpz_partition_size, n):
        raise ConfigError(
            "zero_optimization.zero_hpz_partition_size",
            zero.zero_hpz_partition_size,
            f"a divisor of world_size {n}, or >= it (DeepSpeed uses min(size, world_size))",
        )
    if sim.ranks_per_node is not None and n % sim.ranks_per_node:
        raise ConfigError(
            "zerosim.ranks_per_node", sim.ranks_per_node, f"a divisor of world_size {n}"
        )
    half = {"float16": "fp16", "bfloat16": "bf16"}
    if sim.dtype in half and cfg.mixed_precision != half[sim.dtype]:
        raise ConfigError(
            "zerosim.dtype",
            sim.dtype,
            f"'float32' or 'float64' unless {half[sim.dtype]}.enabled is true (16-bit training "
            f"is configured by the {half[sim.dtype]} section, which owns master weights and "
            "loss scaling)",
        )
    if cfg.mixed_precision and sim.dtype == "float64":
        raise ConfigError(
            "zerosim.dtype",
            sim.dtype,
            f"'float32' (or '{cfg.model_dtype}') when {cfg.mixed_precision}.enabled is true: "
            "mixed precision keeps float32 master weights, as DeepSpeed does",
        )
    if sim.backend == "cupy" and "bfloat16" in (cfg.model_dtype, cfg.communication_dtype):
        raise ConfigError(
            "zerosim.backend", "cupy", "'numpy' for bfloat16 (CuPy has no bfloat16 dtype)"
        )
    halves = {cfg.model_dtype, cfg.communication_dtype} & {"float16", "bfloat16"}
    if sim.backend == "array_api_strict" and halves:
        raise ConfigError(
            "zerosim.backend",
            "array_api_strict",
            f"'numpy' for {sorted(halves)} (the Array API standard has no 16-bit floats, so "
            "array_api_strict runs float32 and float64 only)",
        )


def _check_deepspeed_engine_rules(cfg: Config) -> None:
    """What ``deepspeed.initialize`` refuses (after its config parser accepted the config)."""
    zero, opt, sched = cfg.zero_optimization, cfg.optimizer, cfg.scheduler
    if zero.stage >= 1 and opt is not None and opt.type not in ZERO_SUPPORTED_OPTIMIZERS:
        if not cfg.zero_allow_untested_optimizer:
            raise ConfigError(
                "optimizer.type",
                opt.type,
                f"one of {list(ZERO_SUPPORTED_OPTIMIZERS)} at ZeRO stage {zero.stage}, or any "
                'type with "zero_allow_untested_optimizer": true (DeepSpeed\'s rule for '
                "optimizers it has not tested with ZeRO)",
            )
    if sched is not None and sched.is_torch and (zero.stage >= 1 or cfg.mixed_precision):
        raise ConfigError(
            "scheduler.type",
            sched.type,
            f"a DeepSpeed scheduler ({', '.join(DEEPSPEED_SCHEDULERS)}) with ZeRO stage >= 1 "
            "or fp16/bf16: DeepSpeed gives torch schedulers its optimizer wrapper, "
            "which is then not a torch.optim.Optimizer, and fails",
        )
    if not zero.compute_grad_norm and cfg.gradient_clipping > 0:
        raise ConfigError(
            "zero_optimization.compute_grad_norm",
            False,
            f"true while gradient_clipping is {cfg.gradient_clipping} (clipping needs the norm; "
            "DeepSpeed refuses false unless gradient_clipping is 0)",
        )
    # DeepSpeed 0.19.8 sums gradients unscaled ('sum') only at stages 0-2 without DeepCompile
    if cfg.gradient_allreduce_op == "sum" and (zero.stage == 3 or cfg.compile.deepcompile):
        where = "at ZeRO stage 3" if zero.stage == 3 else "with compile.deepcompile"
        raise ConfigError(
            "gradient_allreduce_op",
            "sum",
            f"'mean' {where} (DeepSpeed 0.19.8 refuses 'sum' with stage 3 and with "
            "DeepCompile); 'sum' at stages 0-2 without DeepCompile",
        )
    if zero.stage >= 2 and zero.reduce_scatter and cfg.gradient_allreduce_op == "mean":
        for key, value, fine in (
            ("prescale_gradients", cfg.prescale_gradients, False),
            ("gradient_predivide_factor", cfg.gradient_predivide_factor, 1.0),
        ):
            if value != fine:
                raise ConfigError(
                    key,
                    value,
                    f"{json.dumps(fine)} at ZeRO stage {zero.stage} with reduce_scatter "
                    "(DeepSpeed's ZeRO-2/3 support it only with reduce_scatter: false)",
                )


def read_config_file(path: str | os.PathLike) -> Any:
    """The object in a config file, read as DeepSpeed reads one (runtime/config.py:
    ``hjson.load(f, object_pairs_hook=dict_raise_error_on_duplicate_keys)``): JSON, or hjson
    (comments, quoteless keys and strings, optional commas), a repeated key refused. Every
    problem is a ConfigError naming the file. hjson reads ``1.0`` and ``5e8`` as integers, as
    DeepSpeed sees them. A JSON file with NaN or Infinity reads as it would pretty-printed,
    whatever its line breaks (``_json_with_constants``)."""
    import hjson  # DeepSpeed's reader; pure Python, imported only when a file is read

    name = os.fspath(path)
    allowed = "a readable JSON or hjson file holding one object without repeated keys"

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [key for key, _ in pairs]
        repeated = sorted({key for key in keys if keys.count(key) > 1})
        if repeated:
            raise ConfigError(name, repeated, allowed, got=f"repeated keys {repeated}")
        return dict(pairs)

    try:
        content = Path(name).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        why = err.strerror if isinstance(err, OSError) and err.strerror else err
        raise ConfigError(name, name, allowed, got=f"cannot read the file ({why})") from err
    try:
        return hjson.loads(content, object_pairs_hook=no_duplicates)
    except ConfigError:
        raise
    except hjson.HjsonDecodeError as err:
        try:  # JSON with NaN or Infinity on one line (``_json_with_constants``)
            return _json_with_constants(content, no_duplicates)
        except ConfigError:
            raise
        except (ValueError, OverflowError, RecursionError):
            pass  # not JSON either: hjson's message says where
        got = f"neither JSON nor hjson ({err.msg} at line {err.lineno} column {err.colno})"
        raise ConfigError(name, name, allowed, got=got) from err
    except (ValueError, OverflowError, RecursionError) as err:  # 1e400, nesting too deep
        got = f"not readable as hjson ({type(err).__name__}: {err})"
        raise ConfigError(name, name, allowed, got=got) from err


def _json_with_constants(content: str, object_pairs_hook: Any) -> Any:
    """JSON with NaN, Infinity or -Infinity (Python's json reads them), as hjson reads a file
    that has each on a line of its own: the constant as the string hjson's quoteless value
    gives ('NaN'), the numbers as hjson gives them (5e8 an int), so the key's own check names
    it. On one line hjson cannot read such a file: its quoteless NaN runs to the end of the line
    and takes the closing brackets with it."""
    import hjson

    return json.loads(
        content, object_pairs_hook=object_pairs_hook, parse_constant=str, parse_float=hjson.loads
    )


def _suggest(key: str) -> str:
    close = difflib.get_close_matches(key, known_key_paths(Config), n=1, cutoff=0.8)
    return f"{key} (did you mean {close[0]}?)" if close else key


def _closest(key: str) -> str:
    close = difflib.get_close_matches(key, known_key_paths(Config), n=1, cutoff=0.8)
    return f"did you mean {close[0]}? " if close else ""


def _check_unknown(unknown: list[tuple[str, bool]], raw: dict) -> None:
    """Warn once about unknown keys in open sections (DeepSpeed ignores them), then reject the
    first unknown key of a closed section (DeepSpeed's pydantic models forbid extra keys)."""
    ignored = [path for path, closed in unknown if not closed]
    if ignored:
        warnings.warn(
            f"zerosim ignores {len(ignored)} unknown config key(s): "
            f"{', '.join(_suggest(key) for key in ignored)} "
            "(docs/config.md lists the keys it reads)",
            UserWarning,
            stacklevel=3,
        )
    for path, closed in unknown:
        if closed:
            parent, _, name = path.rpartition(".")
            node: object = raw
            for part in parent.split("."):
                node = node[part]  # type: ignore[index]
            value = node[name]  # type: ignore[index]
            cls = _section_class(parent)
            keys = sorted(f.name for f in knob_fields(cls))
            raise ConfigError(
                path,
                value,
                f"{_closest(path)}a key of {parent}: {keys} (DeepSpeed forbids unknown keys "
                "in this section)",
            )


def _section_class(path: str) -> type:
    """The section dataclass at a dotted key path (aliases allowed)."""
    cls: type = Config
    for part in path.split("."):
        for f in knob_fields(cls):
            if part in (f.name, *f.metadata["aliases"]):
                cls = f.metadata["parser"].section
                break
    return cls


# The one table of what parses but the engine refuses: (key, value of cfg, when it applies,
# why). Keys that parse and are only ignored are declared ``inert`` in their section instead
# (warned about at load, ``_check_inert``).
def _unbuilt(cfg: Config) -> list[tuple[str, Any, bool, str]]:
    zero = cfg.zero_optimization
    return [
        (
            "communication_data_type",
            cfg.communication_data_type,
            cfg.communication_data_type is not None and zero.zero_quantized_gradients,
            "use null with zero_quantized_gradients (qgZ sends its own int4 codes)",
        ),
    ]


def _check_inert(cfg: Config, raw: dict) -> None:
    """One UserWarning for each DeepSpeed key written with a value zerosim does not act on;
    a ConfigError for one that would change the numbers (``refuse``)."""
    for key, value, allowed, why, refuse in inert_keys_given(Config, raw, cfg, ""):
        value = to_plain(value)
        if refuse:
            raise ConfigError(key, value, f"{allowed} ({why})")
        warnings.warn(f"{key}={json.dumps(value)} is ignored: {why}", UserWarning, stacklevel=3)


def _check_data_parallel_size(cfg: Config, raw: Mapping[str, Any]) -> None:
    """``deepspeed.initialize`` reads ``data_parallel_size`` only where ``sequence_parallel_size``
    is written too: it then builds a (data_parallel, sequence_parallel) device mesh over every
    rank (torch's ``init_device_mesh``: the product must be the world size), and the
    data-parallel world is the mesh's first side. Alone, DeepSpeed never reads it."""
    size = cfg.data_parallel_size
    if size is None:
        return
    if "sequence_parallel_size" not in raw:
        warnings.warn(
            f"data_parallel_size={size} is ignored: deepspeed.initialize reads it only together "
            "with sequence_parallel_size (to build their device mesh)",
            UserWarning,
            stacklevel=3,
        )
        return
    sequence = cfg.sequence_parallel_size  # 1: a larger one is refused (_check_inert)
    if size * sequence != cfg.world_size:
        raise ConfigError(
            "data_parallel_size",
            size,
            f"{cfg.world_size // sequence} (world size {cfg.world_size} / sequence_parallel_size "
            f"{sequence}: deepspeed.initialize lays every rank out in a (data_parallel, "
            "sequence_parallel) device mesh)",
        )


def _check_sum_scaling(cfg: Config) -> None:
    """With ``gradient_allreduce_op: "sum"`` DeepSpeed's stages 0-2 sum the gradients without
    any scaling, so ``prescale_gradients`` and ``gradient_predivide_factor`` do nothing: say so."""
    if cfg.gradient_allreduce_op != "sum":
        return
    for key, value, default in (
        ("prescale_gradients", cfg.prescale_gradients, False),
        ("gradient_predivide_factor", cfg.gradient_predivide_factor, 1.0),
    ):
        if value != default:
            warnings.warn(
                f"{key}={json.dumps(value)} is ignored: with gradient_allreduce_op 'sum' the "
                "gradients are summed over ranks without any scaling, as DeepSpeed 0.19.8 does",
                UserWarning,
                stacklevel=3,
            )


def reject_unbuilt(cfg: Config) -> None:
    """Raise ConfigError for a value that parses but that the engine does not implement."""
    for key, value, applies, why in _unbuilt(cfg):
        if applies:
            raise ConfigError(f"{key} = {value!r} is not supported by this engine; {why}")


def load_config(config: dict | str | os.PathLike | Config, world_size: int) -> Config:
    """Read and validate a DeepSpeed config (a dict, or a path to a JSON or hjson file, read by
    ``read_config_file``) for ``world_size``.

    Unknown keys produce one UserWarning listing their key paths, except inside the sections
    DeepSpeed validates strictly (zero_optimization, its offload sections, fp16, bf16), where
    they are a ConfigError as in DeepSpeed; so is any invalid value or contradiction. A
    DeepSpeed key zerosim reads but does not act on is warned about when written with a value
    that would matter. Pure: no communicator, no state.
    """
    valid = isinstance(world_size, numbers.Integral) and not isinstance(world_size, bool)
    if not valid or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    world_size = int(world_size)
    if isinstance(config, Config):
        config = config.to_dict()
    elif isinstance(config, str | os.PathLike):
        config = read_config_file(config)
    raw = as_mapping(config, "")
    for key in REMOVED_TOP_LEVEL_KEYS:
        if key in raw:
            raise ConfigError(key, raw[key], "nothing: DeepSpeed 0.19.8 removed this section")
    if raw.get("bfloat16", False) is None and raw.get("bf16") is None:
        raise ConfigError("bfloat16", None, "a JSON object (DeepSpeed fails on null here)")
    _check_unknown(find_unknown_keys(Config, raw, ""), raw)
    values = read_knobs(Config, raw, "")
    batch = resolve_batch_size(
        values["train_batch_size"],
        values["train_micro_batch_size_per_gpu"],
        values["gradient_accumulation_steps"],
        world_size,
    )
    values.update(
        zip(
            ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"),
            batch,
            strict=True,
        )
    )
    cfg = Config(world_size=world_size, **values)
    _check_consistency(cfg)
    _check_inert(cfg, raw)
    _check_data_parallel_size(cfg, raw)
    _check_sum_scaling(cfg)
    zero = cfg.zero_optimization
    hpz = min(zero.zero_hpz_partition_size, world_size)  # DeepSpeed's effective size
    if hpz != zero.zero_hpz_partition_size:
        cfg = replace(cfg, zero_optimization=replace(zero, zero_hpz_partition_size=hpz))
    return cfg
