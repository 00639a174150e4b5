"""zerosim.report.plots draws PNGs from data; docs/make_figures.py regenerates the docs' figures."""

import subprocess
import sys

import numpy as np
import pytest
from mpi_helpers import ROOT

import zerosim as zs
from zerosim.comm.record import Record
from zerosim.report import plots
from zerosim.zero import deepspeed_layout, megatron_layout

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 1024


def mlp_shapes():
    return [(n, p.shape) for n, p in zs.nn.MLP([8, 6, 3], seed=0).named_parameters()]


def test_memory_vs_dp_writes_a_png_with_one_line_per_stage(tmp_path):
    fig = plots.memory_vs_dp(
        [1, 4, 16], {"0": [3e9, 3e9, 3e9], "3": [3e9, 7.5e8, 1.9e8]}, tmp_path / "m.png"
    )
    assert_png(tmp_path / "m.png")
    (ax,) = fig.axes
    assert [line.get_label() for line in ax.get_lines()] == ["0", "3"]
    # the unit of the range's middle (√(3e9·1.9e8) ≈ 7.5e8 B): MB
    np.testing.assert_allclose(ax.get_lines()[1].get_ydata(), [3000, 750, 190])
    assert ax.get_ylabel() == "MB per rank"


def test_byte_unit_is_the_largest_unit_the_value_reaches():
    assert plots.byte_unit(999) == ("B", 1.0)
    assert plots.byte_unit(3.2e5) == ("kB", 1e3)
    assert plots.byte_unit(2 * 2**30, base=1024) == ("GiB", 2.0**30)
    with pytest.raises(ValueError, match="base must be 1000 or 1024, got 10"):
        plots.byte_unit(1, base=10)


def test_memory_vs_dp_draws_measured_as_markers_and_the_formula_dashed_in_a_unit_that_fits():
    fig = plots.memory_vs_dp(
        [1, 2, 4],
        {"stage 3": [3e5, None, 7.5e4]},
        formula_by_stage={"stage 3": [3e5, 1.5e5, 7.5e4]},
        capacity=("a small device", 2e5),
    )
    (ax,) = fig.axes
    measured, formula, device, *_legend_entries = ax.get_lines()
    assert device.get_label() == "a small device" and list(device.get_ydata()) == [200, 200]
    assert measured.get_linestyle() == "None" and formula.get_linestyle() == "--"
    np.testing.assert_allclose(measured.get_ydata(), [300, np.nan, 75])  # kB, None not drawn
    np.testing.assert_allclose(formula.get_ydata(), [300, 150, 75])
    assert formula.get_color() == measured.get_color() and ax.get_ylabel() == "kB per rank"


def test_lines_marks_events_and_draws_differences_from_a_reference():
    fig = plots.lines(
        {"fp32": [4.0, 3.0], "bf16": [4.0, 3.5]}, reference="fp32", marks={2: "overflow"}
    )
    top, below = fig.axes[:2]
    np.testing.assert_allclose(below.get_lines()[0].get_ydata(), [0.0, 0.5])  # bf16 − fp32
    assert "overflow" in top.get_legend_handles_labels()[1]
    with pytest.raises(ValueError, match="reference must be one of"):
        plots.lines({"a": [1]}, reference="b")


def test_stacked_bars_in_bytes_scale_to_a_unit_and_draw_the_markers():
    fig = plots.stacked_bars(
        {"a": {"x": 2e6}, "b": {"x": 1e6, "y": 5e5}}, in_bytes=True, markers={"b": 3e6}
    )
    ax = fig.axes[0]
    assert ax.get_ylabel().startswith("MB ")
    assert [round(bar.get_height(), 6) for bar in ax.patches] == [2.0, 1.0, 0.0, 0.5]
    (diamonds,) = ax.collections
    np.testing.assert_allclose(diamonds.get_offsets(), [[1, 3.0]])


def test_memory_vs_dp_rejects_a_series_of_the_wrong_length(tmp_path):
    with pytest.raises(ValueError, match=r"bytes_by_stage\['2'\] has 1 values; expected one per"):
        plots.memory_vs_dp([1, 4], {"2": [1.0]}, tmp_path / "m.png")


def test_volume_by_phase_stacks_the_phases_of_each_stage(tmp_path):
    data = {"0": {"backward": 200, "step": 0}, "1": {"backward": 100, "step": 100, "clip": 8}}
    fig = plots.volume_by_phase(data, tmp_path / "v.png")
    assert_png(tmp_path / "v.png")
    bars = fig.axes[0].patches
    tops = {}
    for bar in bars:
        x = round(bar.get_x() + bar.get_width() / 2)
        tops[x] = max(tops.get(x, 0), bar.get_y() + bar.get_height())
    assert tops == {0: 200, 1: 208}


