"""Tests for zerosim.config: DeepSpeed's JSON config read into typed objects, validated up front."""

from __future__ import annotations

import itertools
import json
import pickle
import re
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st

from zerosim.config import Config, load_config, read_config_file, resolve_batch_size
from zerosim.config.optimizer import (
    DEEPSPEED_SCHEDULERS,
    HYPERPARAMETERS,
    OPTIMIZER_TYPES,
    PYTHON_ONLY_SCHEDULERS,
    TORCH_SCHEDULERS,
)
from zerosim.config.values import knob_fields, known_key_paths
from zerosim.errors import ConfigError, short_repr

ROOT = Path(__file__).resolve().parent.parent
BATCH = {"train_batch_size": 8}


def load(config: dict, world_size: int = 1) -> Config:
    """load_config that fails the test on any warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return load_config(config, world_size)


def error_for(config: dict, world_size: int = 1) -> ConfigError:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError) as info:
            load_config(config, world_size)
    return info.value


# --- defaults ------------------------------------------------------------------------------

# zerosim's own section; DeepSpeed's keys are compared with DeepSpeed's code at test time in
# tests/test_deepspeed_defaults.py.
ZEROSIM_DEFAULTS = {
    "zerosim.backend": "numpy",
    "zerosim.dtype": "float32",
    "zerosim.collectives": "native",
    "zerosim.layout": "deepspeed",
    "zerosim.ranks_per_node": None,
    "zerosim.validate_collectives": True,
}


def attribute(obj: object, path: str) -> object:
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def test_zerosim_section_defaults():
    config = load(BATCH)
    for path, expected in ZEROSIM_DEFAULTS.items():
        value = attribute(config, path)
        assert value == expected, path
        assert isinstance(value, bool) == isinstance(expected, bool), path


@pytest.mark.parametrize("stage, expected", [(0, False), (1, False), (2, False), (3, True)])
def test_overlap_comm_defaults_to_true_only_at_stage_3(stage, expected):
    assert load(
        {**BATCH, "zero_optimization": {"stage": stage}}
    ).zero_optimization.overlap_comm is (expected)
    explicit = {**BATCH, "zero_optimization": {"stage": stage, "overlap_comm": not expected}}
    assert load(explicit).zero_optimization.overlap_comm is (not expected)


def test_sizes_written_as_floats_become_ints():
    config = load(
        {**BATCH, "zero_optimization": {"reduce_bucket_size": 5e8, "sub_group_size": 1e3}}
    )
    assert config.zero_optimization.reduce_bucket_size == 500_000_000
    assert type(config.zero_optimization.reduce_bucket_size) is int
    assert config.zero_optimization.sub_group_size == 1000


# --- the batch triple ----------------------------------------------------------------------

KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def expected_triple(train, micro, accumulation, world_size):
    """The rule written with exact division: None when the given members admit no triple."""
    if train is None and micro is None:
        return None
    if train is None:
        accumulation = accumulation or 1
        return (micro * accumulation * world_size, micro, accumulation)
    if micro is None:
        accumulation = accumulation or 1
        micro, rest = divmod(train, world_size * accumulation)
        return (train, micro, accumulation) if rest == 0 and micro >= 1 else None
    if accumulation is None:
        accumulation, rest = divmod(train, micro * world_size)
        return (train, micro, accumulation) if rest == 0 and accumulation >= 1 else None
    return (train, micro, accumulation) if train == micro * accumulation * world_size else None


@pytest.mark.parametrize("world_size", [1, 3, 8])
def test_batch_triple_inference_table(world_size):
    values = [1, 2, 3, 4, 6, 8, 12, 24, 48, 72]
    checked = {"ok": 0, "error": 0}
    for present in itertools.product([False, True], repeat=3):
        for triple in itertools.product(values, [1, 2, 3, 4], [1, 2, 3]):
            args = [v if g else None for v, g in zip(triple, present, strict=True)]
            config = {key: v for key, v in zip(KEYS, args, strict=True) if v is not None}
            expected = expected_triple(*args, world_size)
            if expected is None:
                error = error_for(config, world_size)
                assert error.path in KEYS
                checked["error"] += 1
            else:
                got = load(config, world_size)
                assert (
                    got.train_batch_size,
                    got.train_micro_batch_size_per_gpu,
                    got.gradient_accumulation_steps,
                ) == expected
                checked["ok"] += 1
    assert checked["ok"] > 50 and checked["error"] > 50


def test_batch_mismatch_message_shows_the_product():
    error = error_for({KEYS[0]: 10, KEYS[1]: 3, KEYS[2]: 2}, world_size=1)
    assert error.path == "train_batch_size" and error.value == 10
    assert "3 × 2 × 1 = 6" in str(error)


def test_inferred_accumulation_that_does_not_divide_names_the_numbers():
    message = str(error_for({KEYS[0]: 10, KEYS[1]: 3}, world_size=1))
    assert "3 × 3 × 1 = 9" in message and "10 // " in message


def test_train_batch_below_world_size_infers_zero_micro_batch():
    error = error_for({KEYS[0]: 4}, world_size=8)
    assert error.path == "train_micro_batch_size_per_gpu" and error.value == 0


@pytest.mark.parametrize("config", [{}, {"gradient_accumulation_steps": 4}])
def test_batch_size_missing_is_an_error(config):
    error = error_for(config)
    assert "neither train_batch_size nor train_micro_batch_size_per_gpu" in str(error)


def test_resolve_batch_size_is_usable_on_its_own():
    assert resolve_batch_size(None, 2, 3, 4) == (24, 2, 3)


# --- wrong values --------------------------------------------------------------------------

WRONG_VALUES = [
    ("train_batch_size", True),
    ("train_batch_size", "8"),
    ("train_batch_size", 8.5),
    ("train_batch_size", -8),
    ("gradient_clipping", -1.0),
    ("gradient_clipping", float("nan")),
    ("gradient_clipping", "1.0"),
    ("steps_per_print", 0),
    ("gradient_clipping", None),
    ("wall_clock_breakdown", 2),
    ("wall_clock_breakdown", "true"),
    ("wall_clock_breakdown", None),
    ("gradient_predivide_factor", 0),
    ("communication_data_type", "fp8"),
    ("zero_optimization.stage", 4),
    ("zero_optimization.stage", "two"),
    ("zero_optimization.stage", 1.5),
    ("zero_optimization.stage", None),
    ("zero_optimization.reduce_bucket_size", 0),
    ("zero_optimization.reduce_bucket_size", "5e8"),
    ("gradient_clipping", 10**400),
    ("zero_optimization.allgather_bucket_size", -5e8),
    ("zero_optimization.sub_group_size", False),
    ("zero_optimization.stage3_prefetch_bucket_size", -1),
    ("zero_optimization.offload_optimizer.device", "gpu"),
    ("zero_optimization.offload_optimizer.device", "CPU"),
    ("zero_optimization.offload_param.buffer_count", -1),
    ("fp16.enabled", "maybe"),
    ("fp16.enabled", 2),
    ("fp16.loss_scale", -1),
    ("fp16.initial_scale_power", 1024),
    ("fp16.hysteresis", 0),
    ("fp16.min_loss_scale", 0),
    ("fp16.min_loss_scale", 0.5),
    ("fp16.loss_scale_window", "2.0"),
    ("bf16.enabled", "maybe"),
    ("optimizer.type", "sgd"),
    ("optimizer.params.torch_adam", "false"),
    ("checkpoint.tag_validation", "maybe"),
    ("zerosim.backend", "jax"),
    ("zerosim.dtype", "float8"),
    ("zerosim.collectives", "tree"),
    ("zerosim.layout", "fsdp"),
    ("zerosim.ranks_per_node", 0),
    ("zerosim.validate_collectives", "no"),
]

# Read as DeepSpeed's pydantic models read them (lax mode) inside its validated sections.
LAX_VALUES = [
    ("zero_optimization.stage", "2", 2),
    ("zero_optimization.stage", True, 1),
    ("zero_optimization.stage", 2.0, 2),
    ("zero_optimization.reduce_bucket_size", "1_000", 1000),
    ("zero_optimization.overlap_comm", "yes", True),
    ("zero_optimization.contiguous_gradients", 1, True),
    ("fp16.enabled", "off", False),
    ("fp16.loss_scale", "5e8", 5e8),
    ("fp16.initial_scale_power", -1, -1),
    ("bf16.enabled", "TRUE", True),
    ("wall_clock_breakdown", 1, True),
    ("prescale_gradients", 0, False),
]


@pytest.mark.parametrize("path, value, expected", LAX_VALUES)
def test_deepspeeds_pydantic_sections_read_values_as_deepspeed_does(path, value, expected):
    config = load(merged({"train_batch_size": 8}, nest(path, value)))
    got = attribute(config, path)
    assert got == expected and type(got) is type(expected)


def nest(path: str, value: object) -> dict:
    config: dict = {}
    node = config
    *parents, leaf = path.split(".")
    for name in parents:
        node = node.setdefault(name, {})
    node[leaf] = value
    return config


def merged(*parts: dict) -> dict:
    result: dict = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, dict) and isinstance(result.get(key), dict):
                result[key] = merged(result[key], value)
            else:
                result[key] = value
    return result


@pytest.mark.parametrize("path, value", WRONG_VALUES, ids=[f"{p}={v!r}" for p, v in WRONG_VALUES])
def test_wrong_value_is_rejected_naming_key_and_value(path, value):
    base = {"train_batch_size": 8, "zero_optimization": {"stage": 3}}
    if path.startswith("fp16."):  # the scaling keys are checked when fp16 uses them
        base["fp16"] = {"enabled": True}
    if path.startswith("optimizer.params"):
        base["optimizer"] = {"type": "Adam"}
    config = merged(base, nest(path, value))
    error = error_for(config)
    assert error.path == path
    assert str(error).startswith(f"{path}: got {short_repr(value)}; allowed: ")


def test_config_error_is_a_value_error_and_survives_pickling():
    error = error_for({"train_batch_size": "8"})
    assert isinstance(error, ValueError)
    copy = pickle.loads(pickle.dumps(error))
    assert str(copy) == str(error) and copy.path == "train_batch_size"


def test_config_error_also_takes_a_whole_message():
    error = ConfigError("scheduler: both a section and an object were given")
    assert str(error) == "scheduler: both a section and an object were given"
    assert str(pickle.loads(pickle.dumps(error))) == str(error)


def test_auto_values_get_a_hint():
    assert "HuggingFace" in str(error_for({"train_batch_size": "auto"}))


# --- contradictions ------------------------------------------------------------------------

CONTRADICTIONS = [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, 1, "bf16.enabled"),
    (
        {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
        1,
        "zero_optimization.offload_param.device",
    ),
    (
        {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
        1,
        "zero_optimization.offload_optimizer.device",
    ),
    (
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
        1,
        "zero_optimization.offload_optimizer.nvme_path",
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
        1,
        "zero_optimization.offload_param.nvme_path",
    ),
    ({"zerosim": {"layout": "megatron"}}, 1, "zero_optimization.stage"),
    (
        {"zerosim": {"layout": "megatron"}, "zero_optimization": {"stage": 2}},
        1,
        "zero_optimization.stage",
    ),
    (
        {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}},
        8,
        "zero_optimization.zero_hpz_partition_size",
    ),
    (
        {"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}},
        8,
        "zero_optimization.zero_hpz_partition_size",
    ),
    (
        {"zero_optimization": {"stage": 2, "zero_quantized_weights": True}},
        1,
        "zero_optimization.zero_quantized_weights",
    ),
    (
        {"zero_optimization": {"stage": 1, "zero_quantized_gradients": True}},
        1,
        "zero_optimization.zero_quantized_gradients",
    ),
    ({"zerosim": {"ranks_per_node": 3}}, 8, "zerosim.ranks_per_node"),
    ({"zerosim": {"dtype": "float16"}}, 1, "zerosim.dtype"),
    ({"zerosim": {"dtype": "bfloat16"}, "fp16": {"enabled": True}}, 1, "zerosim.dtype"),
    ({"zerosim": {"dtype": "float64"}, "bf16": {"enabled": True}}, 1, "zerosim.dtype"),
    ({"zerosim": {"backend": "cupy"}, "bf16": {"enabled": True}}, 1, "zerosim.backend"),
    ({"zerosim": {"backend": "cupy"}, "communication_data_type": "bf16"}, 1, "zerosim.backend"),
    (
        {
            "zero_optimization": {
                "cpu_offload": True,
                "offload_optimizer": {"device": "cpu"},
                "stage": 2,
            }
        },
        1,
        "zero_optimization.cpu_offload",
    ),
    (
        {"zero_optimization": {"stage3_prefetch_bucket_size": 1, "prefetch_bucket_size": 2}},
        1,
        "zero_optimization.prefetch_bucket_size",
    ),
    ({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, 1, "bfloat16"),
]


@pytest.mark.parametrize("fragment, world_size, path", CONTRADICTIONS)
def test_contradiction_is_rejected_at_the_key_at_fault(fragment, world_size, path):
    config = {"train_micro_batch_size_per_gpu": 1, **fragment}
    assert error_for(config, world_size).path == path


@pytest.mark.parametrize(
    "fragment, world_size",
    [
        ({"zerosim": {"layout": "megatron"}, "zero_optimization": {"stage": 1}}, 4),
        ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}}, 8),
        ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}, 2),
        (
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_param": {"device": "nvme", "nvme_path": "/tmp"},
                }
            },
            2,
        ),
        ({"zerosim": {"dtype": "float16"}, "fp16": {"enabled": True}}, 1),
        ({"zerosim": {"ranks_per_node": 4}}, 8),
    ],
)
def test_neighbouring_valid_combination_is_accepted(fragment, world_size):
    load({"train_micro_batch_size_per_gpu": 1, **fragment}, world_size)


@pytest.mark.parametrize(
    "fragment, model, master, wire",
    [
        ({}, "float32", "float32", "float32"),
        ({"zerosim": {"dtype": "float64"}}, "float64", "float64", "float64"),
        ({"fp16": {"enabled": True}}, "float16", "float32", "float16"),
        (
            {"bf16": {"enabled": True}, "communication_data_type": "FP32"},
            "bfloat16",
            "float32",
            "float32",
        ),
    ],
)
def test_precision_properties(fragment, model, master, wire):
    config = load({**BATCH, **fragment})
    assert (config.model_dtype, config.master_dtype, config.communication_dtype) == (
        model,
        master,
        wire,
    )


# --- legacy spellings ----------------------------------------------------------------------


def test_legacy_spellings_map_to_current_keys():
    config = load(
        {
            **BATCH,
            "bfloat16": {"enabled": True},
            "zero_optimization": {
                "stage": 3,
                "cpu_offload": True,
                "cpu_offload_param": True,
                "cpu_offload_use_pin_memory": True,
                "prefetch_bucket_size": 7,
                "stage3_gather_fp16_weights_on_model_save": True,
            },
        }
    )
    zero = config.zero_optimization
    assert config.bf16.enabled
    assert zero.offload_optimizer.device == "cpu" and zero.offload_param.device == "cpu"
    assert zero.stage3_prefetch_bucket_size == 7
    assert zero.stage3_gather_16bit_weights_on_model_save is True


@pytest.mark.parametrize("flag, stage", [(True, 1), (False, 0)])
def test_zero_optimization_as_bool_is_deepspeeds_legacy_stage_switch(flag, stage):
    assert load({**BATCH, "zero_optimization": flag}).zero_optimization.stage == stage


# --- unknown keys --------------------------------------------------------------------------


def test_unknown_keys_produce_one_warning_listing_every_path():
    config = {
        **BATCH,
        "zero_optimisation": {"stage": 2},
        "zero_optimization": {"stage": 1},
        "zerosim": {"colour": "red"},
        "checkpoint": {"tag_validaton": "FAIL"},
        "optimizer": {"type": "Adam", "param": {}},
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_config(config, 1)
    assert len(caught) == 1 and caught[0].category is UserWarning
    message = str(caught[0].message)
    for path in (
        "zero_optimisation",
        "zerosim.colour",
        "checkpoint.tag_validaton",
        "optimizer.param",
    ):
        assert path in message
    assert "did you mean checkpoint.tag_validation?" in message
    assert loaded.zero_optimization.stage == 1


@pytest.mark.parametrize(
    "config, path",
    [
        ({"zero_optimization": {"stage": 1, "overlap_com": True}}, "zero_optimization.overlap_com"),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "x": 1}}},
            "zero_optimization.offload_optimizer.x",
        ),
        ({"fp16": {"enabled": False, "loss_scal": 0}}, "fp16.loss_scal"),
        ({"bfloat16": {"enabled": True, "master": 1}}, "bfloat16.master"),
        # a key with dots of its own (found by the fuzz test below): still named, not a crash
        ({"bf16": {".": None}}, "bf16.."),
        (
            {"zero_optimization": {"stage": 1, "offload_optimizer.device": "cpu"}},
            "zero_optimization.offload_optimizer.device",
        ),
    ],
)
def test_unknown_keys_in_deepspeeds_validated_sections_are_errors(config, path):
    error = error_for({**BATCH, **config})
    assert error.path == path
    assert "DeepSpeed forbids unknown keys" in str(error)


def test_unknown_key_error_suggests_the_closest_key():
    error = error_for({**BATCH, "zero_optimization": {"stage": 1, "overlap_com": True}})
    assert "did you mean zero_optimization.overlap_comm?" in str(error)


@pytest.mark.parametrize(
    "config, path",
    [
        ({"amp": {"enabled": True}}, "amp"),
        ({"elasticity": {}}, "elasticity"),
        (
            {"zero_optimization": {"stage": 3, "mics_shard_size": 2}},
            "zero_optimization.mics_shard_size",
        ),
    ],
)
def test_keys_deepspeed_removed_are_rejected(config, path):
    error = error_for({**BATCH, **config})
    assert error.path == path and "removed" in str(error)


def test_unknown_keys_are_reported_even_when_the_config_is_then_rejected():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ConfigError):
            load_config({"train_batch_sise": 8}, 1)
    assert "train_batch_sise (did you mean train_batch_size?)" in str(caught[0].message)


INERT = [
    ("zero_optimization.offload_optimizer.pin_memory", True, "page-locking"),
    ("zero_optimization.offload_param.pin_memory", False, "page-locking"),
    ("zero_optimization.offload_param.buffer_count", 5, "memory-maps"),
    ("zero_optimization.offload_param.buffer_size", 10, "memory-maps"),
    ("zero_optimization.offload_param.max_in_cpu", 10, "whole offloaded shard"),
    ("checkpoint.tag_validation", "WARN", "raises if not"),
    ("checkpoint.load_universal", True, "universal checkpoints"),
    ("checkpoint.use_node_local_storage", True, "shared directory"),
]


@pytest.mark.parametrize("path, value, why", INERT)
def test_a_key_without_effect_here_is_warned_about_naming_it_and_why(path, value, why):
    base = {**BATCH, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    base["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(merged(base, nest(path, value)), 1)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert messages[0].startswith(f"{path}={json.dumps(value)} is ignored: ") and why in messages[0]


@pytest.mark.parametrize(
    "path, value",
    [
        ("fp16.fp16_master_weights_and_grads", True),
        ("bf16.bf16_master_weights_and_grads", True),
        ("zero_optimization.zero_quantized_nontrainable_weights", True),
        ("zero_optimization.zenflow", {"topk_ratio": 0.1}),
    ],
)
def test_a_key_that_would_change_the_numbers_but_is_not_built_is_rejected(path, value):
    error = error_for(merged({**BATCH, "zero_optimization": {"stage": 3}}, nest(path, value)))
    assert error.path == path


def test_inert_keys_at_their_default_are_not_written_back_by_to_dict():
    config = load(BATCH)
    text = json.dumps(config.to_dict())
    assert "pin_memory" not in text and "tag_validation" not in text
    assert load(config.to_dict()) == config


@pytest.mark.parametrize(
    "key",
    [
        "reduce_scatter",
        "use_multi_rank_bucket_allreduce",
        "contiguous_gradients",
        "allgather_partitions",
    ],
)
def test_the_switches_that_choose_deepspeeds_collectives_are_read_without_a_warning(key):
    """zerosim.schedule "deepspeed" issues DeepSpeed's collectives for both values (and, like
    DeepSpeed 0.19.8, all-gathers the same way whatever allgather_partitions says)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_config({**BATCH, "zero_optimization": {"stage": 2, key: False}}, 2)
    assert not caught
    assert getattr(loaded.zero_optimization, key) is False


