"""The zerosim command and the README's main-job script."""

import json
import subprocess
import sys
from pathlib import Path

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


# -- bad input: a clear error naming the argument or file, on every rank, before anything runs --
@pytest.mark.parametrize(
    "argv, named",
    [
        (["volume", "--params=-1e6", "--dp", "4"], "argument --params: must be a whole number"),
        (["volume", "--params", "1.5", "--dp", "4"], "got '1.5'"),
        (["volume", "--params", "nan", "--dp", "4"], "got 'nan'"),
        (["volume", "--params", "1e6", "--dp", "0"], "argument --dp: must be an integer >= 1"),
        (["memory", "--params=-1"], "argument --params: must be a whole number"),
        (["memory", "--num-states", "-5"], "argument --num-states: must be an integer >= 0"),
        (["train", "--steps", "0"], "argument --steps: must be an integer >= 1, got '0'"),
        (["train", "--steps", "-3"], "argument --steps: must be an integer >= 1, got '-3'"),
    ],
)
def test_bad_numbers_are_refused_naming_the_argument_and_value(argv, named, capsys):
    from zerosim.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def _train(tmp_path, *extra):
    from zerosim.cli import main

    return main(["train", "--local", "2", "--model", "mlp", "--quiet", *extra])


@pytest.mark.parametrize(
    "text, named",
    [
        (
            '{"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, '
            '"gradient_clipping": 0.0}',
            "repeated keys ['gradient_clipping']",
        ),
        ('{"train_micro_batch_size_per_gpu": 2,\n "fp16": }', "neither JSON nor hjson"),
        (None, "cannot read the file"),
        (
            '{"train_micro_batch_size_per_gpu": 2, "gradient_clipping": -1}',
            "gradient_clipping: got -1",
        ),
    ],
)
def test_train_config_goes_through_the_checked_reader(tmp_path, capsys, text, named):
    path = tmp_path / "ds.json"
    if text is not None:
        path.write_text(text)
    assert _train(tmp_path, "--steps", "1", "--config", str(path)) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerosim train: ") and named in err, err
    assert err.count(str(path)) == 1, err  # the file is named, once
    assert "Traceback" not in err


def test_train_reads_an_hjson_config(tmp_path, capsys):
    path = tmp_path / "ds.hjson"
    path.write_text(
        """# hjson: comments, quoteless keys and strings (each runs to the end of its line)
{
  train_micro_batch_size_per_gpu: 4
  optimizer: {
    type: SGD
    params: {lr: 0.1}
  }
  zero_allow_untested_optimizer: true
  zerosim: {
    dtype: float64
  }
}
"""
    )
    assert _train(tmp_path, "--steps", "2", "--config", str(path)) == 0
    assert "memory matches the formula on every rank" in capsys.readouterr().out


