"""Published training runs the dry run's time model is held to: each figure, its source, and the
config that reproduces the run (docs/dryrun.md gives every source and assumption). Each source is
a folder of ``examples/published/`` holding its rows, with each row's address and quoted line,
its FLOP convention and its config (the folder's README.md); this module reads them.

**Narayanan et al., SC21, Table 2** (``narayanan2021/table2_zero3.csv``; "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", arXiv 2104.04473, §5.2): their
174.6B and 529.6B GPTs trained with ZeRO-3 and no model parallelism on Selene, model TFLOP/s per
GPU counting the recomputation (eq. 3). One row, named before the others were predicted
(``fitted``), fixes the one software factor of (Selene, DeepSpeed ZeRO-3); the rest are
predictions.

**Wang et al. 2023, ZeRO++** (``zeropp/figures.csv``): ZeRO-3 and ZeRO++ on 384 V100s, TFLOP/s
per GPU as printed on the bars of the ZeRO++ blog's Figures 6-8; one named row fitted likewise.

**MosaicML llm-foundry**, ``scripts/train/benchmarking/README.md``: MPT models 125M-70B trained
with PyTorch FSDP on 8-128 A100s (80 GB and 40 GB, 1600 Gb/s RoCE between nodes), 139 rows kept
cell for cell in ``examples/published/llm_foundry/a100.csv`` with their source and FLOP
convention beside them (``read_sweep``); ``llm_foundry_recipe`` and ``llm_foundry_config`` run
a row as Composer ran it (the README's rules, Composer's train metrics included).

``fit_software_factor`` fits a source's one factor on its named row.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from zerosim import meta
from zerosim.analysis.presets import GPTShape
from zerosim.dryrun.run import ModelRecipe
from zerosim.dryrun.timeline import ClusterModel
from zerosim.nn import PRESETS, CrossEntropyLoss, ModelDescription, Transformer

PUBLISHED = Path(__file__).resolve().parents[2] / "examples" / "published"
NARAYANAN_CSV = PUBLISHED / "narayanan2021" / "table2_zero3.csv"
ZEROPP_CSV = PUBLISHED / "zeropp" / "figures.csv"
LLM_FOUNDRY_CSV = PUBLISHED / "llm_foundry" / "a100.csv"


class TableRow(NamedTuple):
    """One ZeRO-3 row of Narayanan et al.'s Table 2."""

    model: str  # a preset name (``analysis.presets.PRESETS``)
    gpus: int
    micro_batch: int
    batch: int  # global batch
    tflops: float  # published model TFLOP/s per GPU
    fitted: bool  # the one row the software factor of (Selene, DeepSpeed) is fitted on


