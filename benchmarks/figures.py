"""PNG plots of the benchmarks' JSON rows (``--json PATH`` of each ``benchmarks/<module>.py``).

    python benchmarks/figures.py JSON_DIR OUT_DIR   # OUT_DIR/bench_<module>.png for each
                                                    # JSON_DIR/<module>.json that exists

One function per benchmark turns its rows into one figure:

* collectives: bus bandwidth against message size, raw mpi4py against zerosim, per N and
  operation; busbw = bytes / time · f with f = (N−1)/N for all_gather and reduce_scatter and
  2(N−1)/N for all_reduce (the bytes each rank's link carries, nccl-tests' convention);
* optimizer_step: effective GB/s of each optimizer and implementation, against numpy's copy;
* model_step: GFLOP/s of the GPT step in zerosim and torch against numpy's matmul;
* training_step: zerosim's step time over its torch counterpart's and over DeepSpeed's, per
  stage and N;
* scaling: model-state bytes per rank against N (log-log, with the 1/N line), and step time
  against Ψ with the least-squares line t = a·Ψ + c, one panel per stage;
* allocations: the peak bytes allocated in one steady-state step over Ψ·b, per stage and dtype,
  against the largest parameter's bytes (a layer's worth) and the whole model's;
* large_gpt: per rank, 16Ψ/N plus the buffers against the measured peak RSS growth and the
  whole model's fp32 size;
* dryrun: the dry run's wall time per world size against its target, and the time model's
  predicted TFLOP/s per GPU against every published figure it predicts (fitted rows filled);
* long_run: the median step time of each block of steps along a long run, for each way of
  asking the ledger for a step's bytes (running totals, a bounded ledger, a scan).

Figures are drawn on a matplotlib ``Figure`` with the Agg canvas (no pyplot, no display), as in
``zerosim.report.plots``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

Rows = Sequence[dict]
COLLECTIVE_OPS = ("all_gather", "reduce_scatter", "all_reduce")
PLAIN = FuncFormatter(lambda value, _: f"{value:g}")


def _figure(width: float, height: float, panels: int = 1) -> tuple[Figure, list]:
    fig = Figure(figsize=(width, height), dpi=90, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, panels, squeeze=False)[0]
    return fig, list(axes)


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def _colors(count: int) -> list:
    cmap = colormaps["tab10"]
    return [cmap(i % 10) for i in range(count)]


def busbw_factor(op: str, n: int) -> float:
    """Bus-bandwidth factor: (N−1)/N for all_gather / reduce_scatter, 2(N−1)/N for all_reduce."""
    if op not in COLLECTIVE_OPS:
        raise ValueError(f"op must be one of {COLLECTIVE_OPS}, got {op!r}")
    return (2 if op == "all_reduce" else 1) * (n - 1) / n


def collectives(rows: Rows, path: str | Path) -> Path:
    """busbw (GB/s) against message size, one panel per operation: raw dashed, zerosim solid."""
    ops = [op for op in COLLECTIVE_OPS if any(r["op"] == op for r in rows)]
    ranks = sorted({r["n"] for r in rows})
    fig, axes = _figure(4.2 * len(ops), 3.6, len(ops))
    for ax, op in zip(axes, ops, strict=True):
        for n, color in zip(ranks, _colors(len(ranks)), strict=True):
            mine = sorted(
                (r for r in rows if r["op"] == op and r["n"] == n), key=lambda r: r["bytes"]
            )
            if not mine:
                continue
            size = np.array([r["bytes"] for r in mine], float)
            for key, style in (("raw", "--"), ("zerosim", "-")):
                bw = size / np.array([r[key] for r in mine]) * busbw_factor(op, n) / 1e9
                ax.plot(size / 2**20, bw, style, color=color, marker=".", label=f"N={n} {key}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (MiB)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(op)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("collectives: zerosim against raw mpi4py")
    return _save(fig, path)


def _grouped_bars(ax: Axes, series: dict[str, list[float]]) -> None:
    """One bar per series side by side at each x position 0, 1, …; the series' names label them."""
    width = 0.8 / max(1, len(series))
    for i, ((label, values), color) in enumerate(
        zip(series.items(), _colors(len(series)), strict=True)
    ):
        x = np.arange(len(values)) + (i - (len(series) - 1) / 2) * width
        ax.bar(x, values, width, color=color, label=label)


