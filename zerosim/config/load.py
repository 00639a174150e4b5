"""The load pipeline: DeepSpeed's JSON config read into a ``Config`` and validated before anything
is built.

``load_config(config, world_size)`` is a pure function: the engine calls it first on every
rank, so every rank raises the same ``ConfigError`` before any buffer or communicator is
touched. Key names and defaults are DeepSpeed 0.19.8's (deepspeed/runtime/config.py,
constants.py, zero/config.py), and so is the decision to accept or reject: the tests hold
``load_config`` + ``initialize`` to DeepSpeed's own parser on a corpus of configs, and list
every case where zerosim is stricter, with the reason (tests/test_deepspeed_config.py). The
rules across sections are in ``rules.py``.

The batch triple follows DeepSpeed's ``_set_batch_related_parameters``: with world size N,

    train_batch_size == train_micro_batch_size_per_gpu × gradient_accumulation_steps × N

and a missing member is inferred with floor division in DeepSpeed's order (so a product that
does not divide is caught by the equality check, with the numbers in the message).
"""

from __future__ import annotations

import difflib
import json
import numbers
import os
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

from zerosim.config.rules import check_consistency, check_data_parallel_size, check_sum_scaling
from zerosim.config.top_level import Config
from zerosim.config.values import (
    as_mapping,
    find_unknown_keys,
    inert_keys_given,
    knob_fields,
    known_key_paths,
    read_knobs,
    to_plain,
)
from zerosim.errors import ConfigError

# Top-level sections DeepSpeed 0.19.8 removed (runtime/config.py _REMOVED_TOP_LEVEL_CONFIG_KEYS):
# it raises DeepSpeedConfigError when one is present, so zerosim does too.
REMOVED_TOP_LEVEL_KEYS = (
    "amp",
    "compression_training",
    "curriculum_learning",
    "eigenvalue",
    "elasticity",
    "graph_harvesting",
    "nebula",
    "progressive_layer_drop",
    "quantize_training",
    "sparse_attention",
    "sparse_gradients",
)


def resolve_batch_size(
    train: int | None, micro: int | None, accumulation: int | None, world_size: int
) -> tuple[int, int, int]:
    """DeepSpeed's batch-triple inference and check → (train, micro, accumulation).

    Given two or three members, the missing one is inferred (floor division); given only
    train_batch_size or only the micro-batch, accumulation is 1. Then every member must be
    >= 1 and train == micro × accumulation × world_size.
    """
    inferred = ""  # "<key> inferred as <formula>", for the messages
    if train is not None and micro is not None and accumulation is None:
        accumulation = train // micro // world_size
        inferred = (
            f"gradient_accumulation_steps inferred as train_batch_size {train} // "
            f"train_micro_batch_size_per_gpu {micro} // world_size {world_size}"
        )
    elif train is not None and micro is None:
        accumulation = 1 if accumulation is None else accumulation
        micro = train // world_size // accumulation
        inferred = (
            f"train_micro_batch_size_per_gpu inferred as train_batch_size {train} // "
            f"world_size {world_size} // gradient_accumulation_steps {accumulation}"
        )
    elif train is None and micro is not None:
        accumulation = 1 if accumulation is None else accumulation
        train = micro * accumulation * world_size
    elif train is None:
        raise ConfigError(
            "train_batch_size",
            None,
            "train_batch_size or train_micro_batch_size_per_gpu, or both "
            "(gradient_accumulation_steps alone does not fix the batch)",
            got="neither train_batch_size nor train_micro_batch_size_per_gpu is given",
        )
    for key, value in (
        ("gradient_accumulation_steps", accumulation),
        ("train_micro_batch_size_per_gpu", micro),
    ):
        if value < 1:
            raise ConfigError(key, value, "an integer >= 1", got=f"got {value} ({inferred})")
    product = micro * accumulation * world_size
    if train != product:
        raise ConfigError(
            "train_batch_size",
            train,
            "train_micro_batch_size_per_gpu × gradient_accumulation_steps × world_size = "
            f"{micro} × {accumulation} × {world_size} = {product}"
            + (f" ({inferred})" if inferred else ""),
        )
    return train, micro, accumulation