# --- fp16 loss scaler: DeepSpeed's two cases -----------------------------------------------


@pytest.mark.parametrize(
    "fp16, stage, expected",
    [
        # DeepSpeed 0.19.8 hands the scaler every dynamic key, defaults included
        ({}, 1, (True, 2.0**16, 1000, 1.0, 2, False, True)),
        ({}, 3, (True, 2.0**16, 1000, 1.0, 2, False, True)),
        # stage 0: FP16_Optimizer has no hysteresis and never raises at the minimum
        ({}, 0, (True, 2.0**16, 1000, 1.0, 1, False, False)),
        (
            {"hysteresis": 3, "consecutive_hysteresis": True},
            0,
            (True, 2.0**16, 1000, 1.0, 1, False, False),
        ),
        ({"hysteresis": 3}, 2, (True, 2.0**16, 1000, 1.0, 3, False, True)),
        (
            {
                "initial_scale_power": 8,
                "loss_scale_window": 50,
                "min_loss_scale": 2,
                "consecutive_hysteresis": True,
            },
            3,
            (True, 2.0**8, 50, 2.0, 2, True, True),
        ),
        # static
        ({"loss_scale": 128}, 2, (False, 128.0, None, None, None, None, None)),
    ],
)
def test_fp16_loss_scaler_follows_deepspeed(fp16, stage, expected):
    config = load(
        {**BATCH, "fp16": {"enabled": True, **fp16}, "zero_optimization": {"stage": stage}}
    )
    settings_ = config.loss_scaler()
    got = (
        settings_.dynamic,
        settings_.init_scale,
        settings_.scale_window,
        settings_.min_scale,
        settings_.hysteresis,
        settings_.consecutive_hysteresis,
        settings_.raise_error_at_min_scale,
    )
    if not expected[0]:
        got, expected = got[:2], expected[:2]
    assert got == expected
    assert load(config.to_dict()).loss_scaler() == settings_


