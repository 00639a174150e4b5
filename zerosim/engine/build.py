"""``initialize``: DeepSpeed's entry point, which checks the config and the model on every rank
and builds the engine's parts in DeepSpeed's order.

    load and check the config (every rank the same)  →  check the optimizer and the model
    →  cast, move and broadcast the model  →  the strategy of the ZeRO stage  →  Engine

Every check runs before anything is built, and raises on every rank (``ConfigError`` naming the
key, or the argument's name and what is allowed).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zerosim import optim
from zerosim.backend import Backend, crossings, get_backend
from zerosim.comm import Communicator, default_comm
from zerosim.config import Config, load_config, reject_unbuilt
from zerosim.config.optimizer import ZERO_SUPPORTED_OPTIMIZERS
from zerosim.data import build_loader
from zerosim.engine.consistency import check_same_config, check_same_model
from zerosim.engine.engine import Engine
from zerosim.errors import ConfigError
from zerosim.nn import Module
from zerosim.optim.lr_scheduler import build_scheduler
from zerosim.zero import Strategy, strategy_class
from zerosim.zero.init import is_partitioned
from zerosim.zero.loss_scaler import build_loss_scaler
from zerosim.zero.offload import check_nvme_paths
from zerosim.zero.schedule import BoundaryChecks
from zerosim.zero.stage3_fsdp2 import Stage3FSDP2
from zerosim.zero.stage3_zeropp import Stage3ZeroPP
from zerosim.zero.zeropp import zeropp_enabled


def initialize(
    model: Module,
    config: dict | str | Config,
    comm: Communicator | None = None,
    optimizer: Any = None,
    lr_scheduler: Any = None,
    training_data: Any = None,
) -> tuple[Engine, Any, Any, Any]:
    """DeepSpeed's ``initialize``: (engine, optimizer, dataloader, lr_scheduler).

    The config (a dict or a JSON path) is checked first, on every rank, before any state is built:
    every bad value raises ``ConfigError`` naming the key. The model must be built identically on
    every rank; a layout fingerprint all-reduce checks that.
    """
    comm = default_comm() if comm is None else comm
    cfg = load_config(config, comm.size)
    sim = cfg.zerosim  # the watchdog's settings first, so they cover the checks below
    comm.set_watchdog(sim.timeout, sim.flight_records, sim.flight_dir)
    check_same_config(cfg, comm)
    if not isinstance(model, Module):
        raise TypeError(f"model must be a zerosim.nn.Module, got {type(model).__name__}")
    engine = build_engine(model, cfg, comm, optimizer, lr_scheduler)
    loader = None
    if training_data is not None:
        loader = build_loader(
            training_data,
            cfg.train_micro_batch_size_per_gpu,
            comm.size,
            comm.rank,
            cfg.gradient_accumulation_steps,
        )
    engine.training_dataloader = loader  # DeepSpeed's name; checkpoints save its position
    return engine, engine.optimizer, loader, engine.lr_scheduler


def build_engine(
    model: Module, cfg: Config, comm: Communicator, optimizer: Any, lr_scheduler: Any
) -> Engine:
    """The engine of a checked config: the model checked, placed and broadcast, the strategy
    attached to it, then the loss scaler and the scheduler."""
    reject_unbuilt(cfg)
    # before anything changes: cupy without a GPU, or a backend not installed, fails here
    backend = get_backend(cfg.zerosim.backend)
    crossings_at_start = crossings().as_dict()
    zero = cfg.zero_optimization
    strategy_cls = strategy_class(
        zero.stage, cfg.zerosim.schedule, cfg.zerosim.layout, zeropp_enabled(zero)
    )
    check_zero_init_model(model, cfg, strategy_cls)
    check_nvme_paths(zero, comm)  # collective, only when nvme is used
    comm.collectives = cfg.zerosim.collectives
    comm.validate = cfg.zerosim.validate_collectives
    if cfg.zerosim.ranks_per_node is not None or comm.node_of is None:  # intra/inter bytes
        comm.set_ranks_per_node(cfg.zerosim.ranks_per_node)
    opt_cls, groups = optimizer_spec(cfg, optimizer, model, strategy_cls)
    place_model(model, cfg, comm, backend)
    checks = boundary_checks(strategy_cls, cfg)
    strategy = build_strategy(strategy_cls, cfg, comm, groups, opt_cls)
    loss_scaler = build_loss_scaler(cfg.loss_scaler())
    strategy.attach(model)
    return Engine(
        model,
        cfg,
        comm,
        strategy=strategy,
        checks=checks,
        loss_scaler=loss_scaler,
        lr_scheduler=build_lr_scheduler(cfg, strategy.optimizer, lr_scheduler),
        backend=backend,
        crossings_at_start=crossings_at_start,
    )


def check_zero_init_model(model: Module, cfg: Config, strategy_cls: type[Strategy]) -> None:
    """A model built inside zero.Init is trained only by a stage that takes over its chunks."""
    zero = cfg.zero_optimization
    if not strategy_cls.partitions_params and is_partitioned(model):
        raise ConfigError(
            f"zero_optimization.stage = {zero.stage}: the model was built "
            "inside zerosim.zero.Init, so its parameters are partitioned across ranks and "
            "no rank holds them whole; only stage 3 trains such a model (allowed: 3, or "
            "build the model outside zero.Init)"
        )
    if (
        strategy_cls.partitions_params
        and not strategy_cls.adopts_zero_init
        and is_partitioned(model)
    ):
        raise ConfigError(
            "zerosim.schedule",
            cfg.zerosim.schedule,
            "'deepspeed' or 'paper' for a model built inside zerosim.zero.Init (it cut each "
            "parameter into ceil(numel / N) elements; this schedule cuts dim-0 rows): build "
            "the model outside zero.Init",
        )


def optimizer_spec(
    cfg: Config, client: Any, model: Module, strategy_cls: type[Strategy]
) -> tuple[type, list[tuple]]:
    """(optimizer class, [(named params, hyperparameters) per group]), from the config's
    ``optimizer`` section or from an optimizer object passed to ``initialize`` (``client``)."""
    named = list(model.named_parameters())
    if client is None:
        if cfg.optimizer is None:
            raise ConfigError(
                "optimizer",
                None,
                "a config 'optimizer' section or an optimizer object passed to initialize(): "
                "zerosim's engine trains (DeepSpeed would build an engine that cannot step)",
            )
        return getattr(optim, cfg.optimizer.class_name), cfg.optimizer.param_groups(named)
    check_client_optimizer(cfg, client, strategy_cls)
    names = {id(p): n for n, p in named}
    groups = []
    for group in client.param_groups:
        unknown = [p for p in group["params"] if id(p) not in names]
        if unknown:
            raise ValueError("optimizer holds parameters that are not the model's")
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append(([(names[id(p)], p) for p in group["params"]], hyper))
    return type(client), groups


def check_client_optimizer(cfg: Config, client: Any, strategy_cls: type[Strategy]) -> None:
    """DeepSpeed's rules for an optimizer object passed to ``initialize``."""
    if cfg.optimizer is not None:
        raise ConfigError(
            "optimizer: both a config 'optimizer' section and an optimizer object were "
            "given; pass one of them"
        )
    if not isinstance(client, optim.Optimizer):
        raise TypeError(f"optimizer must be a zerosim.optim.Optimizer, got {type(client).__name__}")
    untested = type(client).__name__ not in ZERO_SUPPORTED_OPTIMIZERS
    partitioned = strategy_cls.partitions_optimizer_states  # DeepSpeed: any ZeRO stage ≥ 1
    if partitioned and untested and not cfg.zero_allow_untested_optimizer:
        raise ConfigError(
            "optimizer",
            type(client).__name__,
            f"one of {list(ZERO_SUPPORTED_OPTIMIZERS)} at ZeRO stage "
            f"{cfg.zero_optimization.stage}, or any optimizer with "
            '"zero_allow_untested_optimizer": true (DeepSpeed\'s rule)',
        )
    offload = cfg.zero_optimization.offload_optimizer.device
    if offload != "none" and cfg.zero_force_ds_cpu_optimizer:
        raise ConfigError(
            "zero_force_ds_cpu_optimizer",
            True,
            f"false to step an optimizer object passed to initialize() with offload_optimizer "
            f"'{offload}' (DeepSpeed's rule: ZeRO-Offload takes its own CPU Adam or Lion, from "
            "an 'optimizer' section, unless this is false)",
        )


