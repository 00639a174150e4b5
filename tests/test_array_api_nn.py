"""zerosim.nn on array_api_strict arrays held on its non-host Device("device1").

Each case builds the same module twice from the same seed (parameters are drawn on the host),
moves one copy with ``.to(backend="array_api_strict")``, crosses the same input with
``from_host`` and runs forward and backward on both. Any NumPy-only call left on the hot path
raises there (device arrays refuse ``numpy.asarray`` and have no NumPy methods), and float64
outputs, input gradients and parameter gradients must equal the NumPy run's within 1e-12.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from zerosim import nn
from zerosim.backend import crossings, from_host, get_backend, to_host
from zerosim.nn.gradcheck import gradcheck

array_api_strict = pytest.importorskip(
    "array_api_strict",
    reason="array-api-strict (the stand-in device) is in the test extra",
)

DEVICE = array_api_strict.Device("device1")
STRICT = "array_api_strict"
TOLERANCE = 1e-12


def strict_xp() -> Any:
    return get_backend(STRICT).xp


def to_device(a: np.ndarray) -> Any:
    return from_host(a, xp=strict_xp())


def assert_matches(host: Any, device: Any, what: str, tolerance: float = TOLERANCE) -> None:
    """``device`` is on device1, has ``host``'s dtype and equals it within ``tolerance``
    (relative to the largest magnitude, at least 1)."""
    assert device.device == DEVICE, f"{what} left the device: {device.device}"
    got = to_host(device)
    assert got.dtype == host.dtype, f"{what}: dtype {got.dtype}, expected {host.dtype}"
    assert got.shape == host.shape, f"{what}: shape {got.shape}, expected {host.shape}"
    scale = max(1.0, float(np.max(np.abs(host), initial=0.0)))
    assert np.array_equal(np.isnan(got), np.isnan(host)), f"{what}: NaNs differ"
    error = float(np.max(np.abs(np.nan_to_num(got - host)), initial=0.0))
    assert error <= tolerance * scale, f"{what} differs from the NumPy run by {error:.3g}"


def rng(seed: int = 7) -> np.random.Generator:
    return np.random.default_rng(seed)


# --- modules: forward(x), backward(upstream) ---------------------------------------------

Case = tuple[Callable[[], nn.Module], Callable[[], np.ndarray]]


def normal(*shape: int) -> Callable[[], np.ndarray]:
    return lambda: rng().standard_normal(shape)


MODULES: dict[str, Case] = {
    "linear": (lambda: nn.Linear(5, 3, rng=1, dtype="float64"), normal(2, 4, 5)),
    "linear_no_bias": (lambda: nn.Linear(5, 3, bias=False, rng=1, dtype="float64"), normal(4, 5)),
    "layernorm": (lambda: nn.LayerNorm(6, dtype="float64"), normal(3, 4, 6)),
    "layernorm_plain": (
        lambda: nn.LayerNorm(6, elementwise_affine=False, dtype="float64"),
        normal(3, 6),
    ),
    "batchnorm_3d": (lambda: nn.BatchNorm1d(3, dtype="float64"), normal(4, 3, 5)),
    "relu": (nn.ReLU, normal(3, 7)),
    "tanh": (nn.Tanh, normal(3, 7)),
    "gelu": (nn.GELU, lambda: 4 * rng().standard_normal((3, 7))),
    "gelu_tanh": (lambda: nn.GELU("tanh"), lambda: 4 * rng().standard_normal((3, 7))),
    "dropout": (lambda: nn.Dropout(0.4, rng=3), normal(5, 6)),
    # T = 70 > QUERY_BLOCK: two causal blocks, the skipped upper-right one included
    "attention": (
        lambda: nn.CausalSelfAttention(8, 2, dropout=0.2, rng=2, dtype="float64"),
        normal(2, 70, 8),
    ),
    # ALiBi's bias is built where the scores live (MPT's and BLOOM's attention, and GQA's)
    "attention_alibi": (
        lambda: nn.CausalSelfAttention(8, 2, alibi=True, rng=2, dtype="float64"),
        normal(2, 70, 8),
    ),
    "gqa_alibi": (
        lambda: nn.GroupedQueryAttention(8, 4, 2, positions="alibi", rng=2, dtype="float64"),
        normal(2, 9, 8),
    ),
    "feedforward": (
        lambda: nn.FeedForward(8, dropout=0.1, rng=2, dtype="float64"),
        normal(2, 5, 8),
    ),
    "block": (lambda: nn.Block(8, 2, dropout=0.1, rng=4, dtype="float64"), normal(2, 6, 8)),
    "checkpointed_block": (
        lambda: nn.checkpoint(nn.Block(8, 2, dropout=0.1, rng=4, dtype="float64")),
        normal(2, 6, 8),
    ),
    "sequential": (
        lambda: nn.Sequential(
            nn.Linear(4, 6, rng=1, dtype="float64"), nn.GELU("tanh"), nn.Linear(6, 2, rng=2)
        ).to("float64"),
        normal(3, 4),
    ),
}


def run_module(module: nn.Module, x: Any, upstream: Any) -> tuple[Any, Any, dict[str, Any]]:
    y = module(x)
    dx = module.backward(upstream)
    return y, dx, {name: p.grad for name, p in module.named_parameters()}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_forward_and_backward_on_device1_equal_the_numpy_run(name: str) -> None:
    make, data = MODULES[name]
    x = data()
    upstream = rng(11).standard_normal(np.shape(make()(x)))
    y0, dx0, grads0 = run_module(make(), x, upstream)
    device_module = make().to(backend=STRICT)
    y1, dx1, grads1 = run_module(device_module, to_device(x), to_device(upstream))
    assert_matches(y0, y1, "output")
    assert_matches(dx0, dx1, "input gradient")
    assert grads0.keys() == grads1.keys()
    for key in grads0:
        assert_matches(grads0[key], grads1[key], f"{key}.grad")
    for key, buffer in device_module.named_buffers():
        assert buffer.device == DEVICE, f"buffer {key} left the device"


# --- losses: forward(prediction, target), backward(seed) -------------------------------------


def cross_entropy_case() -> tuple[nn.Module, np.ndarray, np.ndarray]:
    targets = np.array([2, -100, 0, 4, 1, -100])
    return nn.CrossEntropyLoss(), rng().standard_normal((6, 5)), targets


def recomputing_cross_entropy_case() -> tuple[nn.Module, np.ndarray, np.ndarray]:
    _, logits, targets = cross_entropy_case()
    return nn.CrossEntropyLoss(recompute_softmax=True), logits, targets


def mse_case() -> tuple[nn.Module, np.ndarray, np.ndarray]:
    return (
        nn.MSELoss(reduction="sum"),
        rng().standard_normal((4, 3)),
        rng(2).standard_normal((4, 3)),
    )


@pytest.mark.parametrize(
    "make",
    [cross_entropy_case, recomputing_cross_entropy_case, mse_case],
    ids=["cross_entropy", "cross_entropy_recomputed", "mse"],
)
def test_loss_and_its_gradient_on_device1_equal_the_numpy_run(make: Callable[..., Any]) -> None:
    loss_fn, prediction, target = make()
    loss0 = loss_fn(prediction, target)
    d0, _ = loss_fn.backward(np.asarray(0.5))
    loss_fn, _, _ = make()
    loss1 = loss_fn(to_device(prediction), to_device(target))
    d1, none = loss_fn.backward(strict_xp().asarray(0.5, dtype=np.float64))
    assert none is None
    assert_matches(np.asarray(loss0), loss1, "loss")
    assert_matches(d0, d1, "prediction gradient")


def test_cross_entropy_with_every_target_ignored_is_nan_with_zero_gradient_on_device1() -> None:
    loss_fn = nn.CrossEntropyLoss()
    loss = loss_fn(to_device(rng().standard_normal((3, 4))), to_device(np.full(3, -100)))
    (grad, _) = loss_fn.backward(1.0)
    assert np.isnan(to_host(loss)) and grad.device == DEVICE
    assert not np.any(to_host(grad))


# --- the models: model(x, y), model.backward(scale) -----------------------------------------

MODELS: dict[str, Callable[[], tuple[nn.LossModel, np.ndarray, np.ndarray]]] = {
    "mlp_relu_cross_entropy": lambda: (
        nn.MLP([5, 8, 8, 3], dtype="float64", seed=1),
        rng().standard_normal((6, 5)),
        rng(3).integers(0, 3, 6),
    ),
    "mlp_tanh_mse": lambda: (
        nn.MLP([5, 8, 2], activation="tanh", loss="mse", dtype="float64", seed=1),
        rng().standard_normal((6, 5)),
        rng(3).standard_normal((6, 2)),
    ),
    "gpt_dropout_tied": lambda: (
        nn.GPT(13, 12, 2, 2, 8, dropout=0.1, tie_weights=True, dtype="float64", seed=2),
        rng().integers(0, 13, (3, 12)),
        rng(3).integers(-1, 13, (3, 12)),
    ),
    "gpt_exact_gelu_checkpointed": lambda: checkpointed(
        nn.GPT(13, 12, 2, 2, 8, dropout=0.1, gelu_approximate="none", dtype="float64", seed=2),
        rng().integers(0, 13, (3, 12)),
        rng(3).integers(-1, 13, (3, 12)),
    ),
}


def checkpointed(model: nn.GPT, x: np.ndarray, y: np.ndarray) -> tuple[nn.GPT, Any, Any]:
    for i, block in enumerate(model.blocks):
        model.blocks[i] = nn.checkpoint(block)
    return model, x, y


def train_twice(model: nn.LossModel, x: Any, y: Any) -> tuple[list[Any], dict[str, Any]]:
    """Two forward/backward passes accumulating into the same gradients (the second one
    adds into existing ``.grad`` arrays), with forward and backward hooks on every module
    recording the device of what they see."""
    seen: list[Any] = []

    def record(*arrays: Any) -> None:
        seen.extend(a.device if hasattr(a, "device") else "host" for a in arrays if a is not None)

    for m in model.modules():
        m.register_forward_hook(lambda m, args, out: record(out))
        m.register_full_backward_hook(lambda m, gin, gout: record(*gin, *gout))
    losses = [model(x, y)]
    model.backward(1.0)
    losses.append(model(x, y))
    model.backward(0.25)
    return losses, {"hooks saw": seen} | {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_training_passes_on_device1_equal_the_numpy_run(name: str) -> None:
    model, x, y = MODELS[name]()
    losses0, grads0 = train_twice(model, x, y)
    model, _, _ = MODELS[name]()
    model.to(backend=STRICT)
    losses1, grads1 = train_twice(model, to_device(x), to_device(y))
    for loss0, loss1 in zip(losses0, losses1, strict=True):
        assert_matches(np.asarray(loss0), loss1, "loss")
    seen0, seen1 = grads0.pop("hooks saw"), grads1.pop("hooks saw")
    assert len(seen1) == len(seen0) > 0 and set(seen1) == {DEVICE}
    for key in grads0:
        assert_matches(grads0[key], grads1[key], f"{key}.grad")
    assert all(p.data.device == DEVICE for p in model.parameters())


def test_gpt_logits_and_their_backward_stay_on_device1() -> None:
    model0, x, _ = MODELS["gpt_dropout_tied"]()
    logits0 = model0(x)
    upstream = rng(5).standard_normal(logits0.shape)
    assert model0.backward(upstream) is None
    model, _, _ = MODELS["gpt_dropout_tied"]()
    model.to(backend=STRICT)
    logits1 = model(to_device(x))
    model.backward(to_device(upstream))
    assert_matches(logits0, logits1, "logits")
    grads0 = dict(model0.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad.device == DEVICE, name
        assert_matches(grads0[name].grad, p.grad, f"{name}.grad")


def test_gpt_in_float32_on_device1_matches_the_numpy_run_to_float32_rounding() -> None:
    def make() -> nn.GPT:
        return nn.GPT(13, 12, 1, 2, 8, dropout=0.1, dtype="float32", seed=2)

    x, y = rng().integers(0, 13, (3, 12)), rng(3).integers(-1, 13, (3, 12))
    model = make()
    loss0 = model(x, y)
    model.backward(1.0)
    device_model = make().to(backend=STRICT)
    loss1 = device_model(to_device(x), to_device(y))
    device_model.backward(1.0)
    assert_matches(np.asarray(loss0), loss1, "loss", tolerance=1e-6)
    for p0, p1 in zip(model.parameters(), device_model.parameters(), strict=True):
        assert p1.dtype == np.float32
        assert_matches(p0.grad, p1.grad, f"{p0.name}.grad", tolerance=1e-6)


# --- what must be refused, and what crosses --------------------------------------------------


def test_a_host_array_given_to_a_device_model_is_refused() -> None:
    model = nn.MLP([4, 3], dtype="float64").to(backend=STRICT)
    with pytest.raises((RuntimeError, TypeError)):
        model(rng().standard_normal((2, 4)), to_device(np.array([0, 1])))


def test_a_device_model_refuses_a_host_gradient_seed_array_of_the_wrong_kind() -> None:
    model = nn.MLP([4, 3], dtype="float64").to(backend=STRICT)
    model(to_device(rng().standard_normal((2, 4))))
    with pytest.raises((RuntimeError, TypeError)):
        model.backward(rng().standard_normal((2, 3)))  # the output's gradient, left on the host


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_on_array_api_strict_raises_a_type_error_before_moving(dtype: str) -> None:
    model = nn.MLP([4, 3], dtype="float32")
    with pytest.raises(TypeError, match=dtype):
        model.to(dtype=dtype, backend=STRICT)
    assert all(isinstance(p.data, np.ndarray) and p.dtype == np.float32 for p in model.parameters())
    half = nn.MLP([4, 3], dtype=dtype)
    with pytest.raises(TypeError, match=dtype):
        half.to(backend=STRICT)
    assert all(isinstance(p.data, np.ndarray) for p in half.parameters())


def test_moving_a_model_crosses_each_array_once_and_dropout_masks_cross_per_forward() -> None:
    model = nn.GPT(13, 12, 1, 2, 8, dropout=0.1, dtype="float64")
    arrays = len(list(model.parameters()))
    before = crossings().from_host_calls
    model.to(backend=STRICT)
    assert crossings().from_host_calls - before == arrays
    x = to_device(rng().integers(0, 13, (2, 12)))
    before = crossings().from_host_calls
    model(x)
    dropouts = sum(isinstance(m, nn.Dropout) for m in model.modules())
    assert crossings().from_host_calls - before == dropouts == 4


def test_cast_back_to_numpy_and_state_dict_round_trip() -> None:
    model = nn.GPT(13, 12, 1, 2, 8, dtype="float64", seed=1)
    host = {k: v.copy() for k, v in model.state_dict().items()}
    model.to(backend=STRICT).to(dtype="float32")
    assert all(p.data.device == DEVICE and p.dtype == np.float32 for p in model.parameters())
    model.to(dtype="float64").load_state_dict(host)  # host arrays cross into device ones
    state = model.state_dict()
    assert all(v.device == DEVICE for v in state.values())
    model.to(backend="numpy")
    for key, value in model.state_dict().items():
        assert isinstance(value, np.ndarray) and np.array_equal(value, host[key]), key


def test_gradcheck_runs_on_device1() -> None:
    module = nn.LayerNorm(4, dtype="float64").to(backend=STRICT)
    module.weight.data[...] = to_device(rng().standard_normal(4))  # a weight that is not 1
    errors = gradcheck(module, to_device(rng(2).standard_normal((3, 4))))
    assert set(errors) == {"weight", "bias", "input0"}
    assert max(errors.values()) < 1e-7


def test_checkpointing_keeps_fewer_saved_bytes_on_device1() -> None:
    def make() -> nn.Block:
        return nn.Block(8, 2, dropout=0.1, rng=4, dtype="float64").to(backend=STRICT)

    x = to_device(rng().standard_normal((2, 6, 8)))
    plain, wrapped = make(), nn.checkpoint(make())
    plain(x)
    wrapped(x)
    assert 0 < nn.saved_bytes(wrapped) < nn.saved_bytes(plain)


def test_out_of_range_ids_and_targets_are_caught_on_device1_with_one_crossing_each() -> None:
    embedding = nn.Embedding(5, 3, dtype="float64").to(backend=STRICT)
    before = crossings().to_host_calls
    embedding(to_device(np.array([[0, 4], [2, 1]])))
    assert crossings().to_host_calls - before == 1  # min and max come back together
    with pytest.raises(IndexError, match="min 0, max 5"):
        embedding(to_device(np.array([0, 5])))
    with pytest.raises(IndexError, match=r"\[0, 4\)"):
        nn.CrossEntropyLoss()(to_device(np.zeros((2, 4))), to_device(np.array([1, 4])))
