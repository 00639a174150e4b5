"""Every config key DeepSpeed reads, found in DeepSpeed's own code at test time.

DeepSpeed 0.19.8 reads its JSON config in two ways: plain functions that take the dict and call
``get_scalar_param(d, KEY, DEFAULT)``, ``d.get(KEY, DEFAULT)``, ``d[KEY]`` or ``KEY in d``, and
pydantic models built with ``Model(**d)``. ``deepspeed_keys()`` walks the first kind from
``DeepSpeedConfig`` (its ``__init__``, ``_initialize_params`` and checks) and from
``deepspeed.initialize`` (which reads ``data_parallel_size`` and ``tensor_parallel.autotp_size``
itself, for its device mesh and AutoTP's mode) through every function
and class they hand the dict or a part of it to, following the key path each variable holds,
and walks the second kind through ``model_fields`` (aliases and nested models included). Key
names are resolved from the constants modules the readers import. The result maps each key path
(a tuple) to a ``Key``: where DeepSpeed reads it, its default where one is written in the code
(``NO_DEFAULT`` otherwise), and whether its value is read as a whole (a leaf: no key under it
is read).

The walk is deliberately small: assignments, returns, ``for`` loops over constant tuples and
dicts, calls and ``if`` bodies; a reader that hides its keys better would be missed, which is
why the test also checks that keys it knows DeepSpeed reads are found.
"""

from __future__ import annotations

import ast
import enum
import importlib
import inspect
import textwrap
import types
from dataclasses import dataclass, field
from typing import Any

import pydantic
from pydantic_core import PydanticUndefined

READERS = ("get_scalar_param", "get_dict_param", "get_list_param")  # (dict, key, default)
NO_DEFAULT = object()


@dataclass
class Key:
    """One key path DeepSpeed reads: where (module.function:line or Model.field) and its
    default as the code writes it (``NO_DEFAULT`` when none is)."""

    where: str
    default: Any = NO_DEFAULT
    pydantic: bool = False
    children: set[str] = field(default_factory=set)


Path = tuple[str, ...]


class KeyWalk:
    """The shared state of one walk: the keys found and the functions already walked."""

    def __init__(self) -> None:
        self.keys: dict[Path, Key] = {}
        self.walked: set[tuple[Any, frozenset]] = set()

    def read(self, path: Path, where: str, default: Any = NO_DEFAULT, pydantic_=False) -> None:
        key = self.keys.setdefault(path, Key(where, default, pydantic_))
        if key.default is NO_DEFAULT and default is not NO_DEFAULT:
            key.default = default
        for depth in range(1, len(path)):
            self.keys.setdefault(path[:depth], Key(where)).children.add(path[depth])

    def model(self, cls: type, path: Path) -> None:
        """Every field of pydantic model ``cls`` read at ``path`` (nested models too)."""
        for name, info in cls.model_fields.items():
            default = info.default
            if default is PydanticUndefined:
                default = info.default_factory() if info.default_factory else NO_DEFAULT
            for key in {name, info.alias} - {None}:
                self.read((*path, key), f"{cls.__name__}.{name}", _plain(default), True)
                for nested in _models_in(info.annotation):
                    self.model(nested, (*path, key))

    def function(self, fn: Any, env: dict[str, frozenset], keys: dict[str, list[str]]) -> set:
        """Walk ``fn`` with its parameters bound to key paths (``env``) or key names
        (``keys``); returns the paths it may return."""
        tag = (fn, frozenset(env.items()), frozenset((k, tuple(v)) for k, v in keys.items()))
        if tag in self.walked:
            return set()
        self.walked.add(tag)
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
        except (OSError, TypeError, SyntaxError):
            return set()
        body = FunctionBody(self, fn, env, keys)
        body.block(tree.body)
        return body.returned


