"""``zerosim dryrun`` and ``zerosim.dryrun.dry_run``: the report against the formulas."""

from __future__ import annotations

import json
import math

import pytest
from cluster_files import write_cluster

from zerosim import analysis
from zerosim.analysis.presets import narayanan_flops
from zerosim.cli import main
from zerosim.dryrun import dry_run

N = 6
B, S, L, H, V = 2, 32, 2, 16, 40  # micro-batch, sequence, layers, hidden, vocabulary
MODEL = f"gpt:{L},{H},{V},{S},2"


def _config(stage=3, schedule="paper", **zero):
    return {
        "train_micro_batch_size_per_gpu": B,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
            **zero,
        },
        "bf16": {"enabled": True},
        "zerosim": {"schedule": schedule},
    }


def _params():
    """Ψ of the untied GPT, from its shapes: 12·l·h² + 13·l·h + (V + s)·h + 2h + V·h."""
    return 12 * L * H * H + 13 * L * H + (V + S) * H + 2 * H + V * H


def _padded(n):
    """Stage 3 pads every parameter to a multiple of N: Σ ceil(numel_i / N)·N."""
    layer = [H, H, 3 * H * H, 3 * H, H * H, H, H, H, 4 * H * H, 4 * H, 4 * H * H, H]
    numels = [V * H, S * H, *layer * L, H, H, V * H]
    return sum(math.ceil(x / n) * n for x in numels)


@pytest.fixture(scope="module")
def report():
    return dry_run(MODEL, N, _config())


def test_the_report_has_the_issue_fields_and_covers_every_rank(report):
    for key in ("world_size", "params", "padded_params", "wall_s", "host_peak_rss_bytes"):
        assert key in report
    assert (report["world_size"], report["params"]) == (N, _params())
    assert report["padded_params"] == _padded(N)
    assert sorted(r for e in report["ranks"] for r in e["ranks"]) == list(range(N))
    for e in report["ranks"]:
        assert {"model_states_bytes", "peak_bytes", "activation_peak_bytes"} <= e.keys()
        assert {"bytes_sent", "flops"} <= e.keys()
        assert e["peak_bytes"] >= e["activation_peak_bytes"] > 0
    assert {"paper", "deepspeed_estimator", "model_flops"} == report["formula"].keys()
    for e in report["ranks"]:  # a ring all-gather or reduce-scatter receives what it sends
        assert e["bytes_received"]["forward"] == e["bytes_sent"]["forward"]


def test_model_states_and_bytes_equal_the_paper_formula(report):
    """Stage 3, bf16 with fp32 Adam: (2 + 2 + 12)·Ψ_pad/N bytes; the paper's schedule without
    reuse: 3(N−1)/N·Ψ_pad·2 bytes per step (forward gather; backward gather + reduce-scatter)."""
    padded = _padded(N)
    for e in report["ranks"]:
        assert e["model_states_bytes"] == 16 * padded // N
        assert e["bytes_sent"]["forward"] == (N - 1) * padded // N * 2
        assert e["bytes_sent"]["backward"] == 2 * (N - 1) * padded // N * 2
    paper = report["formula"]["paper"]
    assert paper["model_states_bytes"] == 16 * padded // N
    assert (
        paper["bytes_sent"]["forward"] + paper["bytes_sent"]["backward"]
        == 3 * (N - 1) * padded // N * 2
    )
    psi, layer = _params(), 4 * H * H + 4 * H  # the estimator: 4L + int(18Ψ/N), one node
    want = 4 * max(V * H, layer) + int(18 * psi / N)
    assert report["formula"]["deepspeed_estimator"]["model_states_bytes"] == want


@pytest.mark.parametrize("recompute", [False, True])
def test_flops_per_step_are_narayanans_formula(recompute):
    """At S ≤ 64 the attention is one block, computed whole: the count is the formula's."""
    got = dry_run(MODEL, 2, _config(stage=2), recompute=recompute)
    want = narayanan_flops(B, S, L, H, V, recompute)
    assert {e["flops"] for e in got["ranks"]} == {int(round(want))}
    # the model FLOPs of the report: its family's count, for a GPT Narayanan et al.'s eq. 3
    assert got["formula"]["model_flops"] == int(round(want))


def test_recompute_keeps_less_activation_memory(report):
    again = dry_run(MODEL, N, _config(), recompute=True)
    assert again["ranks"][0]["activation_peak_bytes"] < report["ranks"][0]["activation_peak_bytes"]


def test_all_ranks_reports_what_the_classes_report(report):
    every = dry_run(MODEL, N, _config(), all_ranks=True)
    assert every["ranks_run"] == N and report["ranks_run"] < N
    assert every["ranks"] == report["ranks"]


