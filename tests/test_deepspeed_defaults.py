"""zerosim's defaults against DeepSpeed 0.19.8's, read from DeepSpeed's code at test time.

Every DeepSpeed key zerosim's config reads gets its default from where DeepSpeed keeps it: the
``*_DEFAULT`` constants of ``deepspeed.runtime.constants`` for the keys its ``DeepSpeedConfig``
reads with ``dict.get``, a default instance of the pydantic model for ``zero_optimization``,
its offload sections, ``fp16`` and ``bf16`` (so validators such as ``overlap_comm``'s run), the
loss scaler DeepSpeed builds, the signatures of the optimizer and scheduler classes a config
section builds, and the bounds of the pydantic fields. No number is copied here. The
deliberate differences are listed in ``DELIBERATE`` with their reasons (docs/config.md too).
"""

from __future__ import annotations

import inspect
import warnings

import pytest

import zerosim.optim as zoptim
import zerosim.optim.lr_scheduler as zsched
from zerosim.config import Config, load_config
from zerosim.config.features import DeepSpeedFeatures
from zerosim.config.sections import (
    BF16Config,
    FP16Config,
    LeafModuleConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ZeroConfig,
)
from zerosim.config.values import knob_fields
from zerosim.errors import ConfigError

deepspeed = pytest.importorskip(
    "deepspeed", reason="DeepSpeed is the oracle here: pip install -e '.[test]' installs it"
)
torch = pytest.importorskip("torch")

constants = pytest.importorskip("deepspeed.runtime.constants")
lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
DeepSpeedFP16Config = deepspeed.runtime.precision_config.DeepSpeedFP16Config
DeepSpeedBF16Config = deepspeed.runtime.precision_config.DeepSpeedBF16Config
DeepSpeedZeroConfig = deepspeed.runtime.zero.config.DeepSpeedZeroConfig
DeepSpeedZeroLeafModuleConfig = (
    deepspeed.runtime.zero.leaf_module_config.DeepSpeedZeroLeafModuleConfig
)
DeepSpeedZeroOffloadOptimizerConfig = (
    deepspeed.runtime.zero.offload_config.DeepSpeedZeroOffloadOptimizerConfig
)
DeepSpeedZeroOffloadParamConfig = (
    deepspeed.runtime.zero.offload_config.DeepSpeedZeroOffloadParamConfig
)

BATCH = {"train_batch_size": 8}

# Where zerosim knowingly differs from DeepSpeed's default or bound, and why.
DELIBERATE = {
    "zero_optimization.sub_group_size >= 0": (
        "zerosim tiles the optimizer step by elements and 0 cannot tile (DeepSpeed's stage 3 "
        "then steps each parameter on its own; stages 1-2 never read it): zerosim asks for >= 1"
    ),
    "zero_optimization.offload_optimizer / offload_param": (
        "DeepSpeed's default is no section (None); zerosim's is a section whose device is "
        "'none', which means the same; its other keys are compared with DeepSpeed's section"
    ),
    "zerosim.optim.Lion()": (
        "the torch-like class keeps the Lion paper's and lion-pytorch's defaults (lr 1e-4, betas "
        "(0.9, 0.99)) that users of that API expect; a config's Lion section gets DeepSpeed's"
    ),
}


def _load(config: dict, world_size: int = 1) -> Config:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return load_config(config, world_size)


# --- top level and checkpoint: DeepSpeed's *_DEFAULT constants ------------------------------

