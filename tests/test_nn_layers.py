"""Every layer's hand-written backward against finite differences (float64), and the
layers' forward values against torch (GELU, LayerNorm, BatchNorm1d, losses, attention)."""

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import zerosim.nn as nn
from zerosim.backend import resolve_dtype
from zerosim.nn.functional import erfc
from zerosim.nn.gradcheck import gradcheck, relative_error

TOL = 1e-6


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def assert_gradcheck(module, *inputs):
    errors = gradcheck(module, *inputs)
    assert errors, "nothing was checked"
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOL, f"{worst}: relative error {errors[worst]:.2e}"


@pytest.mark.parametrize("shape", [(1, 3), (4, 3), (2, 5, 3)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_backward_matches_finite_differences(shape, bias):
    assert_gradcheck(nn.Linear(3, 5, bias, rng=1, dtype="float64"), rand(*shape))


def test_embedding_backward_sums_repeated_ids_like_finite_differences():
    emb = nn.Embedding(5, 3, rng=2, dtype="float64")
    ids = np.array([[0, 4, 4], [1, 0, 4]])
    errors = gradcheck(emb, ids)
    assert errors["weight"] <= TOL
    assert np.all(emb.weight.grad[[2, 3]] == 0)  # rows never looked up get no gradient


@pytest.mark.parametrize(
    "kwargs", [{}, {"bias": False}, {"elementwise_affine": False}, {"eps": 1e-3}]
)
@pytest.mark.parametrize("shape", [(1, 7), (3, 2, 7)])
def test_layernorm_backward_matches_finite_differences(kwargs, shape):
    ln = nn.LayerNorm(7, dtype="float64", **kwargs)
    if ln.weight is not None:  # move away from the trivial weight 1 / bias 0
        ln.weight.data[...] = rand(7, seed=3) + 1
    if ln.bias is not None:
        ln.bias.data[...] = rand(7, seed=4)
    assert_gradcheck(ln, rand(*shape) * 3 + 1)


@pytest.mark.parametrize("shape", [(2, 3), (5, 3), (2, 3, 4)])
@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_backward_matches_finite_differences(shape, training):
    bn = nn.BatchNorm1d(3, dtype="float64")
    bn.weight.data[...] = rand(3, seed=5) + 1
    bn.bias.data[...] = rand(3, seed=6)
    bn.running_mean[...] = rand(3, seed=7)
    bn.running_var[...] = rand(3, seed=8) ** 2 + 0.5
    bn.train(training)
    assert_gradcheck(bn, rand(*shape) * 2 + 1)


@pytest.mark.parametrize(
    "layer", [nn.ReLU(), nn.Tanh(), nn.GELU("none"), nn.GELU("tanh")], ids=repr
)
@pytest.mark.parametrize("shape", [(1,), (3, 5), (2, 3, 4)])
def test_activation_backward_matches_finite_differences(layer, shape):
    assert_gradcheck(layer, rand(*shape) * 2)


def test_dropout_backward_matches_finite_differences_with_a_fixed_mask():
    drop = nn.Dropout(0.4, rng=11)
    drop.register_forward_pre_hook(lambda m, args: setattr(m, "rng", np.random.default_rng(11)))
    assert_gradcheck(drop, rand(4, 6))


def test_dropout_zeroes_about_p_scales_the_rest_and_is_seeded():
    x = np.ones((200, 100))
    y = nn.Dropout(0.3, rng=5)(x)
    assert abs((y == 0).mean() - 0.3) < 0.02
    np.testing.assert_allclose(y[y != 0], 1 / 0.7)
    np.testing.assert_array_equal(y, nn.Dropout(0.3, rng=5)(x))
    assert not np.array_equal(y, nn.Dropout(0.3, rng=6)(x))


def test_dropout_is_the_identity_in_eval_mode():
    drop = nn.Dropout(0.9, rng=0).eval()
    x = rand(3, 4)
    assert drop(x) is x
    g = rand(3, 4, seed=1)
    assert drop.backward(g) is g


@pytest.mark.parametrize("shape", [(1, 1, 4), (2, 3, 6), (1, 5, 6)])
def test_attention_backward_matches_finite_differences(shape):
    attn = nn.CausalSelfAttention(shape[-1], n_head=2, rng=3, dtype="float64")
    assert_gradcheck(attn, rand(*shape))


@pytest.mark.parametrize("t", [5, 7])
def test_attention_backward_matches_finite_differences_across_query_blocks(monkeypatch, t):
    """Blocks of 2 positions, so the causal block loops (and a ragged last block) are
    exercised on a sequence small enough for finite differences."""
    from zerosim.nn import attention

    monkeypatch.setattr(attention, "QUERY_BLOCK", 2)
    attn = nn.CausalSelfAttention(6, n_head=2, rng=3, dtype="float64")
    assert_gradcheck(attn, rand(2, t, 6))


@pytest.mark.parametrize("t", [64, 65, 150])
def test_attention_forward_and_backward_match_torch_autograd_on_long_sequences(t):
    """T beyond one query block of 64 (exactly one, one plus a row, and a ragged third
    block): output, input gradient and every weight gradient against torch autograd."""
    c, h = 16, 4
    attn = nn.CausalSelfAttention(c, n_head=h, rng=1, dtype="float64")
    x, dy = rand(2, t, c, seed=1), rand(2, t, c, seed=2)
    y = attn(x)
    dx = attn.backward(dy)

    tx = torch.tensor(x, requires_grad=True)
    w = {n: torch.tensor(p.data, requires_grad=True) for n, p in attn.named_parameters()}
    qkv = F.linear(tx, w["c_attn.weight"], w["c_attn.bias"]).reshape(2, t, 3, h, c // h)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    ty = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ty = F.linear(ty.transpose(1, 2).reshape(2, t, c), w["c_proj.weight"], w["c_proj.bias"])
    ty.backward(torch.tensor(dy))

    assert relative_error(y, ty.detach().numpy()) < 1e-12
    assert relative_error(dx, tx.grad.numpy()) < 1e-12
    for name, p in attn.named_parameters():
        assert relative_error(p.grad, w[name].grad.numpy()) < 1e-12, name


def test_attention_dropout_mask_is_the_same_with_and_without_query_blocks(monkeypatch):
    """Blocks change only which products are computed: with dropout on, the same seed
    gives the same output and gradients whatever the block length."""
    from zerosim.nn import attention

    x, dy = rand(2, 9, 6, seed=4), rand(2, 9, 6, seed=5)
    results = []
    for block in (64, 2):
        monkeypatch.setattr(attention, "QUERY_BLOCK", block)
        attn = nn.CausalSelfAttention(6, n_head=2, dropout=0.3, rng=7, dtype="float64")
        results.append((attn(x), attn.backward(dy), attn.c_attn.weight.grad.copy()))
    for a, b in zip(*results, strict=True):
        assert relative_error(a, b) < 1e-13


def test_block_and_feedforward_backward_match_finite_differences():
    block = nn.Block(4, n_head=2, gelu_approximate="none", rng=4, dtype="float64")
    for p in block.parameters():  # LayerNorm weights away from 1, biases away from 0
        p.data[...] += 0.3 * rand(*p.shape, seed=p.numel)
    assert_gradcheck(block, rand(2, 3, 4))
    assert_gradcheck(nn.FeedForward(4, rng=5, dtype="float64"), rand(3, 4))


@pytest.mark.parametrize("n", [1, 6])
def test_cross_entropy_backward_matches_finite_differences(n):
    targets = np.arange(n) % 4
    targets[-1] = -100 if n > 1 else targets[-1]  # an ignored row when there are several
    assert_gradcheck(nn.CrossEntropyLoss(), rand(n, 4) * 3, targets)
    assert_gradcheck(nn.CrossEntropyLoss(recompute_softmax=True), rand(n, 4) * 3, targets)


def test_mse_and_sequential_backward_match_finite_differences():
    assert_gradcheck(nn.MSELoss(), rand(3, 2), rand(3, 2, seed=1))
    seq = nn.Sequential(nn.Linear(3, 4, rng=0, dtype="float64"), nn.Tanh())
    assert_gradcheck(seq, rand(2, 3))


def test_gradcheck_detects_a_wrong_backward():
    class Wrong(nn.ReLU):
        def _backward(self, grad):
            return super()._backward(grad) * 1.001

    assert gradcheck(Wrong(), rand(3, 4))["input0"] > 1e-4


# --- forward values against torch -----------------------------------------------------


def test_erfc_matches_the_c_library_across_its_range():
    x = np.concatenate([np.linspace(-8, 27, 20001), [0.0, -1e-12, 1e-300]])
    got = erfc(x)
    expected = np.array([math.erfc(v) for v in x])
    tail = x >= 26  # erfc(26) < 6e-296: returned as 0
    assert np.max(np.abs(got - expected)[~tail] / expected[~tail]) < 5e-13
    assert np.all(got[tail] == 0)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_and_its_gradient_match_torch(approximate):
    x = rand(1000) * 4
    layer = nn.GELU(approximate)
    y = layer(x)
    dx = layer.backward(np.ones_like(x))
    xt = torch.tensor(x, requires_grad=True)
    yt = F.gelu(xt, approximate=approximate)
    yt.sum().backward()
    assert relative_error(y, yt.detach().numpy()) < 1e-14
    assert relative_error(dx, xt.grad.numpy()) < 1e-14


def test_layernorm_forward_matches_torch():
    x = rand(4, 9) * 5 + 2
    ln = nn.LayerNorm(9, dtype="float64")
    ln.weight.data[...] = rand(9, seed=1)
    tln = torch.nn.LayerNorm(9, dtype=torch.float64)
    with torch.no_grad():
        tln.weight.copy_(torch.tensor(ln.weight.data))
    assert relative_error(ln(x), tln(torch.tensor(x)).detach().numpy()) < 1e-14


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_running_statistics_match_torch(momentum):
    bn = nn.BatchNorm1d(3, momentum=momentum, dtype="float64")
    tbn = torch.nn.BatchNorm1d(3, momentum=momentum, dtype=torch.float64)
    for step, shape in enumerate([(4, 3), (6, 3, 2), (2, 3)]):
        x = rand(*shape, seed=step) * (step + 1) + step
        y, ty = bn(x), tbn(torch.tensor(x)).detach().numpy()
        assert relative_error(y, ty) < 1e-13
    for name in ("running_mean", "running_var"):
        assert relative_error(getattr(bn, name), getattr(tbn, name).numpy()) < 1e-13
    assert int(bn.num_batches_tracked) == int(tbn.num_batches_tracked) == 3
    bn.eval(), tbn.eval()
    x = rand(5, 3, seed=9)
    assert relative_error(bn(x), tbn(torch.tensor(x)).detach().numpy()) < 1e-13


def test_batchnorm_rejects_a_single_value_per_channel_when_training():
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        nn.BatchNorm1d(3)(np.ones((1, 3), np.float32))


def test_cross_entropy_with_ignore_index_matches_torch():
    logits, targets = rand(6, 5) * 4, np.array([0, 4, -1, 2, -1, 3])
    loss_fn = nn.CrossEntropyLoss(ignore_index=-1)
    loss = loss_fn(logits, targets)
    dlogits, dtargets = loss_fn.backward(np.array(2.0))
    lt = torch.tensor(logits, requires_grad=True)
    tloss = F.cross_entropy(lt, torch.tensor(targets), ignore_index=-1)
    (2 * tloss).backward()
    assert abs(float(loss) - tloss.item()) < 1e-14
    assert relative_error(dlogits, lt.grad.numpy()) < 1e-14
    assert dtargets is None


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_cross_entropy_recomputing_the_softmax_matches_torch_and_leaves_the_logits(dtype):
    """flash-attn's way (``recompute_softmax``): the logits and log-sum-exp kept, softmax
    recomputed in backward; the loss and gradient are torch's, the logits untouched (a trainer
    still reads them). bf16 logits: torch's float32 arithmetic on their values, d rounded."""
    logits = (rand(6, 5) * 4).astype(resolve_dtype(dtype))
    targets = np.array([0, 4, -1, 2, -1, 3])
    kept = logits.copy()
    loss_fn = nn.CrossEntropyLoss(ignore_index=-1, recompute_softmax=True)
    loss = loss_fn(logits, targets)
    dlogits, _ = loss_fn.backward(np.array(2.0))
    lt = torch.tensor(logits.astype(np.float64), requires_grad=True)
    tloss = F.cross_entropy(lt, torch.tensor(targets), ignore_index=-1)
    (2 * tloss).backward()
    assert float(loss) == pytest.approx(tloss.item(), rel=1e-14 if dtype == "float64" else 1e-6)
    tolerance = 1e-14 if dtype == "float64" else 2**-7  # d rounded to bf16
    assert relative_error(dlogits.astype(np.float64), lt.grad.numpy()) < tolerance
    assert dlogits.dtype == logits.dtype and np.array_equal(logits, kept)


def test_cross_entropy_with_every_target_ignored_is_nan_like_torch_with_zero_gradient():
    logits, targets = rand(3, 4), np.full(3, -100)
    loss_fn = nn.CrossEntropyLoss()
    loss = loss_fn(logits, targets)
    assert np.isnan(loss) and math.isnan(
        F.cross_entropy(torch.tensor(logits), torch.tensor(targets)).item()
    )
    dlogits, _ = loss_fn.backward(np.array(1.0))
    assert np.all(dlogits == 0)


def test_cross_entropy_rejects_targets_out_of_range():
    with pytest.raises(IndexError, match=r"\[0, 3\)"):
        nn.CrossEntropyLoss()(np.zeros((2, 3)), np.array([0, 3]))


def test_attention_forward_matches_torch_scaled_dot_product_attention():
    attn = nn.CausalSelfAttention(8, n_head=2, rng=0, dtype="float64")
    x = rand(2, 5, 8)
    q, k, v = (attn.c_attn(x) @ np.eye(24)).reshape(2, 5, 3, 2, 4).transpose(2, 0, 3, 1, 4)
    with torch.no_grad():
        y = F.scaled_dot_product_attention(*map(torch.tensor, (q, k, v)), is_causal=True)
    y = y.numpy().transpose(0, 2, 1, 3).reshape(2, 5, 8)
    expected = y @ attn.c_proj.weight.data.T + attn.c_proj.bias.data
    attn.clear_saved()
    assert relative_error(attn(x), expected) < 1e-13


# --- 16-bit storage with float32 accumulation ------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_layers_match_float32_on_the_rounded_values(dtype):
    """Linear, attention and the loss in 16 bits equal float64 math on the same 16-bit
    inputs up to rounding of the outputs (float32 accumulation inside)."""
    tol = {"float16": 4e-3, "bfloat16": 3e-2}[dtype]
    attn16 = nn.CausalSelfAttention(8, n_head=2, rng=0, dtype=dtype)
    attn64 = nn.CausalSelfAttention(8, n_head=2, rng=0, dtype="float64")
    attn64.load_state_dict({k: v.astype(np.float64) for k, v in attn16.state_dict().items()})
    x16 = rand(2, 5, 8).astype(dtype)
    y16, y64 = attn16(x16), attn64(x16.astype(np.float64))
    assert y16.dtype == np.dtype(dtype)
    assert relative_error(y16, y64) < tol
    g = rand(2, 5, 8, seed=1).astype(dtype)
    dx16, dx64 = attn16.backward(g), attn64.backward(g.astype(np.float64))
    assert dx16.dtype == np.dtype(dtype)
    assert relative_error(dx16, dx64) < tol
    for (name, p16), (_, p64) in zip(
        attn16.named_parameters(), attn64.named_parameters(), strict=True
    ):
        assert p16.grad.dtype == np.dtype(dtype)
        assert relative_error(p16.grad, p64.grad) < tol, name
    logits, targets = rand(64, 50).astype(dtype) * 3, np.arange(64) % 50
    regression = logits[::-1].copy()
    for loss_fn, y, y64 in (
        (nn.CrossEntropyLoss(), targets, targets),
        (nn.MSELoss(), regression, regression.astype(np.float64)),
    ):
        loss16, loss64 = loss_fn(logits, y), loss_fn(logits.astype(np.float64), y64)
        assert loss16.dtype == np.float32
        assert abs(float(loss16) - float(loss64)) < 1e-6 * float(loss64)
        d64 = loss_fn.backward(np.float64(1))[0]  # last in, first out
        d16 = loss_fn.backward(np.float32(1))[0]
        assert d16.dtype == np.dtype(dtype)
        assert relative_error(d64, d16) < tol


def test_float16_overflow_becomes_inf_without_a_warning_for_the_loss_scaler():
    lin = nn.Linear(2, 2, rng=0, dtype="float16")
    big = np.full((1, 2), 60000, np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lin(big)
        lin.backward(big)
    assert np.isinf(lin.weight.grad).all()
    assert lin.weight.grad.dtype == np.float16


def test_erfc_is_one_kernel_where_a_dry_run_stands_for_a_gpu():
    """CuPy's erfc is one element-wise kernel (read x, write the result); the host's path, and
    a host's dry run, evaluate the Chebyshev series, many passes."""
    from zerosim import meta
    from zerosim.nn.functional import erfc

    x = meta.NAMESPACE.zeros((8, 16), "float32")
    for backend, calls in (("cupy", {"erfc": 1}), ("numpy", None)):
        with meta.tracking(backend=backend) as t:
            t.ops.clear()
            erfc(x)
        assert t.ops == calls if calls else t.ops.get("erfc") is None and sum(t.ops.values()) > 40
        if calls:
            assert t.op_bytes == 2 * 8 * 16 * 4
