"""A tiny Llama-style and a tiny MPT-style model (``zerosim train --model NAME-tiny``) under a real
``mpirun -n 2`` at ZeRO stage 3: the loss falls, and the weights equal a one-process run on the
same global batches (stage 0, micro-batch twice as large), in float64."""

import json

import numpy as np
import pytest
from mpi_helpers import run_mpi

from zerosim.cli import main

pytestmark = pytest.mark.mpi

STEPS = 12


def config(stage: int, micro: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 20000},
        "zerosim": {"dtype": "float64", "schedule": "paper"},
    }


def weights(ckpt, out) -> dict[str, np.ndarray]:
    assert main(["consolidate", str(ckpt), str(out)]) == 0
    with np.load(out) as arrays:
        return {name: arrays[name] for name in arrays.files}


@pytest.mark.parametrize("model", ["llama3-8b-tiny", "mpt-125m-tiny"])
def test_tiny_model_trains_under_mpirun_and_stage_3_equals_one_process(tmp_path, model, capsys):
    cfg3, cfg1 = tmp_path / "stage3.json", tmp_path / "single.json"
    cfg3.write_text(json.dumps(config(3, micro=4)))
    cfg1.write_text(json.dumps(config(0, micro=8)))
    common = ["--model", model, "--steps", str(STEPS), "--quiet", "--json"]
    proc = run_mpi(
        2, ["-m", "zerosim", "train", *common, "--config", str(cfg3), "--save", str(tmp_path / "3")]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    losses = report["losses"]
    assert report["world_size"] == 2 and report["stage"] == 3 and len(losses) == STEPS
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3  # ln 128 ≈ 4.85 at the start
    assert report["bytes"]["equal"] and report["memory"]["equal"]

    single = [*common, "--config", str(cfg1), "--save", str(tmp_path / "1"), "--local", "1"]
    assert main(["train", *single]) == 0
    one = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert one["world_size"] == 1 and len(one["losses"]) == STEPS  # rank 0's half is not it
    got, want = (
        weights(tmp_path / "3", tmp_path / "3.npz"),
        weights(tmp_path / "1", tmp_path / "1.npz"),
    )
    assert list(got) == list(want)
    assert any(".attn.q_proj." in n for n in got) == model.startswith("llama")
    for name in want:
        scale = np.linalg.norm(want[name])
        assert np.linalg.norm(got[name] - want[name]) <= 1e-10 * scale, name
