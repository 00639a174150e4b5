"""Launch a real ``mpirun`` job from a test and return what it printed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent  # tests/ (this file is in tests/helpers/)
ROOT = TESTS.parent


def mpirun_path() -> str:
    """The mpirun next to this Python (the mpich wheel's), else the first on PATH."""
    here = Path(sys.executable).parent
    found = shutil.which("mpirun", path=str(here)) or shutil.which("mpirun")
    if found is None:
        raise RuntimeError(
            "mpirun not found next to the Python or on PATH; "
            "pip install mpich (it is a zerosim dependency)"
        )
    return found


def run_mpi(n: int, args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``mpirun -n n python ARGS`` from the repository root and capture its output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    # Unbuffered, print() hands its pieces to the pipe one write at a time and the ranks' lines
    # interleave mid-line ("CASES 0" + "CASES 1 3" + " 3"); buffered, each flush is one write.
    env.pop("PYTHONUNBUFFERED", None)
    cmd = [mpirun_path(), "-n", str(n), sys.executable, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