def test_no_loss_scaler_without_fp16():
    assert load({**BATCH, "bf16": {"enabled": True}}).loss_scaler() is None


# --- optimizer and scheduler ---------------------------------------------------------------


@pytest.mark.parametrize(
    "spelling", ["adamw", "ADAMW", "AdamW", "adagrad", "LION", "SGD", "RMSprop"]
)
def test_optimizer_type_follows_deepspeeds_case_rules(spelling):
    config = load({**BATCH, "optimizer": {"type": spelling}})
    assert config.optimizer.type.lower() == spelling.lower()
    assert config.optimizer.type in OPTIMIZER_TYPES


@pytest.mark.parametrize("spelling", ["sgd", "Sgd", "rmsprop", "nadam", "RADAM", "adamax"])
def test_torch_optimizer_names_must_be_exact_as_in_deepspeed(spelling):
    error = error_for({**BATCH, "optimizer": {"type": spelling}})
    assert error.path == "optimizer.type" and "exactly as written" in str(error)


@pytest.mark.parametrize("kind", ["SGD", "RMSprop", "Adamax", "NAdam", "RAdam"])
def test_untested_optimizer_under_zero_needs_deepspeeds_permission(kind):
    config = {**BATCH, "optimizer": {"type": kind}, "zero_optimization": {"stage": 1}}
    error = error_for(config)
    assert error.path == "optimizer.type" and "zero_allow_untested_optimizer" in str(error)
    assert load({**config, "zero_allow_untested_optimizer": True}).optimizer.type == kind
    assert load({**config, "zero_optimization": {"stage": 0}}).optimizer.type == kind


