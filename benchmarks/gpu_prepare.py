"""Prepare what travels to a GPU machine for the GPU check, on a machine with pip and a network.

    python benchmarks/gpu_prepare.py [--dest .gpu_check/wheels] [--print-only]

The lent GPU machines reach no package registry. Their image (Python 3.12, numpy, CuPy for CUDA
13, mpi4py, torch with CUDA, NCCL, ml_dtypes, matplotlib, tqdm, pytest) lacks what this
downloads, as wheels for CPython 3.12 on x86-64 Linux, into a folder git ignores:

- array-api-compat: zerosim's namespace for CuPy arrays (a dependency of zerosim);
- mpich: an MPI library and its ``mpirun``, installed there only where the image's mpi4py finds
  no MPI library or no ``mpirun`` is found (benchmarks/gpu_machine.py decides);
- pytest-timeout: setup.cfg's per-test ``timeout``.

It checks that the wheels and the working tree together fit the 64 MiB a copy of the repository
may carry, then prints the folder to carry and the one command to run there (``command()``, at
most 2,000 characters: tests/test_gpu_check.py holds it to that). ``--print-only`` downloads nothing
and checks what is already in the folder.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEST = ".gpu_check/wheels"
# the versions the check was written against (the test environment's, zerosim's test suite runs
# on them); mpich 5's libmpi.so.12 is the ABI mpi4py's wheels load
WHEELS = ("array-api-compat==1.16.0", "mpich==5.0.2", "pytest-timeout==2.4.0")
TARGET = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"]
for tag in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"):
    TARGET += ["--platform", tag]
CARRY_LIMIT = 64 * 2**20  # bytes: the working tree and the carried folders together
COMMAND_LIMIT = 2000  # characters of the command line a lent machine takes
CARRY_PATH_LIMIT = 200  # characters of each path a lent machine is asked to carry (--dest)


def command(dest: str = DEST) -> str:
    """The one command line to run on the GPU machine, in the repository's root."""
    return f'bash benchmarks/gpu_check.sh --wheels {shlex.quote(dest)} --out "$OUT"'


def download(dest: Path) -> None:
    """The wheels, for the image's Python and platform, without their dependencies."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(dest)]
    subprocess.run([*cmd, *TARGET, *WHEELS], check=True)


def working_tree_bytes() -> int:
    """Bytes of what a copy of the repository takes along: tracked files and untracked files
    git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout  # fmt: skip
    files = (ROOT / name for name in listed.decode().split("\0") if name)
    return sum(f.stat().st_size for f in files if f.is_file())


def check(dest: Path, line: str, carried: str = DEST) -> list[str]:
    """What is wrong with the folder (empty: ready): every wheel there, git ignores it, it fits,
    and so do ``carried`` (the folder as the machine is asked to carry it) and the command."""
    problems = []
    if len(carried) > CARRY_PATH_LIMIT:
        problems.append(
            f"--dest {carried[:40]}…: {len(carried)} characters, over {CARRY_PATH_LIMIT} "
            "(the longest path a lent machine carries)"
        )
    names = {w.name.split("-")[0].replace("_", "-").lower() for w in dest.glob("*.whl")}
    for wanted in WHEELS:
        if wanted.split("==")[0] not in names:
            problems.append(f"no {wanted} wheel in {dest}")
    ignored = subprocess.run(["git", "check-ignore", "-q", str(dest)], cwd=ROOT).returncode == 0
    if not ignored:
        problems.append(f"{dest} is not ignored by git: the copy would take it as untracked files")
    total = working_tree_bytes() + sum(w.stat().st_size for w in dest.glob("*.whl"))
    if total > CARRY_LIMIT:
        problems.append(f"{total / 2**20:.1f} MiB to carry, over {CARRY_LIMIT / 2**20:.0f} MiB")
    if len(line) > COMMAND_LIMIT:
        problems.append(f"the command has {len(line)} characters, over {COMMAND_LIMIT}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dest", default=DEST, help="relative to the repository root")
    parser.add_argument("--print-only", action="store_true", help="download nothing")
    a = parser.parse_args(argv)
    dest = ROOT / a.dest
    if not a.print_only:
        download(dest)
    for wheel in sorted(dest.glob("*.whl")):
        print(f"{wheel.stat().st_size / 2**20:8.2f} MiB  {wheel.name}")
    tree = working_tree_bytes()
    wheels = sum(w.stat().st_size for w in dest.glob("*.whl"))
    print(f"{tree / 2**20:8.2f} MiB  the working tree; together {(tree + wheels) / 2**20:.2f} MiB")
    line = command(a.dest)
    problems = check(dest, line, a.dest)
    for problem in problems:
        print(f"gpu_prepare: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"\ncarry: {a.dest}\ncommand ({len(line)} characters):\n{line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
