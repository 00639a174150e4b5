"""DeepSpeed's model-state memory estimators, re-derived, and how they differ from the exact model.

These reproduce the formulas in DeepSpeed's current code (``deepspeed/runtime/zero/
stage_1_and_2.py`` and ``stage3.py``, functions ``estimate_zero{2,3}_model_states_mem_needs``),
not its older docs. Ψ = total_params, L = largest_layer_params, g = GPUs per node, M = nodes,
N = g·M, f = additional_buffer_factor (1.5). Bytes; ``int()`` as DeepSpeed truncates.

ZeRO-2 (stage 1 uses the same estimate):
    offload optimizer:  gpu = 2Ψ                     cpu = Ψ·max(4N, 16)·f
    no offload:         gpu = 2Ψ + int(18Ψ/N)        cpu = Ψ·4g·f
        (18 = 2 16-bit grads + 4 fp32 grads + 4 fp32 params + 8 Adam states;
         DeepSpeed's docs still show the older 4Ψ + 16Ψ/N)

ZeRO-3, with largest_layer_memory = 4L (16-bit params and grads of the largest layer, gathered):
    offload params + optimizer:  gpu = 4L                 cpu = 18Ψ/M·f      (no zero.Init:
                                                                         Ψ·max(4g, 18/M)·f)
    offload optimizer only:      gpu = 4L + int(2Ψ/N)     cpu = 16Ψ/M·f      (Ψ·max(4g, 16/M)·f)
    no offload:                  gpu = 4L + int(18Ψ/N)    cpu = 4L·g·f       (Ψ·4g·f)
        (16 = fp32 param, grad, momentum, variance; 18 = 16 + the 2-byte 16-bit param)

DeepSpeed's ``cpu`` is per node (its ``4g`` terms are the g processes of a node each building the
model in fp32 on the host before ZeRO moves it); ``gpu`` is per device. The ``_all_cold`` variants
return every offload combination in DeepSpeed's order; :func:`format_estimates` prints them as
DeepSpeed does (GiB = 2**30 bytes, two decimals).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from zerosim.analysis.memory import zero_model_states

logger = logging.getLogger(__name__)

GIB = 2**30


def _check(
    total_params: float,
    num_gpus_per_node: int,
    num_nodes: int,
    additional_buffer_factor: float,
    largest_layer_params: float = 0,
) -> None:
    for name, value in (
        ("total_params", total_params),
        ("largest_layer_params", largest_layer_params),
    ):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")
    for name, value in (("num_gpus_per_node", num_gpus_per_node), ("num_nodes", num_nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if not additional_buffer_factor > 0:
        raise ValueError(f"additional_buffer_factor must be > 0, got {additional_buffer_factor!r}")


def estimate_zero2_model_states_mem_needs(
    total_params: float,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int]:
    """(cpu bytes per node, gpu bytes per device) for ZeRO-2, as DeepSpeed's estimator computes."""
    _check(total_params, num_gpus_per_node, num_nodes, additional_buffer_factor)
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu = 2 * total_params
        cpu = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu = 2 * total_params + int(18 * total_params / total_gpus)
        cpu = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu)


def estimate_zero3_model_states_mem_needs(
    total_params: float,
    largest_layer_params: float,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int, float]:
    """(cpu bytes per node, gpu bytes per device, largest_layer_memory) for ZeRO-3, as DeepSpeed.

    DeepSpeed's function returns the three values; the third is 4·largest_layer_params.
    ``cpu_offload_params`` only counts when ``cpu_offload`` is on (as in DeepSpeed).
    """
    _check(
        total_params, num_gpus_per_node, num_nodes, additional_buffer_factor, largest_layer_params
    )
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    f, g = additional_buffer_factor, num_gpus_per_node
    if cpu_offload and cpu_offload_params:
        gpu = largest_layer_memory
        per_param = 18 * gpus_factor if zero_init else max(4 * g, 18 * gpus_factor)
        cpu = total_params * per_param * f
    elif cpu_offload:
        gpu = largest_layer_memory + int(2 * total_params / total_gpus)
        per_param = 16 * gpus_factor if zero_init else max(4 * g, 16 * gpus_factor)
        cpu = total_params * per_param * f
    else:
        gpu = largest_layer_memory + int(18 * total_params / total_gpus)
        cpu = (largest_layer_params if zero_init else total_params) * 4 * g * f
    return int(cpu), int(gpu), largest_layer_memory


