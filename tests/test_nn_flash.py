"""FlashAttention-style attention (``zerosim.nn.flash``): the outputs and gradients of torch
autograd's attention, and the memory of a layer that keeps no s × s probabilities."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import zerosim.nn as nn
from tests.torch_twins import press_alibi_slopes
from zerosim import meta
from zerosim.backend import shape_only_init
from zerosim.dryrun import dry_run
from zerosim.nn.gradcheck import relative_error

xp = meta.NAMESPACE


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def torch_attention(attn, x, dy, alibi, dtype):
    """torch autograd's causal attention (SDPA, ALiBi as an additive mask) with ``attn``'s
    weights, in ``dtype``: (y, dx, {name: weight gradient})."""
    b, t, c = x.shape
    h = attn.n_head
    tx = torch.tensor(x, dtype=dtype, requires_grad=True)
    w = {
        n: torch.tensor(np.asarray(p.data, np.float64), dtype=dtype, requires_grad=True)
        for n, p in attn.named_parameters()
    }
    qkv = F.linear(tx, w["c_attn.weight"], w["c_attn.bias"]).reshape(b, t, 3, h, c // h)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    mask = torch.zeros(t, t, dtype=dtype).masked_fill(
        torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")
    )
    if alibi:  # m_h·j: the row-constant part of −m_h·(i − j) leaves the softmax unchanged
        slopes = torch.tensor(press_alibi_slopes(h), dtype=dtype)
        mask = mask + slopes[:, None, None] * torch.arange(t, dtype=dtype)[None, None, :]
    ty = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ty = F.linear(ty.transpose(1, 2).reshape(b, t, c), w["c_proj.weight"], w["c_proj.bias"])
    ty.backward(torch.tensor(dy, dtype=dtype))
    grads = {n: g.grad.double().numpy() for n, g in w.items()}
    return ty.detach().double().numpy(), tx.grad.double().numpy(), grads


@pytest.mark.parametrize("dtype, tol", [("float64", 1e-12), ("float32", 2e-5)])
@pytest.mark.parametrize("t, alibi", [(5, False), (64, True), (65, False), (150, True)])
def test_flash_attention_matches_torch_autograd(t, alibi, dtype, tol):
    """One query block, exactly one, one plus a row, a ragged third block; with and without
    ALiBi: output, input gradient and every weight gradient."""
    c, h = 16, 4
    attn = nn.FlashSelfAttention(c, h, alibi=alibi, rng=1, dtype=dtype)
    x, dy = rand(2, t, c, seed=1).astype(dtype), rand(2, t, c, seed=2).astype(dtype)
    y, dx = attn(x), None
    dx = attn.backward(dy)
    ty, tdx, tgrads = torch_attention(attn, x, dy, alibi, torch.float64)
    assert y.dtype == np.dtype(dtype) and dx.dtype == np.dtype(dtype)
    assert relative_error(y, ty) < tol
    assert relative_error(dx, tdx) < tol
    for name, p in attn.named_parameters():
        assert relative_error(p.grad, tgrads[name]) < tol, name


def test_flash_attention_in_bfloat16_matches_torch_in_bfloat16():
    """bf16 weights and inputs: zerosim computes attention in fp32 and rounds at the matrices'
    edges; torch's bf16 autograd rounds inside too, so both are held to float64 math on the
    same bf16 values at bf16's tolerance, and to each other."""
    c, h, t = 16, 4, 80
    attn = nn.FlashSelfAttention(c, h, rng=3, dtype="bfloat16")
    x = rand(2, t, c, seed=4).astype(ml_dtypes.bfloat16)
    dy = rand(2, t, c, seed=5).astype(ml_dtypes.bfloat16)
    y, dx = attn(x), None
    dx = attn.backward(dy)
    exact = torch_attention(attn, x.astype(np.float64), dy.astype(np.float64), False, torch.float64)
    bf16 = torch_attention(attn, x.astype(np.float64), dy.astype(np.float64), False, torch.bfloat16)
    for ours, theirs, want in ((y, bf16[0], exact[0]), (dx, bf16[1], exact[1])):
        assert relative_error(ours.astype(np.float64), want) < 2e-2
        assert relative_error(theirs, want) < 5e-2  # torch's own bf16 error, for scale
    for name, p in attn.named_parameters():
        assert relative_error(p.grad.astype(np.float64), exact[2][name]) < 2e-2, name


def test_flash_equals_the_standard_layer_with_the_same_weights():
    std = nn.CausalSelfAttention(24, 3, alibi=True, rng=5, dtype="float64")
    flash = nn.FlashSelfAttention(24, 3, alibi=True, rng=5, dtype="float64")
    x, dy = rand(3, 100, 24, seed=6), rand(3, 100, 24, seed=7)
    assert relative_error(flash(x), std(x)) < 1e-13
    assert relative_error(flash.backward(dy), std.backward(dy)) < 1e-13


