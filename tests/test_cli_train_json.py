"""``zerosim train --json`` under a real mpirun: one JSON object on stdout with the step time, and
``train`` and ``dryrun`` taking the same ``--model`` forms."""

from __future__ import annotations

import argparse
import json
import math
import statistics

import pytest
from mpi_helpers import run_mpi

from zerosim.cli.main import main
from zerosim.cli.train import build
from zerosim.dryrun import recipe
from zerosim.meta import tracking

TINY = "gpt:1,32,80,16,2"  # 1 layer, hidden 32, vocabulary 80, sequence 16, 2 heads


def _train_json(steps: int, *extra: str) -> dict:
    proc = run_mpi(
        2, ["-m", "zerosim", "train", "--model", TINY, "--steps", str(steps), "--json", *extra], 240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout[:2000]  # nothing but the one object on stdout
    return json.loads(lines[0])


@pytest.mark.mpi
def test_train_json_under_mpirun_prints_the_median_step_time_after_two_warmup_steps():
    data = _train_json(5, "--probe")
    assert data["steps"] == 5 and data["ranks"] == 2 and data["stage"] == 3
    assert data["model"] == TINY
    # 1 layer of 12h² + 13h, embeddings V·h + s·h, final norm 2h, untied head V·h
    h, v, s = 32, 80, 16
    assert data["params"] == 12 * h * h + 13 * h + v * h + s * h + 2 * h + v * h
    walls = data["step_wall_s"]
    assert len(walls) == 5 and all(t > 0 for t in walls)
    assert data["steps_timed"] == 3
    assert data["step_s"] == pytest.approx(statistics.median(walls[2:]))
    assert len(data["step_cpu_share"]) == 5
    assert all(0 < c <= 1.5 for c in data["step_cpu_share"])
    assert 0 < data["step_cpu_s"] <= max(walls[2:]) * 1.5
    # --probe: after every step rank 0's probe, milliseconds of a fixed sample
    assert len(data["step_probe_s"]) == 5 and all(0 < p < 0.5 for p in data["step_probe_s"])


@pytest.mark.mpi
def test_train_json_with_two_steps_or_fewer_has_no_step_time():
    data = _train_json(2)
    assert data["step_s"] is None and data["steps_timed"] == 0 and data["steps"] == 2
    assert data["step_cpu_s"] is None
    assert data["step_probe_s"] == [None, None]  # not asked for: no probe run


# Each rank trains the model named by its argument with both metrics and prints its own last
# loss beside the metrics
METRICS_WORKER = """
import argparse, json, sys
from zerosim.cli.train import train
from zerosim.comm import MPIComm
args = argparse.Namespace(
    config=None, model=sys.argv[1], steps=3, seed=0, quiet=True, json=True, block_size=16,
    n_layer=1, n_head=2, n_embd=32, metrics=["LanguageCrossEntropy", "LanguagePerplexity"],
)
result = train(MPIComm(), args)
print(json.dumps({"loss": result["losses"][-1], **result["metrics"]}), flush=True)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_train_metrics_under_mpirun_are_every_ranks_mean_loss(ranks):
    """``--metrics`` under mpirun: every rank's micro-batch counts 4 × 16 targets (none
    ignored) and the loss is their mean cross-entropy of the same fp32 logits, so Composer's
    cross-entropy over every rank is the mean of the ranks' losses, on every rank alike, and
    perplexity its exponential. Without the sync each rank would print its own loss."""
    proc = run_mpi(ranks, ["-c", METRICS_WORKER, TINY], 240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    assert len(rows) == ranks
    mean = statistics.fmean(r["loss"] for r in rows)
    for r in rows:
        assert r["LanguageCrossEntropy"] == pytest.approx(mean, rel=1e-6)
        assert r["LanguagePerplexity"] == pytest.approx(math.exp(mean), rel=1e-5)
    if ranks > 1:  # the ranks' batches differ, so their own losses do
        assert len({r["loss"] for r in rows}) == ranks


@pytest.mark.mpi
def test_train_json_prints_the_last_steps_metrics():
    data = _train_json(3, "--metrics", "LanguagePerplexity", "LanguageCrossEntropy")
    metrics = data["metrics"]
    assert sorted(metrics) == ["LanguageCrossEntropy", "LanguagePerplexity"]
    assert metrics["LanguagePerplexity"] == pytest.approx(
        math.exp(metrics["LanguageCrossEntropy"]), rel=1e-5
    )
    assert _train_json(3)["metrics"] == {}  # none asked for: none run


@pytest.mark.parametrize(
    "names", [["LanguagePerplexity"], ["LanguageCrossEntropy", "LanguagePerplexity"]]
)
def test_dryrun_metrics_sync_sends_one_value_per_state_around_the_ring(names, tmp_path, capsys):
    """``zerosim dryrun --metrics``: after the step each metric's two states (a float32 sum and
    an int64 count) are all-gathered, a ring of N ranks sending N - 1 values of each: (N - 1) ·
    (4 + 8) bytes a metric, in the ``metrics`` phase on every rank."""
    cfg = tmp_path / "cfg.json"
    adam = {"type": "Adam", "params": {"lr": 1e-3}}
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
    cfg.write_text(json.dumps({**config, "optimizer": adam}))
    n = 3
    assert main(["dryrun", "--model", TINY, "--ranks", str(n), "--config", str(cfg), "--json",
                 "--metrics", *names]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    for entry in report["ranks"]:
        assert entry["bytes_sent"]["metrics"] == len(names) * (n - 1) * (4 + 8)


def test_train_refuses_an_unknown_metric_naming_the_allowed(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train", "--model", TINY, "--metrics", "Accuracy"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "argument --metrics: invalid choice: 'Accuracy'" in err
    assert "LanguageCrossEntropy" in err and "LanguagePerplexity" in err


def _params(model) -> int:
    return sum(p.numel for p in model.parameters())


@pytest.mark.parametrize(
    "spec", ["gpt", "mlp", "gpt:2,32,80,16,2", "gpt:1,64,96,32", "mpt-125m-tiny"]
)
def test_train_builds_the_model_the_dry_run_builds(spec):
    args = argparse.Namespace(
        model=spec, seed=0, block_size=32, n_layer=2, n_head=4, n_embd=64
    )  # zerosim train's defaults
    trained, _ = build(args)
    with tracking():
        dry = recipe(spec).build()
    assert _params(trained) == _params(dry)
    assert [n for n, _ in trained.named_parameters()] == [n for n, _ in dry.named_parameters()]


def test_train_refuses_a_model_the_dry_run_refuses_with_the_same_forms_named(capsys):
    assert main(["train", "--local", "1", "--model", "gpt3-9b", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--model 'gpt3-9b' is not a model" in err and "gpt:LAYERS,HIDDEN,VOCAB,SEQ" in err


def test_train_refuses_a_gpt_whose_vocabulary_cannot_hold_the_corpus(capsys):
    assert main(["train", "--local", "1", "--model", "gpt:1,32,10,16,2", "--steps", "1"]) == 2
    assert "has vocab 10; the corpus needs at least" in capsys.readouterr().err
