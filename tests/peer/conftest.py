"""The peer tests import tests/ helpers (mpi_helpers, torch_twins) and cases.py beside them."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
