"""Rules across sections: combinations of keys that DeepSpeed (its parser or
``deepspeed.initialize``) or zerosim refuses, or where one key makes another do nothing.

Rules inside one section live in that section's ``finish`` (``sections.py``); ``load_config``
(``load.py``) calls these once every section is read.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from typing import Any

from zerosim.config.features import check_features
from zerosim.config.fsdp2 import check_fsdp2
from zerosim.config.optimizer import (
    DEEPSPEED_SCHEDULERS,
    ZERO_SUPPORTED_OPTIMIZERS,
    check_whole_parameter_rules,
)
from zerosim.config.top_level import Config
from zerosim.errors import ConfigError


def check_consistency(cfg: Config) -> None:
    """Rules across sections: combinations that do not exist in DeepSpeed or in zerosim."""
    zero, sim, n = cfg.zero_optimization, cfg.zerosim, cfg.world_size
    if cfg.fp16.enabled and cfg.bf16.enabled:
        raise ConfigError("bf16.enabled", True, "false when fp16.enabled is true (one 16-bit mode)")
    check_fsdp2(cfg)  # before the others: it names the fsdp2 key that refuses a section
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


def check_data_parallel_size(cfg: Config, raw: Mapping[str, Any]) -> None:
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


def check_sum_scaling(cfg: Config) -> None:
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
