"""The dry run's time model: a step's events on a described cluster, against hand-worked times."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from zerosim.analysis.timing import Cluster
from zerosim.cli.dryrun import format_report
from zerosim.dryrun import dry_run
from zerosim.dryrun.report import against_device
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
    with pytest.raises(FileNotFoundError, match=r"not one of the shipped clusters \['selene'"):
        load_cluster_model("no-such-cluster")


def test_a_shipped_cluster_loads_by_name_from_any_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cluster_names() == ["selene", "zeropp_v100"]
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


def test_dry_run_reports_time_and_writes_trace_and_plot(tmp_path):
    cluster = _small_cluster(tmp_path / "c.json", device_memory_bytes=2**40)
    trace, plot = tmp_path / "t.json", tmp_path / "m.png"
    report = dry_run("gpt:2,32,40,32,2", 8, SMALL_CFG, cluster=cluster, trace=trace, plot=plot)
    t = report["time"]
    assert t["step_s"] >= max(t["compute_s"], t["comm_s"]) > 0
    assert t["exposed_comm_s"] == pytest.approx(t["step_s"] - t["compute_s"])
    assert t["cluster"]["nodes"] == 2  # resized to the 8 ranks, 4 per node
    assert json.loads(trace.read_text())["traceEvents"] and plot.stat().st_size > 1000
    # a peak under the device's memory: the step runs
    assert report["fits_device"] and t["fits_device"]
    assert all(e["fits_device"] and "would_not_start" not in e for e in report["ranks"])
    assert "OOM" not in format_report(report) and "step " in format_report(report)
    with pytest.raises(ValueError, match="give a cluster"):
        dry_run("gpt:2,32,40,32,2", 8, SMALL_CFG, trace=trace)


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
        "inter_latency", "device_flops", "device_memory_bytes",
    }  # fmt: skip
    assert v100.device_memory_bytes == 32 * 2**30  # V100-SXM3-32GB
    assert selene.device_memory_bytes == 80 * 2**30  # A100-80GB
