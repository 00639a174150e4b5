"""A whole dry run priced on a GPU cluster, against step times counted by hand.

Each test writes a cluster file with round, made-up rates chosen so that one term of the time
model binds and the others vanish (rates of 10³⁰, latencies of 0), runs ``dry_run`` on a small
GPT and holds the reported ``time`` to a count derived here from the model's shapes and the
file's numbers alone: matrix-product FLOPs, the bytes each product reads and writes, the one
fused optimizer kernel, and the paper's collectives priced by NCCL's ring formula.

The model, ``gpt:2,32,64,16,2``: L = 2 blocks of hidden size H = 32, vocabulary V = 64,
sequence S = 16, 2 heads of d = 16, untied output layer; micro-batch B = 2, so T = B·S = 32
tokens per rank. Its parameters, from the shapes (embeddings V·H and S·H; per block two
LayerNorms 4H, c_attn 3H² + 3H, c_proj H² + H, c_fc 4H² + 4H, mlp c_proj 4H² + H; ln_f 2H;
lm_head V·H without bias):

    Ψ = V·H + S·H + L·(12H² + 13H) + 2H + V·H = 2,048 + 512 + 25,408 + 64 + 2,048 = 30,080

in 2 + 12·L + 2 + 1 = 29 tensors. Every tensor's size is a multiple of 4, so N = 2 and 4
pad nothing.
"""

from __future__ import annotations

import json

import pytest
from cluster_files import write_cluster

from zerosim.dryrun import dry_run

L, H, V, S, HEADS, B = 2, 32, 64, 16, 2, 2
MODEL = f"gpt:{L},{H},{V},{S},{HEADS}"
D = H // HEADS  # head size
T = B * S  # tokens per rank per micro-batch
PSI = V * H + S * H + L * (12 * H * H + 13 * H) + 2 * H + V * H
TENSORS = 2 + 12 * L + 2 + 1  # wte, wpe; 12 per block; ln_f's two; lm_head
# every Linear as (in, out): c_attn, attention's c_proj, c_fc, the MLP's c_proj; then lm_head
LINEARS = [(H, 3 * H), (H, H), (H, 4 * H), (4 * H, H)] * L + [(H, V)]
FREE = 1e30  # a rate so high that its term vanishes next to the one under test


def _config(stage: int, optimizer: str = "Adam") -> dict:
    """fp32, the paper's schedule, every collective blocking (``overlap_comm`` off), one bucket
    for the whole model, and at stage 3 no persistent parameters and no reuse of a gathered one:
    each tensor is gathered before its module's forward and again before its backward."""
    return {
        "train_micro_batch_size_per_gpu": B,
        "optimizer": {"type": optimizer, "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": False,
            "reduce_bucket_size": 10**9,
            "allgather_bucket_size": 10**9,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
        },
        "zerosim": {"schedule": "paper"},
    }


def _gpu(path, **rates):
    """A GPU cluster file (CuPy's path) where everything is free unless ``rates`` says so (a
    rate of None leaves the key out)."""
    spec = dict(
        backend="cupy", nodes=1, devices_per_node=8, intra_bandwidth=FREE, inter_bandwidth=FREE,
        intra_latency=0.0, inter_latency=0.0, device_flops=FREE, device_memory_bandwidth=FREE,
    )  # fmt: skip
    spec = {k: v for k, v in {**spec, **rates}.items() if v is not None}
    return write_cluster(path, **spec)


def _matmul_flops() -> int:
    """FLOPs of one step's matrix products on one rank. A Linear (in → out) on T rows is
    2·T·in·out in forward and twice that in backward (dW = gᵀx and dx = g·W): 6·T·in·out.
    Attention per block and sequence, with S ≤ 64 one causal block, so the whole S × S matrix:
    forward q·kᵀ and P·v, 2·S²·d each per head; backward dP = dY·vᵀ, dv = Pᵀ·dY, dq = dS·k and
    dk = dSᵀ·q, four more: 6 products of 2·S²·d per head, 12·S²·H per sequence."""
    linears = sum(6 * T * n_in * n_out for n_in, n_out in LINEARS)
    attention = L * B * 12 * S * S * H
    return linears + attention  # 5,111,808 + 393,216


def _product_bytes() -> int:
    """Bytes the step's products read and write (operands and result, fp32). A Linear's three
    products each touch the (T, in) input, the (in, out) weight and the (T, out) output (or
    their gradients): 3·4·(T·in + in·out + T·out). Each of attention's six products per block
    touches, per (sequence, head), two (S, d) matrices and one (S, S): B·h·4·(S² + 2·S·d)."""
    linears = sum(3 * 4 * (T * i + i * o + T * o) for i, o in LINEARS)
    attention = L * 6 * B * HEADS * 4 * (S * S + 2 * S * D)
    return linears + attention


