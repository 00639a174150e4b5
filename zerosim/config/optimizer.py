"""The ``optimizer`` and ``scheduler`` sections: a type name and its parameters.

Type names follow DeepSpeed's lookup: its own optimizers (Adam, AdamW, Adagrad, Lion, Lamb,
Muon) match in
any case, because DeepSpeed lower-cases those names; every other optimizer name, and every
scheduler name, is looked up in ``torch.optim`` / DeepSpeed's ``lr_schedules`` as written, so
it must match exactly ('sgd' and 'warmuplr' fail in DeepSpeed, and here).

Optimizer hyperparameters are checked here, by name and range, with the rules of the
torch.optim constructors that ``zerosim.optim`` mirrors, plus DeepSpeed's two Adam switches:

- ``adam_w_mode`` (default true): type ``Adam`` with ``adam_w_mode`` steps with decoupled
  weight decay (AdamW), as DeepSpeed's FusedAdam does. Type ``AdamW`` is always decoupled
  (DeepSpeed: ``effective_adam_w_mode = name == "adamw" or adam_w_mode``).
- ``torch_adam`` (default false): DeepSpeed's choice between torch's Adam and FusedAdam. The
  only difference zerosim keeps is the default ``weight_decay``: FusedAdam's is 0.0 even in
  AdamW mode, torch.optim.AdamW's is 0.01.

- ``Lamb``: FusedLamb's arguments; ``amsgrad`` must be false.
- ``Muon``: the keys DeepSpeed's engine reads for its two halves (``param_groups``): lr,
  momentum, weight_decay, ns_method for Muon; lr, betas, eps, weight_decay for the auxiliary
  Adam; muon_lr / adam_lr override lr per half; adam_w_mode and torch_adam as for Adam
  (torch_adam only picks DeepSpeed's Adam class, the same arithmetic here). DeepSpeed ignores
  any other key of a Muon section; zerosim refuses it.

Scheduler parameters are checked by the scheduler builder; here only the section's shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from zerosim.config.values import (
    Parser,
    Section,
    as_finite_float,
    as_mapping,
    boolean,
    choice,
    flag,
    join,
    knob,
    number,
)
from zerosim.errors import ConfigError

# DeepSpeed's own optimizer names (matched in any case) and torch.optim names (matched exactly).
DEEPSPEED_OPTIMIZERS = ("Adam", "AdamW", "Adagrad", "Lion", "Lamb", "Muon")
TORCH_OPTIMIZERS = ("SGD", "RMSprop", "Adamax", "NAdam", "RAdam")
OPTIMIZER_TYPES = DEEPSPEED_OPTIMIZERS + TORCH_OPTIMIZERS
# DeepSpeed's ZERO_SUPPORTED_OPTIMIZERS among zerosim's: any other type at ZeRO stage >= 1
# needs "zero_allow_untested_optimizer": true (deepspeed/runtime/zero/utils.py; FusedLamb is not
# on the list, MuonWithAuxAdam is added to it when Muon is imported).
ZERO_SUPPORTED_OPTIMIZERS = ("Adam", "AdamW", "Adagrad", "Lion", "Muon")
# Defaults of DeepSpeed's Lion (FusedLion / DeepSpeedCPULion), which a config section builds.
DEEPSPEED_LION_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999)}
DEEPSPEED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
TORCH_SCHEDULERS = (
    "StepLR",
    "MultiStepLR",
    "ConstantLR",
    "LinearLR",
    "ExponentialLR",
    "PolynomialLR",
    "CosineAnnealingLR",
    "CosineAnnealingWarmRestarts",
    "CyclicLR",
    "OneCycleLR",
    "ReduceLROnPlateau",
)
# torch schedulers whose arguments are Python callables or other schedulers: not JSON.
PYTHON_ONLY_SCHEDULERS = ("LambdaLR", "MultiplicativeLR", "SequentialLR", "ChainedScheduler")
DEEPSPEED_ONLY_KEYS = ("adam_w_mode", "torch_adam")
# DeepSpeed's Muon config (engine._muon_param_groups): the keys each half of the split reads,
# and the per-half learning rates that override "lr".
MUON_HALF_KEYS = ("lr", "momentum", "weight_decay", "ns_method")
ADAM_HALF_KEYS = ("lr", "betas", "eps", "weight_decay")
MUON_LR_KEYS = {True: "muon_lr", False: "adam_lr"}
# Name parts that keep a matrix out of Muon (deepspeed.set_optimizer_flags).
NOT_MUON = ("embed", "lm_head")


def _betas() -> Parser:
    allowed = "two numbers [beta1, beta2], each in [0, 1)"

    def convert(value: Any, path: str) -> tuple[float, float]:
        if not isinstance(value, list | tuple) or len(value) != 2:
            raise ConfigError(path, value, allowed)
        for beta in value:
            as_float = as_finite_float(beta)
            if as_float is None or not 0.0 <= as_float < 1.0:
                raise ConfigError(path, value, allowed)
        return (float(value[0]), float(value[1]))

    return Parser(allowed, convert)


_NONNEGATIVE = number(0)
_ANY_NUMBER = number()
_FLAG = boolean()
_SWITCH = flag()  # DeepSpeed's own switches: it pops them and tests their truth
_ADAM = {
    "lr": _NONNEGATIVE,
    "betas": _betas(),
    "eps": _NONNEGATIVE,
    "weight_decay": _NONNEGATIVE,
    "amsgrad": _FLAG,
    "maximize": _FLAG,
    "adam_w_mode": _SWITCH,
    "torch_adam": _SWITCH,
}
_ADAM_FAMILY = {
    "lr": _NONNEGATIVE,
    "betas": _betas(),
    "eps": _NONNEGATIVE,
    "weight_decay": _NONNEGATIVE,
    "maximize": _FLAG,
}
# Per optimizer type: hyperparameter name -> parser (torch.optim's names and range checks).
HYPERPARAMETERS: dict[str, dict[str, Parser]] = {
    "Adam": _ADAM,
    "AdamW": _ADAM,
    "SGD": {
        "lr": _NONNEGATIVE,
        "momentum": _NONNEGATIVE,
        "dampening": _ANY_NUMBER,
        "weight_decay": _NONNEGATIVE,
        "nesterov": _FLAG,
        "maximize": _FLAG,
    },
    "Adagrad": {
        "lr": _NONNEGATIVE,
        "lr_decay": _NONNEGATIVE,
        "weight_decay": _NONNEGATIVE,
        "initial_accumulator_value": _NONNEGATIVE,
        "eps": _NONNEGATIVE,
        "maximize": _FLAG,
    },
    "RMSprop": {
        "lr": _NONNEGATIVE,
        "alpha": _NONNEGATIVE,
        "eps": _NONNEGATIVE,
        "weight_decay": _NONNEGATIVE,
        "momentum": _NONNEGATIVE,
        "centered": _FLAG,
        "maximize": _FLAG,
    },
    "Adamax": _ADAM_FAMILY,
    "NAdam": {**_ADAM_FAMILY, "momentum_decay": _NONNEGATIVE, "decoupled_weight_decay": _FLAG},
    "RAdam": {**_ADAM_FAMILY, "decoupled_weight_decay": _FLAG},
    "Lion": {"lr": _NONNEGATIVE, "betas": _betas(), "weight_decay": _NONNEGATIVE},
    # FusedLamb's arguments (max_grad_norm is refused for every type, amsgrad below)
    "Lamb": {
        "lr": _NONNEGATIVE,
        "bias_correction": _FLAG,
        "betas": _betas(),
        "eps": _NONNEGATIVE,
        "eps_inside_sqrt": _FLAG,
        "weight_decay": _NONNEGATIVE,
        "max_coeff": _NONNEGATIVE,
        "min_coeff": _NONNEGATIVE,
        "amsgrad": _FLAG,
    },
    # what DeepSpeed reads for Muon: both halves' keys, the per-half lr, its Adam switches
    "Muon": {
        "lr": _NONNEGATIVE,
        "momentum": _NONNEGATIVE,
        "weight_decay": _NONNEGATIVE,
        "ns_method": choice("gram", "standard", any_case=False),
        "betas": _betas(),
        "eps": _NONNEGATIVE,
        "muon_lr": _NONNEGATIVE,
        "adam_lr": _NONNEGATIVE,
        "adam_w_mode": _SWITCH,
        "torch_adam": _SWITCH,
        "per_head_muon": _SWITCH,
    },
}


def check_hyperparameters(kind: str, params: Mapping[str, Any], path: str) -> dict[str, Any]:
    """Validate the hyperparameters of optimizer ``kind``; returns them converted."""
    known = HYPERPARAMETERS[kind]
    if "max_grad_norm" in params:
        raise ConfigError(
            join(path, "max_grad_norm"),
            params["max_grad_norm"],
            "nothing: clip with the top-level key gradient_clipping (DeepSpeed rejects it too)",
        )
    for name, value in params.items():
        if name not in known:
            allowed = f"a hyperparameter of {kind}: {sorted(known)}"
            raise ConfigError(join(path, name), value, allowed)
    parsed = {name: known[name](value, join(path, name)) for name, value in params.items()}
    if kind == "Lamb" and parsed.get("amsgrad", False):
        raise ConfigError(
            join(path, "amsgrad"), True, "false (DeepSpeed's FusedLamb raises on AMSGrad)"
        )
    if kind == "Muon" and parsed.get("per_head_muon", False):
        raise ConfigError(
            join(path, "per_head_muon"),
            True,
            "false: DeepSpeed tags attention projections for per-head Newton-Schulz from a "
            "HuggingFace model config and raises where it can tag none, as for zerosim's models "
            "(no such config; GPT's fused c_attn); zerosim orthogonalizes each matrix whole",
        )
    if kind == "SGD" and parsed.get("nesterov", False):
        if parsed.get("momentum", 0.0) <= 0 or parsed.get("dampening", 0.0) != 0:
            raise ConfigError(
                join(path, "nesterov"),
                True,
                "false unless momentum > 0 and dampening == 0 (torch.optim.SGD's rule)",
            )
    return parsed


def _optimizer_type() -> Parser:
    ours = ", ".join(repr(name) for name in DEEPSPEED_OPTIMIZERS)
    torch_names = ", ".join(repr(name) for name in TORCH_OPTIMIZERS)
    allowed = (
        f"one of {ours} (any case: DeepSpeed's own optimizers) or {torch_names} (exactly as "
        "written: DeepSpeed looks torch.optim names up as given)"
    )
    by_lower = {name.lower(): name for name in DEEPSPEED_OPTIMIZERS}

    def convert(value: Any, path: str) -> str:
        if isinstance(value, str) and value.lower() in by_lower:
            return by_lower[value.lower()]
        if isinstance(value, str) and value in TORCH_OPTIMIZERS:
            return value
        raise ConfigError(path, value, allowed)

    return Parser(allowed, convert)


def _json_object() -> Parser:
    def convert(value: Any, path: str) -> Mapping[str, Any]:
        return as_mapping(value, path)

    return Parser("a JSON object (dict) with string keys", convert)


def check_json_value(value: Any, path: str) -> None:
    """Raise ConfigError unless ``value`` is plain JSON: str, bool, null, finite number,
    list or string-keyed object of those (what a scheduler builder can receive)."""
    if isinstance(value, str | bool) or value is None:
        return
    if isinstance(value, Mapping):
        for key, item in as_mapping(value, path).items():
            check_json_value(item, join(path, key))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            check_json_value(item, f"{path}[{index}]")
    elif as_finite_float(value) is None:
        allowed = "a JSON value: string, finite number, bool, null, list or object"
        raise ConfigError(path, value, allowed)


@dataclass(frozen=True)
class OptimizerConfig(Section):
    """``optimizer``: ``type`` (required) and ``params`` (a read-only mapping)."""

    type: str = knob(None, _optimizer_type(), "required when the section is given")
    params: Mapping[str, Any] = knob(None, _json_object(), "hyperparameters, checked per type")
    legacy_fusion: bool = knob(
        False,
        flag(),
        "fp16 at stage 0 with FusedAdam: unscale inside the Adam kernel",
        inert="zerosim unscales the fp16 gradients before any optimizer step",
        reproduces=(False,),
    )

    @classmethod
    def finish(cls, values: dict[str, Any], raw: Mapping[str, Any], path: str) -> dict[str, Any]:
        if values["type"] is None:
            raise ConfigError(
                join(path, "type"),
                None,
                f"{_optimizer_type().allowed} (DeepSpeed ignores a section without a type and "
                "builds an engine that cannot step)",
            )
        params = check_hyperparameters(values["type"], values["params"] or {}, join(path, "params"))
        if (
            values["type"] in ("Adam", "AdamW")
            and params.get("amsgrad")
            and not params.get("torch_adam")
        ):
            raise ConfigError(
                join(path, "params.amsgrad"),
                True,
                "false unless torch_adam is true: DeepSpeed's FusedAdam and CPU Adam do not "
                "implement AMSGrad (torch's Adam does)",
            )
        values["params"] = MappingProxyType(params)
        return values

    @property
    def adam_w_mode(self) -> bool:
        """DeepSpeed's effective AdamW mode: type AdamW, or type Adam with adam_w_mode (default)."""
        if self.type == "AdamW":
            return True
        return self.type == "Adam" and self.params.get("adam_w_mode", True)

    @property
    def class_name(self) -> str:
        """The ``zerosim.optim`` class that implements this section (Adam → AdamW in AdamW mode)."""
        if self.type in ("Adam", "AdamW"):
            return "AdamW" if self.adam_w_mode else "Adam"
        return self.type

    def param_groups(self, named: list[tuple[str, Any]]) -> list[tuple[list, dict[str, Any]]]:
        """[(named parameters, hyperparameters)] of the groups the optimizer is built with.

        One group for every type but Muon, which DeepSpeed splits into two
        (``engine._muon_param_groups``): the matrices whose name holds neither "embed" nor
        "lm_head" (``use_muon``), in the order MuonWithAuxAdam sorts them (shapes compared as
        tuples, largest first; so DeepSpeed lays them out in its flat buffers), with lr (or
        muon_lr), momentum, weight_decay and ns_method;
        then the others, for the auxiliary Adam, with lr (or adam_lr), betas, eps,
        weight_decay and adam_w_mode. A half without parameters is left out.
        """
        if self.type != "Muon":
            return [(named, self.kwargs())]
        groups = []
        for use_muon, keys in ((True, MUON_HALF_KEYS), (False, ADAM_HALF_KEYS)):
            half = [(n, p) for n, p in named if uses_muon(n, p.shape) is use_muon]
            if use_muon:  # MuonWithAuxAdam sorts its matrices, largest shape first
                half = sorted(half, key=lambda item: tuple(item[1].shape), reverse=True)
            if not half:
                continue
            hyper = {k: self.params[k] for k in keys if k in self.params}
            if MUON_LR_KEYS[use_muon] in self.params:
                hyper["lr"] = self.params[MUON_LR_KEYS[use_muon]]
            if not use_muon:
                hyper["adam_w_mode"] = bool(self.params.get("adam_w_mode", True))
            groups.append((half, {"use_muon": use_muon, **hyper}))
        return groups

    def kwargs(self) -> dict[str, Any]:
        """Constructor arguments for ``class_name``: params without DeepSpeed's switches.

        FusedAdam's default ``weight_decay`` (0.0) is filled in unless ``torch_adam`` asks for
        torch's class, whose own default then applies; Lion gets DeepSpeed's lr 1e-3 and betas
        (0.9, 0.999) unless given.
        """
        kwargs = {k: v for k, v in self.params.items() if k not in DEEPSPEED_ONLY_KEYS}
        if self.type == "Lamb":
            kwargs.pop("amsgrad", None)  # false (true is refused): FusedLamb's check only
        if self.type in ("Adam", "AdamW") and not self.params.get("torch_adam", False):
            kwargs.setdefault("weight_decay", 0.0)
        if self.type == "Lion":  # DeepSpeed's defaults, not lion-pytorch's (zerosim.optim.Lion)
            for key, value in DEEPSPEED_LION_DEFAULTS.items():
                kwargs.setdefault(key, value)
        return kwargs


