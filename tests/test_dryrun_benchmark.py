"""benchmarks/dryrun.py's published runs: the ZeRO++ configs and how each figure is predicted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import zerosim.dryrun
from benchmarks import dryrun as bench
from zerosim.analysis.presets import GPTShape
from zerosim.config import load_config


def test_zeropp_and_its_baseline_differ_only_in_the_three_switches():
    base, plus = bench.zeropp_config(2, False), bench.zeropp_config(2, True)
    extra = {
        k: v for k, v in plus["zero_optimization"].items() if k not in base["zero_optimization"]
    }
    assert extra == {
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": 16,
        "zero_quantized_gradients": True,
    }
    assert {**plus, "zero_optimization": base["zero_optimization"]} == base
    for cfg in (base, plus):  # both are configs zerosim accepts for 384 ranks, 16 per node
        loaded = load_config({**cfg, "zerosim": {**cfg["zerosim"], "backend": "meta"}}, 384)
        assert loaded.zerosim.ranks_per_node == 16 and loaded.model_dtype == "float16"


def test_every_figure_is_listed_and_predicted_only_where_its_shape_is_known(monkeypatch):
    tiny = GPTShape(2, 32, 2, vocab=64, seq=16)
    monkeypatch.setattr(bench, "zeropp_shapes", lambda: {"18B": tiny})
    monkeypatch.setattr(bench, "ZEROPP_GPUS", 32)  # two nodes of 16
    monkeypatch.setattr(
        bench,
        "ZEROPP_PUBLISHED",
        [
            ("8", 200, 32, "18B", 37, 50),
            ("8", 800, 32, "18B", 47, 54),
            ("8", 200, 32, "138B", 32, 48),
        ],
    )
    runs = []
    original = zerosim.dryrun.run_world

    def counting(*args, **kwargs):  # zeropp_rows imports run_world when it runs
        runs.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(zerosim.dryrun, "run_world", counting)
    rows = bench.zeropp_rows()
    assert [(r["model"], r["scheme"], r["published_tflops"]) for r in rows] == [
        ("18B", "ZeRO-3", 37),
        ("18B", "ZeRO++", 50),
        ("18B", "ZeRO-3", 47),
        ("18B", "ZeRO++", 54),
        ("138B", "ZeRO-3", 32),
        ("138B", "ZeRO++", 48),
    ]
    assert len(runs) == 2  # one dry run per scheme, simulated at both bandwidths
    assert all(r["micro_batch"] == 2 for r in rows[:4])  # 32 tokens of 16
    assert [r["predicted_tflops"] for r in rows[4:]] == [None, None]
    slow, fast = rows[0:2], rows[2:4]
    for at_200, at_800 in zip(slow, fast, strict=True):  # more bandwidth is never slower
        assert at_800["predicted_tflops"] >= at_200["predicted_tflops"] > 0
        assert at_800["step_s"] <= at_200["step_s"]
    assert all(not r["fitted"] for r in rows)


def test_the_18b_shape_is_18b_and_every_published_token_count_is_whole_sequences():
    (shape,) = bench.zeropp_shapes().values()
    assert round(shape.formula_params() / 1e9) == 18  # the figures' "18B"
    assert {tokens for _, _, tokens, *_ in bench.ZEROPP_PUBLISHED} == {1024, 2048}
    assert all(tokens % shape.seq == 0 for _, _, tokens, *_ in bench.ZEROPP_PUBLISHED)


def test_the_shipped_bf16_dryrun_config_is_the_benchmarks():
    """README's dry-run command reads examples/ds_config_dryrun_bf16.json: the config whose
    figures it quotes (benchmarks/dryrun.py's), bf16 on the paper's schedule."""
    path = Path(__file__).resolve().parent.parent / "examples" / "ds_config_dryrun_bf16.json"
    assert json.loads(path.read_text()) == bench.config()
    assert bench.config()["bf16"] == {"enabled": True}


def test_the_software_factor_is_fitted_on_its_one_row_by_bisection():
    """A prediction that grows with the factor, here 100·f TFLOP/s: the fit finds f = 0.44 for a
    published 44; a row the roofline itself falls short of keeps the factor at 1."""
    from zerosim.dryrun import load_cluster_model
    from zerosim.dryrun.published import fit_software_factor

    base = load_cluster_model("selene")
    factor = fit_software_factor(lambda c: 100 * c.software_factor, 44.0, base)
    assert factor == pytest.approx(0.44, rel=1e-9)
    assert fit_software_factor(lambda c: 100 * c.software_factor, 150.0, base) == 1.0


def test_a_factor_fitted_on_another_backend_is_not_written(capsys):
    """``--write`` stores the factor in the cluster file, whose own backend it must be fitted
    on: with ``--backend`` it is refused before anything runs, naming both options."""
    from benchmarks.dryrun_papers import main as papers

    with pytest.raises(SystemExit) as stop:
        papers(["--write", "--backend", "torch"])
    assert stop.value.code == 2
    assert "--write stores a factor fitted on the cluster file's own backend" in (
        capsys.readouterr().err
    )


def test_each_paper_source_names_exactly_one_fitted_row():
    from zerosim.dryrun.published import NARAYANAN_CSV, ZEROPP_CSV, read_rows

    for path in (NARAYANAN_CSV, ZEROPP_CSV):
        assert sum(r["fitted"] == "True" for r in read_rows(path)) == 1, path


def test_a_row_whose_step_would_not_start_prints_oom_and_no_step_time(capsys):
    row = {
        "source": "Narayanan et al. SC21, Table 2", "model": "529.6B", "gpus": 640,
        "tokens_per_gpu": 8192, "cluster": "selene.json", "scheme": "ZeRO-3",
        "published_tflops": 138, "predicted_tflops": 86.2, "fitted": False, "step_s": 408.9,
        "exposed_comm_s": 165.8, "fits_device": False, "peak_gib": 81.7, "device_gib": 80.0,
    }  # fmt: skip
    bench.print_predictions([row, {**row, "fits_device": True, "gpus": 1120}])
    oom, ran = capsys.readouterr().out.splitlines()[2:]
    assert "OOM: peak 81.7 GiB > device 80 GiB (would take 408.90 s)" in oom
    assert "86.2" not in oom and "0.625" not in oom  # no throughput, no ratio
    assert "| 86.2 | 0.625 | 408.90 | 165.80 |" in ran


def test_a_paper_row_prints_the_step_its_published_figure_implies(capsys):
    """The same model FLOPs at the published rate: a row predicted at twice the published
    TFLOP/s took half the published step (10 s predicted, 20 s published)."""
    from benchmarks.dryrun_papers import print_table

    row = {
        "row": "174.6B on 768 GPUs", "fitted": True, "published_tflops": 88.0,
        "predicted_tflops": 176.0, "step_s": 10.0, "comm_s": 3.0,
        "exposed_comm_s": 1.0, "fits_device": True, "peak_gib": 40.0,
    }  # fmt: skip
    print_table("narayanan2021", 0.5, [row])
    header, line = capsys.readouterr().out.splitlines()[-2:]
    assert "published step s" in header
    assert line.split()[-6:] == ["10.00", "3.00", "20.00", "176.0", "88", "2.00"]
