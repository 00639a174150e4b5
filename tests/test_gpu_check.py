"""The GPU check (benchmarks/gpu_check.sh) in its CPU mode, where CI runs it: every part runs or
skips saying why, the report and the logs land in the output folder, a failing or hanging part
makes the check exit non-zero and the report name it, and the command the prepare helper prints
fits the GPU machine's command line."""

from __future__ import annotations

import datetime
import os
import re
import shlex
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from mpi_helpers import ROOT

from benchmarks import gpu_prepare, gpu_report
from benchmarks.gpu_check import FAIL_ENV, PARTS, Part
from benchmarks.gpu_machine import route_facts

OUT_FILES = {"setup", "environment", "mpi", "tests", "benchmark", "mpirun"}
MACHINE_FILE_LIMIT = 8  # files a lent machine sends back from $OUT


def check(out: Path, *args: str, env: dict | None = None, timeout: float = 300):
    """``bash benchmarks/gpu_check.sh --out OUT ARGS`` with this Python; (process, report)."""
    run_env = {k: v for k, v in os.environ.items() if k != FAIL_ENV}
    run_env.update(PYTHON=sys.executable, **(env or {}))
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--out", str(out), *args],
        cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    report = (out / "report.md").read_text() if (out / "report.md").exists() else ""
    return proc, report


def part_row(report: str, name: str) -> list[str]:
    """The cells of a part's row in the report's table: name, status, seconds, limit, note."""
    for line in report.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == name and len(cells) == 6:
            return cells
    raise AssertionError(f"no row for part {name!r} in:\n{report}")


def fake_wheel(folder: Path, dist: str, version: str = "1.0") -> Path:
    """A minimal valid wheel of one module, ``{dist}_module``."""
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(f"{dist}_module.py", "ANSWER = 42\n")
        whl.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
        )
        whl.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        whl.writestr(f"{info}/RECORD", "")
    return path


