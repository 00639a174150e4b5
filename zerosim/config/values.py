"""The building blocks of the config: its error type, value parsers and the knob declaration.

Every config section is a frozen dataclass whose fields are declared with
``knob(default, parser, doc)``. The generic functions here read those fields from a
JSON-like dict, list the keys nobody declared, and write a section back to a dict, so a
section only declares its keys and its cross-field rules (``config_sections.py``,
``config_optim.py``, ``config.py``).

Parsers are strict where Python is loose: ``True`` is an ``int`` in Python but is rejected
where a number goes; strings are never converted to numbers or booleans. Integral floats
are accepted where integers go, because DeepSpeed configs write sizes as ``5e8``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass
from typing import Any

_REPR_LIMIT = 120


def short_repr(value: Any) -> str:
    """repr() cut to a readable length, for error messages."""
    text = repr(value)
    return text if len(text) <= _REPR_LIMIT else text[: _REPR_LIMIT - 3] + "..."


class ConfigError(ValueError):
    """An invalid config: names the key path, the value received and what is allowed.

    The message reads ``"<path>: got <value>; allowed: <allowed>"``; ``got`` replaces the
    middle part when the problem is not a single value (a file that cannot be read, a
    batch-size product). The parts are kept as attributes ``path``, ``value``, ``allowed``.
    ``ConfigError(message)`` with one argument is also accepted (a complete message that
    already names key, value and what is allowed); its ``value`` and ``allowed`` are None.
    """

    def __init__(
        self, path: str, value: Any = None, allowed: str | None = None, got: str | None = None
    ) -> None:
        self.path = path
        self.value = value
        self.allowed = allowed
        self.got = got
        if allowed is None:
            super().__init__(path)
            return
        got = f"got {short_repr(value)}" if got is None else got
        message = f"{path}: {got}; allowed: {allowed}"
        if isinstance(value, str) and value.lower() == "auto":
            message += " ('auto' is filled in by the HuggingFace integration, not by DeepSpeed)"
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.value, self.allowed, self.got))


def join(path: str, key: Any) -> str:
    """The dotted key path of ``key`` inside the section at ``path`` ('' is the top level)."""
    return f"{path}.{key}" if path else str(key)


@dataclass(frozen=True)
class Parser:
    """Turns the raw value found at a key path into a typed value, or raises ConfigError.

    ``allowed`` is the human description used in error messages and in docs/config.md;
    ``section`` is the dataclass when the value is a nested section.
    """

    allowed: str
    convert: Callable[[Any, str], Any]
    section: type | None = None

    def __call__(self, value: Any, path: str) -> Any:
        return self.convert(value, path)


def is_number(value: Any) -> bool:
    """A real number that is not a bool (``True`` is an int in Python, not a number here)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def as_finite_float(value: Any) -> float | None:
    """The value as a finite float, or None when it is not a real number or not finite."""
    if not is_number(value):
        return None
    try:
        result = float(value)
    except OverflowError:  # an int beyond float range
        return None
    return result if math.isfinite(result) else None


