"""The numbers the teaching commands print, as plain data: memory, volume, projection, Table 1.

Each function returns exactly what the matching ``zerosim`` command prints with ``--json``
(``memory_data`` → ``zerosim memory``, ``volume_data`` → ``zerosim volume``, ``project_data`` →
``zerosim project``), computed only by ``zerosim.analysis``, so tests and notebooks can use them
and compare them with the library. ``table1_page`` writes docs/table1.md. A new stage joins
``volume_data`` and ``project_data`` by an entry in ``analysis.stages.STAGES`` and its
collectives in ``analysis.collective_schedule``.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from zerosim import analysis
from zerosim.analysis.stages import STAGES, stage_info
from zerosim.analysis.timing import CLUSTER_KEYS
from zerosim.backend import resolve_dtype
from zerosim.config import read_config_file
from zerosim.zero.partition import chunk_numel, dim0_partition, padded_size

DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")
# DeepSpeed's names for the training precision -> the dtype of the parameters


def element_bytes(name: str, dtype: str) -> tuple[int, int]:
    """(bytes per parameter, bytes per gradient) that stage ``name`` keeps and communicates.

    The training dtype's size, except Megatron's bf16 recipe, which keeps fp32 gradients.
    """
    b = resolve_dtype(dtype).itemsize
    return b, 4 if (name == "megatron" and dtype == "bfloat16") else b


def model_states(
    name: str,
    num_params: float,
    dp: int,
    dtype: str = "float16",
    num_states: int = 2,
    **offload: str,
) -> analysis.ModelStateMemory:
    """Per-rank model states of stage ``name`` (0-3 or megatron) for a training dtype.

    float16 / bfloat16 train with fp32 master weights and fp32 states (the ZeRO paper's K = 12 for
    Adam); float32 / float64 keep no master copy and states in their own dtype.
    """
    stage_info(name)
    param_b, grad_b = element_bytes(name, dtype)
    mixed = param_b == 2
    if name == "megatron":
        if any(v != "none" for v in offload.values()):
            raise ValueError(f"offload is not part of Megatron's layout, got {offload}")
        m = 4 if mixed else param_b
        return analysis.megatron_model_states(
            num_params,
            dp,
            param_bytes=param_b,
            grad_bytes=grad_b,
            master_bytes=m,
            state_bytes=m,
            num_states=num_states,
        )
    if not mixed:
        return analysis.full_precision_model_states(
            num_params, dp, int(name), dtype_bytes=param_b, num_states=num_states, **offload
        )
    return analysis.zero_model_states(num_params, dp, int(name), num_states=num_states, **offload)


def memory_data(
    params: float,
    dp: list[int],
    stages: list[str],
    dtype: str = "float16",
    num_states: int = 2,
    offload_optimizer: str = "none",
    offload_param: str = "none",
    numels: list[int] | None = None,
    shapes: list[tuple[str, tuple[int, ...]]] | None = None,
    accumulation: int = 1,
    reduce_every_micro_batch: bool = False,
) -> dict[str, Any]:
    """Bytes per rank by category for every (N, stage); what ``zerosim memory --json`` prints.

    With a model's parameter sizes (``numels``), stage 3 counts Ψ_pad as its partition pads
    it: every parameter cut into N chunks of ceil(numel/N) (``stage3_padded_numel``). With its
    named shapes too (``shapes``) and stage 3 asked for, ``fsdp2`` adds PyTorch FSDP2's rows
    (``fsdp2_memory``, for ``accumulation`` micro-batches, reduced after the last or after
    every one); ``accumulation`` changes no other row."""
    if accumulation < 1:
        raise ValueError(f"accumulation must be >= 1 micro-batch, got {accumulation}")
    if reduce_every_micro_batch and (shapes is None or "3" not in stages):
        got = "shapes=None" if shapes is None else f"stages={stages!r}"
        raise ValueError(
            "reduce_every_micro_batch=True changes FSDP2's row only, which needs the model's "
            f"shapes and stage 3, got {got}"
        )
    offload = {"offload_optimizer": offload_optimizer, "offload_param": offload_param}
    rows = []
    for n in dp:
        for s in stages:
            psi = params if s != "3" or numels is None else stage3_padded_numel(numels, n)
            m = model_states(s, psi, n, dtype, num_states, **offload)
            rows.append({"dp": n, "stage": s, **m.as_dict(), **m.split()})
    data = {"num_params": params, "dtype": dtype, "num_states": num_states, **offload}
    if shapes is not None and "3" in stages:
        every = {"accumulation": accumulation, "reduce_every_micro_batch": reduce_every_micro_batch}
        data["fsdp2"] = [fsdp2_memory(shapes, n, dtype, num_states, **every) for n in dp]
    return {**data, "rows": rows}


def fsdp2_units(shapes: list[tuple[str, tuple[int, ...]]], world_size: int) -> list[int]:
    """S_u of each FSDP module as a torch user applies ``fully_shard``: every transformer block
    (``blocks.<i>``) in order, then the root with the rest; S_u = Σ ceil(dim0 / N) · numel / dim0
    over its parameters (``dim0_partition``)."""
    blocks: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    root = []
    for name, shape in shapes:
        parts = name.split(".")
        if parts[0] == "blocks" and len(parts) > 2:
            blocks.setdefault(parts[1], []).append((name, shape))
        else:
            root.append((name, shape))
    return [sum(dim0_partition(u, world_size).chunks) for u in [*blocks.values(), root]]


def fsdp2_memory(
    shapes: list[tuple[str, tuple[int, ...]]],
    world_size: int,
    dtype: str,
    num_states: int,
    accumulation: int = 1,
    reduce_every_micro_batch: bool = False,
) -> dict[str, Any]:
    """FSDP2's bytes per rank: the sharded parameters, which are the optimizer's weights (fp32
    under a 16-bit ``dtype``, the param_dtype; else ``dtype``), their gradient shard and K_s
    states in the same dtype, S = Σ_u S_u elements of each; ``peak_gathered_params``: the root
    gathered for the whole pass plus the largest block and the one prefetched beside it, N · b
    per element of param_dtype; ``peak_accumulated_grads``: the unsharded gradients kept between
    the k micro-batches when only the last reduce-scatters, Ψ · b in reduce_dtype (= param_dtype),
    and none with one micro-batch or ``reduce_every_micro_batch``, where each micro-batch's rows
    are added into the gradient shard."""
    b = resolve_dtype(dtype).itemsize
    shard_b = 4 if b == 2 else b
    units = fsdp2_units(shapes, world_size)
    s = sum(units)
    kept = accumulation > 1 and not reduce_every_micro_batch
    return {
        "dp": world_size,
        "padded_numel": world_size * s,
        "params": shard_b * s,
        "grads": shard_b * s,
        "optimizer_states": num_states * shard_b * s,
        "total": (2 + num_states) * shard_b * s,
        "peak_gathered_params": world_size * b * (units[-1] + 2 * max(units[:-1], default=0)),
        "accumulation": accumulation,
        "reduce_every_micro_batch": reduce_every_micro_batch,
        "peak_accumulated_grads": b * sum(math.prod(shape) for _, shape in shapes) if kept else 0,
    }


def stage3_padded_numel(numels: list[int], world_size: int) -> int:
    """Stage 3's Ψ_pad: Σ ceil(numel_i / N)·N, each parameter cut into N equal chunks (at least
    one element each)."""
    return sum(chunk_numel(m, world_size) * world_size for m in numels)


def volume_data(
    params: int,
    dp: int,
    accumulation: int = 1,
    dtype: str = "float32",
    persistent_numel: int = 0,
    reuse: bool = False,
    numels: list[int] | None = None,
    shapes: list[tuple[str, tuple[int, ...]]] | None = None,
    reduce_every_micro_batch: bool = False,
) -> dict[str, Any]:
    """Bytes one rank sends per optimizer step, by phase and stage (``zerosim volume --json``).

    ``stages``: the ZeRO paper's schedule. Ψ_pad: Ψ padded to a multiple of N (stage 3 pads each
    parameter, so a model's real Ψ_pad can be a little larger) or, for megatron, to lcm(N, 128)
    as one bucket. Stage 3 keeps ``persistent_numel`` (Ψ_persist, a multiple of N) elements whole
    on every rank and, with ``reuse``, keeps every parameter from forward to backward (no
    backward all-gather). The clip all-reduce sends 8 bytes on the first and last rank, 16 on
    the others.

    ``deepspeed``: stages 0-2 under DeepSpeed 0.19.8's schedule with its defaults, on rank 0:
    Ψ all-reduced unpadded (in 5e8-element messages), the stage 1-2 all-gather of Ψ padded to a
    multiple of 2N, and ``ratio`` = its total / the paper's. The gradients are taken as parameters
    much smaller than a bucket, so its buckets hold exactly ``reduce_bucket_size`` elements (one
    bucket when Ψ ≤ 5e8: exact for any model), unless a model's parameter sizes are given
    (``numels``, definition order): then its buckets are the model's, and stage 3's Ψ_pad is
    its parameters padded one by one (``stage3_padded_numel``); stage 3 is given by the paper's
    formula in both
    (DeepSpeed's coalesces each module's gathers into one call; with a prefetch bucket or live
    cap smaller than the model its bytes follow the module trace: docs/formulas.md).
    ``fsdp2``, given the model's named ``shapes``: PyTorch FSDP2's schedule (``_fsdp2_volume``).
    """
    b = resolve_dtype(dtype).itemsize
    stages = {}
    for s in STAGES:
        multiple = math.lcm(dp, 128) if s == "megatron" else dp
        pad = padded_size(int(params), multiple)
        if s == "3" and numels is not None:
            pad = stage3_padded_numel(numels, dp)
        stage = 1 if s == "megatron" else int(s)
        extra = {"persistent_numel": persistent_numel, "backward_gather": not reuse}
        phases = analysis.step_bytes(
            stage, dp, pad, b, accumulation, **(extra if stage == 3 else {})
        )
        stages[s] = {"padded_numel": pad, **phases, "total": sum(phases.values())}
    clip = {"end_ranks": analysis.clip_bytes(dp, 0)}
    clip["middle_ranks"] = analysis.clip_bytes(dp, 1) if dp > 2 else None
    deepspeed = _deepspeed_volume(int(params), dp, b, accumulation, stages, numels)
    return {
        **_fsdp2_volume(shapes, dp, b, accumulation, reduce_every_micro_batch),
        "num_params": params,
        "dp": dp,
        "itemsize": b,
        "accumulation": accumulation,
        "persistent_numel": persistent_numel,
        "reuse": reuse,
        "stages": stages,
        "deepspeed": deepspeed,
        "clip_bytes": clip,
    }


def _fsdp2_volume(
    shapes: list[tuple[str, tuple[int, ...]]] | None,
    dp: int,
    b: int,
    accumulation: int,
    reduce_every_micro_batch: bool = False,
) -> dict[str, dict[str, Any]]:
    """``volume_data``'s "fsdp2" row, given the model's ``shapes`` (else nothing): PyTorch FSDP2's
    schedule (``analysis.fsdp2_step_bytes``, param_dtype = reduce_dtype = the dtype of ``b``
    bytes), each parameter padded along dim 0, one all-gather per FSDP module (``fsdp2_units``)
    in forward and again in backward for the blocks, one reduce-scatter per FSDP module at the
    last micro-batch or, with ``reduce_every_micro_batch`` (torch's default when gradient sync
    stays on), at every one of the k."""
    if shapes is None:
        if reduce_every_micro_batch:
            raise ValueError(
                "reduce_every_micro_batch=True changes FSDP2's row only, which needs the "
                "model's shapes; got shapes=None"
            )
        return {}
    units = fsdp2_units(shapes, dp)
    phases = analysis.fsdp2_step_bytes(
        units, dp, b, b, accumulation, reduce_every_micro_batch=reduce_every_micro_batch
    )
    row = {"padded_numel": dp * sum(units), **phases, "total": sum(phases.values())}
    return {"fsdp2": {**row, "reduce_every_micro_batch": reduce_every_micro_batch}}


def _deepspeed_volume(
    params: int,
    dp: int,
    b: int,
    accumulation: int,
    paper: dict[str, dict[str, Any]],
    numels: list[int] | None = None,
) -> dict[str, dict[str, Any]]:
    """``volume_data``'s "deepspeed" section: stages 0-2 under DeepSpeed's schedule, the
    gradients in buckets of exactly ``reduce_bucket_size`` elements
    (``analysis.deepspeed_bucketed_step_bytes``: per bucket size, not per bucket, so any Ψ
    answers at once) or, given a model's ``numels``, in the model's own buckets
    (``analysis.step_bytes``), beside ``paper``'s totals."""
    deepspeed = {}
    for s in ("0", "1", "2"):
        if numels is None:
            phases = analysis.deepspeed_bucketed_step_bytes(int(s), dp, params, b, accumulation)
        else:
            phases = analysis.step_bytes(
                int(s), dp, 0, b, accumulation, schedule="deepspeed", numels=numels
            )
        total = sum(phases.values())
        pad = params if s == "0" else analysis.deepspeed_padded_numel(params, dp)
        paper_total = paper[s]["total"]
        deepspeed[s] = {
            "padded_numel": pad,
            **phases,
            "total": total,
            "ratio": total / paper_total if paper_total else None,
        }
    return deepspeed


