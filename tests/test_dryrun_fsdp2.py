"""FSDP2's schedule dry-run at 1,024 virtual ranks (GPT-3 175B, Llama 3 8B), held to closed forms
of the published shapes.

Every expected number is derived here from the shapes (OpenAI's GPT-3 Table 2.1 as Narayanan et
al. count it, Meta's Llama 3 config), never read from the code under test. FSDP2 shards each
parameter along dim 0 (torch's ``[out, in]`` for a weight): rank r holds ceil(dim0 / N) rows, so
its chunk is S_i = ceil(dim0_i / N) · numel_i / dim0_i elements. Each transformer block is one
FSDP module, the root (embeddings, final norm, output layer) another.

    model states per rank   16 · S    (fp32 sharded params, fp32 gradient shard, Adam's m and v)
    forward all-gather      k_f · (N−1) · b_p · S          (every FSDP module, param_dtype)
    backward all-gather     k · (N−1) · b_p · S_blocks      (blocks resharded after forward)
    reduce-scatter          (N−1) · b_r · S                 (reduce_dtype, last micro-batch)
    gathered peak           N · b_p · (S_root + 2 · S_block)

S = Σ S_i over every parameter, S_blocks over the blocks' (the root is not resharded after
forward, so backward does not gather it again); k micro-batches, k_f = k unless the parameters
stay gathered between micro-batches. The gathered peak: the root stays gathered for the whole
pass, a block runs while the next one (in forward) or the one before it (in backward) is
prefetched. Runs: bf16 all-gathers (``zerosim.fsdp2.param_dtype``), fp32 reduce-scatters.
"""

from __future__ import annotations

import math

import pytest

from zerosim.dryrun import dry_run
from zerosim.nn import PRESETS

N = 1024
BF16, FP32 = 2, 4


def gpt3_175b() -> tuple[list[tuple[int, int]], list[list[tuple[int, int]]]]:
    """(root, blocks) as (dim0, numel) of each parameter: GPT-3 175B (96 layers, hidden 12,288,
    vocabulary 51,200, 2,048 positions, tied output layer: one embedding matrix)."""
    layers, h, v, s = 96, 12288, 51200, 2048
    block = [(h, h), (h, h), (3 * h, 3 * h * h), (3 * h, 3 * h), (h, h * h), (h, h)]
    block += [(h, h), (h, h), (4 * h, 4 * h * h), (4 * h, 4 * h), (h, 4 * h * h), (h, h)]
    return [(v, v * h), (s, s * h), (h, h), (h, h)], [block] * layers


def llama3_8b() -> tuple[list[tuple[int, int]], list[list[tuple[int, int]]]]:
    """(root, blocks): Llama 3 8B (32 layers, hidden 4,096, 8 of 32 heads for k and v, SwiGLU
    14,336, vocabulary 128,256; RMSNorm, no biases, rotary, untied output layer)."""
    layers, h, f, v, kv = 32, 4096, 14336, 128256, 8 * 4096 // 32
    block = [(h, h), (h, h * h), (kv, kv * h), (kv, kv * h), (h, h * h), (h, h)]
    block += [(f, f * h), (f, f * h), (h, h * f)]
    return [(v, v * h), (h, h), (v, v * h)], [block] * layers