def test_cli_prints_one_json_object_and_progress_on_stderr(tmp_path, capsys):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(_config()))
    args = ["dryrun", "--model", MODEL, "--ranks", str(N), "--config", str(cfg)]
    assert main([*args, "--json"]) == 0
    out, err = capsys.readouterr()
    printed = json.loads(out)
    assert printed["world_size"] == N and printed["params"] == _params()
    assert "classes of rank" in err and "zerosim dryrun:" in err
    assert main([*args, "--micro-batch", "1"]) == 0
    table = capsys.readouterr().out
    assert f"{N} virtual ranks, stage 3" in table and "micro-batch 1 × 1" in table


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--model", "gpt3-9b"], "zerosim dryrun: --model 'gpt3-9b' is not a model; allowed: ["),
        (["--ranks", "0"], "argument --ranks: must be an integer >= 1, got '0'"),
        (["--steps", "0"], "argument --steps: must be an integer >= 1, got '0'"),
        (["--micro-batch", "-1"], "argument --micro-batch: must be an integer >= 1, got '-1'"),
        (
            ["--config", "missing.json"],
            "zerosim dryrun: missing.json: cannot read the file (No such file or directory); "
            "allowed: a readable JSON or hjson file",
        ),
    ],
)
def test_cli_refuses_bad_arguments_naming_them_with_exit_code_2(tmp_path, capsys, extra, message):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(_config()))
    args = {"--model": MODEL, "--ranks": str(N), "--config": str(cfg)}
    args.update(dict(zip(extra[::2], extra[1::2], strict=True)))
    try:
        code = main(["dryrun", *[x for kv in args.items() for x in kv]])
    except SystemExit as exit_info:  # argparse's refusal
        code = exit_info.code
    err = capsys.readouterr().err
    assert code == 2 and message in err.splitlines()[-1], err
    assert "Traceback" not in err and "[Errno" not in err


def test_cli_reads_an_hjson_config_as_train_does(tmp_path, capsys):
    cfg = tmp_path / "ds.hjson"
    cfg.write_text("# the dry run's config, in hjson\n" + json.dumps(_config(), indent=2))
    assert main(["dryrun", "--model", MODEL, "--ranks", str(N), "--config", str(cfg)]) == 0
    assert f"{N} virtual ranks" in capsys.readouterr().out


def test_a_bad_config_key_is_refused_before_any_rank_runs():
    bad = _config()
    bad["zero_optimization"]["stage"] = 5
    with pytest.raises(ValueError, match="zero_optimization.stage"):
        dry_run(MODEL, N, bad)


def test_step_bytes_formula_helper_agrees(report):
    """The formula the report prints is analysis.step_bytes with Ψ_pad (held to the engine
    elsewhere); here only that the report passes it the run's values."""
    want = analysis.step_bytes(3, N, _padded(N), 2, 1, 0, True, schedule="paper")
    assert report["formula"]["paper"]["bytes_sent"] == want


def test_overflow_rule_decides_whether_fp16_steps_are_skipped():
    """The overflow flag's all-reduce runs either way; with every test finding an inf the step is
    skipped, so the parameters' all-gather after it is not sent."""
    cfg = _config(stage=2)
    cfg.pop("bf16")
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    finite = dry_run(MODEL, 3, cfg, steps=1)["ranks"][0]["bytes_sent"]
    skipped = dry_run(MODEL, 3, cfg, steps=1, overflow=True)["ranks"][0]["bytes_sent"]
    assert finite["overflow"] == skipped["overflow"] > 0
    assert finite["step"] > 0 and skipped.get("step", 0) == 0


def test_a_recipe_from_a_shape_keeps_its_name_and_its_tied_embedding():
    from zerosim.analysis.presets import GPTShape
    from zerosim.backend import shape_only_init
    from zerosim.dryrun import recipe

    shape = GPTShape(2, 32, 2, vocab=40, seq=16)  # tied, as Megatron's GPT
    model = recipe(shape, "tiny")
    assert model.name == "tiny" and model.gpt == shape
    with shape_only_init():
        net = model.build()
    # Narayanan et al.'s eq. 2 counts one embedding matrix and no final LayerNorm (2h)
    assert sum(p.numel for p in net.parameters()) == round(shape.formula_params()) + 2 * 32
    x, y = model.batch(3)
    assert x.shape == y.shape == (3, 16)
    untied = recipe("gpt:2,32,40,16,2")
    with shape_only_init():
        assert sum(p.numel for p in untied.build().parameters()) == (
            round(shape.formula_params()) + 2 * 32 + 40 * 32
        )


def test_wall_s_counts_the_report_over_every_rank_and_the_time_model(monkeypatch, tmp_path):
    """On a clock that moves only while the report is summed over the ranks (100 s) and the step
    simulated (7 s), ``wall_s`` is 107 s: what the dry run cost besides running the ranks."""
    import zerosim.dryrun as dryrun

    clock = [0.0]

    def advancing(function, seconds):
        def run(*args, **kwargs):
            clock[0] += seconds
            return function(*args, **kwargs)

        return run

    monkeypatch.setattr(dryrun, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(dryrun, "summarize", advancing(dryrun.summarize, 100.0))
    monkeypatch.setattr(dryrun, "step_time", advancing(dryrun.step_time, 7.0))
    cluster = tmp_path / "c.json"
    write_cluster(
        cluster, nodes=1, devices_per_node=4, intra_bandwidth=1e9, inter_bandwidth=1e9,
        intra_latency=0, inter_latency=0, device_flops=1e12,
    )  # fmt: skip
    report = dry_run(MODEL, N, _config(), cluster=cluster)
    assert report["wall_s"] == 107.0
    assert report["ranks_wall_s"] > 0  # the ranks' runs, on the real clock