def stage_collectives(
    name: str, padded_numel: int, param_bytes: int, grad_bytes: int, accumulation: int = 1
) -> list[tuple[str, int]]:
    """(op, buffer bytes S) of the collectives of one optimizer step of stage ``name``:
    ``analysis.collective_schedule`` (no persistent parameters, no reuse) with its bytes, then
    the 8-byte clip all-reduce."""
    schedule = analysis.collective_schedule(STAGES[name].stage, padded_numel, accumulation)
    calls = [
        (c.op, c.elements * (param_bytes if c.what == "params" else grad_bytes))
        for c in schedule
        if c.elements
    ]
    return [*calls, ("all_reduce", 8)]


def load_cluster(path: str | Path) -> analysis.Cluster:
    """A ``Cluster`` from JSON with its seven fields (a ``name`` or ``comment`` key is allowed).

    Read as configs are (``read_config_file``): errors name the file; a repeated key is one.
    """
    spec = read_config_file(path)
    if not isinstance(spec, dict):
        raise ValueError(f"cluster file {path}: holds a {type(spec).__name__}, not an object")
    unknown = sorted(set(spec) - set(CLUSTER_KEYS) - {"name", "comment"})
    missing = [k for k in CLUSTER_KEYS if k not in spec]
    if unknown or missing:
        raise ValueError(
            f"cluster file {path}: unknown keys {unknown}, missing keys {missing}; "
            f"expected {list(CLUSTER_KEYS)}"
        )
    return analysis.Cluster(**{k: spec[k] for k in CLUSTER_KEYS})


