"""DeepSpeed's own parser as the oracle of which configs zerosim accepts.

A generated corpus of configs (valid ones; each key of them set to null, "auto", a wrong type,
an out-of-range value, another capitalisation; unknown keys; removed and legacy keys;
conflicting batch sizes; missing sections; optimizer and scheduler rules; and, from DeepSpeed's
own code, every key DeepSpeed reads at its default and every switch flipped) goes through

- DeepSpeed 0.19.8: ``DeepSpeedConfig`` for the config's world size, then
  ``deepspeed.initialize`` of a ``torch.nn.Linear(4, 4)`` on a one-process gloo group (the
  batch triple rescaled to one rank), which adds the optimizer, scheduler and ZeRO checks;
- zerosim: ``load_config`` for the same world size, then ``zerosim.initialize`` of a tiny MLP
  on ``LocalWorld(1)`` with the same rescaled config.

Both must accept or both reject, and every zerosim rejection must be a ConfigError naming the
key, the value and what is allowed. The cases where they differ are listed in ``DIFFERENCES``,
each with its reason: zerosim is stricter only where DeepSpeed fails later (at the first step)
or silently does something other than the config says, or builds a feature zerosim does not,
and looser only where DeepSpeed fails for want of what this machine lacks (an accelerator, a
package, its launcher's environment). Every row must still be needed.

The keys DeepSpeed reads come from its code (tests/helpers/deepspeed_keys.py walks its config
readers
and pydantic models), not from zerosim's list: the tests at the end hold zerosim to declare every
one of them, with DeepSpeed's default, and to declare no key DeepSpeed does not read.

Set-up notes: the test sets MASTER_ADDR / MASTER_PORT (a free port) / RANK / WORLD_SIZE /
LOCAL_RANK itself; Adam configs use ``"torch_adam": true`` so that DeepSpeed never JIT-builds
FusedAdam; DeepSpeed's CPU accelerator says it has no fp16, so the test patches
``get_accelerator().is_fp16_supported`` to return True (fp16 engines then build on CPU).
"""

from __future__ import annotations

import copy
import functools
import gc
import itertools
import re
import warnings
from dataclasses import Field, dataclass

import pytest
from deepspeed_keys import NO_DEFAULT, deepspeed_keys, dotted

import zerosim
from zerosim.comm import LocalWorld
from zerosim.config import REMOVED_TOP_LEVEL_KEYS, Config, load_config
from zerosim.config.values import any_value, knob_fields, known_key_paths
from zerosim.errors import ConfigError

pytestmark = pytest.mark.slow
deepspeed = pytest.importorskip(
    "deepspeed", reason="DeepSpeed is the oracle here: pip install -e '.[test]' installs it"
)
torch = pytest.importorskip("torch")

