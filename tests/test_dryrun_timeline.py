"""The dry run's time model: a step's events on a described cluster, against hand-worked times."""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import pytest
from cluster_files import sourced, write_cluster

from zerosim import meta
from zerosim.analysis.timing import Cluster
from zerosim.cli.dryrun import format_report
from zerosim.dryrun import dry_run, recipe, records_of, run_world
from zerosim.dryrun.plots import busy_fractions
from zerosim.dryrun.report import against_device, step_time
from zerosim.dryrun.timeline import (
    CLUSTERS,
    ClusterModel,
    chrome_trace,
    cluster_names,
    compute_seconds,
    group_seconds,
    kernel_seconds,
    load_cluster_model,
    simulate,
)
from zerosim.optim.functional.adam import adam

# 2 nodes × 2 devices; bandwidths in bytes/s, no latency, 1,000 FLOP/s: easy arithmetic
CLUSTER = Cluster(2, 2, 100.0, 10.0, 0.0, 0.0, 1000.0)


def _call(op, size, members, blocking):
    record = SimpleNamespace(op=op, size_bytes=size, blocking=blocking, phase="p", group="g")
    return SimpleNamespace(record=record, comm=SimpleNamespace(members=members))


def _ends(step, stream: str) -> list[float]:
    """Start and end of each of ``stream``'s spans, in order, end to end."""
    return [t for s, _, a, b in step.spans if s == stream for t in (a, b)]


def test_a_step_on_two_streams_by_hand():
    calls = [
        # one ring over 2 nodes × 2 ranks: NVLink hops (100 B/s) and the node crossing (the
        # two ranks' NIC shares, 2 × 10 B/s) run at once, so the ring goes at 20 B/s
        _call("all_gather", 40, (0, 1, 2, 3), False),
        _call("all_reduce", 40, (0, 1), True),  # one node: 2·(1/2)·40/100
    ]
    events = [
        ("compute", 1000),  # 1 s
        ("issue", 0),  # starts at 1: (3/4)·40/20 = 1.5 s, ends at 2.5
        ("compute", 2000),  # 1 → 3
        ("wait", 0),  # already done
        ("issue", 1),  # blocking: 3 → 3.4
    ]
    step = simulate(events, calls, ClusterModel(CLUSTER), spans=True)
    assert step.as_dict() == pytest.approx(
        {"step_s": 3.4, "compute_s": 3.0, "comm_s": 1.9, "exposed_comm_s": 0.4, "reduce_s": 0.0}
    )
    waiting = simulate([("issue", 0), ("wait", 0), ("compute", 1000)], calls, ClusterModel(CLUSTER))
    assert waiting.step_s == pytest.approx(2.5)  # compute waits for the gather


def test_two_buckets_one_overlap_by_hand(tmp_path):
    """A backward pass with two gradient buckets, written out by hand from a hand-made cluster
    file: 2 ranks on one node at 100 B/s and 1,000 FLOP/s, the link at half its line rate and a
    software factor of one half (50 B/s, 500 FLOP/s), no latency. A reduce-scatter of S bytes
    takes (1/2)·S/50 s.

    compute  |0 fwd 2|2 bw 3|3 bw 4|4 bw 6|     wait      |
    comm                    |3 rs1 5|5 rs2 7|7 ar 7.16|

    bucket 1 (200 B, 2 s) starts when issued at 3; bucket 2 (200 B), issued at 4, queues behind
    it (5 → 7); compute ends at 6 and waits for both (1 s exposed); the gradient norm's blocking
    all-reduce of 8 B takes 2·(1/2)·8/50 = 0.16 s."""
    path = write_cluster(
        tmp_path / "hand.json", nodes=1, devices_per_node=2, intra_bandwidth=100.0,
        inter_bandwidth=10.0, intra_latency=0.0, inter_latency=0.0, device_flops=1000.0,
        software_factor=0.5, intra_efficiency=0.5,
    )  # fmt: skip
    calls = [
        _call("reduce_scatter", 200, (0, 1), False),
        _call("reduce_scatter", 200, (0, 1), False),
        _call("all_reduce", 8, (0, 1), True),
    ]
    events = [
        ("compute", 1000),  # forward, 0 → 2
        ("compute", 500),  # backward of the last layers, 2 → 3
        ("issue", 0),
        ("compute", 500),  # 3 → 4
        ("issue", 1),
        ("compute", 1000),  # 4 → 6
        ("wait", 0),
        ("wait", 1),
        ("issue", 2),
    ]
    step = simulate(events, calls, load_cluster_model(path), spans=True)
    assert step.step_s == pytest.approx(7.16)
    assert step.exposed_comm_s == pytest.approx(1.16)
    busy = {
        stream: sum(b - a for s, _, a, b in step.spans if s == stream)
        for stream in ("compute", "comm")
    }
    assert busy == pytest.approx({"compute": 6.0, "comm": 4.16})
    assert (step.compute_s, step.comm_s) == pytest.approx((6.0, 4.16))
    assert _ends(step, "comm") == pytest.approx([3.0, 5.0, 5.0, 7.0, 7.0, 7.16])


