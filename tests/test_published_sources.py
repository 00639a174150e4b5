"""The published rows kept in ``examples/published/`` are what their sources print.

No network here, so the transcription is checked by what each source says about its own columns:
llm-foundry prints ``NumParams`` from the model's shapes and MFU from the throughput by a formula
it quotes, so a mistyped cell breaks one of the two. The shapes below are read from llm-foundry's
``scripts/train/yamls/pretrain/mpt-*.yaml`` (d_model, n_layers; vocabulary 50368), written here
rather than taken from zerosim's presets, which are then held to them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from zerosim.dryrun.published import read_sweep
from zerosim.nn.presets import PRESETS

SWEEP = Path(__file__).resolve().parent.parent / "examples/published/llm_foundry/a100.csv"
MPT_YAMLS = {  # size: (d_model, n_layers)
    "125m": (768, 12),
    "350m": (1024, 24),
    "760m": (1536, 24),
    "1b": (2048, 24),
    "3b": (2560, 32),
    "7b": (4096, 32),
    "13b": (5120, 40),
    "30b": (7168, 48),
    "70b": (8192, 80),
}
A100_BF16_PEAK = 312e12


@pytest.fixture(scope="module")
def rows():
    return read_sweep(SWEEP)


def test_both_a100_tables_whole(rows):
    assert len(rows) == 139
    assert sum(r.gpu == "a100_80gb" for r in rows) == 61
    assert sum(r.gpu == "a100_40gb" for r in rows) == 78
    assert len({r.line for r in rows}) == 139


def test_num_params_follow_the_mpt_shapes(rows):
    """GPT-shaped MPT: V·d + s·d (learned positions) + L(12d² + 13d) + 2d (final LayerNorm)."""
    for r in rows:
        d, layers = MPT_YAMLS[r.model.removeprefix("mpt-")]
        expected = 50368 * d + r.seq * d + layers * (12 * d * d + 13 * d) + 2 * d
        assert r.num_params == expected, r


def test_zerosim_presets_count_what_llm_foundry_counts(rows):
    for r in rows:
        desc = dataclasses.replace(PRESETS[r.model], seq=r.seq)
        assert desc.num_parameters() == r.num_params, r


def test_mfu_is_the_quoted_formula_of_the_printed_throughput(rows):
    """MFU = (6·N + 12·L·d·s) · tokens/s / (GPUs · 312 TFLOP/s); the throughput is printed as an
    integer, so the two agree to its rounding (under 0.05% at the slowest row)."""
    for r in rows:
        d, layers = MPT_YAMLS[r.model.removeprefix("mpt-")]
        flops_per_token = 6 * r.num_params + 12 * layers * d * r.seq
        mfu = 100 * flops_per_token * r.tokens_per_s / (r.gpus * A100_BF16_PEAK)
        assert mfu == pytest.approx(r.mfu, rel=5e-4, abs=0.006), r


def test_batch_columns_agree(rows):
    for r in rows:
        assert r.global_batch == r.micro_batch * r.grad_accum * r.gpus, r