# --- the corpus ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One config of the corpus: ``name`` is '<base or topic>/<what was done to it>'.
    ``initialize`` False: DeepSpeed's side runs its config parser only (``dskey/...=default``
    cases: a key at its default changes nothing its engine would check)."""

    name: str
    config: dict
    world_size: int = 1
    initialize: bool = True


ADAM = {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}

BASES = {
    "s0-fp32": {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 100,
        "wall_clock_breakdown": False,
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
        "communication_data_type": "fp32",
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-3,
                "betas": [0.9, 0.999],
                "eps": 1e-8,
                "weight_decay": 0.0,
                "adam_w_mode": True,
                "torch_adam": True,
            },
        },
        "scheduler": {"type": "StepLR", "params": {"step_size": 10, "gamma": 0.5}},
        "zero_optimization": {"stage": 0},
        "checkpoint": {"tag_validation": "FAIL", "load_universal": False},
    },
    "s1-bf16": {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": 1e-3,
                "warmup_num_steps": 10,
                "warmup_type": "linear",
            },
        },
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 1,
            "reduce_bucket_size": 500_000_000,
            "overlap_comm": False,
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "allgather_partitions": True,
            "sub_group_size": 1_000_000_000,
        },
    },
    "s2-fp16": {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.5,
        "optimizer": ADAM,
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"total_num_steps": 100, "warmup_num_steps": 10, "warmup_max_lr": 1e-3},
        },
        "fp16": {
            "enabled": True,
            "auto_cast": False,
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "consecutive_hysteresis": False,
            "min_loss_scale": 1,
        },
        "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5e8},
    },
    "s2-sgd": {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 4,
        "zero_allow_untested_optimizer": True,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}},
        "scheduler": {
            "type": "OneCycle",
            "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 10},
        },
        "zero_optimization": {"stage": 2},
    },
    "s1-offload": {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {"total_num_steps": 100, "warmup_num_steps": 10, "cos_min_ratio": 0.001},
        },
        "zero_optimization": {
            "stage": 1,
            "offload_optimizer": {"device": "cpu", "pin_memory": True, "buffer_count": 4},
        },
    },
    "s0-adagrad": {
        "train_batch_size": 2,
        "optimizer": {"type": "Adagrad", "params": {"lr": 0.01, "lr_decay": 0.0}},
    },
    "s3": {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": ADAM,
        "zero_optimization": {
            "stage": 3,
            "stage3_prefetch_bucket_size": 50_000_000,
            "stage3_param_persistence_threshold": 100_000,
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "zero_hpz_partition_size": 1,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "cpu"},
        },
    },
}
BASE_WORLD = {"s2-fp16": 8}
# Stage 3 engines take DeepSpeed ~0.3 s to build: its base mutates only its own section.
MUTATED_PREFIXES = {"s3": ("zero_optimization.",)}


def leaves(node: object, path: str = "") -> list[tuple[str, object]]:
    """(dotted path, value) of every leaf and every section of a config."""
    found = []
    if isinstance(node, dict):
        if path:
            found.append((path, node))
        for key, value in node.items():
            found += leaves(value, f"{path}.{key}" if path else key)
    else:
        found.append((path, node))
    return found


def with_value(config: dict, path: str, value: object) -> dict:
    """A copy of ``config`` with ``path`` set to ``value`` (a ``DELETE`` value removes it)."""
    result = copy.deepcopy(config)
    node = result
    *parents, leaf = path.split(".")
    for name in parents:
        node = node.setdefault(name, {})
    if value is DELETE:
        node.pop(leaf, None)
    else:
        node[leaf] = value
    return result


DELETE = object()


def variants(value: object) -> list[tuple[str, object]]:
    """Values to try in place of ``value``: null, "auto", wrong types, out of range, case."""
    out: list[tuple[str, object]] = [("null", None), ("auto", "auto")]
    if isinstance(value, dict):
        out += [("list", []), ("string", "x"), ("empty", {}), ("absent", DELETE)]
    elif isinstance(value, bool):
        out += [("int-2", 2), ("int-1", 1), ("text-true", "true"), ("text-false", "false")]
        out += [("text-x", "x"), ("list", [value])]
    elif isinstance(value, int | float):
        out += [("text", str(value)), ("bool", True), ("negative", -1), ("zero", 0)]
        out += [("fraction", 2.5), ("list", [value]), ("text-x", "x")]
    elif isinstance(value, str):
        out += [("upper", value.upper()), ("lower", value.lower()), ("number", 1)]
        out += [("text-x", "x")]
    elif isinstance(value, list):
        out += [("text", "x"), ("empty", []), ("scalar", value[0] if value else 0)]
    return out


def mutations() -> list[Case]:
    cases = []
    for base, config in BASES.items():
        world = BASE_WORLD.get(base, 1)
        cases.append(Case(f"{base}/valid", config, world))
        prefixes = MUTATED_PREFIXES.get(base, ("",))
        for path, value in leaves(config):
            if not path.startswith(prefixes):
                continue
            seen = set()
            for label, new in variants(value):
                if new is not DELETE and repr(new) == repr(value) or repr(new) in seen:
                    continue
                seen.add(repr(new))
                cases.append(Case(f"{base}/{path}={label}", with_value(config, path, new), world))
            if isinstance(value, dict):  # an unknown key, and a misspelt one, inside it
                cases.append(
                    Case(f"{base}/{path}.foo=unknown", with_value(config, f"{path}.foo", 1))
                )
                if value:
                    key = next(iter(value))
                    typo = f"{path}.{key[:-1]}"
                    cases.append(
                        Case(f"{base}/{path}.{key}=misspelt", with_value(config, typo, value[key]))
                    )
        cases.append(Case(f"{base}/foo=unknown", {**config, "foo": 1}, world))
    return cases


def batch_cases() -> list[Case]:
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    cases = []
    for triple, world in itertools.product(
        [(8, 2, 2), (8, 3, 2), (8, None, 2), (8, 2, None), (None, 2, 2), (8, None, None),
         (None, 2, None), (None, None, 2), (None, None, None), (8, 16, None), (8.0, 2.0, None),
         (True, 1, 1), (0, 2, 1), (-8, -2, None), (8, 2, 0), ("8", 2, None), (8.5, 2, None)],
        [1, 2, 4],
    ):  # fmt: skip
        config = {k: v for k, v in zip(keys, triple, strict=True) if v is not None}
        cases.append(Case(f"batch/{triple}@{world}", {**config, "optimizer": ADAM}, world))
    return cases


def optimizer_cases() -> list[Case]:
    cases = []
    names = ["adam", "ADAM", "AdamW", "adamw", "Adagrad", "ADAGRAD", "SGD", "sgd", "Sgd",
             "RMSprop", "rmsprop", "Adamax", "adamax", "NAdam", "nadam", "RAdam", "radam",
             "Lion", "lion", "Lamb", "Adadelta", "Foo"]  # fmt: skip
    for name, stage, allow in itertools.product(names, (0, 2), (None, True)):
        if stage == 0 and allow:
            continue
        params = {"lr": 0.01, **({"torch_adam": True} if name.lower().startswith("adam") else {})}
        if name.lower() == "adamax":
            params = {"lr": 0.01}
        config = {
            "train_batch_size": 2,
            "optimizer": {"type": name, "params": params},
            "zero_optimization": {"stage": stage},
        }
        if allow is not None:
            config["zero_allow_untested_optimizer"] = allow
        cases.append(Case(f"optimizer/{name}@s{stage}" + ("+allow" if allow else ""), config))
    for flag_value in ("true", 1, "yes", False, None):
        config = {
            "train_batch_size": 2,
            "zero_allow_untested_optimizer": flag_value,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 1},
        }
        cases.append(Case(f"optimizer/SGD@s1 allow={flag_value!r}", config))
    for torch_adam, stage, kind in itertools.product((None, True), (0, 2), ("Adam", "AdamW")):
        params = {"amsgrad": True, **({"torch_adam": torch_adam} if torch_adam else {})}
        config = {
            "train_batch_size": 2,
            "optimizer": {"type": kind, "params": params},
            "zero_optimization": {"stage": stage},
        }
        cases.append(Case(f"optimizer/{kind} amsgrad torch_adam={torch_adam}@s{stage}", config))
    odd = {
        "no type": {"params": {"lr": 0.1}},
        "type null": {"type": None, "params": {"lr": 0.1}},
        "params null": {"type": "SGD", "params": None},
        "no params": {"type": "SGD"},
        "params list": {"type": "SGD", "params": []},
        "unknown param": {"type": "SGD", "params": {"lr": 0.1, "foo": 1}},
        "max_grad_norm": {"type": "Adam", "params": {"torch_adam": True, "max_grad_norm": 1.0}},
        "lr negative": {"type": "SGD", "params": {"lr": -0.1}},
        "lr text": {"type": "SGD", "params": {"lr": "0.1"}},
        "betas out of range": {"type": "Adam", "params": {"torch_adam": True, "betas": [1.5, 0]}},
        "torch_adam on SGD": {"type": "SGD", "params": {"lr": 0.1, "torch_adam": True}},
        "nesterov without momentum": {"type": "SGD", "params": {"lr": 0.1, "nesterov": True}},
    }
    for label, section in odd.items():
        cases.append(Case(f"optimizer/{label}", {"train_batch_size": 2, "optimizer": section}))
    cases.append(Case("optimizer/absent", {"train_batch_size": 2}))
    return cases + whole_parameter_cases()


def whole_parameter_cases() -> list[Case]:
    """LAMB and Muon: DeepSpeed's rules across sections (Muon with torch_adam: DeepSpeed's
    FusedAdam, its default auxiliary Adam, is not built on this machine)."""
    muon = {"torch_adam": True}
    fp16, bf16 = {"fp16": {"enabled": True}}, {"bf16": {"enabled": True}}
    static = {"enabled": True, "loss_scale": 8}
    sections = {
        "Muon@s0": ({"type": "Muon", "params": muon}, {}, {}),
        "muon@s1 fp16": ({"type": "muon", "params": muon}, {"stage": 1}, fp16),
        "Muon@s2 bf16": ({"type": "Muon", "params": muon}, {"stage": 2}, bf16),
        "Muon@s3": ({"type": "Muon", "params": muon}, {"stage": 3}, {}),
        "Muon@s3 no reduce_scatter": (
            {"type": "Muon", "params": muon}, {"stage": 3, "reduce_scatter": False}, {}
        ),
        "Muon@s3 qgZ": (
            {"type": "Muon", "params": muon},
            {"stage": 3, "reduce_scatter": False, "zero_quantized_gradients": True},
            {},
        ),
        "Muon@s2 offload": (
            {"type": "Muon", "params": muon},
            {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            {},
        ),
        "Muon@s3 offload": (
            {"type": "Muon", "params": muon},
            {"stage": 3, "reduce_scatter": False, "offload_optimizer": {"device": "cpu"}},
            {},
        ),
        "Muon halves": (
            {"type": "Muon", "params": {**muon, "muon_lr": 0.02, "adam_lr": 1e-3,
                                        "momentum": 0.9, "ns_method": "standard",
                                        "betas": [0.9, 0.95], "eps": 1e-10}},
            {}, {},
        ),
        "Muon ns_method newton": ({"type": "Muon", "params": {**muon, "ns_method": "x"}}, {}, {}),
        "Muon unknown key": ({"type": "Muon", "params": {**muon, "foo": 1}}, {}, {}),
        "Muon per_head_muon": (
            {"type": "Muon", "params": {**muon, "per_head_muon": True}}, {}, {}
        ),
        "Lamb fp16 static scale": ({"type": "Lamb"}, {}, {"fp16": static}),
        "Lamb static scale fp16 off": ({"type": "Lamb"}, {}, {"fp16": {"loss_scale": 8}}),
        "Lamb amsgrad": ({"type": "Lamb", "params": {"amsgrad": True}}, {}, {}),
        "Lamb params": (
            {"type": "Lamb", "params": {"lr": 0.01, "bias_correction": False, "max_coeff": 5.0,
                                        "min_coeff": 0.1, "eps_inside_sqrt": True}},
            {}, {},
        ),
    }  # fmt: skip
    cases = []
    for label, (section, zero, top) in sections.items():
        config = {"train_batch_size": 2, "optimizer": section, "zero_optimization": zero, **top}
        cases.append(Case(f"optimizer/{label}", config))
    return cases


TORCH_SCHEDULER_PARAMS = {
    "StepLR": {"step_size": 3},
    "MultiStepLR": {"milestones": [2, 5]},
    "ExponentialLR": {"gamma": 0.9},
    "CosineAnnealingLR": {"T_max": 10},
    "LinearLR": {"total_iters": 4},
    "OneCycleLR": {"max_lr": 0.1, "total_steps": 100},
    "ReduceLROnPlateau": {"patience": 2},
    "ConstantLR": {"factor": 0.5, "total_iters": 3},
    "PolynomialLR": {"total_iters": 5, "power": 2.0},
    "CosineAnnealingWarmRestarts": {"T_0": 5, "T_mult": 2},
    "CyclicLR": {"base_lr": 0.001, "max_lr": 0.01, "step_size_up": 4},
}
DS_SCHEDULER_PARAMS = {
    "WarmupLR": {"warmup_num_steps": 5},
    "WarmupDecayLR": {"total_num_steps": 20, "warmup_num_steps": 5},
    "WarmupCosineLR": {"total_num_steps": 20, "warmup_num_steps": 5},
    "OneCycle": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 4},
    "LRRangeTest": {"lr_range_test_step_size": 5, "lr_range_test_staircase": True},
}


def scheduler_cases() -> list[Case]:
    cases = []
    precisions = {
        "fp32": {},
        "bf16": {"bf16": {"enabled": True}},
        "fp16": {"fp16": {"enabled": True}},
    }
    every = {**TORCH_SCHEDULER_PARAMS, **DS_SCHEDULER_PARAMS}
    for (name, params), (label, precision), stage in itertools.product(
        every.items(), precisions.items(), (0, 1)
    ):
        if label != "fp32" and stage == 1:
            continue
        config = {
            "train_batch_size": 2,
            "optimizer": ADAM,
            "scheduler": {"type": name, "params": params},
            "zero_optimization": {"stage": stage},
            **precision,
        }
        cases.append(Case(f"scheduler/{name}@s{stage}-{label}", config))
    odd = {
        "warmuplr": {"type": "warmuplr", "params": {}},
        "WARMUPLR": {"type": "WARMUPLR", "params": {}},
        "steplr": {"type": "steplr", "params": {"step_size": 2}},
        "LRRangeTest": {"type": "LRRangeTest", "params": {}},
        "LambdaLR": {"type": "LambdaLR", "params": {"lr_lambda": 1}},
        "Foo": {"type": "Foo", "params": {}},
        "no params": {"type": "WarmupLR"},
        "params null": {"type": "WarmupLR", "params": None},
        "no type": {"params": {"warmup_num_steps": 5}},
        "WarmupLR steps 0": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}},
        "WarmupLR steps -1": {"type": "WarmupLR", "params": {"warmup_num_steps": -1}},
        "WarmupLR steps 2.0": {"type": "WarmupLR", "params": {"warmup_num_steps": 2.0}},
        "WarmupLR type cos": {"type": "WarmupLR", "params": {"warmup_type": "cos"}},
        "WarmupLR unknown": {"type": "WarmupLR", "params": {"foo": 1}},
        "WarmupLR max list": {"type": "WarmupLR", "params": {"warmup_max_lr": [0.1]}},
        "WarmupLR max list 2": {"type": "WarmupLR", "params": {"warmup_max_lr": [0.1, 0.2]}},
        "WarmupDecayLR no total": {"type": "WarmupDecayLR", "params": {}},
        "WarmupCosineLR total<warmup": {
            "type": "WarmupCosineLR",
            "params": {"total_num_steps": 3, "warmup_num_steps": 5},
        },
        "WarmupCosineLR total=warmup": {
            "type": "WarmupCosineLR",
            "params": {"total_num_steps": 5, "warmup_num_steps": 5},
        },
        "OneCycle no min": {"type": "OneCycle", "params": {"cycle_max_lr": 0.1}},
        "OneCycle second 0": {
            "type": "OneCycle",
            "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_second_step_size": 0},
        },
        "OneCycle first 0": {
            "type": "OneCycle",
            "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 0},
        },
        "OneCycle stairs": {
            "type": "OneCycle",
            "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_stair_count": 2},
        },
        "LRRangeTest step 0": {"type": "LRRangeTest", "params": {"lr_range_test_step_size": 0}},
        "LRRangeTest step 2.0": {
            "type": "LRRangeTest",
            "params": {"lr_range_test_step_size": 2.0},
        },
        "LRRangeTest min list 2": {
            "type": "LRRangeTest",
            "params": {"lr_range_test_min_lr": [1e-3, 1e-3]},
        },
        "LRRangeTest unknown": {"type": "LRRangeTest", "params": {"lr_range_test_rate": 1.0}},
        "LRRangeTest staircase 'false'": {
            "type": "LRRangeTest",
            "params": {"lr_range_test_staircase": "false"},
        },
        "StepLR step 0": {"type": "StepLR", "params": {"step_size": 0}},
        "StepLR unknown": {"type": "StepLR", "params": {"step_size": 2, "foo": 1}},
    }
    for label, section in odd.items():
        config = {"train_batch_size": 2, "optimizer": ADAM, "scheduler": section}
        cases.append(Case(f"scheduler/{label}", config))
    section = {"type": "WarmupLR", "params": {}}
    cases.append(Case("scheduler/without optimizer", {"train_batch_size": 2, "scheduler": section}))
    return cases


def section_cases() -> list[Case]:
    """Rules inside and across sections: precision, legacy keys, offload, ZeRO++, removed keys."""
    base = {"train_batch_size": 2, "optimizer": ADAM}
    z = "zero_optimization"
    fragments = {
        "fp16+bf16": {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
        "bfloat16": {"bfloat16": {"enabled": True}},
        "bf16+bfloat16": {"bf16": {"enabled": True}, "bfloat16": {"enabled": False}},
        "bfloat16 null": {"bfloat16": None},
        "bf16 null": {"bf16": None},
        "zero true": {z: True},
        "zero false": {z: False},
        "zero 1": {z: 1},
        "zero string": {z: "2"},
        "stage text": {z: {"stage": "2"}},
        "stage 2.0": {z: {"stage": 2.0}},
        "stage 4": {z: {"stage": 4}},
        "cpu_offload": {z: {"stage": 2, "cpu_offload": True}},
        "cpu_offload false": {z: {"stage": 2, "cpu_offload": False}},
        "cpu_offload+offload": {
            z: {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}
        },
        "cpu_offload_param": {z: {"stage": 3, "cpu_offload_param": True}},
        "cpu_offload_use_pin_memory": {z: {"stage": 2, "cpu_offload_use_pin_memory": True}},
        "offload s0": {z: {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
        "offload s2": {z: {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
        "offload CPU": {z: {"stage": 2, "offload_optimizer": {"device": "CPU"}}},
        "offload gpu": {z: {"stage": 2, "offload_optimizer": {"device": "gpu"}}},
        "offload null": {z: {"stage": 2, "offload_optimizer": None}},
        "offload ratio s2": {z: {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
        "offload_param s2": {z: {"stage": 2, "offload_param": {"device": "cpu"}}},
        "offload_param s3": {
            z: {"stage": 3, "offload_param": {"device": "cpu", "buffer_count": 8}}
        },
        "qw s1": {z: {"stage": 1, "zero_quantized_weights": True}},
        "qg s2": {z: {"stage": 2, "zero_quantized_gradients": True}},
        "hpz s2": {z: {"stage": 2, "zero_hpz_partition_size": 2}},
        "hpz 0 s3": {z: {"stage": 3, "zero_hpz_partition_size": 0}},
        "hpz 2 s3": {z: {"stage": 3, "zero_hpz_partition_size": 2}},
        "qw s3": {z: {"stage": 3, "zero_quantized_weights": True}},
        "alias both": {
            z: {"stage": 3, "stage3_prefetch_bucket_size": 1, "prefetch_bucket_size": 2}
        },
        "alias short": {z: {"stage": 3, "prefetch_bucket_size": 2}},
        "compute_grad_norm s0": {z: {"stage": 0, "compute_grad_norm": False}},
        "compute_grad_norm s2": {z: {"stage": 2, "compute_grad_norm": False}},
        "ignore_unused false": {z: {"stage": 2, "ignore_unused_parameters": False}},
        "round robin": {z: {"stage": 2, "round_robin_gradients": True}},
        "allgather bucket 0": {z: {"stage": 1, "allgather_bucket_size": 0}},
        "reduce bucket 0": {z: {"stage": 2, "reduce_bucket_size": 0}},
        "sub group 0": {z: {"stage": 1, "sub_group_size": 0}},
        "leaf_module": {z: {"stage": 3, "leaf_module": {"classes": ["Linear"]}}},
        "leaf_module bad": {z: {"stage": 3, "leaf_module": {"classes": "Linear"}}},
        "zenflow": {z: {"stage": 2, "zenflow": {"topk_ratio": 0.1}}},
        "mics": {z: {"stage": 3, "mics_shard_size": 2}},
        "removed amp": {"amp": {"enabled": True}},
        "removed elasticity": {"elasticity": {"enabled": False}},
        "removed sparse_gradients": {"sparse_gradients": False},
        "prescale s1": {"prescale_gradients": True, z: {"stage": 1}},
        "prescale s2": {"prescale_gradients": True, z: {"stage": 2}},
        "prescale s2 allreduce": {
            "prescale_gradients": True,
            z: {"stage": 2, "reduce_scatter": False},
        },
        "predivide s3": {"gradient_predivide_factor": 2.0, z: {"stage": 3}},
        "predivide s0": {"gradient_predivide_factor": 2.0},
        "fp16 master s0": {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
        "bf16 master s2": {
            "bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
            z: {"stage": 2},
        },
        "bf16 check overflow off": {"bf16": {"enabled": True, "check_grad_overflow": False}},
        "fp16 static": {"fp16": {"enabled": True, "loss_scale": 128}},
        "fp16 window 0 static": {
            "fp16": {"enabled": True, "loss_scale": 128, "loss_scale_window": 0}
        },
        "fp16 window 0 off": {"fp16": {"enabled": False, "loss_scale_window": 0}},
        "fp16 min 0.5": {"fp16": {"enabled": True, "min_loss_scale": 0.5}},
        "fp16 hysteresis 0": {"fp16": {"enabled": True, "hysteresis": 0}},
        "fp16 power 200": {"fp16": {"enabled": True, "initial_scale_power": 200}},
        "fp16 power -1": {"fp16": {"enabled": True, "initial_scale_power": -1}},
        "fp16 power 2000": {"fp16": {"enabled": True, "initial_scale_power": 2000}},
        "fp16 auto_cast": {"fp16": {"enabled": True, "auto_cast": True}},
        "comm FP16": {"communication_data_type": "FP16"},
        "comm bf16 s2": {"communication_data_type": "bf16", z: {"stage": 2}},
        "comm fp8": {"communication_data_type": "fp8"},
        "comm 16": {"communication_data_type": 16},
        "tag warn": {"checkpoint": {"tag_validation": "warn"}},
        "tag Ignore": {"checkpoint": {"tag_validation": "Ignore"}},
        "tag nope": {"checkpoint": {"tag_validation": "nope"}},
        "tag null": {"checkpoint": {"tag_validation": None}},
        "checkpoint null": {"checkpoint": None},
        "parallel write": {"checkpoint": {"parallel_write": {"pipeline_stage": True}}},
        "parallel write text": {"checkpoint": {"parallel_write": {"pipeline_stage": "x"}}},
        "universal": {"checkpoint": {"load_universal": True}},
        "checkpoint unknown": {"checkpoint": {"foo": 1}},
        "clip -1": {"gradient_clipping": -1},
        "clip auto": {"gradient_clipping": "auto"},
        "clip null": {"gradient_clipping": None},
        "spp 0": {"steps_per_print": 0},
        "spp null": {"steps_per_print": None},
        "wall text": {"wall_clock_breakdown": "true"},
        "wall 1": {"wall_clock_breakdown": 1},
        "prescale text": {"prescale_gradients": "false"},
        "zerosim section": {"zerosim": {"dtype": "float64", "collectives": "ring"}},
        "top-level capitalised": {"Gradient_Clipping": 1.0},
        "zero capitalised": {"Zero_Optimization": {"stage": 2}},
    }
    return [Case(f"section/{label}", {**base, **fragment}) for label, fragment in fragments.items()]


def builds_a_deepspeed_op(config: dict) -> bool:
    """True when ``deepspeed.initialize`` would load one of DeepSpeed's compiled optimizers
    (FusedAdam, CPU Adam, CPU Adagrad, CPU Lion) for ``config``: on a fresh machine that is a
    JIT build of a minute or more, so such configs stay out of the corpus (the corpus's Adam
    sections carry ``"torch_adam": true`` to avoid it). Switches are read as DeepSpeed reads
    them, by their truth."""
    section = config.get("optimizer")
    if not isinstance(section, dict) or not isinstance(section.get("type"), str):
        return False
    params = section.get("params") or {}
    if not isinstance(params, dict):
        return False
    zero = config.get("zero_optimization")
    zero = zero if isinstance(zero, dict) else {}
    offload = zero.get("offload_optimizer")
    cpu_step = bool(zero.get("cpu_offload")) or (
        isinstance(offload, dict) and offload.get("device") in ("cpu", "nvme")
    )
    name = section["type"].lower()
    if name in ("adam", "adamw") and not bool(params.get("torch_adam")):
        return cpu_step or not bool(params.get("amsgrad"))
    return name in ("adagrad", "lion") and cpu_step


# --- the keys DeepSpeed reads, from its code ------------------------------------------------

DSKEY_BASE = {"train_batch_size": 2, "optimizer": ADAM}


@functools.cache
def ds_keys() -> dict:
    """{key path: Key} of every key DeepSpeed 0.19.8's config readers and models read
    (tests/helpers/deepspeed_keys.py walks its code)."""
    return deepspeed_keys()


def flippable(path: tuple[str, ...]) -> bool:
    """A boolean key whose other value is worth a case: a switch (``enabled``), or a key that
    is not read only once a sibling ``enabled`` switch is on."""
    keys = ds_keys()
    parent = keys.get(path[:-1]) if len(path) > 1 else None
    return path[-1] == "enabled" or parent is None or "enabled" not in parent.children


def deepspeed_key_cases() -> list[Case]:
    """Every key DeepSpeed reads, at the default its code writes (DeepSpeed's parser only: at
    its default a key changes nothing), and every boolean switch flipped (both engines)."""
    cases = []
    for path, key in sorted(ds_keys().items()):
        if key.children or key.default is NO_DEFAULT:
            continue
        name = dotted(path)
        config = with_value(DSKEY_BASE, name, copy.deepcopy(key.default))
        cases.append(Case(f"dskey/{name}=default", config, initialize=False))
        if isinstance(key.default, bool) and flippable(path):
            cases.append(
                Case(f"dskey/{name}=flipped", with_value(DSKEY_BASE, name, not key.default))
            )
    return cases


def corpus() -> list[Case]:
    cases = mutations() + batch_cases() + optimizer_cases() + scheduler_cases() + section_cases()
    cases += deepspeed_key_cases()
    names = [case.name for case in cases]
    assert len(names) == len(set(names)), "case names must be unique"
    return [case for case in cases if not builds_a_deepspeed_op(case.config)]


# --- the two sides ---------------------------------------------------------------------------


def rescaled(config: dict, micro: int, accumulation: int) -> dict:
    """The config for one rank: the same micro-batch and accumulation, train = their product."""
    return {
        **config,
        "train_batch_size": micro * accumulation,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
    }


class _Mpu:
    """Just enough of an mpu for DeepSpeedConfig: the data-parallel world size."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def get_data_parallel_world_size(self) -> int:
        return self.world_size