def test_collective_timeline_draws_one_box_per_record_from_records_or_dicts(tmp_path):
    def record(op, start, wall):
        return Record(
            op, "backward", "world", "float32", 8, 32, 24, 24, 4, 0, "model", True, start, wall
        )

    rank0 = [record("reduce_scatter", 1.0, 0.002), record("all_gather", 1.01, None)]
    rank1 = [{"op": "all_reduce", "start": 1.005, "wall_time": 0.001}]
    fig = plots.collective_timeline([rank0, rank1], tmp_path / "t.png")
    assert_png(tmp_path / "t.png")
    boxes = fig.axes[0].patches
    assert len(boxes) == 3
    lefts = sorted(round(b.get_x(), 6) for b in boxes)
    assert lefts == [0.0, 5.0, 10.0]  # ms after the earliest start


def test_lines_draws_one_line_per_series_against_the_step(tmp_path):
    fig = plots.lines({"fp16": [256, 256, 512], "bf16": [1, 1, 1]}, tmp_path / "l.png", log_y=True)
    assert_png(tmp_path / "l.png")
    (ax,) = fig.axes
    assert [line.get_label() for line in ax.get_lines()] == ["fp16", "bf16"]
    np.testing.assert_array_equal(ax.get_lines()[0].get_xdata(), [1, 2, 3])
    assert ax.get_yscale() == "log"
    with pytest.raises(ValueError, match="at least one line"):
        plots.lines({})


def test_lanes_put_overlapping_intervals_side_by_side_and_reuse_free_lanes():
    # [0, 4) and [1, 2) overlap; [2, 3) starts when [1, 2) ends; [5, 6) finds every lane free
    assert plots.lanes([(0, 4), (1, 2), (2, 3), (5, 6)]) == [1, 2, 2, 1]
    assert plots.lanes([(3, 5), (0, 4)]) == [2, 1]  # by start, whatever the input order


def test_gather_release_timeline_draws_collectives_module_spans_and_release_ticks(tmp_path):
    def record(phase, op, start, wall):
        return {"phase": phase, "op": op, "start": start, "wall_time": wall}

    rank0 = [
        record("forward", "all_gather", 1.0, 0.004),
        record("forward", "all_gather", 1.001, 0.004),
    ]
    events0 = [{"module": "fc", "pass": "forward", "start": 1.005, "stop": 1.007}]
    rank1 = [record("backward", "reduce_scatter", 1.002, 0.001)]
    fig = plots.gather_release_timeline([rank0, rank1], [events0, []], tmp_path / "g.png")
    assert_png(tmp_path / "g.png")
    (ax,) = fig.axes
    boxes = ax.patches
    assert len(boxes) == 4  # three collectives, one module span
    # the two forward gathers overlap, so they sit in two lanes of half the height
    gathers = sorted(
        (b for b in boxes if b.get_width() == pytest.approx(4.0)), key=lambda b: b.get_x()
    )
    assert len(gathers) == 2 and gathers[0].get_y() != gathers[1].get_y()
    assert gathers[0].get_height() == pytest.approx(0.2)
    (ticks,) = ax.collections  # one release tick, at the module's stop: 7 ms after the origin
    assert ticks.get_segments()[0][0][0] == pytest.approx(7.0)
    labels = ax.get_legend_handles_labels()[1]
    assert labels == ["forward all_gather", "forward compute", "backward reduce_scatter"]
    with pytest.raises(ValueError, match="one list per rank each, got 2 and 1"):
        plots.gather_release_timeline([rank0, rank1], [events0])


def test_padding_ranges_are_the_elements_no_parameter_occupies():
    ds = deepspeed_layout(mlp_shapes(), 4)  # Ψ = 75 → Ψ_pad = 76
    assert plots.padding_ranges(ds) == [(75, 76)]
    mega = megatron_layout(mlp_shapes(), 4, 20)
    gaps = plots.padding_ranges(mega)
    assert sum(b - a for a, b in gaps) == mega.padded_numel - 75
    assert all(unit.size % 128 == 0 for unit in mega.units) and len(gaps) == len(mega.units)


def test_flat_buffer_and_rank_holdings_write_pngs(tmp_path):
    plots.flat_buffer(megatron_layout(mlp_shapes(), 3, 20), tmp_path / "f.png")
    assert_png(tmp_path / "f.png")
    held = np.full((3, 6), np.nan)
    held[1, 2:4] = [1.0, 2.0]
    plots.rank_holdings(held, tmp_path / "h.png", "rank 1 holds two elements")
    assert_png(tmp_path / "h.png")
    with pytest.raises(ValueError, match="one array per rank, all of the same size"):
        plots.rank_holdings([np.zeros(2), np.zeros(3)])


@pytest.mark.slow
def test_make_figures_writes_every_figure_and_the_table1_page(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "make_figures.py"), "--docs", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    written = sorted(p.name for p in (tmp_path / "figures").iterdir())
    committed = sorted(  # bench_*.png are the benchmarks' (python -m benchmarks), not these
        p.name for p in (ROOT / "docs" / "figures").glob("*.png") if not p.name.startswith("bench_")
    )
    assert written == committed and len(written) == 9
    for name in written:
        assert_png(tmp_path / "figures" / name)
    assert (tmp_path / "table1.md").read_text() == (ROOT / "docs" / "table1.md").read_text()
