"""The zerosim command and the README's main-job script."""

import subprocess
import sys

import pytest
from mpi_helpers import ROOT


def test_demo_on_a_local_world_reports_measured_bytes_equal_to_the_formulas(capsys):
    from zerosim.cli import main

    assert main(["demo", "--local", "3", "--mib", "0.01"]) == 0
    out = capsys.readouterr().out
    assert out.count("   OK") == 3 and "MISMATCH" not in out
    assert "zerosim collective demo: 3 ranks" in out


@pytest.mark.mpi
def test_run_mpi_sh_runs_the_main_job_on_4_ranks():
    proc = subprocess.run(
        ["./run_mpi.sh", "-n", "4", "demo", "--mib", "0.1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "zerosim collective demo: 4 ranks" in proc.stdout
    assert proc.stdout.count("   OK") == 3


def test_run_mpi_sh_rejects_a_bad_rank_count():
    proc = subprocess.run(
        ["./run_mpi.sh", "-n", "zero"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "-n must be a positive integer, got 'zero'" in proc.stderr


def test_python_dash_m_zerosim_help_lists_the_commands():
    proc = subprocess.run(
        [sys.executable, "-m", "zerosim", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "demo" in proc.stdout


@pytest.mark.mpi
def test_run_mpi_sh_main_job_trains_and_matches_the_formulas_on_4_ranks():
    proc = subprocess.run(
        ["./run_mpi.sh", "-n", "4", "train", "--steps", "40", "--quiet"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = proc.stdout.split("loss: first 10 steps ")[1].split("\n")[0]
    first, last = (float(v) for v in line.split(" → last 10 steps "))
    assert last < first - 0.5
    assert proc.stdout.count("   OK") == 4
    assert "memory matches the formula on every rank" in proc.stdout


def test_train_on_a_local_world_with_a_megatron_config(tmp_path, capsys):
    import json

    from zerosim.cli import main

    cfg = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 1},
        "zerosim": {"layout": "megatron"},
    }
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    args = [
        "train",
        "--local",
        "3",
        "--model",
        "mlp",
        "--steps",
        "5",
        "--quiet",
        "--config",
        str(path),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("   OK") == 3 and "memory matches the formula" in out


def test_train_json_numbers_equal_the_library_formulas_and_plot_writes_a_png(tmp_path, capsys):
    import json

    from zerosim import analysis
    from zerosim.cli import main

    png = tmp_path / "loss.png"
    args = [
        "train",
        "--local",
        "2",
        "--model",
        "mlp",
        "--steps",
        "4",
        "--quiet",
        "--json",
        "--plot",
        str(png),
    ]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["world_size"] == 2 and len(data["losses"]) == 4
    want = analysis.step_bytes(3, 2, data["padded_numel"], 4, 1, data["persistent_numel"])
    for rank, row in enumerate(data["bytes"]["measured"]):
        assert row == [
            want["forward"],
            want["backward"],
            want["step"],
            analysis.clip_bytes(2, rank),
        ]
    assert data["bytes"]["equal"] and data["memory"]["equal"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_consolidate_json_lists_every_parameter(tmp_path, capsys):
    import json

    from zerosim.cli import main

    ckpt, out = tmp_path / "ckpt", tmp_path / "full.npz"
    assert (
        main(
            [
                "train",
                "--local",
                "2",
                "--model",
                "mlp",
                "--steps",
                "2",
                "--quiet",
                "--save",
                str(ckpt),
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["consolidate", str(ckpt), str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["arrays"] == {
        "layers.0.weight": [256, 32],
        "layers.0.bias": [256],
        "layers.2.weight": [256, 256],
        "layers.2.bias": [256],
        "layers.4.weight": [10, 256],
        "layers.4.bias": [10],
    }
