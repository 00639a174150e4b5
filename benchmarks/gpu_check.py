"""The GPU check: what zerosim's CuPy half has to show on a GPU, run in one command on a bare GPU
machine (benchmarks/gpu_check.sh starts it; benchmarks/gpu_prepare.py prepares what it carries).

    python benchmarks/gpu_check.py [--wheels .gpu_check/wheels] [--out DIR] [--cpu-dry]
        [--parts setup,environment,…] [--limit PART=SECONDS …] [--budget 470]

Parts, in this order, each a process of its own with a time limit (past it the part and every
process it started are ended, and it counts as failed), inside an overall budget (470 s: under
the 8 minutes a lent machine gives one command):

- ``setup`` (90 s): installs the carried wheels this machine lacks (gpu_machine.py install).
- ``environment`` (60 s): GPU, driver, CUDA, versions, the MPI library and ``mpirun``, NCCL
  through CuPy, the route CuPy arrays take under ``mpirun -n 2`` here, CuPy's bfloat16.
- ``mpi`` (60 s): ``mpirun -n 2``, two ranks all-reducing through zerosim's MPIComm.
- ``tests`` (180 s): tests/test_gpu.py in-process (every stage on ``cupy`` in float64 and
  float32 against the NumPy runs, the ElementwiseKernels against the NumPy path) and the cupy
  test of tests/test_backend.py.
- ``benchmark`` (180 s): benchmarks/gpu_adam.py --check (Adam against the copy bandwidth and
  torch's fused Adam; a 97.8M-parameter GPT's training step against torch's).
- ``mpirun`` (180 s): tests/test_gpu.py's mpirun tests (the route, every stage under
  ``mpirun -n 2``).

It writes to ``--out`` ($OUT by default) report.md (each part's outcome and note, every test's,
the benchmark's tables, the routes exercised and those that cannot be on this machine, and the
rows for docs/install.md's "What runs where") and the raw logs (setup.log, environment.log,
mpi.log, tests.log, benchmark.log, mpirun.log); the report is rewritten after every part, so a
check cut short still leaves one. Exit status 0 when no part failed (a part may skip, saying
why), 1 otherwise.

CPU mode: with ``--cpu-dry`` (which hides the GPUs from every part, ``CUDA_VISIBLE_DEVICES=""``),
the same parts run: the GPU tests skip, saying why, and the benchmark runs its code on the host at
a small size, so the check itself is tested where there is no GPU (tests/test_gpu_check.py).
Without ``--cpu-dry`` a GPU is required: where none is seen the environment part fails saying why
(CuPy's import error or its device count, and what nvidia-smi says), a GPU test part whose tests
all skip fails, and so does the benchmark (gpu_adam.py exits 2 without a GPU, 1 without a torch
that can use CUDA to compare with). ``ZEROSIM_GPU_CHECK_FAIL=PART`` (or ``PART:hang``) runs a
command that fails (or never ends) in place of that part's, for those tests.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_report  # noqa: E402  (after the path set-up above)

MACHINE = "benchmarks/gpu_machine.py"
LIMITS = {"setup": 90, "environment": 60, "mpi": 60, "tests": 180, "benchmark": 180, "mpirun": 180}
PARTS = tuple(LIMITS)
BUDGET = 470
FLOOR = 15  # seconds kept back for each part still to come
FAIL_ENV = "ZEROSIM_GPU_CHECK_FAIL"
BENCH_ON_HOST = ["--device", "cpu", "--numel", "65536", "--steps", "3", "--gpt", "tiny"]
BENCH_ON_HOST += ["--gpt-steps", "2", "--warmup", "1"]
GPU_TESTS = (
    "tests/test_gpu.py",
    "tests/test_backend.py::test_cupy_backend_round_trips_arrays_through_the_device",
)


@dataclass
class Part:
    """One part's outcome: ``status`` is passed, failed, skipped, timed out or not run."""

    name: str
    status: str = "not run"
    note: str = ""
    seconds: float = 0.0
    limit: float = 0.0
    tests: list[tuple[str, str, float, str]] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.status in ("failed", "timed out")