def deepspeed_accepts(case: Case) -> tuple[bool, str]:
    from deepspeed.runtime.config import DeepSpeedConfig

    mpu = _Mpu(case.world_size) if case.world_size > 1 else None
    try:
        parsed = DeepSpeedConfig(copy.deepcopy(case.config), mpu=mpu)
        one = rescaled(
            case.config, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps
        )
        if case.initialize:
            model = torch.nn.Linear(4, 4)
            deepspeed.initialize(model=model, model_parameters=model.parameters(), config=one)
    except Exception as err:  # ValidationError, AssertionError, TypeError, ValueError, ...
        return False, f"{type(err).__name__}: {err}"[:300]
    finally:
        gc.enable()  # disable_python_gc: true turns Python's collector off for good
    return True, ""


def zerosim_accepts(case: Case) -> tuple[bool, ConfigError | None]:
    try:
        cfg = load_config(copy.deepcopy(case.config), case.world_size)
        one = rescaled(
            case.config, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
        )
        model = zerosim.nn.MLP([4, 4], seed=0)
        zerosim.initialize(model, one, comm=LocalWorld(1).comms()[0])
    except ConfigError as err:
        return False, err
    return True, None


# --- where zerosim differs, and why ----------------------------------------------------------


@dataclass(frozen=True)
class Difference:
    """Cases (``pattern`` matches their names) that DeepSpeed accepts and zerosim rejects
    (``stricter``), or the reverse, with the reason."""

    pattern: str
    stricter: bool
    reason: str


