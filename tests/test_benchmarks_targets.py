"""The targets table of docs/benchmarks.md judges the benchmarks' rows as the issue states them."""

from test_benchmarks_smoke import sample_rows

from benchmarks import targets


def test_collectives_are_judged_in_both_timing_modes_from_one_and_four_mib():
    def row(n, op, size, ratio, ratio_bar, fast=1.0):
        return {
            "n": n,
            "op": op,
            "bytes": size,
            "ratio_zerosim": ratio,
            "ratio_zerosim_bar": ratio_bar,
            "ratio_fast": fast,
            "ratio_fast_bar": fast,
            **{f"{v}{m}": 1.0 for v in ("raw", "zerosim", "fast") for m in ("", "_bar")},
        }

    rows = [
        row(2, "all_gather", 4096, 0.1, 0.1),  # below the target's range
        row(2, "all_gather", 2**20, 0.96, 0.95),  # 1 MiB: 0.95 is enough
        row(4, "all_reduce", 2**24, 0.97, 0.98, fast=0.9),  # from 4 MiB: 0.97
    ]
    text, met = targets.collectives(rows)
    assert met, text
    assert "back-to-back from 1 MiB: check on min 0.96, median 0.96; check off min 0.90" in text
    assert "one at a time from 4 MiB: check on min 0.98" in text
    rows[2]["ratio_zerosim_bar"] = 0.965  # 4 MiB and up, one at a time: under 0.97
    assert not targets.collectives(rows)[1]
    rows[2]["ratio_zerosim_bar"] = 0.98
    rows[1]["ratio_zerosim"] = 0.94  # 1 MiB, back-to-back: under 0.95
    assert not targets.collectives(rows)[1]
    rows[1]["ratio_zerosim"] = 0.96
    del rows[1]["raw_bar"]  # a mode the rows did not measure is not a pass
    text, met = targets.collectives(rows)
    assert not met and "one at a time from 1 MiB: not measured" in text


def test_collectives_of_an_oversubscribed_world_are_reported_not_judged():
    def row(n, size, ratio, again, cores=2):
        cell = {f"{v}{m}": 1.0 for v in ("raw", "zerosim", "fast") for m in ("", "_bar")}
        for m in ("", "_bar"):
            cell.update({f"ratio_zerosim{m}": ratio, f"ratio_fast{m}": ratio})
            cell[f"ratio_again{m}"] = again
        return {"n": n, "op": "all_gather", "bytes": size, "cores": cores, **cell}

    rows = [row(2, 2**20, 0.96, 0.99), row(2, 2**22, 0.98, 1.01), row(4, 2**22, 0.80, 0.90)]
    text, met = targets.collectives(rows)
    assert met, text  # N = 4 on 2 cores: its 0.80 is listed, not held to 0.97
    assert "raw + bare check" not in text  # rows that did not time the ceiling say nothing of it
    rows[1]["ratio_checked"] = 0.95  # the raw call after a bare check in MPI: reported, not judged
    text, met = targets.collectives(rows)
    assert met and "back-to-back from 4 MiB: check on min 0.98" in text
    assert "A/A 1.01 to 1.01; raw + bare check min 0.95" in text
    assert text.startswith("N = 2 (N = 4 > 2 cores: reported, not judged): ")
    assert "back-to-back from 1 MiB: check on min 0.96, median 0.97" in text
    assert "A/A 0.99 to 1.01" in text
    rows[2]["cores"] = 4  # the same rows on a 4-core machine: judged, and short of 0.97
    assert not targets.collectives(rows)[1]
    rows[0]["ratio_zerosim"] = 0.94  # N = 2 stays judged
    rows[2]["cores"] = 2
    assert not targets.collectives(rows)[1]


def test_adam_is_judged_against_the_copy_bandwidth_and_compared_with_torch():
    rows = sample_rows()["optimizer_step"]  # zerosim: 28.7 GB/s of 30, torch twice as long
    text, met = targets.adam(rows)
    assert met and text.startswith("0.96 of copy bandwidth") and "torch single takes 2.00×" in text
    for r in rows:
        r["copy_gbps"] = 80.0
    assert not targets.adam(rows)[1]  # 0.36 of copy


def test_every_optimizer_is_judged_against_torch_fused_when_it_was_measured():
    rows = sample_rows()["optimizer_step"]  # zerosim 1 µs a step
    rows += [
        {**rows[0], "implementation": "torch fused", "seconds": 1.25e-6},
        {**rows[2], "implementation": "torch fused", "seconds": 0.8e-6},  # SGD-momentum
    ]
    text, met = targets.adam(rows)
    assert not met and "zerosim ÷ torch fused time: Adam 0.80, SGD-momentum 1.25" in text
    rows[-1]["seconds"] = 1e-6
    assert targets.adam(rows)[1]


