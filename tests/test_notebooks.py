"""Every notebook in notebooks/ runs top to bottom as a learner runs it, and is committed without
outputs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mpi_helpers import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_the_teaching_notebooks_are_there():
    names = [p.name for p in NOTEBOOKS]
    for expected in ("01_partitioning", "02_communication_volume", "03_memory"):
        assert f"{expected}.ipynb" in names, names


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_without_outputs_and_ends_by_asserting(notebook):
    cells = json.loads(notebook.read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    assert all(c["outputs"] == [] and c["execution_count"] is None for c in code)
    assert "assert " in "".join(code[-1]["source"]), (
        "the last cell must check measured == predicted"
    )


@pytest.mark.slow
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom_as_a_learner_runs_it(notebook):
    """From the notebook's own folder (what Jupyter does), with zerosim found only as
    ``pip install -e .`` installed it: no ``PYTHONPATH``, the repository root not on ``sys.path``
    (notebook_runner.py checks both inside the kernel)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).parent / "helpers" / "notebook_runner.py"),
            notebook.name,
        ],
        cwd=notebook.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