_TRUTH = (
    "DeepSpeed tests this switch for truth without looking at its type, so the string 'false' "
    "turns it on and 2 or 'x' pass as true; zerosim takes true/false or 0/1"
)
# First match wins: the specific rows come before the general ones.
DIFFERENCES: list[Difference] = [
    Difference(
        r"/(zero_optimization|fp16|bf16)(\.\w+)*=auto$",
        True,
        "DeepSpeed's pydantic sections drop 'auto' and use the default without a word; 'auto' "
        "is a placeholder the HuggingFace integration fills in, so zerosim says so instead",
    ),
    Difference(
        r"/gradient_clipping=|section/clip ",
        True,
        "DeepSpeed reads gradient_clipping unchecked and compares it with 0 at the first "
        "step: null and strings fail there, a negative value turns clipping off and true clips "
        "at 1.0, without a word",
    ),
    Difference(
        r"/steps_per_print=|section/spp 0",
        True,
        "DeepSpeed takes (step + 1) % steps_per_print at every step: 0, lists and strings fail "
        "there, true or negative values print every step, fractions on a cadence nobody wrote",
    ),
    Difference(
        r"/gradient_predivide_factor=",
        True,
        "DeepSpeed divides by it at every gradient reduction without checking it: 0, null and "
        "strings fail there, a negative factor flips the sign of the gradients, true is 1",
    ),
    Difference(
        r"/(train_batch_size|train_micro_batch_size_per_gpu|gradient_accumulation_steps)"
        r"=(bool|fraction)$|batch/\(True",
        True,
        "DeepSpeed only multiplies and compares the batch triple: true passes as 1, and a "
        "fractional micro-batch or accumulation count passes that check and fails in the data "
        "loader",
    ),
    Difference(
        r"optimizer\.params\.adam_w_mode=null",
        True,
        "DeepSpeed pops a null adam_w_mode as None and builds classic Adam instead of its "
        "default AdamW mode",
    ),
    Difference(
        r"/(wall_clock_breakdown|prescale_gradients|zero_allow_untested_optimizer|"
        r"checkpoint\.load_universal|optimizer\.params\.(adam_w_mode|torch_adam))="
        r"|section/(wall|prescale) text|optimizer/SGD@s1 allow='(true|yes)'",
        True,
        _TRUTH,
    ),
    Difference(
        r"/optimizer\.params\.\w+=",
        True,
        "torch's optimizer constructors check ranges, not types: true passes as 1.0 (lr, eps, "
        "momentum, ...) and a flag takes any truthy or falsy value (the string 'false' is true)",
    ),
    Difference(
        r"/optimizer(\.type)?=(null|empty|absent)$|optimizer/(no type|type null|absent)"
        r"|scheduler/without optimizer",
        True,
        "DeepSpeed ignores an optimizer section without a type and builds an engine without an "
        "optimizer, whose backward() then fails ('must provide optimizer during init in order "
        "to use backward'); zerosim asks for the optimizer at initialize",
    ),
    Difference(
        r"optimizer/Adadelta",
        True,
        "zerosim implements Adam, AdamW, SGD, Adagrad, RMSprop, Adamax, NAdam, RAdam, Lion, Lamb "
        "and Muon; "
        "DeepSpeed looks any other torch.optim name up",
    ),
    Difference(
        r"optimizer/Lamb(@s0|@s2\+allow| params)",
        False,
        "DeepSpeed builds FusedLamb, which its CPU accelerator lacks ('This op had not been "
        "implemented on CPU backend'); with a GPU DeepSpeed accepts these configs, as zerosim does",
    ),
    Difference(
        r"optimizer/Muon unknown key",
        True,
        "DeepSpeed's Muon reads only the keys of its two halves (and its Adam switches) and "
        "ignores any other without a word; zerosim refuses a key it would not act on",
    ),
    Difference(
        r"optimizer/[Ll]ion@",
        False,
        "DeepSpeed builds FusedLion, which its CPU accelerator lacks ('This op had not been "
        "implemented on CPU backend'); with a GPU DeepSpeed accepts these configs, as zerosim does",
    ),
    Difference(
        r"section/qw s3",
        False,
        "DeepSpeed's qwZ quantizer is not built for its CPU accelerator ('This op had not been "
        "implemented on CPU backend'); with a GPU DeepSpeed accepts this config, as zerosim does",
    ),
    Difference(
        r"/scheduler(\.type)?=(null|empty)$|scheduler/no type",
        True,
        "DeepSpeed ignores a scheduler section without a type, params included; zerosim asks "
        "for the type rather than drop the schedule silently",
    ),
    Difference(
        r"s0-fp32/scheduler\.params\.|scheduler/StepLR step 0",
        True,
        "torch's StepLR checks nothing at construction: a step_size of 0, null or a string "
        "fails at the first scheduler step, a negative or fractional one gives a schedule "
        "nobody wrote",
    ),
    Difference(
        r"/scheduler\.params\.\w+=|scheduler/WarmupLR type cos|scheduler/LRRangeTest staircase",
        True,
        "DeepSpeed's schedulers check only warmup_num_steps and the cycle and range-test step "
        "sizes: a negative learning rate or ratio is written into the optimizer, strings fail "
        "at the first step, an unknown warmup_type (even 'LINEAR') becomes 'log' with a "
        "warning, and lr_range_test_staircase is tested for truth ('false' turns it on)",
    ),
    Difference(
        r"section/(offload s0|offload_param s2)|(s3|s1-offload)/zero_optimization\.stage=",
        True,
        "DeepSpeed ignores offload_optimizer at stage 0 and offload_param below stage 3 without "
        "a word; zerosim refuses a key it would not act on",
    ),
    Difference(
        r"section/(qw s1|qg s2|hpz s2)"
        r"|dskey/zero_optimization\.zero_quantized_(weights|gradients)=",
        True,
        "DeepSpeed ignores the ZeRO++ keys below stage 3 without a word (ZeRO++ is built on "
        "ZeRO-3)",
    ),
    Difference(
        r"dskey/(managed_gradient_accumulation|torch_autocast\.enabled|autotuning\.enabled|"
        r"expert_parallel\.enabled|data_efficiency\.[\w.]*enabled|"
        r"zero_optimization\.zero_quantized_nontrainable_weights)=flipped",
        True,
        "a feature zerosim does not build that changes what is trained (client-managed "
        "accumulation, per-op autocast, the autotuner, which ends the job after profiling, expert "
        "parallelism, other samples or tokens, quantized frozen weights): DeepSpeed builds it, "
        "zerosim refuses rather than train something else",
    ),
    Difference(
        r"dskey/zero_optimization\.zenflow\.",
        True,
        "DeepSpeed takes a ZenFlow section at any stage (and uses it at stages 1-2); zerosim does "
        "not build ZenFlow and refuses the section",
    ),
    Difference(
        r"dskey/((tensorboard|wandb|comet)\.enabled|datastates_ckpt)=flipped",
        False,
        "DeepSpeed imports the monitor's or the checkpoint engine's package (tensorboard, wandb, "
        "comet_ml, datastates), which this machine lacks; with it DeepSpeed accepts, and zerosim "
        "accepts with a warning",
    ),
    Difference(
        r"dskey/aio\.use_gds=flipped",
        False,
        "GPUDirect Storage needs a CUDA accelerator ('GDS currently only supported for CUDA "
        "accelerator'); with one DeepSpeed accepts, and zerosim accepts with a warning",
    ),
    Difference(
        r"dskey/checkpoint\.writer\.\w+=flipped",
        False,
        "DeepSpeed's checkpoint writer reads the CROSS_SIZE variable its launcher sets, which a "
        "one-process test does not; under the launcher DeepSpeed accepts, and zerosim accepts "
        "with a warning",
    ),
    Difference(
        r"sub_group_size=zero|section/sub group 0",
        True,
        "DeepSpeed allows 0 (at stage 3 each parameter is then stepped on its own; stages 1-2 "
        "never read it); zerosim tiles the optimizer step by elements, and 0 cannot tile",
    ),
    Difference(
        r"section/bf16\+bfloat16",
        True,
        "DeepSpeed reads bf16 and ignores bfloat16 without a word; zerosim refuses one key "
        "given under both of its names",
    ),
    Difference(
        r"fp16\.hysteresis=(negative|zero)|section/fp16 hysteresis 0",
        True,
        "with hysteresis <= 0 DeepSpeed never lowers the loss scale (the count only goes down "
        "past 1), so every step after the first overflow is skipped",
    ),
    Difference(
        r"section/fp16 power 2000",
        True,
        "2**2000 is not a float: DeepSpeed fails at its first overflow, halving the scale",
    ),
]


