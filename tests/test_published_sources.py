"""The published rows kept in ``examples/published/`` are what their sources print.

No network here, so the transcription is checked by what each source says about its own columns:
llm-foundry prints ``NumParams`` from the model's shapes and MFU from the throughput by a formula
it quotes, so a mistyped cell breaks one of the two. The shapes below are read from llm-foundry's
``scripts/train/yamls/pretrain/mpt-*.yaml`` (d_model, n_layers; vocabulary 50368), written here
rather than taken from zerosim's presets, which are then held to them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from zerosim.analysis.presets import PRESETS as GPT_PRESETS
from zerosim.dryrun.published import read_rows, read_sweep, zeropp_config
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


# Narayanan et al. 2021, Table 2 (examples/published/narayanan2021/): eq. (3) per token and the
# shapes, written here from the paper's text (§5.1, §5.3.2, Table 1), not from zerosim's presets.
NARAYANAN = Path(__file__).resolve().parent.parent / "examples/published/narayanan2021"
PAPER_SHAPES = {"174.6": (96, 12288, 96), "529.6": (105, 20480, 128)}  # layers, hidden, heads


@pytest.fixture(scope="module")
def table2():
    return read_rows(NARAYANAN / "table2_zero3.csv")


def test_table2_rows_are_the_quoted_lines(table2):
    """Every figure of a row is a cell of its quoted line (the merged cells aside)."""
    assert len(table2) == 6
    for r in table2:
        cells = [c.strip() for c in r["quoted"].strip("|").split("|")]
        assert cells[4:7] == [r["gpus"], r["micro_batch"], r["tflops_per_gpu"]], r
        assert cells[7] == r["days_300b_tokens"], r
        assert cells[3] in ("", r["global_batch"], r["global_batch"] + "*"), r
        assert int(r["global_batch"]) == int(r["gpus"]) * int(r["micro_batch"]), r


def test_table2_days_are_eq3_flops_at_the_printed_tflops(table2):
    """Days for 300B tokens = 300e9 · 96·l·h²·(1 + s/6h + V/16lh) / (GPUs · X), X the printed
    TFLOP/s: the printed days lie within the rounding of X and of the days themselves."""
    seq, vocab = 2048, 51200
    for r in table2:
        layers, hidden, _ = PAPER_SHAPES[r["params_billion"]]
        per_token = (
            96 * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
        )
        days = [
            300e9 * per_token / (int(r["gpus"]) * x * 1e12) / 86400
            for x in (float(r["tflops_per_gpu"]) + 0.5, float(r["tflops_per_gpu"]) - 0.5)
        ]
        assert days[0] - 0.5 <= int(r["days_300b_tokens"]) <= days[1] + 0.5, (r, days)


def test_table2_models_are_zerosims_presets_and_the_config_never_switches_prefetch_off(table2):
    """The rule stated before predicting: stage3_max_live_parameters at least the largest
    module, 529.6B's 4h² (its MLP matrices)."""
    for r in table2:
        shape = GPT_PRESETS[r["model"]]
        assert (shape.layers, shape.hidden, shape.heads) == PAPER_SHAPES[r["params_billion"]]
        assert shape.formula_params() / 1e9 == pytest.approx(float(r["params_billion"]), abs=0.05)
    config = json.loads((NARAYANAN / "ds_config.json").read_text())
    largest = max(4 * h * h for _, h, _ in PAPER_SHAPES.values())
    assert config["zero_optimization"]["stage3_max_live_parameters"] >= largest


# ZeRO++ blog (examples/published/zeropp/): the gains the figures print as arrows
ZEROPP = Path(__file__).resolve().parent.parent / "examples/published/zeropp"
ARROWS = [("6", 1024, "138B", 1.56), ("6", 2048, "49B", 1.41), ("7", 1024, "18B", 2.21),
          ("7", 2048, "18B", 1.77)]  # fmt: skip


def test_zeropp_bars_agree_with_the_gains_the_figures_print():
    """Each arrow's gain is ZeRO++ over the baseline of its pair: the labels are integers, so
    their ratio agrees with the arrow to the labels' rounding (±0.5 on each)."""
    rows = read_rows(ZEROPP / "figures.csv")
    assert len(rows) == 40 and sum(r["fitted"] == "True" for r in rows) == 1
    for figure, tokens, model, gain in ARROWS:
        pair = {
            r["scheme"]: int(r["tflops_per_gpu"])
            for r in rows
            if (r["figure"], int(r["tokens_per_gpu"]), r["model"]) == (figure, tokens, model)
            and r["figure"] in ("6", "7")
        }
        low = (pair["ZeRO++"] - 0.5) / (pair["ZeRO-3"] + 0.5)
        high = (pair["ZeRO++"] + 0.5) / (pair["ZeRO-3"] - 0.5)
        assert low <= gain <= high, (figure, tokens, model, pair)
        assert f"'{pair['ZeRO-3']}'" in next(
            r["quoted"] for r in rows if r["scheme"] == "ZeRO-3" and r["model"] == model
            and (r["figure"], int(r["tokens_per_gpu"])) == (figure, tokens)
        )  # fmt: skip


def test_zeropp_configs_are_the_tutorials():
    for name, plus in (("ds_config_zero3.json", False), ("ds_config_zeropp.json", True)):
        config = json.loads((ZEROPP / name).read_text())
        assert {**config, "train_micro_batch_size_per_gpu": 2} == zeropp_config(2, plus)
