"""``benchmarks/dryrun_host.py``'s judging: which steps it keeps (every rank on the CPU for 0.9
of the wall time, after the two warm-up steps), the target by step length, and the grid the
issue names (stages 0-3, both schedules, fp32 and bf16, N = 1 and 2 judged, N = 4 reported)."""

from __future__ import annotations

from benchmarks import dryrun_host as bench


def test_warm_up_steps_and_steps_with_a_rank_off_the_cpu_are_dropped_and_counted():
    report = {
        "step_wall_s": [9.0, 8.0, 0.20, 0.50, 0.21, 0.22, 0.90],
        "step_cpu_share": [0.2, 0.3, 0.95, 0.40, 0.90, 0.99, 0.89],
    }
    kept, dropped, off_speed = bench.kept_steps(report)
    assert kept == [0.20, 0.21, 0.22]  # 0.90 exactly is kept, 0.89 is not
    assert (dropped, off_speed) == (2, 0)
    threads = {"step_wall_s": [1.0, 1.0, 0.3, 0.4], "step_cpu_share": [None] * 4}
    assert bench.kept_steps(threads) == ([0.3, 0.4], 0, 0)  # one process's threads: no share


def test_a_step_beside_a_probe_off_the_calibrated_speed_is_dropped_and_counted():
    """Calibrated at a 2.0 ms probe: a step is kept when the probes right before and after it
    are within 10% (1.8-2.2 ms); a step off the CPU is counted as that, whatever its probes."""
    report = {
        "step_wall_s": [9.0, 8.0, 0.20, 0.21, 0.30, 0.31, 0.22, 0.50],
        "step_cpu_share": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5],
        "step_probe_s": [2e-3, 2.1e-3, 1.9e-3, 2.18e-3, 2.6e-3, 2.0e-3, 2.0e-3, 2.0e-3],
    }
    kept, dropped, off_speed = bench.kept_steps(report, probe_s=2e-3)
    # step 4's own probe is slow, step 5's is fine but the probe before it (step 4's) is not
    assert kept == [0.20, 0.21, 0.22] and (dropped, off_speed) == (1, 2)
    assert bench.kept_steps(report)[0] == [0.20, 0.21, 0.30, 0.31, 0.22]  # no probe_s: none


def test_a_step_of_100_ms_or_more_is_held_to_15_percent_a_faster_one_to_25():
    assert bench.within(1.14, 0.1) and not bench.within(1.16, 0.1)
    assert bench.within(0.86, 2.0) and not bench.within(0.84, 2.0)
    assert bench.within(1.24, 0.099) and not bench.within(1.26, 0.099)
    assert bench.within(0.76, 0.02) and not bench.within(0.74, 0.02)


def test_the_grid_is_the_issues_and_quick_covers_every_stage_schedule_dtype_and_n():
    rows = bench.grid(quick=False, shapes=len(bench.SHAPES))
    assert len(rows) == len(set(rows)) == 4 * 3 * 4 * 2 * 2
    assert {n for _, n, *_ in rows} == {1, 2, 4}
    quick = bench.grid(quick=True, shapes=2)
    for position, values in [(1, {1, 2, 4}), (2, {0, 1, 2, 3}), (3, {"paper", "deepspeed"}),
                             (4, {"fp32", "bf16"})]:  # fmt: skip
        assert {row[position] for row in quick} == values
    subset = bench.grid(False, 1, {"ranks": [2], "stages": [3], "dtypes": None})
    assert len(subset) == 2 * 2 and {(n, stage) for _, n, stage, *_ in subset} == {(2, 3)}
    assert bench.config(2, "paper", "bf16")["bf16"] == {"enabled": True}
    assert "bf16" not in bench.config(2, "paper", "fp32")