def project_data(
    cluster: analysis.Cluster,
    params: int,
    tokens_per_step: float,
    dtype: str = "float16",
    accumulation: int = 1,
    efficiency: float = 0.5,
    recompute: bool = False,
    model: Any = None,
) -> dict[str, Any]:
    """Step time and memory per GPU for each stage on ``cluster`` (``zerosim project --json``).

    compute = 6ΨT/N FLOPs (8ΨT/N with recomputation), or with a ``model`` description its
    family's count, (6·N_matmul + 12·l·h·s)·T/N (``analysis.transformer_flops_per_token``), at
    device_flops · efficiency; communication = the stage's collectives (``stage_collectives``)
    on the two-level α-β model.
    """
    n = cluster.world_size
    if model is None:
        flops = analysis.transformer_training_flops(params, tokens_per_step / n, recompute)
    else:
        flops = analysis.transformer_flops_per_token(model, recompute) * tokens_per_step / n
    compute = cluster.compute_time(flops, efficiency)
    out: dict[str, Any] = {"world_size": n, "compute_flops_per_device": flops, "stages": {}}
    for s in STAGES:
        pad = padded_size(int(params), math.lcm(n, 128) if s == "megatron" else n)
        memory = model_states(s, pad, n, dtype)
        calls = stage_collectives(s, pad, *element_bytes(s, dtype), accumulation)
        comm = cluster.comm_time(calls)
        out["stages"][s] = {
            "padded_numel": pad,
            "memory": memory.as_dict(),
            "collectives": calls,
            "compute_s": compute,
            "comm_s": comm,
            "step_s_no_overlap": analysis.step_time(compute, comm, overlap=False),
            "step_s_overlap": analysis.step_time(compute, comm, overlap=True),
        }
    return out