def optimizer_step(rows: Rows, path: str | Path) -> Path:
    """Effective GB/s bars per optimizer and implementation; numpy's copy bandwidth as a line."""
    names = list(dict.fromkeys(r["optimizer"] for r in rows))
    impls = list(dict.fromkeys(r["implementation"] for r in rows))
    fig, (ax,) = _figure(6.5, 3.8)
    gbps = {
        impl: [
            next(
                (r["gbps"] for r in rows if r["optimizer"] == o and r["implementation"] == impl),
                0.0,
            )
            for o in names
        ]
        for impl in impls
    }
    _grouped_bars(ax, gbps)
    copy = max(r["copy_gbps"] for r in rows)
    ax.axhline(copy, color="black", linestyle=":", label=f"numpy copy {copy:.1f} GB/s")
    ax.set_xticks(np.arange(len(names)), names)
    ax.set_ylabel("effective bandwidth (GB/s)")
    ax.set_title(f"optimizer step on a float32 shard of {rows[0]['numel']:,} elements")
    ax.legend(fontsize=8)
    return _save(fig, path)


def model_step(rows: Rows, path: str | Path) -> Path:
    """GFLOP/s bars: numpy's matmul, zerosim's and torch's GPT forward+backward."""
    fig, (ax,) = _figure(5.0, 3.6)
    names = [r["name"] for r in rows]
    ax.bar(names, [r["gflops"] for r in rows], color=_colors(len(rows)))
    for i, r in enumerate(rows):
        ax.annotate(
            f"{r['vs_matmul']:.2f}× matmul", (i, r["gflops"]), ha="center", va="bottom", fontsize=8
        )
    ax.set_ylabel("GFLOP/s")
    ax.set_title("GPT forward+backward against numpy's matmul")
    return _save(fig, path)


def training_step(rows: Rows, path: str | Path) -> Path:
    """zerosim's step time over each peer's, per stage, one bar per (N, model); 1 = as fast.
    Left: against the torch counterpart; right (when DeepSpeed ran): against DeepSpeed."""
    peers = [("ratio", "its torch counterpart"), ("ratio_deepspeed", "DeepSpeed")]
    peers = [(key, name) for key, name in peers if any(r.get(key) is not None for r in rows)]
    stages = sorted({r["stage"] for r in rows})
    groups = sorted({(r["n"], r["model"]) for r in rows})
    fig, axes = _figure(5.5 * max(1, len(peers)), 3.8, max(1, len(peers)))
    for ax, (key, name) in zip(axes, peers, strict=False):
        ratios = {
            f"N={n} {model}": [
                next(
                    (
                        r[key]
                        for r in rows
                        if (r["n"], r["model"], r["stage"]) == (n, model, s)
                        and r.get(key) is not None
                    ),
                    np.nan,
                )
                for s in stages
            ]
            for n, model in groups
        }
        _grouped_bars(ax, ratios)
        ax.axhline(1.0, color="black", linestyle=":")
        ax.set_xticks(np.arange(len(stages)), [f"stage {s}" for s in stages])
        ax.set_ylabel(f"zerosim ms / {name.split()[-1]} ms")
        ax.set_title(f"training step: zerosim against {name}")
        ax.legend(fontsize=8)
    return _save(fig, path)


