"""A whole dry run priced on a GPU cluster, against step times counted by hand.

Each test writes a cluster file with round, made-up rates chosen so that one term of the time
model binds and the others vanish (rates of 10³⁰, latencies of 0), runs ``dry_run`` on a small
GPT and holds the reported ``time`` to a count derived here from the model's shapes and the
file's numbers alone: matrix-product FLOPs, the bytes each product reads and writes, the one
fused optimizer kernel, and stage 2's and 3's collectives (the paper's schedule and DeepSpeed's)
priced by NCCL's ring formula, blocking or, with ``overlap_comm``, hidden under backward.

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
import math

import pytest
from cluster_files import write_cluster

from zerosim.cli import main
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


def _config(stage: int, schedule: str = "paper", bf16: bool = False) -> dict:
    """fp32 (or bf16), the paper's schedule (or DeepSpeed's), every collective blocking
    (``overlap_comm`` off), one bucket for the whole model, and at stage 3 no persistent
    parameters and no reuse of a gathered one: each tensor is gathered before its module's
    forward and again before its backward."""
    return {
        "train_micro_batch_size_per_gpu": B,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": False,
            "reduce_bucket_size": 10**9,
            "allgather_bucket_size": 10**9,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
        },
        "zerosim": {"schedule": schedule},
        "bf16": {"enabled": bf16},
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


@pytest.mark.parametrize(("bf16", "peak"), [(False, 1e9), (True, 1e12)])
def test_a_compute_bound_step_is_the_models_matmul_flops_at_the_dtypes_peak_by_hand(
    tmp_path, bf16, peak
):
    """Links, memory and kernel calls free: the step is the products' FLOPs (counted here from
    the shapes) at the peak of the run's dtype over a software factor of one half: fp32 at
    ``device_flops_fp32`` (10⁹ FLOP/s), bf16 at ``device_flops`` (10¹² FLOP/s, tensor cores;
    the same products, on upcast operands)."""
    cluster = _gpu(
        tmp_path / "flops.json", device_flops=1e12, device_flops_fp32=1e9, software_factor=0.5,
        kernel_launch_s=1e-30,
    )  # fmt: skip
    report = dry_run(MODEL, 4, _config(stage=2, bf16=bf16), cluster=cluster)
    t = report["time"]
    by_hand = _matmul_flops() / (peak * 0.5)  # fp32: 0.011010048 s
    assert _matmul_flops() == 5_505_024
    assert t["step_s"] == pytest.approx(by_hand, rel=1e-9)
    assert t["compute_s"] == pytest.approx(by_hand, rel=1e-9)
    assert t["comm_s"] < 1e-20 and t["exposed_comm_s"] < 1e-20
    # the model FLOPs (6·N_matmul + 12·l·h·s per token) equal these products with S ≤ 64, so
    # the model TFLOP/s per device is the peak times the factor
    assert t["tflops_per_device"] == pytest.approx(peak * 0.5 / 1e12, rel=1e-9)
    assert t["cluster"]["device_flops"] == peak


@pytest.mark.parametrize(("efficiency", "rate"), [(None, 1e9), (0.5, 0.5e9)])
def test_a_memory_bound_step_is_its_products_bytes_at_the_memory_bandwidth_by_hand(
    tmp_path, efficiency, rate
):
    """FLOPs free and no kernel cost given (element-wise work unpriced): each product takes its
    operand and result bytes at the achievable memory rate, the roofline's other side: 10⁹ B/s
    on the datasheet, all of it without ``memory_efficiency``, half of it at 0.5."""
    cluster = _gpu(
        tmp_path / "bytes.json", device_memory_bandwidth=1e9, memory_efficiency=efficiency
    )
    report = dry_run(MODEL, 2, _config(stage=2), cluster=cluster)
    by_hand = _product_bytes() / rate
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
    7·4·Ψ/N bytes, at the quarter of the datasheet's 4·10⁹ B/s a streaming kernel reaches
    (``memory_efficiency``). N = 2: 1 ms + 421,120 B / 10⁹ B/s; N = 4: 1 ms + 210,560 B / 10⁹
    B/s."""
    cluster = _gpu(
        tmp_path / "launch.json", kernel_launch_s=1e-3, device_memory_bandwidth=4e9,
        memory_efficiency=0.25,
    )  # fmt: skip
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
    t = report["time"]
    assert t["step_s"] == pytest.approx(calls * 1e-3, rel=1e-9)
    assert t["host"]["elementwise_s"] == pytest.approx(calls * 1e-3, rel=1e-9)  # the kernels
    assert t["host"]["products_s"] < 1e-20


