"""The sections of the config that are plain knobs: ZeRO, offload, fp16/bf16, checkpoint, zerosim.

Each class is a frozen dataclass; each field is one JSON key with DeepSpeed's name and the
default of DeepSpeed's current code (deepspeed/runtime/zero/config.py,
zero/offload_config.py, precision_config.py, constants.py). Rules that involve two keys of
one section live in its ``finish``; rules across sections live in ``config.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from zerosim.config.values import (
    ConfigError,
    Section,
    boolean,
    choice,
    integer,
    join,
    knob,
    number,
    optional,
    section,
    text,
)

OFFLOAD_DEVICES = ("none", "cpu", "nvme")
ZEROPP_KEYS = ("zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size")


def _check_nvme_path(values: dict[str, Any], path: str) -> None:
    if values["device"] == "nvme" and values["nvme_path"] is None:
        raise ConfigError(join(path, "nvme_path"), None, "a directory path when device is 'nvme'")


@dataclass(frozen=True)
class OffloadOptimizerConfig(Section):
    """Where the fp32 master weights and optimizer states live (ZeRO-Offload / ZeRO-Infinity)."""

    device: str = knob("none", choice(*OFFLOAD_DEVICES), "none: device memory; cpu; nvme files")
    nvme_path: str | None = knob(None, optional(text()), "directory for nvme files")
    buffer_count: int = knob(4, integer(0), "swap buffers for nvme")
    pin_memory: bool = knob(False, boolean(), "page-locked host buffers (cupy backend)")

    @classmethod
    def finish(cls, values: dict[str, Any], raw: Mapping[str, Any], path: str) -> dict[str, Any]:
        _check_nvme_path(values, path)
        return values


@dataclass(frozen=True)
class OffloadParamConfig(Section):
    """Where stage-3 parameter partitions live between uses (ZeRO-Infinity)."""

    device: str = knob("none", choice(*OFFLOAD_DEVICES), "none: device memory; cpu; nvme files")
    nvme_path: str | None = knob(None, optional(text()), "directory for nvme files")
    buffer_count: int = knob(5, integer(0), "swap buffers for nvme")
    buffer_size: int = knob(100_000_000, integer(0), "elements per swap buffer")
    max_in_cpu: int = knob(1_000_000_000, integer(0), "elements kept in host memory")
    pin_memory: bool = knob(False, boolean(), "page-locked host buffers (cupy backend)")

    @classmethod
    def finish(cls, values: dict[str, Any], raw: Mapping[str, Any], path: str) -> dict[str, Any]:
        _check_nvme_path(values, path)
        return values


def _stage3(doc: str) -> str:
    return doc + " (stage 3)"


@dataclass(frozen=True)
class ZeroConfig(Section):
    """``zero_optimization``: which ZeRO stage, bucket sizes, stage-3 fetch knobs, offload, ZeRO++.

    ``overlap_comm`` has no fixed default in DeepSpeed: its validator sets it to
    ``stage == 3`` when the key is absent, so the default is True for stage 3 only.
    """

    # Legacy keys DeepSpeed still accepts, rewritten by ``normalize``.
    LEGACY_KEYS: ClassVar[tuple[str, ...]] = (
        "cpu_offload",
        "cpu_offload_param",
        "cpu_offload_use_pin_memory",
    )

    stage: int = knob(0, integer(0, 3), "0: data parallel; 1: optimizer; 2: +gradients; 3: +params")
    contiguous_gradients: bool = knob(True, boolean(), "copy gradients into a contiguous buffer")
    overlap_comm: bool = knob(False, boolean(), "overlap reduction with backward; default stage==3")
    reduce_scatter: bool = knob(True, boolean(), "reduce gradients with reduce-scatter")
    reduce_bucket_size: int = knob(500_000_000, integer(1), "elements per gradient bucket")
    allgather_partitions: bool = knob(True, boolean(), "all-gather (vs broadcast) updated params")
    allgather_bucket_size: int = knob(500_000_000, integer(1), "elements per all-gather")
    round_robin_gradients: bool = knob(False, boolean(), "round-robin gradient copy (stage 1/2)")
    sub_group_size: int = knob(1_000_000_000, integer(1), "optimizer steps in tiles of this size")
    stage3_prefetch_bucket_size: int = knob(
        50_000_000,
        integer(0),
        _stage3("elements fetched ahead"),
        aliases=("prefetch_bucket_size",),
    )
    stage3_param_persistence_threshold: int = knob(
        100_000,
        integer(0),
        _stage3("params this small stay gathered"),
        aliases=("param_persistence_threshold",),
    )
    stage3_max_live_parameters: int = knob(
        1_000_000_000,
        integer(0),
        _stage3("most gathered elements at once"),
        aliases=("max_live_parameters",),
    )
    stage3_max_reuse_distance: int = knob(
        1_000_000_000,
        integer(0),
        _stage3("keep a param gathered if reused within"),
        aliases=("max_reuse_distance",),
    )
    stage3_gather_16bit_weights_on_model_save: bool = knob(
        False,
        boolean(),
        _stage3("consolidate 16-bit weights on save"),
        aliases=("gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"),
    )
    offload_optimizer: OffloadOptimizerConfig = knob(
        OffloadOptimizerConfig(), section(OffloadOptimizerConfig), "stage >= 1"
    )
    offload_param: OffloadParamConfig = knob(
        OffloadParamConfig(), section(OffloadParamConfig), "stage 3 only"
    )
    zero_quantized_weights: bool = knob(False, boolean(), _stage3("qwZ: int8 weight all-gather"))
    zero_quantized_gradients: bool = knob(False, boolean(), _stage3("qgZ: quantized gradients"))
    zero_hpz_partition_size: int = knob(1, integer(1), _stage3("hpZ: secondary partition size"))

    @classmethod
    def normalize(cls, raw: Mapping[str, Any], path: str) -> Mapping[str, Any]:
        """Rewrite DeepSpeed's deprecated offload switches into the offload sections.

        ``cpu_offload: true`` → ``offload_optimizer: {device: cpu}``;
        ``cpu_offload_param: true`` → ``offload_param: {device: cpu}``. Giving a deprecated
        switch together with its replacement is an error, as in DeepSpeed.
        ``cpu_offload_use_pin_memory`` is checked and ignored: DeepSpeed no longer maps it.
        """
        raw = dict(raw)
        renames = (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param"))
        for old, new in renames:
            if old not in raw:
                continue
            value = raw.pop(old)
            if value is None:
                continue
            boolean()(value, join(path, old))
            if new in raw:
                raise ConfigError(
                    join(path, old), value, f"absent when {join(path, new)} is given (use {new})"
                )
            if value:
                raw[new] = {"device": "cpu"}
        pin = raw.pop("cpu_offload_use_pin_memory", None)
        if pin is not None:
            boolean()(pin, join(path, "cpu_offload_use_pin_memory"))
        return raw

    @classmethod
    def finish(cls, values: dict[str, Any], raw: Mapping[str, Any], path: str) -> dict[str, Any]:
        stage = values["stage"]
        if raw.get("overlap_comm") is None:
            values["overlap_comm"] = stage == 3
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
            if stage != 3 and values[key] != default:
                raise ConfigError(
                    join(path, key),
                    values[key],
                    f"{default!r} unless stage is 3 (stage is {stage}): ZeRO++ is built on ZeRO-3",
                )
        return values


@dataclass(frozen=True)
class LossScaleSettings:
    """The numbers a loss scaler starts from: what DeepSpeed's scaler would be built with."""

    dynamic: bool
    init_scale: float
    scale_window: int
    min_scale: float
    hysteresis: int
    consecutive_hysteresis: bool


