"""zerosim.meta: shape-only arrays against NumPy itself, and what the dry run counts."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import zerosim as zs
from zerosim import meta
from zerosim.backend import get_backend, nbytes, shape_only_init, to_host, xp_of
from zerosim.meta.tracker import category_of
from zerosim.nn import GPT

xp = meta.NAMESPACE
BF16 = np.dtype(ml_dtypes.bfloat16)

# Each case runs on a NumPy array of ones and on a MetaArray of the same shape and dtype; NumPy's
# result is the oracle for the shape, the dtype, the strides and whether it is a view.
VIEW_CASES = {
    "int index": lambda a, x: a[1],
    "slices": lambda a, x: a[:, 2:5],
    "step": lambda a, x: a[..., ::2],
    "newaxis": lambda a, x: a[None, :, 1],
    "negative index": lambda a, x: a[-1, ::-2],
    "T": lambda a, x: a.T,
    "mT": lambda a, x: a.mT,
    "transpose": lambda a, x: a.transpose(1, 0, 2),
    "flat reshape": lambda a, x: a.reshape(-1),
    "split axes": lambda a, x: a.reshape(2, 2, 6, 8),
    "transposed reshape (copy)": lambda a, x: a.T.reshape(-1),
    "strided reshape (copy)": lambda a, x: a[:, :, ::2].reshape(4, -1),
    "merge contiguous axes of a slice": lambda a, x: a[1:3].reshape(12, 8),
    "merge of a column slice (copy)": lambda a, x: a[:, 1:3].reshape(8, 8),
    "size-1 axis kept as view": lambda a, x: a[:, :, 3:4].reshape(4, 6),
    "permuted then split": lambda a, x: a.transpose(0, 2, 1).reshape(4, 2, 4, 6),
    "astype same, no copy": lambda a, x: a.astype(a.dtype, copy=False),
    "astype": lambda a, x: a.astype(np.float64),
    "namespace reshape": lambda a, x: x.reshape(a, (6, 4, 8)),
    "permute_dims": lambda a, x: x.permute_dims(a, (2, 0, 1)),
    "ascontiguousarray of a view": lambda a, x: x.ascontiguousarray(a[:, ::2]),
}
RESULT_CASES = {
    "times Python float": lambda a, x: a * 2.0,
    "plus NumPy float64 scalar": lambda a, x: a + np.float64(1),
    "divide ints": lambda a, x: x.astype(a, np.int64) / 2,
    "compare": lambda a, x: a > 0,
    "bf16 times Python float": lambda a, x: x.astype(a, BF16) * 2.0,
    "bf16 plus float32": lambda a, x: x.astype(a, BF16) + a,
    "bf16 exp": lambda a, x: x.exp(x.astype(a, BF16)),
    "sum keepdims": lambda a, x: a.sum(axis=1, keepdims=True),
    "mean": lambda a, x: x.mean(a),
    "max of axes": lambda a, x: x.max(a, axis=(0, 2)),
    "sum ints": lambda a, x: x.sum(x.astype(a, np.int32), axis=-1),
    "sum bools": lambda a, x: x.sum(a > 0),
    "matmul batch": lambda a, x: a @ a.mT,
    "matmul vector right": lambda a, x: a @ x.ones(8, dtype=np.float32),
    "matmul vector left": lambda a, x: x.ones(6, dtype=np.float32) @ a,
    "vecdot": lambda a, x: x.vecdot(a, a, axis=-1),
    "where": lambda a, x: x.where(a > 0, a, 0.0),
    "take": lambda a, x: x.take(a, x.zeros((2, 3), dtype=np.int64), axis=1),
    "take_along_axis": lambda a, x: x.take_along_axis(a, x.zeros((4, 6, 1), np.int64), axis=2),
    "concatenate": lambda a, x: x.concatenate([a, a], axis=1),
    "stack": lambda a, x: x.stack([a, a], axis=1),
    "index array": lambda a, x: a[[0, 2]],
    "index array inside": lambda a, x: a[:, x.zeros(3, dtype=np.int64)],
    "two index arrays": lambda a, x: a[x.arange(4)[:, None], x.zeros(2, dtype=np.int64)],
    "separated index arrays": lambda a, x: a[x.zeros(2, np.int64), :, x.zeros(2, np.int64)],
    "mask (all true)": lambda a, x: a[a > 0],
    "clip": lambda a, x: x.clip(a, -1, 1),
    "round to int8": lambda a, x: x.astype(x.round(a), np.int8) & 0xF,
}


def _arrays(dtype=np.float32):
    return np.ones((4, 6, 8), dtype=dtype), xp.ones((4, 6, 8), dtype=dtype)


@pytest.mark.parametrize("name", sorted(VIEW_CASES))
def test_views_and_copies_are_numpys(name):
    a, m = _arrays()
    want, got = VIEW_CASES[name](a, np), VIEW_CASES[name](m, xp)
    assert (got.shape, got.dtype, got.strides) == (want.shape, want.dtype, want.strides)
    assert got.flags.c_contiguous == want.flags.c_contiguous
    assert (got.base is m.base) == np.shares_memory(want, a), "view or copy, as NumPy"


@pytest.mark.parametrize("name", sorted(RESULT_CASES))
def test_result_shapes_and_dtypes_are_numpys(name):
    a, m = _arrays()
    with np.errstate(all="ignore"):
        want = np.asarray(RESULT_CASES[name](a, np))
    got = RESULT_CASES[name](m, xp)
    assert (tuple(got.shape), np.dtype(got.dtype)) == (want.shape, want.dtype)


def test_in_place_operations_and_out_allocate_nothing():
    with meta.tracking() as t:
        a, b = xp.ones((100, 10), np.float32), xp.ones((100, 10), np.float32)
        before = t.live_total
        a += b
        a *= 2.0
        xp.multiply(a, b, out=a)
        c = xp.empty((10, 10), np.float32)
        xp.matmul(a[:10], b[:10].T, out=c[...])
        a[:, 1:3] = 0
        assert t.live_total == before + 10 * 10 * 4
        with pytest.raises(ValueError):
            a[:, 1:3] = xp.ones((100, 3), np.float32)  # NumPy's broadcast error


def test_allocations_are_counted_until_the_last_view_goes():
    with meta.tracking() as t:
        a = xp.empty((1000, 3), np.float64)
        view = a[10:20]
        assert t.live_total == t.peak_total == 24_000
        del a
        assert t.live_total == 24_000  # the view keeps the buffer, as NumPy's base does
        copy = view.T.reshape(-1)  # 30 elements copied
        del view
        assert t.live_total == 240
        del copy
        assert t.live_total == 0 and t.peak_total == 24_240
        assert t.allocations == 2


def test_matmul_flops_are_two_m_k_n_per_product():
    with meta.tracking() as t:
        a, b = xp.empty((3, 5, 7, 11), np.float32), xp.empty((5, 11, 13), np.float32)
        assert (a @ b).shape == (3, 5, 7, 13)
        assert t.matmul_flops == 2 * 15 * 7 * 11 * 13
        xp.ones(11, np.float32) @ b  # a vector: one row
        assert t.matmul_flops == 2 * 15 * 7 * 11 * 13 + 2 * 5 * 11 * 13


def test_allocation_sites_decide_the_category():
    assert category_of("zerosim.nn.linear", "Linear.forward") == "activations"
    assert category_of("zerosim.nn.parameter", "accumulate_grad") == "gradients"
    assert category_of("zerosim.optim.functional.common", "zeros_state") == "optimizer_states"
    assert category_of("zerosim.optim.functional.common", "_work_buffers") == "temporaries"
    assert category_of("zerosim.zero.stage2", "Stage2.setup_gradients") == "gradients"
    assert category_of("zerosim.zero.buckets", "BufferPool.take") == "buckets"
    assert category_of("zerosim.zero.stage3", "GatherEach.start_gather") == "gathered_params"
    assert category_of("zerosim.engine", "Engine.__call__") == "temporaries"


def test_reads_follow_the_documented_rules():
    with meta.tracking():
        g = xp.empty(10**7, np.float32)
        assert bool(xp.isfinite(g[:100]).all()) is True  # no overflow by default
        assert bool(xp.isnan(g).any()) is False
        assert float(g.sum()) == 0.0  # an unknown value reads as fill
        assert int(xp.count_nonzero(g[:10] > 0)) == 10  # counts are of every element
        assert to_host(xp.zeros((2, 3), np.int64)).tolist() == [[0] * 3] * 2
        with pytest.raises(RuntimeError, match=r"holds no values.*\(10000000,\)"):
            to_host(g)
    with meta.tracking(overflow=True, fill=2.5):
        assert bool(xp.isfinite(g).all()) is False
        assert bool(xp.logical_and(xp.isinf(g[:3]), True).any()) is True
        assert float(g[:1].sum()) == 2.5


def test_the_backend_hands_out_the_meta_namespace():
    backend = get_backend("meta")
    x = backend.zeros((3, 4), "bfloat16")
    assert xp_of(x) is xp and backend.xp is xp
    assert nbytes(x) == 24 and x.device == "meta"
    assert xp_of(backend.asarray(np.ones((2, 2)))).__name__ == "zerosim.meta"


def test_a_model_built_shape_only_holds_its_parameters_and_nothing_else():
    with meta.tracking() as t, shape_only_init():
        model = GPT(vocab_size=1000, block_size=64, n_layer=3, n_head=4, n_embd=128)
    params = list(model.parameters())
    drawn = [p for p in params if not isinstance(p.data, np.ndarray)]  # LayerNorms use np.ones
    assert all(isinstance(p.data, meta.MetaArray) for p in drawn) and len(drawn) > len(params) / 2
    assert t.live["parameters"] == sum(4 * p.numel for p in drawn)
    assert t.live_total == t.live["parameters"]


def _meta_engine_run(stage: int, extra: dict | None = None):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, **(extra or {})},
        "bf16": {"enabled": True},
        "zerosim": {"backend": "meta"},
    }
    with meta.tracking() as t:
        with shape_only_init():
            model = GPT(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=8)
        engine, *_ = zs.initialize(model, cfg, comm=zs.LocalWorld(1).comms()[0])
        x = xp.zeros((2, 16), np.int64)
        for _ in range(2):
            loss = engine(x, x)
            engine.backward(loss)
            engine.step()
        return engine.memory_report(), dict(t.live), t


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_live_bytes_by_category_are_the_memory_report(stage):
    report, live, _ = _meta_engine_run(stage)
    held = report["params"] + report.get("persistent_params", 0)
    assert live["parameters"] == held
    assert live["gradients"] == report["grads"]
    states = sum(v for k, v in report.items() if k.startswith("optimizer_state."))
    assert live["optimizer_states"] == states + report["master_params"]
    assert live["buckets"] == report["bucket_buffers"]
    assert live["activations"] == 0 and live["gathered_params"] == 0  # all freed after a step


def test_matmul_flops_of_a_step_are_the_gpt_formula():
    """One step of a GPT: forward 2·Ψ_matmul·tokens + attention, backward twice that, with the
    logits' matmul; counted here from the layer shapes (no causal block skipping at T ≤ 64)."""
    _, _, t = _meta_engine_run(0)
    b, s, h, v, layers = 2, 16, 8, 50, 2
    per_layer = 2 * b * s * (3 * h * h + h * h + 8 * h * h) + 2 * 2 * b * s * s * h
    forward = layers * per_layer + 2 * b * s * h * v
    assert t.matmul_flops == 2 * 3 * forward  # two steps, forward + backward (2×)


def test_namespace_names_what_it_lacks():
    with pytest.raises(AttributeError, match="no 'fft'.*namespace.py"):
        _ = xp.fft
    assert xp.float32 == np.dtype(np.float32)
    assert math.isinf(xp.inf)


def test_copies_are_counted_as_operations_with_the_bytes_they_move():
    """A cast, a copy, a write into a slice and a concatenation are each one call (a kernel on a
    GPU) that reads its source and writes its result: 10 float32 elements are 40 bytes, as
    bfloat16 20."""
    xp = meta.NAMESPACE
    with meta.tracking() as t:
        a = xp.zeros((10,), "float32")
        a.astype("bfloat16")  # reads 40, writes 20
        a.astype("float32", copy=False)  # no copy: nothing counted
        a.copy()  # 40 + 40
        a[2:6] = xp.zeros((4,), "float32")  # reads 16, writes 16
        a[:] = 0.0  # a scalar: writes 40
        xp.concat([a, a])  # reads 80, writes 80
    assert t.ops == {"astype": 1, "copy": 1, "setitem": 2, "concatenate": 1}
    assert t.op_bytes == 60 + 80 + 32 + 40 + 160