def place_model(model: Module, cfg: Config, comm: Communicator, backend: Backend) -> None:
    """Check that every rank built the same model, cast it to the training dtype, move it to the
    backend's device (every parameter and buffer crosses once, here) and start every rank from
    rank 0's values."""
    check_same_model(model, comm)
    model.to(dtype=cfg.model_dtype)
    if backend.name != "numpy":
        model.to(backend=backend)
    broadcast_model(model, comm)


def broadcast_model(model: Module, comm: Communicator) -> None:
    """Rank 0's parameters and buffers to every rank (phase ``init``), one broadcast each, as
    DeepSpeed's engine does at start-up (``DeepSpeedEngine._broadcast_model``): ranks that built
    the model with different seeds still train one model."""
    if comm.size == 1:
        return
    with comm.phase("init"):
        for _, p in model.named_parameters():
            if p.partition is None:  # zero.Init broadcast partitioned ones as it built them
                comm.broadcast(p.data, root=0)
        for _, buffer in model.named_buffers():
            comm.broadcast(buffer, root=0)


def boundary_checks(strategy_cls: type[Strategy], cfg: Config) -> BoundaryChecks:
    """The overflow and norm collectives of the boundary: the strategy's row of
    zerosim/zero/schedule.py's table."""
    zero = cfg.zero_optimization
    try:
        return strategy_cls.boundary_checks(
            fp16=cfg.fp16.enabled,
            bf16=cfg.bf16.enabled,
            clip=cfg.gradient_clipping,
            reference_precision=np.dtype(cfg.model_dtype) == np.float64,
            bf16_overflow=cfg.bf16.check_grad_overflow,
            compute_grad_norm=zero.compute_grad_norm,
            optimizer_offload=zero.offload_optimizer.device != "none",
        )
    except ValueError as err:
        raise ConfigError(str(err)) from err


