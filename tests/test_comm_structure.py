"""The shape of ``zerosim/comm``: no import circles (``TYPE_CHECKING`` imports included), and the
MPI call at most two Python frames below every public collective method."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import numpy as np

import zerosim.comm

COMM = Path(zerosim.comm.__file__).parent


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of ``zerosim.comm`` that ``path`` imports, wherever the import stands (module
    level, a function, an ``if TYPE_CHECKING:`` block)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            # ``from zerosim.comm import ring`` names a module; ``import Ledger`` the package
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                for a in node.names
            ]
        else:
            continue
        found.update(n for n in names if n in modules)
    return found


def _graph() -> dict[str, set[str]]:
    paths = {
        ("zerosim.comm" if p.stem == "__init__" else f"zerosim.comm.{p.stem}"): p
        for p in COMM.glob("*.py")
    }
    return {m: _imports(p, set(paths)) - {m} for m, p in paths.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (a depth-first search), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*path[path.index(n) :], n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_cycle_finder_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_import_graph_sees_type_checking_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from zerosim.comm.base import Communicator\n"
        "def f():\n    from zerosim.comm import ring, Ledger\n"
    )
    modules = {"zerosim.comm", "zerosim.comm.base", "zerosim.comm.ring"}
    assert _imports(source, modules) == modules


def test_comm_has_no_import_circles():
    graph = _graph()
    assert "zerosim.comm.base" in graph and graph["zerosim.comm.base"]
    assert _cycle(graph) is None, f"import circle in zerosim/comm: {_cycle(graph)}"


# -- the MPI call, at most two frames below the public method ------------------------------------

COLLECTIVES = [
    "all_gather", "reduce_scatter", "reduce_scatter_v", "all_reduce", "broadcast", "reduce",
    "all_to_all", "barrier", "iall_gather", "ireduce_scatter", "ireduce_scatter_v",
    "iall_reduce", "ireduce",
]  # fmt: skip


def _frames_below(method: str, up: int) -> int:
    """How many Python frames stand between the frame of the public method ``method`` and the
    call being made now (0: the public method makes it itself); asked ``up`` frames below the
    frame that made the call."""
    frame, between = sys._getframe(up + 1), 0  # the frame that made the call
    while frame is not None and frame.f_code.co_name != method:
        frame, between = frame.f_back, between + 1
    assert frame is not None, f"{method} is not on the stack"
    return between


def _call_every_collective(comm, seen: dict, current: list) -> None:
    """Each public collective of ``comm``, and ``wait()`` on each handle, once."""
    n, f32 = comm.size, np.float32
    for method in COLLECTIVES:
        current[0] = method
        args = {
            "all_gather": (np.zeros(2 * n, f32), np.ones(2, f32)),
            "reduce_scatter": (np.zeros(2, f32), np.ones(2 * n, f32)),
            "reduce_scatter_v": (np.zeros(1, f32), np.ones(n, f32), [1] * n),
            "all_reduce": (np.ones(3, f32),),
            "broadcast": (np.ones(3, f32),),
            "reduce": (np.ones(3, f32),),
            "all_to_all": (np.zeros(2 * n, f32), np.ones(2 * n, f32)),
            "barrier": (),
        }[method.removeprefix("i") if method.startswith("ir") or method == "iall_gather"
          or method == "iall_reduce" else method]  # fmt: skip
        handle = getattr(comm, method)(*args)
        if handle is not None:
            current[0] = "wait"
            handle.wait()
        assert method in seen, f"{method} made no call into the world"


def test_an_mpi_call_is_at_most_two_frames_below_the_public_collective():
    from mpi4py import MPI

    from zerosim.comm import MPIComm

    seen: dict[str, int] = {}
    current = [""]

    def note(name: str) -> None:  # called from the stand-in of MPI's method
        below = _frames_below(current[0], 3)
        seen[current[0]] = max(seen.get(current[0], 0), below)
        assert below <= 2, f"{current[0]} calls MPI's {name} {below} frames below it"

    class Request:  # MPI's request, noting where it is completed
        def __init__(self, request):
            self.request = request

        def Wait(self):  # noqa: N802 (mpi4py's name)
            note("Wait")
            return self.request.Wait()

        def Test(self):  # noqa: N802
            return self.request.Test()

    class Noting:  # the mpi4py communicator, noting where each of its methods is called
        def __init__(self, mpi):
            self.mpi = mpi

        def __getattr__(self, name):
            method = getattr(self.mpi, name)

            def call(*args, **kwargs):
                note(name)
                found = method(*args, **kwargs)
                return Request(found) if isinstance(found, MPI.Request) else found

            return call

    comm = MPIComm(MPI.COMM_SELF, group="frames")
    comm.mpi = Noting(comm.mpi)
    _call_every_collective(comm, seen, current)
    assert set(seen) == {*COLLECTIVES, "wait"}


def test_a_local_world_posts_at_most_two_frames_below_the_public_collective(monkeypatch):
    from zerosim.comm import LocalComm, LocalWorld

    seen: dict[str, int] = {}
    post = LocalComm._post

    def noting_post(self, op, payload):
        if op != "argument check":  # the cross-rank check, made by the bookkeeping
            below = _frames_below(current[0], 2)
            seen[current[0]] = max(seen.get(current[0], 0), below)
            assert below <= 2, f"{current[0]} posts {below} frames below it"
        return post(self, op, payload)

    monkeypatch.setattr(LocalComm, "_post", noting_post)
    current = [""]
    LocalWorld(1).run(_call_every_collective, seen, current)
    assert set(seen) == set(COLLECTIVES)