def test_qgz_buckets_on_deepspeeds_reduction_stream_by_hand():
    """Two gradient buckets, each noted on DeepSpeed's reduction stream: a kernel and a blocking
    all-reduce in the first, a blocking all-reduce in the second; the backward epilogue waits
    for the stream. 1,000 FLOP/s; an all-reduce of S bytes on one node at 100 B/s takes
    2·(1/2)·S/100 s.

    compute  |0 c 1|1      c      3|3 c 3.5| wait |4 c 5|
    reduce         |1 k 1.5|
    comm                   |1.5 ar 2|      |3 ar 4|

    the first stretch starts when compute has reached it (1); the second when compute has
    (3), the stream being free since 2; ``sync`` holds compute from 3.5 until the stream ends
    at 4. The same events with the notes removed run in series: 6.5 s."""
    calls = [_call("all_reduce", 50, (0, 1), True), _call("all_reduce", 100, (0, 1), True)]
    events = [
        ("compute", 1000),
        ("stream", "reduce"),
        ("compute", 500),  # qgZ's kernel, on the reduction stream
        ("memory", 64),  # allocated by the host as it issues the stretch, at 1
        ("issue", 0),
        ("stream", "compute"),
        ("compute", 2000),
        ("stream", "reduce"),
        ("issue", 1),
        ("stream", "compute"),
        ("compute", 500),
        ("stream", "sync"),
        ("compute", 1000),
    ]
    step = simulate(events, calls, ClusterModel(CLUSTER), spans=True)
    assert step.as_dict() == pytest.approx(
        {"step_s": 5.0, "compute_s": 4.5, "comm_s": 1.5, "exposed_comm_s": 0.5, "reduce_s": 0.5}
    )
    assert _ends(step, "compute") == pytest.approx([0, 1, 1, 3, 3, 3.5, 4, 5])
    assert _ends(step, "reduce") == pytest.approx([1, 1.5])
    assert _ends(step, "comm") == pytest.approx([1.5, 2, 3, 4])
    assert {e["tid"] for e in chrome_trace(step)["traceEvents"] if e["ph"] == "X"} == {1, 2, 3}
    assert step.memory == [(1.0, 64), (5.0, 64)]  # then held until the step ends
    serial = [e for e in events if e[0] != "stream"]
    assert simulate(serial, calls, ClusterModel(CLUSTER)).step_s == pytest.approx(6.5)
    # a host runs everything on its one thread: the notes change nothing there
    host = ClusterModel(CLUSTER, overlap=False)
    assert simulate(events, calls, host).as_dict() == simulate(serial, calls, host).as_dict()


def test_the_host_waits_for_the_oldest_of_more_than_two_reduction_stretches_by_hand():
    """DeepSpeed's ``max_param_reduce_events`` = 2: four stretches of one non-blocking 1 s
    reduce-scatter each (as a bucket's without qgZ), noted 0.1 s of compute apart. Each holds
    the reduction stream until it ends, as NCCL's kernel on that stream does, so they queue on
    it (0-1, 1-2, 2-3, 3-4); before the fourth, three are in flight and none done at 0.3, so the
    host waits for the oldest (until 1) and the compute after it runs 1 → 1.1; ``sync`` then
    holds it until 4 and the waits after it are already done."""
    calls = [_call("reduce_scatter", 200, (0, 1), False) for _ in range(4)]
    events = []
    for i in range(4):
        events += [("stream", "reduce"), ("issue", i), ("stream", "compute"), ("compute", 100)]
    events += [("stream", "sync"), *(("wait", i) for i in range(4))]
    step = simulate(events, calls, ClusterModel(CLUSTER), spans=True)
    assert _ends(step, "compute") == pytest.approx([0, 0.1, 0.1, 0.2, 0.2, 0.3, 1.0, 1.1])
    assert _ends(step, "comm") == pytest.approx([0, 1, 1, 2, 2, 3, 3, 4])
    assert step.step_s == pytest.approx(4.0)
    with pytest.raises(ValueError, match="'reduce_in_turn', 'compute' or 'sync'; got 'other'"):
        simulate([("stream", "other")], [], ClusterModel(CLUSTER))


@pytest.mark.parametrize("note, step_s", [("reduce_in_turn", 1.6), ("reduce", 1.2)])
def test_stage12_buckets_wait_for_the_reduction_stream_in_turn_by_hand(note, step_s):
    """Two IPG buckets of one non-blocking 0.5 s all-reduce each (50 B on one node at 100 B/s),
    0.1 s of compute before each and 1 s after the second, then the backward epilogue's sync.

    Stages 1 and 2 ("reduce_in_turn", DeepSpeed's ``average_tensor``): before the second bucket
    the compute stream waits for the reduction stream, whose all-reduce holds it until 0.6::

        compute |0 c .1|.1 c .2| wait |.6    c    1.6|
        comm           |.1  ar   .6|.6 ar 1.1|

    step 1.6, of it 0.4 s waited. Stage 3's note ("reduce") lets compute run on (0.2 → 1.2)
    and sync waits for the second all-reduce, which ends at 1.1: step 1.2."""
    calls = [_call("all_reduce", 50, (0, 1), False) for _ in range(2)]
    events = [("compute", 100)]
    events += [("stream", note), ("issue", 0), ("stream", "compute"), ("compute", 100)]
    events += [("stream", note), ("issue", 1), ("stream", "compute"), ("compute", 1000)]
    events += [("stream", "sync"), ("wait", 0), ("wait", 1)]
    step = simulate(events, calls, ClusterModel(CLUSTER), spans=True)
    assert step.step_s == pytest.approx(step_s)
    assert step.compute_s == pytest.approx(1.2)
    assert _ends(step, "comm") == pytest.approx([0.1, 0.6, 0.6, 1.1])
    waited = [0.6, 1.6] if note == "reduce_in_turn" else [0.2, 1.2]
    assert _ends(step, "compute") == pytest.approx([0, 0.1, 0.1, 0.2, *waited])


