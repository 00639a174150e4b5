"""llm-foundry's sweep driver (``benchmarks/dryrun_published.py``): each row's model and config
derived from the row's own columns, read here straight from the CSV, by the rules of
``examples/published/llm_foundry/README.md``."""

from __future__ import annotations

import csv
import json

import pytest

from benchmarks.dryrun_published import CLUSTERS, SWEEP, config, description, model_flops_per_step
from zerosim.config import load_config
from zerosim.dryrun import load_cluster_model
from zerosim.dryrun.published import read_sweep
from zerosim.dryrun.timeline import CLUSTERS as CLUSTER_FILES

ROWS = list(csv.DictReader(open(SWEEP, newline="")))
SWEEP_ROWS = read_sweep(SWEEP)


def test_every_row_is_read():
    assert len(ROWS) == len(SWEEP_ROWS) == 139


@pytest.mark.parametrize("i", range(139))
def test_a_rows_config_follows_its_columns(i):
    """README: DEFAULT gathers bf16 and reduces fp32, PURE both bf16; FULL_SHARD frees a block's
    parameters after forward (ZeRO-3), SHARD_GRAD_OP keeps them to backward; Composer re-gathers
    per micro-batch and reduce-scatters every micro-batch (no no_sync on an FSDP model);
    GradAccum micro-batches of MicroBatchSize sequences per GPU make GlobalBatchSize."""
    raw, row = ROWS[i], SWEEP_ROWS[i]
    cfg = config(row)
    fsdp2 = cfg["zerosim"]["fsdp2"]
    assert cfg["zero_optimization"]["stage"] == 3 and cfg["zerosim"]["schedule"] == "fsdp2"
    assert fsdp2["param_dtype"] == "bfloat16"
    assert fsdp2["reduce_dtype"] == {"DEFAULT": "float32", "PURE": "bfloat16"}[raw["MP Mode"]]
    strategy = raw["Sharding Strategy"]
    assert fsdp2["reshard_after_forward"] is {"FULL_SHARD": True, "SHARD_GRAD_OP": False}[strategy]
    assert fsdp2["reshard_after_backward"] is True and fsdp2["reduce_every_micro_batch"] is True
    micro, accum = int(raw["MicroBatchSize"]), int(raw["GradAccum"])
    assert cfg["train_micro_batch_size_per_gpu"] == micro
    assert cfg["gradient_accumulation_steps"] == accum
    assert micro * accum * int(raw["# GPUs"]) == int(raw["GlobalBatchSize"])
    assert row.recompute is (raw["Activation Checkpointing"] == "True")
    load_config(cfg, int(raw["# GPUs"]))  # a config zerosim accepts at the row's world size
    desc = description(row)
    assert desc.seq == int(raw["SeqLen (T)"]) and desc.attention == "flash"
    assert desc.num_parameters() == int(raw["NumParams"])  # the preset at the row's sequence


def test_the_mfu_numerator_is_the_sources_formula():
    """(3·flops_per_seq + 3·attn_flops_per_seq) per sequence, flops_per_seq = 2·N·s and
    attn_flops_per_seq = L·2·2·d·s² (the README's quote), times the global batch."""
    raw, row = ROWS[0], SWEEP_ROWS[0]
    n, s = int(raw["NumParams"]), int(raw["SeqLen (T)"])
    layers, d = 80, 8192  # MPT-70B (llm-foundry's mpt-70b.yaml)
    per_seq = 3 * 2 * n * s + 3 * layers * 2 * 2 * d * s * s
    assert raw["Model"] == "70b"
    assert model_flops_per_step(row) == per_seq * int(raw["GlobalBatchSize"])


@pytest.mark.parametrize("table", sorted(CLUSTERS))
def test_the_rows_run_on_pytorchs_kernels_with_flashattentions_cited_efficiency(table):
    """The runs were PyTorch's kernels (README): backend torch; FlashAttention at the midpoint
    of the 25-40% of the peak that FlashAttention-2's abstract gives, quoted in the file."""
    name = CLUSTERS[table]
    model = load_cluster_model(name)
    assert model.backend == "torch" and model.prices_kernels
    assert model.attention_efficiency == (0.25 + 0.40) / 2
    source = json.loads((CLUSTER_FILES / f"{name}.json").read_text())["attention_efficiency"]
    assert "reaching only 25-40% of the theoretical maximum FLOPs/s" in source["source"]
    assert "arXiv 2307.08691" in source["source"]
