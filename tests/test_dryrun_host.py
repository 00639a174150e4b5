"""A host's time model beyond array work (``dryrun/host.py``): zerosim's own Python calls counted
in the dry run against the same count in a real NumPy run, glibc's malloc replayed on
allocation sequences derived by hand, a gather on one rank as a copy of its closed-form bytes,
the new cluster keys refused when malformed, and each priced by hand-worked numbers."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from cluster_files import write_cluster
from mpi_helpers import run_mpi

from zerosim.analysis.timing import Cluster
from zerosim.dryrun import load_cluster_model
from zerosim.dryrun.host import (
    MMAP_THRESHOLD,
    MallocModel,
    PythonCalls,
    advised_regions,
    counted_code,
    mapped_pages,
)
from zerosim.dryrun.run import FreshPages, recipe, run_world
from zerosim.dryrun.timeline import (
    ClusterModel,
    group_seconds,
    host_breakdown,
    self_copy_seconds,
    simulate,
)

MODEL = "gpt:2,128,128,64,4"  # Ψ = 0.5M


def config(stage: int, schedule: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
        "zerosim": {"dtype": "float32", "schedule": schedule},
    }


def dry_events(stage: int, schedule: str, world: int = 1) -> list:
    runs, _ = run_world(
        recipe(MODEL), world, config(stage, schedule), steps=3, backend="numpy", op_events=True
    )
    return runs[0][1].events


@pytest.mark.mpi
@pytest.mark.parametrize(("stage", "schedule"), [(2, "paper"), (3, "deepspeed")])
def test_python_calls_counted_in_the_dry_run_equal_a_real_numpy_runs(tmp_path, stage, schedule):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config(stage, schedule)))
    proc = run_mpi(1, ["tests/helpers/host_counts_worker.py", MODEL, str(path)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("COUNTS"))
    real_calls = int(line.split()[1])
    dry_calls = sum(n for kind, n in dry_events(stage, schedule) if kind == "python")
    assert real_calls > 1000  # the layers, hooks and strategy: thousands of calls a step
    # the data-dependent branches (docs/dryrun.md) may take a few calls more or fewer: a value
    # the dry run reads is its fill, not the real run's; a stand-in's calls would be thousands
    assert dry_calls == pytest.approx(real_calls, rel=0.01)


def test_only_zerosims_own_code_is_counted():
    assert counted_code("zerosim.zero.stage3") and counted_code("zerosim.nn.linear")
    for module in ("zerosim.meta.array", "zerosim.comm.mpi", "zerosim.dryrun.run", "numpy"):
        assert not counted_code(module), module

    def outside() -> int:
        return 1

    with PythonCalls() as counter:
        for _ in range(5):
            outside()  # this test's own module: not zerosim's
    assert counter.calls == 0


def test_small_buffers_reuse_the_heap_and_a_freed_mapping_raises_the_threshold():
    m = MallocModel(hugepages=True)
    # 1,000 bytes: glibc's request 1,008 (8-byte size field, 16-byte rounding) on the heap
    assert m.allocate(1000, key=1) == (1, 0)  # the heap's first page
    assert m.allocate(1000, key=2) == (0, 0)  # the same page
    # 1 MiB ≥ 128 KiB: a mapping of 1 MiB + 16 bytes of header, 257 pages touched
    assert m.allocate(1 << 20, key=3) == (257, 0)
    m.free(1 << 20, key=3)
    assert m.threshold == (1 << 20) + 4096  # the freed chunk's size: glibc's dynamic threshold
    # now on the heap, from byte 2,016 to 2,016 + 1,048,592: pages 1 … 256 are new
    assert m.allocate(1 << 20, key=4) == (math.ceil((2016 + 1048592 - 4096) / 4096), 0)
    m.free(1 << 20, key=4)  # back into the top; below the trim threshold (2 × 1 MiB + 8 KiB)
    assert m.allocate(1 << 20, key=5) == (0, 0)  # its pages are reused
    assert m.faults == [1 + 257 + 256, 0]


def test_a_heap_top_above_the_trim_threshold_is_given_back_and_touched_again():
    m = MallocModel(hugepages=True)
    # four requests of 100,016 bytes: the heap's top at 400,064, 98 pages touched
    assert [m.allocate(100_000, key=k)[0] for k in range(4)] == [25, 24, 25, 24]
    for k in (3, 2, 1):  # freed from the top down
        m.free(100_000, key=k)
    # after the third free the top starts at 100,016 and 301,392 bytes are free above it, over
    # the trim threshold 2 × 128 KiB: the heap keeps M_TOP_PAD (128 KiB) above the top
    assert m.heap.resident == math.ceil((100_016 + 131_072) / 4096) * 4096 == 233_472
    m.free(100_000, key=0)
    pages = [m.allocate(100_000, key=k)[0] for k in range(3)]
    assert pages == [0, 0, math.ceil((300_048 - 233_472) / 4096)]  # the third crosses it: 17


def test_numpys_huge_page_advice_leaves_the_first_2_mib_and_the_tail_in_small_pages():
    # 64 MiB + 16 bytes of header: 16,385 small pages without advice; with it the 31 regions
    # of 2 MiB after the first take one fault each and 513 small pages remain
    assert mapped_pages(64 << 20, hugepages=False) == (16_385, 0)
    assert mapped_pages(64 << 20, hugepages=True) == (16_385 - 31 * 512, 31)
    assert mapped_pages(2 << 20, hugepages=True) == (513, 0)  # under 4 MiB: no advice
    assert MMAP_THRESHOLD == 128 << 10


def test_a_heap_trim_gives_back_the_huge_pages_of_the_regions_above_the_new_break():
    """Three 6 MiB buffers on the heap (threshold 8 MiB, so the trim threshold is 16 MiB), at
    chunks 0, 6 MiB + 16 and 12 MiB + 32 (requests of 6 MiB + 16 bytes): each buffer's advised
    range, from its first page boundary to its last, holds two whole 2 MiB regions, {1, 2},
    {4, 5} and {7, 8}, faulted as huge pages. Freeing them from the top down, the last free
    leaves about 18 MiB free above a top at 0: the break falls to 128 KiB and every region
    above it (1 … 8) is given back, the six huge ones as huge pages."""
    m = MallocModel(hugepages=True)
    m.threshold = 8 << 20
    faulted = [m.allocate(6 << 20, key=k)[1] for k in range(3)]
    assert faulted == [2, 2, 2] and m.heap_huge == {1, 2, 4, 5, 7, 8}
    assert [m.free(6 << 20, key=k) for k in (2, 1)] == [0, 0]  # below the trim threshold
    assert m.free(6 << 20, key=0) == 6
    assert m.heap.resident == 128 << 10 and not m.heap_huge
    assert m.allocate(6 << 20, key=3)[1] == 2  # the heap grows again: fresh huge pages


def test_an_unmapped_buffer_gives_its_huge_pages_back_and_a_heap_chunk_none():
    m = MallocModel(hugepages=True)
    m.allocate(64 << 20, key=1)  # mapped: 31 huge pages (the test above)
    m.allocate(1000, key=2)  # on the heap
    assert m.free(1000, key=2) == 0
    assert m.free(64 << 20, key=1) == 31
    assert m.free(64 << 20, key=1) == 0  # not live any more: nothing to give back
    m.allocate(64 << 20, key=3)
    assert MallocModel(hugepages=False).free(64 << 20, key=3) == 0  # another model's buffer


def test_the_trace_has_each_stretch_of_fresh_pages_and_of_huge_pages_given_back():
    tracker = SimpleNamespace(storage=0)
    pages = FreshPages(MallocModel(hugepages=True), tracker)
    pages.events = []
    for storage, kind, nbytes in [(1, "alloc", 64 << 20), (2, "alloc", 1000), (2, "free", 1000),
                                  (1, "free", 64 << 20), (3, "alloc", 8 << 20),
                                  (3, "free", 8 << 20)]:  # fmt: skip
        tracker.storage = storage
        pages.listen(kind, nbytes, "activations")
    # 64 MiB: 513 small and 31 huge pages (mapped_pages), 1,000 bytes one heap page; freeing
    # it gives nothing back, the 64 MiB mapping its 31 (64 MiB is over glibc's 32 MiB ceiling:
    # the threshold stays, 8 MiB is mapped too); 8 MiB: 3 huge pages after the first 2 MiB,
    # 513 small pages; each stretch of one kind is one event
    assert pages.events == [("faults", (514, 31)), ("unmapped", 31), ("faults", (513, 3)),
                            ("unmapped", 3)]  # fmt: skip


def reclaiming_host(reclaim_after_s: float) -> ClusterModel:
    """A host whose Python call takes 1 s, a warm 2 MiB fault 1 s and a cold one 10 s."""
    return ClusterModel(
        Cluster(1, 1, 1e9, 1e9, 1e-5, 1e-5, 1e11),
        backend="numpy",
        memory_bandwidth=4e9,
        call_overhead_s=1.0,
        page_fault_s=1e-6,
        hugepage_fault_s=1.0,
        cold_hugepage_fault_s=10.0,
        reclaim_after_s=reclaim_after_s,
        overlap=False,
    )


def test_huge_pages_given_back_longer_ago_than_the_machine_keeps_them_fault_cold_by_hand():
    # A step: 1 s of Python, 3 huge pages unmapped at t = 1, 2 s, then 4 huge pages faulted.
    events = [("python", 1), ("unmapped", 3), ("python", 2), ("faults", (0, 4))]
    # First run, every page warm: the faults at t = 3 take 4 s, a step of 7 s, its pages given
    # back at t = 1, which the next step sees at 1 - 7 = -6. Second run: at t = 3 the 3 pages
    # given back at t = 1 are 2 s old (warm, < 5 s) and taken first; the 4th would come from
    # the step before's, 3 - (-6) = 9 s old: cold. 3·1 + 10 = 13 s of faults, a step of 16 s;
    # a third run sees the step before's pages at 1 - 16 = -15, still cold: settled.
    step = simulate(events, [], reclaiming_host(5.0))
    assert step.step_s == pytest.approx(16.0) and step.cold_huge_pages == 1
    assert step.unmapped == [(1.0, 3)]
    parts = host_breakdown(events, reclaiming_host(5.0), step.cold_huge_pages)
    assert parts["faults_s"] == pytest.approx(13.0) and parts["cold_huge_pages"] == 1
    # kept 10 s: the step before's pages are warm too
    kept = simulate(events, [], reclaiming_host(10.0))
    assert kept.step_s == pytest.approx(7.0) and kept.cold_huge_pages == 0
    # faults before any page is given back in the step take the step before's: given back at
    # t = 5 of a 7 s step (first run), so 2 s old at t = 0; kept 5 s: 3 warm and 1 cold, the
    # step 3 + 10 + 3 = 16 s, and its pages again 2 s old (14 - 16); kept 1.5 s: all 4 cold,
    # 40 + 3 = 43 s (41 - 43 = -2 again)
    first = [("faults", (0, 4)), ("python", 1), ("unmapped", 3), ("python", 2)]
    assert simulate(first, [], reclaiming_host(5.0)).step_s == pytest.approx(16.0)
    assert simulate(first, [], reclaiming_host(1.5)).step_s == pytest.approx(43.0)


def test_one_rank_gathers_and_reduce_scatters_are_copies_of_the_closed_form_bytes():
    """Stage 3 under the paper's schedule on one rank: a rank's shard is its whole parameter,
    so forward and backward gather nothing; the gradients' reduce-scatter and the updated
    parameters' all-gather move Ψ·4 bytes each, every byte read and written once: 2·2·Ψ·4."""
    runs, _ = run_world(recipe(MODEL), 1, config(3, "paper"), backend="numpy", op_events=True)
    run = runs[0][1]
    params = sum(p.numel for p in recipe(MODEL).build().parameters())  # Ψ: one rank, no padding
    host = ClusterModel(Cluster(1, 1, 1e9, 1e9, 1e-5, 1e-5, 1e30), memory_bandwidth=1e9)
    copies = sum(
        self_copy_seconds(host, run.comm.calls[i].record.op, run.comm.calls[i].record.size_bytes)
        for kind, i in run.events
        if kind == "issue"
    )
    assert copies == pytest.approx(2 * 2 * params * 4 / 1e9)
    assert self_copy_seconds(host, "all_reduce", 1e6) == 0.0  # in place: nothing moves