class Check:
    """Runs the parts in order and keeps the report up to date."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a, self.out = a, Path(a.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.scratch = Path(tempfile.mkdtemp(prefix="zerosim-gpu-check-"))
        self.parts = {name: Part(name) for name in PARTS}
        for name in set(PARTS) - set(a.parts):
            self.parts[name].note = "not chosen (--parts)"
        self.facts: dict = {}
        self.started = datetime.datetime.now(datetime.UTC)
        self.deadline = time.monotonic() + a.budget
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
        )
        self.env["PYTHONUNBUFFERED"] = "1"  # a part ended at its limit leaves its whole log
        # Open MPI refuses to start as root without these (MPICH ignores them)
        self.env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        self.env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        if a.cpu_dry:
            self.env["CUDA_VISIBLE_DEVICES"] = ""
        if not os.access(Path.home(), os.W_OK):  # CuPy caches the kernels it compiles there
            self.env.setdefault("CUPY_CACHE_DIR", str(self.scratch / "cupy"))

    # -- running a part -------------------------------------------------------------------------
    def limit_for(self, name: str) -> float:
        """The part's own limit, or less where the budget would not leave the later parts
        their floor."""
        later = PARTS[PARTS.index(name) + 1 :]
        left = self.deadline - time.monotonic() - FLOOR * sum(p in self.a.parts for p in later)
        return min(self.a.limits.get(name, LIMITS[name]), left)

    def run(self, part: Part, argv: list[str]) -> int | None:
        """Run ``argv`` for ``part`` (its output to PART.log); the exit status, None past the
        limit (then the part's whole process group is ended)."""
        injected = os.environ.get(FAIL_ENV, "")
        if injected in (part.name, f"{part.name}:hang"):
            code = "import os, time; print('injected hang, pid', os.getpid(), flush=True)"
            code += "; time.sleep(10**6)"
            if injected == part.name:
                code = f"import sys; sys.exit('injected failure ({FAIL_ENV}={part.name})')"
            argv = [sys.executable, "-c", code]
        log = self.out / f"{part.name}.log"
        with log.open("a") as sink:
            sink.write(f"$ {shlex.join(argv)}\n")
            sink.flush()
            start = time.monotonic()
            proc = subprocess.Popen(
                argv, cwd=ROOT, env=self.env, stdout=sink, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
            try:
                code = proc.wait(timeout=part.limit)
            except subprocess.TimeoutExpired:
                end_group(proc)
                code = None
            part.seconds += time.monotonic() - start
        return code

    def step(self, name: str, body) -> None:
        part = self.parts[name]
        if name not in self.a.parts:
            return
        part.limit = self.limit_for(name)
        if part.limit < min(5, self.a.limits.get(name, LIMITS[name])):
            part.status, part.note = "skipped", "the check's time budget was spent"
        else:
            print(f"[{name}] running (limit {part.limit:.0f} s)", flush=True)
            try:
                body(part)
            except Exception as err:  # a fault of the check itself: the other parts still run
                traceback.print_exc()
                part.status, part.note = "failed", f"the check's own error: {err!r}"
        print(f"[{name}] {part.status} in {part.seconds:.0f} s {part.note}", flush=True)
        self.write_report()

    def timed_out(self, part: Part) -> None:
        part.status, part.note = "timed out", f"ended after {part.limit:.0f} s"

    # -- the parts --------------------------------------------------------------------------------
    def setup(self, part: Part) -> None:
        wheels = Path(self.a.wheels)
        if not list(wheels.glob("*.whl")):
            part.status = "skipped"
            part.note = f"no wheels in {wheels} (benchmarks/gpu_prepare.py puts them there)"
            return
        facts = self.scratch / "installed.json"
        prefix = self.scratch / "prefix"
        code = self.run(
            part, [sys.executable, MACHINE, "install", str(wheels), str(prefix), str(facts)]
        )
        if code is None:
            return self.timed_out(part)
        if code != 0 or not facts.exists():
            part.status, part.note = "failed", f"exit status {code} (setup.log)"
            return
        installed = json.loads(facts.read_text())
        for key, value in installed["env"].items():
            if key == "MPI4PY_LIBMPI":
                self.env[key] = value
            else:  # in front of what the machine has (PYTHONPATH: after the repository)
                old = [p for p in self.env.get(key, "").split(os.pathsep) if p]
                at = 1 if key == "PYTHONPATH" else 0
                self.env[key] = os.pathsep.join(old[:at] + [value] + old[at:])
        part.status = "passed"
        part.note = "installed: " + (", ".join(installed["installed"]) or "nothing (all present)")

    def environment(self, part: Part) -> None:
        facts = self.scratch / "environment.json"
        code = self.run(part, [sys.executable, MACHINE, "environment", str(facts)])
        if code is None:
            return self.timed_out(part)
        if code != 0 or not facts.exists():
            part.status, part.note = "failed", f"exit status {code} (environment.log)"
            return
        self.facts = json.loads(facts.read_text())
        f = self.facts
        if not f.get("gpu") and not self.a.cpu_dry:  # a GPU check with no GPU tests nothing
            smi = " ".join(str(f.get("nvidia-smi", "not asked")).split())
            part.status = "failed"
            part.note = f"no GPU: {f.get('no gpu') or f.get('cuda facts')}; nvidia-smi: {smi} "
            part.note += "(--cpu-dry runs the check without a GPU)"
            return
        part.status = "passed"
        gpus = (
            f"{f['devices']} × {f.get('names', ['?'])[0]}"
            if f.get("gpu")
            else f"no GPU ({f.get('no gpu')})"
        )
        part.note = f"{gpus}; MPI: {f.get('mpi library')}; mpirun: {f.get('mpirun')}"

    def mpi(self, part: Part) -> None:
        mpirun = self.facts.get("mpirun") or self.mpirun_here()
        if not mpirun:
            part.status = "failed"
            part.note = "no mpirun (carry the mpich wheel: benchmarks/gpu_prepare.py)"
            return
        code = self.run(part, [mpirun, "-n", "2", sys.executable, MACHINE, "mpi-hello"])
        if code is None:
            return self.timed_out(part)
        # the ranks share one output: their lines may run together
        said = re.findall(r"OK rank \d+ of \d+ \([^)]*\)", self.log(part))
        ranks = sorted(line.split()[2] for line in said)
        if code == 0 and ranks == ["0", "1"]:
            part.status, part.note = "passed", "; ".join(sorted(said))
        else:
            part.status, part.note = "failed", f"exit status {code}, ranks that answered: {ranks}"

    def pytest(self, part: Part, marker: str) -> None:
        report = self.scratch / f"{part.name}.xml"
        argv = [sys.executable, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider"]
        argv += ["-o", f"timeout={max(30, int(part.limit) - 10)}", "-m", marker]
        files = GPU_TESTS if part.name == "tests" else GPU_TESTS[:1]  # test_backend's: no mpi
        argv += [f"--junitxml={report}", *files]
        code = self.run(part, argv)
        part.tests = gpu_report.junit_cases(report) or gpu_report.verbose_cases(self.log(part))
        if code is None:
            return self.timed_out(part)
        outcomes = [outcome for _, outcome, _, _ in part.tests]
        counts = ", ".join(f"{outcomes.count(o)} {o}" for o in sorted(set(outcomes)))
        if code in (0, 5) and outcomes and set(outcomes) == {"skipped"}:  # 5: none collected
            # every GPU test skipped: the CPU mode's outcome, a failure on a GPU machine
            part.status = "skipped" if self.a.cpu_dry else "failed"
            part.note = "; ".join(sorted({message for *_, message in part.tests}))
            if not self.a.cpu_dry:
                part.note = f"every test skipped (outside --cpu-dry): {part.note}"
        elif code == 0 and "passed" in outcomes:
            part.status, part.note = "passed", counts
        else:
            part.status, part.note = "failed", f"pytest exit status {code}: {counts or 'no tests'}"

    def tests(self, part: Part) -> None:
        self.pytest(part, "not mpi")

    def mpirun(self, part: Part) -> None:
        if self.parts["mpi"].status not in ("passed", "not run"):
            part.status, part.note = "skipped", "mpirun does not work here (the mpi part)"
            return
        self.pytest(part, "mpi")

    def benchmark(self, part: Part) -> None:
        on_host = self.a.cpu_dry
        argv = [sys.executable, "benchmarks/gpu_adam.py", "--check"]
        code = self.run(part, argv + (BENCH_ON_HOST if on_host else []))
        if code is None:
            return self.timed_out(part)
        if code == 2:  # gpu_adam.py found no GPU (outside --cpu-dry: it runs on the device)
            part.status, part.note = "failed", self.log(part).strip().splitlines()[-1]
        elif code == 0:
            part.status = "passed"
            part.note = "on the host, a check of the script's code (--cpu-dry)" if on_host else ""
        else:
            part.status, part.note = "failed", f"exit status {code} (benchmark.log)"

    def mpirun_here(self) -> str | None:
        """Where the environment part did not say: the ``mpirun`` tests/helpers/mpi_helpers.py would
        take, next to this Python, else on the parts' PATH."""
        here = Path(sys.executable).parent
        return shutil.which("mpirun", path=str(here)) or shutil.which(
            "mpirun", path=self.env.get("PATH")
        )

    def log(self, part: Part) -> str:
        path = self.out / f"{part.name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- the report -------------------------------------------------------------------------------
    def write_report(self) -> None:
        try:
            text = gpu_report.report(self.parts, self.facts, self.started, self.a.cpu_dry, self.log)
        except Exception:  # a fault of the report's code: the parts' outcomes still come back
            rows = [f"- {p.name}: {p.status} {p.note}" for p in self.parts.values()]
            text = "\n".join(["# zerosim GPU check", "", "**The report failed:**", "", "```"])
            text += f"\n{traceback.format_exc()}```\n\n" + "\n".join(rows) + "\n"
        (self.out / "report.md").write_text(text)

    def main(self) -> int:
        for name in PARTS:
            self.step(name, getattr(self, name))
        shutil.rmtree(self.scratch, ignore_errors=True)  # the installed wheels among them
        failed = [p.name for p in self.parts.values() if p.failed]
        print(f"report: {self.out / 'report.md'}; failed: {', '.join(failed) or 'none'}")
        return 1 if failed else 0


def end_group(proc: subprocess.Popen) -> None:
    """End a part that ran past its limit: TERM to its process group (mpirun passes it on to
    the ranks), then KILL to whatever of the group is left 5 s later."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--wheels", default=str(ROOT / ".gpu_check" / "wheels"))
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / ".gpu_check" / "out"))
    p.add_argument("--cpu-dry", action="store_true", help="hide the GPUs: the CPU mode")
    p.add_argument(
        "--parts", default=",".join(PARTS), help="comma-separated, from " + ", ".join(PARTS)
    )
    p.add_argument("--limit", action="append", default=[], metavar="PART=SECONDS")
    p.add_argument("--budget", type=float, default=BUDGET, help="seconds for the whole check")
    a = p.parse_args(argv)
    if not a.out:
        p.error("--out: an empty folder name (is $OUT set?)")
    a.parts = [name for name in a.parts.split(",") if name]
    unknown = [name for name in a.parts if name not in PARTS]
    if unknown:
        p.error(f"--parts: {', '.join(unknown)} unknown; allowed: {', '.join(PARTS)}")
    a.limits = {}
    for item in a.limit:
        name, _, seconds = item.partition("=")
        if name not in PARTS or not seconds.replace(".", "", 1).isdigit():
            p.error(f"--limit {item!r}: expected PART=SECONDS with PART one of {', '.join(PARTS)}")
        a.limits[name] = float(seconds)
    return a


if __name__ == "__main__":
    raise SystemExit(Check(parse_args(sys.argv[1:])).main())