@dataclass(frozen=True)
class FP16Config(Section):
    """``fp16``: float16 parameters and gradients, fp32 master weights, loss scaling.

    ``loss_scale`` 0 means dynamic scaling. DeepSpeed passes the five dynamic-scaling keys
    to the scaler only when at least one of them is written in the fp16 dict
    (``get_dynamic_loss_scale_args``); otherwise the scaler keeps its own defaults.
    ``dynamic_loss_args_given`` records which case applies; ``loss_scaler`` resolves it.
    """

    DYNAMIC_KEYS: ClassVar[tuple[str, ...]] = (
        "initial_scale_power",
        "loss_scale_window",
        "hysteresis",
        "consecutive_hysteresis",
        "min_loss_scale",
    )

    enabled: bool = knob(False, boolean(), "train with float16 params and gradients")
    auto_cast: bool = knob(False, boolean(), "cast forward inputs to float16")
    loss_scale: float = knob(0.0, number(0), "0: dynamic; > 0: static scale")
    initial_scale_power: int = knob(16, integer(0, 127), "dynamic scale starts at 2**power")
    loss_scale_window: int = knob(1000, integer(1), "overflow-free steps before doubling")
    hysteresis: int = knob(2, integer(1), "overflows tolerated before lowering")
    consecutive_hysteresis: bool = knob(False, boolean(), "refill hysteresis on good steps")
    min_loss_scale: float = knob(1.0, number(0, above=True), "lowest dynamic scale")
    dynamic_loss_args_given: bool = False

    @classmethod
    def finish(cls, values: dict[str, Any], raw: Mapping[str, Any], path: str) -> dict[str, Any]:
        values["dynamic_loss_args_given"] = any(
            raw.get(key) is not None for key in cls.DYNAMIC_KEYS
        )
        return values

    def loss_scaler(self, zero_stage: int) -> LossScaleSettings:
        """The scaler DeepSpeed builds for this fp16 section at ``zero_stage``.

        - ``loss_scale > 0``: static scale, never changes.
        - dynamic, some of the five keys written: init ``2**initial_scale_power`` and the
          written/default window, hysteresis, consecutive flag and minimum.
        - dynamic, none written (DeepSpeed's quirk): window 1000, minimum 1, hysteresis 1,
          not consecutive, and the initial scale of the scaler's own default: ``2**32``
          for ZeRO stages 1-3 (``CreateLossScaler`` → ``DynamicLossScaler()``), but
          ``2**initial_scale_power`` = 2**16 at stage 0, where the engine hands
          ``FP16_Optimizer`` its ``initial_dynamic_scale``.
        """
        if self.loss_scale > 0:  # static: only init_scale matters
            return LossScaleSettings(False, self.loss_scale, 1, self.loss_scale, 1, False)
        if self.dynamic_loss_args_given:
            return LossScaleSettings(
                True,
                float(2**self.initial_scale_power),
                self.loss_scale_window,
                self.min_loss_scale,
                self.hysteresis,
                self.consecutive_hysteresis,
            )
        init = 2**self.initial_scale_power if zero_stage == 0 else 2**32
        return LossScaleSettings(True, float(init), 1000, 1.0, 1, False)

    def to_dict(self) -> dict[str, Any]:
        """The keys, leaving out the dynamic ones when none was given (keeps the quirk)."""
        result = super().to_dict()
        if not self.dynamic_loss_args_given:
            for key in self.DYNAMIC_KEYS:
                del result[key]
        return result