def test_the_software_factor_scales_products_and_link_efficiency_the_link():
    model = ClusterModel(CLUSTER, software_factor=0.5, intra_efficiency=0.25)
    step = simulate(
        [("compute", 1000), ("issue", 0)], [_call("all_gather", 40, (0, 1), True)], model
    )
    assert step.compute_s == pytest.approx(2.0)
    assert step.comm_s == pytest.approx(0.5 * 40 / 25)


def test_groups_are_placed_by_node():
    model = ClusterModel(CLUSTER)
    assert group_seconds(model, "all_gather", 40, (2,)) == 0.0
    assert group_seconds(model, "all_gather", 40, (0, 2)) == pytest.approx(0.5 * 40 / 10)
    assert group_seconds(model, "reduce", 40, (0, 1)) == group_seconds(
        model, "broadcast", 40, (0, 1)
    )
    uneven = group_seconds(model, "all_gather", 30, (0, 1, 2))  # a flat ring at inter-node
    assert uneven == pytest.approx((2 / 3) * 30 / 10)


def test_chrome_trace_has_a_track_per_stream():
    calls = [_call("all_gather", 40, (0, 1), False)]
    step = simulate(
        [("issue", 0), ("compute", 500), ("wait", 0)], calls, ClusterModel(CLUSTER), True
    )
    trace = chrome_trace(step)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == {1, 2}
    assert spans[0]["dur"] == pytest.approx(0.2e6)  # (1/2)·40/100 s, in µs


def test_cluster_files_name_what_is_wrong(tmp_path):
    path = tmp_path / "c.json"
    good = dict(
        nodes=2, devices_per_node=8, intra_bandwidth=1e11, inter_bandwidth=2.5e10,
        intra_latency=1e-6, inter_latency=5e-6, device_flops=3e14,
    )  # fmt: skip

    def refused(spec, message):
        path.write_text(json.dumps(spec))
        with pytest.raises(ValueError, match=message):
            load_cluster_model(path)

    refused({**sourced(good), "bogus": 1}, r"unknown keys \['bogus'\]")
    refused(
        {**sourced(good), "intra_bandwidth": 1e11}, "'intra_bandwidth' is 1000.*0 without a source"
    )
    refused(
        {**sourced(good), "intra_bandwidth": {"value": 1e11, "source": " "}},
        "'intra_bandwidth' has no 'source'",
    )
    refused({**sourced(good), "intra_bandwidth": {"source": "x"}}, "has a source but no 'value'")
    for retired in ("compute_efficiency", "network_efficiency"):
        refused(
            {**sourced(good), retired: 0.4},
            rf"\['{retired}'\] are no longer cluster keys.*'software_factor'",
        )
    refused(sourced({**good, "software_factor": 1.5}), r"software_factor must be in \(0, 1\]")
    refused(sourced({**good, "nic_bandwidth": 2.5e10, "nics_per_node": 8}), "not both")
    no_inter = {k: v for k, v in good.items() if k != "inter_bandwidth"}
    refused(sourced({**no_inter, "nic_bandwidth": 2.5e10}), r"both \['nic_bandwidth', 'nics_")
    refused(sourced(no_inter), r"missing keys \['inter_bandwidth'\]")
    refused(
        sourced({**good, "bus_efficiency_by_size": [[2e6, 0.5], [1e6, 0.9]]}),
        "increasing positive sizes",
    )
    refused(sourced({**good, "collective_algorithm": "tree"}), "collective_algorithm must be one")
    # 4 NICs of 12.5 GB/s shared by 16 devices: one device's share is 3.125 GB/s
    write_cluster(path, **{**no_inter, "devices_per_node": 16, "nic_bandwidth": 12.5e9,
                            "nics_per_node": 4})  # fmt: skip
    assert load_cluster_model(path).cluster.inter_bandwidth == 3.125e9
    # a host's file, measured here by zerosim calibrate, gives plain numbers
    path.write_text(json.dumps({**good, "measurements": {}}))
    assert load_cluster_model(path).cluster.intra_bandwidth == 1e11
    for bad in (0, -1.0, "80GB", True):
        write_cluster(path, **good, device_memory_bytes=bad)
        with pytest.raises(
            ValueError, match=f"device_memory_bytes must be a positive number, got {bad!r}"
        ):
            load_cluster_model(path)
    for bad in (0, -1e-6, "11us"):
        write_cluster(path, **good, kernel_launch_s=bad)
        with pytest.raises(
            ValueError, match=f"kernel_launch_s must be a positive number, got {bad!r}"
        ):
            load_cluster_model(path)
    path.write_text(json.dumps({**sourced(good), "kernel_launch_s": 1e-5}))
    with pytest.raises(ValueError, match="'kernel_launch_s' is 1e-05 without a source"):
        load_cluster_model(path)
    write_cluster(path, **good, device_memory_bytes=80 * 2**30)
    assert load_cluster_model(path).resized(64).device_memory_bytes == 80 * 2**30
    with pytest.raises(FileNotFoundError, match=r"not one of the shipped clusters \[.*'selene'"):
        load_cluster_model("no-such-cluster")


