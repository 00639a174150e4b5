"""Run one notebook as Jupyter runs it for a learner: ``python notebook_runner.py NOTEBOOK``.

Started by tests/test_notebooks.py with the notebook's folder as the working directory and no
``PYTHONPATH``: the kernel (this Python's own) finds zerosim only as ``pip install -e .``
installed it. A first cell, added here and never written back, checks that: the working directory
is the notebook's folder, the repository root is not on ``sys.path`` and zerosim is an installed
distribution. Exits non-zero, naming the cell, if any cell raises.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

CHECK = """\
import importlib.metadata, os, sys
assert os.getcwd() == {folder!r}, os.getcwd()
assert "PYTHONPATH" not in os.environ, os.environ["PYTHONPATH"]
assert {root!r} not in [os.path.abspath(p or ".") for p in sys.path], sys.path
importlib.metadata.distribution("zerosim")  # installed, not merely importable
"""


def main(argv: list[str]) -> int:
    notebook = Path(argv[0]).resolve()
    nb = nbformat.read(notebook, as_version=4)
    check = CHECK.format(folder=str(notebook.parent), root=str(notebook.parent.parent))
    nb.cells.insert(0, nbformat.v4.new_code_cell(check))
    client = NotebookClient(nb, timeout=300, kernel_name="python3")
    start = time.perf_counter()
    try:
        client.execute(cwd=str(notebook.parent))
    except CellExecutionError as err:
        print(f"{notebook.name}: {err}", file=sys.stderr)
        return 1
    print(f"{notebook.name}: {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
