"""Narayanan et al.'s and ZeRO++'s published rows, predicted after one fitted row per source.

    python -m benchmarks.dryrun_papers [--source narayanan2021|zeropp] [--write] [--json PATH]

The rows and their sources are ``examples/published/narayanan2021/`` and
``examples/published/zeropp/`` (each row's address, quoted line and FLOP convention there). The
clusters are ``selene`` and ``zeropp_v100``: physical rates, each cited in the file. The one
number no datasheet gives, ``software_factor`` (the fraction of the matrix products' roofline a
software stack reaches), is fitted per (cluster, software) on ONE row named in the source's CSV
(``fitted``) before any other row was predicted:

- (Selene, DeepSpeed ZeRO-3 in Megatron-LM): Table 2's 174.6B row on 384 GPUs, micro-batch 4
  (the smallest run, the one whose step is most nearly compute);
- (ZeRO++'s V100 cluster, DeepSpeed ZeRO-3 and ZeRO++): Figure 6's 18B ZeRO-3 bar at 2K tokens
  per GPU and 4 × 100 Gb/s per node (the baseline at the cluster's own network).

Every other row is a prediction, printed beside its published figure whatever it shows. The
configuration where a paper publishes none, chosen by a rule stated before predicting:
``stage3_max_live_parameters`` 1e10, at least the largest module (the 529.6B model's 4h² =
1.68e9), so prefetch is never switched off; bf16 for Narayanan's "mixed precision" (A100s run
fp16 and bf16 at one rate). ZeRO++: the tutorial's config (``published.zeropp_config``); of its
model sizes only the 18B has a published shape, so only its rows are predicted. Model TFLOP/s
per GPU by Narayanan et al.'s eq. 3, recomputation counted (``examples/published/*/README.md``).
Element-wise work and the optimizer step are priced too (``op_events``: the array operations
between two collective events, as the kernels CuPy launches: ``timeline.kernel_seconds``).
``--write`` stores each fitted factor in its cluster file with the row it was fitted on. About
15-30 minutes here: ten dry runs of 384 to 2,240 ranks.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zerosim.dryrun import load_cluster_model, recipe, run_world  # noqa: E402
from zerosim.dryrun.published import (  # noqa: E402
    NARAYANAN_TABLE2,
    PUBLISHED,
    ZEROPP_GPUS,
    ZEROPP_GPUS_PER_NODE,
    ZEROPP_PUBLISHED,
    fit_software_factor,
    zeropp_config,
    zeropp_shapes,
)
from zerosim.dryrun.report import step_time  # noqa: E402
from zerosim.dryrun.timeline import CLUSTERS, ClusterModel  # noqa: E402

SOURCES = {"narayanan2021": "selene", "zeropp": "zeropp_v100"}
SOFTWARE = {
    "narayanan2021": "DeepSpeed ZeRO-3 in Megatron-LM (Narayanan et al. 2021)",
    "zeropp": "DeepSpeed ZeRO-3 and ZeRO++ (Wang et al. 2023)",
}


def narayanan_config(micro: int, accumulation: int) -> dict:
    """The source's config (``examples/published/narayanan2021/ds_config.json``) for one row."""
    config = json.loads((PUBLISHED / "narayanan2021" / "ds_config.json").read_text())
    return {
        **config,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
    }


