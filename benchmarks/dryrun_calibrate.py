"""Calibrate zerosim/dryrun/clusters/selene.json on Narayanan et al.'s ZeRO-3 rows; predict the
others.

    python -m benchmarks.dryrun_calibrate [--write] [--json PATH] [--only 174.6]

Narayanan et al. (SC21, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", arXiv 2104.04473, §5.2 "Comparison to ZeRO-3" and Table 2) trained their 174.6B
and 529.6B GPTs with ZeRO-3 and no model parallelism on Selene (§5: DGX A100 nodes), keeping the
global batch fixed as the GPUs grow, and report model TFLOP/s per GPU (§5.1, eq. 3:
96·B·s·l·h²·(1 + s/6h + V/16lh) per step over the step time, recomputation included).
``PUBLISHED`` (``zerosim.dryrun.published.NARAYANAN_TABLE2``) transcribes Table 2's six ZeRO-3
rows, every figure checked against the paper's text and table (docs/dryrun.md says where).

For every row, one dry run (``zerosim.dryrun.run_world``: GPT preset, stage 3 on DeepSpeed's
schedule with DeepSpeed's defaults, bf16 with fp32 Adam, recomputation of every block, the row's
micro-batch, one micro-batch per step as batch = N · micro-batch) records each class
representative's last step; the time model (``dryrun/timeline.py``) simulates it on Selene.
The two efficiency factors of selene.json, compute (fraction of the 312 TFLOP/s peak the matrix
products reach) and network (fraction of the link bandwidths), are fitted on the three 174.6B
rows only, minimising Σ log²(predicted / published) by coordinate descent (golden section in log
space, from 1, 1, until a round moves neither factor by more than 1e-5). The 529.6B rows are
then predictions of a model that never saw them; every row is printed with its ratio.
``--write`` stores the fitted factors in selene.json; it is refused unless the 174.6B rows are
fitted (``--only`` takes 174.6 or 529.6; ``--only 529.6`` predicts with the file's factors).
About 6 minutes here: the six dry runs (one per row, each simulated as often as the fit asks)
and a few hundred simulated steps.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zerosim.dryrun import load_cluster_model, recipe, run_world  # noqa: E402
from zerosim.dryrun.published import NARAYANAN_TABLE2  # noqa: E402
from zerosim.dryrun.report import step_time  # noqa: E402
from zerosim.dryrun.timeline import CLUSTERS  # noqa: E402

SELENE = CLUSTERS / "selene.json"
# Narayanan et al. SC21, Table 2, ZeRO-3 without model parallelism: (model, GPUs, micro-batch,
# global batch, published model TFLOP/s per GPU, fitted?). 640 GPUs and batch 2560 for the
# 529.6B model at micro-batch 4: it did not fit on 560 GPUs (Table 2's caption, the row marked *).
PUBLISHED = NARAYANAN_TABLE2
SIZES = {"174.6": "gpt3-175b", "529.6": "gpt-529b"}  # --only: Table 2's model sizes
FACTORS = 2  # compute and network efficiency: a fit needs at least as many fitted rows


def select_rows(only: str | None) -> list[tuple]:
    """``PUBLISHED``, or only the rows of one model size (a key of ``SIZES``)."""
    if only is None:
        return list(PUBLISHED)
    if only not in SIZES:
        raise ValueError(f"--only must be one of {list(SIZES)}, got {only!r}")
    return [row for row in PUBLISHED if row[0] == SIZES[only]]


def config(micro: int, accumulation: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,
    }


def record(row: tuple) -> list:
    """The dry run of one row: its class representatives' runs."""
    model, n, micro, batch, *_ = row
    runs, wall = run_world(
        recipe(model), n, config(micro, batch // (n * micro)), recompute=True, steps=2
    )
    print(f"  {model} on {n} ranks: {len(runs)} classes in {wall:.0f} s", file=sys.stderr)
    return runs


def predict(row: tuple, runs: list, cluster) -> float:
    model, n, *_ = row
    time_, _ = step_time(runs, n, cluster, recipe(model), recompute=True)
    return time_["tflops_per_device"]


def loss(rows: list, traces: list, cluster) -> float:
    return sum(
        math.log(predict(row, runs, cluster) / row[4]) ** 2
        for row, runs in zip(rows, traces, strict=True)
        if row[5]
    )


def golden(f, lo: float, hi: float, iterations: int = 25) -> float:
    """The minimiser of a unimodal f on [lo, hi] (golden-section search)."""
    ratio = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iterations):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
    return (a + b) / 2


