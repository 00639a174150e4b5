"""A layer's marked chain counts as the one kernel PyTorch runs for it, only where a dry run
stands for PyTorch (``meta.fusion``, backend "torch"), and changes nothing else.

Every expected count below is derived here from the shapes: a fused kernel reads each array
argument once and writes each array result once; an epilogue adds nothing to the products it
rides on.
"""

from __future__ import annotations

import numpy as np
import pytest

from zerosim import meta, nn
from zerosim.backend import shape_only_init
from zerosim.dryrun import dry_run
from zerosim.meta.fusion import fused

xp = meta.NAMESPACE
ROWS, C = 24, 16  # a (ROWS, C) bf16 activation: 2 bytes an element
N = ROWS * C


@fused("axpy")
def _axpy(x, y):
    """Three calls on NumPy: a cast, a product, a sum."""
    return x.astype(np.float32) * 2.0 + y


@fused("outer", epilogue=True)
def _outer(a, b):
    c = a.astype(np.float32) @ b.astype(np.float32)  # two casts and a product
    return c + 1.0, _inner(c)


@fused("inner")
def _inner(c):
    return c * c


@fused("absorbed")
def _holds_a_kernel(x):
    return _inner(x) + 1.0


def _ops(backend, fn, *shapes, dtype=np.float32):
    with meta.tracking(backend=backend) as tracker:
        fn(*(xp.zeros(s, dtype) for s in shapes))
    return tracker.ops, tracker.op_bytes, tracker.matmul_flops


def test_a_fused_chain_is_one_kernel_of_its_inputs_and_outputs_under_torch_only():
    ops, moved, _ = _ops("torch", _axpy, (ROWS, C), (ROWS, C))
    assert ops == {"axpy": 1}
    assert moved == 3 * N * 4  # x and y read, the result written, float32
    ops, moved, _ = _ops("cupy", _axpy, (ROWS, C), (ROWS, C))
    assert "axpy" not in ops and sum(ops.values()) == 3  # the cast, the product and the sum
    assert moved > 3 * N * 4


def test_an_epilogue_leaves_its_products_and_a_kernel_inside_it_counts():
    ops, moved, flops = _ops("torch", _outer, (ROWS, C), (C, ROWS))
    assert ops == {"matmul": 1, "inner": 1}
    assert moved == 2 * ROWS * ROWS * 4  # inner: c read, c·c written
    assert flops == 2 * ROWS * C * ROWS


def test_a_kernel_inside_a_kernel_is_part_of_it():
    ops, moved, _ = _ops("torch", _holds_a_kernel, (ROWS, C))
    assert ops == {"absorbed": 1} and moved == 2 * N * 4


def test_a_fused_chains_temporaries_raise_no_peak_under_torch():
    """_axpy makes a float32 copy of x, then the product (the copy is freed once it exists),
    then the sum: two (ROWS, C) float32 arrays live at once on NumPy's path at each step; a
    fused kernel holds only its result."""
    for backend, temporaries in (("cupy", 1), ("torch", 0)):
        with meta.tracking(backend=backend) as tracker:
            x, y = xp.zeros((ROWS, C), np.float32), xp.zeros((ROWS, C), np.float32)
            start = tracker.peak_total
            z = _axpy(x, y)
            assert tracker.live_total == start + z.nbytes
        assert tracker.peak_total == start + (1 + temporaries) * N * 4, backend


def test_the_values_are_the_functions_own_on_numpy():
    x, y = np.arange(6.0).reshape(2, 3), np.ones((2, 3))
    np.testing.assert_array_equal(_axpy(x, y), x * 2.0 + y)
    with meta.tracking(backend="torch"):  # a NumPy array in a torch dry run runs as it is
        np.testing.assert_array_equal(_axpy(x, y), x * 2.0 + y)