TOP_LEVEL = {
    "train_batch_size": constants.TRAIN_BATCH_SIZE_DEFAULT,
    "train_micro_batch_size_per_gpu": constants.TRAIN_MICRO_BATCH_SIZE_PER_GPU_DEFAULT,
    "gradient_accumulation_steps": constants.GRADIENT_ACCUMULATION_STEPS_DEFAULT,
    "gradient_clipping": constants.GRADIENT_CLIPPING_DEFAULT,
    "steps_per_print": constants.STEPS_PER_PRINT_DEFAULT,
    "wall_clock_breakdown": constants.WALL_CLOCK_BREAKDOWN_DEFAULT,
    "prescale_gradients": constants.PRESCALE_GRADIENTS_DEFAULT,
    "gradient_predivide_factor": constants.GRADIENT_PREDIVIDE_FACTOR_DEFAULT,
    "gradient_allreduce_op": constants.GRADIENT_ALLREDUCE_OP_DEFAULT,
    "communication_data_type": constants.COMMUNICATION_DATA_TYPE_DEFAULT,
    "zero_allow_untested_optimizer": constants.ZERO_ALLOW_UNTESTED_OPTIMIZER_DEFAULT,
    "zero_force_ds_cpu_optimizer": constants.ZERO_FORCE_DS_CPU_OPTIMIZER_DEFAULT,
    "optimizer": constants.OPTIMIZER_TYPE_DEFAULT,
    "scheduler": constants.SCHEDULER_TYPE_DEFAULT,
}
CHECKPOINT = {
    "tag_validation": constants.CHECKPOINT_TAG_VALIDATION_DEFAULT,
    "load_universal": constants.LOAD_UNIVERSAL_CHECKPOINT_DEFAULT,
    "use_node_local_storage": constants.USE_NODE_LOCAL_STORAGE_CHECKPOINT_DEFAULT,
}


def test_every_deepspeed_top_level_key_has_deepspeeds_default():
    """The batch triple's defaults are None (inferred); the others are the declared ones."""
    declared = {f.name: f.default for f in knob_fields(Config)}
    for key, theirs in TOP_LEVEL.items():
        assert declared[key] == theirs, key
        assert isinstance(declared[key], bool) == isinstance(theirs, bool), key
    # the keys of features zerosim does not build, and the legacy allgather_size, are compared
    # with the defaults DeepSpeed's readers write, for every key they read, in
    # tests/test_deepspeed_config.py
    generic = {f.name for f in knob_fields(DeepSpeedFeatures)} | {"allgather_size"}
    assert {f.name for f in knob_fields(Config)} - set(TOP_LEVEL) - generic == {
        "zero_optimization",
        "fp16",
        "bf16",
        "checkpoint",
        "zerosim",
    }  # the sections, compared below


def test_checkpoint_keys_have_deepspeeds_defaults():
    checkpoint = _load(BATCH).checkpoint
    for key, theirs in CHECKPOINT.items():
        assert getattr(checkpoint, key) == theirs, key
    pipeline_stage = constants.CHECKPOINT_PARALLEL_WRITE_PIPELINE_STAGE_DEFAULT
    assert checkpoint.parallel_write.pipeline_stage == pipeline_stage


# --- pydantic sections: a default instance of DeepSpeed's model -----------------------------

SECTIONS = [
    (ZeroConfig, DeepSpeedZeroConfig),
    (OffloadOptimizerConfig, DeepSpeedZeroOffloadOptimizerConfig),
    (OffloadParamConfig, DeepSpeedZeroOffloadParamConfig),
    (LeafModuleConfig, DeepSpeedZeroLeafModuleConfig),
    (FP16Config, DeepSpeedFP16Config),
    (BF16Config, DeepSpeedBF16Config),
]


def deepspeed_field(model: type, key: str) -> str | None:
    """The name of DeepSpeed's field that reads JSON key ``key`` (its name or its alias)."""
    for name, field in model.model_fields.items():
        if key in (name, field.alias):
            return name
    return None


def plain(value: object) -> object:
    """DeepSpeed's value as zerosim stores it: enums to their value, lists to tuples, paths."""
    if hasattr(value, "value") and not isinstance(value, bool | int | float | str):
        return value.value
    if isinstance(value, list):
        return tuple(value)
    return value


