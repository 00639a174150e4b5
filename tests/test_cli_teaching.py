"""The teaching commands: zerosim memory, volume, project, compare, plot (and docs/table1.md)."""

import json
import math
import subprocess
import sys

import pytest
from mpi_helpers import ROOT, run_mpi

from zerosim import analysis
from zerosim.cli import main
from zerosim.comm import LocalWorld
from zerosim.report.compare import format_report, stage_config
from zerosim.report.tables import memory_data, volume_data

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MLP_SIZES = (32 * 256, 256, 256 * 256, 256, 256 * 10, 10)  # zerosim train --model mlp
MLP_PARAMS = sum(MLP_SIZES)


def stage3_shard(n: int) -> int:
    """P at stage 3: every parameter padded to a multiple of N on its own, N-th of each."""
    return sum(-(-size // n) for size in MLP_SIZES)


def run_json(capsys, *argv: str) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def refusal(capsys, *argv: str) -> str:
    """The last stderr line of a command that refuses its input (exit code 2, no traceback):
    argparse's, or the command's own one line."""
    try:
        code = main(list(argv))
    except SystemExit as exit_info:
        code = exit_info.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    return err.splitlines()[-1]


def assert_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 1024


@pytest.mark.parametrize("command", ["memory", "volume", "project", "compare", "plot"])
def test_every_teaching_command_has_help_naming_its_options(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: zerosim {command}" in out
    if command != "plot":
        assert "--json" in out and "--plot FILE.png" in out


def test_memory_prints_the_papers_table1_values_for_7_5b_at_64_ranks(capsys):
    assert main(["memory", "--params", "7.5e9", "--dp", "64", "--stage", "1", "2", "3"]) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert row == ["64", "31.4", "16.6", "1.88"]  # ZeRO paper, Table 1


def test_memory_json_equals_the_analysis_functions_for_every_stage_and_n(capsys):
    data = run_json(capsys, "memory", "--params", "1e9", "--dp", "1", "8", "--json")
    assert len(data["rows"]) == 2 * 5
    for row in data["rows"]:
        n, stage = row["dp"], row["stage"]
        if stage == "megatron":
            want = analysis.megatron_model_states(1e9, n)
        else:
            want = analysis.zero_model_states(1e9, n, int(stage))
        assert {k: row[k] for k in want.as_dict()} == want.as_dict()
    # the paper's stage-2 formula written out: 2Ψ + 14Ψ/N at N = 8
    stage2 = next(r for r in data["rows"] if r["stage"] == "2" and r["dp"] == 8)
    assert stage2["total"] == 2 * 10**9 + 14 * 10**9 // 8


def test_memory_json_in_float32_with_cpu_offload_splits_device_and_host(capsys):
    argv = ["memory", "--params", "1200", "--dp", "4", "--dtype", "float32"]
    data = run_json(capsys, *argv, "--offload-optimizer", "cpu", "--num-states", "1", "--json")
    assert [r["stage"] for r in data["rows"]] == ["1", "2", "3"]  # offload needs stage >= 1
    for row in data["rows"]:
        want = analysis.full_precision_model_states(
            1200, 4, int(row["stage"]), dtype_bytes=4, num_states=1, offload_optimizer="cpu"
        )
        assert (row["device"], row["host"]) == (want.split()["device"], want.split()["host"])
        assert row["host"] == 1200 * 4 // 4  # one momentum array, its shard on the host


def test_memory_table1_prints_docs_table1_md_exactly(capsys):
    assert main(["memory", "--table1"]) == 0
    page = (ROOT / "docs" / "table1.md").read_text()
    assert capsys.readouterr().out == page + "\n"
    # cells as printed in the ZeRO paper and Megatron's docs, written independently here
    assert "| 64 | 31.4 | 16.6 | 1.88 | 536 | 284 | 32 | 4187 | 2218 | 250 |" in page
    assert "| 1024 | 30.1 | 15.1 | 0.12 | 513 | 257 | 2 | 4011 | 2013 | 15.6 |" in page
    assert "| fp16, fp16 | 20 | 4 + 16/d |" in page and "| bf16, fp32 | 18 | 6 + 12/d |" in page


@pytest.mark.parametrize("n, k", [(3, 1), (4, 3), (128, 2)])
def test_volume_json_equals_step_bytes_with_psi_padded_to_n(n, k, capsys):
    params = 1_000_001
    data = run_json(
        capsys, "volume", "--params", str(params), "--dp", str(n), "--accumulation", str(k),
        "--json",
    )  # fmt: skip
    pad = -(-params // n) * n
    once = (n - 1) * (pad // n) * 4  # (N-1)/N · Ψ_pad · b, float32
    expected = {
        "0": (0, 2 * once, 0),
        "1": (0, once, once),
        "2": (0, k * once, once),
        "3": (k * once, 2 * k * once, 0),  # gather in forward and backward, reduce-scatter
    }
    for stage, (forward, backward, step) in expected.items():
        row = data["stages"][stage]
        assert row["padded_numel"] == pad
        assert (row["forward"], row["backward"], row["step"]) == (forward, backward, step)
        assert row == {
            "padded_numel": pad,
            **analysis.step_bytes(int(stage), n, pad, 4, k),
            "total": forward + backward + step,
        }
    mega_pad = -(-params // math.lcm(n, 128)) * math.lcm(n, 128)
    assert data["stages"]["megatron"]["padded_numel"] == mega_pad
    assert data["clip_bytes"]["end_ranks"] == analysis.clip_bytes(n, 0) == 8


@pytest.mark.parametrize("k", [1, 2])
def test_volume_json_gives_deepspeeds_schedule_beside_the_papers(k, capsys):
    """Ψ = 1,000,001 on N = 3: DeepSpeed all-reduces the unpadded Ψ (one bucket, chunks of
    333,334 / 333,334 / 333,333: rank 0 sends 2Ψ − c_0 − c_1 elements), at stage 2 once per
    micro-step, and all-gathers Ψ padded to a multiple of 2N = 6, 1,000,002."""
    params, n = 1_000_001, 3
    data = run_json(
        capsys, "volume", "--params", str(params), "--dp", str(n), "--accumulation", str(k),
        "--json",
    )  # fmt: skip
    reduce = (2 * params - 333_334 - 333_334) * 4
    gather = (n - 1) * 1_000_002 // n * 4
    want = {"0": (reduce, 0), "1": (reduce, gather), "2": (k * reduce, gather)}
    for stage, (backward, step) in want.items():
        row = data["deepspeed"][stage]
        assert (row["forward"], row["backward"], row["step"]) == (0, backward, step)
        assert row["ratio"] == row["total"] / data["stages"][stage]["total"]
    assert data["deepspeed"]["1"]["padded_numel"] == 1_000_002
    assert 1.49 < data["deepspeed"]["1"]["ratio"] < 1.51  # stage 1: 3(N−1)/N·Ψ vs 2(N−1)/N·Ψ


def test_volume_json_for_stage3_with_persistent_parameters_and_reuse(capsys):
    n, params, persist = 4, 100_000, 400
    argv = ["volume", "--params", str(params), "--dp", str(n), "--dtype", "float16"]
    data = run_json(capsys, *argv, "--persistent-numel", str(persist), "--stage3-reuse", "--json")
    row = data["stages"]["3"]
    # 2-byte elements: gather Ψ - Ψ_persist in forward only (reused in backward), reduce-scatter
    # all of Ψ, and all-gather the persistent chunks after the step
    assert row["forward"] == (n - 1) * (params - persist) // n * 2
    assert row["backward"] == (n - 1) * params // n * 2
    assert row["step"] == (n - 1) * persist // n * 2
    want = analysis.step_bytes(3, n, params, 2, 1, persist, backward_gather=False)
    assert {p: row[p] for p in want} == want and row["total"] == (n - 1) * params // n * 4


def test_volume_rejects_a_persistent_numel_that_n_does_not_divide(capsys):
    argv = ["volume", "--params", "1000", "--dp", "4", "--persistent-numel", "6"]
    line = refusal(capsys, *argv)
    assert line.startswith("zerosim volume: persistent_numel must be a multiple of world_size")


def test_project_json_equals_the_time_model_on_the_example_cluster(capsys):
    path = ROOT / "examples" / "cluster_64gpu.json"
    argv = ["project", "--cluster", str(path), "--params", "7e9", "--tokens-per-step", "2e6"]
    data = run_json(capsys, *argv, "--json")
    spec = json.loads(path.read_text())
    spec.pop("name")
    cluster = analysis.Cluster(**spec)
    assert data["world_size"] == 64
    compute = 6 * 7e9 * 2e6 / 64 / (spec["device_flops"] * 0.5)  # 6ΨT FLOPs per device
    for stage, row in data["stages"].items():
        assert row["compute_s"] == pytest.approx(compute, rel=1e-12)
        pad = row["padded_numel"]
        assert pad % 64 == 0 and 0 <= pad - 7e9 < (64 if stage != "megatron" else 128)
        s = pad * 2  # fp16 bytes
        calls = {
            "0": [("all_reduce", s)],
            "1": [("reduce_scatter", s), ("all_gather", s)],
            "2": [("reduce_scatter", s), ("all_gather", s)],
            "3": [("all_gather", s), ("all_gather", s), ("reduce_scatter", s)],
            "megatron": [("reduce_scatter", s), ("all_gather", s)],
        }[stage] + [("all_reduce", 8)]
        comm = cluster.comm_time(calls)
        assert row["comm_s"] == pytest.approx(comm, rel=1e-12)
        assert row["step_s_no_overlap"] == pytest.approx(compute + comm, rel=1e-12)
        assert row["step_s_overlap"] == pytest.approx(max(compute, comm), rel=1e-12)
        name = stage if stage == "megatron" else int(stage)
        want = (
            analysis.megatron_model_states(pad, 64)
            if name == "megatron"
            else analysis.zero_model_states(pad, 64, name)
        )
        assert row["memory"] == want.as_dict()


def test_project_rejects_a_cluster_file_with_an_unknown_key(tmp_path, capsys):
    bad = tmp_path / "cluster.json"
    bad.write_text(json.dumps({"nodes": 1, "gpus": 8}))
    line = refusal(capsys, "project", "--cluster", str(bad), "--params", "1e9")
    assert "unknown keys ['gpus'], missing keys ['devices_per" in line


def test_volume_rejects_an_accumulation_below_one_naming_it(capsys):
    line = refusal(capsys, "volume", "--params", "1000", "--dp", "2", "--accumulation", "0")
    assert line.endswith("argument --accumulation: must be an integer >= 1, got '0'")


@pytest.mark.parametrize("n", [2, 3])
def test_compare_on_a_local_world_reports_equal_bytes_and_memory(n, capsys):
    data = run_json(capsys, "compare", "-n", str(n), "--steps", "2", "--json")
    assert data["ok"] is True and data["world_size"] == n
    assert data["schedules"] == ["deepspeed", "paper"]
    names = ["0", "1", "2", "3", "megatron"]
    assert [(s["schedule"], s["name"]) for s in data["stages"]] == [
        (schedule, name) for schedule in data["schedules"] for name in names
    ]
    pad = -(-MLP_PARAMS // n) * n
    once = (n - 1) * (pad // n) * 4
    for row in data["stages"]:
        if row["name"] in ("megatron", "3") or row["schedule"] != "paper":
            continue
        assert row["padded_numel"] == pad and row["bytes"]["equal"] and row["memory"]["equal"]
        backward = 2 * once if row["stage"] == 0 else once
        assert row["bytes"]["measured"][0][:3] == [0, backward, 0 if row["stage"] == 0 else once]
        params, grads, _, states = row["memory"]["measured"][-1]
        assert params == pad * 4 and states == 2 * pad * 4 // (1 if row["stage"] == 0 else n)
        assert grads == pad * 4 // (n if row["stage"] == 2 else 1)
    assert data["fit"] is not None


@pytest.mark.parametrize("n", [2, 3])
def test_compare_shows_deepspeeds_stage_1_and_2_sending_half_as_much_again(n, capsys):
    """DeepSpeed's schedule all-reduces Ψ (in buckets of 20,000 here, cut at parameter
    boundaries and inside the large ones) and all-gathers Ψ padded to 2N: rank 0 sends
    2(N−1)/N·Ψ·b up to the rounding of each all-reduce's chunks, plus (N−1)/N·Ψ_pad·b."""
    argv = ["compare", "-n", str(n), "--steps", "2", "--stage", "1", "2", "--json"]
    rows = run_json(capsys, *argv)["stages"]
    by = {(r["schedule"], r["name"]): r for r in rows}
    pad = -(-MLP_PARAMS // (2 * n)) * 2 * n
    for name in ("1", "2"):
        deepspeed, paper = by["deepspeed", name], by["paper", name]
        assert deepspeed["padded_numel"] == pad and deepspeed["bytes"]["equal"]
        forward, backward, step, clip = deepspeed["bytes"]["measured"][0]
        assert (forward, step, clip) == (0, (n - 1) * pad // n * 4, 4)  # float32 norm: 4 B
        assert abs(backward - 2 * (n - 1) * MLP_PARAMS * 4 // n) < 4 * 4 * 20
        ratio = sum(deepspeed["bytes"]["measured"][0][:3]) / sum(paper["bytes"]["measured"][0][:3])
        assert 1.49 < ratio < 1.51


@pytest.mark.parametrize("n", [2, 3])
def test_compare_stage3_moves_three_times_the_shard_and_holds_a_nth_of_everything(n, capsys):
    argv = ["compare", "-n", str(n), "--stage", "3", "--steps", "2", "--schedule", "paper"]
    data = run_json(capsys, *argv, "--json")
    (row,) = data["stages"]
    shard = stage3_shard(n)  # P, with Ψ_pad = N·P ≥ Ψ padded as one buffer
    assert row["padded_numel"] == n * shard and row["persistent_numel"] == 0
    once = (n - 1) * shard * 4  # (N-1)/N · Ψ_pad · b
    for rank, measured in enumerate(row["bytes"]["measured"]):
        assert measured == [once, 2 * once, 0, analysis.clip_bytes(n, rank)]
    assert row["bytes"]["formula"][0][:3] == list(analysis.step_bytes(3, n, n * shard, 4).values())
    assert row["memory"]["categories"][-1] == "persistent_params"
    for measured in row["memory"]["measured"]:  # params, grads, master, states, persistent
        assert measured == [shard * 4, shard * 4, 0, 2 * shard * 4, 0]
    want = analysis.full_precision_model_states(n * shard, n, 3, dtype_bytes=4, num_states=2)
    fields = ("params", "grads", "master_params", "optimizer_states")
    assert row["memory"]["formula"][:4] == [getattr(want, c) for c in fields]
    # prefetch (overlap_comm, stage 3's default) gathers a whole pass ahead: every parameter
    assert row["peak_gathered_params"] == [MLP_PARAMS * 4] * n
    assert data["ok"] is True


def test_stage3_persistent_parameters_are_gathered_after_the_step_and_held_whole():
    from zerosim.report.compare import run_stage

    n, threshold = 3, 300
    zero = {"stage3_param_persistence_threshold": threshold}
    row = LocalWorld(n).run(run_stage, "3", "mlp", 2, zero=zero, schedule="paper")[1]
    persist = sum(-(-s // n) * n for s in MLP_SIZES if s <= threshold)  # the two biases of 256, 10
    assert row["persistent_numel"] == persist == 258 + 258 + 12
    shard = stage3_shard(n)
    forward = (n - 1) * (shard - persist // n) * 4
    step = (n - 1) * persist // n * 4  # the persistent chunks, all-gathered after the update
    assert row["bytes"]["measured"][1] == [forward, forward + (n - 1) * shard * 4, step, 16]
    assert row["bytes"]["equal"] and row["memory"]["equal"]
    assert row["memory"]["measured"][0][-1] == persist * 4  # persistent_params, whole on every rank


def test_stage3_deepspeeds_first_step_gathers_persistent_parameters_around_modules():
    """DeepSpeed's coordinator starts persistent parameters partitioned: the step that records
    the trace gathers every parameter in forward and again in backward; the next ones gather
    only the others, once."""
    from zerosim.report.compare import run_stage

    n, threshold = 3, 300
    zero = {"stage3_param_persistence_threshold": threshold}
    shard = stage3_shard(n)
    # the persistent parameters (at most the threshold), each padded to a multiple of N
    persist = sum(-(-size // n) * n for size in MLP_SIZES if size <= threshold)
    step = (n - 1) * persist // n * 4
    first = LocalWorld(n).run(run_stage, "3", "mlp", 1, zero=zero, schedule="deepspeed")[1]
    whole = (n - 1) * shard * 4
    assert first["bytes"]["measured"][1] == [whole, 2 * whole, step, 16]
    assert first["bytes"]["equal"] and first["memory"]["equal"]
    second = LocalWorld(n).run(run_stage, "3", "mlp", 2, zero=zero, schedule="deepspeed")[1]
    forward = (n - 1) * (shard - persist // n) * 4
    assert second["bytes"]["measured"][1] == [forward, whole, step, 16]
    assert second["bytes"]["equal"]


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_compare_with_mixed_precision_holds_the_zero_paper_bytes(precision, capsys):
    n = 2
    argv = ["compare", "-n", str(n), "--steps", "2", "--precision", precision, "--json"]
    data = run_json(capsys, *argv)
    assert data["ok"] is True and data["precision"] == precision
    for row in data["stages"]:
        if row["schedule"] == "deepspeed":  # bytes equal its formula ("ok"); flag: schedule.py
            flagged = row["stage"] in (1, 2) or (precision, row["stage"]) == ("fp16", 3)
            assert ("overflow" in row["bytes"]["phases"]) == flagged
            continue
        pad, mem = row["padded_numel"], row["memory"]
        held = [dict(zip(mem["categories"], r, strict=True)) for r in mem["measured"]]
        assert row["skipped_steps"] == 0 and row["itemsize"] == 2
        if row["name"] == "megatron":  # Megatron's table: bf16 keeps fp32 gradients
            want = analysis.megatron_model_states(
                pad, n, param_bytes=2, grad_bytes=4 if precision == "bf16" else 2
            )
        else:
            want = analysis.zero_model_states(
                pad, n, row["stage"], param_bytes=2, master_bytes=4, num_states=2
            )
        want_bytes = {c: v for c, v in want.as_dict().items() if c != "total"}
        for h in held:
            assert {c: h[c] for c in want_bytes} == want_bytes
            if row["name"] != "megatron":  # 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N
                total = sum(v for c, v in h.items() if c != "persistent_params")
                assert total == analysis.zero_paper_bytes(pad, n, row["stage"])
        phases = row["bytes"]["phases"]
        assert phases[-1] == ("overflow" if precision == "fp16" else "clip")
        backward = row["bytes"]["measured"][0][phases.index("backward")]
        g = 4 if (row["name"], precision) == ("megatron", "bf16") else 2  # gradient bytes
        # (N-1)/N·Ψ_pad times: stage 0 all-reduces the gradients, 1 and 2 reduce-scatter them,
        # 3 gathers the 2-byte parameters again and reduce-scatters the gradients
        per_element = {0: 2 * g, 1: g, 2: g, 3: 2 + g}[row["stage"]]
        assert backward == (n - 1) * pad // n * per_element
    if precision == "fp16":
        assert all(r["loss_scale"] == 2.0**8 for r in data["stages"])  # initial_scale_power 8


def test_compare_refuses_mixed_precision_over_float64(capsys):
    line = refusal(capsys, "compare", "-n", "2", "--precision", "bf16", "--dtype", "float64")
    assert line == "zerosim compare: --precision bf16 needs --dtype float32"


@pytest.mark.parametrize("precision, dtype", [("bf16", "bfloat16"), ("fp32", "float32")])
def test_memory_precision_is_deepspeeds_name_for_the_dtype(precision, dtype, capsys):
    argv = ["memory", "--params", "1e9", "--dp", "8", "--json"]
    by_precision = run_json(capsys, *argv, "--precision", precision)
    assert by_precision == run_json(capsys, *argv, "--dtype", dtype)
    stage3 = next(r for r in by_precision["rows"] if r["stage"] == "3")
    if precision == "bf16":
        want = analysis.zero_model_states(1e9, 8, 3, param_bytes=2, master_bytes=4, num_states=2)
        assert stage3["total"] == want.total == 16 * 10**9 // 8  # 16Ψ/N
    else:
        assert stage3["total"] == (2 + 2) * 4 * 10**9 // 8  # (2 + K_s)·Ψ·b/N, no master


def test_compare_exits_1_and_says_mismatch_when_a_formula_disagrees(monkeypatch, capsys):
    from zerosim.report import compare

    real = compare.step_bytes

    def off_by_one(*args, **kwargs):
        out = real(*args, **kwargs)
        out["step"] += 1
        return out

    monkeypatch.setattr(compare, "step_bytes", off_by_one)
    assert main(["compare", "-n", "2", "--steps", "1", "--stage", "1"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["memory", "--params", "7.5e9", "--dp", "1", "4", "64"],
        ["volume", "--params", "100000", "--dp", "4", "--accumulation", "2"],
        ["project", "--cluster", str(ROOT / "examples" / "cluster_64gpu.json"), "--params", "7e9"],
        ["compare", "-n", "2", "--steps", "1"],
    ],
    ids=["memory", "volume", "project", "compare"],
)
def test_plot_option_writes_a_png(argv, tmp_path, capsys):
    out = tmp_path / "figure.png"
    assert main([*argv, "--plot", str(out)]) == 0
    assert_png(out)


@pytest.mark.parametrize(
    "argv",
    [
        ["memory", "--params", "1e9"],
        ["volume", "--params", "1e6", "--dp", "8"],
        ["timeline", "-n", "3", "--stage", "1"],
        ["timeline", "-n", "2", "--stage", "3", "--schedule", "paper"],
        ["timeline", "-n", "2", "--stage", "3"],
    ],
    ids=["memory", "volume", "timeline", "timeline-stage3-paper", "timeline-stage3"],
)
def test_plot_command_writes_a_png_and_its_data_as_json(argv, tmp_path, capsys):
    out = tmp_path / "figure.png"
    data = run_json(capsys, "plot", *argv, "--out", str(out), "--json")
    assert_png(out)
    if argv[0] == "memory":
        row = next(r for r in data["rows"] if r["stage"] == "3" and r["dp"] == 1024)
        assert row["total"] == analysis.zero_paper_bytes(1e9, 1024, 3)
    elif argv[0] == "volume":
        assert data["stages"]["2"]["backward"] == 7 * 125_000 * 4
    elif argv[-1] == "3":  # DeepSpeed's coordinator: the first fetch prefetches the whole MLP
        calls = [(r["phase"], r["op"]) for r in data["records_by_rank"][1]]
        assert calls.count(("forward", "all_gather")) == 1  # one coalesced call
        assert calls.count(("backward", "all_gather")) == 0  # kept: the prefetch took it
        assert calls.count(("backward", "reduce_scatter")) >= 1
    elif argv[-1] == "1":
        records = data["records_by_rank"]
        assert len(records) == 3
        ops = [r["op"] for r in records[0]]
        # DeepSpeed's schedule: gradient buckets all-reduced (and the norm), one all-gather
        assert ops.count("all_reduce") >= 2 and ops.count("all_gather") == 1
        assert "reduce_scatter" not in ops
    else:  # stage 3: one gather per parameter in forward and in backward, then the release
        records, events = data["records_by_rank"], data["events_by_rank"]
        assert len(records) == len(events) == 2
        calls = [(r["phase"], r["op"]) for r in records[1]]
        assert calls.count(("forward", "all_gather")) == len(MLP_SIZES)
        assert calls.count(("backward", "all_gather")) == len(MLP_SIZES)
        # three Linear modules, each once per pass, released after it ran
        assert sorted((e["module"], e["pass"]) for e in events[0]) == sorted(
            (f"layers.{i}", p) for i in (0, 2, 4) for p in ("forward", "backward")
        )
        assert all(e["stop"] >= e["start"] for e in events[0])


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3, 4])
def test_compare_under_mpirun_exits_0_with_equal_bytes_on_every_rank(n):
    args = [
        "-m",
        "zerosim",
        "compare",
        "--steps",
        "2",
        "--json",
        "--stage",
        "0",
        "1",
        "2",
        "3",
        "megatron",
    ]
    proc = run_mpi(n, args, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)
    assert data["world_size"] == n and data["ok"] is True
    for row in data["stages"]:
        assert len(row["bytes"]["measured"]) == n
        assert row["bytes"]["measured"] == row["bytes"]["formula"]


@pytest.mark.parametrize("shape", [(1, 8, 13, 5), (2, 16, 50, 7), (3, 24, 11, 9)])
def test_gpt_parameter_count_equals_the_built_model(shape):
    from zerosim.nn import GPT
    from zerosim.report.tables import model_params

    n_layer, n_embd, vocab, block = shape
    model = GPT(vocab, block, n_layer, 2, n_embd, seed=0)
    assert model_params(f"gpt:{n_layer},{n_embd},{vocab},{block}") == model.num_parameters()


def test_project_model_equals_project_params_of_the_same_size(capsys):
    from zerosim.report.tables import model_params

    cluster = str(ROOT / "examples" / "cluster_64gpu.json")
    by_model = run_json(capsys, "project", "--cluster", cluster, "--model", "gpt-7b", "--json")
    psi = model_params("gpt-7b")
    by_params = run_json(capsys, "project", "--cluster", cluster, "--params", str(psi), "--json")
    assert 6.5e9 < psi < 7e9
    for stage, row in by_params["stages"].items():  # memory and collectives: Ψ's
        for key in ("padded_numel", "memory", "collectives", "comm_s"):
            assert by_model["stages"][stage][key] == row[key]
    # compute: 6Ψ per token from Ψ; the model's own 6·N_matmul + 12·l·h·s (Narayanan et al.)
    layers, h, v, s = 32, 4096, 32000, 4096  # gpt-7b
    per_token = 6 * (12 * layers * h * h + v * h) + 12 * layers * h * s
    tokens = by_model["compute_flops_per_device"] / per_token
    assert by_params["compute_flops_per_device"] == pytest.approx(6 * psi * tokens, rel=1e-12)
    line = refusal(capsys, "project", "--cluster", cluster, "--model", "llama")
    assert line.startswith("zerosim project: --model 'llama' is not a model")


# -- sizes far beyond any model: an answer at once, or a refusal naming the range ----------------
def test_volume_for_1e15_parameters_answers_within_seconds_with_the_ring_formulas():
    """Ψ = 10^15 on N = 8 in float32 (8 divides Ψ, the 5e8-element buckets and Ψ / 16): one
    (N−1)/N·Ψ·b pass is 3.5·10^15 bytes. The DeepSpeed rows once listed every bucket, and the
    partition of each was found by summing all before it: 10^13 took 84 s, 10^15 never ended."""
    proc = subprocess.run(
        [sys.executable, "-m", "zerosim", "volume", "--params", "1e15", "--dp", "8"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=15,  # interpreter start and imports included
    )
    assert proc.returncode == 0, proc.stderr
    psi, once = "1,000,000,000,000,000", 35 * 10**14
    rows = {}
    for line in proc.stdout.splitlines():
        fields = line.split()
        if fields and fields[0] in ("0", "1", "2", "3", "megatron"):
            rows.setdefault(fields[0], []).append(fields)  # the paper's, then DeepSpeed's
    want = {
        "0": (0, 2 * once, 0),
        "1": (0, once, once),
        "2": (0, once, once),
        "3": (once, 2 * once, 0),
        "megatron": (0, once, once),
    }
    for stage, phases in want.items():
        assert rows[stage][0] == [stage, psi, *(f"{v:,}" for v in (*phases, sum(phases)))]
    deepspeed = {"0": (0, 2 * once, 0, "1.000"), "1": (0, 2 * once, once, "1.500")}
    deepspeed["2"] = deepspeed["1"]
    for stage, (*phases, ratio) in deepspeed.items():
        total = f"{sum(phases):,}"
        assert rows[stage][1] == [stage, psi, *(f"{v:,}" for v in phases), total, ratio]


@pytest.mark.timeout(30)
def test_volume_at_the_largest_size_keeps_its_columns_apart(capsys):
    """Ψ = 10^18, N = 8, float64, k = 1000: stage 3 sends k·3·7/8·Ψ·8 = 2.1·10^22 bytes, a number
    wider than the columns were."""
    argv = ["volume", "--params", "1e18", "--dp", "8", "--dtype", "float64"]
    data = run_json(capsys, *argv, "--accumulation", "1000", "--json")
    once = 7 * 10**18  # (N−1)/N·Ψ·b
    assert data["stages"]["3"] == {
        "padded_numel": 10**18,
        "forward": 1000 * once,
        "backward": 2000 * once,
        "step": 0,
        "total": 3000 * once,
    }
    assert data["deepspeed"]["2"]["backward"] == 1000 * 2 * once
    assert main([*argv, "--accumulation", "1000"]) == 0
    table = capsys.readouterr().out.splitlines()
    row = next(line.split() for line in table if line.split()[:1] == ["3"])
    assert row == [
        "3",
        f"{10**18:,}",
        f"{1000 * once:,}",
        f"{2000 * once:,}",
        "0",
        f"{3000 * once:,}",
    ]


def test_memory_at_1e18_parameters_is_table1s_trillion_row_scaled_exactly(capsys):
    """Ψ = 10^18 (Table 1's 1T model × 10^6) at N = 1024: P_os 4Ψ + 12Ψ/N, P_os+g 2Ψ + 14Ψ/N,
    P_os+g+p 16Ψ/N, in GB; Ψ printed as the integer given, not the float's."""
    assert (
        main(["memory", "--params", "1e18", "--dp", "1", "1024", "--stage", "0", "1", "2", "3"])
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert "Ψ = 1,000,000,000,000,000,000," in lines[0]
    assert lines[-2].split() == ["1", *["16000000000"] * 4]
    assert lines[-1].split() == ["1024", "16000000000", "4011718750", "2013671875", "15625000"]
    assert main(["memory", "--params", "123456789012345678", "--dp", "3", "--stage", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "Ψ = 123,456,789,012,345,678," in lines[0]  # a float would say …,680
    assert lines[-1].split() == ["3", "1975308624"]  # 16Ψ / 10^9, truncated
    argv = ["memory", "--params", "1e18", "--num-states", "1000000", "--dtype", "float64"]
    assert main(argv) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [len(r.split()) for r in rows] == [6] * 6  # N and five stages, never run together


@pytest.mark.parametrize(
    "argv",
    [
        ["volume", "--params", "1e30", "--dp", "8"],
        ["volume", "--params", "1000000000000000001", "--dp", "8"],
        ["memory", "--params", "1e300"],
        ["memory", "--params", "1e25"],
        ["project", "--cluster", "examples/cluster_64gpu.json", "--params", "1.8e308"],
        ["plot", "volume", "--out", "x.png", "--params", "1e19", "--dp", "2"],
    ],
)
def test_a_size_beyond_1e18_is_refused_naming_the_range(argv, capsys):
    value = argv[argv.index("--params") + 1]
    assert refusal(capsys, *argv).endswith(
        f"argument --params: must be a whole number of parameters from 0 to 1e18 (such as "
        f"7.5e9), got '{value}'"
    )


def test_compare_runs_fsdp2s_stage_3_beside_the_papers_with_dim0_shards(capsys):
    """The MLP under FSDP2 at N = 3 (torch's [out, in] weights, each Linear one FSDP module):
    ceil(dim0 / 3) rows of every parameter, S = 2,838 + 22,102 + 1,028 elements per rank;
    every module gathered in forward and again in backward, reduce-scattered once; one
    float32 norm element per parameter (6)."""
    n = 3
    argv = ["compare", "-n", str(n), "--stage", "3", "--steps", "2", "--schedule", "paper"]
    data = run_json(capsys, *argv, "fsdp2", "--json")
    assert [(r["name"], r["schedule"]) for r in data["stages"]] == [("3", "paper"), ("3", "fsdp2")]
    row = data["stages"][1]
    units = [(256, 32), (256,), (256, 256), (256,), (10, 256), (10,)]
    shard = sum(-(-shape[0] // n) * math.prod(shape[1:]) for shape in units)
    assert shard == 2838 + 22102 + 1028 and row["padded_numel"] == n * shard
    once = (n - 1) * shard * 4
    for rank, measured in enumerate(row["bytes"]["measured"]):
        assert measured == [once, 2 * once, 0, analysis.clip_bytes(n, rank, 4, len(units))]
    for measured in row["memory"]["measured"]:  # params, grads, master, states, persistent
        assert measured == [shard * 4, shard * 4, 0, 2 * shard * 4, 0]
    assert row["bytes"]["equal"] and row["memory"]["equal"] and data["ok"] is True
    # the first Linear runs while the second is prefetched: the two largest neighbours
    assert row["peak_gathered_params"] == [n * (2838 + 22102) * 4] * n


def test_compare_refuses_fsdp2_under_mixed_precision(capsys):
    line = refusal(capsys, "compare", "-n", "2", "--schedule", "fsdp2", "--precision", "bf16")
    assert line == "zerosim compare: --schedule fsdp2 needs --precision fp32, got 'bf16'"


def _gpt_shapes(h: int, vocab: int, seq: int) -> tuple[list[tuple[int, ...]], ...]:
    """(one block's, the root's) parameter shapes of an untied GPT, torch's [out, in] weights:
    ln_1, c_attn, attn's c_proj, ln_2, c_fc, mlp's c_proj; wte, wpe, ln_f, lm_head."""
    block = [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,)]
    block += [(4 * h, h), (4 * h,), (h, 4 * h), (h,)]
    return block, [(vocab, h), (seq, h), (h,), (h,), (vocab, h)]


def _shard(shapes: list[tuple[int, ...]], n: int) -> int:
    """Elements of one rank's dim-0 shards: ceil(dim0 / N) rows of every parameter."""
    return sum(-(-s[0] // n) * math.prod(s[1:]) for s in shapes)


def _gpt_fsdp2_units(n: int) -> list[int]:
    """S_u of gpt:2,16,40,32 at N ranks: each block, then the root (wte, wpe, ln_f, lm_head)."""
    block, root = _gpt_shapes(16, 40, 32)
    return [_shard(u, n) for u in (block, block, root)]


@pytest.mark.parametrize("k", [1, 3])
def test_volume_json_gives_fsdp2s_schedule_from_the_models_shapes(k, capsys):
    """At N = 6 every 16-row parameter pads to 18 rows: forward gathers every FSDP module
    k times, backward the two blocks again k times, then one reduce-scatter of each."""
    n, b = 6, 2
    units = _gpt_fsdp2_units(n)
    argv = ["volume", "--model", "gpt:2,16,40,32", "--dp", str(n), "--dtype", "bfloat16"]
    data = run_json(capsys, *argv, "--accumulation", str(k), "--json")
    row = data["fsdp2"]
    assert row["padded_numel"] == n * sum(units)
    assert row["forward"] == k * (n - 1) * b * sum(units)
    assert row["backward"] == (n - 1) * b * (k * sum(units[:2]) + sum(units))
    assert row["step"] == 0 and row["total"] == row["forward"] + row["backward"]
    assert "fsdp2" not in run_json(capsys, "volume", "--params", "1000", "--dp", "4", "--json")


def test_memory_json_gives_fsdp2s_shards_and_gathered_peak(capsys):
    """bf16 gathers, fp32 shards (the optimizer's weights), gradient shard and Adam's 2 states:
    (2 + 2) · 4 · S bytes; the root stays gathered, a block runs beside the prefetched one."""
    n = 6
    units = _gpt_fsdp2_units(n)
    argv = ["memory", "--model", "gpt:2,16,40,32", "--dp", str(n), "--stage", "3"]
    data = run_json(capsys, *argv, "--dtype", "bfloat16", "--num-states", "2", "--json")
    (row,) = data["fsdp2"]
    s = sum(units)
    assert (row["params"], row["grads"], row["optimizer_states"]) == (4 * s, 4 * s, 8 * s)
    assert row["total"] == 16 * s and row["padded_numel"] == n * s
    assert row["peak_gathered_params"] == n * 2 * (units[2] + 2 * units[0])
    argv = ["memory", "--model", "gpt:2,16,40,32", "--dp", str(n), "--stage", "1", "--json"]
    assert "fsdp2" not in run_json(capsys, *argv)


@pytest.mark.parametrize("k", [2, 3])
def test_volume_reduce_every_micro_batch_reduce_scatters_every_fsdp_module_k_times(k, capsys):
    """torch's default with gradient sync left on: each of the k micro-batches reduce-scatters
    every FSDP module's gradients, k·(N−1)·b·Σ_u S_u where the default sends it once; the
    gathers are the same. The flag accepted and ignored would print the once-per-step bytes."""
    n, b = 6, 2
    units = _gpt_fsdp2_units(n)
    argv = ["volume", "--model", "gpt:2,16,40,32", "--dp", str(n), "--dtype", "bfloat16"]
    argv += ["--accumulation", str(k), "--reduce-every-micro-batch"]
    row = run_json(capsys, *argv, "--json")["fsdp2"]
    assert row["reduce_every_micro_batch"] is True
    assert row["forward"] == k * (n - 1) * b * sum(units)
    assert row["backward"] == (n - 1) * b * (k * sum(units[:2]) + k * sum(units))
    assert row["total"] == row["forward"] + row["backward"] and row["step"] == 0
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "gradients reduce-scattered after every micro-batch):" in text
    total = text.splitlines()[-1].split()[-1]
    assert text.splitlines()[-1].split()[0] == "fsdp2" and total == f"{row['total']:,}"


def test_volume_says_fsdp2_reduces_after_the_last_micro_batch_without_the_flag(capsys):
    argv = ["volume", "--model", "gpt:2,16,40,32", "--dp", "6", "--accumulation", "2"]
    assert run_json(capsys, *argv, "--json")["fsdp2"]["reduce_every_micro_batch"] is False
    assert main(argv) == 0
    assert "gradients reduce-scattered after the last micro-batch):" in capsys.readouterr().out


def test_compare_fsdp2_reducing_every_micro_batch_sends_k_reduce_scatters(capsys):
    """The MLP at N = 3 (S = 2,838 + 22,102 + 1,028 elements per rank, as above) with k = 2:
    forward gathers every module k times, backward gathers it again k times and reduce-scatters
    it k times, so backward is 2k·(N−1)·S·4 bytes where once-per-step reducing sends
    (k + 1)·(N−1)·S·4; the engine's ledger and the formula both say so."""
    n, k, shard = 3, 2, 2838 + 22102 + 1028
    argv = ["compare", "-n", str(n), "--stage", "3", "--steps", "2", "--schedule", "fsdp2"]
    data = run_json(capsys, *argv, "--accumulation", str(k), "--reduce-every-micro-batch", "--json")
    (row,) = data["stages"]
    once = (n - 1) * shard * 4
    for rank, (measured, formula) in enumerate(
        zip(row["bytes"]["measured"], row["bytes"]["formula"], strict=True)
    ):
        clip = analysis.clip_bytes(n, rank, 4, 6)
        assert measured == formula == [k * once, 2 * k * once, 0, clip]
    assert data["ok"] is True and row["fsdp2"] == {"reduce_every_micro_batch": True}
    assert "stage 3, fsdp2's schedule reducing every micro-batch (" in format_report(data)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["volume", "--params", "1e6", "--dp", "4", "--accumulation", "2"],
            "--reduce-every-micro-batch is FSDP2's knob: it needs --model (FSDP2's row is built "
            "from its shapes), got --params",
        ),
        (
            ["volume", "--model", "gpt:2,16,40,32", "--dp", "4"],
            "--reduce-every-micro-batch needs --accumulation K >= 2, got 1 (with one micro-batch "
            "FSDP2 reduce-scatters once per step either way)",
        ),
        (
            ["compare", "-n", "2", "--accumulation", "2", "--schedule", "deepspeed", "paper"],
            "--reduce-every-micro-batch is FSDP2's knob: it needs --schedule fsdp2, got "
            "--schedule deepspeed paper",
        ),
        (
            ["compare", "-n", "2", "--accumulation", "2", "--schedule", "fsdp2", "--optimizer",
             "lamb"],
            "--reduce-every-micro-batch is FSDP2's knob: it needs --optimizer adam (the others "
            "run DeepSpeed's stages), got 'lamb'",
        ),
        (
            ["compare", "-n", "2", "--schedule", "fsdp2"],
            "--reduce-every-micro-batch needs --accumulation K >= 2, got 1 (with one micro-batch "
            "FSDP2 reduce-scatters once per step either way)",
        ),
        (
            ["memory", "--params", "1e6", "--dp", "4", "--accumulation", "2"],
            "--reduce-every-micro-batch is FSDP2's knob: it needs --model (FSDP2's row is built "
            "from its shapes), got --params",
        ),
        (
            ["memory", "--model", "gpt:2,16,40,32", "--dp", "4", "--stage", "1", "2",
             "--accumulation", "2"],
            "--reduce-every-micro-batch is FSDP2's knob: it needs stage 3 (FSDP2's row is a "
            "stage-3 row), got --stage 1 2",
        ),
        (
            ["memory", "--model", "gpt:2,16,40,32", "--dp", "4"],
            "--reduce-every-micro-batch needs --accumulation K >= 2, got 1 (with one micro-batch "
            "FSDP2 reduce-scatters once per step either way)",
        ),
    ],
)  # fmt: skip
def test_reduce_every_micro_batch_is_refused_where_it_would_change_nothing(argv, message, capsys):
    line = refusal(capsys, *argv, "--reduce-every-micro-batch")
    assert line == f"zerosim {argv[0]}: {message}"


@pytest.mark.parametrize("every", [False, True])
def test_memory_fsdp2_keeps_the_unsharded_gradients_between_micro_batches_unless_each_reduces(
    every, capsys
):
    """gpt:2,16,40,32 in bf16 over k = 3 micro-batches: reduced only at the last, every unsharded
    gradient waits in reduce_dtype = param_dtype, Ψ · 2 bytes, Ψ = 2·(12h² + 13h) + 2·vocab·h
    + seq·h + 2h (a block: ln_1, ln_2, c_attn, c_proj, c_fc, c_proj; the root: wte, lm_head,
    wpe, ln_f); reduced after every micro-batch, none waits. The fp32 gradient shard (4 · S) and
    the other model states are the same either way."""
    n, k, h, vocab, seq = 6, 3, 16, 40, 32
    psi = 2 * (12 * h * h + 13 * h) + 2 * vocab * h + seq * h + 2 * h
    s = sum(_gpt_fsdp2_units(n))
    argv = ["memory", "--model", "gpt:2,16,40,32", "--dp", str(n), "--stage", "3"]
    argv += ["--dtype", "bfloat16", "--accumulation", str(k)]
    argv += ["--reduce-every-micro-batch"] if every else []
    (row,) = run_json(capsys, *argv, "--json")["fsdp2"]
    assert row["peak_accumulated_grads"] == (0 if every else 2 * psi)
    assert (row["grads"], row["total"]) == (4 * s, 16 * s)
    assert (row["accumulation"], row["reduce_every_micro_batch"]) == (k, every)
    assert main(argv) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    if every:
        assert last.endswith("; no unsharded gradient kept between the k = 3 micro-batches "
                             "(reduce-scattered after every one)")  # fmt: skip
    else:
        assert last.endswith("between the k = 3 micro-batches (reduce-scattered at the last)")


@pytest.mark.parametrize("every", [False, True])
def test_memory_fsdp2_row_holds_what_an_engine_run_holds(every, capsys):
    """zerosim compare's GPT (1 layer, h = 32, vocab 67, 16 positions) trained under FSDP2 at
    N = 3 with k = 2 micro-batches, and zerosim memory's FSDP2 row for the same shapes: the
    float32 gradient shard, 4 · Σ ceil(dim0 / 3) · rest, and the unsharded gradients kept
    between micro-batches, Ψ · 4 bytes reduced at the last (Ψ = 12h² + 13h + 2·67·h + 16h + 2h),
    none reduced after every one; the run measures each on every rank."""
    n, k, h = 3, 2, 32
    block, root = _gpt_shapes(h, 67, 16)
    psi = 12 * h * h + 13 * h + 2 * 67 * h + 16 * h + 2 * h
    flag = ["--reduce-every-micro-batch"] if every else []
    argv = ["compare", "-n", str(n), "--stage", "3", "--schedule", "fsdp2", "--model", "gpt"]
    run = run_json(capsys, *argv, "--steps", "1", "--accumulation", str(k), *flag, "--json")
    (stage,) = run["stages"]
    argv = ["memory", "--model", "gpt:1,32,67,16", "--dp", str(n), "--stage", "3"]
    (row,) = run_json(capsys, *argv, "--dtype", "float32", "--accumulation", str(k), *flag,
                      "--json")["fsdp2"]  # fmt: skip
    want = 0 if every else 4 * psi
    assert row["peak_accumulated_grads"] == want and stage["peak_accumulated_grads"] == [want] * n
    grads = stage["memory"]["categories"].index("grads")
    assert row["grads"] == 4 * _shard(block + root, n)
    assert [measured[grads] for measured in stage["memory"]["measured"]] == [row["grads"]] * n


@pytest.mark.parametrize("every", [False, True])
def test_plot_memory_draws_fsdp2_with_the_gradients_it_keeps(every, tmp_path, capsys, monkeypatch):
    """``plot memory --model`` draws FSDP2 beside the stages: its model states, 16 · S bytes in
    bf16 (fp32 shards), plus Ψ · 2 bytes of unsharded gradients kept over k = 3 micro-batches
    when only the last reduce-scatters (gpt:2,16,40,32 at N = 6, as the memory test above)."""
    from zerosim.report import plots

    drawn = {}
    monkeypatch.setattr(plots, "memory_vs_dp", lambda dp, series, *a, **k: drawn.update(series))
    n, h, vocab, seq = 6, 16, 40, 32
    psi = 2 * (12 * h * h + 13 * h) + 2 * vocab * h + seq * h + 2 * h
    s = sum(_gpt_fsdp2_units(n))
    argv = ["plot", "memory", "--model", "gpt:2,16,40,32", "--dp", str(n), "--dtype", "bfloat16"]
    argv += ["--accumulation", "3", "--out", str(tmp_path / "m.png")]
    argv += ["--reduce-every-micro-batch"] if every else []
    assert main(argv) == 0
    capsys.readouterr()
    if every:
        assert drawn["FSDP2"] == [16 * s]
    else:
        assert drawn["FSDP2 (+ unsharded gradients kept over k = 3)"] == [16 * s + 2 * psi]
    stages = ("0", "1", "2", "3", "megatron")
    assert [k for k in drawn if k.startswith("stage")] == [f"stage {st}" for st in stages]
    line = refusal(capsys, "plot", "memory", "--params", "1e6", "--accumulation", "2", "--out",
                   str(tmp_path / "x.png"))  # fmt: skip
    assert line.startswith("zerosim plot: --accumulation changes FSDP2's row only")


def test_memory_refuses_accumulation_without_an_fsdp2_row(capsys):
    """--accumulation changes FSDP2's row only: with --params it would change nothing."""
    line = refusal(capsys, "memory", "--params", "1e6", "--dp", "4", "--accumulation", "2")
    assert line == (
        "zerosim memory: --accumulation changes FSDP2's row only (gradients kept between "
        "micro-batches): it needs --model (FSDP2's row is built from its shapes), got --params"
    )


def test_the_report_functions_refuse_fsdp2_knobs_without_fsdp2():
    with pytest.raises(ValueError, match="reduce_every_micro_batch=True .* got shapes=None"):
        volume_data(1000, 4, 2, reduce_every_micro_batch=True)
    with pytest.raises(ValueError, match="reduce_every_micro_batch=True .* got shapes=None"):
        memory_data(1000, [4], ["3"], accumulation=2, reduce_every_micro_batch=True)
    with pytest.raises(ValueError, match="needs schedule 'fsdp2', got 'paper'"):
        stage_config("3", schedule="paper", fsdp2={"reduce_every_micro_batch": True})
