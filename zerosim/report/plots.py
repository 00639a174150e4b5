"""Pictures for the teaching material: each function takes data, draws one figure, writes a PNG.

Memory per rank against the number of ranks for each stage, bytes per phase for each stage, lines
over training steps (a loss, a loss scale), a timeline of the collectives each rank ran (from the
ledger's ``start`` and ``wall_time``) and, for stage 3, the same with the span in which each
module holds its gathered parameters, the flat buffer with its padding and owners, and what each
rank holds of a buffer. Figures are drawn with matplotlib's Agg canvas on a ``Figure`` object (no
pyplot, no global backend, no display), so they work in scripts, tests and notebooks alike;
notebooks show the PNG that was written.

What every picture keeps to: bytes in the unit that fits them (``byte_unit``), what was measured
drawn as markers and a formula as a dashed line, series that coincide told apart by their
markers, events shaded, colour bars that say what they show, titles wrapped to fit the figure.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter, NullLocator

PHASE_COLORS = {
    "forward": "#4c72b0",
    "backward": "#dd8452",
    "step": "#55a868",
    "clip": "#c44e52",
    "overflow": "#8c8c8c",
}
OP_COLORS = {
    "all_gather": "#55a868",
    "reduce_scatter": "#dd8452",
    "all_reduce": "#4c72b0",
    "broadcast": "#8172b3",
    "all_to_all": "#937860",
}
PathLike = str | Path


MARKERS = ("o", "s", "^", "D", "v", "P", "X")
UNITS = {1000: ("B", "kB", "MB", "GB", "TB"), 1024: ("B", "KiB", "MiB", "GiB", "TiB")}


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _title(ax: Any, text: str) -> None:
    """The figure's title, wrapped to the figure's width so that no word is cut off (over the
    whole figure, legends beside the axes included)."""
    chars = max(20, int(ax.figure.get_figwidth() * 72 / 6.5))  # ~6.5 points a character
    ax.figure.suptitle(textwrap.fill(text, chars), fontsize=11)


def byte_unit(largest: float, base: int = 1000) -> tuple[str, float]:
    """(name, bytes) of the largest unit in which ``largest`` bytes is at least 1: 3e5 → kB."""
    if base not in UNITS:
        raise ValueError(f"base must be 1000 or 1024, got {base!r}")
    power = 0
    while power < len(UNITS[base]) - 1 and largest >= base ** (power + 1):
        power += 1
    return UNITS[base][power], float(base**power)


def _save(fig: Figure, path: PathLike | None) -> Figure:
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
    return fig


def memory_vs_dp(
    dp_degrees: Sequence[int],
    bytes_by_stage: Mapping[str, Sequence[float | None]],
    path: PathLike | None = None,
    title: str = "model-state memory per device",
    formula_by_stage: Mapping[str, Sequence[float]] | None = None,
    base: int = 1000,
    capacity: tuple[str, float] | None = None,
) -> Figure:
    """Bytes per rank against N, both axes logarithmic, one colour and marker per stage.

    ``bytes_by_stage``: measured, drawn as hollow markers (of decreasing size, so that series
    which coincide stay visible; None: not measured at that N), joined by a line unless the stage
    also has a formula. ``formula_by_stage``: the formula, a dashed line of the stage's colour
    (with the stage's markers where nothing was measured). The unit (B, kB, MB, GB; ``base``
    1024: KiB … GiB) fits the middle of the range. ``capacity``: (name, bytes) of a device's
    memory, drawn as a dotted line."""
    formula_by_stage = formula_by_stage or {}
    _check_per_degree(dp_degrees, bytes_by_stage=bytes_by_stage, formula_by_stage=formula_by_stage)
    series = (*bytes_by_stage.values(), *formula_by_stage.values())
    known = [float(v) for values in series for v in values if v is not None and v > 0] or [1.0]
    known += [float(capacity[1])] if capacity else []
    # the unit of the middle of the range (log scale): 300 kB … 1,200 kB, not 0.3 … 1.2 MB
    unit, scale = byte_unit(math.sqrt(min(known) * max(known)), base)
    fig = _figure(6.0, 3.8)
    ax = fig.add_subplot()
    stages = [*bytes_by_stage, *(s for s in formula_by_stage if s not in bytes_by_stage)]
    for i, stage in enumerate(stages):
        marks = dict(marker=MARKERS[i % len(MARKERS)], markersize=9 - 1.2 * i,
                     markerfacecolor="none", markeredgewidth=1.5, color=f"C{i % 10}")  # fmt: skip
        if stage in bytes_by_stage:
            y = [np.nan if v is None else float(v) / scale for v in bytes_by_stage[stage]]
            line = "none" if stage in formula_by_stage else "-"
            ax.plot(dp_degrees, y, linestyle=line, label=stage, **marks)
        if stage in formula_by_stage:
            y = np.asarray(formula_by_stage[stage], dtype=float) / scale
            if stage in bytes_by_stage:
                ax.plot(dp_degrees, y, linestyle="--", color=marks["color"], linewidth=1.2)
            else:
                ax.plot(dp_degrees, y, linestyle="--", linewidth=1.2, label=stage, **marks)
    if capacity:
        ax.axhline(capacity[1] / scale, color="black", linestyle=":", label=capacity[0])
    if set(bytes_by_stage) & set(formula_by_stage):
        ax.plot([], [], linestyle="none", marker="o", markerfacecolor="none", color="grey",
                label="measured")  # fmt: skip
        ax.plot([], [], linestyle="--", color="grey", label="formula")
    _log_log_axes(ax, dp_degrees, narrow=max(known) < 20 * min(known))
    ax.set_ylabel(f"{unit} per rank")
    _title(ax, title)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def _check_per_degree(dp_degrees: Sequence[int], **named: Mapping[str, Sequence]) -> None:
    """A ValueError unless every series of every mapping in ``named`` has one value per N."""
    if not dp_degrees:
        raise ValueError("dp_degrees must list at least one data-parallel degree, got none")
    for what, series in named.items():
        for stage, values in series.items():
            if len(values) != len(dp_degrees):
                raise ValueError(
                    f"{what}[{stage!r}] has {len(values)} values; expected one per "
                    f"dp degree ({len(dp_degrees)})"
                )


def _log_log_axes(ax: Any, dp_degrees: Sequence[int], narrow: bool) -> None:
    """N on a base-2 axis ticked at the measured degrees; bytes on a log axis numbered plainly
    (0.1, 1, 10, not 10⁻¹), its 2…9 ticks too when the range is ``narrow`` (within about a
    decade the decades alone leave the axis bare)."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(list(dp_degrees), [f"{n:,}" for n in dp_degrees])
    ax.xaxis.set_minor_locator(NullLocator())
    plain = FuncFormatter(lambda v, _: f"{v:,.10g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain if narrow else NullFormatter())
    ax.set_xlabel("data-parallel ranks N")
    ax.grid(True, which="major", alpha=0.3)


def stacked_bars(
    data: Mapping[str, Mapping[str, float]],
    path: PathLike | None = None,
    title: str = "",
    ylabel: str = "bytes sent per rank per step",
    colors: Mapping[str, str] | None = None,
    in_bytes: bool = False,
    notes: Mapping[str, str] | None = None,
    markers: Mapping[str, float] | None = None,
    marker_label: str = "",
) -> Figure:
    """One bar per key of ``data`` (a stage), stacked by the keys of its value (phases).

    ``in_bytes``: the values are bytes, drawn in the unit that fits them (the unit goes before
    ``ylabel``). ``notes``: text over a bar (its ratio to a baseline, say). ``markers``: one value
    per bar drawn as a black diamond (a published figure beside the bar), named ``marker_label``.
    Bar labels may hold a line break; the figure widens with the number of bars."""
    if not data:
        raise ValueError("data must have at least one bar, got an empty mapping")
    colors = PHASE_COLORS if colors is None else colors
    parts: list[str] = []
    for row in data.values():
        parts += [p for p in row if p not in parts]
    labels = list(data)
    totals = np.array([sum(float(v) for v in data[k].values()) for k in labels])
    unit, scale = byte_unit(float(totals.max(initial=0.0))) if in_bytes else ("", 1.0)
    longest = max(len(line) for label in labels for line in str(label).split("\n"))
    per_bar = max(0.6, 0.09 * longest + 0.2)  # inches: room for the longest line of a label
    fig = _figure(max(5.5, 2.6 + per_bar * len(labels)), 3.8)
    ax = fig.add_subplot()
    x = np.arange(len(labels))
    bottom = np.zeros(len(labels))
    for part in parts:
        heights = np.array([float(data[k].get(part, 0)) for k in labels]) / scale
        ax.bar(x, heights, bottom=bottom, label=part, color=colors.get(part))
        bottom += heights
    for i, label in enumerate(labels):
        if notes and label in notes:
            ax.annotate(notes[label], (i, bottom[i]), xytext=(0, 2), textcoords="offset points",
                        ha="center", va="bottom", fontsize="small")  # fmt: skip
    if markers:
        keys = [k for k in labels if k in markers]
        ax.scatter([labels.index(k) for k in keys], [markers[k] / scale for k in keys],
                   marker="D", color="black", zorder=3, label=marker_label or None)  # fmt: skip
    ax.set_xticks(x, labels)
    top = max([*bottom, *([v / scale for v in markers.values()] if markers else [])], default=1.0)
    ax.set_ylim(0, 1.12 * top if top > 0 else 1.0)
    ax.set_ylabel(f"{unit} {ylabel}" if unit else ylabel)
    _title(ax, title)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, path)