def test_training_names_the_worst_configuration_and_counts_those_over_one():
    rows = sample_rows()["training_step"]  # ratios (10 + stage) / 11: stages 2 and 3 over 1
    text, met = targets.training(rows)
    assert not met
    assert "4 of 8 configurations at or under 1" in text and "worst: N=2 mlp stage 3" in text
    good = [r for r in rows if r["ratio"] <= 1]
    assert targets.training(good)[1]
    failed = [*good, {**good[0], "ratio": None}]  # a side that did not run is not a pass
    assert not targets.training(failed)[1]


def _scaling_rows(ms):
    return [
        {
            "n": n,
            "stage": 3,
            "params": p,
            "ms": ms(p, n),
            "model_state_bytes": [16 * p // n] * n,
            "formula_bytes": 16 * p // n,
            "padded_numel": p,
            "expected_padded_numel": p,
        }
        for n in (1, 2)
        for p in (1_000, 10_000, 100_000)
    ]


def test_scaling_judges_memory_to_the_byte_and_time_by_the_fit():
    rows = _scaling_rows(lambda p, n: 2.0 + 1e-4 * p / n)
    assert targets.scaling_memory(rows) == ("6 of 6 (N, stage, Ψ) equal on every rank", True)
    text, met = targets.scaling_time(rows)
    assert met and text.startswith("R² ≥ 1.0000")
    rows[-1]["model_state_bytes"][1] += 1
    assert not targets.scaling_memory(rows)[1]
    curved = _scaling_rows(lambda p, n: min(p, 10_000) / 100)  # flat from 10k: not a line
    assert not targets.scaling_time(curved)[1]


def test_allocations_fail_on_a_model_sized_peak_or_a_pool_allocation():
    rows = sample_rows()["allocations"]  # peaks 0.1 to 0.4 of Ψ·b, no pool allocations
    text, met = targets.allocations(rows)
    assert met and text.startswith("peak ≤ 0.40 Ψ·b (stage 3")
    rows[0]["pool_new"] = 1
    assert not targets.allocations(rows)[1]
    rows[0]["pool_new"] = 0
    rows[0]["peak_max"] = rows[0]["psi_bytes"]
    assert not targets.allocations(rows)[1]


def test_table_lists_every_target_and_the_cause_of_each_miss_only():
    rows = sample_rows()
    del rows["scaling"]
    lines = targets.table(rows)
    text = "\n".join(lines)
    assert len([line for line in lines if line.startswith("| ")]) == len(targets.TARGETS) + 2
    assert text.count("not measured (`scaling` did not run)") == 2
    missed = [t for t, m, check, _ in targets.TARGETS if m in rows and not check(rows[m])[1]]
    assert missed == [targets.TARGETS[0][0], targets.TARGETS[3][0]]  # collectives, model
    assert [line for line in lines if line.startswith("- **")] == [
        f"- **{t}.** {cause}" for t, _, _, cause in targets.TARGETS if t in missed
    ]


def test_training_judges_every_peer_deepspeed_included():
    rows = [r for r in sample_rows()["training_step"] if r["ratio"] <= 1]  # DeepSpeed ≤ 0.6
    text, met = targets.training(rows)
    assert met and "against DeepSpeed: 4 of 4 configurations at or under 1" in text
    rows[0] = {**rows[0], "ratio_deepspeed": 1.2}
    text, met = targets.training(rows)
    assert not met and "against DeepSpeed: 3 of 4" in text
    assert "worst: N=2 mlp stage 0 against DeepSpeed" in text
    rows[0] = {**rows[0], "ratio_deepspeed": None}  # DeepSpeed failed on a row: not a pass
    assert not targets.training(rows)[1]
    torch_only = [{**r, "peers": ["torch"], "ratio_deepspeed": None} for r in rows]
    assert targets.training(torch_only)[1]  # DeepSpeed not asked for (--peers torch)


def test_zero_init_cap_needs_every_rank_failing_outside_and_fitting_inside():
    def row(peak, allowance=100, full=200, failed=2):
        return dict(
            peak=peak, formula=60, buffers=20, allowance=allowance, full_model=full,
            outside_failed=failed,
        )  # fmt: skip

    text, met = targets.zero_init_cap([row(80), row(90)])
    assert met and "2/2 ranks failed" in text and "peak ≤ 1.12×" in text
    assert not targets.zero_init_cap([row(80), row(101)])[1]  # a rank over its cap
    assert not targets.zero_init_cap([row(80, failed=1), row(90, failed=1)])[1]
    assert not targets.zero_init_cap([row(80, allowance=250), row(90, allowance=250)])[1]
    assert not targets.zero_init_cap([row(80, allowance=110), row(101, allowance=110)])[1]  # 1.26


def test_large_gpt_needs_100m_parameters_8_ranks_and_states_equal_to_the_formula():
    row = dict(
        params=124_000_000, n=8, step_s=10.0, tokens_per_s=80.0, model_states=2**28,
        formula=2**28, rss_growth=[2**29] * 8, buffers=[2**27] * 8,
    )  # fmt: skip
    text, met = targets.large_gpt([row])
    assert met and text.startswith("Ψ = 124.0M at N = 8") and "16Ψ_pad/N: True" in text
    assert "≤ 1.33×" in text  # 512 MiB of growth against 256 + 128 MiB
    for change in (dict(params=99_000_000), dict(n=4), dict(model_states=2**28 + 16)):
        assert not targets.large_gpt([{**row, **change}])[1], change


def test_dryrun_needs_both_world_sizes_of_gpt3_175b_and_the_fitted_rows_within_ten_percent():
    rows = sample_rows()["dryrun"]
    text, met = targets.dryrun(rows)
    assert met, text
    assert "fitted rows (one per source) at 0.995-1.003 of published" in text
    assert "5 unfitted predictions at 0.35-1.01 of published (reported, not judged)" in text
    slow = [{**r, "wall_s": 61.0} if r.get("n") == 1024 else r for r in rows]
    assert not targets.dryrun(slow)[1]
    big = [{**r, "host_peak_rss_bytes": 5e9} if r.get("n") == 4096 else r for r in rows]
    assert not targets.dryrun(big)[1]
    far = [{**r, "predicted_tflops": 40 * 1.14} if r.get("published_tflops") == 40 else r
           for r in rows]  # fmt: skip
    assert not targets.dryrun(far)[1]  # a fitted row 14% off: its fit did not take
    unfitted_far = [{**r, "predicted_tflops": 1.0} if r.get("published_tflops") == 138 else r
                    for r in rows]  # fmt: skip
    assert targets.dryrun(unfitted_far)[1]  # predictions are reported, not judged
    assert not targets.dryrun([r for r in rows if r.get("n") != 4096])[1]
    quick = [{**r, "model": "gpt3-1.3b"} if r["kind"] == "target" else r for r in rows]
    assert not targets.dryrun(quick)[1]
    wrong = [{**r, "bytes_equal": False} if r.get("n") == 1024 else r for r in rows]
    assert not targets.dryrun(wrong)[1]
    assert not targets.dryrun([r for r in rows if r["kind"] == "target"])[1]  # no fitted rows
    oom = [
        {**r, "fits_device": False, "model": "529.6B", "gpus": 640}
        if r.get("published_tflops") == 138
        else r
        for r in rows
    ]
    text, met = targets.dryrun(oom)  # a step that would not start: named, not a ratio
    assert met and "4 unfitted predictions" in text
    assert "would not start (peak over the device's memory): 529.6B on 640 GPUs" in text


def test_long_run_judges_the_train_queries_paired_against_the_bounded_ledger():
    rows = sample_rows()["long_run"]
    text, met = targets.long_run(rows)
    assert met, text
    assert text == (
        "N = 4, last 100 / first 100 of 400 steps: 1.02 paired against a ≤ 2,000-record ledger "
        "(1.02 plain); a scan of the records: 1.80"
    )
    grown = [{**r, "paired_ratio": 1.15} if r["way"] == "totals" else r for r in rows]
    assert not targets.long_run(grown)[1]
    loaded = [{**r, "ratio": 2.0} for r in rows]  # the load doubled every step time: not judged
    assert targets.long_run(loaded)[1]
    differ = [{**r, "same_bytes": False} for r in rows]
    assert not targets.long_run(differ)[1]


def test_collectives_summary_states_the_fixed_cost_bound_at_four_mib_and_the_spread():
    """The load-robust bound: 40 us of fixed cost over a 960 us raw call caps the ratio at
    960 / 1000 = 0.96; the 4 MiB line quotes each per-round ratio's median and quartiles."""
    from benchmarks.collectives import MIB, summary

    def row(size, raw_bar, ours_bar):
        r = {"n": 2, "op": "reduce_scatter", "bytes": size, "cores": 2}
        for key in ("raw", "again"):
            r.update({key: raw_bar, key + "_bar": raw_bar})
        for key in ("zerosim", "fast"):
            r.update({key: ours_bar, key + "_bar": ours_bar})
        for key in ("zerosim", "fast", "again"):
            for mode in ("", "_bar"):
                r.update(
                    {
                        f"ratio_{key}{mode}": 0.9,
                        f"spread_{key}{mode}": [0.8, 0.95],
                        f"over_us_{key}{mode}": 12.0,
                    }
                )
        return r

    lines = summary([row(4096, 10e-6, 50e-6), row(MIB, 240e-6, 300e-6), row(4 * MIB, 960e-6, 1e-3)])
    bound = next(line for line in lines if line.startswith("N=2, check on: fixed cost"))
    assert "fixed cost per call 40.0 us" in bound
    assert "at 1 MiB, so that cost alone caps the ratio there at 0.857" in bound
    assert "at 4 MiB, so that cost alone caps the ratio there at 0.960" in bound
    spread = [line for line in lines if "reduce_scatter 4 MiB" in line]
    assert len(spread) == 2  # back-to-back and one at a time
    assert "check on 0.900 [0.800, 0.950], +12 us" in spread[0]