def table1_page() -> str:
    """docs/table1.md: the ZeRO paper's Table 1 and Megatron's table, generated by the code."""
    quiet = logging.getLogger("zerosim.analysis.estimators")  # it logs the rows it returns
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        ds_rows = analysis.estimate_zero3_model_states_mem_needs_all_cold(2851e6, 32e6, 8, 1)
    finally:
        quiet.setLevel(level)
    mega = ["| param, grad dtype | non-distributed | distributed (d ranks) |", "|---|---|---|"]
    for r in analysis.megatron_table():
        mega.append(
            f"| {r.param_dtype}, {r.grad_dtype} | {r.non_distributed} | "
            f"{r.replicated} + {r.sharded}/d |"
        )
    return "\n".join(
        [
            "# The ZeRO paper's Table 1 and Megatron's table, from the code",
            "",
            "Generated by `zerosim memory --table1` (`zerosim.report.tables.table1_page`); a test",
            "holds this page equal to what the code prints. Run `python docs/make_figures.py` to",
            "regenerate it with the figures.",
            "",
            "## ZeRO, Table 1: per-device model-state memory (GB = 10^9 bytes)",
            "",
            "Mixed-precision Adam, K = 12 bytes of optimizer state per parameter: P_os (stage 1)",
            "4Ψ + KΨ/N, P_os+g (stage 2) 2Ψ + (2 + K)Ψ/N, P_os+g+p (stage 3) (4 + K)Ψ/N",
            "(`analysis.zero_paper_bytes`), printed as the paper prints them",
            "(`analysis.format_paper_gb`: values ≥ 100 truncated, others to three figures).",
            "",
            analysis.table1_markdown(),
            "",
            "## Megatron-LM's distributed optimizer: bytes per parameter",
            "",
            "From `analysis.megatron_model_states` with d = 1 (non-distributed) and the split",
            "into what every rank keeps whole and what is sharded over d ranks",
            "(`analysis.megatron_table`).",
            "",
            *mega,
            "",
            "## DeepSpeed's ZeRO-3 estimator, its reference example",
            "",
            "`analysis.estimate_zero3_model_states_mem_needs_all_cold(2851e6, 32e6, 8, 1)`: a",
            "2.851B-parameter model whose largest layer has 32M parameters, one node of 8 GPUs",
            "(GiB = 2^30 bytes; docs/formulas.md explains where it differs from the exact count).",
            "",
            "```",
            analysis.format_estimates(ds_rows),
            "```",
            "",
        ]
    )