def read_config_file(path: str | os.PathLike) -> Any:
    """The object in a config file, read as DeepSpeed reads one (runtime/config.py:
    ``hjson.load(f, object_pairs_hook=dict_raise_error_on_duplicate_keys)``): JSON, or hjson
    (comments, quoteless keys and strings, optional commas), a repeated key refused. Every
    problem is a ConfigError naming the file. hjson reads ``1.0`` and ``5e8`` as integers, as
    DeepSpeed sees them. A JSON file with NaN or Infinity reads as it would pretty-printed,
    whatever its line breaks (``_json_with_constants``)."""
    import hjson  # DeepSpeed's reader; pure Python, imported only when a file is read

    name = os.fspath(path)
    allowed = "a readable JSON or hjson file holding one object without repeated keys"

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [key for key, _ in pairs]
        repeated = sorted({key for key in keys if keys.count(key) > 1})
        if repeated:
            raise ConfigError(name, repeated, allowed, got=f"repeated keys {repeated}")
        return dict(pairs)

    try:
        content = Path(name).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        why = err.strerror if isinstance(err, OSError) and err.strerror else err
        raise ConfigError(name, name, allowed, got=f"cannot read the file ({why})") from err
    try:
        return hjson.loads(content, object_pairs_hook=no_duplicates)
    except ConfigError:
        raise
    except hjson.HjsonDecodeError as err:
        try:  # JSON with NaN or Infinity on one line (``_json_with_constants``)
            return _json_with_constants(content, no_duplicates)
        except ConfigError:
            raise
        except (ValueError, OverflowError, RecursionError):
            pass  # not JSON either: hjson's message says where
        got = f"neither JSON nor hjson ({err.msg} at line {err.lineno} column {err.colno})"
        raise ConfigError(name, name, allowed, got=got) from err
    except (ValueError, OverflowError, RecursionError) as err:  # 1e400, nesting too deep
        got = f"not readable as hjson ({type(err).__name__}: {err})"
        raise ConfigError(name, name, allowed, got=got) from err


def _json_with_constants(content: str, object_pairs_hook: Any) -> Any:
    """JSON with NaN, Infinity or -Infinity (Python's json reads them), as hjson reads a file
    that has each on a line of its own: the constant as the string hjson's quoteless value
    gives ('NaN'), the numbers as hjson gives them (5e8 an int), so the key's own check names
    it. On one line hjson cannot read such a file: its quoteless NaN runs to the end of the line
    and takes the closing brackets with it."""
    import hjson

    return json.loads(
        content, object_pairs_hook=object_pairs_hook, parse_constant=str, parse_float=hjson.loads
    )


def _suggest(key: str) -> str:
    close = difflib.get_close_matches(key, known_key_paths(Config), n=1, cutoff=0.8)
    return f"{key} (did you mean {close[0]}?)" if close else key


def _closest(key: str) -> str:
    close = difflib.get_close_matches(key, known_key_paths(Config), n=1, cutoff=0.8)
    return f"did you mean {close[0]}? " if close else ""


def _check_unknown(unknown: list[tuple[str, bool, str, Any]], raw: dict) -> None:
    """Warn once about unknown keys in open sections (DeepSpeed ignores them), then reject the
    first unknown key of a closed section (DeepSpeed's pydantic models forbid extra keys)."""
    ignored = [path for path, closed, _, _ in unknown if not closed]
    if ignored:
        warnings.warn(
            f"zerosim ignores {len(ignored)} unknown config key(s): "
            f"{', '.join(_suggest(key) for key in ignored)} "
            "(docs/config.md lists the keys it reads)",
            UserWarning,
            stacklevel=3,
        )
    for path, closed, parent, name in unknown:
        if closed:
            node: object = raw
            for part in parent.split(".") if parent else ():  # a key may have dots; sections not
                node = node[part]  # type: ignore[index]
            value = node[name]  # type: ignore[index]
            cls = _section_class(parent)
            keys = sorted(f.name for f in knob_fields(cls))
            raise ConfigError(
                path,
                value,
                f"{_closest(path)}a key of {parent}: {keys} (DeepSpeed forbids unknown keys "
                "in this section)",
            )