def test_a_shipped_cluster_loads_by_name_from_any_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cluster_names() == ["mosaic_a100_40gb", "mosaic_a100_80gb", "selene", "zeropp_v100"]
    selene = load_cluster_model("selene")
    assert selene == load_cluster_model(CLUSTERS / "selene.json")
    assert selene.cluster.devices_per_node == 8 and selene.name.startswith("Selene")


SMALL_CFG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": 2000, "overlap_comm": True},
    "bf16": {"enabled": True},
}


def _small_cluster(path, **extra):
    """A 4-device node, resized to the world; ``extra`` keys added (device memory)."""
    return write_cluster(
        path, nodes=1, devices_per_node=4, intra_bandwidth=1e9, inter_bandwidth=1e8,
        intra_latency=1e-6, inter_latency=5e-6, device_flops=1e11, **extra,
    )  # fmt: skip


def _one_node_cluster(path, **rates):
    """8 devices on one node, no latency: a collective of S bytes on p ranks takes its ring's
    c_β(p)·S/B, c_β written out by hand in ``_ring_seconds``."""
    spec = dict(
        nodes=1, devices_per_node=8, intra_bandwidth=1e9, inter_bandwidth=1e9, intra_latency=0.0,
        inter_latency=0.0, device_flops=1e11, device_memory_bytes=2**40,
    )  # fmt: skip
    return write_cluster(path, **{**spec, **rates})


def _ring_seconds(record, bandwidth):
    """A ring's time without latency: all-gather and reduce-scatter (p−1)/p·S/B, all-reduce
    2(p−1)/p·S/B, broadcast (binary tree) ⌈log₂ p⌉·S/B."""
    p, s = record.peers, record.size_bytes
    if p == 1:
        return 0.0
    factor = {"all_gather": (p - 1) / p, "reduce_scatter": (p - 1) / p}.get(record.op)
    if record.op == "all_reduce":
        factor = 2 * (p - 1) / p
    if record.op == "broadcast":
        factor = math.ceil(math.log2(p))
    assert factor is not None, record.op  # the step issues nothing else
    return factor * s / bandwidth


def test_a_dry_run_step_on_free_compute_is_its_collectives_back_to_back(tmp_path):
    """Compute at 10³⁰ FLOP/s: nothing delays an issue, so the step is the sum of the step's
    collectives (the ledger's, held to mpirun elsewhere), each timed by hand; the trace has one
    span per collective and the plot is drawn."""
    bandwidth = 1e9
    cluster = _one_node_cluster(tmp_path / "c.json", device_flops=1e30)
    runs, _ = run_world(recipe("gpt:2,32,40,32,2"), 8, SMALL_CFG)
    time, step = step_time(runs, 8, load_cluster_model(cluster), spans=True)
    run = runs[0][1]
    records = [r for r in records_of(run, run.rank) if r.step == run.last_step]
    assert len(records) == sum(1 for kind, _ in run.events if kind == "issue") > 10
    by_hand = sum(_ring_seconds(r, bandwidth) for r in records)
    assert time["step_s"] == pytest.approx(by_hand, rel=1e-9)
    assert time["comm_s"] == pytest.approx(by_hand, rel=1e-9)
    assert time["exposed_comm_s"] == pytest.approx(by_hand, rel=1e-9)  # nothing hides it
    assert time["compute_s"] < 1e-15
    trace = chrome_trace(step)["traceEvents"]
    assert sum(1 for e in trace if e["ph"] == "X" and e["tid"] == 2) == len(records)


@pytest.mark.parametrize("qgz", [False, True])
def test_deepspeeds_stage3_dry_run_reduces_on_the_reduction_stream(qgz):
    """DeepSpeed's stage 3 (with ZeRO++'s qgZ, or without) on the shipped V100 cluster, 2 nodes
    × 2 ranks: every gradient reduction of the step (qgZ's all-to-alls, or the reduce-scatters)
    lies inside a noted stretch, the stretches' kernels are priced on the reduction stream
    (``reduce_s``), and the step is shorter than the same events run in line (the notes
    removed), as a host runs them; the report names the reduction stream."""
    zero = {**SMALL_CFG["zero_optimization"], "reduce_bucket_size": 500}
    if qgz:
        zero.update(zero_quantized_gradients=True, zero_quantized_weights=True)
    cfg = {
        **SMALL_CFG,
        "zero_optimization": zero,
        "zerosim": {"ranks_per_node": 2, "schedule": "deepspeed"},
    }
    report = dry_run("gpt:2,32,40,32,2", 4, cfg, cluster="zeropp_v100")
    assert report["time"]["reduce_s"] > 0
    assert "DeepSpeed's reduction stream's kernels" in format_report(report)
    runs, _ = run_world(recipe("gpt:2,32,40,32,2"), 4, cfg, op_events=True)
    model = load_cluster_model("zeropp_v100").resized(4)
    reduction = "all_to_all" if qgz else "reduce_scatter"
    for _, run in runs:
        inside, reductions = False, 0
        for kind, value in run.events:
            if kind == "stream":
                inside = value == "reduce"
            elif kind == "issue" and run.comm.calls[value].record.op == reduction:
                assert inside
                reductions += 1
        assert reductions > 1
        noted = simulate(run.events, run.comm.calls, model)
        in_line = simulate([e for e in run.events if e[0] != "stream"], run.comm.calls, model)
        assert noted.reduce_s > 0 and in_line.reduce_s == 0
        assert noted.compute_s < in_line.compute_s
        assert noted.step_s < in_line.step_s


