"""``zerosim.fsdp2``: the knobs of PyTorch FSDP2's schedule (``zerosim.schedule: "fsdp2"``), named
as torch names them, and the rules that tie it to the rest of the config.

Each knob is an argument of torch's ``fully_shard`` or ``MixedPrecisionPolicy``, or a setter a
torch user calls on the model (``set_reshard_after_backward``). What FSDP2 does not have, or
keeps elsewhere, is refused with schedule fsdp2: the DeepSpeed mixed-precision sections (FSDP2
keeps the sharded parameters in their own dtype and casts at the all-gather: ``param_dtype``),
offload, ZeRO++ and DeepSpeed's gradient scaling keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerosim.config.values import Parser, Section, as_integer, boolean, choice, integer, knob
from zerosim.errors import ConfigError

FSDP2_DTYPES = ("float32", "bfloat16")  # MixedPrecisionPolicy dtypes zerosim builds


def _reshard_value() -> Parser:
    """true, false, or an integer ≥ 1 (reshard to groups of that many ranks)."""
    allowed = "true, false, or an integer >= 1 (a divisor of the shard group's size)"

    def convert(value: Any, path: str) -> bool | int:
        if isinstance(value, bool):
            return value
        result = as_integer(value)
        if result is None or result < 1:
            raise ConfigError(path, value, allowed)
        return result

    return Parser(allowed, convert)


def _dtype_or_null() -> Parser:
    names = choice(*FSDP2_DTYPES)

    def convert(value: Any, path: str) -> str | None:
        return None if value is None else names(value, path)

    return Parser(f"null or {names.allowed}", convert)


@dataclass(frozen=True)
class Fsdp2Config(Section):
    """``zerosim.fsdp2``: how ``fully_shard`` is applied (read only with schedule fsdp2)."""

    reshard_after_forward: Any = knob(
        True,
        _reshard_value(),
        "fully_shard(reshard_after_forward=): free a block's gathered parameters after its "
        "forward (true), keep them until backward (false), or keep a copy sharded over groups "
        "of this many ranks (an integer)",
    )
    param_dtype: str | None = knob(
        None,
        _dtype_or_null(),
        "MixedPrecisionPolicy.param_dtype: dtype of the all-gather and of the computation "
        "(null: the parameters' own dtype)",
        null=None,
    )
    reduce_dtype: str | None = knob(
        None,
        _dtype_or_null(),
        "MixedPrecisionPolicy.reduce_dtype: dtype of the gradient reduce-scatter "
        "(null: param_dtype)",
        null=None,
    )
    replicate: int = knob(
        1, integer(1), "HSDP: replica groups, mesh [replicate, N / replicate]; 1 = plain FSDP"
    )
    reshard_after_backward: bool = knob(
        True,
        boolean(),
        "false: keep parameters gathered between accumulation micro-batches "
        "(torch: set_reshard_after_backward(False))",
    )
    reduce_every_micro_batch: bool = knob(
        False,
        boolean(),
        "true: reduce-scatter each FSDP module's gradients after every micro-batch's backward "
        "(torch's default, and FSDP1's as Composer runs it); false: sum them unsharded and "
        "reduce at the last micro-batch (set_requires_gradient_sync(False) before the others)",
    )
    units: str = knob(
        "blocks",
        choice("blocks"),
        "fully_shard each transformer block (each child of model.blocks, or of model.layers "
        "that has parameters), then the root",
    )


def check_fsdp2(cfg: Any) -> None:
    """The rules of schedule fsdp2 across sections, as FSDP2 (or zerosim's build of it) has them."""
    if cfg.zerosim.schedule != "fsdp2":
        return
    zero, sim, n = cfg.zero_optimization, cfg.zerosim, cfg.world_size
    if zero.stage != 3:
        raise ConfigError(
            "zero_optimization.stage",
            zero.stage,
            "3 with zerosim.schedule 'fsdp2' (FSDP2 is ZeRO-3)",
        )
    for key in ("bf16", "fp16"):
        if getattr(cfg, key).enabled:
            raise ConfigError(
                f"{key}.enabled",
                True,
                "false with zerosim.schedule 'fsdp2': FSDP2 keeps the sharded parameters in their "
                "own dtype and casts at the all-gather; use zerosim.fsdp2.param_dtype",
            )
    refused = {
        "zero_optimization.offload_optimizer.device": (zero.offload_optimizer.device, "none"),
        "zero_optimization.offload_param.device": (zero.offload_param.device, "none"),
        "zero_optimization.zero_quantized_weights": (zero.zero_quantized_weights, False),
        "zero_optimization.zero_quantized_gradients": (zero.zero_quantized_gradients, False),
        "zero_optimization.zero_hpz_partition_size": (zero.zero_hpz_partition_size, 1),
        "zerosim.layout": (sim.layout, "deepspeed"),
        "communication_data_type": (cfg.communication_data_type, None),
        "prescale_gradients": (cfg.prescale_gradients, False),
        "gradient_predivide_factor": (cfg.gradient_predivide_factor, 1.0),
        "gradient_allreduce_op": (cfg.gradient_allreduce_op, "mean"),
    }
    for key, (value, allowed) in refused.items():
        if value != allowed:
            raise ConfigError(
                key,
                value,
                f"{allowed!r} with zerosim.schedule 'fsdp2' (FSDP2 has no such switch: the "
                "gradient dtype is zerosim.fsdp2.reduce_dtype, gradients are averaged)",
            )
    check_mesh(sim.fsdp2, n)


def check_mesh(fsdp2: Fsdp2Config, world_size: int) -> None:
    """The mesh [replicate, shard] and what is resharded after forward fit the world size."""
    if world_size % fsdp2.replicate:
        raise ConfigError(
            "zerosim.fsdp2.replicate", fsdp2.replicate, f"a divisor of world_size {world_size}"
        )
    shard = world_size // fsdp2.replicate
    after = fsdp2.reshard_after_forward
    if not isinstance(after, bool) and shard % after:
        raise ConfigError(
            "zerosim.fsdp2.reshard_after_forward",
            after,
            f"true, false or a divisor of the shard group's size {shard} (torch's rule)",
        )
