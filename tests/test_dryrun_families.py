"""Llama 3, MPT and BLOOM dry-run at 1,024 virtual ranks, held to closed forms of their shapes.

Every expected number is derived here from the published shapes (Meta's, llm-foundry's and
BigScience's configs), never read from the code under test: the parameter list of each family
(GQA's k and v of h·n_kv·d, SwiGLU's three matrices, no position table under rotary or ALiBi,
biases or not, tied or not), the ZeRO paper's model states 2Ψ + 2Ψ + 12Ψ split by stage with
the padding the layout makes (stages 1-2: Ψ to a multiple of N; stage 3: every parameter to
N chunks of ceil(numel/N)), the paper's collectives over Ψ_pad, and the FLOPs.

FLOP convention: every matrix product counted 2·m·k·n. Model FLOPs per token are
6·N_matmul + 12·l·h·s (N_matmul: the blocks' matrices and the output layer; attention's q·kᵀ
and P·v over the whole s×s matrix, 2·s·h each per layer in forward, backward twice). The
engine counts what it multiplies: grouped-query attention computes the whole matrix (its
count is the model count); GPT-2's packed attention, which MPT and BLOOM use, skips the blocks
of 64 positions above the diagonal, so its attention is 6·l·h·64²·n_b(n_b + 1) per sequence
with n_b = s/64 blocks.

Runs: bf16 with fp32 Adam on the paper's schedule, one micro-batch of one sequence, stage 3
without persistent parameters or reuse (every module gathers before its forward and backward).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from zerosim.cli import main
from zerosim.dryrun import dry_run
from zerosim.nn import PRESETS

N = 1024
ROOT = Path(__file__).resolve().parents[1]

# Published shapes: layers, hidden, heads, kv heads, MLP width, vocab, seq, and the parts.
SHAPES = {
    "llama3-8b": dict(l=32, h=4096, n=32, kv=8, f=14336, v=128256, s=8192, llama=True),
    "llama3-70b": dict(l=80, h=8192, n=64, kv=8, f=28672, v=128256, s=8192, llama=True),
    # MPT-7B with llm-foundry's attn_config.alibi: true (MosaicML's released MPT-7B): no wpe
    "mpt-7b-alibi": dict(l=32, h=4096, n=32, kv=32, f=16384, v=50368, s=2048, llama=False),
    "bloom-176b": dict(l=70, h=14336, n=112, kv=112, f=57344, v=250880, s=2048, llama=False),
}


def numels(name: str) -> list[int]:
    """Every parameter's elements, from the shapes alone, a tied output layer once."""
    c = SHAPES[name]
    h, f, v = c["h"], c["f"], c["v"]
    if c["llama"]:  # RMSNorm, no biases, rotary (no table), GQA, SwiGLU, untied
        kv = c["kv"] * h // c["n"]
        block = [h, h * h, kv * h, kv * h, h * h, h, f * h, f * h, h * f]
        return [v * h, *block * c["l"], h, v * h]
    # LayerNorm with bias, biases, ALiBi (no table), packed q/k/v, 4h GELU MLP, tied
    block = [h, h, 3 * h * h, 3 * h, h * h, h, h, h, f * h, f, h * f, h]
    embedding_norm = [h, h] if name == "bloom-176b" else []
    return [v * h, *embedding_norm, *block * c["l"], h, h]


def matmul_numel(name: str) -> int:
    """N_matmul: the blocks' matrices (as counted from the shapes) and the output layer."""
    c = SHAPES[name]
    h, f = c["h"], c["f"]
    kv = c["kv"] * h // c["n"]
    per_layer = 2 * h * h + 2 * kv * h + (3 if c["llama"] else 2) * h * f
    return c["l"] * per_layer + c["v"] * h


def description(name: str):
    if name == "mpt-7b-alibi":
        return PRESETS["mpt-7b"].with_(positions="alibi", name=name)
    return PRESETS[name]


def config(stage: int, **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
            **zero,
        },
        "bf16": {"enabled": True},
        "zerosim": {"schedule": "paper"},
    }


def padded(name: str, stage: int) -> int:
    psi = sum(numels(name))
    if stage == 3:
        return sum(math.ceil(m / N) * N for m in numels(name))
    return math.ceil(psi / N) * N