# GPT shapes for ``zerosim project --model``: (n_layer, n_embd, vocab_size, block_size).
GPT_PRESETS = {
    "gpt2": (12, 768, 50257, 1024),
    "gpt2-medium": (24, 1024, 50257, 1024),
    "gpt2-large": (36, 1280, 50257, 1024),
    "gpt2-xl": (48, 1600, 50257, 1024),
    "gpt-7b": (32, 4096, 32000, 4096),
    "gpt-13b": (40, 5120, 32000, 4096),
}


def gpt_params(n_layer: int, n_embd: int, vocab_size: int, block_size: int) -> int:
    """Ψ of ``zerosim.nn.GPT`` (biases on, untied head): its description's count, per block
    12d² + 13d (two LayerNorms 4d, c_attn 3d² + 3d, c_proj d² + d, MLP 8d² + 5d), plus the
    token and position embeddings (V + T)·d, the final LayerNorm 2d and the LM head V·d."""
    return gpt_description(n_layer, n_embd, vocab_size, block_size).num_parameters()


def gpt_description(n_layer: int, n_embd: int, vocab_size: int, block_size: int) -> Any:
    """The description of ``zerosim project``'s untied GPT, with one head (the number of heads
    changes neither the parameters nor the FLOPs)."""
    from zerosim.nn import GPT

    return GPT.description(vocab_size, block_size, n_layer, 1, n_embd)


def model_description(spec: str) -> Any:
    """The ``ModelDescription`` of a ``--model`` value: a GPT preset name,
    ``gpt:n_layer,n_embd,vocab_size,block_size``, a ``zerosim.nn.PRESETS`` name, its ``-tiny``,
    or a JSON/hjson file; a ValueError naming the allowed forms otherwise."""
    from zerosim.nn import PRESETS, describe

    if spec in GPT_PRESETS:
        return gpt_description(*GPT_PRESETS[spec])
    if spec.startswith("gpt:"):
        parts = spec[4:].split(",")
        if len(parts) == 4 and all(p.strip().isdigit() and int(p) > 0 for p in parts):
            return gpt_description(*(int(p) for p in parts))
    if spec in PRESETS or spec.removesuffix("-tiny") in PRESETS or Path(spec).is_file():
        return describe(spec)  # a bad file: its own message
    raise ValueError(
        f"--model {spec!r} is not a model; allowed: {sorted(GPT_PRESETS)}, "
        "gpt:n_layer,n_embd,vocab_size,block_size with positive integers, a model preset "
        f"({', '.join(sorted(PRESETS))}, each also as NAME-tiny) or a model-description file"
    )


def model_params(spec: str) -> int:
    """Ψ of a ``--model`` value (``model_description``): its description's parameter count."""
    return model_description(spec).num_parameters()
