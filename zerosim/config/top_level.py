"""``Config``: the whole config, one field per DeepSpeed top-level key.

Each section is a dataclass of its own (``sections.py``, ``optimizer.py``; the keys of DeepSpeed's
features zerosim does not build in ``features.py``). Build a ``Config`` with ``load_config``
(``load.py``), which reads and checks the raw dict first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerosim.backend import PRECISION_DTYPES
from zerosim.config.features import DeepSpeedFeatures
from zerosim.config.optimizer import OptimizerConfig, SchedulerConfig
from zerosim.config.sections import (
    BF16Config,
    CheckpointConfig,
    FP16Config,
    LossScaleSettings,
    ZeroConfig,
    ZerosimConfig,
)
from zerosim.config.values import (
    Parser,
    any_value,
    choice,
    flag,
    integer,
    knob,
    knobs_to_dict,
    number,
    optional,
    section,
)

COMMUNICATION_DTYPES = PRECISION_DTYPES  # communication_data_type's values
# gradient_allreduce_op's values (DeepSpeed's GRADIENT_ALLREDUCE_OP_SUPPORTED, read in any case)
GRADIENT_ALLREDUCE_OPS = ("mean", "sum")
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