def _layer_ops(make, *shapes, backward=True, dtype="bfloat16"):
    """Element-wise kernels of one forward and backward of a layer under torch, by kind."""
    with meta.tracking(backend="torch") as tracker:
        with shape_only_init():
            layer = make()
        args = [xp.zeros(s, dtype) for s in shapes]
        out = layer(*args)
        forward = dict(tracker.ops), tracker.op_bytes
        if backward:
            layer.backward(xp.zeros(out.shape, out.dtype))
    backward_ops = {k: v - forward[0].get(k, 0) for k, v in tracker.ops.items()}
    return forward, ({k: v for k, v in backward_ops.items() if v}, tracker.op_bytes - forward[1])


def test_layer_norm_and_gelu_are_one_kernel_a_pass():
    """LayerNorm forward reads x (2N bytes) and writes y (2N); the row mean and rstd it keeps
    (2·ROWS·4 bytes) are not its result and are not counted; backward reads dy and x (2N each)
    and the two statistics, writes dx (2N). GELU forward reads x, writes y; backward reads x
    and dy, writes dx."""
    (f_ops, f_bytes), (b_ops, b_bytes) = _layer_ops(lambda: nn.LayerNorm(C), (ROWS, C))
    assert f_ops == {"layer_norm": 1} and f_bytes == 2 * N * 2
    assert b_ops == {"layer_norm_backward": 1} and b_bytes == 3 * N * 2 + 2 * ROWS * 4
    (f_ops, f_bytes), (b_ops, b_bytes) = _layer_ops(lambda: nn.GELU("tanh"), (ROWS, C))
    assert f_ops == {"gelu": 1} and f_bytes == 2 * N * 2
    assert b_ops == {"gelu_backward": 1} and b_bytes == 3 * N * 2


def test_a_linear_is_its_products_and_a_bias_reduction():
    """Forward: one product (its casts and bias add are the epilogue). Backward: the two
    products and the bias gradient's reduction, which reads g in float32 (the cast g the
    products read) and writes OUT float32 sums."""
    out = 8
    (f_ops, f_bytes), (b_ops, b_bytes) = _layer_ops(lambda: nn.Linear(C, out), (ROWS, C))
    assert f_ops == {"matmul": 1} and f_bytes == 0
    assert b_ops == {"matmul": 2, "bias_grad": 1} and b_bytes == ROWS * out * 4 + out * 4


def test_the_cross_entropy_is_one_kernel_a_pass():
    """Forward reads the bf16 logits (2 bytes each) and the int64 targets, writes the 0-d
    float32 loss; backward reads the float32 probabilities it kept, the targets, the validity
    mask (1 byte a row) and the 0-d seed, and writes the bf16 gradient."""
    vocab = 32
    with meta.tracking(backend="torch") as tracker:
        loss_fn = nn.CrossEntropyLoss()
        loss = loss_fn(xp.zeros((ROWS, vocab), "bfloat16"), xp.zeros((ROWS,), np.int64))
        assert tracker.ops == {"cross_entropy": 1}
        assert tracker.op_bytes == ROWS * vocab * 2 + ROWS * 8 + 4
        before = tracker.op_bytes
        loss_fn.backward(xp.zeros((), loss.dtype))
    assert tracker.ops == {"cross_entropy": 1, "cross_entropy_backward": 1}
    moved = tracker.op_bytes - before
    assert moved == ROWS * vocab * 4 + ROWS * 8 + ROWS + 4 + ROWS * vocab * 2


def test_the_recomputing_cross_entropy_keeps_the_logits_and_reads_them_in_backward():
    """flash-attn's cross-entropy (``recompute_softmax``) keeps no float32 probabilities
    (4 bytes a logit) but each row's float32 log-sum-exp (4 bytes a row), the logits being
    alive anyway; its backward reads the bf16 logits, the log-sum-exp, the targets, the mask
    and the seed, and writes the bf16 gradient."""
    vocab, kept = 32, {}
    for recompute in (False, True):
        with meta.tracking(backend="torch") as tracker:
            logits = xp.zeros((ROWS, vocab), "bfloat16")
            loss_fn = nn.CrossEntropyLoss(recompute_softmax=recompute)
            before = tracker.live_total
            loss = loss_fn(logits, xp.zeros((ROWS,), np.int64))
            kept[recompute] = tracker.live_total - before
            moved = tracker.op_bytes
            loss_fn.backward(xp.zeros((), loss.dtype))
            moved = tracker.op_bytes - moved
    assert kept[False] - kept[True] == ROWS * vocab * 4 - ROWS * 4
    assert tracker.ops == {"cross_entropy": 1, "cross_entropy_backward": 1}
    assert moved == ROWS * vocab * 2 + ROWS * 4 + ROWS * 8 + ROWS + 4 + ROWS * vocab * 2


