"""The sections of the config that are plain knobs: ZeRO, offload, fp16/bf16, checkpoint, zerosim.

Each class is a frozen dataclass; each field is one JSON key with DeepSpeed's name and the
default of DeepSpeed 0.19.8's code (deepspeed/runtime/zero/config.py, zero/offload_config.py,
precision_config.py, constants.py). Rules that involve two keys of one section live in its
``finish``; rules across sections live in ``rules.py``.

``zero_optimization``, the two offload sections, ``fp16`` and ``bf16`` are pydantic models in
DeepSpeed. They are read here as pydantic reads them (``lax_boolean``, ``lax_integer``; null
only where DeepSpeed's field is Optional), and they are ``CLOSED``: an unknown key is an error,
as DeepSpeed's ``extra="forbid"`` makes it. Every key of DeepSpeed's models is therefore
declared, including those zerosim does not act on: an ``inert`` knob says why it has no effect
here, and ``load_config`` warns when one is written with a value whose DeepSpeed behaviour
zerosim does not have (a ``refuse`` knob is rejected instead: it would change the numbers).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from zerosim.analysis.volume import SCHEDULES
from zerosim.config.fsdp2 import Fsdp2Config
from zerosim.config.values import (
    Parser,
    Section,
    as_finite_float,
    boolean,
    choice,
    flag,
    integer,
    join,
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
from zerosim.zero.loss_scaler import LossScaleSettings

OFFLOAD_DEVICES = ("none", "cpu", "nvme")
ZEROPP_KEYS = ("zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size")
# Why null is an error in DeepSpeed's pydantic sections: the field is not Optional.
NOT_NULL = "DeepSpeed's model requires a value for this field"
# Keys DeepSpeed 0.19.8 removed from zero_optimization (runtime/config.py
# _REMOVED_ZERO_CONFIG_KEYS): it raises DeepSpeedConfigError when one is present.
REMOVED_ZERO_KEYS = {
    "mics_shard_size": "MiCS ZeRO-3 sharding",
    "mics_hierarchical_params_gather": "MiCS ZeRO-3 sharding",
    "zeropp_loco_param": "LoCo-Zero++",
}


def _flag(default: bool, doc: str, **extra: Any) -> Any:
    """A boolean of a DeepSpeed pydantic section."""
    return knob(default, lax_boolean(), doc, null=NOT_NULL, **extra)


def _count(default: int, minimum: int | None, doc: str, **extra: Any) -> Any:
    """An integer of a DeepSpeed pydantic section (``minimum`` None: any integer)."""
    return knob(default, lax_integer(minimum), doc, null=NOT_NULL, **extra)


def _fraction() -> Parser:
    """A float in [0, 1] as pydantic reads it (bools, numbers and numeric strings)."""
    allowed = "a number in [0, 1]"

    def convert(value: Any, path: str) -> float:
        if isinstance(value, bool):
            number: float | None = float(value)
        elif isinstance(value, str):
            try:
                number = as_finite_float(float(value.strip()))
            except ValueError:
                number = None
        else:
            number = as_finite_float(value)
        if number is None or not 0.0 <= number <= 1.0:
            raise ConfigError(path, value, allowed)
        return number

    return Parser(allowed, convert)


def _not_built(why: str) -> Parser:
    """A DeepSpeed key whose only accepted value here is null (its feature is not built)."""

    def convert(value: Any, path: str) -> Any:
        raise ConfigError(path, value, f"null or absent: {why}")

    return Parser(f"null ({why})", convert)


def _check_nvme_path(values: dict[str, Any], path: str) -> None:
    if values["device"] == "nvme" and values["nvme_path"] is None:
        raise ConfigError(join(path, "nvme_path"), None, "a directory path when device is 'nvme'")


_DEVICE = choice(*OFFLOAD_DEVICES, any_case=False)
_NVME_PATH = optional(text())
_PIN = (
    "zerosim's offloaded arrays are host memory already (numpy); page-locking only speeds up "
    "device copies, which zerosim does not time"
)


@dataclass(frozen=True)
class OffloadOptimizerConfig(Section):
    """Where the fp32 master weights and optimizer states live (ZeRO-Offload / ZeRO-Infinity)."""

    CLOSED: ClassVar[bool] = True

    device: str = knob("none", _DEVICE, "none: device memory; cpu; nvme files", null=NOT_NULL)
    nvme_path: str | None = knob(None, _NVME_PATH, "directory for nvme files")
    buffer_count: int = _count(4, 0, "nvme: swap buffers the optimizer step streams through")
    pin_memory: bool = _flag(True, "page-locked host buffers", inert=_PIN)
    pipeline_read: bool = _flag(
        False, "overlap nvme reads with the step", inert="zerosim reads each tile, then steps it"
    )
    pipeline_write: bool = _flag(
        False, "overlap nvme writes with the step", inert="zerosim steps a tile, then writes it"
    )
    fast_init: bool = _flag(
        False, "nvme: fast initialisation", inert="zerosim's swap files are memory maps"
    )
    ratio: float = knob(
        1.0,
        _fraction(),
        "share of the optimizer step offloaded; < 1 needs stage 3",
        null=NOT_NULL,
        inert="zerosim offloads all of the optimizer partition or none of it",
        reproduces=(1.0,),
    )
    super_offload: bool = _flag(
        False, "DeepSpeed's SuperOffload", inert="SuperOffload's scheduling is not built"
    )
    cpuadam_cores_perc: float = knob(
        0.8,
        _fraction(),
        "share of host cores DeepSpeed's CPU Adam uses",
        null=NOT_NULL,
        inert="zerosim's host step is NumPy's, on the threads NumPy uses",
    )

    @classmethod
    def finish(cls, values: dict[str, Any], raw: Mapping[str, Any], path: str) -> dict[str, Any]:
        _check_nvme_path(values, path)
        return values


_PARAM_SWAP = "zerosim memory-maps the parameter shard file (no swap buffers)"


@dataclass(frozen=True)
class OffloadParamConfig(Section):
    """Where stage-3 parameter partitions live between uses (ZeRO-Infinity)."""

    CLOSED: ClassVar[bool] = True

    device: str = knob("none", _DEVICE, "none: device memory; cpu; nvme files", null=NOT_NULL)
    nvme_path: str | None = knob(None, _NVME_PATH, "directory for nvme files")
    buffer_count: int = _count(5, 0, "nvme swap buffers", inert=_PARAM_SWAP)
    buffer_size: int = _count(100_000_000, 0, "elements per swap buffer", inert=_PARAM_SWAP)
    max_in_cpu: int = _count(
        1_000_000_000,
        0,
        "elements kept in host memory",
        inert="zerosim keeps the whole offloaded shard where the device key says",
    )
    pin_memory: bool = _flag(True, "page-locked host buffers", inert=_PIN)

    @classmethod
    def finish(cls, values: dict[str, Any], raw: Mapping[str, Any], path: str) -> dict[str, Any]:
        _check_nvme_path(values, path)
        return values


def _names() -> Parser:
    """A list of strings, or one string (DeepSpeed's validator wraps it in a list)."""
    allowed = "a list of strings, or one string"

    def convert(value: Any, path: str) -> tuple[str, ...]:
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise ConfigError(path, value, allowed)
        return tuple(dict.fromkeys(value))

    return Parser(allowed, convert)


_LEAF = "zerosim's stage 3 fetches parameters per module, whatever their class or name"
# DeepSpeed's DEFAULT_LEAF_MODULE_CLASSES (runtime/zero/leaf_module_config.py).
_LEAF_CLASSES = tuple(
    f"transformers.models.{name}"
    for name in (
        "mixtral.modeling_mixtral.MixtralSparseMoeBlock",
        "qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
        "qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
    )
)


@dataclass(frozen=True)
class LeafModuleConfig(Section):
    """``zero_optimization.leaf_module``: modules DeepSpeed's stage 3 fetches as one unit."""

    CLOSED: ClassVar[bool] = True

    classes: tuple[str, ...] = knob(
        _LEAF_CLASSES, _names(), "class names", null=NOT_NULL, inert=_LEAF
    )
    names: tuple[str, ...] = knob((), _names(), "module names", null=NOT_NULL, inert=_LEAF)
    name_suffixes: tuple[str, ...] = knob(
        (), _names(), "module name suffixes", null=NOT_NULL, inert=_LEAF
    )


def _stage3(doc: str) -> str:
    return doc + " (stage 3)"


_STAGE3_ONLY = "a stage-3 fetch strategy of DeepSpeed's that zerosim does not build"


@dataclass(frozen=True)
class ZeroConfig(Section):
    """``zero_optimization``: which ZeRO stage, bucket sizes, stage-3 fetch knobs, offload, ZeRO++.

    ``overlap_comm`` has no fixed default in DeepSpeed: its validator sets it to
    ``stage == 3`` when the key is absent, so the default is True for stage 3 only.
    """

    CLOSED: ClassVar[bool] = True
    # Legacy keys DeepSpeed still accepts, rewritten by ``normalize``; removed ones it rejects.
    LEGACY_KEYS: ClassVar[tuple[str, ...]] = (
        "cpu_offload",
        "cpu_offload_param",
        "cpu_offload_use_pin_memory",
    )
    REMOVED_KEYS: ClassVar[tuple[str, ...]] = tuple(REMOVED_ZERO_KEYS)

    stage: int = knob(
        0,
        lax_integer(0, 3),
        "0: data parallel; 1: optimizer; 2: +gradients; 3: +params",
        null=NOT_NULL,
    )
    contiguous_gradients: bool = _flag(
        True,
        "copy gradients into a contiguous buffer (false: stages 1-2 all-reduce each bucket)",
    )
    overlap_comm: bool = knob(
        False, lax_boolean(), "overlap reduction with backward; default stage==3"
    )
    reduce_scatter: bool = _flag(
        True,
        "stages 1-2: reduce each bucket's slices to their owners (false: all-reduce the bucket)",
    )
    reduce_bucket_size: int = _count(500_000_000, 1, "elements per gradient bucket")
    use_multi_rank_bucket_allreduce: bool = _flag(
        True,
        "stages 1-2 with reduce_scatter: all-reduce the slices of all owners at once "
        "(false: one reduce per owner)",
    )
    allgather_partitions: bool = _flag(
        True,
        "all-gather (vs broadcast) updated params; DeepSpeed 0.19.8 reads but never uses it "
        "(one all-gather either way), nor does zerosim",
    )
    allgather_bucket_size: int = _count(
        500_000_000,
        0,
        "elements per all-gather; DeepSpeed 0.19.8 all-gathers each group in one call whatever "
        "it says (all_gather_into_tensor), and so does zerosim",
    )
    compute_grad_norm: bool = _flag(
        True,
        "compute the global gradient norm (false, stages 1-2: no norm all-reduce, no clipping)",
    )
    load_from_fp32_weights: bool = _flag(
        True,
        "restore master weights from the checkpoint's fp32 copy",
        inert="zerosim's checkpoints always restore the fp32 master weights",
        reproduces=(True,),
    )
    elastic_checkpoint: bool = _flag(
        False,
        "legacy elastic checkpoints",
        inert="zerosim's checkpoints load at any world size already",
        reproduces=(False,),
    )
    round_robin_gradients: bool = _flag(
        False,
        "stages 1-2 (DeepSpeed's schedule): lay parameters out round robin over the ranks "
        "(parameter i in list i mod N, the lists end to end), as DeepSpeed does",
    )
    sub_group_size: int = _count(1_000_000_000, 1, "optimizer steps in tiles of this size")
    stage3_prefetch_bucket_size: int = _count(
        50_000_000, 0, _stage3("elements fetched ahead"), aliases=("prefetch_bucket_size",)
    )
    stage3_param_persistence_threshold: int = _count(
        100_000,
        0,
        _stage3("params this small stay gathered"),
        aliases=("param_persistence_threshold",),
    )
    stage3_model_persistence_threshold: int = _count(
        sys.maxsize,
        0,
        _stage3("cap on the elements kept gathered by the persistence threshold"),
        aliases=("model_persistence_threshold",),
        inert="zerosim keeps every parameter under stage3_param_persistence_threshold gathered",
    )
    stage3_max_live_parameters: int = _count(
        1_000_000_000,
        0,
        _stage3("most gathered elements at once"),
        aliases=("max_live_parameters",),
    )
    stage3_max_reuse_distance: int = _count(
        1_000_000_000,
        0,
        _stage3("keep a param gathered if reused within"),
        aliases=("max_reuse_distance",),
    )
    stage3_gather_16bit_weights_on_model_save: bool = knob(
        False,
        lax_boolean(),
        _stage3("consolidate 16-bit weights on save"),
        aliases=("gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"),
        null=NOT_NULL,
    )
    stage3_module_granularity_threshold: int = _count(
        0,
        None,
        _stage3("fetch fine-grained modules as one unit"),
        aliases=("module_granularity_threshold",),
        inert=_STAGE3_ONLY,
        reproduces=(0,),
    )
    stage3_use_all_reduce_for_fetch_params: bool = _flag(
        False,
        _stage3("fetch parameters with an all-reduce"),
        aliases=("use_all_reduce_for_fetch_params",),
        inert=_STAGE3_ONLY,
        reproduces=(False,),
    )
    stage3_allgather_sequential: bool = _flag(
        False,
        _stage3("all-gather parameters one by one"),
        aliases=("allgather_sequential",),
        inert=_STAGE3_ONLY,
        reproduces=(False,),
    )
    ignore_unused_parameters: bool = _flag(
        True,
        "unused parameters are not an error",
        inert="zerosim's modules give every parameter a gradient (no unused parameters)",
        reproduces=(True,),
    )
    legacy_stage1: bool = _flag(
        False,
        "DeepSpeed's old stage-1 code",
        inert="zerosim has one stage-1 implementation",
        reproduces=(False,),
    )
    parameter_alignment: bool = _flag(
        False,
        "pad flat buffers so each parameter starts 16-byte aligned",
        inert="zerosim pads only the end of each flat buffer (docs/concepts.md)",
        reproduces=(False,),
    )
    offload_optimizer: OffloadOptimizerConfig = knob(
        OffloadOptimizerConfig(), section(OffloadOptimizerConfig), "stage >= 1; null: none"
    )
    offload_param: OffloadParamConfig = knob(
        OffloadParamConfig(), section(OffloadParamConfig), "stage 3 only; null: none"
    )
    zenflow: None = knob(
        None,
        _not_built("ZenFlow updates only some parameters each step; zerosim does not build it"),
        "DeepSpeed's ZenFlow",
    )
    zero_quantized_weights: bool = _flag(False, _stage3("qwZ: int8 weight all-gather"))
    zero_quantized_gradients: bool = _flag(False, _stage3("qgZ: quantized gradients"))
    zero_quantized_nontrainable_weights: bool = _flag(
        False,
        _stage3("store frozen weights quantized"),
        inert="quantized storage of frozen weights is not built; zerosim would compute with "
        "unquantized weights",
        reproduces=(False,),
        refuse=True,
    )
    zero_hpz_partition_size: int = _count(
        1, 0, _stage3("hpZ: secondary partition size; min(this, world size) is used")
    )
    memory_efficient_linear: bool = _flag(
        True,
        _stage3("memory-efficient linear layers"),
        inert="zerosim's Linear keeps what its backward needs, nothing more",
        reproduces=(True,),
    )
    pipeline_loading_checkpoint: bool = _flag(
        False,
        _stage3("load checkpoints in pipeline mode"),
        inert="zerosim has no pipeline parallelism",
        reproduces=(False,),
    )
    override_module_apply: bool = _flag(
        True,
        _stage3("gather parameters around Module.apply"),
        inert="zerosim's Module has no apply()",
        reproduces=(True,),
    )
    log_trace_cache_warnings: bool = _flag(
        False,
        _stage3("log trace-cache invalidations"),
        inert="zerosim's trace is rebuilt without warnings",
    )
    enable_sanity_checks: bool = _flag(
        False,
        "DeepSpeed's internal sanity checks",
        inert="zerosim's invariants are checked by its tests",
    )
    save_muon_momentum_buffer_in_memory: bool = _flag(
        False,
        _stage3("Muon: keep its momentum in memory when optimizer states swap to NVMe"),
        inert="zerosim's Muon never swaps its momentum (it refuses optimizer offload)",
        reproduces=(False, True),
    )
    leaf_module: LeafModuleConfig = knob(
        LeafModuleConfig(), section(LeafModuleConfig), _stage3("leaf modules; null: defaults")
    )

    @classmethod
    def normalize(cls, raw: Mapping[str, Any], path: str) -> Mapping[str, Any]:
        """Reject DeepSpeed's removed keys; rewrite its deprecated offload switches.

        ``cpu_offload: true`` → ``offload_optimizer: {device: cpu}``;
        ``cpu_offload_param: true`` → ``offload_param: {device: cpu}``. Giving a deprecated
        switch together with its replacement is an error, as in DeepSpeed.
        ``cpu_offload_use_pin_memory`` is checked and ignored: DeepSpeed no longer maps it.
        """
        for key, feature in REMOVED_ZERO_KEYS.items():
            if key in raw:
                raise ConfigError(
                    join(path, key),
                    raw[key],
                    f"nothing: DeepSpeed 0.19.8 removed {feature} and rejects this key",
                )
        raw = dict(raw)
        renames = (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param"))
        for old, new in renames:
            if raw.get(old) is None:
                raw.pop(old, None)
                continue
            on = lax_boolean()(raw.pop(old), join(path, old))
            if new in raw:
                raise ConfigError(
                    join(path, old), on, f"absent when {join(path, new)} is given (use {new})"
                )
            if on:
                raw[new] = {"device": "cpu"}
        pin = raw.pop("cpu_offload_use_pin_memory", None)
        if pin is not None:
            lax_boolean()(pin, join(path, "cpu_offload_use_pin_memory"))
        return raw

    @classmethod
    def finish(cls, values: dict[str, Any], raw: Mapping[str, Any], path: str) -> dict[str, Any]:
        stage = values["stage"]
        if raw.get("overlap_comm") is None:
            values["overlap_comm"] = stage == 3
        if not values["compute_grad_norm"] and stage not in (1, 2):
            raise ConfigError(
                join(path, "compute_grad_norm"),
                False,
                f"true unless stage is 1 or 2 (stage is {stage}), as DeepSpeed's validator says",
            )
        if values["offload_optimizer"].ratio < 1.0 and stage != 3:
            raise ConfigError(
                join(path, "offload_optimizer.ratio"),
                values["offload_optimizer"].ratio,
                f"1.0 unless stage is 3 (stage is {stage}): DeepSpeed offloads part of the "
                "optimizer only at stage 3",
            )
        if values["offload_param"].device != "none" and stage != 3:
            raise ConfigError(
                join(path, "offload_param.device"),
                values["offload_param"].device,
                f"'none' unless stage is 3 (stage is {stage}): only stage 3 partitions parameters",
            )
        if values["offload_optimizer"].device != "none" and stage == 0:
            raise ConfigError(
                join(path, "offload_optimizer.device"),
                values["offload_optimizer"].device,
                "'none' at stage 0: offload moves the optimizer partition, which needs stage >= 1",
            )
        for key in ZEROPP_KEYS:
            default = cls.__dataclass_fields__[key].default
            value = values[key]
            if key == "zero_hpz_partition_size" and value == 0:
                value = values[key] = 1  # DeepSpeed: hpZ is on for sizes > 1 only
            if stage != 3 and value != default:
                raise ConfigError(
                    join(path, key),
                    values[key],
                    f"{default!r} unless stage is 3 (stage is {stage}): ZeRO++ is built on ZeRO-3",
                )
        return values


def _fp16_integer() -> Parser:
    """DeepSpeed's fp16 loss_scale_window / min_loss_scale: an integer, never a bool, never
    a decimal string (its validator calls int() first)."""
    inner = lax_integer(from_bool=False)

    def convert(value: Any, path: str) -> int:
        if isinstance(value, str) and "." in value:
            raise ConfigError(path, value, inner.allowed)
        return inner(value, path)

    return Parser(inner.allowed, convert)


def _loss_scale() -> Parser:
    """DeepSpeed's fp16.loss_scale validator: float(value), not a bool, finite, >= 0."""
    allowed = "a finite number >= 0 (0 = dynamic scaling)"

    def convert(value: Any, path: str) -> float:
        try:
            number = None if isinstance(value, bool) else float(value)
        except (TypeError, ValueError):
            number = None
        if number is None or not math.isfinite(number) or number < 0:
            raise ConfigError(path, value, allowed)
        return number

    return Parser(allowed, convert)


# 2.0**power must be a finite, non-zero float: DeepSpeed fails at its first overflow above
# 1023 (an int too large for a float) and never trains below -1074 (a scale of 0.0).
SCALE_POWERS = (-1074, 1023)


@dataclass(frozen=True)
class FP16Config(Section):
    """``fp16``: float16 parameters and gradients, fp32 master weights, loss scaling.

    ``loss_scale`` 0 means dynamic scaling. DeepSpeed 0.19.8 always hands the scaler the five
    dynamic keys (``DeepSpeedFP16Config.dynamic_loss_scale_args``), defaults included, so
    ``"fp16": {"enabled": true}`` starts at 2**16 with hysteresis 2 at every stage; at stage 0
    its ``FP16_Optimizer`` has no hysteresis and never raises at the minimum scale.
    ``loss_scaler(stage)`` returns those settings. The window, minimum and hysteresis are
    checked only where they are used: fp16 enabled with dynamic scaling (DeepSpeed's
    validator does the same for the first two).
    """

    CLOSED: ClassVar[bool] = True

    enabled: bool = _flag(False, "train with float16 params and gradients")
    auto_cast: bool = _flag(False, "cast floating-point inputs of forward to float16")
    loss_scale: float = knob(0.0, _loss_scale(), "0: dynamic; > 0: static scale", null=NOT_NULL)
    initial_scale_power: int = knob(
        16, lax_integer(*SCALE_POWERS), "dynamic scale starts at 2**power", null=NOT_NULL
    )
    loss_scale_window: int = knob(
        1000, _fp16_integer(), "overflow-free steps before doubling", null=NOT_NULL
    )
    hysteresis: int = _count(2, None, "overflows tolerated before lowering")
    consecutive_hysteresis: bool = _flag(False, "refill hysteresis on good steps")
    min_loss_scale: int = knob(1, _fp16_integer(), "lowest dynamic scale", null=NOT_NULL)
    fp16_master_weights_and_grads: bool = _flag(
        False,
        "keep master weights and gradients in float16",
        inert="zerosim keeps float32 master weights; it would train differently",
        reproduces=(False,),
        refuse=True,
    )

    @classmethod
    def finish(cls, values: dict[str, Any], raw: Mapping[str, Any], path: str) -> dict[str, Any]:
        if values["enabled"] and values["loss_scale"] == 0:  # dynamic scaling uses these
            for key, why in (
                ("loss_scale_window", "the scale grows every this many good steps"),
                ("min_loss_scale", "the scale cannot fall to 0 or below"),
                ("hysteresis", "with 0 DeepSpeed never lowers the scale and skips every step"),
            ):
                if values[key] < 1:
                    raise ConfigError(
                        join(path, key),
                        values[key],
                        f"an integer >= 1 when fp16 is enabled with dynamic scaling ({why})",
                    )
        return values

    def loss_scaler(self, zero_stage: int) -> LossScaleSettings:
        """The scaler DeepSpeed 0.19.8 builds for this fp16 section at ``zero_stage``.

        - ``loss_scale > 0``: static scale, never changes.
        - dynamic, stages 1-3: ``DynamicLossScaler(2**initial_scale_power, loss_scale_window,
          min_loss_scale, hysteresis, consecutive_hysteresis)``, raising at the minimum.
        - dynamic, stage 0: ``FP16_Optimizer``'s own rule: the same start, window and minimum,
          no hysteresis (every overflow halves), floored at the minimum without raising.
        """
        if self.loss_scale > 0:  # static: only init_scale matters
            return LossScaleSettings(False, self.loss_scale, 1, self.loss_scale, 1, False)
        init = 2.0**self.initial_scale_power
        if zero_stage == 0:
            return LossScaleSettings(
                True, init, self.loss_scale_window, float(self.min_loss_scale), 1, False, False
            )
        return LossScaleSettings(
            True,
            init,
            self.loss_scale_window,
            float(self.min_loss_scale),
            self.hysteresis,
            self.consecutive_hysteresis,
        )


@dataclass(frozen=True)
class BF16Config(Section):
    """``bf16`` (legacy name ``bfloat16``): bfloat16 params and gradients, no loss scaling."""

    CLOSED: ClassVar[bool] = True

    enabled: bool = _flag(False, "train with bfloat16 params and gradients")
    immediate_grad_update: bool = _flag(
        False,
        "accumulate each micro-step's gradients into fp32 at once",
        inert="zerosim accumulates bfloat16 gradients as DeepSpeed's default does",
        reproduces=(False,),
    )
    check_grad_overflow: bool = _flag(
        True,
        "skip a step whose bfloat16 gradients hold inf/nan (stages 1-2: a one-byte all-reduce)",
    )
    bf16_master_weights_and_grads: bool = _flag(
        False,
        "keep master weights and gradients in bfloat16",
        inert="zerosim keeps float32 master weights; it would train differently",
        reproduces=(False,),
        refuse=True,
    )
    bf16_optimizer_states: bool = _flag(
        False,
        "keep optimizer states in bfloat16",
        inert="zerosim keeps float32 optimizer states; it would train differently",
        reproduces=(False,),
        refuse=True,
    )


@dataclass(frozen=True)
class ParallelWriteConfig(Section):
    """``checkpoint.parallel_write``: DeepSpeed's pipeline-stage checkpoint writers."""

    pipeline_stage: bool = knob(
        False,
        flag(),
        "pipeline stages write in parallel",
        null="DeepSpeed accepts only true or false",
        inert="zerosim has no pipeline parallelism",
        reproduces=(False,),
    )


_NEEDS_MAPPING = "DeepSpeed reads keys of it and fails on null"


@dataclass(frozen=True)
class CheckpointConfig(Section):
    """``checkpoint``: DeepSpeed's checkpoint switches (read with dict.get: unknown keys pass)."""

    tag_validation: str = knob(
        "WARN",
        choice("IGNORE", "WARN", "FAIL"),
        "check that every rank saves the same tag",
        null="DeepSpeed upper-cases the value and fails on null",
        inert="zerosim always checks that every rank saves the same tag and raises if not "
        "(DeepSpeed's FAIL)",
        reproduces=("FAIL",),
    )
    load_universal: bool = knob(
        False,
        flag(),
        "load a universal checkpoint",
        inert="zerosim's checkpoints load at any world size, stage and layout already; it reads "
        "its own format, not DeepSpeed's universal checkpoints",
        reproduces=(False,),
    )
    use_node_local_storage: bool = knob(
        False,
        flag(),
        "each node writes its own files",
        inert="every rank of zerosim writes its own files into one shared directory",
        reproduces=(False,),
    )
    parallel_write: ParallelWriteConfig = knob(
        ParallelWriteConfig(),
        section(ParallelWriteConfig),
        "pipeline-parallel writing",
        null=_NEEDS_MAPPING,
    )
    checkpoint_serialization: bool = knob(
        True,
        flag(),
        "torch.save's zip format",
        inert="zerosim writes its own files (NumPy arrays and JSON), not torch.save's",
        reproduces=(True,),
    )
    writer: Any = whole_section(
        "DeepSpeed's checkpoint writer (type FAST, PYTHON or MOCK; I/O buffer sizes)",
        lambda value: True,
        "zerosim writes its checkpoint files itself, one file per rank and array group",
        refuse=False,
        null=None,
    )


@dataclass(frozen=True)
class ZerosimConfig(Section):
    """``zerosim``: our own section — array backend, precision, collectives, buffer layout."""

    backend: str = knob(
        "numpy",
        choice("numpy", "cupy", "array_api_strict", "meta"),
        "array namespace; array_api_strict is the portability test (arrays on a non-host "
        "device, float32/float64 only); meta: shape-only arrays, the dry run (docs/dryrun.md)",
    )
    dtype: str = knob(
        "float32",
        choice("float64", "float32", "float16", "bfloat16"),
        "precision; float64 is the exact reference mode",
    )
    collectives: str = knob("native", choice("native", "ring"), "MPI's or explicit ring")
    layout: str = knob("deepspeed", choice("deepspeed", "megatron"), "flat buffer layout")
    schedule: str = knob(
        "deepspeed",
        choice(*SCHEDULES),
        "whose collectives: DeepSpeed 0.19.8's for these switches, the ZeRO paper's "
        "reduce-scatter schedule (zerosim/zero/schedule.py), or PyTorch FSDP2's (stage 3)",
    )
    fsdp2: Fsdp2Config = knob(
        Fsdp2Config(),
        section(Fsdp2Config),
        "schedule fsdp2: fully_shard's arguments (zerosim/config/fsdp2.py)",
        null=None,
    )
    ranks_per_node: int | None = knob(
        None, optional(integer(1)), "ranks per node for intra/inter-node bytes"
    )
    validate_collectives: bool = knob(True, boolean(), "check shapes/dtypes agree across ranks")
    quantization_block_size: int = knob(
        256, integer(1), "ZeRO++: elements per scale in qwZ and qgZ block quantization"
    )
    timeout: float = knob(
        600.0,
        number(0),
        "watchdog: seconds one wait in a collective may last before the job ends (0: never); "
        "the environment variable ZEROSIM_TIMEOUT wins",
    )
    flight_records: int = knob(64, integer(0), "flight recorder: collective calls kept per rank")
    flight_dir: str | None = knob(
        None,
        optional(text()),
        "flight recorder: folder for rank<R>.json on a timeout or an uncaught exception; "
        "the environment variable ZEROSIM_FLIGHT_DIR wins",
    )