@dataclass(frozen=True)
class BF16Config(Section):
    """``bf16`` (legacy name ``bfloat16``): bfloat16 params and gradients, no loss scaling."""

    enabled: bool = knob(False, boolean(), "train with bfloat16 params and gradients")


@dataclass(frozen=True)
class CheckpointConfig(Section):
    """``checkpoint``: DeepSpeed's checkpoint switches that apply to zerosim."""

    tag_validation: str = knob(
        "WARN", choice("IGNORE", "WARN", "FAIL"), "check that every rank saves the same tag"
    )
    load_universal: bool = knob(False, boolean(), "load a universal checkpoint")
    use_node_local_storage: bool = knob(False, boolean(), "each node writes its own files")


@dataclass(frozen=True)
class ZerosimConfig(Section):
    """``zerosim``: our own section — array backend, precision, collectives, buffer layout."""

    backend: str = knob("numpy", choice("numpy", "cupy"), "array module")
    dtype: str = knob(
        "float32",
        choice("float64", "float32", "float16", "bfloat16"),
        "precision; float64 is the exact reference mode",
    )
    collectives: str = knob("native", choice("native", "ring"), "MPI's or explicit ring")
    layout: str = knob("deepspeed", choice("deepspeed", "megatron"), "flat buffer layout")
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
