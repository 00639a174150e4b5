"""The GPU check's report (benchmarks/gpu_check.py): each test's outcome read from pytest's
JUnit XML (or its ``-v`` lines), and report.md from the parts' outcomes, the machine's facts
(benchmarks/gpu_machine.py environment) and the logs."""

from __future__ import annotations

import ast
import datetime
import json
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

# what each test of tests/test_gpu.py (and the cupy test of tests/test_backend.py) runs, as the
# route and what columns of docs/install.md's "What runs where" ("mpirun": the route found here)
LOCAL = "LocalWorld: in place on the GPU"
MPIRUN = "`mpirun -n 2`: {route}"
SHOWS = {
    "test_every_stage_on_the_gpu_matches_the_numpy_run": (
        LOCAL,
        "stages 0-3, both layouts, accumulation, clipping in float64: the NumPy run's weights "
        "(≤ 1e-12)",
    ),
    "test_every_stage_in_float32_on_the_gpu_is_as_close_to_float64_as_numpys_float32": (
        LOCAL,
        "stages 0-3 (Adam) and stage 2 (SGD) in float32: within 2× NumPy float32's distance "
        "from the NumPy float64 run",
    ),
    "test_the_adam_elementwise_kernel_matches_the_numpy_path": (
        "—",
        "the fused Adam/AdamW ElementwiseKernel (AMSGrad too) against the NumPy path",
    ),
    "test_the_sgd_elementwise_kernel_matches_the_numpy_path": (
        "—",
        "the fused SGD ElementwiseKernel (momentum, Nesterov) against the NumPy path, to the bit",
    ),
    "test_collectives_on_gpu_arrays_say_how_they_travelled_under_mpirun": (
        MPIRUN,
        "all-reduce and all-gather of CuPy arrays take the route expected here",
    ),
    "test_every_stage_on_the_gpu_under_mpirun_2": (
        MPIRUN,
        "stages 0-3 in float64 (≤ 1e-12 from the NumPy run) and float32, the expected route",
    ),
    "test_cupy_backend_round_trips_arrays_through_the_device": (
        "—",
        "the backend: host arrays to the GPU and back, counted; bfloat16 refused",
    ),
}
BENCH_LINES = ("|", "Adam on", "GPT training", "last losses")


# -- what pytest says ----------------------------------------------------------------------------
def junit_cases(path: Path) -> list[tuple[str, str, float, str]]:
    """(test, outcome, seconds, message) for each test case of a pytest JUnit XML report."""
    if not path.exists():
        return []
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "failed" if child.tag != "skipped" else "skipped"
                message = child.get("message") or ""
                if message in ("", "collection skipped") and child.text:  # the reason is there
                    message = skip_reason(child.text.strip())
                message = (message.splitlines() or [""])[0][:300]
        module = case.get("classname", "").rsplit(".", 1)[-1]
        name = f"{module}::{case.get('name')}" if module else case.get("name", "")
        cases.append((name, outcome, float(case.get("time") or 0), message))
    return cases


def verbose_cases(log: str) -> list[tuple[str, str, float, str]]:
    """(test, outcome, 0, "") from ``pytest -v``'s lines, where pytest was ended before it
    wrote its JUnit report (a part past its limit): the tests that finished."""
    found = re.findall(r"^tests/(\S+)\.py::(\S+) (PASSED|FAILED|SKIPPED|ERROR)", log, re.M)
    words = {"PASSED": "passed", "SKIPPED": "skipped"}
    return [(f"{m}::{t}", words.get(word, "failed"), 0.0, "") for m, t, word in found]


def skip_reason(text: str) -> str:
    """A module-level skip's reason from JUnit's text ``('tests/x.py', 25, 'Skipped: why')``."""
    try:
        path, line, why = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError):
        return text
    return f"{Path(path).name}:{line}: {why.removeprefix('Skipped: ')}"


# -- report.md ---------------------------------------------------------------------------------


def report(
    parts: dict, facts: dict, started: datetime.datetime, cpu_dry: bool, log: Callable
) -> str:
    """report.md: the verdict, the parts, the routes, bf16, every test, the benchmark's tables,
    the rows for docs/install.md and the machine's facts."""
    failed = [p.name for p in parts.values() if p.failed]
    pending = [p.name for p in parts.values() if p.status == "not run" and not p.note]
    verdict = f"Failed: {', '.join(failed)}." if failed else "No part failed."
    if pending:  # the report is rewritten after each part: a check cut short leaves this one
        verdict += f" Not run yet: {', '.join(pending)}."
    when = started.strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# zerosim GPU check",
        "",
        f"Started {when} on {facts.get('host', 'an unknown host')}; {mode(facts, cpu_dry)}.",
        "",
        f"**{verdict}** "
        'Written by `benchmarks/gpu_check.sh` (see docs/install.md, "What runs where").',
        "",
        "| part | status | seconds | limit (s) | note | log |",
        "|---|---|---|---|---|---|",
    ]
    for p in parts.values():
        note = p.note.replace("|", "/").replace("\n", " ")
        lines.append(
            f"| {p.name} | {p.status} | {p.seconds:.0f} | {p.limit:.0f} | {note} | {p.name}.log |"
        )
    lines += routes(facts) + bfloat16(facts) + tests(parts) + benchmark(parts["benchmark"], log)
    lines += docs_rows(parts, facts, when, cpu_dry) + environment(facts)
    text = "\n".join(lines) + "\n"
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text