def test_one_rank_copy_is_priced_as_one_call_of_its_bytes_from_the_size_table():
    """With ``elementwise_by_size``, a one-rank gather of S bytes is one native call moving 2·S
    bytes, read off the table between its two measured sizes; an all-reduce is the fixed cost."""
    host = ClusterModel(
        Cluster(1, 1, 1e9, 1e9, 1e-5, 1e-5, 1e11),
        backend="numpy",
        memory_bandwidth=1e9,  # not used where the table is
        one_rank_collective_s=2e-6,
        elementwise_by_size=(("native", ((1_000, 1e-6), (1_000_000, 1e-4))),),
    )
    # 2·S = 500,000 bytes: (500,000 − 1,000) / 999,000 of the way from 1 µs to 100 µs
    by_hand = 2e-6 + 1e-6 + (500_000 - 1_000) / 999_000 * (1e-4 - 1e-6)
    assert self_copy_seconds(host, "all_gather", 250_000) == pytest.approx(by_hand)
    assert self_copy_seconds(host, "reduce_scatter", 250_000) == pytest.approx(by_hand)
    assert self_copy_seconds(host, "all_reduce", 250_000) == 2e-6


class Call:  # a stand-in of VirtualComm.calls' entries: a record and its group
    def __init__(self, op, size, members):
        self.record = type(
            "R", (), dict(op=op, size_bytes=size, phase="p", group=0, blocking=True)
        )()
        self.comm = type("C", (), dict(members=members))()


