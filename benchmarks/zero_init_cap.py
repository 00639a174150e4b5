"""ZeRO-3's promise, measured: a model larger than one rank's memory, trained on 8 ranks.

    python -m benchmarks.zero_init_cap [--layers 40] [--margin-mib 150] [--json rows.json]

Runs ``tests/helpers/zero_init_worker.py`` twice under ``mpirun -n 8``: each rank caps its
private memory with ``RLIMIT_DATA`` (enforced by the kernel) at what it holds after start-up plus
an allowance, and builds an MLP of square 1024-wide layers whose fp32 weights exceed that
allowance. Outside
``zero.Init`` every rank fails to build it; inside, every rank trains it at stage 3 with Adam.
Per rank the table sets the measured peaks (tracemalloc's peak of traced allocations during
training; VmData, the kernel's count the cap applies to) beside the formula of the ZeRO paper
for stage 3 with Adam in fp32, 16Ψ/N bytes (4 parameters + 4 gradients + 8 two moments per
element of the rank's shard), plus the ZeRO-R buffers (gradient bucket pool) and the most
parameters gathered at once, and beside the whole model's fp32 size.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

from mpi_helpers import run_mpi  # noqa: E402

MIB = 2**20


def run(inside: bool, args: argparse.Namespace) -> tuple[int, list[dict]]:
    cmd = [
        "tests/helpers/zero_init_worker.py",
        "--layers",
        str(args.layers),
        "--width",
        str(args.width),
    ]
    cmd += ["--margin-mib", str(args.margin_mib), "--steps", str(args.steps), "--optimizer", "Adam"]
    proc = run_mpi(args.ranks, [*cmd, "--inside"] if inside else cmd, timeout=1200)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc.returncode, sorted(rows, key=lambda r: r["rank"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--margin-mib", type=int, default=150)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    code_out, outside = run(False, args)
    code_in, inside = run(True, args)
    if not inside or code_in != 0:
        print(f"the zero.Init run failed (exit {code_in}); rows: {inside}")
        return 1
    n = args.ranks
    full = inside[0]["fp32_model_bytes"]
    failed = sum("MemoryError" in r.get("error", "") for r in outside)
    print(
        f"MLP of {args.layers} layers {args.width}x{args.width}: fp32 weights {full / MIB:,.1f} "
        f"MiB; each of {n} ranks may allocate {inside[0]['allowance'] / MIB:,.0f} MiB after "
        f"start-up (RLIMIT_DATA). Outside zero.Init: {failed} of {len(outside)} ranks failed "
        f"with MemoryError (exit {code_out}). Inside: trained {args.steps} steps at stage 3 "
        "(Adam, fp32).\n"
    )
    print(
        "| rank | allowance MiB | measured peak MiB (tracemalloc) | VmData growth MiB | "
        "16Ψ/N MiB | + buffers MiB | whole model MiB | ratio peak / (16Ψ/N + buffers) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    out = []
    for r in inside:
        formula = 16 * r["padded_numel"] // n
        buffers = r["report"]["bucket_buffers"] + r["report"]["peak_gathered_params"]
        grown = r["vmdata_end"] - r["start"]
        ratio = r["train_peak"] / (formula + buffers)
        print(
            f"| {r['rank']} | {r['allowance'] / MIB:,.0f} | {r['train_peak'] / MIB:,.1f} | "
            f"{grown / MIB:,.1f} | {formula / MIB:,.1f} | {buffers / MIB:,.1f} | "
            f"{full / MIB:,.1f} | {ratio:.3f} |"
        )
        out.append(
            {
                "rank": r["rank"],
                "allowance": r["allowance"],
                "peak": r["train_peak"],
                "vmdata_growth": grown,
                "formula": formula,
                "buffers": buffers,
                "full_model": full,
                "outside_failed": failed,
            }
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