@pytest.mark.mpi
@pytest.mark.slow
def test_the_check_runs_end_to_end_in_cpu_mode(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    fake_wheel(wheels, "zs_probe")  # missing here: installed into the check's prefix
    (wheels / "pytest-0.0-py3-none-any.whl").write_bytes(b"")  # present here: not installed
    out = tmp_path / "out"
    proc, report = check(out, "--cpu-dry", "--wheels", str(wheels))
    assert proc.returncode == 0, proc.stdout + proc.stderr + report
    assert "CPU mode (--cpu-dry" in report and "No part failed." in report
    assert "Rows for docs/install.md" not in report  # those come from a GPU only
    setup = part_row(report, "setup")
    assert setup[1] == "passed" and setup[4] == "installed: zs_probe-1.0-py3-none-any.whl"
    setup_log = (out / "setup.log").read_text()
    assert "pytest-0.0-py3-none-any.whl: not needed" in setup_log
    assert re.search(r"PYTHONPATH=\S+", setup_log), setup_log
    assert part_row(report, "environment")[1] == "passed"
    mpi = part_row(report, "mpi")
    assert mpi[1] == "passed" and "OK rank 0 of 2" in mpi[4] and "OK rank 1 of 2" in mpi[4]
    for name in ("tests", "mpirun"):  # the GPU tests skip, saying why
        status, note = part_row(report, name)[1], part_row(report, name)[4]
        assert status == "skipped" and "no GPU" in note, (name, note)
    bench = part_row(report, "benchmark")
    assert bench[1] == "passed" and "on the host" in bench[4]
    # the benchmark's code ran: zerosim's and torch's GPT from the same weights on the same data
    gap = re.search(r"\|zerosim − torch\| / torch = (\S+)", report)
    assert gap and float(gap.group(1)) < 1e-3, report
    assert re.search(r"\| zerosim \(numpy, stage 0\) \| host \|", report)
    assert re.search(r"\| torch \(Adam fused\) \| host \|", report)
    # what comes back fits what a lent machine sends back
    files = {p.name for p in out.iterdir()}
    assert files == {"report.md"} | {f"{name}.log" for name in OUT_FILES}
    assert len(files) <= MACHINE_FILE_LIMIT


def test_without_cpu_dry_a_machine_with_no_gpu_fails_the_check_saying_why(tmp_path):
    """This machine has no GPU: outside --cpu-dry that is a failure, not the CPU mode."""
    out = tmp_path / "out"
    proc, report = check(out, "--parts", "environment,tests,benchmark")
    assert proc.returncode == 1, proc.stdout + proc.stderr + report
    assert "No part failed." not in report
    environment = part_row(report, "environment")
    assert environment[1] == "failed", environment
    assert re.search(r"no GPU: CuPy (does not import|sees no CUDA device|finds no)", environment[4])
    assert "nvidia-smi: " in environment[4] and "--cpu-dry" in environment[4]
    tests = part_row(report, "tests")
    assert tests[1] == "failed" and "every test skipped" in tests[4], tests
    bench = part_row(report, "benchmark")
    assert bench[1] == "failed" and "no GPU" in bench[4], bench
    assert "**Failed: environment, tests, benchmark.**" in report
    assert "no GPU seen (" in report and "CPU mode" not in report


def test_the_benchmark_check_fails_where_torch_cannot_use_cuda(monkeypatch, capsys):
    """``gpu_adam.py --check`` on a GPU but with a torch that has no CUDA: nothing compared,
    exit 1 (here the GPU is stood in for by the host arrays; torch has no CUDA)."""
    from types import SimpleNamespace

    import numpy as np

    import zerosim.backend
    from benchmarks import gpu_adam

    assert not __import__("torch").cuda.is_available()
    host_as_gpu = SimpleNamespace(xp=np, sync=lambda: None, torch="cuda", backend="numpy")
    monkeypatch.setattr(zerosim.backend, "gpu_available", lambda: True)
    monkeypatch.setattr(
        gpu_adam, "device", lambda name: SimpleNamespace(**vars(host_as_gpu), name="gpu")
    )
    argv = ["--numel", "1024", "--steps", "1", "--gpt", "tiny", "--gpt-steps", "1", "--warmup", "0"]
    assert gpu_adam.main([*argv, "--check"]) == 1
    assert "torch cannot use CUDA here" in capsys.readouterr().err
    assert gpu_adam.main(argv) == 0  # without --check it only reports


def test_a_failing_part_fails_the_check_and_the_report_names_it(tmp_path):
    out = tmp_path / "out"
    proc, report = check(out, "--parts", "environment", env={FAIL_ENV: "environment"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert part_row(report, "environment")[1] == "failed"
    assert "**Failed: environment.**" in report
    assert "injected failure" in (out / "environment.log").read_text()
    assert part_row(report, "mpi")[4] == "not chosen (--parts)"


@pytest.mark.mpi
def test_a_part_past_its_limit_is_ended_and_the_check_goes_on(tmp_path):
    out = tmp_path / "out"
    start = time.monotonic()
    proc, report = check(
        out, "--parts", "environment,mpi", "--limit", "environment=3",
        env={FAIL_ENV: "environment:hang"},
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert part_row(report, "environment")[1:2] + part_row(report, "environment")[4:5] == [
        "timed out",
        "ended after 3 s",
    ]
    assert part_row(report, "mpi")[1] == "passed"  # the next part still ran
    assert time.monotonic() - start < 120
    pid = int(re.search(r"injected hang, pid (\d+)", (out / "environment.log").read_text())[1])
    with pytest.raises(ProcessLookupError):  # ended, not left behind
        os.kill(pid, 0)


def test_the_wrapper_writes_a_report_when_the_check_cannot_start(tmp_path):
    out = tmp_path / "out"
    proc, report = check(out, "--parts", "no-such-part")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--parts: no-such-part unknown" in proc.stderr
    assert "**Failed: the check did not start or was cut short** (exit status 2" in report


def test_the_prepared_command_fits_the_machines_command_line():
    """The longest command gpu_prepare.py prints: its --dest at the longest path a machine
    carries, made of the character that quoting lengthens most."""
    assert gpu_prepare.CARRY_PATH_LIMIT == 200 and gpu_prepare.COMMAND_LIMIT == 2000
    longest = gpu_prepare.command("'" * gpu_prepare.CARRY_PATH_LIMIT)
    assert len(longest) <= gpu_prepare.COMMAND_LIMIT, len(longest)
    spaced = "wheels for the check/" + "x" * 10
    assert shlex.split(gpu_prepare.command(spaced))[3] == spaced  # one argument, as given
    line = gpu_prepare.command()
    assert line.startswith("bash benchmarks/gpu_check.sh ") and '--out "$OUT"' in line
    assert (ROOT / "benchmarks" / "gpu_check.sh").exists()
    ignored = subprocess.run(["git", "check-ignore", "-q", gpu_prepare.DEST], cwd=ROOT)
    assert ignored.returncode == 0, f"{gpu_prepare.DEST} must be ignored by git: it is carried"


def test_the_prepare_helper_names_what_is_missing(tmp_path):
    (tmp_path / "mpich-5.0.2-py3-none-manylinux_2_28_x86_64.whl").write_bytes(b"x" * 1000)
    problems = gpu_prepare.check(tmp_path, gpu_prepare.command())
    assert f"no array-api-compat==1.16.0 wheel in {tmp_path}" in problems
    assert f"no pytest-timeout==2.4.0 wheel in {tmp_path}" in problems
    assert not any("mpich" in p for p in problems)
    assert not any("MiB to carry" in p for p in problems)  # 1 kB and the tree fit
    too_long = gpu_prepare.command("x" * 2000)
    assert any("characters, over 2000" in p for p in gpu_prepare.check(tmp_path, too_long))
    dest = "d" * 201  # longer than a machine carries: refused before the command is printed
    problems = gpu_prepare.check(tmp_path, gpu_prepare.command(dest), dest)
    assert any("201 characters, over 200" in p for p in problems), problems


# -- the report as it will read on a GPU machine --------------------------------------------------
ONE_H100 = {
    "host": "gpu-1",
    "gpu": True,
    "devices": 1,
    "names": ["NVIDIA H100 80GB HBM3"],
    "cupy": "14.2.0",
    "nccl": True,
    "nccl version": "22803",
    "cuda-aware mpi": False,
    "bfloat16": {"from host": "bfloat16", "matmul": "error: TypeError: no bf16 matmul"},
}


def test_one_gpu_sends_two_ranks_the_next_route_and_says_nccl_cannot_run():
    one = route_facts(ONE_H100, cuda_aware=False)
    assert one["route"] == "staged" and "NCCL refuses two ranks on one device" in one["route why"]
    assert route_facts(ONE_H100, cuda_aware=True)["route"] == "cuda-aware"
    assert route_facts({**ONE_H100, "devices": 2}, cuda_aware=True)["route"] == "nccl"
    assert route_facts({**ONE_H100, "nccl": False, "devices": 2}, False)["route"] == "staged"


def test_the_report_of_a_gpu_run_names_routes_bf16_and_the_rows_for_the_docs():
    facts = {**ONE_H100, **route_facts(ONE_H100, cuda_aware=False)}
    parts = {name: Part(name, "passed") for name in PARTS}
    float64 = "test_gpu::test_every_stage_on_the_gpu_matches_the_numpy_run"
    parts["tests"].status = "failed"
    parts["tests"].tests = [
        (f"{float64}[s0-gpt-deepspeed]", "passed", 2.0, ""),
        (f"{float64}[s3-gpt-deepspeed]", "failed", 2.0, "assert 1e-09 <= 1e-12"),
    ]
    mpirun = "test_gpu::test_every_stage_on_the_gpu_under_mpirun_2[float32]"
    parts["mpirun"].tests = [(mpirun, "passed", 20.0, "")]
    started = datetime.datetime(2026, 11, 26, 12, 0, tzinfo=datetime.UTC)
    text = gpu_report.report(parts, facts, started, False, lambda part: "")
    assert "GPU: 1 × NVIDIA H100 80GB HBM3" in text and "**Failed: tests.**" in text
    assert "CuPy arrays go **staged**" in text
    assert "NCCL through CuPy: 22803; taken here: no." in text
    assert "- `matmul`: error: TypeError: no bf16 matmul" in text
    rows = [line for line in text.splitlines() if line.startswith("| cupy | ")]
    assert rows[0].startswith("| cupy | LocalWorld: in place on the GPU | stages 0-3, both")
    assert rows[0].endswith(
        "| 1 failed, 1 passed: 2026-11-26 12:00 UTC, GPU: 1 × NVIDIA H100 80GB HBM3 |"
    )
    assert rows[1].startswith("| cupy | `mpirun -n 2`: staged | stages 0-3 in float64")
    assert rows[1].endswith("| 1 passed: 2026-11-26 12:00 UTC, GPU: 1 × NVIDIA H100 80GB HBM3 |")
    assert "| `benchmarks/gpu_adam.py` | passed: 2026-11-26" in rows[2]


def test_every_test_the_report_describes_exists():
    """The report's rows for the docs name tests by function: each must still exist, and each
    test of tests/test_gpu.py must have its row."""
    gpu = set(re.findall(r"^def (test_\w+)", (ROOT / "tests/test_gpu.py").read_text(), re.M))
    backend = re.findall(r"^def (test_\w+)", (ROOT / "tests/test_backend.py").read_text(), re.M)
    assert set(gpu_report.SHOWS) <= gpu | set(backend), set(gpu_report.SHOWS) - gpu - set(backend)
    assert gpu <= set(gpu_report.SHOWS), gpu - set(gpu_report.SHOWS)


def test_test_outcomes_are_read_from_pytest_junit_report_or_its_verbose_lines(tmp_path):
    """What a real pytest run writes: its JUnit XML, and (for a part ended at its limit, before
    the XML is written) its ``-v`` lines."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_demo.py").write_text(
        "import pytest\n\n"
        "def test_passes():\n    assert True\n\n"
        "def test_fails():\n    assert 1 == 2, 'one is not two'\n\n"
        "@pytest.mark.skip(reason='not here')\ndef test_skips():\n    pass\n"
    )
    xml = tmp_path / "demo.xml"
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    ran = subprocess.run(
        [*cmd, "tests/test_demo.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    want = {"test_passes": "passed", "test_fails": "failed", "test_skips": "skipped"}
    from_xml = gpu_report.junit_cases(xml)
    assert {name.split("::")[1]: outcome for name, outcome, _, _ in from_xml} == want
    assert [m for n, _, _, m in from_xml if n.endswith("test_skips")] == ["not here"]
    assert any("one is not two" in m for n, _, _, m in from_xml if n.endswith("test_fails"))
    from_log = gpu_report.verbose_cases(ran.stdout)
    assert {name.split("::")[1]: outcome for name, outcome, _, _ in from_log} == want


def test_where_pip_is_missing_a_wheel_is_unpacked_as_pip_would_lay_it_out(tmp_path):
    """The fallback of the setup part: packages into the site folder, a wheel's data (mpich's
    bin/ and lib/) into the prefix, executables executable; then found for PYTHONPATH, PATH,
    LD_LIBRARY_PATH and MPI4PY_LIBMPI."""
    from benchmarks.gpu_machine import environment_for, unpack

    wheel = tmp_path / "mpich-9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as whl:
        whl.writestr("mpich-9.9.dist-info/METADATA", "Metadata-Version: 2.1\nName: mpich\n")
        whl.writestr("mpich-9.9.data/data/bin/mpirun", "#!/bin/sh\necho ran\n")
        whl.writestr("mpich-9.9.data/data/lib/libmpi.so.12", "not really a library")
    probe = tmp_path / "wheels"
    probe.mkdir()
    prefix = tmp_path / "prefix"
    for each in (wheel, fake_wheel(probe, "zs_probe")):
        unpack(each, prefix, prefix / "site-packages")
    assert (prefix / "site-packages" / "zs_probe_module.py").read_text() == "ANSWER = 42\n"
    ran = subprocess.run([str(prefix / "bin" / "mpirun")], capture_output=True, text=True)
    assert ran.stdout == "ran\n"
    assert environment_for(prefix) == {
        "PYTHONPATH": str(prefix / "site-packages"),
        "PATH": str(prefix / "bin"),
        "LD_LIBRARY_PATH": str(prefix / "lib"),
        "MPI4PY_LIBMPI": str(prefix / "lib" / "libmpi.so.12"),
    }