def test_flash_attention_refuses_attention_dropout():
    with pytest.raises(ValueError, match="dropout must be 0.0.*got dropout=0.1"):
        nn.FlashSelfAttention(16, 4, dropout=0.1)


def _kept_after_forward(layer_type, b, t, c, h, dtype):
    """Activation bytes alive after one shape-only forward (the output included)."""
    with meta.tracking() as tracker:
        with shape_only_init():
            layer = layer_type(c, h, dtype=dtype)
        x = xp.zeros((b, t, c), dtype)
        before = tracker.live["activations"]
        y = layer(x)
        kept = tracker.live["activations"] - before
        peak = tracker.peak["activations"] - before
        layer.backward(y)
    return kept, peak


@pytest.mark.parametrize("dtype, size", [("float32", 4), ("bfloat16", 2)])
def test_flash_layer_keeps_the_closed_form_and_no_s_squared_term(dtype, size):
    """Kept after forward: q, k, v (3·B·s·C) and Y (B·s·C, the input c_proj keeps) in the
    model's dtype, the log-sum-exp in fp32 (B·h·s·4 bytes), and the output (B·s·C). The standard
    layer keeps, beyond q, k, v in fp32 and Y, the fp32 probabilities, B·h·s²·4 bytes."""
    b, t, c, h = 2, 1024, 64, 4
    kept, peak = _kept_after_forward(nn.FlashSelfAttention, b, t, c, h, dtype)
    assert kept == (3 + 1 + 1) * b * t * c * size + b * h * t * 4
    std_kept, _ = _kept_after_forward(nn.CausalSelfAttention, b, t, c, h, dtype)
    upcast = b * t * c * (4 if size == 2 else 0)  # fp32 copies of bf16 q, k, v and Y ...
    assert std_kept == (3 * 4 + size + size) * b * t * c + b * h * t * t * 4 + upcast - (
        b * t * c * 4 if size == 2 else 0  # ... of which Y's is freed after c_proj's cast
    )
    # at most: what forward keeps, three (B, h, 64, ≤ s) fp32 tiles of scores, probabilities
    # and their gradient, and eight (B, s, C) arrays at fp32's size (q, k, v in fp32, dY, dq/dk/dv
    # and their 16-bit cast, the input's gradient); an s × s array alone is 8 times the tiles
    tile = b * h * 64 * t * 4
    assert peak <= kept + 3 * tile + 8 * b * t * c * 4 < b * h * t * t * 4


def test_the_dry_runs_memory_and_flops_follow_flash_attention():
    """An fp32 MPT at sequence 256 on one rank: the activation peak (at the loss, after every
    block's forward) loses each layer's probabilities and gains its log-sum-exp,
    L·B·h·(s² − s)·4 bytes; backward multiplies q kᵀ once more for every (query, key) pair the
    causal blocks of 64 compute, 2·d·B·h·L·Σ_blocks 64·e FLOPs."""
    desc = nn.PRESETS["mpt-125m"].tiny().with_(seq=256)
    b, s, layers, h, d = 2, desc.seq, desc.layers, desc.heads, desc.head_dim
    cfg = {
        "train_micro_batch_size_per_gpu": b,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 0},
    }
    std, flash = (
        dry_run(dataclasses.replace(desc, attention=a), 1, cfg)["ranks"][0]
        for a in ("standard", "flash")
    )
    drop = layers * b * h * (s * s - s) * 4
    assert std["activation_peak_bytes"] - flash["activation_peak_bytes"] == drop
    pairs = sum(64 * e for e in range(64, s + 1, 64))
    assert flash["flops"] - std["flops"] == 2 * d * b * h * layers * pairs


def test_a_description_says_flash_only_where_it_is_built():
    assert nn.PRESETS["mpt-7b"].with_(attention="flash").attention == "flash"
    with pytest.raises(ValueError, match="attention must be one of"):
        nn.PRESETS["mpt-7b"].with_(attention="fast")
    with pytest.raises(ValueError, match="attention='flash' is built for packed attention"):
        nn.PRESETS["llama2-7b"].with_(attention="flash")
    model = nn.Transformer(nn.PRESETS["mpt-125m"].tiny().with_(attention="flash"))
    assert all(isinstance(block.attn, nn.FlashSelfAttention) for block in model.blocks)


def test_the_dry_run_of_a_gpu_counts_the_tiles_flops_in_one_kernel_per_pass():
    """Standing for a GPU, each pass is FlashAttention's one fused kernel: the FLOPs of the tiles
    computed on the host's path, and the same bytes kept for backward; no tile in device memory,
    so the activation peak is at most the host path's."""
    desc = nn.PRESETS["mpt-125m"].tiny().with_(seq=200, attention="flash")
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 0},
        "bf16": {"enabled": True},
    }
    host, gpu = (dry_run(desc, 1, cfg, backend=b)["ranks"][0] for b in ("numpy", "cupy"))
    assert gpu["flops"] == host["flops"]
    assert gpu["activation_peak_bytes"] <= host["activation_peak_bytes"]