@pytest.mark.parametrize("kind", ["Adam", "AdamW"])
def test_amsgrad_needs_torch_adam_as_in_deepspeed(kind):
    error = error_for({**BATCH, "optimizer": {"type": kind, "params": {"amsgrad": True}}})
    assert error.path == "optimizer.params.amsgrad"
    params = {"amsgrad": True, "torch_adam": True}
    assert load({**BATCH, "optimizer": {"type": kind, "params": params}}).optimizer.params[
        "amsgrad"
    ]


def test_lion_from_a_config_gets_deepspeeds_defaults():
    optimizer = load({**BATCH, "optimizer": {"type": "Lion"}}).optimizer
    assert optimizer.kwargs() == {"lr": 1e-3, "betas": (0.9, 0.999)}
    params = {"lr": 3e-4, "betas": [0.9, 0.99]}
    assert load({**BATCH, "optimizer": {"type": "Lion", "params": params}}).optimizer.kwargs() == {
        "lr": 3e-4,
        "betas": (0.9, 0.99),
    }


@pytest.mark.parametrize(
    "kind, params, class_name, weight_decay",
    [
        ("Adam", {}, "AdamW", 0.0),  # DeepSpeed's adam_w_mode defaults to true
        ("Adam", {"adam_w_mode": False}, "Adam", 0.0),
        ("AdamW", {"adam_w_mode": False}, "AdamW", 0.0),  # type AdamW is always decoupled
        ("AdamW", {"torch_adam": True}, "AdamW", None),  # torch's own default applies
        ("Adam", {"weight_decay": 0.1}, "AdamW", 0.1),
        ("SGD", {"momentum": 0.9}, "SGD", None),
    ],
)
def test_adam_w_mode_and_torch_adam(kind, params, class_name, weight_decay):
    optimizer = load({**BATCH, "optimizer": {"type": kind, "params": params}}).optimizer
    assert optimizer.class_name == class_name
    kwargs = optimizer.kwargs()
    assert "adam_w_mode" not in kwargs and "torch_adam" not in kwargs
    assert kwargs.get("weight_decay") == weight_decay


