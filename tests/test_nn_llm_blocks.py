"""Llama's, MPT's and BLOOM's blocks against torch autograd (values and every gradient): RMSNorm,
SwiGLU, rotary embedding, grouped-query attention, ALiBi; in float64, float32 and bfloat16, on odd
shapes; and against finite differences in float64."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch_twins import TorchGQA, TorchPackedAlibiAttention, press_alibi_slopes, rope_cos_sin
from torch_twins import rotate_half as torch_rotate_half

import zerosim.nn as nn
from zerosim.nn.gradcheck import gradcheck, relative_error

TORCH = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
# float64: rounding only; float32: a few ulps through softmax and sums; bfloat16: zerosim keeps
# float32 inside where torch rounds each op to 8 bits, so they differ by a few bf16 ulps (2⁻⁸)
TOL = {"float64": 1e-12, "float32": 2e-5, "bfloat16": 4e-2}


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def as_dtype(a, dtype):
    return a.astype(dtype)


def tensor(a, dtype, grad=False):
    t = torch.tensor(np.asarray(a, np.float64), dtype=TORCH[dtype])
    return t.requires_grad_(grad)


def check_against_torch(module, torch_fn, x, dtype, tol=None):
    """module(x) and its backward of a random g against torch_fn(tx, params) and autograd."""
    tol = TOL[dtype] if tol is None else tol
    module.to(dtype)
    x = as_dtype(x, dtype)
    g = as_dtype(rand(*module(x).shape, seed=9), dtype)
    module.clear_saved()
    module.zero_grad()
    y = module(x)
    dx = module.backward(g)
    tx = tensor(x, dtype, grad=True)
    params = {n: tensor(p.data, dtype, grad=True) for n, p in module.named_parameters()}
    ty = torch_fn(tx, params)
    ty.backward(tensor(g, dtype))
    assert y.dtype == np.dtype(dtype)
    assert relative_error(y, ty.detach().double().numpy()) < tol
    assert relative_error(dx, tx.grad.double().numpy()) < tol
    for name, p in module.named_parameters():
        assert relative_error(p.grad, params[name].grad.double().numpy()) < tol, name


def assert_gradcheck(module, *inputs):
    errors = gradcheck(module, *inputs)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-6, f"{worst}: relative error {errors[worst]:.2e}"


# --- RMSNorm --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(1, 7), (3, 5, 7)])
@pytest.mark.parametrize("eps", [1e-5, 1e-2])
def test_rmsnorm_matches_torch_rms_norm(dtype, shape, eps):
    norm = nn.RMSNorm(7, eps=eps, dtype="float64")
    norm.weight.data[...] = rand(7, seed=1) + 1
    x = rand(*shape, seed=2) * 3 + 0.5

    def oracle(tx, p):
        return F.rms_norm(tx, (7,), p["weight"], eps=eps)

    check_against_torch(norm, oracle, x, dtype)


def test_rmsnorm_backward_matches_finite_differences_and_has_no_bias():
    norm = nn.RMSNorm(5, eps=1e-3, dtype="float64")
    norm.weight.data[...] = rand(5, seed=3) + 1
    assert [n for n, _ in norm.named_parameters()] == ["weight"]
    assert_gradcheck(norm, rand(2, 3, 5) * 2 + 1)


def test_rmsnorm_refuses_a_wrong_last_axis_and_a_bad_eps():
    with pytest.raises(ValueError, match="last axis of 4; got shape"):
        nn.RMSNorm(4)(np.zeros((2, 5), np.float32))
    with pytest.raises(ValueError, match="eps must be a positive float; got 0"):
        nn.RMSNorm(4, eps=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layernorm_and_linear_without_bias_match_torch(dtype):
    ln = nn.LayerNorm(7, bias=False, dtype="float64")
    ln.weight.data[...] = rand(7, seed=4) + 1
    assert [n for n, _ in ln.named_parameters()] == ["weight"]
    x = rand(3, 5, 7, seed=5)
    check_against_torch(ln, lambda tx, p: F.layer_norm(tx, (7,), p["weight"]), x, dtype)
    lin = nn.Linear(7, 3, bias=False, rng=1, dtype="float64")
    assert [n for n, _ in lin.named_parameters()] == ["weight"]
    check_against_torch(lin, lambda tx, p: F.linear(tx, p["weight"]), x, dtype)


# --- SwiGLU ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_matches_torch(dtype, bias):
    mlp = nn.SwiGLU(5, hidden=11, bias=bias, rng=3, dtype="float64")
    names = [n for n, _ in mlp.named_parameters()]
    assert names[:: 2 if bias else 1][:3] == [
        "gate_proj.weight",
        "up_proj.weight",
        "down_proj.weight",
    ]

    def oracle(tx, p):
        def lin(name, u):
            return F.linear(u, p[f"{name}.weight"], p.get(f"{name}.bias"))

        return lin("down_proj", F.silu(lin("gate_proj", tx)) * lin("up_proj", tx))

    check_against_torch(mlp, oracle, rand(2, 3, 5, seed=6) * 2, dtype)


def test_swiglu_backward_matches_finite_differences():
    assert_gradcheck(nn.SwiGLU(4, hidden=6, bias=True, rng=2, dtype="float64"), rand(3, 4) * 2)


# --- rotary position embedding ----------------------------------------------------------------


@pytest.mark.parametrize("base", [10000.0, 500000.0])
@pytest.mark.parametrize("t, d", [(7, 6), (13, 16)])
def test_rotary_rotation_and_its_transpose_match_hf_llama_through_autograd(base, t, d):
    rope = nn.RotaryEmbedding(d, seq=20, base=base)
    assert dict(rope.named_buffers()).keys() == {"cos", "sin"}
    assert list(rope.parameters()) == [] and rope.state_dict() == {}  # not saved, not trained
    x, g = rand(2, 3, t, d, seed=1), rand(2, 3, t, d, seed=2)
    tx = torch.tensor(x, requires_grad=True)
    cos, sin = rope_cos_sin(t, d, base, torch.float64)
    ty = tx * cos + torch_rotate_half(tx) * sin
    ty.backward(torch.tensor(g))
    # the tables are float32 (as HF's for a float32 model): about 1e-7 of the angle's value
    assert relative_error(rope.rotate(x), ty.detach().numpy()) < 1e-6
    assert relative_error(rope.rotate_backward(g), tx.grad.numpy()) < 1e-6
    # a rotation: norms kept, and the transpose undoes it
    assert relative_error(rope.rotate_backward(rope.rotate(x)), x) < 1e-6


def test_rotary_turns_q_dot_k_by_the_difference_of_positions_only():
    rope = nn.RotaryEmbedding(8, seq=16, base=10000.0)
    q, k = rand(8, seed=3), rand(8, seed=4)
    rotated_q = rope.rotate(np.broadcast_to(q, (16, 8)).astype(np.float64))
    rotated_k = rope.rotate(np.broadcast_to(k, (16, 8)).astype(np.float64))
    assert rotated_q[5] @ rotated_k[2] == pytest.approx(rotated_q[13] @ rotated_k[10], rel=1e-6)


def test_rotary_refuses_an_odd_head_size_and_too_long_a_sequence():
    with pytest.raises(ValueError, match="even head_dim; got 5"):
        nn.RotaryEmbedding(5, seq=4)
    with pytest.raises(ValueError, match="cover 4 positions; got T=5"):
        nn.RotaryEmbedding(4, seq=4).rotate(np.zeros((5, 4)))


# --- ALiBi ----------------------------------------------------------------------------------


def mpt_gen_slopes(n_heads, alibi_bias_max=8):
    """llm-foundry's ``gen_slopes`` (llmfoundry/models/layers/attention.py)."""
    n = 2 ** math.ceil(math.log2(n_heads))
    m = torch.arange(1, n + 1, dtype=torch.float64) * (alibi_bias_max / n)
    slopes = 1.0 / torch.pow(2, m)
    if n != n_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes.numpy()