def test_python_calls_fresh_pages_products_and_one_rank_copies_priced_by_hand():
    host = ClusterModel(
        Cluster(1, 1, 1e9, 1e9, 1e-5, 1e-5, 1e11),
        backend="numpy",
        memory_bandwidth=4e9,
        call_overhead_s=5e-7,
        page_fault_s=2e-6,
        hugepage_fault_s=1e-4,
        matmul_by_intensity=((10.0, 2e10), (100.0, 6e10)),
        one_rank_collective_s=3e-5,
        overlap=False,
    )
    # a product of 4e6 FLOPs over 1e5 bytes: 40 FLOP/byte, between the two measured points
    rate = 2e10 + math.log(40 / 10) / math.log(100 / 10) * (6e10 - 2e10)
    events = [
        ("python", 3000),
        ("faults", (100, 2)),
        ("compute", {(4e6, 1e5): 3}),
        ("issue", 0),  # an all-gather of 8 MB on one rank
    ]
    step = simulate(events, [Call("all_gather", 8e6, (0,))], host)
    gather = 3e-5 + 2 * 8e6 / 4e9  # the call's fixed cost and its copy
    by_hand = 3000 * 5e-7 + 100 * 2e-6 + 2 * 1e-4 + 3 * 4e6 / rate + gather
    assert step.step_s == pytest.approx(by_hand)
    assert step.compute_s == pytest.approx(by_hand - gather)
    one = simulate([("issue", 0)], [Call("all_reduce", 8e6, (0,))], host)
    assert one.step_s == pytest.approx(3e-5)  # in place: the fixed cost alone
    parts = host_breakdown(events, host)
    assert parts["products_s"] == pytest.approx(3 * 4e6 / rate)
    assert parts["python_s"] == pytest.approx(3000 * 5e-7) and parts["python_calls"] == 3000
    assert parts["faults_s"] == pytest.approx(100 * 2e-6 + 2 * 1e-4)
    assert (parts["fresh_pages"], parts["fresh_huge_pages"], parts["elementwise_s"]) == (100, 2, 0)
    # held at the ends; a GPU cluster (no host keys) prices none of them
    assert host.matmul_rate(1e3, 1e3) == 2e10 and host.matmul_rate(1e9, 1e3) == 6e10
    gpu = simulate(events[:2], [], ClusterModel(Cluster(1, 1, 1e9, 1e9, 1e-5, 1e-5, 1e11)))
    assert gpu.step_s == 0.0


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("call_overhead_s", -1, "call_overhead_s must be a positive number, got -1"),
        ("page_fault_s", "fast", "page_fault_s must be a positive number, got 'fast'"),
        ("hugepage_fault_s", 0, "hugepage_fault_s must be a positive number, got 0"),
        ("cold_hugepage_fault_s", -1, "cold_hugepage_fault_s must be a positive number, got -1"),
        ("reclaim_after_s", "soon", "reclaim_after_s must be a positive number, got 'soon'"),
        ("one_rank_collective_s", [], r"one_rank_collective_s must be a positive number, got \[\]"),
        ("matmul_by_intensity", [[10, 1e9], [5, 2e9]], "matmul_by_intensity must be"),
        ("matmul_by_intensity", [[10, -1]], r"got \(\(10, -1\),\)"),
    ],
)
def test_malformed_host_keys_are_refused_naming_key_and_value(tmp_path, key, value, message):
    spec = {
        "nodes": 1, "devices_per_node": 1, "intra_bandwidth": 1e10, "inter_bandwidth": 1e10,
        "intra_latency": 1e-5, "inter_latency": 1e-5, "device_flops": 1e11, "backend": "numpy",
        key: value,
    }  # fmt: skip
    path = write_cluster(tmp_path / "host.json", **spec)
    with pytest.raises(ValueError, match=message):
        load_cluster_model(path)