def test_resume_with_steps_not_beyond_the_checkpoint_is_refused(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert _train(tmp_path, "--steps", "3", "--save", str(ckpt)) == 0
    capsys.readouterr()
    assert _train(tmp_path, "--steps", "3", "--resume", str(ckpt), "--save", str(ckpt)) == 2
    err = capsys.readouterr().err
    assert f"--steps 3: the checkpoint in {ckpt} is at step 3" in err and "> 3" in err
    assert sorted(p.name for p in ckpt.iterdir()) == ["global_step3", "latest"]  # unchanged


def test_consolidate_without_a_checkpoint_says_so_without_a_traceback(tmp_path, capsys):
    from zerosim.cli import main

    out = str(tmp_path / "w.npz")
    assert main(["consolidate", str(tmp_path), out]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"zerosim consolidate: {tmp_path / 'latest'}: missing"), err
    assert main(["consolidate", str(tmp_path / "nowhere"), out]) == 2
    assert "nowhere: no such checkpoint folder" in capsys.readouterr().err
    (tmp_path / "latest").write_text("")
    assert main(["consolidate", str(tmp_path), out]) == 2
    assert f"{tmp_path / 'latest'}: holds ''" in capsys.readouterr().err


def test_a_tag_path_that_is_a_file_is_called_a_file_not_missing(tmp_path, capsys):
    from zerosim.cli import main

    out = str(tmp_path / "w.npz")
    (tmp_path / "latest").write_text("global_step1")
    (tmp_path / "global_step1").write_text("not a folder")
    assert main(["consolidate", str(tmp_path), out]) == 2
    tag = tmp_path / "global_step1"
    assert capsys.readouterr().err == (
        f"zerosim consolidate: {tmp_path / 'latest'} names 'global_step1', but {tag} is a file, "
        "not a tag folder\n"
    )
    assert main(["consolidate", str(tmp_path), out, "--tag", "global_step1"]) == 2
    assert capsys.readouterr().err == (
        f"zerosim consolidate: {tag}: is a file, not a checkpoint tag folder\n"
    )
    assert main(["consolidate", str(tag), out]) == 2
    assert (
        capsys.readouterr().err
        == f"zerosim consolidate: {tag}: is a file, not a checkpoint folder\n"
    )


class _Writes:
    """A stderr that keeps each write apart."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--local", "2", "--config", "missing.json"],
        ["consolidate", "nowhere", "w.npz"],
        ["dryrun", "--model", "nonsense", "--ranks", "2", "--config", "x.json"],
        ["memory", "--params", "1e6", "--stage", "megatron", "--offload-optimizer", "cpu"],
        ["compare", "--precision", "bf16", "--dtype", "float64"],
        ["flight", "nowhere"],
    ],
)
def test_an_error_is_one_write_of_one_whole_line(argv, monkeypatch, tmp_path):
    """Under mpirun every rank writes its error at once; a message and its newline written
    apart (print() does that) let two ranks' lines splice into one."""
    from zerosim.cli import main

    monkeypatch.chdir(tmp_path)
    stderr = _Writes()
    monkeypatch.setattr(sys, "stderr", stderr)
    assert main(argv) == 2
    assert len(stderr.writes) == 1, stderr.writes
    line = stderr.writes[0]
    assert line.startswith(f"zerosim {argv[0]}: ") and line.endswith("\n") and line.count("\n") == 1


@pytest.mark.mpi
def test_bad_config_and_steps_end_every_rank_with_the_error_under_mpirun(tmp_path):
    from mpi_helpers import run_mpi

    path = tmp_path / "ds.json"
    path.write_text(
        '{"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "gradient_clipping": 0.0}'
    )
    argv = ["-m", "zerosim", "train", "--model", "mlp", "--quiet", "--steps", "1"]
    proc = run_mpi(3, [*argv, "--config", str(path)], timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count(f"zerosim train: {path}: repeated keys ['gradient_clipping']") == 3
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()  # each rank's line whole: none spliced into another
    assert len(lines) == 3 and len(set(lines)) == 1, proc.stderr
    proc = run_mpi(3, [*argv[:-1], "0"], timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("argument --steps: must be an integer >= 1, got '0'") == 3


@pytest.mark.mpi
@pytest.mark.slow
def test_train_saved_on_4_ranks_resumes_on_3(tmp_path):
    """The issue's commands (with the MLP): 4 steps × 16 samples = 64 is not a multiple of the
    3-rank micro-step (12 samples); the resumed run trains to step 6 and reports."""
    from mpi_helpers import run_mpi

    argv = ["-m", "zerosim", "train", "--model", "mlp", "--quiet"]
    ckpt = str(tmp_path / "ck")
    proc = run_mpi(4, [*argv, "--steps", "4", "--save", ckpt], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = run_mpi(3, [*argv, "--steps", "6", "--resume", ckpt, "--save", ckpt], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "memory matches the formula on every rank" in proc.stdout
    assert (tmp_path / "ck" / "latest").read_text() == "global_step6"


def _stage2_config(tmp_path, **zerosim):
    import json

    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        "zerosim": zerosim,
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    return cfg, path


def test_train_names_the_paper_stage_file_it_runs_before_training(tmp_path, capsys):
    from zerosim.cli import main

    _, path = _stage2_config(tmp_path, schedule="paper")
    assert (
        main(["train", "--local", "2", "--model", "mlp", "--steps", "1", "--config", str(path)])
        == 0
    )
    out = capsys.readouterr().out
    # the paper's stage 2 is the stage file a learner reads (docs/concepts.md, DESIGN.md)
    assert out.splitlines()[0] == "strategy: Stage2 (zerosim/zero/stage2.py)"
    assert out.count("strategy: ") == 1  # rank 0 alone


def test_train_names_the_class_that_runs_under_the_default_schedule(tmp_path, capsys):
    import inspect

    import zerosim as zs
    from zerosim.cli import main
    from zerosim.cli.main import build_parser
    from zerosim.cli.train import build

    cfg, path = _stage2_config(tmp_path)
    argv = ["train", "--local", "2", "--model", "mlp", "--steps", "1", "--config", str(path)]
    assert main(argv) == 0
    first = capsys.readouterr().out.splitlines()[0]
    model, _ = build(build_parser().parse_args(argv))  # the model train builds
    engine = zs.LocalWorld(2).run(lambda comm: zs.initialize(model, cfg, comm=comm)[0])[0]
    runs = type(engine.strategy)
    file = Path(inspect.getfile(runs)).relative_to(ROOT).as_posix()
    assert first == f"strategy: {runs.__name__} ({file})"
    assert f"class {runs.__name__}" in (ROOT / file).read_text()  # the file defines it


def test_train_quiet_or_json_prints_no_strategy_line(tmp_path, capsys):
    from zerosim.cli import main

    _, path = _stage2_config(tmp_path, schedule="paper")
    base = ["train", "--local", "2", "--model", "mlp", "--steps", "1", "--config", str(path)]
    assert main([*base, "--quiet"]) == 0
    assert "strategy:" not in capsys.readouterr().out
    assert main([*base, "--json"]) == 0
    json.loads(capsys.readouterr().out)  # stdout is the JSON report alone
