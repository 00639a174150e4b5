"""zerosim's structure, held by reading its source: sizes, import circles, private names.

zerosim is read more than it is run (docs/STYLE: one concern per file, a class with one role),
so these limits are checked on every module, one test per top-level area of the package so that
a failure names where it is:

- no class over 350 lines, no function over 60 lines outside ``zerosim/cli/`` (a data table
  aside: a function whose body, after its docstring, only assigns or returns list, tuple, set or
  dict displays, with no loop, branch or call around them);
- no import circle among zerosim's modules, counting module-level imports, imports inside
  functions and imports under ``if TYPE_CHECKING:`` alike (a circle is a circle to a reader even
  where Python resolves it at run time);
- no private name (a leading underscore) imported from another zerosim module: modules talk
  through public names. ruff's PLC2701 (on in ruff.toml) does not see these, because it leaves
  first-party imports alone; this test is the check;
- no two classes of one name in the package, and every field of a class in ``zerosim/zero/``
  declared where a reader looks for it: first assigned (``self.x = …``) in ``__init__`` of the
  class or of a base, or in the class body, never first in another method; and in
  ``zerosim/zero/`` every field an ``__init__`` declares carries its type
  (``self.x: T = …``).

A line count is the source span of the ``def`` or ``class`` statement, docstring included,
decorators not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "zerosim"
MAX_CLASS_LINES = 350
MAX_FUNCTION_LINES = 60
EXEMPT_FROM_FUNCTION_LIMIT = ("cli",)  # argparse tables: one long build_parser reads best whole

DISPLAYS = (ast.List, ast.Tuple, ast.Set, ast.Dict)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in MODULES.items()}


def area_of(module: str) -> str:
    """``zerosim.<area>...``: a subpackage or a root module (the package's own ``__init__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


AREAS = sorted({area_of(m) for m in MODULES})


def in_area(area: str) -> list[str]:
    return [m for m in MODULES if area_of(m) == area]


def lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def is_data_table(func: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A body that only writes down displays (after an optional docstring): a table, not logic."""
    body = func.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    if not body:
        return False
    for stmt in body:
        if not isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.Return)):
            return False
        if not isinstance(stmt.value, DISPLAYS):
            return False
        if any(isinstance(n, (ast.Call, ast.Lambda, ast.comprehension)) for n in ast.walk(stmt)):
            return False
    return True


def long_definitions(module: str) -> list[str]:
    found = []
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.ClassDef) and lines(node) > MAX_CLASS_LINES:
            found.append(f"{module}: class {node.name} has {lines(node)} lines")
        elif (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and area_of(module) not in EXEMPT_FROM_FUNCTION_LIMIT
            and lines(node) > MAX_FUNCTION_LINES
            and not is_data_table(node)
        ):
            found.append(f"{module}: def {node.name} at line {node.lineno} has {lines(node)} lines")
    return found


def resolve(module: str, node: ast.ImportFrom) -> str | None:
    """The absolute module name an ``import from`` names, relative imports included."""
    if node.level == 0:
        return node.module
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def owning_module(name: str) -> str | None:
    """The zerosim module that defines ``name`` (a dotted path), or None outside zerosim."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> list[tuple[str, str | None, int]]:
    """Every import in ``module``, wherever it sits: (imported module, imported name, line)."""
    found = []
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = resolve(module, node)
            if source:
                found += [(source, alias.name, node.lineno) for alias in node.names]
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the zerosim modules it imports (a submodule when the imported name is one)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module in MODULES:
        for source, name, _ in imports(module):
            if not source.startswith("zerosim"):
                continue
            full = f"{source}.{name}" if name else source
            target = full if full in MODULES else owning_module(source)
            if target and target != module:
                graph[module].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def private_imports(module: str) -> list[str]:
    found = []
    for source, name, line in imports(module):
        if not source.startswith("zerosim"):
            continue
        private = name is not None and name.startswith("_") and not name.startswith("__")
        owner = owning_module(f"{source}.{name}") if name else None
        if private and owner != module:
            found.append(f"{module}:{line} imports {name} from {source}")
    return found


def class_index(trees: dict[str, ast.Module]) -> dict[str, list[tuple[str, ast.ClassDef]]]:
    """Class name -> [(module, its definition)] over the package."""
    found: dict[str, list[tuple[str, ast.ClassDef]]] = {}
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append((module, node))
    return found


def assigned_fields(function: ast.AST) -> list[tuple[str, int]]:
    """(name, line) of each ``self.<name> = …`` (plain, annotated or augmented) in a function."""
    out = []
    for node in ast.walk(function):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for e in ast.walk(target):
                if (
                    isinstance(e, ast.Attribute)
                    and isinstance(e.value, ast.Name)
                    and e.value.id == "self"
                    and isinstance(e.ctx, ast.Store)
                ):
                    out.append((e.attr, node.lineno))
    return out


def declared_fields(node: ast.ClassDef) -> set[str]:
    """The names a class declares: its body's names and methods, and ``__init__``'s fields."""
    names = body_names(node)
    for st in node.body:
        if isinstance(st, ast.FunctionDef) and st.name == "__init__":
            names |= {name for name, _ in assigned_fields(st)}
    return names


def body_names(node: ast.ClassDef) -> set[str]:
    """The names a class body declares: its class attributes and methods."""
    names = set()
    for st in node.body:
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(st.name)
        elif isinstance(st, ast.Assign):
            names |= {t.id for t in st.targets if isinstance(t, ast.Name)}
        elif isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
            names.add(st.target.id)
    return names


def lineage(
    node: ast.ClassDef, classes: dict[str, list[tuple[str, ast.ClassDef]]]
) -> list[ast.ClassDef]:
    """The class and its bases, looked up by name among the package's classes."""
    out = [node]
    for base in node.bases:
        name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
        for _, parent in classes.get(name, []):
            out += lineage(parent, classes)
    return out


def fields_outside_init(
    module: str, classes: dict[str, list[tuple[str, ast.ClassDef]]]
) -> list[str]:
    """``module:line Class.field (in method)`` for each field first assigned outside
    ``__init__`` (bases looked up by name among the package's classes)."""
    found = []
    for name, defs in classes.items():
        for where, node in defs:
            if where != module:
                continue
            known = set().union(*(declared_fields(c) for c in lineage(node, classes)))
            for st in node.body:
                if not isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for field, line in assigned_fields(st):
                    if field not in known:
                        found.append(f"{module}:{line} {name}.{field} (in {st.name})")
                        known.add(field)
    return found


def unannotated_fields(
    module: str, classes: dict[str, list[tuple[str, ast.ClassDef]]]
) -> list[str]:
    """``module:line Class.field`` for each field an ``__init__`` declares without its type: the
    first ``self.field = …`` of a field that neither the class body nor a base declares must be
    ``self.field: T = …`` (a tuple target ``self.a, self.b = …`` cannot carry one)."""
    found = []
    for name, defs in classes.items():
        for where, node in defs:
            if where != module:
                continue
            bases = lineage(node, classes)[1:]
            known = body_names(node).union(*(declared_fields(c) for c in bases))
            for init in (s for s in node.body if isinstance(s, ast.FunctionDef)):
                if init.name != "__init__":
                    continue
                statements = [
                    n for n in ast.walk(init) if isinstance(n, (ast.Assign, ast.AnnAssign))
                ]
                for st in sorted(statements, key=lambda n: (n.lineno, n.col_offset)):
                    for field, line in assigned_fields(st):
                        if field not in known and not isinstance(st, ast.AnnAssign):
                            found.append(f"{module}:{line} {name}.{field}")
                        known.add(field)
    return found


# -- the checks themselves -----------------------------------------------------------


def test_the_checks_see_the_whole_package():
    assert "zerosim.engine" in MODULES and "zerosim.zero.stage3" in MODULES
    assert {"analysis", "comm", "optim", "zero", "engine"} <= set(AREAS)


@pytest.mark.parametrize("area", AREAS)
def test_no_class_or_function_over_its_line_limit(area):
    found = [f for m in in_area(area) for f in long_definitions(m)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("area", AREAS)
def test_no_import_circle_through(area):
    found = [c for c in circles(import_graph()) if any(area_of(m) == area for m in c)]
    assert not found, "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("area", AREAS)
def test_no_private_name_imported_across_modules(area):
    found = [f for m in in_area(area) for f in private_imports(m)]
    assert not found, "\n".join(found)


def test_no_two_classes_share_a_name():
    found = {n: [m for m, _ in d] for n, d in class_index(TREES).items() if len(d) > 1}
    assert not found, found


@pytest.mark.parametrize("module", [m for m in MODULES if area_of(m) == "zero"])
def test_every_field_is_declared_in_init(module):
    found = fields_outside_init(module, class_index(TREES))
    assert not found, "\n".join(found)


@pytest.mark.parametrize("module", [m for m in MODULES if area_of(m) == "zero"])
def test_every_field_is_declared_with_its_type(module):
    found = unannotated_fields(module, class_index(TREES))
    assert not found, "\n".join(found)


# DESIGN.md's layers, top to bottom; a module imports only from its own layer or below. The
# areas DESIGN.md does not list sit where their imports put them: ``meta`` (shape-only arrays)
# under ``backend``, ``data`` beside ``nn``, ``dryrun`` beside the entry points.
LAYERS = (
    ("__init__", "__main__", "cli", "report", "dryrun"),
    ("engine", "config", "checkpoint"),
    ("zero",),
    ("optim", "nn", "analysis", "data"),
    ("comm",),
    ("faults",),
    ("backend", "errors"),
    ("meta",),
)
# The one import against the layers, and why: ``zero.Init(config=dict or path)`` reads the config
# the engine will get (DeepSpeed's ``zero.Init(config_dict_or_path=…)`` does the same); the
# reader is config/'s, so ``zero/init.py`` imports it where it is called.
UPWARD_ALLOWED = {("zerosim.zero.init", "zerosim.config")}


def depth(area: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if area in layer)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``module -> module`` for each import of a layer above the importer's."""
    return [
        f"{m} -> {target}"
        for m, targets in graph.items()
        for target in sorted(targets)
        if depth(area_of(target)) < depth(area_of(m)) and (m, target) not in UPWARD_ALLOWED
    ]


def test_every_area_has_a_layer():
    assert sorted(a for layer in LAYERS for a in layer) == AREAS


@pytest.mark.parametrize("area", AREAS)
def test_no_import_from_a_layer_above(area):
    graph = {m: t for m, t in import_graph().items() if area_of(m) == area}
    found = upward_imports(graph)
    assert not found, "\n".join(found)


# -- the checks can fail: each finds what it is for in a small made-up source ----------


def test_a_data_table_is_told_from_logic():
    table = ast.parse('def f():\n    """doc"""\n    return {"a": (1, 2), "b": [3]}\n').body[0]
    logic = ast.parse("def f():\n    return [g(x) for x in range(3)]\n").body[0]
    branch = ast.parse("def f(x):\n    if x:\n        return [1]\n    return [2]\n").body[0]
    assert is_data_table(table)
    assert not is_data_table(logic)
    assert not is_data_table(branch)


def test_a_circle_is_found_and_a_chain_is_not():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_a_relative_import_resolves_to_its_module():
    node = ast.parse("from .sampler import _check", mode="exec").body[0]
    assert resolve("zerosim.data.loader", node) == "zerosim.data.sampler"
    node = ast.parse("from ..backend import xp", mode="exec").body[0]
    assert resolve("zerosim.data", node) == "zerosim.backend"


def test_a_field_first_set_outside_init_is_found():
    source = (
        "class A:\n    def __init__(self):\n        self.x = 1\n"
        "class B(A):\n    y = 0\n    def setup(self):\n        self.x = self.y = 2\n"
        "        self.z: int = 3\n        self.z += 1\n"
    )
    classes = class_index({"m": ast.parse(source)})
    assert fields_outside_init("m", classes) == ["m:8 B.z (in setup)"]


def test_a_field_declared_without_its_type_is_found():
    source = (
        "class A:\n    def __init__(self):\n        self.x: int = 1\n"
        "class B(A):\n    y = 0\n    def __init__(self):\n        self.x = self.y = 2\n"
        "        self.z = 3\n        self.z: int = 4\n        self.a, self.b = 5, 6\n"
        "        self.c: int = 7\n        self.c = 8\n"
    )
    classes = class_index({"m": ast.parse(source)})
    assert unannotated_fields("m", classes) == ["m:8 B.z", "m:10 B.a", "m:10 B.b"]


def test_an_upward_import_is_found():
    graph = {"zerosim.zero.lamb": {"zerosim.config.values", "zerosim.backend"}}
    assert upward_imports(graph) == ["zerosim.zero.lamb -> zerosim.config.values"]
    assert upward_imports({"zerosim.zero.init": {"zerosim.config"}}) == []