def test_a_dry_run_step_on_a_free_network_is_its_flops_at_the_device_rate(tmp_path):
    """Links at 10³⁰ B/s: the step is the counted matmul FLOPs (held to the layers' shapes in
    tests/test_meta.py) at device_flops × software_factor (no memory bandwidth given: the
    products are priced by their FLOPs alone)."""
    cluster = _one_node_cluster(
        tmp_path / "c.json", intra_bandwidth=1e30, inter_bandwidth=1e30, software_factor=0.5
    )
    trace, plot = tmp_path / "t.json", tmp_path / "m.png"
    report = dry_run("gpt:2,32,40,32,2", 8, SMALL_CFG, cluster=cluster, trace=trace, plot=plot)
    t, flops = report["time"], max(e["flops"] for e in report["ranks"])
    assert t["step_s"] == pytest.approx(flops / 0.5e11, rel=1e-9)
    assert t["compute_s"] == pytest.approx(flops / 0.5e11, rel=1e-9)
    assert t["exposed_comm_s"] < 1e-15 and t["comm_s"] < 1e-15
    assert t["cluster"]["nodes"] == 1
    spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    compute = sum(e["dur"] for e in spans if e["tid"] == 1) / 1e6
    assert compute == pytest.approx(flops / 0.5e11, rel=1e-9)
    assert plot.stat().st_size > 1000
    # a peak under the device's memory: the step runs
    assert report["fits_device"] and t["fits_device"]
    assert all(e["fits_device"] and "would_not_start" not in e for e in report["ranks"])
    assert "OOM" not in format_report(report) and "step " in format_report(report)
    with pytest.raises(ValueError, match="give a cluster"):
        dry_run("gpt:2,32,40,32,2", 8, SMALL_CFG, trace=trace)


@pytest.mark.parametrize("bf16", [False, True])
def test_matrix_products_run_at_the_peak_of_the_runs_dtype(tmp_path, bf16):
    """On a free network, an fp32 step is its FLOPs at device_flops_fp32 (10¹⁰ here), a bf16
    step its FLOPs at device_flops (10¹¹): the same products, ten times faster in bf16."""
    cluster = _one_node_cluster(
        tmp_path / "c.json", intra_bandwidth=1e30, inter_bandwidth=1e30, device_flops_fp32=1e10
    )
    cfg = {k: v for k, v in SMALL_CFG.items() if bf16 or k != "bf16"}
    report = dry_run("gpt:2,32,40,32,2", 8, cfg, cluster=cluster)
    peak = 1e11 if bf16 else 1e10
    flops = max(e["flops"] for e in report["ranks"])
    assert report["dtype"] == ("bfloat16" if bf16 else "float32")
    assert report["time"]["step_s"] == pytest.approx(flops / peak, rel=1e-9)
    assert report["time"]["cluster"]["device_flops"] == peak
    with pytest.raises(ValueError, match="device_flops_fp32 must be a positive number, got 0"):
        _one_node_cluster(tmp_path / "bad.json", device_flops_fp32=0)
        load_cluster_model(tmp_path / "bad.json")


def test_the_cluster_is_resized_to_the_world(tmp_path):
    cluster = _small_cluster(tmp_path / "c.json")
    report = dry_run("gpt:2,32,40,32,2", 8, SMALL_CFG, cluster=cluster)
    assert report["time"]["cluster"]["nodes"] == 2  # 8 ranks, 4 per node


def test_a_peak_above_the_device_memory_is_marked_would_not_start(tmp_path):
    """A device smaller than the step's peak: every class is flagged, the table prints OOM in
    place of a step time, the JSON says fits_device false; at the peak itself, it fits."""
    cluster = _small_cluster(tmp_path / "c.json", device_memory_bytes=2**18)
    plot = tmp_path / "m.png"
    report = dry_run("gpt:2,32,40,32,2", 8, SMALL_CFG, cluster=cluster, plot=plot)
    peaks = [e["peak_bytes"] for e in report["ranks"]]
    assert min(peaks) > 2**18  # the premise: this model's step needs more than 256 KiB
    assert report["fits_device"] is False and report["time"]["fits_device"] is False
    for e in report["ranks"]:
        assert e["fits_device"] is False
        assert (
            e["would_not_start"] == f"peak {e['peak_bytes'] / 2**30:.3g} GiB > device 0.000244 GiB"
        )
    assert report["time"]["peak_bytes"] == max(peaks)
    table = format_report(report)
    assert "would not start" in table and "step: OOM" in table and " s, communication" not in table
    assert json.loads(json.dumps(report))["fits_device"] is False and plot.stat().st_size > 1000
    exact = against_device({k: v for k, v in report.items() if k != "time"}, max(peaks))
    assert exact["fits_device"] and all(e["fits_device"] for e in exact["ranks"])


