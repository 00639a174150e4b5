"""Regenerate the documentation's figures (docs/figures/*.png) and docs/table1.md from the code.

    python docs/make_figures.py            # writes into docs/
    python docs/make_figures.py --docs DIR # writes DIR/figures/*.png and DIR/table1.md

Every figure is drawn by ``zerosim.report.plots`` from numbers that zerosim computes or measures:
the formulas of ``zerosim.analysis`` and runs of the engine on a ``LocalWorld``. The timeline is a
real measurement, so it differs a little from run to run; everything else is deterministic.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import zerosim as zs  # noqa: E402  (after the path set-up, so the script runs from a clone)
from zerosim.analysis.stages import STAGES  # noqa: E402
from zerosim.report import plots  # noqa: E402
from zerosim.report.compare import run_stage  # noqa: E402
from zerosim.report.tables import memory_data, table1_page  # noqa: E402
from zerosim.zero import deepspeed_layout, megatron_layout  # noqa: E402

FIGURES = (
    "flat_buffer.png",
    "flat_buffer_megatron.png",
    "collective_before.png",
    "collective_reduce_scatter.png",
    "collective_all_gather.png",
    "memory_vs_n.png",
    "volume_by_phase.png",
    "timeline.png",
    "timeline_stage3.png",
)


def _collectives(comm: zs.comm.Communicator) -> list[np.ndarray]:
    """Each rank's buffer before, after a reduce-scatter (own shard), after an all-gather."""
    n, piece = comm.size, 3
    full = np.arange(n * piece, dtype=np.float64) + 10.0 * comm.rank
    shard = np.empty(piece)
    comm.reduce_scatter(shard, full)
    held = np.full(n * piece, np.nan)
    held[comm.rank * piece : (comm.rank + 1) * piece] = shard
    gathered = np.empty(n * piece)
    comm.all_gather(gathered, shard)
    return [full, held, gathered]


def make(docs: Path) -> list[Path]:
    """Write every figure and table1.md under ``docs``; return the paths written."""
    out = docs / "figures"
    out.mkdir(parents=True, exist_ok=True)
    shapes = [(name, p.shape) for name, p in zs.nn.MLP([8, 6, 3], seed=0).named_parameters()]
    plots.flat_buffer(deepspeed_layout(shapes, 4), out / FIGURES[0])
    plots.flat_buffer(megatron_layout(shapes, 4, 20), out / FIGURES[1])

    before, scattered, gathered = zip(*zs.LocalWorld(4).run(_collectives), strict=True)
    plots.rank_holdings(before, out / FIGURES[2], "before: every rank's own buffer")
    plots.rank_holdings(scattered, out / FIGURES[3], "after reduce-scatter: own shard of the sum")
    plots.rank_holdings(gathered, out / FIGURES[4], "after all-gather: every shard everywhere")

    dp = [1, 4, 16, 64, 256, 1024]
    data = memory_data(7.5e9, dp, list(STAGES))
    series = {f"stage {s}": [r["total"] for r in data["rows"] if r["stage"] == s] for s in STAGES}
    plots.memory_vs_dp(dp, series, out / FIGURES[5], "Ψ = 7.5e9, fp16 + Adam: memory per device")

    bars = {}  # the ZeRO paper's schedule, which docs/concepts.md describes beside them
    for name in STAGES:
        run = zs.LocalWorld(4).run(run_stage, name, "mlp", 2, "float32", 2, schedule="paper")
        measured = run[0]["bytes"]
        bars[name] = dict(zip(measured["phases"], measured["measured"][0], strict=True))
    plots.volume_by_phase(bars, out / FIGURES[6], "measured bytes per step, N = 4, k = 2 (rank 0)")

    records = zs.LocalWorld(4).run(
        run_stage, "2", "gpt", 2, keep_records=True, bucket=6000, schedule="paper"
    )
    title = "stage 2, one step of a GPT (Ψ = 17,568, buckets of 6,000), 4 ranks"
    plots.collective_timeline([r["records"] for r in records], out / FIGURES[7], title)

    runs = zs.LocalWorld(4).run(run_stage, "3", "gpt", 2, keep_records=True)
    title = "stage 3, one step of a GPT (prefetch on, no reuse), 4 ranks"
    records, events = [r["records"] for r in runs], [r["events"] for r in runs]
    plots.gather_release_timeline(records, events, out / FIGURES[8], title)
    (docs / "table1.md").write_text(table1_page())
    return [out / f for f in FIGURES] + [docs / "table1.md"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=Path, default=ROOT / "docs", help="docs folder to write")
    args = parser.parse_args(argv)
    for path in make(args.docs):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