def volume_by_phase(
    bytes_by_stage: Mapping[str, Mapping[str, float]],
    path: PathLike | None = None,
    title: str = "bytes each rank sends per optimizer step",
    notes: Mapping[str, str] | None = None,
) -> Figure:
    """Stacked bars of bytes per phase (forward, backward, step, clip) for each stage."""
    return stacked_bars(
        bytes_by_stage, path, title, "sent per rank per step", in_bytes=True, notes=notes
    )


def lines(
    series: Mapping[str, Sequence[float]],
    path: PathLike | None = None,
    title: str = "",
    xlabel: str = "optimizer step",
    ylabel: str = "",
    log_y: bool = False,
    styles: Mapping[str, Mapping[str, Any]] | None = None,
    marks: Mapping[float, str] | None = None,
    reference: str | None = None,
) -> Figure:
    """One line per key of ``series`` against 1, 2, … (a loss or a loss scale over steps).

    ``styles``: matplotlib keywords per series (say markers alone for what was measured, a dashed
    line for a formula). ``marks``: {step: label}, a shaded band at each step (an event: an
    injected overflow), one legend entry per label. ``reference``: a series the others are also
    drawn against, below, as their difference from it (lines that would lie on top of each
    other come apart)."""
    if not series:
        raise ValueError("series must have at least one line, got an empty mapping")
    if reference is not None and reference not in series:
        raise ValueError(f"reference must be one of {list(series)}, got {reference!r}")
    styles = styles or {}
    fig = _figure(7.0, 3.4 if reference is None else 5.0)
    if reference is None:
        ax, diff = fig.add_subplot(), None
    else:
        ax, diff = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    for i, (label, values) in enumerate(series.items()):
        style = {"marker": MARKERS[i % len(MARKERS)], "markersize": 4, **styles.get(label, {})}
        steps = range(1, len(values) + 1)
        (line,) = ax.plot(steps, values, label=label, **style)
        if diff is not None and label != reference:
            gap = np.asarray(values, dtype=float) - np.asarray(series[reference], dtype=float)
            diff.plot(steps, gap, color=line.get_color(), label=f"{label} − {reference}", **style)
    for axis in (ax, diff):
        if axis is None:
            continue
        seen: set[str] = set()
        for step, label in (marks or {}).items():
            axis.axvspan(step - 0.4, step + 0.4, color="#c44e52", alpha=0.25, linewidth=0,
                         label=None if label in seen or axis is diff else label)  # fmt: skip
            seen.add(label)
        axis.grid(True, alpha=0.3)
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if log_y:
        ax.set_yscale("log", base=2)
    (diff if diff is not None else ax).set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if diff is not None:
        diff.axhline(0.0, color=ax.get_lines()[list(series).index(reference)].get_color(),
                     linewidth=1.0)  # fmt: skip
        diff.set_ylabel(f"difference from {reference}")
    _title(ax, title)
    return _save(fig, path)