def test_numpys_advice_on_the_heap_makes_whole_fresh_2_mib_regions_huge_pages():
    # a 6 MiB buffer whose data starts at byte 16 of a heap taken as 2 MiB-aligned: the advice
    # covers bytes 4,096 … 6 MiB, holding the regions 2-4 MiB and 4-6 MiB
    assert advised_regions(16, 6 << 20, touched=0, resident=(6 << 20) + 4096) == range(1, 3)
    # with the first 3 MiB touched before, only the region 4-6 MiB is touched whole now
    assert advised_regions(16, 6 << 20, touched=3 << 20, resident=(6 << 20) + 4096) == range(2, 3)
    assert len(advised_regions(16, 1 << 20, touched=0, resident=2 << 20)) == 0  # none whole
    m = MallocModel(hugepages=True)
    m.threshold = 32 << 20  # as after a freed mapping of 32 MiB: a 6 MiB buffer on the heap
    small, huge = m.allocate(6 << 20, key=1)
    assert huge == 2 and small == math.ceil(((6 << 20) + 32) / 4096) - 2 * 512


def test_copies_are_counted_as_operations_with_the_bytes_they_read_and_write():
    import numpy as np

    from zerosim import meta

    xp = meta.NAMESPACE
    with meta.tracking(backend="numpy") as tracker:
        x = xp.zeros((8, 4), np.float32)  # 128 bytes
        tracker.ops.clear()
        tracker.op_bytes = 0
        x.astype(np.float64)  # reads 128, writes 256
        x.astype(np.float32, copy=False)  # no copy: not an operation
        x.copy()  # 128 + 128
        x[2:4] = 1.0  # a write through an index: 2 rows of 16 bytes written, a scalar read
        xp.concatenate([x, x])  # reads 256, writes 256
        x[xp.zeros((3,), np.int64)]  # a fancy index: 3 rows of 16 bytes, read and written
    assert tracker.ops == {"astype": 1, "copy": 1, "setitem": 1, "concatenate": 1, "getitem": 1}
    assert tracker.op_bytes == (128 + 256) + 256 + 32 + 512 + 96


