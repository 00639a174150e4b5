"""Pictures for the teaching material: each function takes data, draws one figure, writes a PNG.

Memory per rank against the number of ranks for each stage, bytes per phase for each stage, lines
over training steps (a loss, a loss scale), a
timeline of the collectives each rank ran (from the ledger's ``start`` and ``wall_time``) and, for
stage 3, the same with the span in which each module holds its gathered parameters, the flat
buffer with its padding and owners, and what each rank holds of a buffer. Figures are drawn
with matplotlib's Agg canvas on a ``Figure`` object (no pyplot, no global backend, no display), so
they work in scripts, tests and notebooks alike; notebooks show the PNG that was written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

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


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=80, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: PathLike | None) -> Figure:
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
    return fig


def memory_vs_dp(
    dp_degrees: Sequence[int],
    bytes_by_stage: Mapping[str, Sequence[float]],
    path: PathLike | None = None,
    title: str = "model-state memory per device",
) -> Figure:
    """One line per stage: bytes per rank (GB = 1e9 B) against N, both axes logarithmic."""
    if not dp_degrees:
        raise ValueError("dp_degrees must list at least one data-parallel degree, got none")
    for stage, values in bytes_by_stage.items():
        if len(values) != len(dp_degrees):
            raise ValueError(
                f"bytes_by_stage[{stage!r}] has {len(values)} values; expected one per "
                f"dp degree ({len(dp_degrees)})"
            )
    fig = _figure(5.5, 3.6)
    ax = fig.add_subplot()
    for stage, values in bytes_by_stage.items():
        ax.plot(dp_degrees, np.asarray(values, dtype=float) / 1e9, marker="o", label=stage)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("data-parallel ranks N")
    ax.set_ylabel("GB per device")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def stacked_bars(
    data: Mapping[str, Mapping[str, float]],
    path: PathLike | None = None,
    title: str = "",
    ylabel: str = "bytes sent per rank per step",
    colors: Mapping[str, str] | None = None,
) -> Figure:
    """One bar per key of ``data`` (a stage), stacked by the keys of its value (phases)."""
    if not data:
        raise ValueError("data must have at least one bar, got an empty mapping")
    colors = PHASE_COLORS if colors is None else colors
    parts: list[str] = []
    for row in data.values():
        parts += [p for p in row if p not in parts]
    fig = _figure(5.5, 3.6)
    ax = fig.add_subplot()
    labels = list(data)
    bottom = np.zeros(len(labels))
    for part in parts:
        heights = np.array([float(data[k].get(part, 0)) for k in labels])
        ax.bar(labels, heights, bottom=bottom, label=part, color=colors.get(part))
        bottom += heights
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="small")
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, path)


def volume_by_phase(
    bytes_by_stage: Mapping[str, Mapping[str, float]],
    path: PathLike | None = None,
    title: str = "bytes each rank sends per optimizer step",
) -> Figure:
    """Stacked bars of bytes per phase (forward, backward, step, clip) for each stage."""
    return stacked_bars(bytes_by_stage, path, title, "bytes sent per rank per step")


def lines(
    series: Mapping[str, Sequence[float]],
    path: PathLike | None = None,
    title: str = "",
    xlabel: str = "optimizer step",
    ylabel: str = "",
    log_y: bool = False,
) -> Figure:
    """One line per key of ``series`` against 1, 2, … (a loss or a loss scale over steps)."""
    if not series:
        raise ValueError("series must have at least one line, got an empty mapping")
    fig = _figure(5.5, 3.2)
    ax = fig.add_subplot()
    for label, values in series.items():
        ax.plot(range(1, len(values) + 1), values, marker=".", label=label)
    if log_y:
        ax.set_yscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
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
    ax.set_title(title)
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
    ax.set_title(title)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def flat_buffer(layout: Any, path: PathLike | None = None, title: str = "") -> Figure:
    """The flat buffer of a ``zerosim.zero.Layout``: parameter slots, padding, each rank's shard."""
    fig = _figure(7.0, 1.2 + 0.35 * layout.world_size)
    ax = fig.add_subplot()
    cmap = colormaps["tab20"]
    for i, slot in enumerate(layout.slots):
        ax.barh(0, slot.range.size, left=slot.range.start, color=cmap(i % 20), edgecolor="black")
        if slot.range.size > 0.06 * layout.padded_numel:
            middle = slot.range.start + slot.range.size / 2
            ax.text(middle, 0, slot.name, ha="center", va="center", fontsize="x-small")
    for start, stop in padding_ranges(layout):
        ax.barh(0, stop - start, left=start, color="white", hatch="///", edgecolor="grey")
    for rank in range(layout.world_size):
        for rng in layout.owned_ranges(rank):
            ax.barh(1 + rank, rng.size, left=rng.start, color=cmap(2 * rank % 20), alpha=0.8)
    ax.set_yticks(range(1 + layout.world_size))
    ax.set_yticklabels(["parameters"] + [f"rank {r} owns" for r in range(layout.world_size)])
    ax.invert_yaxis()
    ax.set_xlim(0, layout.padded_numel)
    ax.set_xlabel(f"flat-buffer element (Ψ = {layout.numel}, Ψ_pad = {layout.padded_numel})")
    ax.set_title(title or f"{layout.kind} layout on {layout.world_size} ranks")
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
    arrays_by_rank: Sequence[Any], path: PathLike | None = None, title: str = ""
) -> Figure:
    """A rank × element picture of what each rank holds (NaN = not held, drawn blank)."""
    rows = [np.asarray(a, dtype=float).reshape(-1) for a in arrays_by_rank]
    if not rows or len({r.size for r in rows}) != 1:
        raise ValueError("arrays_by_rank must be one array per rank, all of the same size")
    fig = _figure(7.0, 0.8 + 0.35 * len(rows))
    ax = fig.add_subplot()
    image = ax.imshow(np.vstack(rows), aspect="auto", interpolation="nearest", cmap="viridis")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r}" for r in range(len(rows))])
    ax.set_xlabel("flat-buffer element")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, fraction=0.03)
    return _save(fig, path)