def _section_class(path: str) -> type:
    """The section dataclass at a dotted key path (aliases allowed)."""
    cls: type = Config
    for part in path.split("."):
        for f in knob_fields(cls):
            if part in (f.name, *f.metadata["aliases"]):
                cls = f.metadata["parser"].section
                break
    return cls


# The one table of what parses but the engine refuses: (key, value of cfg, when it applies,
# why). Keys that parse and are only ignored are declared ``inert`` in their section instead
# (warned about at load, ``_check_inert``).
def _unbuilt(cfg: Config) -> list[tuple[str, Any, bool, str]]:
    zero = cfg.zero_optimization
    return [
        (
            "communication_data_type",
            cfg.communication_data_type,
            cfg.communication_data_type is not None and zero.zero_quantized_gradients,
            "use null with zero_quantized_gradients (qgZ sends its own int4 codes)",
        ),
    ]


def _check_inert(cfg: Config, raw: dict) -> None:
    """One UserWarning for each DeepSpeed key written with a value zerosim does not act on;
    a ConfigError for one that would change the numbers (``refuse``)."""
    for key, value, allowed, why, refuse in inert_keys_given(Config, raw, cfg, ""):
        value = to_plain(value)
        if refuse:
            raise ConfigError(key, value, f"{allowed} ({why})")
        warnings.warn(f"{key}={json.dumps(value)} is ignored: {why}", UserWarning, stacklevel=3)


def reject_unbuilt(cfg: Config) -> None:
    """Raise ConfigError for a value that parses but that the engine does not implement."""
    for key, value, applies, why in _unbuilt(cfg):
        if applies:
            raise ConfigError(f"{key} = {value!r} is not supported by this engine; {why}")


def load_config(config: dict | str | os.PathLike | Config, world_size: int) -> Config:
    """Read and validate a DeepSpeed config (a dict, or a path to a JSON or hjson file, read by
    ``read_config_file``) for ``world_size``.

    Unknown keys produce one UserWarning listing their key paths, except inside the sections
    DeepSpeed validates strictly (zero_optimization, its offload sections, fp16, bf16), where
    they are a ConfigError as in DeepSpeed; so is any invalid value or contradiction. A
    DeepSpeed key zerosim reads but does not act on is warned about when written with a value
    that would matter. Pure: no communicator, no state.
    """
    valid = isinstance(world_size, numbers.Integral) and not isinstance(world_size, bool)
    if not valid or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    world_size = int(world_size)
    if isinstance(config, Config):
        config = config.to_dict()
    elif isinstance(config, str | os.PathLike):
        config = read_config_file(config)
    raw = as_mapping(config, "")
    for key in REMOVED_TOP_LEVEL_KEYS:
        if key in raw:
            raise ConfigError(key, raw[key], "nothing: DeepSpeed 0.19.8 removed this section")
    if raw.get("bfloat16", False) is None and raw.get("bf16") is None:
        raise ConfigError("bfloat16", None, "a JSON object (DeepSpeed fails on null here)")
    _check_unknown(find_unknown_keys(Config, raw, ""), raw)
    values = read_knobs(Config, raw, "")
    batch = resolve_batch_size(
        values["train_batch_size"],
        values["train_micro_batch_size_per_gpu"],
        values["gradient_accumulation_steps"],
        world_size,
    )
    values.update(
        zip(
            ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"),
            batch,
            strict=True,
        )
    )
    cfg = Config(world_size=world_size, **values)
    check_consistency(cfg)
    _check_inert(cfg, raw)
    check_data_parallel_size(cfg, raw)
    check_sum_scaling(cfg)
    zero = cfg.zero_optimization
    hpz = min(zero.zero_hpz_partition_size, world_size)  # DeepSpeed's effective size
    if hpz != zero.zero_hpz_partition_size:
        cfg = replace(cfg, zero_optimization=replace(zero, zero_hpz_partition_size=hpz))
    return cfg