def _field(record: Any, name: str) -> Any:
    return record[name] if isinstance(record, Mapping) else getattr(record, name)


def collective_timeline(
    records_by_rank: Sequence[Sequence[Any]],
    path: PathLike | None = None,
    title: str = "collectives per rank",
) -> Figure:
    """One row per rank, one box per collective from ``start`` for ``wall_time`` seconds.

    Times are drawn from the earliest ``start`` (each rank's ledger clock starts when its
    communicator is made: in a LocalWorld at the same moment, under mpirun only roughly).

    Records are ledger ``Record`` objects or their dicts (``ledger.to_json()``); calls not yet
    waited on (``wall_time`` None) are drawn as thin ticks. Colour is the op.
    """
    if not records_by_rank:
        raise ValueError("records_by_rank must have one list of records per rank, got none")
    fig = _figure(7.0, 1.0 + 0.45 * len(records_by_rank))
    ax = fig.add_subplot()
    seen: set[str] = set()
    starts = [_field(rec, "start") for records in records_by_rank for rec in records]
    origin = min(starts, default=0.0)
    for rank, records in enumerate(records_by_rank):
        for rec in records:
            op = _field(rec, "op")
            start = (_field(rec, "start") - origin) * 1e3
            width = (_field(rec, "wall_time") or 0.0) * 1e3
            label = op if op not in seen else None
            seen.add(op)
            ax.barh(
                rank,
                max(width, 1e-3),
                left=start,
                height=0.6,
                color=OP_COLORS.get(op, "grey"),
                edgecolor="black",
                linewidth=0.3,
                label=label,
            )
    ax.set_yticks(range(len(records_by_rank)))
    ax.set_yticklabels([f"rank {r}" for r in range(len(records_by_rank))])
    ax.invert_yaxis()
    ax.set_xlabel("ms after the first collective drawn")
    _title(ax, title)
    if seen:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


