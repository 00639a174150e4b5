"""``zerosim calibrate``: a cluster file of this host from microbenchmarks, loadable by the dry
run, its rates positive and its measurements ordered as physics orders them."""

from __future__ import annotations

import json
import mmap
import os
import sys
import time

import pytest

from zerosim.analysis.timing import collective_time
from zerosim.cli.main import main
from zerosim.dryrun import calibrate, dry_run, load_cluster_model
from zerosim.dryrun.calibrate import fit_alpha_bandwidth
from zerosim.dryrun.host import numpy_hugepages
from zerosim.dryrun.timeline import CLUSTER_KEYS, HOST_KEYS
from zerosim.meta.tracker import RATE_CLASSES


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    out = tmp_path_factory.mktemp("host") / "host.json"
    start = time.perf_counter()
    assert main(["calibrate", "--out", str(out), "--ranks", "2", "--quick"]) == 0
    return out, time.perf_counter() - start


@pytest.mark.mpi
def test_quick_calibration_writes_a_cluster_file_the_dry_run_loads(host):
    path, _ = host
    spec = json.loads(path.read_text())
    # a 2 MiB page's first touch is measured where NumPy advises huge pages
    huge = () if numpy_hugepages() else ("hugepage_fault_s",)
    # --quick does not wait to see freed memory taken back (measure_reclaim, tested below)
    huge += ("cold_hugepage_fault_s", "reclaim_after_s")
    for key in (*CLUSTER_KEYS, *HOST_KEYS, "backend", "device_memory_bytes"):
        assert (key in spec) != (key in huge), key
    assert spec["backend"] == "numpy" and spec["overlap"] is False
    assert spec["devices_per_node"] == 2 and spec["nodes"] == 1
    seconds = {"call_overhead_s", "page_fault_s", "hugepage_fault_s", "one_rank_collective_s"}
    seconds -= set(huge)
    for key in (*CLUSTER_KEYS, "memory_bandwidth", "op_overhead_s", "device_memory_bytes"):
        assert spec[key] > 0, key
    for key in seconds:  # a call and a fresh page: microseconds, not milliseconds
        assert 0 < spec[key] < 1e-2, key
    # a call's time by its size for every rate class: 1 element is its fixed cost, 1 Mi
    # elements (4 MiB and more of cold operands) take far longer
    table = spec["elementwise_by_size"]
    assert sorted(table) == sorted(RATE_CLASSES)
    for rate, points in table.items():
        sizes = [b for b, _ in points]
        assert sizes == sorted(sizes) and len(sizes) == 4, rate
        assert points[-1][1] > 10 * points[0][1], rate
    # each collective's time on both ranks by S, as measured (--quick: to 4 MiB), the largest
    # far slower than 8 bytes
    collectives = spec["collectives_by_size"]
    assert sorted(collectives) == sorted(calibrate.COLLECTIVES)
    for op, points in collectives.items():
        sizes = [b for b, _ in points]
        assert sizes == sorted(set(sizes)) and sizes[-1] == 4 << 20, op
        assert points[-1][1] > 5 * points[0][1], op
    assert (
        load_cluster_model(path).collective_call_seconds("all_gather", 4 << 20)
        == (collectives["all_gather"][-1][1])
    )
    intensities = [x for x, _ in spec["matmul_by_intensity"]]
    assert intensities == sorted(intensities) and len(intensities) >= 4
    assert spec["measurements"]["faults"]["pages"] >= 16_384  # 64 MiB of 4 KiB pages
    # the speed probe train --probe runs after each step: milliseconds of a fixed sample
    assert 1e-4 < spec["measurements"]["probe_s"] < 0.1
    model = load_cluster_model(path)
    assert model.backend == "numpy" and model.prices_elementwise and not model.overlap
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        "zerosim": {"schedule": "paper"},
    }
    report = dry_run("gpt:1,32,80,16,2", 2, cfg, cluster=path)
    assert report["backend"] == "numpy" and report["time"]["step_s"] > 0