def chunk(params: list[tuple[int, int]]) -> int:
    """Σ ceil(dim0 / N) · numel / dim0: one rank's elements of these parameters."""
    return sum(math.ceil(d / N) * (m // d) for d, m in params)


def expected(model, k: int = 1, reshard_after_forward: bool = True, keep: bool = False) -> dict:
    root, blocks = model()
    s_root, s_blocks = chunk(root), [chunk(b) for b in blocks]
    s = s_root + sum(s_blocks)
    forward_passes = 1 if keep else k
    regathered = k * sum(s_blocks) if reshard_after_forward else 0
    return {
        "params": sum(m for d, m in root) + sum(m for b in blocks for d, m in b),
        "padded_params": N * s,
        "model_states_bytes": 16 * s,
        "forward": forward_passes * (N - 1) * BF16 * s,
        "backward": (N - 1) * (BF16 * regathered + FP32 * s),
        "peak_gathered_params": N * BF16 * (s_root + 2 * max(s_blocks)),
        "shard_bytes": FP32 * s,
    }


def config(k: int = 1, **fsdp2) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": k,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3},
        "zerosim": {
            "schedule": "fsdp2",
            "fsdp2": {"param_dtype": "bfloat16", "reduce_dtype": "float32", **fsdp2},
        },
    }


MODELS = {"gpt3-175b": (gpt3_175b, "gpt3-175b"), "llama3-8b": (llama3_8b, PRESETS["llama3-8b"])}


@pytest.fixture(scope="module", params=sorted(MODELS))
def run(request):
    shapes, model = MODELS[request.param]
    return shapes, dry_run(model, N, config(), steps=1)


def test_the_shapes_are_the_published_totals():
    """The test's own parameter lists reproduce the published totals."""
    assert expected(gpt3_175b)["params"] == 174_615_846_912  # 174.6B, Narayanan et al.
    assert expected(llama3_8b)["params"] == 8_030_261_248  # Meta-Llama-3-8B


@pytest.mark.slow
def test_model_states_per_rank_are_the_dim0_shards(run):
    shapes, report = run
    want = expected(shapes)
    assert report["params"] == want["params"]
    assert report["padded_params"] == want["padded_params"]
    assert sorted(r for e in report["ranks"] for r in e["ranks"]) == list(range(N))
    for entry in report["ranks"]:
        memory = entry["memory_report"]
        assert entry["model_states_bytes"] == want["model_states_bytes"]
        for key in ("params", "grads", "optimizer_state.exp_avg", "optimizer_state.exp_avg_sq"):
            assert memory[key] == want["shard_bytes"], key
        assert memory["master_params"] == 0  # the fp32 shards are the optimizer's weights


@pytest.mark.slow
def test_gathered_peak_is_the_root_and_two_blocks(run):
    shapes, report = run
    for entry in report["ranks"]:
        peak = entry["memory_report"]["peak_gathered_params"]
        assert peak == expected(shapes)["peak_gathered_params"]


@pytest.mark.slow
def test_bytes_per_phase_are_the_module_collectives(run):
    """Every rank sends and receives the same all-gathers and reduce-scatters; the norm's
    all-reduce (``clip``) is the only phase beside them."""
    shapes, report = run
    want = expected(shapes)
    for entry in report["ranks"]:
        for ledger in (entry["bytes_sent"], entry["bytes_received"]):
            assert set(ledger) == {"forward", "backward", "clip"}
            assert ledger["forward"] == want["forward"]
            assert ledger["backward"] == want["backward"]


@pytest.mark.slow
def test_no_gradients_are_kept_without_accumulation(run):
    _, report = run
    for entry in report["ranks"]:
        assert entry["memory_report"]["peak_accumulated_grads"] == 0


@pytest.mark.slow
def test_accumulation_without_reshard_after_forward():
    """Two micro-batches, blocks kept gathered from forward to backward: the forward gathers run
    twice, backward gathers nothing, the reduce-scatter runs once. Memory: every FSDP module is
    gathered at once at the end of forward (N · b_p · S), and between the micro-batches every
    unsharded gradient is kept in reduce_dtype (Ψ · b_r)."""
    report = dry_run(PRESETS["llama3-8b"], N, config(2, reshard_after_forward=False), steps=1)
    want = expected(llama3_8b, k=2, reshard_after_forward=False)
    for entry in report["ranks"]:
        memory = entry["memory_report"]
        assert entry["bytes_sent"]["forward"] == want["forward"]
        assert entry["bytes_sent"]["backward"] == want["backward"]
        assert entry["model_states_bytes"] == want["model_states_bytes"]
        assert memory["peak_gathered_params"] == want["padded_params"] * BF16
        assert memory["peak_accumulated_grads"] == want["params"] * FP32