def _scheduler_type() -> Parser:
    supported = choice(*DEEPSPEED_SCHEDULERS, *TORCH_SCHEDULERS, any_case=False)

    def convert(value: Any, path: str) -> str:
        if value in PYTHON_ONLY_SCHEDULERS:
            raise ConfigError(
                path,
                value,
                "a scheduler whose arguments fit in JSON; this one takes Python callables or "
                f"schedulers: build it in Python and pass lr_scheduler= ({supported.allowed})",
            )
        return supported(value, path)

    return Parser(supported.allowed, convert)


@dataclass(frozen=True)
class SchedulerConfig(Section):
    """``scheduler``: ``type`` and ``params`` (both required), params checked by the builder."""

    type: str = knob(None, _scheduler_type(), "required when the section is given")
    params: Mapping[str, Any] = knob(None, _json_object(), "required; checked by the builder")

    @classmethod
    def finish(cls, values: dict[str, Any], raw: Mapping[str, Any], path: str) -> dict[str, Any]:
        if values["type"] is None:
            raise ConfigError(
                join(path, "type"),
                None,
                f"{_scheduler_type().allowed} (DeepSpeed ignores a section without a type)",
            )
        if values["params"] is None:
            raise ConfigError(
                join(path, "params"),
                None,
                "a JSON object, {} for the defaults (DeepSpeed calls the scheduler with "
                "**params and fails without one)",
            )
        params = dict(values["params"])
        check_json_value(params, join(path, "params"))
        values["params"] = MappingProxyType(params)
        return values

    @property
    def is_torch(self) -> bool:
        """A torch.optim.lr_scheduler class: DeepSpeed hands it its optimizer wrapper, which
        under ZeRO or fp16/bf16 is not a torch Optimizer (DeepSpeed's own schedulers unwrap it)."""
        return self.type in TORCH_SCHEDULERS