def test_every_shipped_rate_cites_its_source_and_the_nics_give_the_inter_node_share():
    for name in cluster_names():
        spec = json.loads((CLUSTERS / f"{name}.json").read_text())
        notes = ("name", "comment", "calibration", "backend")
        rates = {k: v for k, v in spec.items() if k not in notes}
        assert rates and all(len(v["source"]) > 20 for v in rates.values()), name
        assert spec.get("backend", "cupy") == "cupy" or "backend torch" in spec["comment"], name
        assert "compute_efficiency" not in spec and "network_efficiency" not in spec
    selene, v100 = load_cluster_model("selene"), load_cluster_model("zeropp_v100")
    c = v100.cluster
    assert c.nodes * c.devices_per_node == 384  # the blog's 384 V100s, 16 per node
    assert c.inter_bandwidth == 4 * 100e9 / 8 / 16  # Figure 6: 4 × 100 Gb/s IB per node
    assert c.device_flops == 2e15 / 16  # the DGX-2's 2 PFLOPS over its 16 GPUs
    assert selene.cluster.inter_bandwidth == 8 * 200e9 / 8 / 8  # 8 HDR HCAs per 8 GPUs
    assert v100.device_memory_bytes == 32 * 2**30  # V100-SXM3-32GB
    assert selene.device_memory_bytes == 80 * 2**30  # A100-80GB


def test_busy_fractions_per_interval_by_hand():
    """Four intervals of 1 s: compute busy over [0.5, 2.5] and [3, 3.25]; communication over
    [1, 4]. Compute fills half of the first, all of the second, half of the third and a quarter
    of the last."""
    spans = [
        ("compute", "matmul", 0.5, 2.5),
        ("comm", "all_gather", 1.0, 4.0),
        ("compute", "matmul", 3.0, 3.25),
    ]
    assert busy_fractions(spans, "compute", 4.0, 4) == pytest.approx([0.5, 1.0, 0.5, 0.25])
    assert busy_fractions(spans, "comm", 4.0, 4) == pytest.approx([0.0, 1.0, 1.0, 1.0])
    assert busy_fractions(spans, "comm", 0.0, 3) == [0.0, 0.0, 0.0]


def test_phases_are_where_the_issued_collectives_change_phase():
    calls = [_call("all_gather", 40, (0, 1), False) for _ in range(3)]
    for call, phase in zip(calls, ("forward", "forward", "backward"), strict=True):
        call.record.phase = phase
    events = [("issue", 0), ("compute", 1000), ("issue", 1), ("compute", 1000), ("issue", 2)]
    step = simulate(events, calls, ClusterModel(CLUSTER), spans=True)
    assert step.phases == [(0.0, "forward"), (pytest.approx(2.0), "backward")]


# Selene's cited rates, written out here from the sources its file quotes: NVLink 300 GB/s each
# way at 370/450 of line rate; 8 HDR HCAs of 25 GB/s for 8 GPUs at 47/50; latency 15 us a step
# between nodes; nccl-tests' busbw at 64 MiB, 142.28 of 159.43 GB/s (nccl issue 1411; the file
# keeps that fraction to 4 digits, so the times agree to 1e-4).
NVLINK, NVLINK_EFF, HCA, HCA_EFF, ALPHA_INTER = 300e9, 0.822, 25e9, 0.94, 15e-6


def test_a_ring_all_gather_over_two_nodes_from_the_cited_rates_by_hand():
    """16 ranks, 8 on each of 2 nodes: one ring, NVLink hops and node crossings at once, so the
    ring runs at the slower of NVLink and the 8 ranks' 8 NICs, not their two times added; of its
    15 hops one crosses the network (15 us) and 14 stay on NVLink (5 us), as NCCL's tuning model
    sums a ring's latency."""
    selene = load_cluster_model("selene").resized(16)
    size = 64 * 2**20
    bus = min(NVLINK * NVLINK_EFF, 8 * HCA * HCA_EFF)  # 188 GB/s: the NICs bind
    by_hand = 14 * 5e-6 + 1 * ALPHA_INTER + (15 / 16) * size / (bus * 142.28 / 159.43)
    assert group_seconds(selene, "all_gather", size, tuple(range(16))) == pytest.approx(
        by_hand, rel=1e-4
    )
    # one rank per node (an inter-node group of a two-level scheme): one device's NIC share
    one_each = tuple(range(0, 16, 8))
    by_hand = ALPHA_INTER + (1 / 2) * size / (HCA * HCA_EFF * 142.28 / 159.43)
    assert group_seconds(selene, "all_gather", size, one_each) == pytest.approx(by_hand, rel=1e-4)
    # inside one node: NVLink at 5 us a step
    by_hand = 7 * 5e-6 + (7 / 8) * size / (NVLINK * NVLINK_EFF * 142.28 / 159.43)
    assert group_seconds(selene, "all_gather", size, tuple(range(8))) == pytest.approx(
        by_hand, rel=1e-4
    )


def test_the_bus_efficiency_is_interpolated_in_log_size_and_held_at_the_ends():
    model = ClusterModel(CLUSTER, bus_efficiency_by_size=((1e6, 0.2), (4e6, 0.8), (16e6, 1.0)))
    assert model.size_efficiency(1.0) == 0.2 and model.size_efficiency(1e6) == 0.2
    assert model.size_efficiency(2e6) == pytest.approx(0.5)  # halfway in log size
    assert model.size_efficiency(8e6) == pytest.approx(0.9)
    assert model.size_efficiency(1e9) == 1.0
    assert ClusterModel(CLUSTER).size_efficiency(123.0) == 1.0  # none given: the line rate