# stage 3's collectives by (phase, op): what each one moves
GATHER_COLORS = {
    ("forward", "all_gather"): "#55a868",
    ("backward", "all_gather"): "#8fd19e",
    ("backward", "reduce_scatter"): "#dd8452",
    ("step", "all_gather"): "#8172b3",
    ("clip", "all_reduce"): "#c44e52",
}
PASS_COLORS = {"forward": "#a1c9f4", "backward": "#ffb482"}


def lanes(intervals: Sequence[tuple[float, float]]) -> list[int]:
    """Lane 1, 2, … for each [start, stop): the first lane free at its start (greedy, by start)."""
    ends: list[float] = []
    out = [0] * len(intervals)
    for i in sorted(range(len(intervals)), key=lambda i: intervals[i][0]):
        start, stop = intervals[i]
        free = next((k for k, end in enumerate(ends) if end <= start), len(ends))
        ends[free:free + 1] = [stop]  # fmt: skip
        out[i] = free + 1
    return out


def gather_release_timeline(
    records_by_rank: Sequence[Sequence[Any]],
    events_by_rank: Sequence[Sequence[Mapping[str, Any]]],
    path: PathLike | None = None,
    title: str = "stage 3: gather and release",
) -> Figure:
    """Per rank, the collectives (upper half, coloured by phase and op) and the modules' spans.

    A collective's box runs from its call to the end of its wait, so prefetched all-gathers
    overlap: they are stacked in as many thin lanes as are in flight at once (``lanes``).
    ``events_by_rank`` holds, per rank, dicts with ``module``, ``pass`` (forward or backward),
    ``start`` and ``stop`` on the ledger's clock (``compare.run_stage(keep_records=True)`` makes
    them): a module's parameters are gathered by ``start`` and released at ``stop``, drawn as a
    box in the lower half ending in a black tick.
    """
    if len(records_by_rank) != len(events_by_rank) or not records_by_rank:
        raise ValueError(
            f"records_by_rank and events_by_rank need one list per rank each, got "
            f"{len(records_by_rank)} and {len(events_by_rank)}"
        )
    fig = _figure(8.0, 1.2 + 0.8 * len(records_by_rank))
    ax = fig.add_subplot()
    times = [_field(r, "start") for rs in records_by_rank for r in rs]
    origin = min(times + [e["start"] for es in events_by_rank for e in es], default=0.0)
    seen: set[str] = set()

    def box(y: float, left: float, width: float, height: float, color: str, label: str) -> None:
        ax.barh(y, max(width, 1e-3), left=left, height=height, color=color, edgecolor="black",
                linewidth=0.3, label=None if label in seen else label)  # fmt: skip
        seen.add(label)

    for rank, (records, events) in enumerate(zip(records_by_rank, events_by_rank, strict=True)):
        spans = [
            ((_field(r, "start") - origin) * 1e3, (_field(r, "wall_time") or 0.0) * 1e3, r)
            for r in records
        ]
        lane_of = lanes([(start, start + width) for start, width, _ in spans])
        height = 0.4 / max(lane_of, default=0) if lane_of else 0.4
        for (start, width, rec), lane in zip(spans, lane_of, strict=True):
            key = (_field(rec, "phase"), _field(rec, "op"))
            y = rank - 0.42 + (lane - 0.5) * height
            box(y, start, width, height, GATHER_COLORS.get(key, "grey"), " ".join(key))
        for e in events:
            start, stop = (e["start"] - origin) * 1e3, (e["stop"] - origin) * 1e3
            label = f"{e['pass']} compute"
            box(rank + 0.2, start, stop - start, 0.35, PASS_COLORS[e["pass"]], label)
            ax.vlines(stop, rank + 0.02, rank + 0.38, color="black", linewidth=1.0)
    ax.set_yticks(range(len(records_by_rank)))
    ax.set_yticklabels([f"rank {r}" for r in range(len(records_by_rank))])
    ax.invert_yaxis()
    ax.set_xlabel("ms after the first event drawn (black tick: parameters released)")
    _title(ax, title)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def flat_buffer(layout: Any, path: PathLike | None = None, title: str = "") -> Figure:
    """The flat buffer of a ``zerosim.zero.Layout``: parameter slots (named in the legend),
    padding (hatched), each rank's shard (grey: rank colours are not parameter colours)."""
    fig = _figure(7.5, 1.3 + 0.35 * layout.world_size)
    ax = fig.add_subplot()
    cmap = colormaps["tab10"]
    for i, slot in enumerate(layout.slots):
        ax.barh(0, slot.range.size, left=slot.range.start, color=cmap(i % 10), edgecolor="black",
                linewidth=0.5, label=slot.name)  # fmt: skip
    for n, (start, stop) in enumerate(padding_ranges(layout)):
        ax.barh(0, stop - start, left=start, color="white", hatch="///", edgecolor="grey",
                label=None if n else "padding")  # fmt: skip
    for rank in range(layout.world_size):
        for rng in layout.owned_ranges(rank):
            ax.barh(1 + rank, rng.size, left=rng.start, color="0.45", edgecolor="black",
                    linewidth=0.5)  # fmt: skip
            if rng.size >= 0.05 * layout.padded_numel:
                ax.text(rng.start + rng.size / 2, 1 + rank, f"{rng.size}", ha="center",
                        va="center", color="white", fontsize="x-small")  # fmt: skip
    ax.set_yticks(range(1 + layout.world_size))
    ax.set_yticklabels(["parameters"] + [f"rank {r} owns" for r in range(layout.world_size)])
    ax.invert_yaxis()
    ax.set_xlim(0, layout.padded_numel)
    ax.set_xlabel(f"flat-buffer element (Ψ = {layout.numel}, Ψ_pad = {layout.padded_numel})")
    _title(ax, title or f"{layout.kind} layout on {layout.world_size} ranks")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def padding_ranges(layout: Any) -> list[tuple[int, int]]:
    """The [start, stop) runs of a layout's flat buffer that no parameter occupies."""
    gaps, edge = [], 0
    for rng in sorted(slot.range for slot in layout.slots):
        if rng.start > edge:
            gaps.append((edge, rng.start))
        edge = max(edge, rng.stop)
    if layout.padded_numel > edge:
        gaps.append((edge, layout.padded_numel))
    return gaps


def rank_holdings(
    arrays_by_rank: Sequence[Any],
    path: PathLike | None = None,
    title: str = "",
    value_label: str = "value",
    xlabel: str = "flat-buffer element",
) -> Figure:
    """A rank × element picture of what each rank holds (NaN = not held, drawn blank); the
    colour bar says what the colours are (``value_label``)."""
    rows = [np.asarray(a, dtype=float).reshape(-1) for a in arrays_by_rank]
    if not rows or len({r.size for r in rows}) != 1:
        raise ValueError("arrays_by_rank must be one array per rank, all of the same size")
    fig = _figure(7.5, 1.0 + 0.35 * len(rows))
    ax = fig.add_subplot()
    image = ax.imshow(np.vstack(rows), aspect="auto", interpolation="nearest", cmap="viridis")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r}" for r in range(len(rows))])
    ax.set_xlabel(xlabel)
    _title(ax, title)
    fig.colorbar(image, ax=ax, fraction=0.03, label=value_label)
    return _save(fig, path)