def uses_muon(name: str, shape: tuple[int, ...]) -> bool:
    """Whether DeepSpeed puts a parameter in Muon's half (``set_optimizer_flags``): a matrix
    (2 or more axes) whose name holds neither "embed" nor "lm_head", in any case."""
    return len(shape) >= 2 and not any(part in name.lower() for part in NOT_MUON)


def check_whole_parameter_rules(cfg: Any) -> None:
    """LAMB and Muon across sections: what DeepSpeed refuses, and what zerosim does not build.

    DeepSpeed refuses LAMB without dynamic loss scaling (``fp16.loss_scale`` 0, its default,
    whether or not fp16 is on: ``engine._do_sanity_check``), Muon with ``reduce_scatter`` at
    stage 3 and Muon with ZeRO++'s quantized gradients (their all-to-all group;
    ``stage3.py``). zerosim does not build LAMB with optimizer offload to NVMe (its tile
    swapper steps part of a shard at a time, where the trust ratio needs every slice of a
    parameter at once), nor Muon with Megatron's layout or the paper's schedule (zerosim's own
    settings). Muon trains in fp16 / bf16 (zero/muon.py), with optimizer offload to cpu or nvme
    (DeepSpeed's path there: zero/muon_offload.py; Muon's update is made before the step, which
    is element-wise), and with ZeRO++'s hpZ / qwZ at stage 3, which change only the weights'
    gathers (Muon's run over the whole group).
    """
    opt = cfg.optimizer
    if opt is not None and opt.type == "Lamb":
        _check_lamb(cfg)
    elif opt is not None and opt.type == "Muon":
        _check_muon_refused_by_deepspeed(cfg.zero_optimization)
        _check_muon_built(cfg)