@pytest.mark.parametrize("ours, theirs", SECTIONS, ids=lambda cls: cls.__name__)
def test_every_section_key_has_deepspeeds_default(ours, theirs):
    default = theirs()
    zerosim_default = ours()
    legacy = set(getattr(ours, "LEGACY_KEYS", ()))
    for f in knob_fields(ours):
        if f.metadata["parser"].section is not None:
            continue  # nested sections are compared on their own
        name = deepspeed_field(theirs, f.name) or deepspeed_field(theirs, f.metadata["aliases"][0])
        assert name is not None, f"{theirs.__name__} has no key {f.name}"
        assert getattr(zerosim_default, f.name) == plain(getattr(default, name)), f.name
    # and zerosim declares every key DeepSpeed's model reads (legacy ones are rewritten)
    keys = {f.name for f in knob_fields(ours)} | {
        a for f in knob_fields(ours) for a in f.metadata["aliases"]
    }
    for name, field in theirs.model_fields.items():
        assert {name, field.alias} & (keys | legacy), f"{theirs.__name__}.{name}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_overlap_comm_default_depends_on_the_stage_as_in_deepspeed(stage):
    ours = _load({**BATCH, "zero_optimization": {"stage": stage}}).zero_optimization.overlap_comm
    assert ours is DeepSpeedZeroConfig(stage=stage).overlap_comm


def test_absent_offload_sections_mean_deepspeeds_none():
    """DELIBERATE: a section with device 'none' stands for DeepSpeed's absent section."""
    zero = DeepSpeedZeroConfig()
    assert zero.offload_optimizer is None and zero.offload_param is None
    ours = _load(BATCH).zero_optimization
    assert ours.offload_optimizer.device == ours.offload_param.device == "none"


@pytest.mark.parametrize("ours, theirs", SECTIONS, ids=lambda cls: cls.__name__)
def test_integer_bounds_are_deepspeeds(ours, theirs):
    """For each bounded integer field of DeepSpeed's model, the smallest value DeepSpeed accepts
    is accepted here and the one below it rejected, except the DELIBERATE ones."""
    for name, field in theirs.model_fields.items():
        bounds = [m for m in field.metadata if hasattr(m, "ge") or hasattr(m, "gt")]
        if field.annotation is not int or not bounds:
            continue
        lowest = getattr(bounds[0], "ge", None)
        lowest = getattr(bounds[0], "gt", -1) + 1 if lowest is None else lowest
        key = field.alias or name
        path = {ZeroConfig: "zero_optimization"}.get(ours, "")
        if ours is OffloadOptimizerConfig:
            path = "zero_optimization.offload_optimizer"
        elif ours is OffloadParamConfig:
            path = "zero_optimization.offload_param"

        def accepts(value, key=key, path=path):
            section = {key: value}
            for part in reversed(path.split(".")):
                section = {part: section}
            zero = section.setdefault("zero_optimization", {})
            zero.setdefault("stage", 3)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    load_config({**BATCH, **section}, 1)
            except ConfigError:
                return False
            return True

        if f"{path}.{key} >= {lowest}" in DELIBERATE:
            assert not accepts(lowest), key
            continue
        assert accepts(lowest) and not accepts(lowest - 1), key


# --- the loss scaler DeepSpeed builds --------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_enabled_alone_scales_as_deepspeed_does(stage):
    """Stages 1-3: the DynamicLossScaler of ``dynamic_loss_scale_args()``; stage 0: the
    ``LossScaleConfig`` FP16_Optimizer steps (its scale, window and minimum; no hysteresis)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaleConfig

    section = DeepSpeedFP16Config(enabled=True)
    args = section.dynamic_loss_scale_args()
    ours = _load({**BATCH, "fp16": {"enabled": True}, "zero_optimization": {"stage": stage}})
    settings = ours.loss_scaler()
    if stage == 0:
        theirs = LossScaleConfig(
            torch.half, True, 0, args, initial_dynamic_scale=section.initial_dynamic_scale()
        )
        got = (settings.init_scale, settings.scale_window, settings.min_scale)
        assert got == (theirs.cur_scale, theirs.scale_window, theirs.min_loss_scale)
        assert (settings.hysteresis, settings.raise_error_at_min_scale) == (1, False)
        return
    assert settings.dynamic
    assert settings.init_scale == args["init_scale"]
    assert settings.scale_window == args["scale_window"]
    assert settings.min_scale == args["min_scale"]
    assert settings.hysteresis == args["delayed_shift"]
    assert settings.consecutive_hysteresis == args["consecutive_hysteresis"]


# --- optimizers and schedulers a config section builds ---------------------------------------


def signature_defaults(cls: type, skip: tuple[str, ...] = ()) -> dict:
    parameters = inspect.signature(cls.__init__).parameters.items()
    return {
        name: p.default
        for name, p in parameters
        if p.default is not inspect.Parameter.empty and name not in skip
    }


def zerosim_hyperparameters(section: dict) -> dict:
    """What zerosim's engine builds from an ``optimizer`` section: class defaults + kwargs."""
    optimizer = _load({**BATCH, "optimizer": section}).optimizer
    cls = getattr(zoptim, optimizer.class_name)
    return {**signature_defaults(cls), **optimizer.kwargs()}