def test_each_operation_has_the_rate_class_of_the_dtypes_it_reads_and_writes():
    """NumPy's own dtypes run its loops ("native"); bfloat16 arithmetic runs ml_dtypes' loops
    ("bf16"), a cast into bfloat16 "to_bf16", reading bfloat16 into a NumPy dtype (a cast up,
    or an operand NumPy casts before its own loop) "from_bf16"; a copy within bfloat16 is
    NumPy's copy."""
    import numpy as np
    from ml_dtypes import bfloat16

    from zerosim import meta

    xp = meta.NAMESPACE
    seen = []
    with meta.tracking(backend="numpy") as tracker:
        tracker.listeners.append(lambda kind, _, __: kind == "op" and seen.append(tracker.op_class))
        a, b = xp.zeros((4,), np.float32), xp.zeros((4,), np.float32).astype(bfloat16)
        seen.clear()
        _ = a + a, b + b, a.astype(bfloat16), b.astype(np.float32), b * a, b.copy()
        _ = xp.sum(b), xp.sum(b, dtype=np.float32), xp.sqrt(b)
        a[:2] = b[:2]  # bfloat16 read into float32
        b[:2] = a[:2]  # float32 written into bfloat16
    assert seen == [
        *("native", "bf16", "to_bf16", "from_bf16", "from_bf16", "native"),
        *("bf16", "from_bf16", "bf16"),
        *("from_bf16", "to_bf16"),
    ]
    # NumPy's own result dtypes, which the classes follow
    x, y = np.zeros(4, np.float32), np.zeros(4, bfloat16)
    assert ((x * y).dtype, (y + y).dtype, y.sum().dtype) == (np.float32, bfloat16, bfloat16)