def mode(facts: dict, cpu_dry: bool) -> str:
    if cpu_dry:
        return 'CPU mode (--cpu-dry: every part ran with CUDA_VISIBLE_DEVICES="")'
    if facts.get("gpu"):
        return f"GPU: {facts['devices']} × {facts.get('names', ['?'])[0]}"
    if facts:
        return f"no GPU seen ({facts.get('no gpu')}): a failure without --cpu-dry"
    return "GPU or not unknown: the environment part did not report"


def routes(facts: dict) -> list[str]:
    if not facts:
        return []
    route = facts.get("route", "?")
    lines = ["", "## Routes on this machine", ""]
    if not facts.get("gpu"):
        return [*lines, f"- No GPU: {facts.get('route why')} (route `{route}`)."]
    lines.append(f"- Under `mpirun -n 2`, CuPy arrays go **{route}**: {facts.get('route why')}.")
    lines.append("- LocalWorld (ranks as threads of one process): in place on the device.")
    nccl = facts.get("nccl version") if facts.get("nccl") else "not available"
    lines.append(f"- NCCL through CuPy: {nccl}; taken here: {'yes' if route == 'nccl' else 'no'}.")
    aware = "yes" if facts.get("cuda-aware mpi") else "no (not reported by the library)"
    lines.append(
        f"- CUDA-aware MPI: {aware}; taken here: {'yes' if route == 'cuda-aware' else 'no'}."
    )
    lines.append(f"- Staged through the host: taken here: {'yes' if route == 'staged' else 'no'}.")
    return lines


def bfloat16(facts: dict) -> list[str]:
    probe = facts.get("bfloat16")
    if not probe:
        return []
    lines = ["", "## bf16 on the cupy backend", ""]
    lines.append(
        'zerosim\'s config refuses bf16 with `"backend": "cupy"` (CuPy before 14 had no '
        f"bfloat16). What CuPy {facts.get('cupy')} does here with ml_dtypes' bfloat16:"
    )
    lines.append("")
    lines += [f"- `{op}`: {result}" for op, result in probe.items()]
    return lines


def tests(parts: dict) -> list[str]:
    cases = [(p.name, *case) for p in parts.values() for case in p.tests]
    if not cases:
        return []
    lines = ["", "## Tests", "", "| part | test | outcome | s | message |", "|---|---|---|---|---|"]
    for part, name, outcome, seconds, message in cases:
        message = message.replace("|", "/")
        lines.append(f"| {part} | `{name}` | {outcome} | {seconds:.1f} | {message} |")
    return lines


def benchmark(part: Any, log: Callable) -> list[str]:
    text = [line for line in log(part).splitlines() if line.startswith(BENCH_LINES)]
    if not text:
        return []
    lines = ["", "## Benchmark (benchmarks/gpu_adam.py)"]
    for line in text:
        lines += [line] if line.startswith("|") else ["", line, ""]
    return lines


def docs_rows(parts: dict, facts: dict, when: str, cpu_dry: bool) -> list[str]:
    """One row of docs/install.md's table per test function of the GPU tests, and one for the
    benchmark: what it runs and how it came out here."""
    outcomes: dict[str, list[str]] = {}
    for part in (parts["tests"], parts["mpirun"]):
        for name, outcome, _, _ in part.tests:
            function = name.split("::")[-1].split("[")[0]
            outcomes.setdefault(function, []).append(outcome)
    if not outcomes or cpu_dry or not facts.get("gpu"):  # rows for the GPU runs only
        return []
    where = f"{when}, {mode(facts, cpu_dry)}"
    lines = ["", '## Rows for docs/install.md ("What runs where")', ""]
    lines += [
        "| backend | route of collectives | what | run by | last run |",
        "|---|---|---|---|---|",
    ]
    for function, got in outcomes.items():
        result = ", ".join(f"{got.count(o)} {o}" for o in sorted(set(got)))
        route, what = SHOWS.get(function, ("?", function))
        route = route.format(route=facts.get("route", "?"))
        lines.append(f"| cupy | {route} | {what} | `{function}` | {result}: {where} |")
    bench = parts["benchmark"]
    if bench.status in ("passed", "failed", "timed out"):
        what = "the tables above"
        lines.append(f"| cupy | — | {what} | `benchmarks/gpu_adam.py` | {bench.status}: {where} |")
    return lines


def environment(facts: dict) -> list[str]:
    if not facts:
        return []
    lines = ["", "## Environment", ""]
    for key, value in facts.items():
        if key != "bfloat16":
            shown = json.dumps(value) if isinstance(value, dict | list) else value
            lines.append(f"- {key}: {shown}")
    return lines
