"""The dry run's time model: a step's events on a described cluster, against hand-worked times."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

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
    group_seconds,
    load_cluster_model,
    simulate,
)

# 2 nodes × 2 devices; bandwidths in bytes/s, no latency, 1,000 FLOP/s: easy arithmetic
CLUSTER = Cluster(2, 2, 100.0, 10.0, 0.0, 0.0, 1000.0)


def _call(op, size, members, blocking):
    record = SimpleNamespace(op=op, size_bytes=size, blocking=blocking, phase="p", group="g")
    return SimpleNamespace(record=record, comm=SimpleNamespace(members=members))


def test_a_step_on_two_streams_by_hand():
    calls = [
        _call("all_gather", 40, (0, 1, 2, 3), False),  # AG_inter(40/2, 2 nodes) + AG_intra(40, 2)
        _call("all_reduce", 40, (0, 1), True),  # one node: 2·(1/2)·40/100
    ]
    events = [
        ("compute", 1000),  # 1 s
        ("issue", 0),  # starts at 1: (1/2)·20/10 + (1/2)·40/100 = 1.2 s, ends at 2.2
        ("compute", 2000),  # 1 → 3
        ("wait", 0),  # already done
        ("issue", 1),  # blocking: 3 → 3.4
    ]
    step = simulate(events, calls, ClusterModel(CLUSTER), spans=True)
    assert step.as_dict() == pytest.approx(
        {"step_s": 3.4, "compute_s": 3.0, "comm_s": 1.6, "exposed_comm_s": 0.4}
    )
    waiting = simulate([("issue", 0), ("wait", 0), ("compute", 1000)], calls, ClusterModel(CLUSTER))
    assert waiting.step_s == pytest.approx(2.2)  # compute waits for the gather


def test_two_buckets_one_overlap_by_hand(tmp_path):
    """A backward pass with two gradient buckets, written out by hand from a hand-made cluster
    file: 2 ranks on one node at 100 B/s and 1,000 FLOP/s, both at half efficiency (50 B/s,
    500 FLOP/s), no latency. A reduce-scatter of S bytes takes (1/2)·S/50 s.

    compute  |0 fwd 2|2 bw 3|3 bw 4|4 bw 6|     wait      |
    comm                    |3 rs1 5|5 rs2 7|7 ar 7.16|

    bucket 1 (200 B, 2 s) starts when issued at 3; bucket 2 (200 B), issued at 4, queues behind
    it (5 → 7); compute ends at 6 and waits for both (1 s exposed); the gradient norm's blocking
    all-reduce of 8 B takes 2·(1/2)·8/50 = 0.16 s."""
    path = tmp_path / "hand.json"
    path.write_text(
        json.dumps(
            dict(
                nodes=1,
                devices_per_node=2,
                intra_bandwidth=100.0,
                inter_bandwidth=10.0,
                intra_latency=0.0,
                inter_latency=0.0,
                device_flops=1000.0,
                compute_efficiency=0.5,
                network_efficiency=0.5,
            )  # fmt: skip
        )
    )
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
    comm = [t for s, _, a, b in step.spans if s == "comm" for t in (a, b)]
    assert comm == pytest.approx([3.0, 5.0, 5.0, 7.0, 7.0, 7.16])


def test_efficiencies_scale_compute_and_bandwidth():
    model = ClusterModel(CLUSTER, compute_efficiency=0.5, network_efficiency=0.25)
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
    path.write_text(json.dumps({**good, "compute_efficiency": 0.4, "bogus": 1}))
    with pytest.raises(ValueError, match=r"unknown keys \['bogus'\]"):
        load_cluster_model(path)
    path.write_text(json.dumps({**good, "network_efficiency": 1.5}))
    with pytest.raises(ValueError, match="network_efficiency must be in"):
        load_cluster_model(path)
    path.write_text(json.dumps({**good, "compute_efficiency": 0.4, "name": "x"}))
    assert load_cluster_model(path).compute_efficiency == 0.4
    for bad in (0, -1.0, "80GB", True):
        path.write_text(json.dumps({**good, "device_memory_bytes": bad}))
        with pytest.raises(
            ValueError, match=f"device_memory_bytes must be a positive number of bytes, got {bad!r}"
        ):
            load_cluster_model(path)
    path.write_text(json.dumps({**good, "device_memory_bytes": 80 * 2**30}))
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
    path.write_text(
        json.dumps(
            dict(
                nodes=1,
                devices_per_node=4,
                intra_bandwidth=1e9,
                inter_bandwidth=1e8,
                intra_latency=1e-6,
                inter_latency=5e-6,
                device_flops=1e11,
                **extra,
            )  # fmt: skip
        )
    )
    return path


def _one_node_cluster(path, **rates):
    """8 devices on one node, no latency: a collective of S bytes on p ranks takes its ring's
    c_β(p)·S/B, c_β written out by hand in ``_ring_seconds``."""
    spec = dict(
        nodes=1, devices_per_node=8, intra_bandwidth=1e9, inter_bandwidth=1e9, intra_latency=0.0,
        inter_latency=0.0, device_flops=1e11, device_memory_bytes=2**40,
    )  # fmt: skip
    path.write_text(json.dumps({**spec, **rates}))
    return path


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


def test_a_dry_run_step_on_a_free_network_is_its_flops_at_the_device_rate(tmp_path):
    """Links at 10³⁰ B/s: the step is the counted matmul FLOPs (held to the layers' shapes in
    tests/test_meta.py) at device_flops × compute_efficiency."""
    cluster = _one_node_cluster(
        tmp_path / "c.json", intra_bandwidth=1e30, inter_bandwidth=1e30, compute_efficiency=0.5
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
    with pytest.raises(ValueError, match="device_flops_fp32 must be a positive FLOP/s, got 0"):
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


def test_the_zeropp_cluster_borrows_selenes_factors_and_the_published_hardware():
    selene = load_cluster_model("selene")
    v100 = load_cluster_model("zeropp_v100")
    # nothing fitted to the ZeRO++ figures: the efficiencies are Selene's, whatever its next fit
    assert (v100.compute_efficiency, v100.network_efficiency) == (
        selene.compute_efficiency,
        selene.network_efficiency,
    )
    c = v100.cluster
    assert c.nodes * c.devices_per_node == 384  # the blog's 384 V100s, 16 per node
    assert c.inter_bandwidth == 4 * 100e9 / 8 / 16  # Figure 6: 4 × 100 Gb/s IB per node
    assert c.device_flops == 2e15 / 16  # the DGX-2's 2 PFLOPS over its 16 GPUs
    spec = json.loads((CLUSTERS / "zeropp_v100.json").read_text())
    assert set(spec["comment"]) == {  # every number says where it comes from
        "nodes", "devices_per_node", "intra_bandwidth", "inter_bandwidth", "intra_latency",
        "inter_latency", "device_flops", "device_flops_fp32", "device_memory_bytes",
    }  # fmt: skip
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