def _ring_seconds(op: str, size: float, bus: float, ring_pass: float, p: int = 4) -> float:
    """A ring all-gather or reduce-scatter of S bytes on p ranks: one pass round the ring of
    latency (its p − 1 hops, ``ring_pass`` seconds in all) and (p − 1)/p·S over the bus; an
    all-reduce (a reduce-scatter, then an all-gather) twice both."""
    passes = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}[op]
    return passes * (ring_pass + (p - 1) / p * size / bus)


# Two nodes of two ranks: NVLink 10⁹ B/s, 10 µs a hop; one NIC of 10⁸ B/s per node, 100 µs a
# crossing. A ring through both nodes runs at its slowest hop, the node's NIC shared by its two
# ranks: min(10⁹, 2 · 10⁸/2) = 10⁸ B/s. A pass round the ring is 3 hops, of which the one node
# crossing pays 100 µs and the other two 10 µs (NCCL's tuning model sums them so).
TWO_NODES = dict(
    nodes=2, devices_per_node=2, intra_bandwidth=1e9, intra_latency=1e-5, inter_bandwidth=None,
    nic_bandwidth=1e8, nics_per_node=1, inter_latency=1e-4,
)  # fmt: skip
TWO_NODES_BUS, TWO_NODES_PASS = 1e8, 2 * 1e-5 + 1e-4

# Stage 2's collectives per step on 4 ranks, one bucket, Ψ_pad = Ψ (a multiple of 2N = 8):
# the paper's: reduce-scatter of the gradients, the norm's float64, all-gather of the updated
# parameters, both in the training dtype (4 or 2 bytes); DeepSpeed 0.19.8's (docs/formulas.md,
# its default contiguous_gradients, reduce_scatter and multi-rank bucket all-reduce): one
# all-reduce of the bucket, after which each rank keeps its slice, the norm's Σg² in float32,
# and the same all-gather.
STAGE2_COLLECTIVES = {
    ("paper", False): [("reduce_scatter", PSI * 4), ("all_reduce", 8), ("all_gather", PSI * 4)],
    ("paper", True): [("reduce_scatter", PSI * 2), ("all_reduce", 8), ("all_gather", PSI * 2)],
    ("deepspeed", False): [("all_reduce", PSI * 4), ("all_reduce", 4), ("all_gather", PSI * 4)],
}

# The paper's stage 3, fp32: each of the 29 tensors gathered before its module's forward and
# again before its backward (4·numel bytes each, Ψ·4 a pass), one reduce-scatter of the
# gradients (Ψ·4 bytes, one bucket), the gradient norm's float64; no all-gather after the step.
STAGE3_COLLECTIVES = [
    *[("all_gather", 4 * numel) for numel in (V * H, S * H)],  # wte, wpe; the blocks below
    *[
        ("all_gather", 4 * numel)
        for numel in [H, H, 3 * H * H, 3 * H, H * H, H, H, H, 4 * H * H, 4 * H, 4 * H * H, H] * L
    ],
    *[("all_gather", 4 * numel) for numel in (H, H, V * H)],  # ln_f, lm_head
]
STAGE3_COLLECTIVES = [
    *STAGE3_COLLECTIVES,  # forward
    *STAGE3_COLLECTIVES,  # backward
    ("reduce_scatter", PSI * 4),
    ("all_reduce", 8),
]


def _all_communication(t: dict, by_hand: float, nodes: int) -> None:
    """A step whose compute is free and whose every collective blocks: step, communication and
    exposed communication all equal the hand count, on the cluster's nodes."""
    assert t["step_s"] == pytest.approx(by_hand, rel=1e-9)
    assert t["comm_s"] == pytest.approx(by_hand, rel=1e-9)
    assert t["exposed_comm_s"] == pytest.approx(by_hand, rel=1e-9)
    assert t["cluster"]["nodes"] == nodes


@pytest.mark.parametrize(("schedule", "bf16"), list(STAGE2_COLLECTIVES))
def test_a_communication_bound_stage2_step_on_two_nodes_by_hand(tmp_path, schedule, bf16):
    """Compute free, every collective blocking: the step is stage 2's three collectives end to
    end, each priced by the ring formula on the two nodes above."""
    cluster = _gpu(tmp_path / "nodes.json", **TWO_NODES)
    report = dry_run(MODEL, 4, _config(stage=2, schedule=schedule, bf16=bf16), cluster=cluster)
    by_hand = sum(
        _ring_seconds(op, size, TWO_NODES_BUS, TWO_NODES_PASS)
        for op, size in STAGE2_COLLECTIVES[schedule, bf16]
    )
    _all_communication(report["time"], by_hand, nodes=2)