# --- the test ---------------------------------------------------------------------------------


KNOWN_SECTIONS = {path.split(".")[0] for path in known_key_paths(Config)}


def names_a_key(err: ConfigError, config: dict) -> bool:
    """The message reads '<key path>: got <value>; allowed: <...>' with a key path of zerosim's
    or of the config."""
    if err.allowed is None or not str(err).startswith(f"{err.path}: "):
        return False
    return err.path.split(".")[0] in KNOWN_SECTIONS | set(config)


def test_corpus_is_accepted_and_rejected_as_deepspeed_does(deepspeed_world, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where DeepSpeed's monitors write, when a case turns one on
    cases = corpus()
    assert len(cases) >= 500
    disagreements = []
    unnamed = []
    unknown = []  # a key DeepSpeed reads that zerosim calls unknown
    used = set()
    agreed = {True: 0, False: 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for case in cases:
            ds, why = deepspeed_accepts(case)
            del caught[:]
            ours, err = zerosim_accepts(case)
            said = [str(w.message) for w in caught if "unknown config key" in str(w.message)]
            if case.name.startswith("dskey/") and said:
                unknown.append(f"{case.name}: {said}")
            if err is not None and not names_a_key(err, case.config):
                unnamed.append(f"{case.name}: {err}")
            if ds == ours:
                agreed[ds] += 1
                continue
            rows = [d for d in DIFFERENCES if re.search(d.pattern, case.name)]
            if rows and rows[0].stricter == ds:
                used.add(rows[0].pattern)
                continue
            side = (
                "DeepSpeed accepts, zerosim rejects" if ds else "zerosim accepts, DeepSpeed rejects"
            )
            disagreements.append(f"{case.name}: {side}: {why or err}")
    assert not disagreements, f"{len(disagreements)} of {len(cases)}:\n" + "\n".join(disagreements)
    assert not unknown, "\n".join(unknown)
    assert not unnamed, "\n".join(unnamed)
    assert {d.pattern for d in DIFFERENCES} == used, "rows no case needs any more"
    assert min(agreed.values()) >= 300, agreed  # both verdicts well represented


# --- every key DeepSpeed reads is one zerosim declares ------------------------------------------


def zerosim_declared(cls: type = Config, prefix: tuple[str, ...] = ()) -> dict:
    """{key path: knob Field, or None for a legacy or removed key} of every key zerosim reads,
    each section under each of its names."""
    declared: dict[tuple[str, ...], Field | None] = {}
    for key in (*getattr(cls, "LEGACY_KEYS", ()), *getattr(cls, "REMOVED_KEYS", ())):
        declared[(*prefix, key)] = None
    if cls is Config:
        declared.update({(key,): None for key in REMOVED_TOP_LEVEL_KEYS})
    for f in knob_fields(cls):
        for name in (f.name, *f.metadata["aliases"]):
            declared[(*prefix, name)] = f
            nested = f.metadata["parser"].section
            if nested is not None:
                declared.update(zerosim_declared(nested, (*prefix, name)))
    return declared


# Keys DeepSpeed reads that zerosim does not declare, each with the reason. Empty: a key added
# here must say why zerosim may ignore it.
NOT_DECLARED: dict[str, str] = {}


def answers_as_a_whole(path: tuple[str, ...], f: Field) -> bool:
    """Whether zerosim's key at ``path``, whose value DeepSpeed reads key by key, answers the
    whole value: a ``whole_section`` (its ``reproduces`` looks into the value), or a key that
    refuses any value (``zero_optimization.zenflow``)."""
    rule = f.metadata["reproduces"]
    if callable(rule) and rule is not any_value:
        return True
    try:
        load_config(with_value(DSKEY_BASE, dotted(path), {}), 1)
    except ConfigError as err:
        return err.path == dotted(path)
    return False


def test_every_key_deepspeed_reads_is_declared_by_zerosim():
    """No key DeepSpeed 0.19.8 reads is unknown to zerosim: each is declared (acted on, warned
    about or refused, docs/config.md), under a section zerosim answers as a whole, or listed in
    NOT_DECLARED with its reason. A key DeepSpeed adds fails here until zerosim declares it."""
    declared = zerosim_declared()
    missing, whole = [], {}
    for path in sorted(ds_keys()):
        if path in declared or dotted(path) in NOT_DECLARED:
            continue
        above = [path[:d] for d in range(len(path) - 1, 0, -1) if path[:d] in declared]
        f = declared[above[0]] if above else None
        if f is not None and f.metadata["parser"].section is None:
            whole[above[0]] = f
            continue
        missing.append(dotted(path))
    assert not missing, f"DeepSpeed reads keys zerosim does not declare: {missing}"
    vague = [dotted(p) for p, f in whole.items() if not answers_as_a_whole(p, f)]
    assert not vague, f"zerosim takes these sections whole without answering them: {vague}"
    stale = [key for key in NOT_DECLARED if tuple(key.split(".")) not in ds_keys()]
    assert not stale, f"NOT_DECLARED rows DeepSpeed no longer reads: {stale}"


def test_every_deepspeed_key_zerosim_declares_is_one_deepspeed_reads():
    """The other way round (the zerosim section aside): no key zerosim declares under
    DeepSpeed's name is one DeepSpeed does not read, or reads inside a value it takes whole
    (``optimizer.params``, ``scheduler.params``)."""
    keys = ds_keys()
    leaves = {path for path, key in keys.items() if not key.children}
    invented = [
        dotted(path)
        for path in zerosim_declared()
        if path[0] != "zerosim"
        and path not in keys
        and not any(path[:d] in leaves for d in range(1, len(path)))
    ]
    assert not invented, invented


def test_the_walk_of_deepspeeds_code_finds_keys_of_every_kind():
    """Keys read by each kind of reader: get_scalar_param, dict.get, [] and `in`, pydantic
    fields and aliases, nested models, a key name passed as an argument, a local import, a
    loop over a constant dict. If the walk broke, the tests above would pass on nothing."""
    keys = {dotted(path) for path in ds_keys()}
    assert len(keys) >= 300
    for expected in (
        "gradient_allreduce_op",  # get_scalar_param
        "seq_parallel_communication_data_type",  # the key passed as an argument
        "checkpoint.load_universal",  # dict.get on a section
        "sequence_parallel_size",  # `in config` in DeepSpeedConfig.__init__
        "vocabulary_size",  # self._param_dict.get in _do_warning_check
        "zero_optimization.stage3_prefetch_bucket_size",  # a pydantic alias
        "zero_optimization.offload_optimizer.device",  # a nested model
        "bfloat16.enabled",  # a model built from the legacy name
        "tensorboard.enabled",  # a model built from a dict comprehension
        "expert_parallel.top_k",  # a reader imported inside a function
        "autotuning.model_info.num_params",  # a loop over a constant dict
        "data_efficiency.data_sampling.curriculum_learning.enabled",
        "timers.throughput.synchronized",
        "nebula",  # removed, and refused
        "data_parallel_size",  # `in config` and config[...] in deepspeed.initialize
        "tensor_parallel.autotp_size",  # .get on .get in deepspeed.initialize
    ):
        assert expected in keys, expected


def _zerosim_default(path: tuple[str, ...], declared: dict) -> object:
    node: object = load_config(DSKEY_BASE, 1)
    for depth in range(1, len(path) + 1):
        node = getattr(node, declared[path[:depth]].name)
    return node


def _same(ours: object, theirs: object) -> bool:
    if isinstance(ours, tuple):
        ours = list(ours)
    if hasattr(ours, "items"):
        ours = dict(ours)
    return ours == theirs and isinstance(ours, bool) == isinstance(theirs, bool)


# DeepSpeed's default where zerosim knowingly reads another (tests/test_deepspeed_defaults.py
# and docs/config.md give the reasons).
OTHER_DEFAULT = {
    "zero_optimization.overlap_comm": "DeepSpeed's None is resolved to stage == 3 by its validator",
    "zero_optimization.leaf_module": "a section: its keys are compared one by one",
    "bf16": "DeepSpeed's None is an absent section, as zerosim's disabled one",
}


def test_every_declared_key_has_the_default_deepspeeds_code_writes():
    """For each key DeepSpeed reads with a default written in its code (a reader's default
    argument, a pydantic field's default) and zerosim declares, zerosim's default is it."""
    declared = zerosim_declared()
    differ = []
    for path, key in ds_keys().items():
        f = declared.get(path)
        if key.default is NO_DEFAULT or f is None or f.metadata["parser"].section is not None:
            continue
        if dotted(path) in OTHER_DEFAULT or path[0] in BATCH_KEYS:
            continue
        rule = f.metadata["reproduces"]
        if f.default is None and callable(rule) and rule(key.default):
            continue  # a whole section zerosim keeps as None when absent: DeepSpeed's default
            # does nothing, as its absence does
        ours = _zerosim_default(path, declared)
        if not _same(ours, key.default):
            differ.append(f"{dotted(path)}: zerosim {ours!r}, DeepSpeed {key.default!r}")
    assert not differ, "\n".join(differ)


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def test_the_key_walk_evaluates_names_attributes_and_literals_only():
    """The walk reads constants out of DeepSpeed's source: it must not run other expressions
    (a call there would run DeepSpeed's, or anyone's, code at test time)."""
    import ast

    from deepspeed_keys import FunctionBody, KeyWalk

    ran = []
    body = FunctionBody(
        KeyWalk(), test_the_key_walk_evaluates_names_attributes_and_literals_only, {}, {}
    )
    body.names.update(run=lambda: ran.append(1) or "KEY", consts=re, KEY="train_batch_size")

    def value(source: str):
        return body.value(ast.parse(source, mode="eval").body)

    assert value("run()") is NO_DEFAULT and value("[run()]") is NO_DEFAULT and ran == []
    assert value("KEY") == "train_batch_size" and value("consts.IGNORECASE") == re.IGNORECASE
    assert value("-1") == -1 and value("(KEY, 2)") == ["train_batch_size", 2]
    assert value("{KEY: None}") == {"train_batch_size": None} and value("1 + 1") is NO_DEFAULT