@pytest.mark.parametrize("n", [*range(1, 17), 40, 56, 112])
def test_alibi_slopes_are_press_bloom_and_mpt_s(n):
    slopes = nn.alibi_slopes(n)
    assert relative_error(slopes, np.array(press_alibi_slopes(n))) < 1e-15
    assert relative_error(slopes, mpt_gen_slopes(n)) < 1e-15
    if n & (n - 1) == 0:  # a power of two: 2^(−8h/n)
        assert relative_error(slopes, 2.0 ** (-8.0 * np.arange(1, n + 1) / n)) < 1e-15


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("t", [5, 9])
def test_packed_attention_with_alibi_matches_torch_with_bloom_s_bias(monkeypatch, dtype, t):
    """MPT's/BLOOM's attention: the query blocks of 2 cross the ALiBi bias at every offset."""
    from zerosim.nn import attention

    monkeypatch.setattr(attention, "QUERY_BLOCK", 2)
    attn = nn.CausalSelfAttention(12, n_head=6, alibi=True, rng=2, dtype="float64")
    twin = TorchPackedAlibiAttention(12, 6, True)

    def oracle(tx, p):
        return torch.func.functional_call(twin.to(TORCH[dtype]), p, (tx,))

    check_against_torch(attn, oracle, rand(2, t, 12, seed=7), dtype)


def test_packed_attention_with_alibi_matches_finite_differences():
    attn = nn.CausalSelfAttention(6, n_head=3, alibi=True, rng=3, dtype="float64")
    assert_gradcheck(attn, rand(2, 4, 6))


# --- grouped-query attention ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("kv", [6, 3, 2, 1])  # multi-head … multi-query
@pytest.mark.parametrize("positions", ["none", "rotary", "alibi"])
def test_grouped_query_attention_matches_hf_llama_through_autograd(dtype, kv, positions):
    c, h, t = 24, 6, 7
    attn = nn.GroupedQueryAttention(
        c,
        h,
        kv,
        bias=False,
        positions=positions,
        seq=9,
        rotary_base=500000.0,
        rng=4,
        dtype="float64",
    )
    twin = TorchGQA(c, h, kv, False, positions, 500000.0)
    assert [n for n, _ in attn.named_parameters()] == [n for n, _ in twin.named_parameters()]
    assert attn.k_proj.weight.shape == (kv * 4, c)

    def oracle(tx, p):
        return torch.func.functional_call(twin.to(TORCH[dtype]), p, (tx,))

    tol = 1e-6 if positions == "rotary" and dtype == "float64" else None  # float32 tables
    check_against_torch(attn, oracle, rand(2, t, c, seed=8), dtype, tol)


@pytest.mark.parametrize("kv", [4, 2, 1])
def test_grouped_query_attention_backward_matches_finite_differences(kv):
    attn = nn.GroupedQueryAttention(
        8, 4, kv, bias=True, positions="rotary", seq=5, rng=5, dtype="float64"
    )
    assert_gradcheck(attn, rand(2, 5, 8))


def test_grouped_query_attention_refuses_kv_heads_that_do_not_divide_heads():
    with pytest.raises(ValueError, match="n_kv_head must divide n_head; got n_kv_head=4, n_head=6"):
        nn.GroupedQueryAttention(12, 6, 4)
    with pytest.raises(ValueError, match="positions must be one of"):
        nn.GroupedQueryAttention(12, 6, 2, positions="learned")