def test_a_communication_bound_stage3_step_on_one_node_by_hand(tmp_path):
    """Four ranks on one node, compute free: NVLink 2·10⁹ B/s at an efficiency of one half
    (10⁹ B/s), 10 µs a hop, so 30 µs a pass round the ring; the network's latency, paid by no
    hop here, is set high. Every collective blocks: the step is the 60 collectives end to end,
    61 passes (the all-reduce makes two) and (3/4)·(3·120,320 + 2·8) bytes over the bus."""
    cluster = _gpu(
        tmp_path / "node.json", devices_per_node=4, intra_bandwidth=2e9, intra_efficiency=0.5,
        intra_latency=1e-5, inter_latency=1e-3,
    )  # fmt: skip
    report = dry_run(MODEL, 4, _config(stage=3), cluster=cluster)
    by_hand = sum(_ring_seconds(op, size, 1e9, 3 * 1e-5) for op, size in STAGE3_COLLECTIVES)
    assert len(STAGE3_COLLECTIVES) == 2 * TENSORS + 2 == 60
    assert by_hand == pytest.approx(61 * 3e-5 + 3 / 4 * (3 * PSI * 4 + 2 * 8) / 1e9)
    assert report["padded_params"] == PSI  # every tensor's numel is a multiple of 4
    _all_communication(report["time"], by_hand, nodes=1)


def test_a_communication_bound_stage3_step_on_two_nodes_adds_its_compute_by_hand(tmp_path):
    """The two nodes above, with the products' FLOPs at 10⁹ FLOP/s: no collective overlaps
    them (every one blocks), so the step is compute plus communication, and all the
    communication is exposed."""
    cluster = _gpu(tmp_path / "nodes.json", **TWO_NODES, device_flops=1e9)
    report = dry_run(MODEL, 4, _config(stage=3), cluster=cluster)
    comm = sum(
        _ring_seconds(op, size, TWO_NODES_BUS, TWO_NODES_PASS) for op, size in STAGE3_COLLECTIVES
    )
    compute = _matmul_flops() / 1e9
    t = report["time"]
    assert t["comm_s"] == pytest.approx(comm, rel=1e-9)
    assert t["compute_s"] == pytest.approx(compute, rel=1e-9)
    assert t["step_s"] == pytest.approx(compute + comm, rel=1e-9)
    assert t["exposed_comm_s"] == pytest.approx(comm, rel=1e-9)
    assert t["cluster"]["nodes"] == 2