def _plain(value: Any) -> Any:
    """A default as JSON would write it: enums by value, tuples as lists; NO_DEFAULT if the
    value is not JSON (a torch dtype, an object)."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, pydantic.BaseModel):
        return value.model_dump()
    if isinstance(value, tuple):
        value = list(value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list) and all(_plain(v) is v for v in value):
        return value
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return value
    return NO_DEFAULT


def _models_in(annotation: Any) -> list[type]:
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    return [m for arg in getattr(annotation, "__args__", ()) or () for m in _models_in(arg)]


class FunctionBody:
    """One function body: which variables hold which key paths, which hold key names."""

    def __init__(self, walk: KeyWalk, fn: Any, env: dict, keys: dict) -> None:
        self.walk, self.fn = walk, fn
        self.env: dict[str, set] = {k: set(v) for k, v in env.items()}
        self.keyvars: dict[str, list[str]] = dict(keys)
        self.names = dict(getattr(fn, "__globals__", {}))  # module names, plus local imports
        self.returned: set = set()
        self.owner = _owner_class(fn)

    # -- statements --------------------------------------------------------------------------
    def block(self, stmts: list[ast.stmt]) -> None:
        for s in stmts:
            self.stmt(s)

    def stmt(self, s: ast.stmt) -> None:
        if isinstance(s, ast.ImportFrom | ast.Import):
            self.local_import(s)
        elif isinstance(s, ast.Assign):
            paths = self.paths(s.value)
            for target in s.targets:
                name = _target_name(target)
                if name is not None and paths:
                    self.env.setdefault(name, set()).update(paths)
        elif isinstance(s, ast.Return):
            if s.value is not None:
                self.returned |= self.paths(s.value)
        elif isinstance(s, ast.For):
            self.paths(s.iter)
            values = self.constants(s.iter)
            target = s.target.elts[0] if isinstance(s.target, ast.Tuple) else s.target
            if values and isinstance(target, ast.Name):
                self.keyvars[target.id] = values
            self.block(s.body + s.orelse)
        else:
            for child in ast.iter_child_nodes(s):
                if isinstance(child, ast.stmt):
                    self.stmt(child)
                elif isinstance(child, ast.expr):
                    self.paths(child)
                elif isinstance(child, ast.ExceptHandler):
                    self.block(child.body)

    def local_import(self, s: ast.ImportFrom | ast.Import) -> None:
        package = getattr(inspect.getmodule(self.fn), "__package__", None)
        try:
            if isinstance(s, ast.Import):
                for alias in s.names:
                    self.names[alias.asname or alias.name] = importlib.import_module(alias.name)
                return
            module = importlib.import_module("." * s.level + (s.module or ""), package)
            for alias in s.names:
                self.names[alias.asname or alias.name] = getattr(module, alias.name)
        except (ImportError, AttributeError):
            pass

    # -- expressions -------------------------------------------------------------------------
    def where(self, node: ast.AST) -> str:
        return f"{self.fn.__module__}.{self.fn.__qualname__}:{getattr(node, 'lineno', '?')}"

    def value(self, node: ast.expr) -> Any:
        """A constant expression's value (a literal or a module constant), else NO_DEFAULT."""
        value = self.constant(node)
        return NO_DEFAULT if value is NO_DEFAULT else _plain(value)

    def constant(self, node: ast.expr) -> Any:
        """What ``node`` names without running DeepSpeed's code: a literal (``ast.literal_eval``),
        a name the function sees (``KEY``), an attribute of one (``consts.KEY``, ``Enum.X``), or a
        tuple, list or dict of those; NO_DEFAULT for any other expression."""
        if isinstance(node, ast.Name):
            return self.names.get(node.id, NO_DEFAULT)
        if isinstance(node, ast.Attribute):
            owner = self.constant(node.value)
            return NO_DEFAULT if owner is NO_DEFAULT else getattr(owner, node.attr, NO_DEFAULT)
        if isinstance(node, ast.Tuple | ast.List):
            items = [self.constant(e) for e in node.elts]
            if NO_DEFAULT in items:
                return NO_DEFAULT
            return tuple(items) if isinstance(node, ast.Tuple) else items
        if isinstance(node, ast.Dict) and None not in node.keys:  # None: a ``**`` entry
            pairs = [
                (self.constant(k), self.constant(v))
                for k, v in zip(node.keys, node.values, strict=True)
            ]
            if any(NO_DEFAULT in pair for pair in pairs):
                return NO_DEFAULT
            return dict(pairs)
        try:
            return ast.literal_eval(node)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return NO_DEFAULT

    def key_names(self, node: ast.expr) -> list[str]:
        if isinstance(node, ast.Name) and node.id in self.keyvars:
            return self.keyvars[node.id]
        value = self.value(node)
        return [value] if isinstance(value, str) else []

    def constants(self, node: ast.expr) -> list[str]:
        """The strings a ``for`` loop over ``node`` may bind (a tuple, a dict's keys)."""
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("items", "keys"):
                node = node.func.value
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return [k for e in node.elts for k in self.key_names(e)]
        value = self.value(node)
        if isinstance(value, dict | list):
            return [k for k in value if isinstance(k, str)]
        return []

    def read(self, bases: set, node: ast.expr, at: ast.AST, default: Any = NO_DEFAULT) -> set:
        """Record ``base + key`` for every base path and every key name ``node`` may be."""
        found = set()
        for base in bases:
            for key in self.key_names(node):
                self.walk.read((*base, key), self.where(at), default)
                found.add((*base, key))
        return found

    def paths(self, node: ast.expr) -> set:
        """The key paths ``node`` may evaluate to (every key read on the way is recorded)."""
        if isinstance(node, ast.Name):
            return set(self.env.get(node.id, ()))
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                return set(self.env.get(f"self.{node.attr}", ()))
            self.paths(node.value)
            return set()
        if isinstance(node, ast.Subscript):
            bases = self.paths(node.value)
            return self.read(bases, node.slice, node) if bases else self.paths(node.slice)
        if isinstance(node, ast.Compare):
            self.paths(node.left)
            for op, right in zip(node.ops, node.comparators, strict=True):
                bases = self.paths(right)
                if isinstance(op, ast.In | ast.NotIn) and bases:
                    self.read(bases, node.left, node)
            return set()
        if isinstance(node, ast.Call):
            return self.call(node)
        if isinstance(node, ast.BoolOp | ast.IfExp):
            children = node.values if isinstance(node, ast.BoolOp) else [node.body, node.orelse]
            if isinstance(node, ast.IfExp):
                self.paths(node.test)
            return set().union(*(self.paths(c) for c in children))
        if isinstance(node, ast.DictComp) and node.generators:
            # {k: d.get(k, ...) for k in (...)}: the dict of those keys of d, as d itself
            generator = node.generators[0]
            if isinstance(generator.target, ast.Name):
                self.keyvars[generator.target.id] = self.constants(generator.iter)
            self.paths(node.value)
            inner = node.value
            if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute):
                return self.paths(inner.func.value)
            return set()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr):
                self.paths(child)
            elif isinstance(child, ast.comprehension):
                self.paths(child.iter)
        return set()

    def call(self, node: ast.Call) -> set:
        f = node.func
        args = [self.paths(a) for a in node.args]
        for keyword in node.keywords:
            self.paths(keyword.value)
        if isinstance(f, ast.Attribute):  # d.get(KEY, DEFAULT), d.keys(), d.copy()
            bases = self.paths(f.value)
            if bases and f.attr in ("get", "pop") and node.args:
                default = self.value(node.args[1]) if len(node.args) > 1 else None
                return self.read(bases, node.args[0], node, default)
            if bases and f.attr in ("keys", "copy"):
                return bases
            if f.attr in ("copy", "deepcopy") and args and args[0]:
                return args[0]
        if isinstance(f, ast.Name) and f.id in READERS and len(node.args) == 3 and args[0]:
            return self.read(args[0], node.args[1], node, self.value(node.args[2]))
        target = self.resolve(f)
        if target is None:
            return set()
        if isinstance(target, type) and issubclass(target, pydantic.BaseModel):
            for keyword in node.keywords:
                if keyword.arg is None:  # Model(**d)
                    for base in self.paths(keyword.value):
                        self.walk.model(target, base)
            return set()
        return self.enter(target, node, args)

    def enter(self, target: Any, node: ast.Call, args: list[set]) -> set:
        """Walk the function (or class ``__init__``) called at ``node`` with what it is given."""
        bound = isinstance(target, type) or isinstance(node.func, ast.Attribute)
        fn = target.__init__ if isinstance(target, type) else target
        try:
            parameters = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            return set()
        if bound and parameters and parameters[0].name == "self":
            parameters = parameters[1:]
        env, keys = {}, {}
        for p in parameters:  # key names given as default values (comm_type=KEY)
            if isinstance(p.default, str):
                keys[p.name] = [p.default]
        for p, given, paths in zip(parameters, node.args, args, strict=False):
            if paths:
                env[p.name] = frozenset(paths)
            elif self.key_names(given):
                keys[p.name] = self.key_names(given)
        for keyword in node.keywords:
            if keyword.arg is not None and self.paths(keyword.value):
                env[keyword.arg] = frozenset(self.paths(keyword.value))
        if not env:
            return set()
        return self.walk.function(fn, env, keys)

    def resolve(self, f: ast.expr) -> Any:
        """The DeepSpeed function or class ``f`` names (``self.method`` included), or None."""
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
            target = getattr(self.owner, f.attr, None) if self.owner is not None else None
        else:
            target = self.constant(f)
        if isinstance(target, types.FunctionType | type):
            if getattr(target, "__module__", "").startswith("deepspeed"):
                return target
        return None


