"""``zerosim volume --optimizer`` and ``zerosim compare --optimizer``: LAMB's and Muon's cost
under ZeRO, as formulas and measured (zerosim/report/whole_params.py)."""

from __future__ import annotations

import json

import pytest

import zerosim as zs
from zerosim.cli.main import main
from zerosim.report import whole_params


def test_muon_volume_at_stage_3_is_four_times_the_matrices():
    """16 matrices 250×250 on N = 4 (chunks exact): 4(N−1)/N·Ψ·b extra, by hand."""
    data = whole_params.volume_data(1_000_000, 4, "muon", 16, 4)
    assert data["stages"]["stage3"]["extra"] == 4 * 3 * 1_000_000 * 4 // 4
    assert data["stages"]["stage0"]["extra"] == 0


@pytest.mark.parametrize("itemsize", [2, 4])
def test_muon_offload_gathers_every_owned_slice_of_gradient_and_momentum(itemsize):
    """16 matrices 250×250 on N = 4, by hand: each rank sends (N−1) times its quarter of the
    gradients and momentums (2·Ψ/4 elements), fp32 at stages 1-2, the model dtype at stage 3."""
    rows = whole_params.volume_data(1_000_000, 4, "muon", 16, itemsize)["stages"]
    for stage, b in ((1, 4), (2, 4), (3, itemsize)):
        assert rows[f"stage{stage}"]["offload"] == 3 * 2 * (1_000_000 // 4) * b
    assert "offload" not in rows["stage0"]


def test_partitions_aligned_with_the_matrices_split_none_of_them():
    """N | M: the partition boundaries of stages 1-2 fall between matrices; N ∤ M cuts some."""
    aligned = whole_params.volume_data(1_000_000, 4, "lamb", 16, 4)["stages"]
    assert aligned["stage1"]["split"] == aligned["stage2"]["split"] == 0
    assert aligned["stage1"]["extra"] == 0
    cut = whole_params.volume_data(1_000_000, 3, "muon", 16, 4)["stages"]
    assert cut["stage1"]["split"] == 2  # boundaries at 1/3 and 2/3 of 16 matrices
    assert cut["stage1"]["extra"] == 0  # the default all-reduces every slice anyway
    assert cut["stage1"]["extra_reduce"] > 0  # reduced to owners, the split ones are not


@pytest.mark.parametrize("optimizer", ["lamb", "muon"])
def test_compare_measures_what_the_formulas_say(optimizer):
    report = zs.LocalWorld(3).run(whole_params.compare, optimizer, "mlp", 2)[0]
    assert report["ok"], whole_params.format_report(report)
    assert [r["stage"] for r in report["stages"]] == [0, 1, 2, 3]


def test_volume_command_prints_the_extra_bytes(capsys):
    assert main(["volume", "--params", "1e6", "--dp", "3", "--optimizer", "muon"]) == 0
    out = capsys.readouterr().out
    assert "Muon under ZeRO" in out and "reduce to owners" in out and "offload gathers" in out
    assert main(["volume", "--params", "1e6", "--dp", "3", "--optimizer", "lamb", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["whole_params"]["stages"]["stage3"]["split"] == 16


def test_compare_command_exits_0_when_every_count_agrees(capsys):
    assert main(["compare", "-n", "2", "--optimizer", "muon", "--model", "gpt"]) == 0
    assert "stage 3: equal" in capsys.readouterr().out