def build_strategy(
    strategy_cls: type[Strategy], cfg: Config, comm: Communicator, groups: list, opt_cls: type
) -> Strategy:
    """The strategy of the config's stage over the optimizer's parameter groups."""
    return strategy_cls(
        groups=groups,
        comm=comm,
        zero=cfg.zero_optimization,
        dtype=cfg.model_dtype,
        optimizer_cls=opt_cls,
        layout=cfg.zerosim.layout,
        master_dtype=cfg.master_dtype,
        comm_dtype=None if cfg.communication_data_type is None else cfg.communication_dtype,
        prescale=cfg.prescale_gradients,
        predivide=cfg.gradient_predivide_factor,
        gradient_average=cfg.gradient_allreduce_op == "mean",
        **zeropp_options(strategy_cls, cfg),
        **fsdp2_options(strategy_cls, cfg),
    )


def zeropp_options(strategy_cls: type, cfg: Config) -> dict[str, Any]:
    """ZeRO++'s own keyword: elements per quantization scale
    (``zerosim.quantization_block_size``)."""
    if issubclass(strategy_cls, Stage3ZeroPP):
        return {"quantization_block_size": cfg.zerosim.quantization_block_size}
    return {}


def fsdp2_options(strategy_cls: type, cfg: Config) -> dict[str, Any]:
    """FSDP2's own keywords (``zerosim.fsdp2``: fully_shard's and MixedPrecisionPolicy's)."""
    if not issubclass(strategy_cls, Stage3FSDP2):
        return {}
    f = cfg.zerosim.fsdp2
    return {
        "reshard_after_forward": f.reshard_after_forward,
        "param_dtype": f.param_dtype,
        "reduce_dtype": f.reduce_dtype,
        "reshard_after_backward": f.reshard_after_backward,
        "reduce_every_micro_batch": f.reduce_every_micro_batch,
        "replicate": f.replicate,
    }


def build_lr_scheduler(cfg: Config, optimizer: Any, client: Any) -> Any:
    """The scheduler: the one passed to ``initialize`` (``client``, re-pointed at the engine's
    optimizer, or a callable building it), else the config's ``scheduler`` section, else None."""
    if client is not None and cfg.scheduler is not None:
        raise ConfigError(
            "scheduler: both a config 'scheduler' section and an lr_scheduler were given"
        )
    if client is not None:
        if callable(client) and not hasattr(client, "step"):
            return client(optimizer)
        client.optimizer = optimizer  # re-point a scheduler built on the client's
        return client
    if cfg.scheduler is not None:
        section = cfg.scheduler
        try:
            return build_scheduler(section.type, optimizer, dict(section.params))
        except (ValueError, TypeError) as err:  # DeepSpeed's constructors raise both
            params = dict(section.params)
            allowed = f"params of {section.type}: {err}"
            raise ConfigError("scheduler.params", params, allowed) from err
    return None
