"""Published training runs the dry run's time model is held to: each figure, its source, and the
config that reproduces the run (docs/dryrun.md gives every source and assumption).

**Narayanan et al., SC21, Table 2** ("Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", arXiv 2104.04473, §5.2): their 174.6B and 529.6B GPTs trained with
ZeRO-3 and no model parallelism on Selene, model TFLOP/s per GPU. The cluster file ``selene``
(``clusters/selene.json``) has its two efficiency factors fitted on the three 174.6B rows
(``fitted``); the 529.6B rows are predictions.

**Wang et al. 2023, ZeRO++**: ZeRO-3 and ZeRO++ on 384 V100s, TFLOP/s per GPU as printed on the
bars of the ZeRO++ blog's Figures 6-8. The cluster file ``zeropp_v100`` keeps Selene's factors:
nothing is fitted to these figures.

**MosaicML llm-foundry**, ``scripts/train/benchmarking/README.md``: MPT models 125M-70B trained
with PyTorch FSDP on 8-128 A100s (80 GB and 40 GB, 1600 Gb/s RoCE between nodes), 139 rows kept
cell for cell in ``examples/published/llm_foundry/a100.csv`` with their source and FLOP
convention beside them (``read_sweep``).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, NamedTuple

from zerosim.analysis.presets import GPTShape


class TableRow(NamedTuple):
    """One ZeRO-3 row of Narayanan et al.'s Table 2."""

    model: str  # a preset name (``analysis.presets.PRESETS``)
    gpus: int
    micro_batch: int
    batch: int  # global batch
    tflops: float  # published model TFLOP/s per GPU
    fitted: bool  # one of the rows selene.json's efficiency factors were fitted on


# 640 GPUs and batch 2560 for the 529.6B model at micro-batch 4: it did not fit on 560 GPUs
# (Table 2's caption, the row marked *).
NARAYANAN_TABLE2 = [
    TableRow("gpt3-175b", 384, 4, 1536, 144.0, True),
    TableRow("gpt3-175b", 768, 2, 1536, 88.0, True),
    TableRow("gpt3-175b", 1536, 1, 1536, 44.0, True),
    TableRow("gpt-529b", 640, 4, 2560, 138.0, False),
    TableRow("gpt-529b", 1120, 2, 2240, 98.0, False),
    TableRow("gpt-529b", 2240, 1, 2240, 48.0, False),
]

ZEROPP_GPUS = 384
ZEROPP_GPUS_PER_NODE = 16
# The ZeRO++ blog (DeepSpeed repository, blogs/zeropp/assets/images/eval1-3.png), TFLOP/s per
# GPU printed on the bars: (figure, inter-node Gb/s per node, tokens per GPU, model, ZeRO-3,
# ZeRO++). Figure 6: 4 × 100 Gb/s InfiniBand per node; Figure 7: 1 × 100 Gb/s; Figure 8: 2K
# tokens at 200 and 800 Gb/s.
ZEROPP_PUBLISHED = [
    ("6", 400, 1024, "18B", 25, 35),
    ("6", 400, 1024, "49B", 23, 36),
    ("6", 400, 1024, "91B", 23, 36),
    ("6", 400, 1024, "138B", 23, 36),
    ("6", 400, 2048, "18B", 40, 53),
    ("6", 400, 2048, "49B", 36, 51),
    ("6", 400, 2048, "91B", 36, 51),
    ("6", 400, 2048, "138B", 36, 50),
    ("7", 100, 1024, "18B", 14, 31),
    ("7", 100, 1024, "49B", 11, 22),
    ("7", 100, 1024, "91B", 11, 22),
    ("7", 100, 1024, "138B", 11, 22),
    ("7", 100, 2048, "18B", 26, 46),
    ("7", 100, 2048, "49B", 20, 38),
    ("7", 100, 2048, "91B", 20, 38),
    ("7", 100, 2048, "138B", 20, 38),
    ("8", 200, 2048, "18B", 37, 50),
    ("8", 800, 2048, "18B", 47, 54),
    ("8", 200, 2048, "138B", 32, 48),
    ("8", 800, 2048, "138B", 48, 55),
]


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