def test_element_wise_calls_priced_by_their_size_and_rate_class_by_hand():
    """A host that measured calls by size: a call between two measured sizes is the line
    between them, below the smallest the smallest's time, beyond the largest its bytes at
    the largest's rate; a class the file lacks is priced as native; a stretch's calls each at
    their bin's mean size."""
    host = ClusterModel(
        Cluster(1, 1, 1e9, 1e9, 1e-5, 1e-5, 1e11),
        backend="numpy",
        memory_bandwidth=1e9,
        op_overhead_s=1e-6,
        elementwise_by_size=(
            ("native", ((100, 2e-6), (1100, 4e-6), (10_100, 1e-5))),
            ("bf16", ((100, 5e-6), (10_100, 1e-4))),
        ),
    )
    assert host.elementwise_call_seconds("native", 50) == 2e-6
    assert host.elementwise_call_seconds("native", 600) == pytest.approx(3e-6)
    assert host.elementwise_call_seconds("native", 20_200) == pytest.approx(2e-5)
    assert host.elementwise_call_seconds("bf16", 5_100) == pytest.approx(5e-6 + 0.5 * 95e-6)
    assert host.elementwise_call_seconds("to_bf16", 600) == pytest.approx(3e-6)
    sizes = {("native", 10): [2, 1200], ("bf16", 13): [1, 5_100], ("to_bf16", 7): [4, 400]}
    by_hand = 2 * 3e-6 + (5e-6 + 0.5 * 95e-6) + 4 * 2e-6
    step = simulate([("elementwise", (7, 6_700, sizes))], [], host)
    assert step.step_s == pytest.approx(by_hand)
    # without the sizes (an older trace) or the table: a call's fixed cost, bytes at bandwidth
    assert simulate([("elementwise", (7, 6_700))], [], host).step_s == pytest.approx(
        7 * 1e-6 + 6_700 / 1e9
    )


def test_collectives_on_the_calibrated_ranks_are_priced_from_the_measured_table_by_hand():
    """A 2-rank host file with ``collectives_by_size``: a collective on both ranks is the line
    between the two measured sizes around its S (a reduce priced as the broadcast it moves
    like, below the smallest size the smallest's time); one on a group of another size, or an
    op the table lacks, falls back to the ring formula c_α·α + c_β·S/B."""
    from zerosim.analysis.timing import collective_time

    host = ClusterModel(
        Cluster(1, 2, 1e9, 1e9, 1e-5, 1e-5, 1e11),
        backend="numpy",
        collectives_by_size=(
            ("all_gather", ((1_000, 4e-5), (1_001_000, 1e-3))),
            ("broadcast", ((8, 3e-5), (8_000, 5e-5))),
        ),
    )
    both = (0, 1)
    assert group_seconds(host, "all_gather", 501_000, both) == pytest.approx(4e-5 + 0.5 * 96e-5)
    assert group_seconds(host, "all_gather", 2_002_000, both) == pytest.approx(2e-3)
    assert group_seconds(host, "reduce", 4_004, both) == pytest.approx(3e-5 + 0.5 * 2e-5)
    assert group_seconds(host, "barrier", 0, both) == 3e-5
    four = host.resized(4)  # two nodes of two: a group the table was not measured on
    assert group_seconds(four, "all_gather", 501_000, (0, 1, 2, 3)) == pytest.approx(
        collective_time("all_gather", 501_000, 4, 1e-5, 1e9)
    )
    assert group_seconds(host, "all_reduce", 501_000, both) == pytest.approx(
        collective_time("all_reduce", 501_000, 2, 1e-5, 1e9)
    )


