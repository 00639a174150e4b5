"""The building blocks of the config: value parsers and the knob declaration (the error type,
``ConfigError``, is in ``zerosim/errors.py``: the strategies below the config raise it too).

Every config section is a frozen dataclass whose fields are declared with
``knob(default, parser, doc)``. The generic functions here read those fields from a
JSON-like dict, list the keys nobody declared, and write a section back to a dict, so a
section only declares its keys and its cross-field rules (``config_sections.py``,
``config_optim.py``, ``config.py``).

Two families of parsers, because DeepSpeed reads its config in two ways:

- the sections DeepSpeed validates with pydantic models (``zero_optimization``, its offload
  sections, ``fp16``, ``bf16``) are read the way pydantic's lax mode reads them
  (``lax_boolean``, ``lax_integer``): ``"true"``, ``"yes"``, ``1`` are booleans there, ``"2"``
  is an integer, and anything pydantic rejects is rejected;
- the keys DeepSpeed takes with a plain ``dict.get`` (the top level, ``checkpoint``,
  ``optimizer``, ``scheduler``) and zerosim's own section are read strictly: ``True`` is not a
  number, strings are never converted. DeepSpeed accepts such values unread and fails or
  misreads them later (``"false"`` is a true flag to Python); zerosim rejects them up front.

Integral floats are accepted where integers go everywhere, because DeepSpeed configs write
sizes as ``5e8``.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass
from types import MappingProxyType
from typing import Any

from zerosim.errors import ConfigError


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


def choice(*options: str, any_case: bool = True) -> Parser:
    """One of ``options``, returned in the spelling given here; compared case-insensitively
    unless ``any_case`` is False (DeepSpeed's pydantic enums match exactly)."""
    fold = str.lower if any_case else str
    by_key = {fold(option): option for option in options}
    allowed = "one of " + ", ".join(repr(option) for option in options)
    allowed += " (any case)" if any_case else " (exactly as written here)"

    def convert(value: Any, path: str) -> str:
        if not isinstance(value, str) or fold(value) not in by_key:
            raise ConfigError(path, value, allowed)
        return by_key[fold(value)]

    return Parser(allowed, convert)


def flag() -> Parser:
    """A top-level switch DeepSpeed reads with ``dict.get``: true/false, or 0/1."""

    def convert(value: Any, path: str) -> bool:
        if isinstance(value, bool):
            return value
        if as_integer(value) in (0, 1):
            return bool(as_integer(value))
        raise ConfigError(path, value, "true or false (or 0 / 1)")

    return Parser("true or false (or 0 / 1)", convert)


# --- pydantic's lax mode, for the sections DeepSpeed validates with pydantic models ----------

_TRUE_TEXT = ("true", "yes", "on", "t", "y", "1")
_FALSE_TEXT = ("false", "no", "off", "f", "n", "0")
_INT_TEXT = re.compile(r"\s*[+-]?\d+(?:_\d+)*(?:\.0+)?\s*")


def lax_boolean() -> Parser:
    """A bool as pydantic's lax mode reads it: true/false, 0/1 (int or float), or the strings
    true/false, yes/no, on/off, t/f, y/n, 1/0 in any case."""
    allowed = "true or false (also 0/1, 'true'/'false', 'yes'/'no', 'on'/'off', as DeepSpeed)"

    def convert(value: Any, path: str) -> bool:
        if isinstance(value, bool):
            return value
        if is_number(value) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.lower() in _TRUE_TEXT + _FALSE_TEXT:
            return value.lower() in _TRUE_TEXT
        raise ConfigError(path, value, allowed)

    return Parser(allowed, convert)


def lax_integer(
    minimum: int | None = None, maximum: int | None = None, *, from_bool: bool = True
) -> Parser:
    """An int as pydantic's lax mode reads it, in [minimum, maximum]: ints, integral floats,
    decimal strings ('2', ' 2', '1_000', '2.0') and, with ``from_bool``, true/false as 1/0."""
    if minimum is None and maximum is None:
        allowed = "an integer"
    elif maximum is None:
        allowed = f"an integer >= {minimum}"
    elif minimum is None:
        allowed = f"an integer <= {maximum}"
    else:
        allowed = f"an integer in [{minimum}, {maximum}]"

    def convert(value: Any, path: str) -> int:
        result = None
        if isinstance(value, bool):
            result = int(value) if from_bool else None
        elif isinstance(value, str):
            if _INT_TEXT.fullmatch(value):
                result = int(value.strip().split(".")[0])
        else:
            result = as_integer(value)
        in_range = result is not None and (minimum is None or result >= minimum)
        if not in_range or (maximum is not None and result > maximum):
            raise ConfigError(path, value, allowed)
        return result

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


def knob(
    default: Any,
    parser: Parser,
    doc: str,
    *,
    aliases: tuple[str, ...] = (),
    null: str | None = None,
    inert: str | None = None,
    reproduces: tuple[Any, ...] | Callable[[Any], bool] = (),
    reproduces_text: str | None = None,
    refuse: bool = False,
) -> Any:
    """Declare a config key: dataclass field named as the JSON key, its default and parser.

    ``aliases`` are other JSON names DeepSpeed accepts for the same key. ``null`` is None when
    JSON null means "not given" (the default applies); otherwise it says why DeepSpeed cannot
    take null there, and null is an error. ``inert`` marks a DeepSpeed key that zerosim reads
    but does not act on, saying why; writing it with a value outside ``reproduces`` (the values
    whose DeepSpeed behaviour zerosim has anyway, or a predicate saying so of a value) is warned
    about at load, or rejected with ``refuse`` (DeepSpeed would compute something zerosim does
    not build). ``reproduces_text`` says in words what a predicate ``reproduces`` allows (the
    message of a refused value names it; a tuple is written out as JSON).
    """
    metadata = {
        "parser": parser,
        "doc": doc,
        "aliases": aliases,
        "null": null,
        "inert": inert,
        "reproduces": reproduces,
        "reproduces text": reproduces_text,
        "refuse": refuse,
    }
    return field(default=default, metadata=metadata)


def whole_section(
    doc: str,
    on: Callable[[Any], bool],
    why: str,
    *,
    refuse: bool,
    objects_only: bool = True,
    null: str | None = "DeepSpeed reads keys of it and fails on null",
    off: str | None = None,
) -> Any:
    """A DeepSpeed section zerosim reads as a whole: a JSON object, kept read-only (any JSON
    value without ``objects_only``); ``on(value)`` says whether DeepSpeed would act on it, and
    then the section is refused or warned about; ``off`` says in words what ``on`` is false for.
    Absent: not given; null as ``null`` says (see ``knob``)."""
    allowed = "a JSON object" if objects_only else "any JSON value"

    def convert(value: Any, path: str) -> Any:
        if not objects_only and not isinstance(value, Mapping):
            return value
        return MappingProxyType(dict(as_mapping(value, path)))

    return knob(
        None,
        Parser(allowed, convert),
        doc,
        inert=why,
        reproduces=lambda value: not on(value),
        reproduces_text=off,
        refuse=refuse,
        null=null,
    )


def knob_fields(cls: type) -> list[Field]:
    """The fields of ``cls`` that are JSON keys (declared with ``knob``), in order."""
    return [f for f in fields(cls) if "parser" in f.metadata]


def known_keys(cls: type) -> set[str]:
    """Every JSON key ``cls`` reads: field names, their aliases, legacy and removed keys."""
    keys = set(getattr(cls, "LEGACY_KEYS", ())) | set(getattr(cls, "REMOVED_KEYS", ()))
    for f in knob_fields(cls):
        keys.add(f.name)
        keys.update(f.metadata["aliases"])
    return keys


def read_knobs(cls: type, raw: Mapping[str, Any], path: str) -> dict[str, Any]:
    """Parse each knob of ``cls`` from ``raw``; absent keys take the field default, and so do
    null ones unless the knob says null is an error.

    A key given under two of its names (name and alias) is a ConfigError.
    """
    values: dict[str, Any] = {}
    for f in knob_fields(cls):
        given = [name for name in (f.name, *f.metadata["aliases"]) if name in raw]
        if len(given) > 1:
            raise ConfigError(
                join(path, given[1]), raw[given[1]], f"only one of {given} (they are one key)"
            )
        if given and raw[given[0]] is None and f.metadata["null"] is not None:
            parser = f.metadata["parser"]
            allowed = f"{parser.allowed} (not null: {f.metadata['null']})"
            raise ConfigError(join(path, given[0]), None, allowed)
        if given and raw[given[0]] is not None:
            values[f.name] = f.metadata["parser"](raw[given[0]], join(path, given[0]))
        else:
            values[f.name] = f.default if f.default is not MISSING else None
    return values


def find_unknown_keys(cls: type, raw: Any, path: str) -> list[tuple[str, bool, str, Any]]:
    """(key path, closed, section path, key) for each key in ``raw`` that ``cls`` (and its
    nested sections) does not read; ``closed`` when the section forbids unknown keys
    (``CLOSED``: DeepSpeed's pydantic models reject extra keys, so zerosim does too). The
    section's path and the key as written come apart too: a key may itself contain dots.

    Tolerates values of the wrong type: this runs before validation, so that the warning
    about a misspelled key appears even when the config is then rejected.
    """
    if not isinstance(raw, Mapping):
        return []
    keys = known_keys(cls)
    closed = getattr(cls, "CLOSED", False)
    unknown = [(join(path, key), closed, path, key) for key in raw if key not in keys]
    for f in knob_fields(cls):
        nested = f.metadata["parser"].section
        if nested is None:
            continue
        for name in (f.name, *f.metadata["aliases"]):
            if isinstance(name, str) and name in raw:
                unknown += find_unknown_keys(nested, raw[name], join(path, name))
    return unknown


def inert_keys_given(
    cls: type, raw: Any, obj: Any, path: str
) -> list[tuple[str, Any, str, str, bool]]:
    """(key path as written, value, the values zerosim reproduces in words, why, refuse) for each
    inert knob written in ``raw`` with a value whose DeepSpeed behaviour zerosim does not have
    (see ``knob``); ``obj`` is the parsed section."""
    if not isinstance(raw, Mapping) or obj is None:
        return []
    found = []
    for f in knob_fields(cls):
        for name in (f.name, *f.metadata["aliases"]):
            if name not in raw or raw[name] is None:
                continue
            value = getattr(obj, f.name)
            nested = f.metadata["parser"].section
            if nested is not None:
                found += inert_keys_given(nested, raw[name], value, join(path, name))
            elif f.metadata["inert"] is not None and not reproduced(f, value):
                meta = f.metadata
                found.append(
                    (join(path, name), value, reproduced_text(f), meta["inert"], meta["refuse"])
                )
    return found


def reproduced(f: Field, value: Any) -> bool:
    """Whether zerosim has DeepSpeed's behaviour for inert knob ``f`` at ``value``: its
    ``reproduces`` is a tuple of such values, or a predicate of the value."""
    rule = f.metadata["reproduces"]
    return rule(value) if callable(rule) else value in rule


def reproduced_text(f: Field) -> str:
    """In words, the values of inert knob ``f`` whose DeepSpeed behaviour zerosim has."""
    text, rule = f.metadata["reproduces text"], f.metadata["reproduces"]
    if text is not None:
        return text
    if callable(rule):
        return "any value" if rule is any_value else "a value DeepSpeed does not act on"
    return " or ".join(json.dumps(to_plain(v)) for v in rule) or "none (leave it out)"


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
    """The JSON keys of a section with their values; None (= not set) is left out, and so are
    an inert key at its default and a nested section left empty (writing them back would say
    nothing or only add a warning)."""
    result = {}
    for f in knob_fields(type(obj)):
        value = getattr(obj, f.name)
        if value is None or (f.metadata["inert"] is not None and value == f.default):
            continue
        plain = to_plain(value)
        if f.metadata["parser"].section is not None and plain == {}:
            continue
        result[f.name] = plain
    return result


def any_value(value: Any) -> bool:
    """``reproduces`` of an inert key whose every value has DeepSpeed's behaviour here (a key
    DeepSpeed reads only once a feature zerosim warns about or refuses is on)."""
    return True


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