def fit(rows: list, traces: list, base) -> tuple[float, float]:
    """(compute, network) efficiencies minimising the fitted rows' Σ log² ratio."""
    log_c = log_n = 0.0
    for _ in range(8):  # coordinate descent, each coordinate in log space on (1%, 100%]
        before = (log_c, log_n)
        log_c = golden(
            lambda x, n=log_n: loss(rows, traces, base.with_efficiencies(math.exp(x), math.exp(n))),
            math.log(0.01),
            0.0,
        )
        log_n = golden(
            lambda x, c=log_c: loss(rows, traces, base.with_efficiencies(math.exp(c), math.exp(x))),
            math.log(0.01),
            0.0,
        )
        if max(abs(log_c - before[0]), abs(log_n - before[1])) < 1e-5:
            break
    return math.exp(log_c), math.exp(log_n)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="store the factors in selene.json")
    parser.add_argument("--json", metavar="PATH", help="also write the table as JSON")
    parser.add_argument("--only", help=f"only the rows of this model size ({' or '.join(SIZES)})")
    args = parser.parse_args(argv)
    try:
        rows = select_rows(args.only)
    except ValueError as err:
        parser.error(str(err))
    fitted = sum(1 for row in rows if row[5])
    if args.write and fitted < FACTORS:
        parser.error(
            f"--write needs at least {FACTORS} fitted rows (the 174.6B ones) to fit "
            f"{FACTORS} factors; --only {args.only} selects {fitted}: selene.json left as it is"
        )
    start = time.perf_counter()
    traces = [record(row) for row in rows]
    base = load_cluster_model(SELENE)
    if fitted < FACTORS:  # nothing to fit: predict with the file's factors
        compute, network = base.compute_efficiency, base.network_efficiency
        how = f"selene.json's factors as they are ({fitted} fitted rows selected, no fit)"
    else:
        compute, network = fit(rows, traces, base)
        how = "selene.json fitted on the 174.6B rows"
    cluster = base.with_efficiencies(compute, network)
    print(
        f"{how}: compute_efficiency {compute:.4f}, "
        f"network_efficiency {network:.4f} ({time.perf_counter() - start:.0f} s)"
    )
    print(f"{'model':>10} {'GPUs':>5} {'micro':>5} {'published':>9} {'predicted':>9} {'ratio':>6}")
    table = []
    for row, runs in zip(rows, traces, strict=True):
        model, n, micro, batch, published, fitted = row
        t, _ = step_time(runs, n, cluster, recipe(model), recompute=True)
        pred = t["tflops_per_device"]
        table.append({"model": model, "gpus": n, "micro_batch": micro, "batch": batch,
                      "published_tflops": published, "predicted_tflops": pred,
                      "fitted": fitted, "time": t})  # fmt: skip
        note = "fitted" if fitted else "predicted"
        if not t["fits_device"]:  # the step would not start: no throughput to set beside
            print(
                f"{model:>10} {n:>5} {micro:>5} {published:>9.0f} {'OOM':>9} {'—':>6}  {note}; "
                f"peak {t['peak_bytes'] / 2**30:.1f} GiB > device "
                f"{cluster.device_memory_bytes / 2**30:.0f} GiB: would not start "
                f"(would take {t['step_s']:.1f} s)"
            )
            continue
        print(
            f"{model:>10} {n:>5} {micro:>5} {published:>9.0f} {pred:>9.1f} "
            f"{pred / published:>6.3f}  {note}; step {t['step_s']:.1f} s, exposed comm "
            f"{t['exposed_comm_s']:.1f} s"
        )
    if args.write:
        spec = json.loads(SELENE.read_text())
        spec["compute_efficiency"], spec["network_efficiency"] = (
            round(compute, 4),
            round(network, 4),
        )
        spec["calibration"] = (
            "compute_efficiency and network_efficiency fitted by benchmarks/dryrun_calibrate.py "
            "on Narayanan et al.'s three 174.6B ZeRO-3 rows (Table 2)"
        )
        SELENE.write_text(json.dumps(spec, indent=2) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