def _owner_class(fn: Any) -> type | None:
    """The class a method belongs to (for ``self.other_method(...)`` calls)."""
    qualname = getattr(fn, "__qualname__", "")
    if "." not in qualname:
        return None
    return getattr(inspect.getmodule(fn), qualname.split(".")[0], None)


def _target_name(target: ast.expr) -> str | None:
    if isinstance(target, ast.Name):
        return target.id
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
        if target.value.id == "self":
            return f"self.{target.attr}"
    return None


def deepspeed_keys() -> dict[Path, Key]:
    """{key path: Key} for every key DeepSpeed 0.19.8's ``DeepSpeedConfig`` and
    ``deepspeed.initialize`` read."""
    import deepspeed
    from deepspeed.runtime import config as ds_config

    walk = KeyWalk()
    root = frozenset({()})
    cls = ds_config.DeepSpeedConfig
    env = {"param_dict": root, "config": root, "self._param_dict": root}
    for name in ("__init__", "_initialize_params", "_do_error_check", "_do_warning_check"):
        walk.function(getattr(cls, name), env, {})
    walk.function(ds_config._reject_removed_config_keys, {"param_dict": root}, {})
    # deepspeed.initialize reads a few keys itself before it builds DeepSpeedConfig (its mesh,
    # AutoTP's mode). Its tp_model_init merge reads tensor_parallel's keys with None for a
    # default, which is not DeepSpeedConfig's: the defaults of the keys DeepSpeedConfig reads
    # stay the ones its readers write.
    config_defaults = {path: key.default for path, key in walk.keys.items()}
    walk.function(deepspeed.initialize, {"config": root}, {})
    for path, default in config_defaults.items():
        walk.keys[path].default = default
    return walk.keys


def dotted(path: Path) -> str:
    return ".".join(path)