def as_tuple(value: object) -> object:
    return tuple(value) if isinstance(value, list | tuple) else value


@pytest.mark.parametrize(
    "section, theirs",
    [
        ({"type": "Adam"}, lambda: deepspeed.ops.adam.FusedAdam),
        ({"type": "AdamW"}, lambda: deepspeed.ops.adam.FusedAdam),
        (
            {"type": "Adam", "params": {"torch_adam": True, "adam_w_mode": False}},
            lambda: torch.optim.Adam,
        ),
        ({"type": "AdamW", "params": {"torch_adam": True}}, lambda: torch.optim.AdamW),
        ({"type": "Adagrad"}, lambda: torch.optim.Adagrad),
        ({"type": "Lion"}, lambda: deepspeed.ops.lion.FusedLion),
        ({"type": "SGD"}, lambda: torch.optim.SGD),
        ({"type": "RMSprop"}, lambda: torch.optim.RMSprop),
        ({"type": "Adamax"}, lambda: torch.optim.Adamax),
        ({"type": "NAdam"}, lambda: torch.optim.NAdam),
        ({"type": "RAdam"}, lambda: torch.optim.RAdam),
    ],
    ids=lambda v: v.get("type", "") + str(v.get("params", "")) if isinstance(v, dict) else "",
)
def test_optimizer_sections_get_the_defaults_of_the_class_deepspeed_builds(section, theirs):
    """FusedAdam / FusedLion for DeepSpeed's own types, torch.optim's classes otherwise."""
    import deepspeed.ops.adam  # noqa: F401
    import deepspeed.ops.lion  # noqa: F401

    ours = zerosim_hyperparameters(section)
    for name, value in signature_defaults(theirs()).items():
        if name in ours:
            assert as_tuple(ours[name]) == as_tuple(value), name


def test_adam_w_mode_default_is_deepspeeds():
    from deepspeed.runtime.config import ADAM_W_MODE_DEFAULT

    assert (
        _load({**BATCH, "optimizer": {"type": "Adam"}}).optimizer.adam_w_mode is ADAM_W_MODE_DEFAULT
    )


def test_lion_class_keeps_the_papers_defaults_deliberately():
    """DELIBERATE: zerosim.optim.Lion() is the torch-like class; a config section is DeepSpeed's."""
    ours = signature_defaults(zoptim.Lion)
    theirs = signature_defaults(deepspeed.ops.lion.FusedLion)
    assert (ours["lr"], ours["betas"]) != (theirs["lr"], theirs["betas"])
    assert "zerosim.optim.Lion()" in DELIBERATE


@pytest.mark.parametrize(
    "name", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"]
)
def test_deepspeed_schedulers_have_deepspeeds_parameters_and_defaults(name):
    ours = getattr(zsched, name)
    theirs = getattr(lr_schedules, name)
    assert list(inspect.signature(ours.__init__).parameters) == list(
        inspect.signature(theirs.__init__).parameters
    )
    assert signature_defaults(ours) == signature_defaults(theirs)
