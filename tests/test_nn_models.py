"""MLP and GPT against torch autograd (same weights, loaded by name) and against finite
differences; hooks fire in torch's order; a module used twice; 16-bit models."""

import numpy as np
import pytest
import torch
from torch import nn as tnn
from torch_twins import TorchGPT, TorchMLP

import zerosim.nn as nn
from zerosim.nn.gradcheck import gradcheck, relative_error

TORCH_DTYPES = {"float64": torch.float64, "float32": torch.float32}
ORACLE_TOL = {"float64": 1e-10, "float32": 1e-5}


def copy_weights(model, tmodel, dtype):
    sd = {k: torch.tensor(np.asarray(v)) for k, v in model.state_dict().items()}
    tmodel.to(TORCH_DTYPES[dtype]).load_state_dict(sd)
    return tmodel


def assert_matches_torch(model, tmodel, x, y, tol):
    loss = model(x, y)
    model.backward()
    tx = torch.tensor(x)
    tloss = tmodel(tx.requires_grad_() if tx.is_floating_point() else tx, torch.tensor(y))
    tloss.backward()
    assert relative_error(loss, tloss.item()) <= tol
    tparams = dict(tmodel.named_parameters())
    assert [n for n, _ in model.named_parameters()] == list(tparams)
    for name, p in model.named_parameters():
        assert relative_error(p.grad, tparams[name].grad.numpy()) <= tol, name


def gpt_data(b, t, vocab, seed=0):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, vocab, (b, t))
    targets = rng.integers(0, vocab, (b, t))
    targets[0, 0] = -1  # one ignored position
    return idx, targets


# --- oracle: torch autograd -----------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize(
    "activation,loss", [("relu", "cross_entropy"), ("gelu", "mse"), ("tanh", "cross_entropy")]
)
def test_mlp_loss_and_gradients_match_torch(dtype, activation, loss):
    sizes = [5, 16, 7, 3]
    model = nn.MLP(sizes, activation, loss, seed=3, dtype=dtype)
    tmodel = copy_weights(model, TorchMLP(sizes, activation, loss), dtype)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((9, 5)).astype(dtype)
    y = rng.integers(0, 3, 9) if loss == "cross_entropy" else rng.standard_normal((9, 3))
    assert_matches_torch(
        model, tmodel, x, y.astype(dtype) if loss == "mse" else y, ORACLE_TOL[dtype]
    )


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("bias,tie", [(True, False), (False, True)])
def test_gpt_loss_and_gradients_match_torch(dtype, bias, tie):
    config = dict(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=8)
    model = nn.GPT(**config, bias=bias, tie_weights=tie, seed=1, dtype=dtype)
    tmodel = copy_weights(model, TorchGPT(13, 8, 2, 2, 8, bias=bias, tie=tie), dtype)
    idx, targets = gpt_data(3, 7, 13)
    assert_matches_torch(model, tmodel, idx, targets, ORACLE_TOL[dtype])


def test_gpt_with_exact_gelu_and_output_gradient_matches_torch():
    model = nn.GPT(11, 6, 1, 2, 8, seed=2, dtype="float64", gelu_approximate="none")
    tmodel = copy_weights(model, TorchGPT(11, 6, 1, 2, 8, gelu="none"), "float64")
    idx, _ = gpt_data(2, 6, 11)
    g = np.random.default_rng(1).standard_normal((2, 6, 11))
    logits = model(idx)
    assert model.backward(g) is None
    tlogits = tmodel(torch.tensor(idx))
    tlogits.backward(torch.tensor(g))
    assert relative_error(logits, tlogits.detach().numpy()) <= 1e-12
    tparams = dict(tmodel.named_parameters())
    for name, p in model.named_parameters():
        assert relative_error(p.grad, tparams[name].grad.numpy()) <= 1e-10, name


def test_module_used_twice_in_one_forward_gets_torchs_gradients():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.act = nn.Linear(3, 3, rng=0, dtype="float64"), nn.Tanh()

        def forward(self, x):
            return self.lin(self.act(self.lin(x)))

        def _backward(self, grad):
            return self.lin.backward(self.act.backward(self.lin.backward(grad)))

    model = Twice()
    tlin = tnn.Linear(3, 3).double()
    tlin.load_state_dict({k: torch.tensor(v) for k, v in model.lin.state_dict().items()})
    x, g = np.random.default_rng(0).standard_normal((2, 2, 3)), np.ones((2, 2, 3))
    model(x)
    dx = model.backward(g)
    tx = torch.tensor(x, requires_grad=True)
    tlin(torch.tanh(tlin(tx))).backward(torch.tensor(g))
    assert relative_error(dx, tx.grad.numpy()) <= 1e-13
    lin_grads = dict(model.lin.named_parameters())
    for name, p in tlin.named_parameters():  # both calls' contributions, once each
        assert relative_error(lin_grads[name].grad, p.grad.numpy()) <= 1e-13


