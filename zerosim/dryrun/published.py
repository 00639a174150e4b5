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
convention beside them (``read_sweep``).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, NamedTuple

from zerosim.analysis.presets import GPTShape

PUBLISHED = Path(__file__).resolve().parents[2] / "examples" / "published"
NARAYANAN_CSV = PUBLISHED / "narayanan2021" / "table2_zero3.csv"
ZEROPP_CSV = PUBLISHED / "zeropp" / "figures.csv"


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