def narayanan_runs(row, backend: str = "cupy") -> list:
    """The dry run of one Table 2 row on ``backend``'s code path: its class representatives'
    runs."""
    config = narayanan_config(row.micro_batch, row.batch // (row.gpus * row.micro_batch))
    start = time.perf_counter()
    model = recipe(row.model)
    runs, _ = run_world(
        model, row.gpus, config, recompute=True, steps=2, op_events=True, backend=backend
    )
    print(f"  {row.model} on {row.gpus}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return runs


def narayanan_cases(backend: str = "cupy") -> list[dict]:
    """Table 2's rows as cases: the dry run of each and how to time it on a cluster."""
    cases = []
    for row in NARAYANAN_TABLE2:
        runs = narayanan_runs(row, backend)
        cases.append(
            {
                "row": f"{row.model} on {row.gpus} GPUs, micro-batch {row.micro_batch}",
                "published": row.tflops,
                "fitted": row.fitted,
                "time": lambda c, r=row, runs=runs: step_time(
                    runs, r.gpus, c, recipe(r.model), recompute=True
                )[0],
            }
        )
    return cases


def zeropp_cases(backend: str = "cupy") -> list[dict]:
    """The ZeRO++ bars whose model has a published shape (the 18B), one case per bar, run on
    ``backend``'s code path."""
    shapes, traces, cases = zeropp_shapes(), {}, []
    for figure, gbps, tokens, size, *published in ZEROPP_PUBLISHED:
        if size not in shapes:
            continue
        shape = shapes[size]
        model = recipe(shape, f"zeropp-{size.lower()}")
        for scheme, value in zip(("ZeRO-3", "ZeRO++"), published, strict=True):
            key = (tokens, scheme)
            if key not in traces:
                cfg = zeropp_config(tokens // shape.seq, scheme == "ZeRO++")
                traces[key], wall = run_world(
                    model, ZEROPP_GPUS, cfg, recompute=True, op_events=True, backend=backend
                )
                print(f"  {size} {scheme}, {tokens} tokens: {wall:.0f} s", file=sys.stderr)
            cases.append(
                {
                    "row": f"Fig. {figure}: {size} {scheme}, {tokens} tokens/GPU, {gbps} Gb/s/node",
                    "published": value,
                    "fitted": (figure, gbps, tokens, scheme) == ("6", 400, 2048, "ZeRO-3"),
                    "time": lambda c, runs=traces[key], m=model, g=gbps: step_time(
                        runs, ZEROPP_GPUS, at_network(c, g), m, recompute=True
                    )[0],
                }
            )
    return cases


def at_network(cluster: ClusterModel, gbps: float) -> ClusterModel:
    """The cluster with ``gbps`` Gb/s of NICs per node (Figures 7 and 8 change only this)."""
    per_device = gbps * 1e9 / 8 / ZEROPP_GPUS_PER_NODE
    return replace(cluster, cluster=replace(cluster.cluster, inter_bandwidth=per_device))


def run_source(source: str, backend: str | None = None) -> tuple[float, list[dict]]:
    """(the fitted factor, every row with its prediction) of one source, on ``backend``'s code
    path (None: the cluster file's)."""
    base = load_cluster_model(SOURCES[source]).with_software_factor(1.0)
    backend = backend or base.backend
    cases = narayanan_cases(backend) if source == "narayanan2021" else zeropp_cases(backend)
    (fitted,) = [c for c in cases if c["fitted"]]
    factor = fit_software_factor(
        lambda c: fitted["time"](c)["tflops_per_device"], fitted["published"], base
    )
    cluster = base.with_software_factor(factor)
    rows = []
    for case in cases:
        t = case["time"](cluster)
        rows.append(
            {
                "source": source,
                "row": case["row"],
                "fitted": case["fitted"],
                "published_tflops": case["published"],
                "predicted_tflops": t["tflops_per_device"],
                "step_s": t["step_s"],
                "comm_s": t["comm_s"],
                "exposed_comm_s": t["exposed_comm_s"],
                "fits_device": t["fits_device"],
                "peak_gib": t["peak_bytes"] / 2**30,
            }
        )
    for r in rows:
        r["published_step_s"] = published_step(r)
    return factor, rows


def published_step(row: dict) -> float:
    """The step a row's published figure implies: the same model FLOPs at the published rate."""
    return row["step_s"] * row["predicted_tflops"] / row["published_tflops"]


def print_table(source: str, factor: float, rows: list[dict]) -> None:
    fitted = next(r["row"] for r in rows if r["fitted"])
    print(f"\n{source}: software_factor {factor:.4f} for ({SOURCES[source]}, {SOFTWARE[source]}), "
          f"fitted on {fitted}")  # fmt: skip
    print(f"{'row':<62} {'kind':>9} {'step s':>8} {'comm s':>7} {'published step s':>16} "
          f"{'predicted':>9} {'published':>9} {'ratio':>6}")  # fmt: skip
    for r in rows:
        kind = "fitted" if r["fitted"] else "predicted"
        oom = "" if r["fits_device"] else f"  OOM: peak {r['peak_gib']:.1f} GiB, would not start"
        print(f"{r['row']:<62} {kind:>9} {r['step_s']:>8.2f} {r['comm_s']:>7.2f} "
              f"{published_step(r):>16.2f} {r['predicted_tflops']:>9.1f} "
              f"{r['published_tflops']:>9.0f} {r['predicted_tflops'] / r['published_tflops']:>6.2f}"
              f"{oom}")  # fmt: skip


def write_factor(source: str, factor: float, rows: list[dict]) -> None:
    """Store ``factor`` in the source's cluster file, with the row it was fitted on."""
    path = CLUSTERS / f"{SOURCES[source]}.json"
    spec = json.loads(path.read_text())
    fitted = next(r for r in rows if r["fitted"])
    spec["software_factor"] = {
        "value": round(factor, 4),
        "source": f"fitted by benchmarks/dryrun_papers.py for {SOFTWARE[source]} on ONE row, "
        f"examples/published/{source}: {fitted['row']}, published {fitted['published_tflops']} "
        "TFLOP/s per GPU; every other row of the source is a prediction",
    }
    spec.pop("calibration", None)
    path.write_text(json.dumps(spec, indent=2, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", choices=sorted(SOURCES), action="append")
    parser.add_argument("--write", action="store_true", help="store the fitted factors")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument(
        "--backend",
        choices=["cupy", "torch"],
        help="the code path the rows run on (default: each cluster file's backend); torch: "
        "each layer's fused chain one kernel, as PyTorch runs it (docs/dryrun.md)",
    )
    args = parser.parse_args(argv)
    if args.write and args.backend:
        parser.error(
            "--write stores a factor fitted on the cluster file's own backend: drop --backend"
        )
    everything = []
    for source in args.source or sorted(SOURCES):
        factor, rows = run_source(source, args.backend)
        print_table(source, factor, rows)
        everything += [{**r, "software_factor": factor} for r in rows]
        if args.write:
            write_factor(source, factor, rows)
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