def model_states(name: str, stage: int) -> int:
    """ZeRO paper, Sec. 5: bf16 params (2), bf16 grads (2), fp32 master + Adam (12)."""
    p = padded(name, stage)
    return {1: 4 * p + 12 * p // N, 2: 2 * p + 14 * p // N, 3: 16 * p // N}[stage]


def sent(name: str, stage: int) -> dict[str, int]:
    """The paper's collectives, 2-byte elements, (N−1)/N of each buffer per rank (ring).

    Stages 1-2: the gradients reduce-scattered in backward, the parameters all-gathered after the
    step. Stage 3: each module gathers its parameters before forward and again before backward
    (a tied weight belongs to two modules, the embedding and the output layer: gathered twice
    in each pass), the gradients reduce-scattered once."""
    p = padded(name, stage)
    if stage in (1, 2):
        return {"backward": (N - 1) * p // N * 2, "step": (N - 1) * p // N * 2}
    tied = 0 if SHAPES[name]["llama"] else math.ceil(numels(name)[0] / N) * N
    gather = (N - 1) * (p + tied) // N * 2
    return {"forward": gather, "backward": gather + (N - 1) * p // N * 2}


def model_flops(name: str) -> int:
    c = SHAPES[name]
    return c["s"] * (6 * matmul_numel(name) + 12 * c["l"] * c["h"] * c["s"])


def counted_flops(name: str) -> int:
    c = SHAPES[name]
    if c["llama"]:
        return model_flops(name)
    blocks = c["s"] // 64
    attention = 6 * c["l"] * c["h"] * 64 * 64 * blocks * (blocks + 1)
    return c["s"] * 6 * matmul_numel(name) + attention


CASES = [("llama3-8b", 1), ("llama3-8b", 2), ("llama3-70b", 3), ("mpt-7b-alibi", 2)]
CASES += [("bloom-176b", 3)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{m}-stage{s}" for m, s in CASES])
def run(request):
    name, stage = request.param
    # stage 2: one bucket holds every gradient, so every rank's piece is Ψ_pad/N (few classes)
    zero = {"reduce_bucket_size": 2 * padded(name, stage)} if stage == 2 else {}
    return name, stage, dry_run(description(name), N, config(stage, **zero), steps=1)


def test_published_totals_are_the_shapes_counted():
    """The test's own parameter lists reproduce the published totals."""
    assert sum(numels("llama3-8b")) == 8_030_261_248  # Meta-Llama-3-8B
    assert sum(numels("llama3-70b")) == 70_553_706_496  # Meta-Llama-3-70B
    assert sum(numels("bloom-176b")) == 176_247_271_424  # bigscience/bloom's card


@pytest.mark.slow
def test_parameters_and_model_states_per_rank_equal_the_paper(run):
    name, stage, report = run
    assert report["params"] == sum(numels(name))
    assert report["padded_params"] == padded(name, stage)
    assert sorted(r for e in report["ranks"] for r in e["ranks"]) == list(range(N))
    for entry in report["ranks"]:
        assert entry["model_states_bytes"] == model_states(name, stage)
    assert report["formula"]["paper"]["model_states_bytes"] == model_states(name, stage)


@pytest.mark.slow
def test_bytes_sent_and_received_per_rank_equal_the_stages_collectives(run):
    """The clip norm's float64 all-reduce of one element aside (8 bytes on the end ranks, 16 on
    the others), every rank sends and receives the stage's collectives over Ψ_pad."""
    name, stage, report = run
    want = sent(name, stage)
    for entry in report["ranks"]:
        clip = {8 if r in (0, N - 1) else 16 for r in entry["ranks"]}
        assert entry["bytes_sent"] == {**want, "clip": clip.pop()} and not clip
        received = dict(entry["bytes_received"])
        assert received.pop("clip") > 0 and received == want


@pytest.mark.slow
def test_flops_per_step_are_the_familys_count(run):
    name, _, report = run
    assert {e["flops"] for e in report["ranks"]} == {counted_flops(name)}
    assert report["formula"]["model_flops"] == model_flops(name)


def test_memory_volume_and_project_commands_follow_llama3_70b(capsys):
    """Through the CLI: Ψ is Llama 3 70B's (GQA, SwiGLU, no table, untied), stage 3's Ψ_pad its
    parameters padded one by one, and the projected compute its family's FLOPs."""
    name, psi = "llama3-70b", sum(numels("llama3-70b"))

    def run_json(*args: str) -> dict:
        assert main([*args, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    memory = run_json(
        "memory", "--model", name, "--dp", str(N), "--stage", "3", "--dtype", "bfloat16"
    )
    (row,) = memory["rows"]
    assert memory["num_params"] == psi and row["total"] == 16 * padded(name, 3) // N
    volume = run_json("volume", "--model", name, "--dp", str(N), "--dtype", "bfloat16")
    assert volume["stages"]["3"]["padded_numel"] == padded(name, 3)
    assert volume["stages"]["3"]["total"] - volume["stages"]["3"]["step"] == sum(
        sent(name, 3).values()
    )
    assert volume["stages"]["1"]["padded_numel"] == padded(name, 1)
    cluster = str(ROOT / "examples" / "cluster_64gpu.json")
    tokens = 2**22
    project = run_json("project", "--cluster", cluster, "--model", name)
    per_token = 6 * matmul_numel(name) + 12 * 80 * 8192 * 8192
    assert project["compute_flops_per_device"] == pytest.approx(per_token * tokens / 64, rel=1e-12)