def test_an_overlapped_bucket_hides_behind_the_rest_of_backward_by_hand(tmp_path):
    """Stage 2 (the paper's) with ``overlap_comm`` on 2 ranks of one node, buckets of at least
    Ψ/2 = 15,040 elements cut at parameter starts, last parameters first: lm_head, ln_f and
    block 1 hold 2,048 + 64 + 12,704 = 14,816, so the first bucket also takes block 0's MLP
    c_proj (32 + 4,096): 18,944 elements; the second holds the other 11,136. The first is full
    while block 0's c_fc, attention and c_attn are still to run backward (c_fc alone
    4·T·H·4H = 524,288 FLOPs, 0.5 ms at 10⁹ FLOP/s), and its reduce-scatter, 10 µs + (1/2)·
    75,776 B / 10⁹ B/s = 48 µs, runs under them. Exposed: the second bucket's reduce-scatter,
    issued when backward ends, the norm's all-reduce and the all-gather of the parameters."""
    cluster = _gpu(
        tmp_path / "overlap.json", devices_per_node=2, intra_bandwidth=1e9, intra_latency=1e-5,
        device_flops=1e9,
    )  # fmt: skip
    config = _config(stage=2)
    config["zero_optimization"].update(overlap_comm=True, reduce_bucket_size=PSI // 2)
    report = dry_run(MODEL, 2, config, cluster=cluster)

    def ring(op, size):  # one node of 2: a pass round the ring is 1 hop of 10 µs
        return _ring_seconds(op, size, 1e9, 1e-5, p=2)

    first = V * H + 2 * H + (12 * H * H + 13 * H) + (H + 4 * H * H)
    assert (first, PSI - first) == (18_944, 11_136)
    hidden = ring("reduce_scatter", first * 4)
    exposed = ring("reduce_scatter", (PSI - first) * 4) + ring("all_reduce", 8)
    exposed += ring("all_gather", PSI * 4)
    compute = _matmul_flops() / 1e9
    t = report["time"]
    assert t["compute_s"] == pytest.approx(compute, rel=1e-9)
    assert t["comm_s"] == pytest.approx(hidden + exposed, rel=1e-9)
    assert t["exposed_comm_s"] == pytest.approx(exposed, rel=1e-9)
    assert t["step_s"] == pytest.approx(compute + exposed, rel=1e-9)


def test_deepspeeds_stage2_buckets_on_its_reduction_stream_by_hand(tmp_path):
    """Stage 2 on DeepSpeed's schedule with ``overlap_comm``, the same cluster and bucket size
    as above: IPG buckets, each reduced when the next gradient would take it past Ψ/2 = 15,040
    elements, in the order backward finishes the gradients (a Linear's bias before its weight,
    as DeepSpeed's hooks finish them: tests/peer/test_deepspeed_collectives.py holds stage 2's
    bucket sizes to DeepSpeed's comms log).
    lm_head 2,048, ln_f 64 and block 1 12,704 make 14,816; block 0's MLP c_proj bias makes
    14,848, and its weight (4,096) would pass the limit, so the first bucket goes then, with
    block 0's c_fc, attention and c_attn still to run backward (0.5 ms and more), under which
    its all-reduce (20 µs + 59,392 B / 10⁹ B/s = 79 µs) hides. The second holds the rest of
    block 0 (12,672) and wpe (512), 13,184, and goes when wte's 2,048 arrive, at the end of
    backward; the third, wte's, in the epilogue. The second and third all-reduces run back to
    back with no backward left to hide them (each on DeepSpeed's reduction stream once the
    compute stream has waited for it), the epilogue's sync waits for the third; then the
    norm's all-reduce of one float and the all-gather of the updated parameters, blocking."""
    cluster = _gpu(
        tmp_path / "overlap.json", devices_per_node=2, intra_bandwidth=1e9, intra_latency=1e-5,
        device_flops=1e9,
    )  # fmt: skip
    config = _config(stage=2, schedule="deepspeed")
    config["zero_optimization"].update(overlap_comm=True, reduce_bucket_size=PSI // 2)
    report = dry_run(MODEL, 2, config, cluster=cluster)

    def ring(op, size):  # one node of 2: a pass round the ring is 1 hop of 10 µs
        return _ring_seconds(op, size, 1e9, 1e-5, p=2)

    block = 12 * H * H + 13 * H
    first = V * H + 2 * H + block + H
    second = (block - H) + S * H
    assert (first, second, PSI - first - second) == (14_848, 13_184, V * H)
    hidden = ring("all_reduce", first * 4)
    exposed = ring("all_reduce", second * 4) + ring("all_reduce", V * H * 4)
    exposed += ring("all_reduce", 4) + ring("all_gather", PSI * 4)
    t = report["time"]
    assert t["compute_s"] == pytest.approx(_matmul_flops() / 1e9, rel=1e-9)
    assert t["comm_s"] == pytest.approx(hidden + exposed, rel=1e-9)
    assert t["exposed_comm_s"] == pytest.approx(exposed, rel=1e-9)


def test_each_collective_reaches_the_bus_efficiency_of_its_own_size_by_hand(tmp_path):
    """Stage 3 on one node of 4 ranks, NVLink 10⁹ B/s, no latency, with a bus efficiency of 1/4
    up to 1 kB rising to 1 at 100 kB (linear in log size): each collective runs at the
    efficiency of its nccl-tests size S, the whole gathered tensor (not the rank's chunk of it),
    so LayerNorm's 128 B gathers at 1/4, a 16 kB weight's at 1/4 + (3/4)·log(16.384)/log(100),
    the 120 kB reduce-scatter at 1."""
    points = [[1e3, 0.25], [1e5, 1.0]]
    cluster = _gpu(
        tmp_path / "sizes.json", devices_per_node=4, intra_bandwidth=1e9,
        bus_efficiency_by_size=points,
    )  # fmt: skip
    report = dry_run(MODEL, 4, _config(stage=3), cluster=cluster)

    def efficiency(size: float) -> float:
        if size <= 1e3:
            return 0.25
        return min(1.0, 0.25 + 0.75 * math.log(size / 1e3) / math.log(1e5 / 1e3))

    by_hand = sum(
        _ring_seconds(op, size, 1e9 * efficiency(size), 0.0) for op, size in STAGE3_COLLECTIVES
    )
    assert efficiency(16384) == pytest.approx(0.25 + 0.75 * math.log10(16.384) / 2)
    assert report["time"]["step_s"] == pytest.approx(by_hand, rel=1e-9)


def test_the_cli_prints_the_hand_counted_step_time_as_json(tmp_path, capsys):
    """``zerosim dryrun --cluster … --json`` prints the same step as the Python API: here the two
    nodes above with the products at 10⁹ FLOP/s, stage 3, compute plus communication."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(_config(stage=3)))
    cluster = _gpu(tmp_path / "nodes.json", **TWO_NODES, device_flops=1e9)
    args = ["dryrun", "--model", MODEL, "--ranks", "4", "--config", str(config)]
    assert main([*args, "--cluster", str(cluster), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)["time"]
    comm = sum(
        _ring_seconds(op, size, TWO_NODES_BUS, TWO_NODES_PASS) for op, size in STAGE3_COLLECTIVES
    )
    assert printed["step_s"] == pytest.approx(_matmul_flops() / 1e9 + comm, rel=1e-9)
    assert printed["exposed_comm_s"] == pytest.approx(comm, rel=1e-9)