@dataclass(frozen=True)
class EstimateRow:
    """One line of an ``_all_cold`` table."""

    cpu_bytes: int
    gpu_bytes: int
    offload_optimizer: str
    offload_param: str | None  # None for ZeRO-2 (no such option)
    zero_init: bool | None  # None for ZeRO-2

    def options(self) -> str:
        parts = [] if self.offload_param is None else [f"offload_param={self.offload_param:4}"]
        parts.append(f"offload_optimizer={self.offload_optimizer:4}")
        if self.zero_init is not None:
            parts.append(f"zero_init={int(self.zero_init)}")
        return ", ".join(parts)


def estimate_zero2_model_states_mem_needs_all_cold(
    total_params: float,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> list[EstimateRow]:
    """ZeRO-2 estimates with and without optimizer offload (DeepSpeed's order); logged at INFO."""
    rows = []
    for offload in (True, False):
        cpu, gpu = estimate_zero2_model_states_mem_needs(
            total_params, num_gpus_per_node, num_nodes, offload, additional_buffer_factor
        )
        rows.append(EstimateRow(cpu, gpu, "cpu" if offload else "none", None, None))
    logger.info("%s", format_estimates(rows))
    return rows


def estimate_zero3_model_states_mem_needs_all_cold(
    total_params: float,
    largest_layer_params: float,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> list[EstimateRow]:
    """ZeRO-3 estimates for the six offload / zero.Init combinations, in DeepSpeed's order."""
    rows = []
    for cpu_offload, offload_params in ((True, True), (True, False), (False, False)):
        for zero_init in (True, False):
            cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
                total_params,
                largest_layer_params,
                num_gpus_per_node,
                num_nodes,
                cpu_offload,
                offload_params,
                zero_init,
                additional_buffer_factor,
            )
            rows.append(
                EstimateRow(
                    cpu,
                    gpu,
                    "cpu" if cpu_offload else "none",
                    "cpu" if offload_params else "none",
                    zero_init,
                )
            )
    logger.info("%s", format_estimates(rows))
    return rows


def format_estimates(rows: list[EstimateRow]) -> str:
    """The rows as DeepSpeed prints them: ``cpu GiB | gpu GiB | options``, two decimals."""
    lines = ["  per CPU  |  per GPU |   Options"]
    lines += [
        f" {r.cpu_bytes / GIB:7.2f}GB | {r.gpu_bytes / GIB:6.2f}GB | {r.options()}" for r in rows
    ]
    return "\n".join(lines)


@dataclass(frozen=True)
class Difference:
    """One reason why DeepSpeed's estimate and the exact model differ, with its size in bytes."""

    name: str
    bytes: float
    reason: str


@dataclass(frozen=True)
class Comparison:
    """DeepSpeed's estimate beside the exact per-category model: deepspeed = exact + Σ terms."""

    quantity: str
    deepspeed: int
    exact: float
    terms: tuple[Difference, ...]


def compare_with_exact(
    total_params: float,
    largest_layer_params: float = 0,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    stage: int = 3,
    cpu_offload: bool = False,
    cpu_offload_params: bool = False,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> list[Comparison]:
    """DeepSpeed's ZeRO-2/3 estimate next to :func:`zero_model_states` (mixed-precision Adam).

    Returns two comparisons, device bytes per GPU and host bytes per node, each split into terms
    that add up exactly: the largest-layer working memory (4L, stage 3), the fp32 gradient copy
    DeepSpeed counts (its 18 bytes per parameter against the paper's 16), gradients that DeepSpeed's
    offload moves to the host, host copies made while the model is built, the buffer factor, and
    int() truncation.
    """
    if stage not in (2, 3):
        raise ValueError(f"stage must be 2 or 3 (DeepSpeed's estimators), got {stage!r}")
    psi, big, g, m = total_params, largest_layer_params, num_gpus_per_node, num_nodes
    n = g * m
    offload_params = cpu_offload and cpu_offload_params and stage == 3
    exact = zero_model_states(
        psi,
        n,
        stage,
        offload_optimizer="cpu" if cpu_offload else "none",
        offload_param="cpu" if offload_params else "none",
    ).split()
    f = additional_buffer_factor
    if stage == 3:
        args = (psi, big, g, m, cpu_offload, cpu_offload_params, zero_init)
        ds_cpu, ds_gpu, _ = estimate_zero3_model_states_mem_needs(*args, f)
        base_cpu = estimate_zero3_model_states_mem_needs(*args, 1.0)[0]
    else:
        ds_cpu, ds_gpu = estimate_zero2_model_states_mem_needs(psi, g, m, cpu_offload, f)
        base_cpu = estimate_zero2_model_states_mem_needs(psi, g, m, cpu_offload, 1.0)[0]

    gpu_terms = _device_terms(stage, psi, big, n, cpu_offload)
    truncation = ds_gpu - exact["device"] - sum(t.bytes for t in gpu_terms)
    if truncation:
        gpu_terms.append(Difference("truncation", truncation, "DeepSpeed's int()"))

    exact_host = g * exact["host"]
    why = _host_difference(stage, g, cpu_offload, zero_init)
    cpu_terms = (
        Difference("host content", base_cpu - exact_host, why),
        Difference(
            "buffer factor",
            ds_cpu - base_cpu,
            f"additional_buffer_factor={f}: a safety margin, and int()",
        ),
    )
    return [
        Comparison("gpu bytes per device", ds_gpu, exact["device"], tuple(gpu_terms)),
        Comparison("cpu bytes per node", ds_cpu, exact_host, cpu_terms),
    ]


def _device_terms(
    stage: int, psi: float, big: float, n: int, cpu_offload: bool
) -> list[Difference]:
    """What DeepSpeed counts on the device beyond the exact model: the largest layer's working
    memory (stage 3) and the fp32 gradients, or less: the gradients its offload streams away."""
    terms = []
    if stage == 3:
        terms.append(
            Difference(
                "largest layer",
                4 * big,
                "4·L: the gathered 16-bit params "
                "and grads of the largest layer, working memory that is "
                "not a model state",
            )
        )
    if cpu_offload:
        terms.append(
            Difference(
                "gradient partition",
                -2 * psi / n,
                "DeepSpeed's offload "
                "streams gradients to the host; the exact model keeps the "
                "16-bit gradient partition 2Ψ/N on the device",
            )
        )
    else:
        fp32_grads = 2 * psi / n if stage == 3 else 4 * psi / n
        terms.append(
            Difference(
                "fp32 gradients",
                fp32_grads,
                "DeepSpeed counts 18 bytes per "
                "partitioned parameter (fp32 grads); the paper 16Ψ/N (stage 3)"
                " or 14Ψ/N (stage 2) with 16-bit grads",
            )
        )
    return terms


def _host_difference(stage: int, g: int, cpu_offload: bool, zero_init: bool) -> str:
    """Why DeepSpeed's host bytes per node differ from the exact model's."""
    if not cpu_offload:
        what = "the largest layer" if (stage == 3 and zero_init) else "the whole model"
        return (
            f"initialisation: each of the {g} processes of a node builds {what} in fp32 on "
            "the host (4 bytes/param) before moving it; the exact model keeps no host states"
        )
    if stage == 2:
        return (
            "Ψ·max(4N, 16): the whole model's fp32 param, grad and Adam states (16Ψ), or N fp32 "
            "copies while loading, per node; the exact model holds 12Ψ/N per rank (12Ψ/M per "
            "node)"
        )
    return (
        "DeepSpeed counts fp32 param, grad, momentum, variance (16 bytes) for the node's "
        "share Ψ/M, plus 2 for 16-bit params when they are offloaded; the exact model has "
        "no fp32 grad copy (12, +2). Without zero.Init: max(4g, …), the g fp32 loads"
    )


def format_comparison(comparisons: list[Comparison]) -> str:
    """The comparison as text, GiB with two decimals."""
    lines = []
    for c in comparisons:
        lines.append(
            f"{c.quantity}: DeepSpeed {c.deepspeed / GIB:.2f} GiB, exact {c.exact / GIB:.2f} GiB"
        )
        lines += [f"  {t.bytes / GIB:+.3f} GiB  {t.name}: {t.reason}" for t in c.terms]
    return "\n".join(lines)