def read_rows(path: str | Path) -> list[dict[str, str]]:
    """A published source's rows as the CSV has them (every column a string)."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def narayanan_table2(path: str | Path = NARAYANAN_CSV) -> list[TableRow]:
    """Table 2's six ZeRO-3 rows. 640 GPUs and batch 2560 for the 529.6B model at micro-batch
    4: it did not fit on 560 GPUs (Table 2's caption, the row marked *)."""
    return [
        TableRow(
            r["model"],
            int(r["gpus"]),
            int(r["micro_batch"]),
            int(r["global_batch"]),
            float(r["tflops_per_gpu"]),
            r["fitted"] == "True",
        )
        for r in read_rows(path)
    ]


NARAYANAN_TABLE2 = narayanan_table2()

ZEROPP_GPUS = 384
ZEROPP_GPUS_PER_NODE = 16


def zeropp_published(path: str | Path = ZEROPP_CSV) -> list[tuple]:
    """The ZeRO++ blog's bars as (figure, inter-node Gb/s per node, tokens per GPU, model,
    ZeRO-3, ZeRO++) TFLOP/s per GPU, in the file's order. Figure 6: 4 × 100 Gb/s InfiniBand per
    node; Figure 7: 1 × 100 Gb/s; Figure 8: 2K tokens at 200 and 800 Gb/s."""
    bars: dict[tuple, dict[str, int]] = {}
    for r in read_rows(path):
        key = (r["figure"], int(r["inter_gbps_per_node"]), int(r["tokens_per_gpu"]), r["model"])
        bars.setdefault(key, {})[r["scheme"]] = int(r["tflops_per_gpu"])
    return [(*key, v["ZeRO-3"], v["ZeRO++"]) for key, v in bars.items()]


ZEROPP_PUBLISHED = zeropp_published()


def zeropp_shapes() -> dict[str, GPTShape]:
    """The ZeRO++ model sizes whose shape is published: the 18B of the ZeRO++ tutorial (DeepSpeed
    docs/_tutorials/zeropp.md: 40 layers, hidden 6144, 32 heads, sequence 512), with GPT-2's
    vocabulary as Megatron pads it (50,257 to a multiple of 128: 50,304), tied as Megatron's GPT
    ties it. No source found gives the 49B, 91B and 138B shapes."""
    return {"18B": GPTShape(40, 6144, 32, vocab=50304, seq=512)}


def zeropp_config(micro: int, zeropp: bool) -> dict[str, Any]:
    """The ZeRO++ tutorial's config (fp16, stage 3, 10M-element buckets, overlap_comm), with its
    three switches on (ZeRO++) or off (the ZeRO-3 baseline); nodes of 16 ranks."""
    zero: dict[str, Any] = {
        "stage": 3,
        "reduce_bucket_size": 10_000_000,
        "reduce_scatter": True,
        "contiguous_gradients": True,
        "overlap_comm": True,
    }
    if zeropp:
        zero |= {
            "zero_quantized_weights": True,
            "zero_hpz_partition_size": ZEROPP_GPUS_PER_NODE,
            "zero_quantized_gradients": True,
        }
    return {
        "train_micro_batch_size_per_gpu": micro,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
        "fp16": {"enabled": True},
        "zerosim": {"ranks_per_node": ZEROPP_GPUS_PER_NODE},
        "steps_per_print": 10**9,
    }


class SweepRow(NamedTuple):
    """One row of llm-foundry's A100 throughput tables (``examples/published/llm_foundry/``)."""

    line: int  # the row's line in the source file
    model: str  # a preset name: ``mpt-7b`` for the table's ``7b``
    seq: int
    gpus: int
    gpu: str  # ``a100_80gb`` or ``a100_40gb``
    micro_batch: int  # sequences per GPU per micro-batch
    grad_accum: int  # micro-batches per optimizer step
    global_batch: int  # sequences per optimizer step
    tokens_per_s: int  # the whole cluster's
    mfu: float  # per cent, model FLOPs (6·N + 12·L·d·s per token) over 312 TFLOP/s per GPU
    precision: str  # Composer's ``precision``: ``bf16`` or ``amp_bf16``
    mixed_precision: str  # Composer FSDP: PURE reduces in bf16, DEFAULT in fp32
    sharding: str  # FSDP's sharding strategy: FULL_SHARD (ZeRO-3) or SHARD_GRAD_OP (ZeRO-2)
    recompute: bool  # activation checkpointing
    num_params: int  # as printed: the position table (``seq`` rows) and tied embedding included


def read_sweep(path: str | Path) -> list[SweepRow]:
    """The rows of a published sweep kept as CSV with the source's own column names."""
    with open(path, newline="") as f:
        return [
            SweepRow(
                int(r["line"]),
                f"mpt-{r['Model']}",
                int(r["SeqLen (T)"]),
                int(r["# GPUs"]),
                r["GPU"],
                int(r["MicroBatchSize"]),
                int(r["GradAccum"]),
                int(r["GlobalBatchSize"]),
                int(r["Throughput (T/s)"]),
                float(r["MFU"]),
                r["Precision"],
                r["MP Mode"],
                r["Sharding Strategy"],
                r["Activation Checkpointing"] == "True",
                int(r["NumParams"]),
            )
            for r in csv.DictReader(f)
        ]


def fit_software_factor(
    throughput: Callable[[ClusterModel], float], published: float, base: ClusterModel
) -> float:
    """The software factor at which ``throughput`` (a predicted rate: TFLOP/s or MFU, growing
    with the factor) equals ``published``, by bisection on its logarithm; 1 if even the
    roofline falls short of it. The one fitted number per (cluster, software): docs/dryrun.md."""
    if throughput(base.with_software_factor(1.0)) <= published:
        return 1.0
    lo, hi = math.log(1e-3), 0.0
    for _ in range(50):
        mid = (lo + hi) / 2
        below = throughput(base.with_software_factor(math.exp(mid))) < published
        lo, hi = (mid, hi) if below else (lo, mid)
    return math.exp((lo + hi) / 2)


# --- llm-foundry: a row run as Composer ran it (the README's rules) ---------------------------

A100_PEAK = 312e12  # the tables' GPU_AVAILABLE_FLOPS for an A100 in bf16
# What Composer's trainer updates after every micro-batch's backward for llm-foundry's MPT
# (``ComposerMPTCausalLM``'s ``train_metrics``; zerosim.nn.metrics)
COMPOSER_TRAIN_METRICS = ("LanguageCrossEntropy", "LanguagePerplexity")
# Composer's fsdp_config.mixed_precision → (param_dtype, reduce_dtype): the gather's dtype and
# the reduce-scatter's
MIXED_PRECISION = {"DEFAULT": ("bfloat16", "float32"), "PURE": ("bfloat16", "bfloat16")}
# FSDP's sharding strategy → reshard_after_forward: FULL_SHARD frees a block's parameters after
# its forward and gathers them again in backward (ZeRO-3); SHARD_GRAD_OP keeps them gathered from
# forward to backward (ZeRO-2's parameters, whole during the pass)
RESHARD_AFTER_FORWARD = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}