def test_a_torch_dry_run_changes_no_collective_and_no_byte_only_the_kernels():
    """A bf16 GPT at stage 3 on 2 ranks: the same bytes sent and received and FLOPs on both
    paths; under torch fewer than half the kernels, the products' launches the same, and a
    peak no higher (the fused chains' temporaries raise none)."""
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
    }
    reports = {b: dry_run("gpt:2,32,64,16,2", 2, cfg, backend=b) for b in ("cupy", "torch")}
    cupy, torch = reports["cupy"], reports["torch"]
    for key in ("bytes_sent", "bytes_received", "flops", "model_states_bytes"):
        assert [r[key] for r in torch["ranks"]] == [r[key] for r in cupy["ranks"]], key
    for fused_rank, plain_rank in zip(torch["ranks"], cupy["ranks"], strict=True):
        assert fused_rank["peak_bytes"] < plain_rank["peak_bytes"]
    ops = {b: r["ranks"][0]["ops"] for b, r in reports.items()}
    assert ops["torch"]["matmul"] == ops["cupy"]["matmul"]
    assert sum(ops["torch"].values()) < sum(ops["cupy"].values()) / 2
    assert {"layer_norm", "gelu_backward", "cross_entropy"} <= set(ops["torch"])


@pytest.mark.parametrize("name", ["gelu", "layer_norm", "linear"])
def test_no_backend_but_torch_counts_a_fused_kernel(name):
    for backend in ("numpy", "cupy"):
        with meta.tracking(backend=backend) as tracker:
            with shape_only_init():
                layer = {"gelu": nn.GELU, "layer_norm": lambda: nn.LayerNorm(C)}.get(
                    name, lambda: nn.Linear(C, C)
                )()
            layer.backward(layer(xp.zeros((ROWS, C), "bfloat16")))
        assert not any(k.startswith((name, "bias_grad")) for k in tracker.ops), backend


def test_attention_scale_mask_and_softmax_are_one_kernel():
    """Megatron's FusedScaleMaskSoftmax: the (ROWS, C) float32 scores scaled, masked by a
    (ROWS, C) additive mask and normalised in one kernel, which reads the scores and the mask
    and writes the scores: 3·N·4 bytes. Under cupy it is the calls one by one."""
    from zerosim.nn.functional import scaled_masked_softmax_

    with meta.tracking(backend="torch") as tracker:
        scaled_masked_softmax_(
            xp.zeros((ROWS, C), np.float32), 0.125, xp.zeros((ROWS, C), np.float32)
        )
    assert (tracker.ops, tracker.op_bytes) == ({"softmax": 1}, 3 * N * 4)
    with meta.tracking(backend="cupy") as tracker:
        scaled_masked_softmax_(
            xp.zeros((ROWS, C), np.float32), 0.125, xp.zeros((ROWS, C), np.float32)
        )
    assert "softmax" not in tracker.ops and sum(tracker.ops.values()) > 3


def test_scaled_masked_softmax_is_torchs_softmax_of_the_masked_scores():
    torch = pytest.importorskip("torch")
    from zerosim.nn.functional import scaled_masked_softmax_

    rng = np.random.default_rng(0)
    z = rng.standard_normal((3, 5, 5)).astype(np.float32)
    mask = np.triu(np.full((5, 5), -np.inf, np.float32), k=1)
    expected = torch.softmax(torch.from_numpy(z) * 0.25 + torch.from_numpy(mask), dim=-1)
    np.testing.assert_allclose(
        scaled_masked_softmax_(z.copy(), 0.25, mask), expected.numpy(), rtol=1e-6, atol=1e-7
    )


