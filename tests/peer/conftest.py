"""The peer tests import tests/ helpers (mpi_helpers, torch_twins) and cases.py beside them."""

import copy
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


@pytest.fixture(scope="session", params=[2, 3], ids=["N2", "N3"])
def peer_runs(request, tmp_path_factory):
    """(N, {module name: {case name: {"ds": ..., "zs": ...}}}) for every peer module collected.

    Each peer module lists its cases (``cases()``) and reads its own results through a ``runs``
    fixture. The cases of all of them run in one DeepSpeed launch and one zerosim launch per world
    size (DeepSpeed's start-up is most of a launch's time), so a session pays two launches per N
    however many peer modules it collects."""
    from runner import run_both

    n = request.param
    modules = {
        item.module.__name__: item.module
        for item in request.session.items
        if "peer_runs" in getattr(item, "fixturenames", ())
    }
    plan, origin = [], {}
    for key, module in sorted(modules.items()):
        for case in copy.deepcopy(module.cases()):
            joined = f"{key}--{case['name']}"  # names repeat across modules ("s0_muon")
            origin[joined] = (key, case["name"])
            plan.append(dict(case, name=joined))
    results = run_both(n, plan, tmp_path_factory.mktemp(f"peer{n}"))
    out: dict[str, dict] = {key: {} for key in modules}
    for joined, result in results.items():
        key, name = origin[joined]
        out[key][name] = result
    return n, out