def test_matrix_products_by_roofline():
    """Each product the longer of FLOPs at peak and bytes at memory bandwidth, the stretch over
    the software factor: 1,000 FLOP/s and 100 B/s here."""
    model = ClusterModel(CLUSTER, device_memory_bandwidth=100.0, software_factor=0.5)
    products = {(2000, 50): 3, (100, 400): 2}  # compute-bound 2 s each, memory-bound 4 s each
    assert compute_seconds(model, products) == pytest.approx((3 * 2 + 2 * 4) / 0.5)
    assert compute_seconds(ClusterModel(CLUSTER), products) == pytest.approx(3 * 2 + 2 * 0.1)
    assert compute_seconds(model, 1000) == pytest.approx(2.0)  # FLOPs alone: at peak


def test_the_tracker_counts_each_products_flops_and_bytes():
    """A (4, 8) @ (8, 16) float32 product: 2·4·8·16 FLOPs, 4·(32 + 128 + 64) bytes moved; the
    dry run's trace keeps them as {(FLOPs, bytes): products} per stretch of compute."""
    with meta.tracking() as tracker:
        xp = meta.NAMESPACE
        xp.zeros((4, 8), "float32") @ xp.zeros((8, 16), "float32")
        assert (tracker.matmul_flops, tracker.product_bytes) == (2 * 4 * 8 * 16, 4 * 224)
    runs, _ = run_world(recipe("gpt:1,32,40,16,2"), 2, SMALL_CFG)
    stretches = [v for kind, v in runs[0][1].events if kind == "compute"]
    assert stretches and all(isinstance(v, dict) for v in stretches)
    counted = sum(f * n for v in stretches for (f, _), n in v.items())
    assert counted == runs[0][1].step_flops
    assert all(b > 0 for v in stretches for (_, b) in v)


def test_the_size_efficiency_is_the_quoted_busbw_over_its_largest():
    """Each shipped file's bus_efficiency_by_size is the busbw its source quotes, size by size,
    over the busbw at the largest size quoted (to the file's 4 digits)."""
    for name in cluster_names():
        entry = json.loads((CLUSTERS / f"{name}.json").read_text())["bus_efficiency_by_size"]
        quoted = re.findall(r"'\s*(\d+)\s[^']*?(\d+\.\d\d)[ …]*'", entry["source"])
        busbw = {int(size): float(bw) for size, bw in quoted}
        assert len(busbw) == len(entry["value"]) == 8, name
        top = busbw[max(busbw)]
        for size, fraction in entry["value"]:
            assert fraction == pytest.approx(busbw[size] / top, abs=5e-5), (name, size)


def test_element_wise_work_on_a_gpu_is_kernel_calls_and_bytes_at_the_memory_bandwidth_by_hand():
    """A GPU (CuPy's path) with 100 B/s of memory and 0.5 s a kernel call: 3 calls moving 200 B
    take 3·0.5 + 200/100 = 3.5 s, not over the software factor (the products' alone: 1,000
    FLOPs at 1,000·0.5 FLOP/s take 2 s). Without a call's cost, or on a host's path, the GPU
    rates price nothing."""
    gpu = ClusterModel(
        CLUSTER, software_factor=0.5, device_memory_bandwidth=100.0, kernel_launch_s=0.5
    )
    assert kernel_seconds(gpu, 3, 200) == pytest.approx(3.5)
    events = [("elementwise", (3, 200)), ("compute", 1000), ("elementwise", (1, 0))]
    step = simulate(events, [], gpu)
    assert (step.step_s, step.compute_s) == pytest.approx((3.5 + 2.0 + 0.5, 6.0))
    unpriced = ClusterModel(CLUSTER, software_factor=0.5, device_memory_bandwidth=100.0)
    assert simulate(events, [], unpriced).step_s == pytest.approx(2.0)
    host_path = ClusterModel(
        CLUSTER, device_memory_bandwidth=100.0, kernel_launch_s=0.5, backend="numpy"
    )
    assert not host_path.prices_elementwise
    assert simulate(events, [], host_path).step_s == pytest.approx(1.0)


def test_flash_attention_runs_at_its_cited_efficiency_not_over_the_software_factor_by_hand():
    """1,000 FLOP/s peak, software factor 0.5, attention_efficiency 0.25, 100 B/s of memory:
    an attention kernel of 500 FLOPs and 10 B takes max(500 / 250, 10 / 100) = 2 s (by FLOPs),
    one of 5 FLOPs and 1,000 B max(0.02, 10) = 10 s (by bytes); a product of 1,000 FLOPs 2 s.
    Without the efficiency the kernels are products: 500 FLOPs over 1,000·0.5 FLOP/s, 1 s."""
    model = ClusterModel(
        CLUSTER, software_factor=0.5, device_memory_bandwidth=100.0, attention_efficiency=0.25
    )
    events = [("attention", {(500, 10): 2, (5, 1000): 1}), ("compute", {(1000, 0): 1})]
    step = simulate(events, [], model, spans=True)
    assert step.compute_s == pytest.approx(2 * 2.0 + 10.0 + 2.0)
    assert [label for _, label, _, _ in step.spans] == ["attention", "matmul"]
    assert simulate(events[:1], [], model.with_software_factor(1.0)).step_s == pytest.approx(14.0)
    plain = ClusterModel(CLUSTER, software_factor=0.5, device_memory_bandwidth=100.0)
    assert simulate([("attention", {(500, 10): 1})], [], plain).step_s == pytest.approx(1.0)
    assert simulate([("attention", {(500, 10): 1})], [], plain).step_s == pytest.approx(
        compute_seconds(plain, {(500, 10): 1})
    )