def scaling(rows: Rows, path: str | Path) -> Path:
    """Left: bytes per rank against N (log-log) per stage and model, with the 1/N line from N=1.
    Then one panel per stage: step time against Ψ for each N, with the fit t = a·Ψ + c."""
    stages = sorted({r["stage"] for r in rows})
    ranks = sorted({r["n"] for r in rows})
    widths = sorted({r["width"] for r in rows})
    fig, axes = _figure(3.8 * (1 + len(stages)), 3.8, 1 + len(stages))
    markers = "os^Dv"
    ax = axes[0]
    for stage, color in zip(stages, _colors(len(stages)), strict=True):
        for k, w in enumerate(widths):
            mine = sorted(
                (r for r in rows if r["stage"] == stage and r["width"] == w), key=lambda r: r["n"]
            )
            n = np.array([r["n"] for r in mine], float)
            mem = np.array([max(r["model_state_bytes"]) for r in mine], float)
            label = f"stage {stage}" if k == len(widths) - 1 else None
            ax.plot(n, mem, "-", color=color, marker=markers[k % len(markers)], label=label)
            if stage == stages[0] and n.size and n[0] == 1:
                ax.plot(
                    n, mem[0] / n, ":", color="black", zorder=3, label="1/N" if k == 0 else None
                )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ranks, [str(n) for n in ranks])
    ax.set_xlabel("ranks N")
    ax.set_ylabel("model-state bytes per rank")
    ax.set_title("memory per rank (markers: Ψ sizes)")
    ax.legend(fontsize=8)
    for ax, stage in zip(axes[1:], stages, strict=True):
        for n, color in zip(ranks, _colors(len(ranks)), strict=True):
            mine = sorted(
                (r for r in rows if r["stage"] == stage and r["n"] == n), key=lambda r: r["params"]
            )
            psi = np.array([r["params"] for r in mine], float)
            ms = np.array([r["ms"] for r in mine])
            ax.plot(psi, ms, "o", color=color, label=f"N={n}")
            if psi.size >= 2:
                slope, intercept = np.polyfit(psi, ms, 1)
                grid = np.geomspace(psi.min(), psi.max(), 50)
                line = slope * grid + intercept  # a negative intercept: drawn where positive
                ax.plot(grid[line > 0], line[line > 0], "-", color=color, alpha=0.7)
        ax.set_xscale("log")
        ax.set_yscale("log")
        measured = [r["ms"] for r in rows if r["stage"] == stage]
        ax.set_ylim(min(measured) / 1.5, max(measured) * 1.5)
        ax.yaxis.set_major_formatter(PLAIN)  # plain numbers (1, 10, 100 ms), not powers of ten
        ax.set_xlabel("parameters Ψ")
        ax.set_ylabel("step time per rank (ms)")
        ax.set_title(f"stage {stage}: t = a·Ψ + c")
        ax.legend(fontsize=8)
    return _save(fig, path)


def allocations(rows: Rows, path: str | Path) -> Path:
    """Peak bytes allocated in a steady-state step ÷ Ψ·b, bars per stage and dtype, with the
    largest parameter's share of Ψ·b as the layer-sized line."""
    stages = sorted({r["stage"] for r in rows})
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    fig, (ax,) = _figure(6.5, 3.8)
    share = {(r["stage"], r["dtype"]): r["peak_max"] / r["psi_bytes"] for r in rows}
    peaks = {dtype: [share.get((s, dtype), np.nan) for s in stages] for dtype in dtypes}
    _grouped_bars(ax, peaks)
    layer = rows[0]["largest_bytes"] / rows[0]["psi_bytes"]
    ax.axhline(layer, color="black", linestyle=":", label=f"largest parameter ({layer:.2f} Ψ·b)")
    ax.axhline(1.0, color="grey", linestyle="--", label="the whole model (Ψ·b)")
    ax.set_xticks(np.arange(len(stages)), [f"stage {s}" for s in stages])
    ax.set_ylabel("peak allocated in a step ÷ Ψ·b")
    ax.set_title(f"allocations per step, per rank (N = {rows[0]['n']})")
    ax.legend(fontsize=8)
    return _save(fig, path)


def zero_init_cap(rows: Rows, path: str | Path) -> Path:
    """Per rank: the measured training peak, the 16Ψ/N formula plus buffers, the allowance
    the kernel enforced and the whole model's fp32 size, in MiB."""
    fig, (ax,) = _figure(6.5, 3.8)
    mib = 2.0**20
    series = {
        "measured peak": [r["peak"] / mib for r in rows],
        "16Ψ/N + buffers": [(r["formula"] + r["buffers"]) / mib for r in rows],
    }
    _grouped_bars(ax, series)
    ax.axhline(rows[0]["allowance"] / mib, color="red", linestyle="--", label="allowance (cap)")
    ax.axhline(rows[0]["full_model"] / mib, color="black", linestyle=":", label="fp32 model")
    ax.set_xticks(np.arange(len(rows)), [f"rank {r['rank']}" for r in rows])
    ax.set_ylabel("MiB")
    ax.set_title("stage 3 inside zero.Init under an OS memory cap, per rank")
    ax.legend(fontsize=8)
    return _save(fig, path)