def test_softmax_and_the_zeropp_quantizers_are_one_kernel_each():
    """softmax_ reads and writes its (ROWS, C) float32 scores in place: 2·N·4 bytes; its
    backward reads the probabilities and the gradient and writes the gradient: 3·N·4. qwZ's
    8-bit quantize of a (ROWS, C) bf16 row block with blocks of 8 reads x (2N) and writes N
    int8 codes and ROWS·C/8 float32 scales; dequantize reads those and writes N float32."""
    from zerosim.nn.functional import softmax_, softmax_backward_
    from zerosim.zero.zeropp import dequantize, quantize

    with meta.tracking(backend="torch") as tracker:
        z = xp.zeros((ROWS, C), np.float32)
        softmax_(z)
        assert (tracker.ops, tracker.op_bytes) == ({"softmax": 1}, 2 * N * 4)
        softmax_backward_(z, xp.zeros((ROWS, C), np.float32))
        assert tracker.ops["softmax_backward"] == 1
        assert tracker.op_bytes == 2 * N * 4 + 3 * N * 4
    scales = ROWS * C // 8 * 4
    with meta.tracking(backend="torch") as tracker:
        codes, s = quantize(xp.zeros((ROWS, C), "bfloat16"), 8, 8)
        assert (tracker.ops, tracker.op_bytes) == ({"quantize": 1}, 2 * N + N + scales)
        dequantize(codes, s, C, 8, 8)
    assert tracker.ops == {"quantize": 1, "dequantize": 1}
    assert tracker.op_bytes == (2 * N + N + scales) + (N + scales + N * 4)


def test_qwz_dequantizes_into_the_gathered_buffer_and_qgz_is_deepspeeds_three_kernels():
    """qwZ's wait is one kernel reading the N·C int8 codes and N·C/8 float32 scales and writing
    the bf16 buffer (2·N·C), no float32 copy between. qgZ on 4 ranks in 2 nodes of 2, rows of
    C elements, int4 in blocks of 8: ``swizzle_quant`` reads the (4, C) float32 bucket and
    writes 4·C/2 codes and 4·C/8 scales; ``quantized_reduction`` reads the first hop's as many
    and writes the node's 2 partial rows, C/2 codes and C/8 scales each; ``dequantize`` reads
    the second hop's (as many) and writes 2·C float32; one sum of those (a reduction counts its
    operand's bytes, ``meta.namespace``)."""
    from zerosim.comm.virtual import VirtualWorld
    from zerosim.zero.stage3_zeropp import HierarchicalReducer, dequantize_into

    with meta.tracking(backend="torch") as tracker:
        out = xp.zeros((ROWS * C,), "bfloat16")
        dequantize_into(
            out, xp.zeros((ROWS, C), np.int8), xp.zeros((ROWS, C // 8), "float32"), C, 8
        )
    assert tracker.ops == {"dequantize": 1}
    assert tracker.op_bytes == N + N // 8 * 4 + 2 * N

    world = VirtualWorld(4)
    comm = world.comm(0)
    comm.set_ranks_per_node(2)
    reducer = HierarchicalReducer(comm, 4, 8)
    with meta.tracking(backend="torch") as tracker:
        reducer.reduce(xp.zeros((4, C), np.float32))
    codes4, scales4 = 4 * C // 2, 4 * C // 8 * 4  # four rows of int4 codes and their scales
    codes2, scales2 = 2 * C // 2, 2 * C // 8 * 4  # two rows
    assert tracker.ops == {"swizzle_quant": 1, "quantized_reduction": 1, "dequantize": 1, "sum": 1}
    assert tracker.op_bytes == (
        (4 * C * 4 + codes4 + scales4)
        + (codes4 + scales4 + codes2 + scales2)
        + (codes2 + scales2 + 2 * C * 4)
        + 2 * C * 4
    )