def as_integer(value: Any) -> int | None:
    """The value as an int (integral floats such as 5e8 included), or None."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    result = as_finite_float(value)
    if result is None or result != int(result):
        return None
    return int(result)


def boolean() -> Parser:
    """true or false, nothing else (no 0/1, no strings)."""

    def convert(value: Any, path: str) -> bool:
        if not isinstance(value, bool):
            raise ConfigError(path, value, "true or false")
        return value

    return Parser("true or false", convert)


def integer(minimum: int = 0, maximum: int | None = None) -> Parser:
    """An integer in [minimum, maximum]; integral floats such as 5e8 are converted."""
    if maximum is None:
        allowed = f"an integer >= {minimum}"
    else:
        allowed = f"an integer in [{minimum}, {maximum}]"

    def convert(value: Any, path: str) -> int:
        result = as_integer(value)
        if result is None or result < minimum or (maximum is not None and result > maximum):
            raise ConfigError(path, value, allowed)
        return result

    return Parser(allowed, convert)


def number(
    minimum: float | None = None,
    maximum: float | None = None,
    *,
    above: bool = False,
    below: bool = False,
) -> Parser:
    """A finite real number; ``above``/``below`` make the bounds strict."""
    bounds = []
    if minimum is not None:
        bounds.append(f"{'>' if above else '>='} {minimum}")
    if maximum is not None:
        bounds.append(f"{'<' if below else '<='} {maximum}")
    allowed = "a finite number" + (" " + " and ".join(bounds) if bounds else "")

    def convert(value: Any, path: str) -> float:
        result = as_finite_float(value)
        if result is None:
            raise ConfigError(path, value, allowed)
        low_ok = minimum is None or (result > minimum if above else result >= minimum)
        high_ok = maximum is None or (result < maximum if below else result <= maximum)
        if not (low_ok and high_ok):
            raise ConfigError(path, value, allowed)
        return result

    return Parser(allowed, convert)


def choice(*options: str) -> Parser:
    """One of ``options``, compared case-insensitively, returned in the spelling given here."""
    by_lower = {option.lower(): option for option in options}
    allowed = "one of " + ", ".join(repr(option) for option in options) + " (any case)"

    def convert(value: Any, path: str) -> str:
        if not isinstance(value, str) or value.lower() not in by_lower:
            raise ConfigError(path, value, allowed)
        return by_lower[value.lower()]

    return Parser(allowed, convert)


def text() -> Parser:
    """A non-empty string."""

    def convert(value: Any, path: str) -> str:
        if not isinstance(value, str) or not value:
            raise ConfigError(path, value, "a non-empty string")
        return value

    return Parser("a non-empty string", convert)


def optional(parser: Parser) -> Parser:
    """``parser``, or null (None)."""

    def convert(value: Any, path: str) -> Any:
        return None if value is None else parser(value, path)

    return Parser(f"null or {parser.allowed}", convert, parser.section)


def section(cls: type) -> Parser:
    """A nested JSON object read into the dataclass ``cls`` (which has ``from_dict``)."""
    return Parser("a JSON object (see its keys)", cls.from_dict, cls)


def as_mapping(raw: Any, path: str) -> Mapping[str, Any]:
    """Check that a section is a JSON object with string keys."""
    if not isinstance(raw, Mapping) or not all(isinstance(key, str) for key in raw):
        raise ConfigError(path or "<config>", raw, "a JSON object (dict) with string keys")
    return raw


def knob(default: Any, parser: Parser, doc: str, *, aliases: tuple[str, ...] = ()) -> Any:
    """Declare a config key: dataclass field named as the JSON key, its default and parser.

    ``aliases`` are other JSON names DeepSpeed accepts for the same key.
    """
    return field(default=default, metadata={"parser": parser, "doc": doc, "aliases": aliases})


def knob_fields(cls: type) -> list[Field]:
    """The fields of ``cls`` that are JSON keys (declared with ``knob``), in order."""
    return [f for f in fields(cls) if "parser" in f.metadata]


def known_keys(cls: type) -> set[str]:
    """Every JSON key ``cls`` reads: field names, their aliases and legacy keys."""
    keys = set(getattr(cls, "LEGACY_KEYS", ()))
    for f in knob_fields(cls):
        keys.add(f.name)
        keys.update(f.metadata["aliases"])
    return keys


def read_knobs(cls: type, raw: Mapping[str, Any], path: str) -> dict[str, Any]:
    """Parse each knob of ``cls`` from ``raw``; absent or null keys take the field default.

    A key given under two of its names (name and alias) is a ConfigError.
    """
    values: dict[str, Any] = {}
    for f in knob_fields(cls):
        given = [name for name in (f.name, *f.metadata["aliases"]) if name in raw]
        if len(given) > 1:
            raise ConfigError(
                join(path, given[1]), raw[given[1]], f"only one of {given} (they are one key)"
            )
        if given and raw[given[0]] is not None:
            values[f.name] = f.metadata["parser"](raw[given[0]], join(path, given[0]))
        else:
            values[f.name] = f.default if f.default is not MISSING else None
    return values


def find_unknown_keys(cls: type, raw: Any, path: str) -> list[str]:
    """Key paths in ``raw`` that ``cls`` (and its nested sections) does not read.

    Tolerates values of the wrong type: this runs before validation, so that the warning
    about a misspelled key appears even when the config is then rejected.
    """
    if not isinstance(raw, Mapping):
        return []
    keys = known_keys(cls)
    unknown = [join(path, key) for key in raw if key not in keys]
    for f in knob_fields(cls):
        nested = f.metadata["parser"].section
        if nested is None:
            continue
        for name in (f.name, *f.metadata["aliases"]):
            if isinstance(name, str) and name in raw:
                unknown += find_unknown_keys(nested, raw[name], join(path, name))
    return unknown


def known_key_paths(cls: type, path: str = "") -> list[str]:
    """Every key path ``cls`` reads, nested sections included (for suggestions and docs)."""
    paths = []
    for key in sorted(known_keys(cls)):
        paths.append(join(path, key))
    for f in knob_fields(cls):
        nested = f.metadata["parser"].section
        if nested is not None:
            paths += known_key_paths(nested, join(path, f.name))
    return paths


def to_plain(value: Any) -> Any:
    """A JSON-ready copy: sections to dicts, tuples to lists, read-only mappings to dicts."""
    if is_dataclass(value) and not isinstance(value, type):
        return value.to_dict()
    if isinstance(value, Mapping):
        return {key: to_plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [to_plain(item) for item in value]
    return value


def knobs_to_dict(obj: Any) -> dict[str, Any]:
    """The JSON keys of a section with their values; None (= not set) is left out."""
    return {
        f.name: to_plain(getattr(obj, f.name))
        for f in knob_fields(type(obj))
        if getattr(obj, f.name) is not None
    }


class Section:
    """Mixin for frozen-dataclass config sections: ``from_dict`` and ``to_dict``.

    Subclasses may override ``normalize`` (rewrite legacy keys before parsing) and
    ``finish`` (resolve defaults that depend on other keys, check cross-key rules).
    """

    @classmethod
    def from_dict(cls, raw: Any, path: str) -> Any:
        raw = cls.normalize(as_mapping(raw, path), path)
        values = cls.finish(read_knobs(cls, raw, path), raw, path)
        return cls(**values)

    @classmethod
    def normalize(cls, raw: Mapping[str, Any], path: str) -> Mapping[str, Any]:
        return raw

    @classmethod
    def finish(cls, values: dict[str, Any], raw: Mapping[str, Any], path: str) -> dict[str, Any]:
        return values

    def to_dict(self) -> dict[str, Any]:
        return knobs_to_dict(self)