def test_unknown_optimizer_hyperparameter_lists_the_known_ones():
    error = error_for({**BATCH, "optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.99]}}})
    assert error.path == "optimizer.params.betas"
    assert "'momentum'" in str(error) and "'nesterov'" in str(error)


def test_max_grad_norm_points_to_gradient_clipping():
    error = error_for({**BATCH, "optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}})
    assert "gradient_clipping" in str(error)


def test_optimizer_and_scheduler_need_a_type():
    assert error_for({**BATCH, "optimizer": {"params": {}}}).path == "optimizer.type"
    assert error_for({**BATCH, "scheduler": {"params": {}}}).path == "scheduler.type"


TORCH_OPTIMIZERS = {  # Lion, Lamb and Muon are DeepSpeed's own, not torch.optim's
    name: getattr(torch.optim, name)
    for name in OPTIMIZER_TYPES
    if name not in ("Lion", "Lamb", "Muon")
}
NUMBERS = st.sampled_from([-1.0, -1e-9, 0.0, 1e-8, 0.5, 0.9, 0.999, 1.0, 3.0])


def hyperparameters(kind: str) -> st.SearchStrategy[dict]:
    values = {
        name: (
            st.tuples(NUMBERS, NUMBERS)
            if name == "betas"
            else st.booleans()
            if name in ("amsgrad", "maximize", "nesterov", "centered", "decoupled_weight_decay")
            else NUMBERS
        )
        for name in HYPERPARAMETERS[kind]
        if name not in ("adam_w_mode", "torch_adam")
    }
    return st.fixed_dictionaries({}, optional=values)


@pytest.mark.parametrize("kind", sorted(TORCH_OPTIMIZERS))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_hyperparameter_checks_agree_with_torch_optim(kind, data):
    params = data.draw(hyperparameters(kind))
    try:
        TORCH_OPTIMIZERS[kind]([torch.zeros(2, requires_grad=True)], **params)
        torch_accepts = True
    except ValueError:
        torch_accepts = False
    config = {**BATCH, "optimizer": {"type": kind, "params": {**params}}}
    if kind in ("Adam", "AdamW"):  # torch's classes: what DeepSpeed builds with torch_adam
        config["optimizer"]["params"]["torch_adam"] = True
    if "betas" in params:
        config["optimizer"]["params"]["betas"] = list(params["betas"])
    try:
        load(config)
        ours = True
    except ConfigError as error:
        assert error.path.startswith("optimizer.params.")
        ours = False
    assert ours == torch_accepts, params


def test_scheduler_names_are_deepspeeds_and_torchs_written_exactly():
    for name in TORCH_SCHEDULERS + PYTHON_ONLY_SCHEDULERS:
        assert hasattr(torch.optim.lr_scheduler, name), name
    for name in DEEPSPEED_SCHEDULERS + TORCH_SCHEDULERS:
        assert load({**BATCH, "scheduler": {"type": name, "params": {}}}).scheduler.type == name
        error = error_for({**BATCH, "scheduler": {"type": name.upper(), "params": {}}})
        assert error.path == "scheduler.type"


def test_every_torch_scheduler_name_accepted_is_buildable():
    from zerosim.optim.lr_scheduler import BUILDABLE

    assert set(TORCH_SCHEDULERS) <= {cls.__name__ for cls in BUILDABLE}


@pytest.mark.parametrize(
    "config", [{}, {"bf16": {"enabled": True}}, {"zero_optimization": {"stage": 1}}]
)
def test_torch_scheduler_only_where_deepspeed_can_build_one(config):
    scheduler = {"type": "StepLR", "params": {"step_size": 2}}
    if not config:
        assert load({**BATCH, "scheduler": scheduler}).scheduler.type == "StepLR"
        return
    error = error_for({**BATCH, **config, "scheduler": scheduler})
    assert error.path == "scheduler.type" and "not a torch.optim.Optimizer" in str(error)


def test_scheduler_needs_params_as_in_deepspeed():
    for section in ({"type": "WarmupLR"}, {"type": "WarmupLR", "params": None}):
        assert error_for({**BATCH, "scheduler": section}).path == "scheduler.params"


@pytest.mark.parametrize(
    "fragment, path",
    [
        ({"prescale_gradients": True, "zero_optimization": {"stage": 2}}, "prescale_gradients"),
        (
            {"gradient_predivide_factor": 2.0, "zero_optimization": {"stage": 3}},
            "gradient_predivide_factor",
        ),
        (
            {
                "gradient_clipping": 1.0,
                "zero_optimization": {"stage": 2, "compute_grad_norm": False},
            },
            "zero_optimization.compute_grad_norm",
        ),
        (
            {"zero_optimization": {"stage": 3, "compute_grad_norm": False}},
            "zero_optimization.compute_grad_norm",
        ),
        (
            {
                "zero_optimization": {
                    "stage": 2,
                    "offload_optimizer": {"device": "cpu", "ratio": 0.5},
                }
            },
            "zero_optimization.offload_optimizer.ratio",
        ),
    ],
)
def test_deepspeeds_engine_rules(fragment, path):
    assert error_for({**BATCH, **fragment}).path == path


def test_prescale_at_stage_2_is_accepted_without_reduce_scatter_as_in_deepspeed():
    config = {**BATCH, "prescale_gradients": True, "gradient_predivide_factor": 2.0}
    config["zero_optimization"] = {"stage": 2, "reduce_scatter": False}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert load_config(config, 2).prescale_gradients


@pytest.mark.parametrize("written, read", [(None, "mean"), ("mean", "mean"), ("SUM", "sum")])
def test_gradient_allreduce_op_is_read_in_any_case_as_in_deepspeed(written, read):
    config = BATCH if written is None else {**BATCH, "gradient_allreduce_op": written}
    assert load(config, 4).gradient_allreduce_op == read


@pytest.mark.parametrize("value", [None, "avg", 1, True, ["sum"]])
def test_gradient_allreduce_op_names_what_is_allowed(value):
    error = error_for({**BATCH, "gradient_allreduce_op": value})
    assert error.path == "gradient_allreduce_op" and error.value == value
    assert "'mean'" in str(error) and "'sum'" in str(error)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_gradient_allreduce_sum_is_accepted_at_stages_0_to_2(stage):
    config = {**BATCH, "gradient_allreduce_op": "sum", "zero_optimization": {"stage": stage}}
    assert load(config, 2).gradient_allreduce_op == "sum"


def test_gradient_allreduce_sum_is_refused_at_stage_3_as_in_deepspeed():
    config = {**BATCH, "gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}}
    error = error_for(config, 2)
    assert (error.path, error.value) == ("gradient_allreduce_op", "sum")
    assert "stage 3" in error.allowed and "'mean'" in error.allowed


@pytest.mark.parametrize(
    "fragment, key",
    [
        ({"prescale_gradients": True}, "prescale_gradients"),
        ({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor"),
    ],
)
def test_gradient_scaling_keys_are_warned_about_with_sum_and_allowed_with_reduce_scatter(
    fragment, key
):
    """DeepSpeed's ZeRO-2 refuses them with reduce_scatter only while it averages; summing, it
    never reads them."""
    config = {**BATCH, **fragment, "gradient_allreduce_op": "sum"}
    config["zero_optimization"] = {"stage": 2}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(config, 2)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and messages[0].startswith(f"{key}=") and "'sum'" in messages[0]


# --- DeepSpeed's features zerosim does not build (zerosim/config/features.py) -------------------

REFUSED_FEATURES = [
    ("managed_gradient_accumulation", False, "managed_gradient_accumulation"),
    ("sequence_parallel_size", 2, "sequence_parallel_size"),
    ("torch_autocast.enabled", True, "torch_autocast.enabled"),
    ("autotuning", {"enabled": True}, "autotuning"),
    ("expert_parallel", {"enabled": True, "autoep_size": 2}, "expert_parallel"),
    ("data_efficiency", {"data_routing": {"random_ltd": {"enabled": True}}}, "data_efficiency"),
    ("tensor_parallel", {"autotp_size": 2}, "tensor_parallel"),
    ("tensor_parallel", {"tp": {"tp_size": 2}}, "tensor_parallel"),
    ("weight_quantization", {"quantized_initialization": {"num_bits": 8}}, "weight_quantization"),
    ("data_types.grad_accum_dtype", "fp32", "data_types.grad_accum_dtype"),  # bf16 model
    ("data_types.param_dtype", "fp16", "data_types.param_dtype"),  # bf16 model
]


@pytest.mark.parametrize("path, value, at", REFUSED_FEATURES)
def test_a_deepspeed_feature_that_changes_what_is_trained_is_refused(path, value, at):
    config = merged({**BATCH, "bf16": {"enabled": True}}, nest(path, value))
    error = error_for(config)
    assert error.path == at and str(error).startswith(f"{at}: got ")
    assert "not built" in str(error) or "model dtype" in str(error)


def test_data_types_naming_the_model_dtype_are_accepted():
    fragment = {"data_types": {"grad_accum_dtype": "bf16", "param_dtype": "torch.bfloat16"}}
    assert load({**BATCH, "bf16": {"enabled": True}, **fragment}).data_types.param_dtype
    assert error_for({**BATCH, **fragment}).path == "data_types.grad_accum_dtype"  # fp32 model


def test_sum_is_refused_with_deepcompile_as_in_deepspeed():
    config = {**BATCH, "gradient_allreduce_op": "sum", "compile": {"deepcompile": True}}
    error = error_for(config)
    assert error.path == "gradient_allreduce_op" and "DeepCompile" in error.allowed


WARNED_FEATURES = [
    ("tensorboard.enabled", True, "TensorBoard"),
    ("wandb.enabled", "yes", "W&B"),  # pydantic's lax boolean, as DeepSpeed reads it
    ("comms_logger.enabled", True, "ledger"),
    ("flops_profiler.enabled", True, "FLOPs"),
    ("compile.deepcompile", True, "engine.compile()"),
    ("hybrid_engine.enabled", True, "generate()"),
    ("timers.throughput.enabled", True, "throughput"),
    ("dump_state", True, "engine state"),
    ("memory_breakdown", True, "memory_report"),
    ("disable_python_gc", True, "garbage collector"),
    ("dataloader_drop_last", False, "global batch"),
    ("log_level", "info", "'zerosim' logger"),
    ("vocabulary_size", 50257, "Tensor Core"),
    ("aio.block_size", 4096, "memory maps"),
    ("activation_checkpointing.partition_activations", True, "zerosim.nn.checkpoint"),
    ("data_types.buffer_dtype", "fp32", "buffers"),
    ("optimizer.legacy_fusion", True, "unscales"),
    ("checkpoint.checkpoint_serialization", False, "NumPy"),
    ("checkpoint.writer", {"type": "PYTHON"}, "writes its checkpoint files itself"),
    ("pipeline", {"stages": 2}, "PipelineEngine"),
    ("datastates_ckpt", {"host_cache_size": 4}, "its own checkpoint files"),
]


@pytest.mark.parametrize("path, value, why", WARNED_FEATURES)
def test_a_deepspeed_feature_that_only_observes_or_tunes_is_warned_about(path, value, why):
    config = merged(
        {**BATCH, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, nest(path, value)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(config, 1)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert messages[0].startswith(f"{path}=") and why in messages[0], messages


@pytest.mark.parametrize(
    "fragment",
    [
        {"disable_allgather": True},  # DeepSpeed reads it and never uses it
        {"seq_parallel_communication_data_type": "BF16"},  # no sequence parallelism
        {"use_data_before_expert_parallelism": True},  # no expert parallelism
        {"tensorboard": {"enabled": False, "job_name": "run"}},  # read once enabled
        {"compile": {"free_activation": True}},  # read by DeepCompile only
        {"expert_parallel": {"enabled": False, "top_k": 2}},
        {"expert_parallel": None},  # DeepSpeed's defaults
        {"datastates_ckpt": False},
        {"timers": {"throughput": {"enabled": False}}},
        {"data_types": {"keep_in_fp32_modules": "auto"}},
        {"allgather_size": 1000},
    ],
)
def test_deepspeed_keys_without_effect_in_any_run_zerosim_makes_are_read_silently(fragment):
    assert load({**BATCH, **fragment}) is not None


@pytest.mark.parametrize(
    "fragment, path",
    [
        ({"tensorboard": {"enabeld": True}}, "tensorboard.enabeld"),  # DeepSpeed forbids it
        ({"comms_logger": {"enabled": "x"}}, "comms_logger.enabled"),
        ({"tensorboard": None}, "tensorboard"),
        ({"torch_autocast": {"dtype": "fp64"}}, "torch_autocast.dtype"),
        ({"data_types": {"keep_in_fp32_modules": "none"}}, "data_types.keep_in_fp32_modules"),
        ({"compile": {"passes": ["z2"]}}, "compile.passes[0]"),
        ({"pipeline": []}, "pipeline"),
        ({"datastates_ckpt": None}, "datastates_ckpt"),
        ({"log_level": "loud"}, "log_level"),
    ],
)
def test_deepspeed_feature_sections_are_checked_as_deepspeed_checks_them(fragment, path):
    assert error_for({**BATCH, **fragment}).path == path


def test_zero_force_ds_cpu_optimizer_decides_on_an_optimizer_object_with_offload():
    """DeepSpeed refuses a client optimizer with ZeRO-Offload unless the key is false."""
    import zerosim as zs

    def build(force):
        model = zs.nn.MLP([4, 3], seed=0)
        config = {
            **BATCH,
            "zero_force_ds_cpu_optimizer": force,
            "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
        }
        optimizer = zs.optim.Adam(model.parameters(), lr=0.1)
        return zs.initialize(model, config, comm=zs.LocalWorld(1).comms()[0], optimizer=optimizer)

    with pytest.raises(ConfigError) as info:
        build(True)
    assert info.value.path == "zero_force_ds_cpu_optimizer" and "offload_optimizer" in str(
        info.value
    )
    engine, *_ = build(False)
    assert engine.strategy.offload.active


@pytest.mark.parametrize("size, world, effective", [(0, 4, 1), (2, 4, 2), (8, 4, 4), (4, 4, 4)])
def test_hpz_size_is_deepspeeds_min_with_the_world_size(size, world, effective):
    config = {**BATCH, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": size}}
    assert load(config, world).zero_optimization.zero_hpz_partition_size == effective


def test_lr_range_test_is_accepted_as_deepspeeds_type():
    params = {"lr_range_test_min_lr": 1e-4, "lr_range_test_staircase": True}
    config = load({**BATCH, "scheduler": {"type": "LRRangeTest", "params": params}})
    assert config.scheduler.type == "LRRangeTest" and not config.scheduler.is_torch
    assert dict(config.scheduler.params) == params


def test_scheduler_needing_python_objects_is_rejected():
    error = error_for({**BATCH, "scheduler": {"type": "LambdaLR", "params": {}}})
    assert "lr_scheduler=" in str(error)


@pytest.mark.parametrize(
    "params, path",
    [
        ([1, 2], "scheduler.params"),
        ({"warmup_max_lr": float("inf")}, "scheduler.params.warmup_max_lr"),
    ],
)
def test_scheduler_params_must_be_a_json_object(params, path):
    assert error_for({**BATCH, "scheduler": {"type": "WarmupLR", "params": params}}).path == path


def test_scheduler_params_are_kept_read_only():
    params = {"warmup_num_steps": 5, "warmup_type": "linear"}
    config = load({**BATCH, "scheduler": {"type": "WarmupLR", "params": params}})
    assert dict(config.scheduler.params) == params
    with pytest.raises(TypeError):
        config.scheduler.params["warmup_num_steps"] = 6


# --- files and round trips -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["ds_config_stage2.json", "ds_config_stage3.json"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_example_configs_load_without_warnings(name, world_size):
    config = load(ROOT / "examples" / name, world_size)
    assert config.train_batch_size == config.train_micro_batch_size_per_gpu * world_size
    raw = json.loads((ROOT / "examples" / name).read_text())
    assert config.gradient_clipping == 1.0
    assert config.optimizer.params["lr"] == raw["optimizer"]["params"]["lr"] > 0
    assert config.scheduler.type == "WarmupLR"
    assert config.zero_optimization.stage == int(re.search(r"stage(\d)", name).group(1))


def test_file_problems_name_the_file(tmp_path):
    missing = tmp_path / "nope.json"
    assert str(missing) in str(error_for(missing))
    broken = tmp_path / "broken.json"
    broken.write_text('{"train_batch_size": 8,\n "fp16": }')
    message = str(error_for(broken))
    assert str(broken) in message and "line 2" in message
    repeated = tmp_path / "repeated.json"
    repeated.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    assert "repeated keys ['train_batch_size']" in str(error_for(repeated))
    assert error_for(tmp_path).path == str(tmp_path)  # a directory is not a file


HJSON = """# DeepSpeed reads its config file with hjson: comments, quoteless keys and strings,
# optional commas
{
  train_micro_batch_size_per_gpu: 2
  gradient_clipping: 1.0  // hjson reads this as the integer 1, as DeepSpeed then sees it
  optimizer: {
    type: AdamW
    params: {lr: 1e-3, betas: [0.9, 0.95,],}
  }
  zero_optimization: {stage: 2}
}
"""


def test_hjson_file_is_read_as_deepspeed_reads_it(tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig

    path = tmp_path / "ds_config.hjson"
    path.write_text(HJSON)
    raw = read_config_file(path)
    assert raw == DeepSpeedConfig(str(path))._param_dict  # DeepSpeed's own reader, its values
    assert type(raw["gradient_clipping"]) is int
    config = load(path, world_size=3)
    assert (config.train_batch_size, config.gradient_clipping) == (6, 1.0)
    assert dict(config.optimizer.params) == {"lr": 1e-3, "betas": (0.9, 0.95)}
    assert config.zero_optimization.stage == 2


@pytest.mark.parametrize(
    "text, key",
    [
        (
            '{"train_batch_size": 8, "gradient_clipping": 1.0, "gradient_clipping": 0.0}',
            "gradient_clipping",
        ),
        ("train_batch_size: 8\nzero_optimization: {\n  stage: 1\n  stage: 2\n}", "stage"),
    ],
)
def test_repeated_key_is_refused_naming_it_and_the_file_as_deepspeed_refuses_it(
    tmp_path, text, key
):
    from deepspeed.runtime.config import DeepSpeedConfig

    path = tmp_path / "repeated.json"
    path.write_text(text)
    message = str(error_for(path))
    assert str(path) in message and f"repeated keys [{key!r}]" in message
    with pytest.raises(ValueError, match=f"Duplicate keys in DeepSpeed config: \\[{key!r}\\]"):
        DeepSpeedConfig(str(path))


def test_malformed_hjson_and_huge_numbers_name_the_file(tmp_path):
    bad = tmp_path / "bad.hjson"
    bad.write_text("{\n  train_batch_size: 8,\n  fp16: }\n")
    message = str(error_for(bad))
    assert str(bad) in message and "neither JSON nor hjson" in message and "line 3" in message
    huge = tmp_path / "huge.json"
    huge.write_text('{"train_batch_size": 1e400}')  # hjson: OverflowError, not a ConfigError
    assert str(huge) in str(error_for(huge))


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_a_json_constant_is_named_by_its_key_on_one_line_as_when_pretty_printed(tmp_path, constant):
    """hjson reads NaN on a line of its own as the string 'NaN', and the key's check names it;
    on one line its quoteless value ran on over the closing brackets, and the file was called
    neither JSON nor hjson."""
    config = {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 1.5e-3}}}
    text = {"one": json.dumps(config), "pretty": json.dumps(config, indent=2)}
    raw = {}
    for form, body in text.items():
        path = tmp_path / f"{form}.json"
        path.write_text(body.replace("0.0015", constant))
        raw[form] = read_config_file(path)
        message = str(error_for(path))
        assert message == f"optimizer.params.lr: got '{constant}'; allowed: a finite number >= 0"
    assert (
        raw["one"]
        == raw["pretty"]
        == {
            "train_batch_size": 8,
            "optimizer": {"type": "Adam", "params": {"lr": constant}},
        }
    )


def test_top_level_must_be_an_object(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    assert error_for(path).path == "<config>"
    assert error_for({1: 2}).path == "<config>"


ROUND_TRIP = [
    BATCH,
    {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 3,
        "optimizer": {"type": "adam", "params": {"betas": [0.8, 0.9], "adam_w_mode": False}},
        "scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 0.1, "list": [1, [2]]}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": "/x"},
            "zero_hpz_partition_size": 2,
            "zero_quantized_weights": True,
        },
        "fp16": {"enabled": True, "hysteresis": 4},
        "zerosim": {"ranks_per_node": 2},
    },
    {
        **BATCH,
        "fp16": {"enabled": True},
        "zero_optimization": True,
        "communication_data_type": "fp16",
        "checkpoint": {"tag_validation": "fail"},
    },
]


@pytest.mark.parametrize("config", ROUND_TRIP)
def test_to_dict_round_trips_through_json(config):
    loaded = load(config, 4)
    text = json.dumps(loaded.to_dict())
    assert load(json.loads(text), 4) == loaded
    assert load(loaded, 4) == loaded


def test_world_size_must_be_a_positive_integer():
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="world_size"):
            load_config(BATCH, bad)


# --- documentation -------------------------------------------------------------------------


def test_docs_list_every_key_path():
    docs = (ROOT / "docs" / "config.md").read_text()
    missing = [path for path in known_key_paths(Config) if f"`{path}`" not in docs]
    assert not missing


def test_every_knob_has_a_doc_line():
    def walk(cls):
        for f in knob_fields(cls):
            assert f.metadata["doc"], f.name
            if f.metadata["parser"].section is not None:
                walk(f.metadata["parser"].section)

    walk(Config)


# --- fuzz ----------------------------------------------------------------------------------

GOOD_STRINGS = [
    "none",
    "cpu",
    "CPU",
    "nvme",
    "/tmp/zs",
    "numpy",
    "cupy",
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "native",
    "ring",
    "deepspeed",
    "megatron",
    "fp16",
    "bf16",
    "fp32",
    "warn",
    "Adam",
    "sgd",
    "Lion",
    "WarmupLR",
    "LRRangeTest",
    "LambdaLR",
    "",
    "auto",
]
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 10),
    st.sampled_from([5e8, 1e3, 2.0, 0.5, -1.0, float("nan"), float("inf"), 10**400]),
    st.sampled_from(GOOD_STRINGS),
    st.text(max_size=4),
)
JUNK = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)
PARAM_NAMES = sorted(
    {name for names in HYPERPARAMETERS.values() for name in names}
    | {"max_grad_norm", "warmup_num_steps"}
)


def good_values(allowed: str) -> st.SearchStrategy:
    """Values a parser should accept, read from its ``allowed`` text (to keep many fuzzed
    configs valid, so the round trip is exercised too)."""
    if allowed.startswith("null or "):
        return st.none() | good_values(allowed.removeprefix("null or "))
    if allowed == "true or false":
        return st.booleans()
    if allowed.startswith("one of "):
        return st.sampled_from(re.findall(r"'([^']*)'", allowed))
    if match := re.match(r"an integer (?:>= (\d+)|in \[(\d+), (\d+)\])", allowed):
        low = int(match.group(1) or match.group(2))
        high = int(match.group(3)) if match.group(3) else low + 4
        return st.integers(low, high) | st.just(float(high))
    if allowed.startswith("a finite number"):
        return st.sampled_from([1.0, 0.5, 2, 128.0])
    if allowed == "a non-empty string":
        return st.just("/tmp/zs")
    return SCALARS


FAVOURED = {"zero_optimization", "optimizer", "bf16", "fp16"}


def section_strategy(cls: type, chaos: bool) -> st.SearchStrategy[dict]:
    """Random subsets of the keys of ``cls`` plus random unknown keys.

    With ``chaos``: aliases and legacy keys too, and any value. Without: values the key's
    parser should accept, the batch given as a micro-batch, a type in optimizer/scheduler,
    so that many configs load and the round trip is exercised."""
    entries, required = {}, {}
    for f in knob_fields(cls):
        parser = f.metadata["parser"]
        names = (f.name, *f.metadata["aliases"]) if chaos else (f.name,)
        if parser.section is not None:
            value = section_strategy(parser.section, chaos)
        elif f.name == "params":
            value = st.dictionaries(st.sampled_from(PARAM_NAMES), SCALARS, max_size=3)
            if not chaos:
                value = st.fixed_dictionaries({}, optional={"lr": st.just(0.5)})
        else:
            value = good_values(parser.allowed)
        if chaos:
            value = value | value | value | JUNK
        elif f.name in ("type", "stage", "train_micro_batch_size_per_gpu"):
            required[f.name] = value
            continue
        elif f.name == "train_batch_size":
            continue
        for name in names:
            entries[name] = value
    if chaos:
        for name in getattr(cls, "LEGACY_KEYS", ()):
            entries[name] = st.booleans() | SCALARS
    # Any up to 4 keys, plus any of the sections that decide how a run trains: drawn from the
    # ~100 top-level keys alone, a ZeRO section came up in too few configs to exercise it.
    favoured = sorted(FAVOURED & set(entries))
    chosen = st.builds(
        lambda keys, more: sorted(set(keys) | set(more)),
        st.lists(st.sampled_from(sorted(entries)), max_size=4, unique=True),
        st.lists(st.sampled_from(favoured), unique=True) if favoured else st.just([]),
    )
    known = chosen.flatmap(
        lambda keys: st.fixed_dictionaries({**required, **{key: entries[key] for key in keys}})
    )
    unknown = st.dictionaries(st.sampled_from(["x", "zero_stage", "lr"]), JUNK, max_size=1)
    return st.builds(lambda a, b: {**b, **a}, known, unknown)


CONFIGS = st.booleans().flatmap(lambda chaos: section_strategy(Config, chaos))


def value_at(config: object, path: str) -> tuple[bool, object]:
    node = config
    for name in path.split("."):
        if not isinstance(node, dict) or name not in node:
            return False, None
        node = node[name]
    return True, node


@settings(max_examples=200, deadline=None)
@given(config=CONFIGS, world_size=st.sampled_from([1, 2, 3, 8]))
def test_fuzzed_config_gives_a_config_or_a_config_error(config, world_size):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            loaded = load_config(config, world_size)
        except ConfigError as error:
            message = str(error)
            assert message.startswith(f"{error.path}: ")
            if error.got is None:
                assert short_repr(error.value) in message
                found, raw = value_at(config, error.path)
                if found and not isinstance(raw, dict):
                    same = raw == error.value or (
                        isinstance(raw, str) and raw.lower() == str(error.value).lower()
                    )
                    assert same or raw != raw, (raw, error.value)  # nan != nan
            return
        assert load_config(loaded.to_dict(), world_size) == loaded
        json.dumps(loaded.to_dict(), allow_nan=False)


def test_fuzz_strategy_reaches_valid_configs_with_sections():
    def loads(config: dict) -> Config | None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                return load_config(config, 2)
            except ConfigError:
                return None

    def interesting(config: dict) -> bool:
        got = loads(config)
        return got is not None and got.zero_optimization.stage >= 1

    # The non-chaos half of CONFIGS (which draws its ``chaos`` flag first): searched alone, the
    # outcome does not hang on how many chaos draws the other half takes (hypothesis seeds its
    # text with the string constants of the modules loaded, so those change with the code).
    budget = settings(database=None, phases=[Phase.generate], derandomize=True, max_examples=2000)
    example = find(section_strategy(Config, False), interesting, settings=budget)
    assert interesting(example)


@pytest.mark.parametrize(
    "raw, key, got, allowed, why",
    [
        (
            {"managed_gradient_accumulation": False},
            "managed_gradient_accumulation",
            "False",
            "true",
            "client-managed boundary is not built",
        ),
        ({"sequence_parallel_size": 4}, "sequence_parallel_size", "4", "1", "Ulysses"),
        (
            {"bf16": {"enabled": True, "bf16_optimizer_states": True}},
            "bf16.bf16_optimizer_states",
            "True",
            "false",
            "float32 optimizer states",
        ),
        (
            {"tensor_parallel": {"autotp_size": 2}},
            "tensor_parallel",
            "{'autotp_size': 2}",
            "autotp_size and tp.tp_size (alias tensor_parallel.tp_size) <= 1 or absent",
            "tensor parallelism is not built",
        ),
        (
            {"weight_quantization": {"quantized_initialization": {"num_bits": 8}}},
            "weight_quantization",
            "{'quantized_initialization': {'num_bits': 8}}",
            "quantized_initialization and post_init_quant false or absent",
            "weight quantization is not built",
        ),
    ],
)
def test_a_refused_key_names_the_value_received_what_is_allowed_and_why(
    raw, key, got, allowed, why
):
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 4, **raw}, world_size=4)
    message = str(info.value)
    assert message.startswith(f"{key}: got {got}; allowed: {allowed} ("), message
    assert why in message and info.value.path == key


@pytest.mark.parametrize("world", [1, 3, 4])
def test_data_parallel_size_beside_sequence_parallel_size_must_be_the_world_size(world):
    """deepspeed.initialize builds a (data_parallel, sequence_parallel) mesh of every rank from
    the two keys: with sequence_parallel_size 1 the data-parallel side is the world."""
    base = {"train_batch_size": 2 * world, "sequence_parallel_size": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # declared: no "unknown key" warning
        cfg = load_config({**base, "data_parallel_size": world}, world_size=world)
    assert cfg.data_parallel_size == world
    for wrong in (world + 1, 2 * world):
        with pytest.raises(ConfigError) as info:
            load_config({**base, "data_parallel_size": wrong}, world_size=world)
        assert info.value.path == "data_parallel_size" and info.value.value == wrong
        assert str(info.value).startswith(
            f"data_parallel_size: got {wrong}; allowed: {world} (world size {world} / "
            "sequence_parallel_size 1"
        )


def test_data_parallel_size_alone_is_warned_about_as_deepspeed_ignores_it():
    with pytest.warns(UserWarning, match=r"data_parallel_size=5 is ignored: deepspeed.initialize"):
        load_config({"train_batch_size": 4, "data_parallel_size": 5}, world_size=4)
    with pytest.raises(ConfigError, match=r"data_parallel_size: got 'two'; allowed: an integer"):
        load_config({"train_batch_size": 4, "data_parallel_size": "two"}, world_size=4)


def test_a_torch_scheduler_at_stage_1_names_every_deepspeed_scheduler_type():
    from zerosim.config.optimizer import DEEPSPEED_SCHEDULERS

    config = {
        "train_batch_size": 2,
        "zero_optimization": {"stage": 1},
        "scheduler": {"type": "StepLR", "params": {"step_size": 10}},
    }
    with pytest.raises(ConfigError) as info:
        load_config(config, world_size=2)
    assert info.value.path == "scheduler.type" and "LRRangeTest" in str(info.value)
    assert all(name in str(info.value) for name in DEEPSPEED_SCHEDULERS)


def test_gradient_allreduce_sum_is_refused_with_deepcompile_as_in_deepspeed():
    config = {**BATCH, "gradient_allreduce_op": "sum", "compile": {"deepcompile": True}}
    error = error_for(config, 2)
    assert (error.path, error.value) == ("gradient_allreduce_op", "sum")
    assert "with compile.deepcompile" in error.allowed and "'mean'" in error.allowed