def test_a_compute_bound_step_is_the_models_matmul_flops_at_the_fp32_peak_by_hand(tmp_path):
    """Links, memory and kernel calls free: the step is the products' FLOPs (counted here from
    the shapes) at the fp32 peak, 10⁹ FLOP/s, over a software factor of one half. The 16-bit
    peak, a thousand times higher, is not the one an fp32 run uses."""
    cluster = _gpu(
        tmp_path / "flops.json", device_flops=1e12, device_flops_fp32=1e9, software_factor=0.5,
        kernel_launch_s=1e-30,
    )  # fmt: skip
    report = dry_run(MODEL, 4, _config(stage=2), cluster=cluster)
    t = report["time"]
    by_hand = _matmul_flops() / (1e9 * 0.5)  # 0.011010048 s
    assert _matmul_flops() == 5_505_024
    assert t["step_s"] == pytest.approx(by_hand, rel=1e-9)
    assert t["compute_s"] == pytest.approx(by_hand, rel=1e-9)
    assert t["comm_s"] < 1e-20 and t["exposed_comm_s"] < 1e-20
    # the model FLOPs (6·N_matmul + 12·l·h·s per token) equal these products with S ≤ 64, so
    # the model TFLOP/s per device is the peak times the factor
    assert t["tflops_per_device"] == pytest.approx(1e9 * 0.5 / 1e12, rel=1e-9)
    assert t["cluster"]["device_flops"] == 1e9


def test_a_memory_bound_step_is_its_products_bytes_at_the_memory_bandwidth_by_hand(tmp_path):
    """FLOPs free and no kernel cost given (element-wise work unpriced): each product takes its
    operand and result bytes at 10⁹ B/s, the roofline's other side."""
    cluster = _gpu(tmp_path / "bytes.json", device_memory_bandwidth=1e9)
    report = dry_run(MODEL, 2, _config(stage=2), cluster=cluster)
    by_hand = _product_bytes() / 1e9
    assert report["time"]["step_s"] == pytest.approx(by_hand, rel=1e-9)
    assert report["time"]["compute_s"] == pytest.approx(by_hand, rel=1e-9)


