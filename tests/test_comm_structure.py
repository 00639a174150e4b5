"""The shape of ``zerosim/comm``: no import circles (``TYPE_CHECKING`` imports included), no
private name used across modules, classes and functions of a readable length, and the world's
call (MPI's, a LocalWorld's exchange, the virtual world's completion) at most two Python frames
below every public collective method, counted on the real stack as the call is made.

Run as a script under mpirun (``python tests/test_comm_structure.py native|ring``), it prints the
frame counts of an MPI world of several ranks, where the cross-rank check and the ring run."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import numpy as np
import pytest

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


# -- private names stay in their module; lengths --------------------------------------------------


def _defined_private_names(tree: ast.AST) -> set[str]:
    """The private names a module defines: its functions, classes and attributes it assigns."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _foreign_private_uses(source: str) -> list[str]:
    """``from m import _x`` and ``obj._x`` where ``_x`` is not defined in this module (``os._exit``,
    the standard library's public way to end a process at once, aside)."""
    tree = ast.parse(source)
    own = _defined_private_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found += [f"from {node.module} import {a.name}" for a in node.names if a.name[0] == "_"]
        elif (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and node.attr not in own
            and ast.unparse(node) != "os._exit"
        ):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_private_name_finder_finds_foreign_names():
    source = (
        "from zerosim.backend import _hidden\nclass A:\n    def f(self, comm):\n"
        "        self._mine = comm._pending\n        return other._mine\n"
    )
    assert _foreign_private_uses(source) == [
        "from zerosim.backend import _hidden",
        "line 4: comm._pending",
    ]


def test_no_module_of_comm_uses_another_modules_private_names():
    found = {p.name: _foreign_private_uses(p.read_text()) for p in sorted(COMM.glob("*.py"))}
    assert {name: uses for name, uses in found.items() if uses} == {}


def _lengths(path: Path) -> list[tuple[str, str, int]]:
    """(kind, name, lines) of every class and function of ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            out.append((kind, node.name, node.end_lineno - node.lineno + 1))
    return out


def test_every_class_of_comm_is_under_350_lines_and_every_function_under_60():
    too_long = [
        (path.name, kind, name, lines)
        for path in sorted(COMM.glob("*.py"))
        for kind, name, lines in _lengths(path)
        if lines >= {"class": 350, "function": 60}[kind]
    ]
    assert too_long == []


# -- the world's call, at most two frames below the public method ---------------------------------

COLLECTIVES = [
    "all_gather", "reduce_scatter", "reduce_scatter_v", "all_reduce", "broadcast", "reduce",
    "all_to_all", "barrier", "iall_gather", "ireduce_scatter", "ireduce_scatter_v",
    "iall_reduce", "ireduce",
]  # fmt: skip


class StackRecorder:
    """A profile hook (``sys.setprofile``, per thread) that, at every call into the world, walks
    the real stack up to the public collective method (or ``Handle.wait``) and keeps, per method,
    the most Python frames found between the two. The world's calls are the functions whose code
    is in ``exchanges``; their own frame does not count, their caller's does. Calls made by the
    bookkeeping (the cross-rank check, the node map) are not the collective's data: left out."""

    def __init__(self, exchanges: set) -> None:
        from zerosim.comm.base import Communicator
        from zerosim.comm.call import Bookkeeping, Handle

        self.public = {getattr(Communicator, m).__code__: m for m in COLLECTIVES}
        self.public[Handle.wait.__code__] = "wait"
        self.bookkeeping = {Bookkeeping.__enter__.__code__, Bookkeeping.__exit__.__code__}
        self.exchanges = exchanges
        self.deepest: dict[str, int] = {}

    def __call__(self, frame, event, arg) -> None:
        if event != "call" or frame.f_code not in self.exchanges:
            return
        start, between = frame.f_back, 0
        while start is not None and start.f_code not in self.public:
            if start.f_code in self.bookkeeping:
                return
            start, between = start.f_back, between + 1
        if start is not None:
            method = self.public[start.f_code]
            self.deepest[method] = max(self.deepest.get(method, 0), between)


class MPIRequest:
    """An mpi4py request whose completion is a Python call the recorder sees (mpi4py's methods
    are compiled, and a profile hook sees no call into them)."""

    def __init__(self, request) -> None:
        self.request = request

    def Wait(self):  # noqa: N802 (mpi4py's name)
        return self.request.Wait()

    def Test(self):  # noqa: N802
        return self.request.Test()


class MPIMethods:
    """An mpi4py communicator whose every method call is a Python call, ``mpi_call``, standing
    where MPI's call stands on the stack (its caller is the frame that calls MPI)."""

    def __init__(self, mpi) -> None:
        self.mpi = mpi

    def __getattr__(self, name):
        method = getattr(self.mpi, name)

        def mpi_call(*args, **kwargs):
            found = method(*args, **kwargs)
            return MPIRequest(found) if type(found).__name__ == "Request" else found

        return mpi_call


def _with_nested(codes: set) -> set:
    """``codes`` and the code of every function (closure, lambda) defined inside them."""
    nested = {c for code in codes for c in code.co_consts if hasattr(c, "co_consts")}
    return codes | (_with_nested(nested) if nested else set())


def _mpi_recorded(comm) -> StackRecorder:
    """The frame counts of every collective of the MPIComm ``comm``."""
    comm.mpi = MPIMethods(comm.mpi)
    nested = _with_nested({MPIMethods.__getattr__.__code__}) - {MPIMethods.__getattr__.__code__}
    return _recorded(comm, {MPIRequest.Wait.__code__, MPIRequest.Test.__code__, *nested})