def large_gpt(rows: Rows, path: str | Path) -> Path:
    """Per rank of the large GPT's run: the model states (16Ψ/N), the buffers beside them and
    the measured peak RSS growth, in MiB, against the whole model's fp32 size."""
    (row,) = rows
    fig, (ax,) = _figure(6.5, 3.8)
    mib = 2.0**20
    ranks = np.arange(len(row["rss_growth"]))
    ax.bar(ranks - 0.2, row["formula"] / mib, 0.4, color=_colors(3)[0], label="16Ψ/N")
    ax.bar(
        ranks - 0.2,
        np.array(row["buffers"]) / mib,
        0.4,
        bottom=row["formula"] / mib,
        color=_colors(3)[1],
        label="+ buffers (bucket pool, gathered)",
    )
    ax.bar(
        ranks + 0.2,
        np.array(row["rss_growth"]) / mib,
        0.4,
        color=_colors(3)[2],
        label="measured peak RSS growth",
    )
    ax.axhline(row["full_model"] / mib, color="black", linestyle=":", label="whole model, fp32")
    ax.set_xticks(ranks, [f"rank {r}" for r in ranks])
    top = max(max(row["rss_growth"]), row["formula"] + max(row["buffers"]), row["full_model"])
    ax.set_ylim(0, 1.45 * top / mib)  # room for the legend above the bars
    ax.set_ylabel("MiB")
    ax.set_title(
        f"GPT of {row['params'] / 1e6:.0f}M at stage 3, N = {row['n']}: "
        f"{row['step_s']:.1f} s/step, {row['tokens_per_s']:.0f} tokens/s"
    )
    ax.legend(fontsize=8, loc="upper center", ncol=2)
    return _save(fig, path)


def dryrun(rows: Rows, path: str | Path) -> Path:
    """Left: each world size's wall time against its target. Right: predicted against published
    model TFLOP/s per GPU for every published run with a prediction whose step fits the device,
    on the y = x line with ±10%, the fitted rows filled."""
    targets = [r for r in rows if r["kind"] == "target"]
    predicted = [
        r
        for r in rows
        if r["kind"] == "prediction" and r["predicted_tflops"] and r.get("fits_device", True)
    ]  # a row whose peak exceeds the device would not start: not drawn as a throughput
    fig, (left, right) = _figure(11, 4.2, 2)
    x = np.arange(len(targets))
    left.bar(x, [r["wall_s"] for r in targets], 0.5, color=_colors(1)[0], label="wall time")
    for i, r in enumerate(targets):
        if r.get("wall_target_s"):
            left.hlines(r["wall_target_s"], i - 0.35, i + 0.35, color="red", linestyle="--")
    left.set_xticks(x, [f"{r['n']:,} ranks" for r in targets])
    left.set_ylabel("seconds on this machine")
    left.set_title(f"{targets[0]['model'] if targets else ''} dry run (red: target)")
    kinds = ("Narayanan et al., Selene", "Wang et al.: ZeRO-3", "Wang et al.: ZeRO++")
    colors = dict(zip(kinds, _colors(3), strict=True))
    for r in predicted:
        kind = kinds[0] if r["source"].startswith("Narayanan") else f"Wang et al.: {r['scheme']}"
        right.scatter(
            r["published_tflops"],
            r["predicted_tflops"],
            color=colors[kind],
            facecolors=colors[kind] if r["fitted"] else "none",
            label=kind,
        )
    top = 1.1 * max([r["published_tflops"] for r in predicted] + [1.0])
    line = np.array([0.0, top])
    right.plot(line, line, color="black", linewidth=0.8)
    right.fill_between(line, 0.9 * line, 1.1 * line, color="grey", alpha=0.2, label="±10%")
    handles, labels = right.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    right.legend(unique.values(), unique.keys(), fontsize=8)
    right.set_xlim(0, top)
    right.set_ylim(0, top)
    right.set_xlabel("published TFLOP/s per GPU")
    right.set_ylabel("predicted")
    right.set_title("published runs (filled: fitted)")
    return _save(fig, path)