# --- finite differences ---------------------------------------------------------------


@pytest.mark.parametrize("activation", ["relu", "gelu", "tanh"])
@pytest.mark.parametrize("loss,batch", [("cross_entropy", 1), ("mse", 3)])
def test_mlp_gradients_match_finite_differences(activation, loss, batch):
    model = nn.MLP([3, 5, 4, 2], activation, loss, seed=4, dtype="float64")
    rng = np.random.default_rng(5)
    x = rng.standard_normal((batch, 3))
    y = rng.integers(0, 2, batch) if loss == "cross_entropy" else rng.standard_normal((batch, 2))
    errors = gradcheck(model, x, y)
    assert max(errors.values()) <= 1e-6, errors


@pytest.mark.parametrize("tie,b,t", [(False, 1, 3), (True, 2, 5)])
def test_gpt_gradients_match_finite_differences(tie, b, t):
    model = nn.GPT(7, 5, 2, 2, 4, tie_weights=tie, seed=6, dtype="float64")
    rng = np.random.default_rng(8)
    for p in model.parameters():  # O(1) weights: gradients well above rounding noise
        p.data[...] += 0.3 * rng.standard_normal(p.shape)
    idx, targets = gpt_data(b, t, 7, seed=7)
    errors = gradcheck(model, idx, targets)
    assert len(errors) == len(list(model.parameters()))
    assert max(errors.values()) <= 1e-6, errors


# --- hooks fire in torch's order ------------------------------------------------------


def record_hooks(named_modules, log, skip_root=False):
    for name, m in named_modules:
        if skip_root and not name:
            continue
        m.register_forward_pre_hook(lambda m, a, n=name: log.append(("forward_pre", n)))
        m.register_forward_hook(lambda m, a, o, n=name: log.append(("forward", n)))
        m.register_full_backward_pre_hook(lambda m, g, n=name: log.append(("backward_pre", n)))
        m.register_full_backward_hook(lambda m, gi, go, n=name: log.append(("backward", n)))


def test_mlp_hooks_fire_in_torchs_order():
    sizes = [4, 6, 5, 3]
    model = nn.MLP(sizes, "gelu", dtype="float64")
    tmodel = copy_weights(model, TorchMLP(sizes, "gelu", "cross_entropy"), "float64")
    ours, theirs = [], []
    record_hooks(model.named_modules(), ours)
    record_hooks(tmodel.named_modules(), theirs)
    x, y = np.random.default_rng(0).standard_normal((2, 4)), np.array([0, 2])
    model(x, y)
    model.backward()
    tmodel(torch.tensor(x, requires_grad=True), torch.tensor(y)).backward()
    assert ours == theirs
    assert ours[-1] == ("backward", "") and ("backward", "layers.0") in ours


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # torch, for wte/wpe
def test_gpt_hooks_fire_in_torchs_order():
    # The root is left out: its inputs (token ids, targets) need no gradient, and for such
    # a module torch fires the full backward hook before its children's (see module.py).
    model = nn.GPT(9, 6, 2, 2, 4, seed=0, dtype="float64")
    tmodel = copy_weights(model, TorchGPT(9, 6, 2, 2, 4), "float64")
    ours, theirs = [], []
    record_hooks(model.named_modules(), ours, skip_root=True)
    record_hooks(tmodel.named_modules(), theirs, skip_root=True)
    idx, targets = gpt_data(2, 5, 9)
    model(idx, targets)
    model.backward()
    tmodel(torch.tensor(idx), torch.tensor(targets)).backward()
    assert ours == theirs
    assert len(ours) == 4 * (len(list(model.modules())) - 2)  # all but the root and blocks


# --- 16-bit storage -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpt_in_16_bits_follows_float32_within_rounding(dtype):
    model16 = nn.GPT(17, 8, 2, 2, 16, seed=8, dtype=dtype)
    model32 = nn.GPT(17, 8, 2, 2, 16, seed=8, dtype="float32")
    model32.load_state_dict({k: v.astype(np.float32) for k, v in model16.state_dict().items()})
    idx, targets = gpt_data(4, 8, 17)
    loss16, loss32 = model16(idx, targets), model32(idx, targets)
    model16.backward()
    model32.backward()
    assert loss16.dtype == np.float32
    assert abs(float(loss16) - float(loss32)) < 1e-2 * float(loss32)
    for (name, p16), (_, p32) in zip(
        model16.named_parameters(), model32.named_parameters(), strict=True
    ):
        assert p16.grad.dtype == np.dtype(dtype)
        assert relative_error(p16.grad, p32.grad) < 0.1, name