@pytest.mark.mpi
def test_every_collective_is_measured_at_every_size_and_products_span_sizes(host):
    """What was measured, not how fast: timings on a shared machine order as load orders them
    (whether bigger messages take longer is printed by ``benchmarks/dryrun_host.py``)."""
    m = json.loads(host[0].read_text())["measurements"]
    rows = m["collectives"]
    sizes = sorted({s for _, s, _ in rows})
    ops = {op for op, _, _ in rows}
    assert ops == {"all_reduce", "all_gather", "reduce_scatter", "broadcast"}
    assert {(op, s) for op, s, _ in rows} == {(op, s) for op in ops for s in sizes}
    assert sizes[0] <= 8 and sizes[-1] >= 2**22 and all(t > 0 for *_, t in rows)
    products = sorted(a * b * c for a, b, c, _ in m["matmul"])
    assert products[-1] >= 8 * products[0] and all(rate > 0 for *_, rate in m["matmul"])


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc and Linux's page faults")
def test_a_fresh_page_is_measured_fresh_when_glibc_holds_a_freed_chunk_that_fits():
    """glibc serves a request from a freed heap chunk that holds it, above the mmap threshold
    too: np.empty then touches pages already resident and faults none. The measurement must
    still count every page of its buffer and price each at microseconds."""
    import resource

    import numpy as np

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    nbytes = 16 << 20
    mapped = np.ones((30 << 20) // 4, np.float32)
    del mapped  # glibc's mmap threshold rises to this freed mapping's 30 MiB
    held = [np.ones((10 << 20) // 4, np.float32) for _ in range(3)]  # now from the heap
    guard = np.ones(1000)  # keeps the three off the heap's top once freed
    del held  # one free 30 MiB chunk inside the heap
    before = faults()
    np.empty(nbytes // 4, np.float32).fill(1.0)
    assert faults() - before < nbytes // 4096 // 10  # the trap: np.empty's pages were resident
    measured = calibrate.measure_page_faults(0.05, nbytes)
    assert measured["pages"] >= nbytes // 4096
    assert 1e-8 < measured["page_fault_s"] < 1e-4
    if measured["hugepage_fault_s"] is not None:  # zeroing 2 MiB: from about 20 µs
        assert 1e-6 < measured["hugepage_fault_s"] < 5e-3
    del guard


AGES = [0.5, 1.0, 1.5, 2.0, 2.5]


@pytest.mark.parametrize(
    ("touches", "cold", "expected"),
    [
        # right after a free 1 ms a page, after idling 9 and 11 ms: taken back (10 ms); warm at
        # 0.5 and 1.0 s of age, cold from 1.5 s: halfway, 1.25 s
        ([1e-3, 1e-3, 9e-3, 11e-3, 1, 1e-3, 1, 1e-3, 1, 8e-3, 1, 9e-3, 1, 9e-3], 10e-3, 1.25),
        # the first idle warm, the next two cold; cold already at 0.5 s: halfway from 0
        (
            [1e-3, 1e-3, 1.1e-3, 9e-3, 11e-3, 1, 5e-3, 1, 1e-3, 1, 8e-3, 1, 9e-3, 1, 9e-3],
            10e-3,
            0.25,
        ),  # fmt: skip
        # one idle cold of four; warm at every age: halfway from the last age to the idle time
        ([1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 7e-3] + [1, 1e-3] * 5, 7e-3, 2.75),
        # idling changes nothing on four tries: the machine takes nothing back, no window
        ([1e-3, 1e-3, 1.2e-3, 1.1e-3, 1e-3, 1.5e-3], None, None),
    ],
)
def test_the_window_after_which_freed_huge_pages_are_taken_back(
    monkeypatch, touches, cold, expected
):
    seconds = iter(touches)
    slept = []
    monkeypatch.setattr(calibrate, "_touch_huge", lambda nbytes: next(seconds))
    monkeypatch.setattr(calibrate.time, "sleep", slept.append)
    measured = calibrate.measure_reclaim()
    assert next(seconds, None) is None  # every touch the plan makes, and no more
    assert measured.get("cold_s") == (None if cold is None else pytest.approx(cold))
    assert measured.get("reclaim_after_s") == expected
    idles = len(measured["idle_s"])
    assert slept == [3.0] * idles + (AGES if expected else [])
    rates = calibrate.reclaim_rates(2e-4, measured)
    if expected is None:
        assert rates == {} and idles == 4
    else:  # a warm huge page's fault plus what a block taken back adds: cold - 1 ms
        assert rates == {"cold_hugepage_fault_s": pytest.approx(2e-4 + cold - 1e-3),
                         "reclaim_after_s": expected}  # fmt: skip


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_measure_reclaims_real_touches_time_a_huge_page_and_free_their_mapping(monkeypatch):
    """``measure_reclaim``'s own touches (no stand-in), the idles skipped: every value is the
    seconds of one 2 MiB page's first touch, more than nothing and far below what zeroing 2 MiB
    takes on any machine (50 ms), and each touch frees its mapping (two to eleven touches of 8
    MiB each leave the resident memory less than one mapping larger)."""
    monkeypatch.setattr(calibrate.time, "sleep", lambda seconds: None)
    before = _resident_bytes()
    measured = calibrate.measure_reclaim(8 << 20)
    grown = _resident_bytes() - before
    touches = [measured["warm_s"], *measured["idle_s"], *(s for _, s in measured["ages"])]
    assert 2 <= len(measured["idle_s"]) <= calibrate.RECLAIM_TRIES
    assert all(0 < s < 0.05 for s in touches), touches
    assert grown < 8 << 20, grown


@pytest.mark.skipif(not hasattr(mmap, "MADV_NOHUGEPAGE"), reason="advises Linux's huge pages")
def test_the_reclaim_benchmark_times_both_page_kinds_by_age(capsys, tmp_path):
    """``benchmarks/page_reclaim.py`` at one short age: a row per page kind and age (the warm
    touch, then 10 ms), asleep and busy, each a first touch of a fresh page, more than nothing
    and far below a second; a bad argument is refused, naming it."""
    from benchmarks import page_reclaim

    out = tmp_path / "rows.json"
    assert page_reclaim.main(["--ages", "0.01", "--repeats", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["page"], r["age_s"]) for r in rows] == [
        ("4 KiB", 0.0), ("4 KiB", 0.01), ("2 MiB", 0.0), ("2 MiB", 0.01)
    ]  # fmt: skip
    assert all(0 < r[k] < 1e6 for r in rows for k in ("asleep_us", "busy_us")), rows
    assert len(capsys.readouterr().out.splitlines()) == 1 + len(rows)
    with pytest.raises(SystemExit):
        page_reclaim.main(["--repeats", "0"])
    assert "--repeats must be at least 1; got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        page_reclaim.main(["--ages", "0.1", "-1"])
    assert "--ages must be 0 or more seconds; got -1.0" in capsys.readouterr().err


def test_the_fit_recovers_alpha_and_bandwidth_of_the_ring_formula():
    alpha, bandwidth, p = 7e-6, 3e9, 2
    rows = [
        [op, s, collective_time(op, s, p, alpha, bandwidth)]
        for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
        for s in (8, 1024, 2**16, 2**20, 2**24)
    ]
    got_alpha, got_bandwidth = fit_alpha_bandwidth(rows, p)
    assert got_alpha == pytest.approx(alpha, rel=1e-6)
    assert got_bandwidth == pytest.approx(bandwidth, rel=1e-6)


def test_a_host_file_prices_elementwise_work_and_moves_collectives_when_waited(tmp_path):
    from zerosim.analysis.timing import Cluster
    from zerosim.dryrun.timeline import ClusterModel, simulate

    class Call:  # a stand-in of VirtualComm.calls' entries: a record and its group
        def __init__(self, blocking):
            self.record = type("R", (), dict(op="all_reduce", size_bytes=1000, phase="p",
                                             group=0, blocking=blocking))()  # fmt: skip
            self.comm = type("C", (), dict(members=(0, 1)))()

    cluster = Cluster(1, 2, 1e9, 1e9, 1e-5, 1e-5, 1e10)
    host = ClusterModel(cluster, backend="numpy", memory_bandwidth=1e9, op_overhead_s=1e-6,
                        overlap=False)  # fmt: skip
    comm_s = 2 * 1e-5 + 1000 / 1e9  # all-reduce on 2 ranks: 2(p−1)α + 2(p−1)/p·S/B
    events = [("issue", 0), ("compute", 1e8), ("elementwise", (10, 4000)), ("wait", 0)]
    step = simulate(events, [Call(False)], host)
    work = 1e8 / 1e10 + 10 * 1e-6 + 4000 / 1e9
    assert step.step_s == pytest.approx(work + comm_s)  # no overlap: after the work
    gpu = ClusterModel(cluster)
    step = simulate(events, [Call(False)], gpu)
    assert step.step_s == pytest.approx(max(1e8 / 1e10, comm_s))  # overlapped, elementwise free


def test_side_by_side_starts_every_benchmark_on_all_ranks_at_once():
    """With ``--ranks N`` the compute benchmarks run on every rank together: each one starts
    after a barrier of the ranks' communicator (one per measured size here), none outside."""

    class Comm:
        barriers = 0

        def barrier(self) -> None:
            Comm.barriers += 1

    sizes = [2**4, 2**6, 2**8]
    with calibrate.side_by_side(Comm()):
        rows = calibrate.measure_elementwise(1e-4, sizes)
    assert [n for n, _ in rows] == sizes and Comm.barriers == len(sizes)
    calibrate.measure_elementwise(1e-4, sizes)  # outside: no barrier
    assert Comm.barriers == len(sizes)


@pytest.mark.mpi
def test_one_rank_is_calibrated_under_mpirun_with_its_one_rank_collective(tmp_path):
    """``--ranks 1`` (the default) runs its benchmarks under ``mpirun -n 1`` too: the file has
    the fixed cost of a collective on a group of one rank, which a step at N = 1 issues (stage
    3 on the paper's schedule issues one a parameter), and no collective between ranks."""
    out = tmp_path / "host1.json"
    assert main(["calibrate", "--out", str(out), "--quick"]) == 0
    spec = json.loads(out.read_text())
    assert spec["devices_per_node"] == 1 and spec["measurements"]["collectives"] == []
    assert 0 < spec["one_rank_collective_s"] < 1e-2
    assert load_cluster_model(out).one_rank_collective_s == spec["one_rank_collective_s"]


def test_a_missing_mpirun_is_refused_naming_what_was_looked_for(monkeypatch, capsys, tmp_path):
    """Every calibration runs under mpirun, N = 1 too: with none next to Python or on PATH the
    command fails at once with an error that says so, and writes nothing."""
    import shutil

    monkeypatch.setattr(shutil, "which", lambda *args, **kwargs: None)
    out = tmp_path / "never.json"
    assert main(["calibrate", "--out", str(out), "--quick"]) != 0
    err = capsys.readouterr().err
    assert "mpirun -n N (N = 1 too)" in err and "no mpirun next to this Python or on PATH" in err
    assert not out.exists()


def test_the_collectives_table_keeps_each_measured_size_once_in_order():
    """On 4 ranks a 4-byte and a 16-byte request both round to 4 float32 elements: the table
    keeps that size once, with its first time."""
    rows = [
        ["all_gather", 16, 3e-5], ["all_gather", 16, 9e-5], ["all_gather", 64, 4e-5],
        ["broadcast", 64, 2e-5], ["broadcast", 16, 1e-5],
    ]  # fmt: skip
    assert calibrate.collectives_by_size(rows) == {
        "all_gather": [[16, 3e-5], [64, 4e-5]],
        "broadcast": [[16, 1e-5], [64, 2e-5]],
    }