def test_a_malformed_collectives_table_is_refused_naming_the_op(tmp_path):
    spec = {
        "nodes": 1, "devices_per_node": 2, "intra_bandwidth": 1e10, "inter_bandwidth": 1e10,
        "intra_latency": 1e-5, "inter_latency": 1e-5, "device_flops": 1e11, "backend": "numpy",
        "collectives_by_size": {"all_to_all": [[8, 1e-5]]}, "measurements": {},
    }  # fmt: skip
    path = tmp_path / "host.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"collectives_by_size must give only \['all_reduce'"):
        load_cluster_model(path)
    spec["collectives_by_size"] = {"all_gather": [[64, 1e-5], [8, 2e-5]]}
    path.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"collectives_by_size\['all_gather'\] must be"):
        load_cluster_model(path)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"bf16": [[1, 1e-6]]}, "must give 'native'"),
        ({"native": [[1, 1e-6]], "fp8": [[1, 1e-6]]}, "got \\['native', 'fp8'\\]"),
        ({"native": [[10, 1e-6], [5, 2e-6]]}, "elementwise_by_size\\['native'\\] must be"),
        ({"native": [[10, 0]]}, "positive seconds, got \\(\\(10, 0\\),\\)"),
    ],
)
def test_a_malformed_elementwise_table_is_refused_naming_the_class(tmp_path, table, message):
    spec = {
        "nodes": 1, "devices_per_node": 1, "intra_bandwidth": 1e10, "inter_bandwidth": 1e10,
        "intra_latency": 1e-5, "inter_latency": 1e-5, "device_flops": 1e11, "backend": "numpy",
        "elementwise_by_size": table, "measurements": {},
    }  # fmt: skip
    path = tmp_path / "host.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=message):
        load_cluster_model(path)


def test_a_dry_runs_stretches_count_each_call_by_rate_class_and_size():
    """The trace's element-wise events bin every call by (rate class, bytes' bit length); the
    bins add up to the event's calls and bytes, and a bf16 run has bf16 classes where the fp32
    run of the same model has only native calls."""
    classes = {}
    for dtype in ("fp32", "bf16"):
        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 2},
        }
        if dtype == "bf16":
            cfg["bf16"] = {"enabled": True}
        runs, _ = run_world(
            recipe("gpt:1,32,80,16,2"), 1, cfg, steps=2, backend="numpy", op_events=True
        )
        stretches = [v for k, v in runs[0][1].events if k == "elementwise"]
        assert stretches
        for calls, nbytes, sizes in stretches:
            assert sum(c for c, _ in sizes.values()) == calls
            assert sum(b for _, b in sizes.values()) == nbytes
            for (_, bits), (c, b) in sizes.items():  # a bin's mean size is in its range
                assert 2 ** (bits - 1) <= b / c < 2**bits or b == 0
        classes[dtype] = {rate for v in stretches for rate, _ in v[2]}
    assert classes["fp32"] == {"native"}
    assert {"bf16", "to_bf16", "from_bf16"} <= classes["bf16"]


@pytest.mark.parametrize("backend, steps", [("numpy", 3), ("cupy", 2)])
def test_a_dry_run_on_a_host_runs_to_the_first_step_zerosim_train_times(
    backend, steps, tmp_path, monkeypatch
):
    """``zerosim train``'s ``step_s`` leaves out its first two steps, so a dry run standing for
    NumPy on a calibrated host reports the third by default; on a GPU's path the second."""
    from zerosim import dryrun
    from zerosim.cli.train import WARMUP_STEPS

    assert dryrun.HOST_STEPS == WARMUP_STEPS + 1
    spec = {
        "nodes": 1, "devices_per_node": 1, "intra_bandwidth": 1e10, "inter_bandwidth": 1e10,
        "intra_latency": 1e-5, "inter_latency": 1e-5, "device_flops": 1e11, "backend": backend,
    }  # fmt: skip
    host = write_cluster(tmp_path / "host.json", **spec)
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {}}}
    ran, run_world = [], dryrun.run_world
    monkeypatch.setattr(
        dryrun, "run_world", lambda *a, **k: ran.append(k["steps"]) or run_world(*a, **k)
    )
    dryrun.dry_run("gpt:1,16,80,8,2", 1, cfg, cluster=host)
    dryrun.dry_run("gpt:1,16,80,8,2", 1, cfg, cluster=host, steps=1)
    dryrun.dry_run("gpt:1,16,80,8,2", 1, cfg)  # no cluster: 2
    assert ran == [steps, 1, 2]