def _compute_spans_between(trace: dict, after: str, before: str) -> float:
    """Seconds the compute track is busy between the end of the collective whose label starts
    with ``after`` and the start of the one whose label starts with ``before``."""
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    comm = {" ".join(e["name"].split()[:2]): e for e in spans if e["tid"] == 2}  # op, phase
    start = comm[after]["ts"] + comm[after]["dur"]
    stop = comm[before]["ts"]
    inside = [e for e in spans if e["tid"] == 1 and start <= e["ts"] and e["ts"] + e["dur"] <= stop]
    return sum(e["dur"] for e in inside) / 1e6


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_launch_bound_optimizer_step_is_one_fused_adam_kernel_by_hand(tmp_path, world_size):
    """FLOPs and links free, a kernel call 1 ms and memory at 10⁹ B/s. At stage 2 an fp32 Adam
    step updates the rank's shard of Ψ/N elements with CuPy's one fused ElementwiseKernel,
    between the gradient norm's all-reduce and the all-gather of the updated parameters: one
    call that reads parameter, gradient and both moments and writes back all but the gradient,
    7·4·Ψ/N bytes. N = 2: 1 ms + 421,120 B / 10⁹ B/s; N = 4: 1 ms + 210,560 B / 10⁹ B/s."""
    cluster = _gpu(tmp_path / "launch.json", kernel_launch_s=1e-3, device_memory_bandwidth=1e9)
    trace = tmp_path / "step.json"
    report = dry_run(MODEL, world_size, _config(stage=2), cluster=cluster, trace=trace)
    spans = json.loads(trace.read_text())
    optimizer_s = _compute_spans_between(spans, "all_reduce clip", "all_gather step")
    by_hand = 1e-3 + 7 * 4 * (PSI // world_size) / 1e9
    assert optimizer_s == pytest.approx(by_hand, rel=1e-6)  # the trace keeps µs as floats
    # every collective is free: the step is the compute stream's, and nothing is exposed
    t = report["time"]
    assert t["step_s"] == pytest.approx(t["compute_s"], rel=1e-12)
    assert t["comm_s"] < 1e-20


def test_a_launch_bound_step_prices_every_counted_call_once(tmp_path):
    """Everything free but a kernel call (1 ms): the step is the number of calls the step made
    (the report's ``ops``, products included: a cuBLAS call is a launch too) times 1 ms. Not a
    hand count of the calls; it holds the time model to price each counted call exactly once."""
    cluster = _gpu(tmp_path / "calls.json", kernel_launch_s=1e-3)
    report = dry_run(MODEL, 2, _config(stage=2), cluster=cluster)
    calls = sum(report["ranks"][0]["ops"].values())
    assert report["time"]["step_s"] == pytest.approx(calls * 1e-3, rel=1e-9)


def _stage3_paper_collectives(p: int) -> tuple[int, float]:
    """The paper's stage 3 on p ranks, fp32, as (ring passes, β bytes): each of the 29 tensors
    gathered in forward and again in backward (Ψ·4 bytes per pass, S of nccl-tests being the
    gathered tensor), one reduce-scatter of the gradients (Ψ·4 bytes, one bucket) and the
    gradient norm's all-reduce of one float64 (8 bytes). A ring all-gather or reduce-scatter
    takes p − 1 hops and moves (p − 1)/p·S; an all-reduce twice both. So the latency is paid
    (2·29 + 1 + 2)·(p − 1) hops and the bandwidth term is (p − 1)/p·(3·Ψ·4 + 2·8) bytes."""
    hops = (2 * TENSORS + 1 + 2) * (p - 1)
    beta_bytes = (p - 1) / p * (3 * PSI * 4 + 2 * 8)
    return hops, beta_bytes


def test_a_communication_bound_stage3_step_on_one_node_by_hand(tmp_path):
    """Four ranks on one node, compute free: NVLink 2·10⁹ B/s at an efficiency of one half
    (10⁹ B/s), 10 µs a hop. Every collective blocks, so the step is the collectives end to end:
    61·3 hops at 10 µs plus (3/4)·(3·120,320 + 16) B at 10⁹ B/s."""
    cluster = _gpu(
        tmp_path / "node.json", devices_per_node=4, intra_bandwidth=2e9, intra_efficiency=0.5,
        intra_latency=1e-5, inter_latency=1e-3,
    )  # fmt: skip
    report = dry_run(MODEL, 4, _config(stage=3), cluster=cluster)
    hops, beta_bytes = _stage3_paper_collectives(4)
    by_hand = hops * 1e-5 + beta_bytes / 1e9
    assert hops == 183 and report["padded_params"] == PSI
    t = report["time"]
    assert t["step_s"] == pytest.approx(by_hand, rel=1e-9)
    assert t["comm_s"] == pytest.approx(by_hand, rel=1e-9)
    assert t["exposed_comm_s"] == pytest.approx(by_hand, rel=1e-9)
    assert t["cluster"]["nodes"] == 1


def test_a_communication_bound_stage3_step_on_two_nodes_adds_its_compute_by_hand(tmp_path):
    """Four ranks, two on each of two nodes: NVLink 10⁹ B/s and 10 µs a hop; one NIC of 10⁸ B/s
    per node, 100 µs a crossing. One ring through both nodes runs at its slowest hop: the two
    ranks of a node share its NIC, min(10⁹, 2 · 10⁸/2) = 10⁸ B/s; of a ring pass's 3 hops, the
    2 − 1 = 1 node crossing pays 100 µs and the other 2 pay 10 µs (NCCL's tuning model). The
    products take their FLOPs at 10⁹ FLOP/s; no collective overlaps them (all block), so the
    step is compute plus communication."""
    cluster = _gpu(
        tmp_path / "nodes.json", nodes=2, devices_per_node=2, intra_bandwidth=1e9,
        intra_latency=1e-5, inter_bandwidth=None, nic_bandwidth=1e8, nics_per_node=1,
        inter_latency=1e-4, device_flops=1e9,
    )  # fmt: skip
    report = dry_run(MODEL, 4, _config(stage=3), cluster=cluster)
    hops, beta_bytes = _stage3_paper_collectives(4)
    passes = hops // 3  # ring passes of 3 hops: 2 at 10 µs and 1 at 100 µs each
    comm = passes * (2 * 1e-5 + 1e-4) + beta_bytes / 1e8
    compute = _matmul_flops() / 1e9
    t = report["time"]
    assert t["comm_s"] == pytest.approx(comm, rel=1e-9)
    assert t["compute_s"] == pytest.approx(compute, rel=1e-9)
    assert t["step_s"] == pytest.approx(compute + comm, rel=1e-9)
    assert t["exposed_comm_s"] == pytest.approx(comm, rel=1e-9)
    assert t["cluster"]["nodes"] == 2