def long_run(rows: Rows, path: str | Path) -> Path:
    """Median step time of each block of ``window`` steps along the run, one line per way of
    asking for a step's bytes; the legend gives each one's last / first ratio, paired against
    the bounded ledger."""
    names = {"totals": "running totals", "bounded": "≤ 2,000 records", "scan": "scan (before)"}
    fig, (ax,) = _figure(7, 3.8)
    for r, color in zip(rows, _colors(len(rows)), strict=True):
        w, times = r["window"], r["step_ms"]
        blocks = [float(np.median(times[i : i + w])) for i in range(0, len(times) - w + 1, w)]
        x = [(i + 0.5) * w for i in range(len(blocks))]
        label = f"{names.get(r['way'], r['way'])}: ×{r['paired_ratio']:.2f} paired"
        ax.plot(x, blocks, marker=".", color=color, label=label)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("step")
    ax.set_ylabel(f"median ms per step ({rows[0]['window']} steps)")
    ax.set_title(f"zerosim train's loop, N = {rows[0]['n']}: a step's cost along the run")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def dryrun_host(rows: Rows, path: str | Path) -> Path:
    """Predicted against measured step seconds on this machine, every row of the grid (log
    axes) on the y = x line with ±15%: judged rows filled, in target or not by colour; rows not
    judged (N = 4, a group whose machine drifted) hollow."""
    grid = [r for r in rows if r.get("kind") == "row" and r["measured_s"] is not None]
    fig, (ax,) = _figure(6, 5, 1)
    ok, miss = _colors(2)
    for r in grid:
        color = miss if r["within"] is False else ok
        ax.scatter(
            r["measured_s"],
            r["predicted_s"],
            color=color,
            facecolors=color if r["within"] is not None else "none",
            s=18,
        )
    times = [v for r in grid for v in (r["measured_s"], r["predicted_s"])] or [1e-3, 1.0]
    line = np.geomspace(min(times) / 1.5, max(times) * 1.5, 50)
    ax.plot(line, line, color="black", linewidth=0.8)
    ax.fill_between(line, 0.85 * line, 1.15 * line, color="grey", alpha=0.2, label="±15%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step s (zerosim train under mpirun)")
    ax.set_ylabel("predicted step s (zerosim dryrun --cluster host.json)")
    ax.set_title(
        "this machine: filled judged (N = 1, 2), hollow not judged\n(N = 4, or the machine "
        "drifted); the second colour: outside target",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    return _save(fig, path)


PLOTS: dict[str, Callable[[Rows, str | Path], Path]] = {
    "collectives": collectives,
    "optimizer_step": optimizer_step,
    "model_step": model_step,
    "training_step": training_step,
    "scaling": scaling,
    "allocations": allocations,
    "zero_init_cap": zero_init_cap,
    "large_gpt": large_gpt,
    "dryrun": dryrun,
    "dryrun_host": dryrun_host,
    "long_run": long_run,
}


def figure_name(module: str) -> str:
    return f"bench_{module}.png"


def make_figure(module: str, json_path: str | Path, out_dir: str | Path) -> Path | None:
    """``out_dir/bench_<module>.png`` from the module's JSON rows; None when the JSON file is
    missing or holds no rows (that figure is skipped)."""
    if module not in PLOTS:
        raise ValueError(f"module must be one of {sorted(PLOTS)}, got {module!r}")
    json_path = Path(json_path)
    if not json_path.is_file():
        return None
    rows = json.loads(json_path.read_text())
    if not rows:
        return None
    return PLOTS[module](rows, Path(out_dir) / figure_name(module))


def make_all(json_dir: str | Path, out_dir: str | Path) -> dict[str, Path]:
    """Every figure whose ``json_dir/<module>.json`` exists: {module: PNG path}."""
    made = {}
    for module in PLOTS:
        path = make_figure(module, Path(json_dir) / f"{module}.json", out_dir)
        if path is not None:
            made[module] = path
    return made


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    for module, path in make_all(*args).items():
        print(f"{module}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