def _call_every_collective(comm) -> None:
    """Each public collective of ``comm``, and ``wait()`` on each handle, once."""
    n, f32 = comm.size, np.float32
    args = {
        "all_gather": lambda: (np.zeros(2 * n, f32), np.ones(2, f32)),
        "reduce_scatter": lambda: (np.zeros(2, f32), np.ones(2 * n, f32)),
        "reduce_scatter_v": lambda: (np.zeros(1, f32), np.ones(n, f32), [1] * n),
        "all_reduce": lambda: (np.ones(3, f32),),
        "broadcast": lambda: (np.ones(3, f32),),
        "reduce": lambda: (np.ones(3, f32),),
        "all_to_all": lambda: (np.zeros(2 * n, f32), np.ones(2 * n, f32)),
        "barrier": lambda: (),
    }
    for method in COLLECTIVES:
        blocking = method.removeprefix("i") if method.startswith("ir") else method
        blocking = blocking.replace("iall_", "all_")
        handle = getattr(comm, method)(*args[blocking]())
        if handle is not None:
            handle.wait()


def _recorded(comm, exchanges: set) -> StackRecorder:
    recorder = StackRecorder(exchanges)
    sys.setprofile(recorder)
    try:
        _call_every_collective(comm)
    finally:
        sys.setprofile(None)
    return recorder


def _local_exchanges() -> set:
    from zerosim.comm import LocalComm

    return {getattr(LocalComm, m).__code__ for m in ("_post", "_collect", "send", "recv")}


def _assert_thin(recorder: StackRecorder, methods: set[str]) -> None:
    assert set(recorder.deepest) == methods, (
        f"no call into the world from {methods - set(recorder.deepest)}"
    )
    too_deep = {m: d for m, d in recorder.deepest.items() if d > 2}
    assert too_deep == {}, f"frames between the public method and the world's call: {too_deep}"


def test_the_stack_recorder_counts_the_frames_between(monkeypatch):
    from zerosim.comm import LocalComm, LocalWorld

    post = LocalComm._post

    def deeper(self, op, payload):  # one more frame on the way to the exchange
        return post(self, op, payload)

    def run(comm):
        return _recorded(comm, _local_exchanges()).deepest

    before = LocalWorld(2).run(run)[0]  # a group of one posts nothing (LocalComm's docstring)
    monkeypatch.setattr(LocalComm, "_post", lambda self, op, payload: deeper(self, op, payload))
    after = LocalWorld(2).run(lambda comm: _recorded(comm, {post.__code__}).deepest)[0]
    assert before["all_gather"] == 2  # all_gather → _native_all_gather → _native_iall_gather
    assert after["all_gather"] == 4  # … → the lambda → deeper → _post


def test_an_mpi_call_is_at_most_two_frames_below_the_public_collective():
    from mpi4py import MPI

    from zerosim.comm import MPIComm

    _assert_thin(_mpi_recorded(MPIComm(MPI.COMM_SELF, group="frames")), {*COLLECTIVES, "wait"})


@pytest.mark.mpi
@pytest.mark.parametrize("collectives", ["native", "ring"])
def test_with_several_ranks_the_mpi_call_is_at_most_two_frames_below(collectives):
    from mpi_helpers import run_mpi

    proc = run_mpi(2, ["tests/test_comm_structure.py", collectives], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    deepest = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(deepest) == {*COLLECTIVES, "wait"} - ({"wait"} if collectives == "ring" else set())
    assert {m: d for m, d in deepest.items() if d > 2} == {}


@pytest.mark.parametrize("size, collectives", [(2, "native"), (3, "native"), (3, "ring")])
def test_a_local_world_exchanges_at_most_two_frames_below_the_public_collective(size, collectives):
    from zerosim.comm import LocalWorld

    recorders = LocalWorld(size, collectives).run(_recorded, _local_exchanges())
    expected = {*COLLECTIVES} | ({"wait"} if collectives == "native" else set())
    for recorder in recorders:
        _assert_thin(recorder, expected)


def test_a_one_rank_local_world_copies_at_most_two_frames_below_and_exchanges_nothing():
    """A group of one rank posts nothing: the collectives that move data (gathers, reduce-
    scatters, all-to-all) reach its one copy (``_copy_alone``) at most two frames below the
    public method, and the others (all-reduce, reduce, broadcast, barrier, wait) reach nothing."""
    from zerosim.comm import LocalComm, LocalWorld

    exchanges = _local_exchanges() | {LocalComm._copy_alone.__code__}
    (recorder,) = LocalWorld(1).run(_recorded, exchanges)
    copies = {m for m in COLLECTIVES if "gather" in m or "scatter" in m} | {"all_to_all"}
    _assert_thin(recorder, copies)


def test_the_virtual_world_completes_at_most_two_frames_below_the_public_collective():
    from zerosim.comm import virtual

    world = virtual.VirtualWorld(4)
    functions = [*vars(virtual).values(), *vars(virtual.VirtualComm).values()]
    codes = _with_nested({f.__code__ for f in functions if hasattr(f, "__code__")})
    comm = world.comm(1)
    comm.record_events([])  # the wait of a non-blocking call is noted: it has a completion
    _assert_thin(_recorded(comm, codes), {*COLLECTIVES, "wait"})


if __name__ == "__main__":  # under mpirun: the frame counts of an MPI world of several ranks
    from zerosim.comm import MPIComm

    print(json.dumps(_mpi_recorded(MPIComm(collectives=sys.argv[1])).deepest))