def test_a_cluster_file_for_pytorch_prices_kernels_and_refuses_a_bad_efficiency(
    tmp_path,
):
    path = tmp_path / "torch.json"
    spec = {
        "nodes": 1, "devices_per_node": 2, "intra_bandwidth": 1e10, "inter_bandwidth": 1e10,
        "intra_latency": 1e-5, "inter_latency": 1e-5, "device_flops": 1e11,
        "device_memory_bandwidth": 1e12, "kernel_launch_s": 1e-5, "backend": "torch",
        "attention_efficiency": 0.3,
    }  # fmt: skip
    write_cluster(path, **spec)
    model = load_cluster_model(path)
    assert model.backend == "torch" and model.prices_kernels and model.attention_efficiency == 0.3
    for key in ("attention_efficiency", "memory_efficiency"):
        for bad in (0, 1.5, "fast"):
            write_cluster(path, **{**spec, key: bad})
            refused = f"{key} must be in \\(0, 1\\], got {bad!r}"
            with pytest.raises(ValueError, match=refused):
                load_cluster_model(path)
    # a fraction of nothing would be accepted and never used
    alone = {k: v for k, v in spec.items() if k != "device_memory_bandwidth"}
    write_cluster(path, **alone, memory_efficiency=0.9)
    with pytest.raises(ValueError, match="memory_efficiency is a fraction of device_memory_ban"):
        load_cluster_model(path)
    with pytest.raises(ValueError, match="memory_efficiency is a fraction of device_memory_ban"):
        ClusterModel(CLUSTER, memory_efficiency=0.9)  # built in code, not read from a file


def test_adam_on_the_cupy_path_is_one_kernel_priced_from_selenes_cited_rates_by_hand():
    """An fp32 Adam step on a shard of n elements is CuPy's one ElementwiseKernel: it reads the
    parameter, gradient and two moments and writes back all but the gradient, 7·4·n bytes. On
    Selene (A100 80GB: 2,039 GB/s on the datasheet, of which a streaming kernel reaches 0.889,
    gpu-benches' measured "scale"; a CuPy kernel call 11.4 us, CuPy's own benchmark) a shard
    of 10⁸ elements takes 11.4 us + 2.8 GB / (0.889 · 2,039 GB/s)."""
    n, xp = 10**8, meta.NAMESPACE
    with meta.tracking(backend="cupy") as tracker:
        p, g, m, v = (xp.zeros((n,), "float32") for _ in range(4))
        adam(p, g, m, v, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
    assert tracker.ops == {"kernel": 1} and tracker.op_bytes == 7 * 4 * n
    selene = load_cluster_model("selene")
    by_hand = 11.4e-6 + 7 * 4 * n / (0.889 * 2.039e12)
    assert kernel_seconds(selene, 1, 7 * 4 * n) == pytest.approx(by_hand)


def test_a_rings_latency_counts_only_its_node_crossings_at_the_networks_by_hand():
    """Table 2's 768 GPUs, 96 nodes of 8: a ring all-gather's 767 hops are 95 node crossings at
    15 us and 672 NVLink hops at 5 us, 4.785 ms (the earlier model's 767 × 15 us was 11.5 ms); an
    all-reduce twice that. A message of nothing costs its latency alone."""
    selene = load_cluster_model("selene").resized(768)
    ranks = tuple(range(768))
    assert group_seconds(selene, "all_gather", 0.0, ranks) == pytest.approx(672 * 5e-6 + 95 * 15e-6)
    assert group_seconds(selene, "all_reduce", 0.0, ranks) == pytest.approx(
        2 * (672 * 5e-6 + 95 * 15e-6)
    )


def test_an_all_to_all_over_nodes_sends_each_ranks_bytes_through_its_own_nic_share_by_hand():
    """2 nodes × 2 ranks (CLUSTER: NVLink 100 B/s, one NIC share 10 B/s, no latency): an
    all-to-all of 40 B sends 10 B to each of 3 peers, 10 B over NVLink (0.1 s) and 20 B off the
    node through the sender's own share (2 s) at once: 2 s, where a ring's sharing of the node's
    NICs would give (3/4)·40/20 = 1.5 s. With latency (1 us on the node, 10 us off it): one peer
    on the node, two off it."""
    model = ClusterModel(CLUSTER)
    assert group_seconds(model, "all_to_all", 40, (0, 1, 2, 3)) == pytest.approx(2.0)
    assert group_seconds(model, "all_to_all", 40, (0, 1)) == pytest.approx(0.5 * 40 / 100)
    assert group_seconds(model, "all_to_all", 40, (0, 2)) == pytest.approx(0.5 * 40 / 10)
    timed = ClusterModel(Cluster(2, 2, 100.0, 10.0, 1e-6, 10e-6, 1000.0))
    assert group_seconds(timed, "all_to_all", 0.0, (0, 1, 2, 3)) == pytest.approx(1e-6 + 2e-5)