def llm_foundry_description(row: SweepRow) -> ModelDescription:
    """The row's model: the MPT preset at the row's sequence (learned positions, so its
    parameter count is the row's ``NumParams``) with FlashAttention (the runs' ``attn_impl:
    triton``, FlashAttention's Triton port: the README)."""
    return PRESETS[row.model].with_(seq=row.seq, attention="flash")


def llm_foundry_model(desc: ModelDescription) -> Transformer:
    """The model with llm-foundry's loss, flash-attn's fused cross-entropy (``loss_fn:
    fused_crossentropy``): it keeps the logits for backward, not float32 probabilities."""
    net = Transformer(desc)
    net.loss_fn = CrossEntropyLoss(ignore_index=-1, recompute_softmax=True)
    return net


def llm_foundry_recipe(row: SweepRow) -> ModelRecipe:
    """The row's model and micro-batch, trained as Composer trains it: its train metrics
    updated from the logits after every micro-batch's backward."""
    desc = llm_foundry_description(row)
    xp = meta.NAMESPACE

    def batch(b: int) -> tuple:
        return xp.zeros((b, row.seq), np.int64), xp.zeros((b, row.seq), np.int64)

    build = partial(llm_foundry_model, desc)
    name = f"{row.model}@{row.seq}"
    return ModelRecipe(name, build, batch, desc=desc, metrics=COMPOSER_TRAIN_METRICS)


def llm_foundry_config(row: SweepRow) -> dict[str, Any]:
    """The row's run under zerosim's FSDP2 schedule as Composer's FSDP1 runs it: one unit per
    block (and the root), parameters re-gathered for every micro-batch (resharded after
    backward) and gradients reduce-scattered after every micro-batch (Composer does not call
    ``no_sync`` on an FSDP model), fp32 shards and Adam, the row's mixed precision and sharding
    strategy."""
    param_dtype, reduce_dtype = MIXED_PRECISION[row.mixed_precision]
    return {
        "train_micro_batch_size_per_gpu": row.micro_batch,
        "gradient_accumulation_steps": row.grad_accum,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3},
        "zerosim": {
            "schedule": "fsdp2",
            "fsdp2": {
                "param_dtype": param_dtype,
                "reduce_dtype": reduce_dtype,
                "reshard_after_forward": RESHARD_AFTER_FORWARD[row.sharding],
                "reshard_after_backward": True,
                "reduce_every_micro_batch": True,
            },
        },
        "steps_per_print": 10**9,
    }


def llm_foundry_model_flops(row: SweepRow) -> float:
    """The source's MFU numerator for one optimizer step: (6·N + 12·L·d·s) per token."""
    desc = PRESETS[row.model]
    per_token = 6 * row.num_params + 12 * desc.layers * desc.hidden * row.seq
    return per_token * row.global_batch * row.seq