def _check_lamb(cfg: Any) -> None:
    """LAMB needs dynamic loss scaling (DeepSpeed) and no NVMe offload (zerosim)."""
    if cfg.fp16.loss_scale != 0:
        raise ConfigError(
            "fp16.loss_scale",
            cfg.fp16.loss_scale,
            "0 (dynamic loss scaling) with Lamb: DeepSpeed's engine requires it for LAMB",
        )
    if cfg.zero_optimization.offload_optimizer.device == "nvme":
        raise ConfigError(
            "zero_optimization.offload_optimizer.device",
            "nvme",
            "'none' or 'cpu' with Lamb (zerosim's NVMe swapper steps a shard part by part; "
            "the trust ratio needs every slice of a parameter at once)",
        )


def _check_muon_refused_by_deepspeed(zero: Any) -> None:
    """What DeepSpeed's stage 3 refuses with Muon: reduce_scatter and quantized gradients."""
    if zero.stage == 3 and zero.reduce_scatter:
        raise ConfigError(
            "zero_optimization.reduce_scatter",
            True,
            "false with Muon at ZeRO stage 3 (DeepSpeed: 'Muon and reduce scatter cannot be "
            "used together')",
        )
    if zero.stage == 3 and zero.zero_quantized_gradients:
        raise ConfigError(
            "zero_optimization.zero_quantized_gradients",
            True,
            "false with Muon (DeepSpeed: 'Muon and all2all process group cannot be used together')",
        )


def _check_muon_built(cfg: Any) -> None:
    """Muon as zerosim builds it: DeepSpeed's, in DeepSpeed's layout and schedule (not Megatron's
    layout or the paper's schedule). Optimizer offload is built (``zero/muon_offload.py``), as
    are ZeRO++'s hpZ and qwZ: they change only the weights' gathers, and Muon's gathers run over
    the whole data-parallel group in full precision, as DeepSpeed's do."""
    sim = cfg.zerosim
    not_built = (
        ("zerosim.layout", sim.layout, "deepspeed"),
        ("zerosim.schedule", sim.schedule, "deepspeed"),
    )
    for key, value, allowed in not_built:
        if value != allowed:
            raise ConfigError(
                key,
                value,
                f"{allowed!r} with Muon (zerosim builds DeepSpeed's Muon for ZeRO stages 0-3, "
                "in DeepSpeed's layout and schedule)",
            )
