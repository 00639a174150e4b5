"""The training engine: DeepSpeed's ``initialize`` and verbs over a ZeRO strategy.

    engine, optimizer, loader, scheduler = zerosim.initialize(model=model, config=cfg)
    for x, y in loader:
        loss = engine(x, y)      # forward on this rank's micro-batch
        engine.backward(loss)    # gradients of loss / gradient_accumulation_steps
        engine.step()            # at the accumulation boundary: reduce, clip, update, gather

The engine owns the loop's bookkeeping (micro-steps, the accumulation boundary, clipping,
ledger phases, the scheduler); where gradients and parameters live and how they travel is the
strategy's business (``zerosim.zero``). It never calls MPI itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import time
from typing import Any

import numpy as np

from zerosim import optim
from zerosim.backend import (
    crossings,
    from_host,
    get_backend,
    item,
    nbytes,
    np_dtype,
    resolve_dtype,
    to_host,
    xp_of,
)
from zerosim.comm import Communicator, default_comm
from zerosim.config import Config, ConfigError, load_config, reject_unbuilt
from zerosim.config.optimizer import ZERO_SUPPORTED_OPTIMIZERS
from zerosim.data import build_loader
from zerosim.nn import Module
from zerosim.optim.lr_scheduler import build_scheduler
from zerosim.zero import STRATEGIES, Strategy
from zerosim.zero.init import is_partitioned
from zerosim.zero.loss_scaler import build_loss_scaler
from zerosim.zero.offload import check_nvme_paths
from zerosim.zero.schedule import boundary_checks

log = logging.getLogger(__name__)


class Loss(float):
    """The loss ``engine(x, y)`` returns: a float that remembers which engine made it."""

    engine: Engine
    serial: int


def _fingerprint(model: Module) -> int:
    text = ";".join(f"{n}:{p.shape}:{p.dtype}" for n, p in model.named_parameters())
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def _to_float16(x: Any) -> Any:
    """``x`` cast to float16 when it is a floating-point array (``fp16.auto_cast``)."""
    if x is None or not hasattr(x, "dtype") or not np.issubdtype(np_dtype(x.dtype), np.floating):
        return x
    return xp_of(x).astype(x, np.float16)


def check_same_model(model: Module, comm: Communicator) -> None:
    """One all-reduce of a layout fingerprint; on mismatch every rank raises naming the diffs."""
    mine = _fingerprint(model)
    both = np.array([mine, -mine], dtype=np.int64)
    with comm.phase("init"):
        comm.all_reduce(both, op="max")
    if both[0] == -both[1] == mine:
        return
    # Rare path: exchange every rank's parameter list to say what differs.
    text = "\n".join(f"{n} {p.shape} {p.dtype}" for n, p in model.named_parameters()).encode()
    length = np.array([len(text)], dtype=np.int64)
    lengths = np.empty(comm.size, dtype=np.int64)
    with comm.phase("init"):
        comm.all_gather(lengths, length)
        padded = np.zeros(int(lengths.max()), dtype=np.uint8)
        padded[: len(text)] = np.frombuffer(text, dtype=np.uint8)
        every = np.empty(comm.size * padded.size, dtype=np.uint8)
        comm.all_gather(every, padded)
    tables = [
        set(every[r * padded.size : r * padded.size + lengths[r]].tobytes().decode().splitlines())
        for r in range(comm.size)
    ]
    differing = sorted({line.split(" ")[0] for t in tables for line in t ^ tables[0]})
    raise ValueError(
        f"the model differs across ranks (build the same architecture on every rank); "
        f"parameters whose name, shape or dtype differ from rank 0's: {differing}"
    )


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


def _optimizer_spec(cfg: Config, client: Any, model: Module) -> tuple[type, list[tuple]]:
    """(optimizer class, [(named params, hyperparameters) per group])."""
    named = list(model.named_parameters())
    if client is not None:
        if cfg.optimizer is not None:
            raise ConfigError(
                "optimizer: both a config 'optimizer' section and an optimizer object were "
                "given; pass one of them"
            )
        if not isinstance(client, optim.Optimizer):
            raise TypeError(
                f"optimizer must be a zerosim.optim.Optimizer, got {type(client).__name__}"
            )
        untested = type(client).__name__ not in ZERO_SUPPORTED_OPTIMIZERS
        if cfg.zero_optimization.stage >= 1 and untested and not cfg.zero_allow_untested_optimizer:
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
        names = {id(p): n for n, p in named}
        groups = []
        for group in client.param_groups:
            unknown = [p for p in group["params"] if id(p) not in names]
            if unknown:
                raise ValueError("optimizer holds parameters that are not the model's")
            hyper = {k: v for k, v in group.items() if k != "params"}
            groups.append(([(names[id(p)], p) for p in group["params"]], hyper))
        return type(client), groups
    if cfg.optimizer is None:
        raise ConfigError(
            "optimizer",
            None,
            "a config 'optimizer' section or an optimizer object passed to initialize(): "
            "zerosim's engine trains (DeepSpeed would build an engine that cannot step)",
        )
    cls = getattr(optim, cfg.optimizer.class_name)
    return cls, cfg.optimizer.param_groups(named)


def _gather_text(comm: Communicator, text: str) -> list[str]:
    """Every rank's ``text``, in rank order (two all-gathers: lengths, then padded bytes)."""
    data = np.frombuffer(text.encode(), dtype=np.uint8)
    lengths = np.empty(comm.size, dtype=np.int64)
    comm.all_gather(lengths, np.array([data.size], dtype=np.int64))
    padded = np.zeros(int(lengths.max()), dtype=np.uint8)
    padded[: data.size] = data
    every = np.empty(comm.size * padded.size, dtype=np.uint8)
    comm.all_gather(every, padded)
    width = padded.size
    return [every[r * width : r * width + lengths[r]].tobytes().decode() for r in range(comm.size)]


def _flat_keys(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} → {"a.b": 1}: the dotted key paths the errors name."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# Keys that may differ from rank to rank: node-local paths (each node its own NVMe, its own flight
# folder); a bad one is caught where it is used, naming the rank (offload.check_nvme_paths).
PER_RANK_KEYS = (
    "zero_optimization.offload_optimizer.nvme_path",
    "zero_optimization.offload_param.nvme_path",
    "zerosim.flight_dir",
)


def check_same_config(cfg: Config, comm: Communicator) -> None:
    """Every rank loaded the same config (defaults filled in): one all-reduce of a hash of its
    canonical JSON; on a mismatch every rank raises one ConfigError naming the differing keys
    and each rank's value, before any state is built."""
    if comm.size == 1:
        return
    flat = {k: v for k, v in _flat_keys(cfg.to_dict()).items() if k not in PER_RANK_KEYS}
    text = json.dumps(flat, sort_keys=True, default=repr)
    mine = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")
    both = np.array([mine, -mine], dtype=np.int64)
    with comm.phase("init"):
        comm.all_reduce(both, op="max")
        if both[0] == -both[1] == mine:
            return
        tables = [json.loads(t) for t in _gather_text(comm, text)]  # rare path: say what differs
    keys = sorted({k for t in tables for k in t.keys() | tables[0].keys()})
    differing = [k for k in keys if any(t.get(k, "<absent>") != tables[0].get(k) for t in tables)]
    details = []
    for key in differing[:8]:
        ranks_of: dict[str, list[int]] = {}
        for r, t in enumerate(tables):
            ranks_of.setdefault(json.dumps(t.get(key, "<absent>")), []).append(r)
        details.append(f"{key}: " + ", ".join(f"{v} on ranks {rs}" for v, rs in ranks_of.items()))
    more = f" (and {len(differing) - 8} more)" if len(differing) > 8 else ""
    raise ConfigError(
        f"the config differs across ranks (every rank must load the same config); keys whose "
        f"value differs: {differing}{more} — " + "; ".join(details)
    )


class Engine:
    """DeepSpeed-like engine over one of zerosim's ZeRO strategies."""

    def __init__(
        self,
        model: Module,
        config: Config,
        comm: Communicator,
        optimizer: Any = None,
        lr_scheduler: Any = None,
    ) -> None:
        cfg = config
        reject_unbuilt(cfg)
        # before anything changes: cupy without a GPU, or a backend not installed, fails here
        self.backend = get_backend(cfg.zerosim.backend)
        self._crossings_at_start = crossings().as_dict()
        if cfg.zero_optimization.stage != 3 and is_partitioned(model):
            raise ConfigError(
                f"zero_optimization.stage = {cfg.zero_optimization.stage}: the model was built "
                "inside zerosim.zero.Init, so its parameters are partitioned across ranks and "
                "no rank holds them whole; only stage 3 trains such a model (allowed: 3, or "
                "build the model outside zero.Init)"
            )
        check_nvme_paths(cfg.zero_optimization, comm)  # collective, only when nvme is used
        self.config = cfg
        self.comm = comm
        self.module = model
        comm.collectives = cfg.zerosim.collectives
        comm.validate = cfg.zerosim.validate_collectives
        if cfg.zerosim.ranks_per_node is not None or comm.node_of is None:  # intra/inter bytes
            comm.set_ranks_per_node(cfg.zerosim.ranks_per_node)
        opt_cls, groups = _optimizer_spec(cfg, optimizer, model)
        check_same_model(model, comm)
        model.to(dtype=cfg.model_dtype)
        if self.backend.name != "numpy":  # every parameter and buffer crosses once, here
            model.to(backend=self.backend)
        broadcast_model(model, comm)
        zero = cfg.zero_optimization
        try:  # the overflow and norm collectives of the boundary (zerosim/zero/schedule.py)
            self.checks = boundary_checks(
                cfg.zerosim.schedule,
                zero.stage,
                fp16=cfg.fp16.enabled,
                bf16=cfg.bf16.enabled,
                clip=cfg.gradient_clipping,
                reference_precision=np.dtype(cfg.model_dtype) == np.float64,
                bf16_overflow=cfg.bf16.check_grad_overflow,
                compute_grad_norm=zero.compute_grad_norm,
            )
        except ValueError as err:
            raise ConfigError(str(err)) from err
        strategy_cls = STRATEGIES[zero.stage]
        self.strategy: Strategy = strategy_cls(
            groups=groups,
            comm=comm,
            zero=zero,
            dtype=cfg.model_dtype,
            optimizer_cls=opt_cls,
            layout=cfg.zerosim.layout,
            master_dtype=cfg.master_dtype,
            comm_dtype=None if cfg.communication_data_type is None else cfg.communication_dtype,
            prescale=cfg.prescale_gradients,
            predivide=cfg.gradient_predivide_factor,
            gradient_average=cfg.gradient_allreduce_op == "mean",
            schedule=cfg.zerosim.schedule,
        )
        self.loss_scaler = build_loss_scaler(cfg.loss_scaler())
        self.skipped_steps = 0
        self.strategy.attach(model)
        self.optimizer = self.strategy.optimizer
        self.lr_scheduler = self._build_scheduler(lr_scheduler)
        self.gradient_accumulation_steps = cfg.gradient_accumulation_steps
        self.micro_steps = 0
        self.global_steps = 0
        self._serial = 0
        self._backwards_since_step = 0
        self._last_loss: Loss | None = None
        self._first_batch: tuple[int, str] | None = None  # (ndim, dtype kind) of x, 1st forward
        self._model_at_init: list[tuple[str, Any, Any]] = []  # (name, Parameter, its .data)
        self._global_grad_norm: float | None = None
        self.wall_clock = {"forward": 0.0, "backward": 0.0, "step": 0.0}  # seconds, cumulative
        self._printed_clock = dict(self.wall_clock)
        self.training_dataloader = None

    def _build_scheduler(self, client: Any) -> Any:
        if client is not None and self.config.scheduler is not None:
            raise ConfigError(
                "scheduler: both a config 'scheduler' section and an lr_scheduler were given"
            )
        if client is not None:
            if callable(client) and not hasattr(client, "step"):
                return client(self.optimizer)
            client.optimizer = self.optimizer  # re-point a scheduler built on the client's
            return client
        if self.config.scheduler is not None:
            section = self.config.scheduler
            try:
                return build_scheduler(section.type, self.optimizer, dict(section.params))
            except (ValueError, TypeError) as err:  # DeepSpeed's constructors raise both
                params = dict(section.params)
                allowed = f"params of {section.type}: {err}"
                raise ConfigError("scheduler.params", params, allowed) from err
        return None

    # -- the training verbs ----------------------------------------------------------------------
    def __call__(self, x: Any, y: Any = None) -> Any:
        """Forward this rank's micro-batch; with targets, returns the loss (mean over it)."""
        self._check_forward(x, y)
        x, y = self._to_device(x), self._to_device(y)
        if self.config.fp16.auto_cast:  # DeepSpeed casts floating-point inputs to float16
            x, y = _to_float16(x), _to_float16(y)
        with self._phase("forward"), self._fp16_quiet():
            self.strategy.before_forward()
            out = self.module(x, y) if y is not None else self.module(x)
        if y is None:
            return out
        loss = Loss(item(out))
        self._serial += 1
        loss.engine, loss.serial = self, self._serial
        self._last_loss = loss
        return loss

    forward = __call__

    def _to_device(self, batch: Any) -> Any:
        """A host batch crosses to the backend's device (``backend.from_host``, counted); one
        already there stays."""
        if batch is None or self.backend.name == "numpy" or xp_of(batch) is self.backend.xp:
            return batch
        return from_host(to_host(batch), xp=self.backend.xp)

    @contextlib.contextmanager
    def _phase(self, name: str) -> Any:
        """Label the ledger with ``name`` and add the time spent to ``wall_clock[name]``."""
        start = time.perf_counter()
        try:
            with self.comm.phase(name):
                yield
        finally:
            self.wall_clock[name] += time.perf_counter() - start

    def _fp16_quiet(self) -> Any:
        """Under fp16 an overflow is expected now and then: it becomes inf/nan in the gradients,
        which the step detects and skips, so NumPy need not warn about it."""
        if self.config.fp16.enabled:
            return np.errstate(over="ignore", invalid="ignore")
        return contextlib.nullcontext()

    # -- misuse of the verbs: errors before anything is computed or sent ------------------------
    def remember_model(self) -> None:
        """Note each parameter and the array behind it, for ``_check_forward`` (initialize
        calls it once the strategy has put the parameters into its buffers)."""
        self._model_at_init = [(n, p, p.data) for n, p in self.module.named_parameters()]

    def _check_forward(self, x: Any, y: Any) -> None:
        """The batch is arrays of a consistent kind, and the model is the one initialized."""
        for name, value in (("x", x), ("y", y)):
            if value is not None and not (hasattr(value, "shape") and hasattr(value, "dtype")):
                raise TypeError(
                    f"engine(x, y): {name} must be an array (numpy, or the backend's), got "
                    f"{type(value).__name__}"
                )
        if x.ndim == 0 or x.shape[0] == 0:
            raise ValueError(
                f"engine(x, y): x must have a batch axis holding at least one sample, got shape "
                f"{tuple(x.shape)}"
            )
        if y is not None and (y.ndim == 0 or y.shape[0] != x.shape[0]):
            raise ValueError(
                f"engine(x, y): y must hold one target per sample of x ({x.shape[0]}), got "
                f"shape {tuple(y.shape)} for x of shape {tuple(x.shape)}"
            )
        spec = (x.ndim, np_dtype(x.dtype).kind)
        if self._first_batch is None:
            self._first_batch = spec
        elif spec != self._first_batch:
            raise ValueError(
                f"engine(x, y): x has {x.ndim} axes and dtype {x.dtype}, but the first batch had "
                f"{self._first_batch[0]} axes and a dtype of kind {self._first_batch[1]!r}; "
                f"every micro-batch must be laid out alike"
            )
        self._check_model()

    def _check_model(self) -> None:
        """The parameters are those of ``initialize``, of the same shapes, still backed by the
        engine's arrays (stages 0-2: the very arrays; stage 3 swaps them itself)."""
        if not self._model_at_init:
            return
        now = [(n, p) for n, p in self.module.named_parameters()]
        before = [(n, p) for n, p, _ in self._model_at_init]
        if [id(p) for _, p in now] != [id(p) for _, p in before]:
            names = {n for n, _ in now}
            old = {n for n, _ in before}
            raise RuntimeError(
                f"the model changed after initialize: parameters added {sorted(names - old)}, "
                f"removed {sorted(old - names)}, or replaced by new Parameter objects; the "
                f"engine trains the parameters it was given: call initialize again"
            )
        stage3 = self.config.zero_optimization.stage == 3
        for name, p, data in self._model_at_init:
            if p.data is data:
                continue
            shape, dtype = tuple(p.data.shape), np_dtype(p.data.dtype)
            if stage3 and (p.data.size == 0 or shape == p.shape) and dtype == np_dtype(data.dtype):
                continue  # stage 3 releases and gathers parameters by swapping .data
            raise RuntimeError(
                f"the model changed after initialize: parameter {name!r} no longer holds the "
                f"engine's array (now shape {shape}, dtype {dtype}; at initialize "
                f"{tuple(data.shape)}, {np_dtype(data.dtype)}), so the engine's updates would "
                f"not reach it; change weights in place (p.data[...] = values, "
                f"model.load_state_dict, engine.load_checkpoint) or call initialize again"
            )

    def _check_backward(self, loss: Any) -> None:
        if getattr(loss, "engine", None) is not self:
            source = "another engine" if isinstance(loss, Loss) else "elsewhere"
            raise ValueError(
                "backward(loss) needs the loss this engine's forward returned "
                f"(got a {type(loss).__name__} from {source})"
            )
        if loss.serial == self._serial and self._last_loss is None:
            raise RuntimeError(
                f"backward(loss) was already called for the loss of forward #{loss.serial}; "
                "each loss is backpropagated once: call loss = engine(x, y) again first"
            )
        if loss is not self._last_loss:
            raise ValueError(
                f"backward(loss) got the loss of forward #{loss.serial}; only the latest "
                f"(#{self._serial}) can be backpropagated"
            )
        if self._backwards_since_step:
            raise RuntimeError(
                "backward() was called again before step(): call engine.step() after every "
                "backward(), also inside an accumulation window; step() counts the "
                f"micro-batches and updates only at the boundary (every "
                f"gradient_accumulation_steps = {self.gradient_accumulation_steps}), so a "
                "PyTorch-style loop of several backward() and one step() would not reach it"
            )

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the current micro-step is the last of its accumulation window."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def backward(self, loss: Any) -> None:
        """Backpropagate ``loss`` / gradient_accumulation_steps and reduce as the stage says."""
        self._check_backward(loss)
        boundary = self.is_gradient_accumulation_boundary()
        with self._phase("backward"), self._fp16_quiet():
            self.strategy.before_backward(boundary)
            self.module.backward(grad_scale=self._loss_seed())
            self.strategy.after_backward(boundary)
        self._last_loss = None
        self._backwards_since_step += 1

    def _loss_seed(self) -> float:
        """d(loss)/d(loss) as DeepSpeed seeds backward: loss scale / gradient_accumulation_steps.

        Under fp16 or bf16 torch's loss is a 16-bit tensor, and so is its gradient: DeepSpeed's
        ``(loss / gas) * scale`` hands backward round(round(scale) / gas) in the model dtype. A
        scale above float16's largest value, 65504 (DeepSpeed's default 2**16 included), is inf
        there, so that step overflows and is skipped whatever the gradients.
        """
        seed = self.loss_scaler.loss_scale / self.gradient_accumulation_steps
        if self.config.mixed_precision is None:
            return seed
        dtype = resolve_dtype(self.config.model_dtype)
        with np.errstate(over="ignore"):
            scale = np.float32(np.asarray(self.loss_scaler.loss_scale, dtype=dtype))
            return float(np.asarray(scale / self.gradient_accumulation_steps, dtype=dtype))

    def step(self) -> None:
        """End a micro-step; at the boundary: clip, update the owned shard, gather, schedule."""
        if self._backwards_since_step == 0:
            raise RuntimeError(
                "step() was called without a backward() since the last step(); call "
                "loss = engine(x, y); engine.backward(loss); engine.step() for each micro-batch"
            )
        self._backwards_since_step = 0
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        with self._phase("step"):
            stepped = self._update()
        if stepped and self.lr_scheduler is not None:
            self.lr_scheduler.step()  # DeepSpeed leaves the schedule alone on a skipped step
        self.global_steps += 1
        self.comm.ledger.step = self.global_steps
        period = self.config.steps_per_print  # None: never, as in DeepSpeed
        if self.comm.rank == 0 and period is not None and self.global_steps % period == 0:
            log.info(
                "step %d: lr %s, grad norm %s, loss scale %g, skipped %d",
                self.global_steps,
                self.get_lr(),
                self._global_grad_norm,
                self.loss_scale,
                self.skipped_steps,
            )
        # DeepSpeed's per-phase timers: with the progress line, or every step without one
        timed = period or 1
        if self.comm.rank == 0 and self.config.wall_clock_breakdown:
            if self.global_steps % timed == 0:
                spent = {k: (v - self._printed_clock[k]) * 1e3 for k, v in self.wall_clock.items()}
                log.info(
                    "time over the last %d steps (ms): forward %.1f, backward %.1f, step %.1f",
                    timed,
                    spent["forward"],
                    spent["backward"],
                    spent["step"],
                )
                self._printed_clock = dict(self.wall_clock)

    def _update(self) -> bool:
        """The boundary's work; False when the step was skipped: an inf/nan gradient that the
        overflow flag saw, or a gradient norm that is not finite where the schedule skips on it
        (``self.checks``, the table of zerosim/zero/schedule.py)."""
        checks = self.checks
        if checks.overflow != "none" and self._overflow_seen():
            return self._skip("gradient overflow")
        # As in DeepSpeed 0.19.8, the norm is taken of the gradients as they stand (scaled by the
        # current loss scale) and judged before the scale is updated; and, as in every fp16
        # optimizer of it, the scale is updated before the gradients are unscaled: on a step
        # where it grows, they are divided by the new scale.
        prev_scale = self.loss_scaler.loss_scale
        norm = self._grad_norm(1.0 / prev_scale)  # of the gradients over prev_scale
        if norm is not None and not math.isfinite(norm):
            if checks.bad_norm == "skip":
                return self._skip("the gradient norm is not finite")
            if checks.bad_norm == "inf":  # DeepSpeed's ZeRO optimizers mask a nan norm to inf
                norm = math.inf
        self.loss_scaler.update_scale(False)
        scale = self.loss_scaler.loss_scale
        unscaled = None if norm is None else norm * (prev_scale / scale)  # over the new scale
        self._global_grad_norm = self._reported_norm(norm, unscaled)
        coef = self._clip_coef(unscaled)
        if self.strategy.master_dtype is None and coef != 1.0:  # one precision: clip in place
            self.strategy.clip(coef)
        self.strategy.unscale_grads(1.0 / scale)
        if self.strategy.master_dtype is not None and coef != 1.0:  # the fp32 gradients made
            self.strategy.clip(coef)
        self.optimizer.step()
        self.strategy.master_to_params()
        self.strategy.gather()
        self.strategy.zero_grad()
        return True

    def _overflow_seen(self) -> bool:
        """Whether any rank's gradients hold inf/nan: this rank's own check, and, unless every
        rank holds the same reduced gradients, one max all-reduce of the flag (phase
        ``overflow``)."""
        local = self.checks.overflow == "local"
        flag = np.array([self.strategy.overflow(whole=local)], dtype=self.checks.flag_dtype)
        if not local:
            with self.comm.phase("overflow"):  # every rank agrees: one scalar, max
                self.comm.all_reduce(flag, op="max")
        return bool(flag[0] > 0)

    def _skip(self, reason: str) -> bool:
        """Skip this step as DeepSpeed does: nothing is updated, the gradients are dropped,
        ``skipped_steps`` grows, the reported norm is inf (None where no norm is computed) and
        the loss scaler is told of an overflow (it may raise LossScaleError, on every rank)."""
        self.strategy.step_skipped()
        if self.strategy.muon is not None:  # Muon's copied gradient slices go with the rest
            self.strategy.muon.step_skipped()
        self.strategy.zero_grad()
        self.skipped_steps += 1
        self._global_grad_norm = None if self.checks.norm == "none" else math.inf
        self.loss_scaler.update_scale(True)
        log.info(
            "step %d skipped: %s; loss scale now %g", self.global_steps, reason, self.loss_scale
        )
        return False

    def _reported_norm(self, norm: float | None, unscaled: float | None) -> float | None:
        """The norm ``get_global_grad_norm()`` reports, as DeepSpeed 0.19.8's does: None at stage
        0 in one precision (the client's torch optimizer keeps no norm; clipping still uses
        it); at stages 1-2 the scaled norm over the scale *before* this step's update
        (``stage_1_and_2.step``: ``norm``), so on a step where the scale grows it is that factor
        above the norm used for clipping; elsewhere over the scale after it (``unscaled``)."""
        stage = self.config.zero_optimization.stage
        if stage == 0 and self.config.mixed_precision is None:
            return None
        return norm if stage in (1, 2) else unscaled

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without fp16)."""
        return self.loss_scaler.loss_scale

    def _grad_norm(self, inv_scale: float = 1.0) -> float | None:
        """The global norm of the gradients times ``inv_scale``, as the schedule says
        (``self.checks``); None without one.

        "sum_sq": each rank's partial Σg² over what it owns, summed by one all-reduce per norm
        group (``Strategy.grad_norm_sq_parts``: DeepSpeed's parameter groups or sub-groups); "mean":
        DeepSpeed's stage 0 all-reduces ‖g‖/N of the full local gradients; "local": the full
        local gradients, no collective; "none": no norm (and so no clipping).
        """
        checks = self.checks
        if checks.norm == "none":  # compute_grad_norm false
            return None
        if checks.norm == "sum_sq":  # a scalar per norm group, phase "clip" (DeepSpeed's)
            total = 0.0
            for part in self.strategy.grad_norm_sq_parts(inv_scale):
                message = np.array([part], dtype=checks.norm_dtype)
                with self.comm.phase("clip"):
                    self.comm.all_reduce(message)
                total += float(message[0])
            return math.sqrt(total)
        sum_sq = self.strategy.grad_norm_sq(inv_scale, whole=True)
        if checks.norm == "local":
            return math.sqrt(sum_sq)
        mean = checks.norm == "mean"  # one scalar, phase "clip": kept apart from the volume
        value = math.sqrt(sum_sq) / self.comm.size if mean else sum_sq
        message = np.array([value], dtype=checks.norm_dtype)
        with self.comm.phase("clip"):
            self.comm.all_reduce(message)
        return float(message[0]) if mean else math.sqrt(float(message[0]))

    def _clip_coef(self, norm: float | None) -> float:
        """The factor ``gradient_clipping`` applies to the unscaled gradients whose norm is
        ``norm``: max_norm / (norm + 1e-6) where that is below 1, else 1; 0 for an inf norm,
        and nan for a nan one (DeepSpeed's stage 0: ``torch.min(1, coefficient)``)."""
        max_norm = self.config.gradient_clipping
        if norm is None or max_norm <= 0:
            return 1.0
        coef = max_norm / (norm + 1e-6)
        return coef if coef < 1 or math.isnan(coef) else 1.0

    # -- queries ----------------------------------------------------------------------------------
    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm (before clipping) of the last optimizer step, as DeepSpeed reports
        it: inf after a skipped step, None at stage 0 without fp16/bf16 (``_reported_norm``)."""
        return self._global_grad_norm

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def full_state_dict(self) -> dict[str, np.ndarray]:
        """Collective: every rank gets {name: full parameter as a host numpy array}."""
        with self.comm.phase("state_dict"):
            return self.strategy.full_state_dict()

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds, by category, from the arrays actually alive. Categories do not
        overlap: ``held`` in ``memory_totals()`` is their sum without the ``peak_*`` entries."""
        report = self.strategy.memory_report()
        report["buffers"] = sum(nbytes(b) for _, b in self.module.named_buffers())
        return report

    def crossings(self) -> dict[str, int]:
        """Host <-> device crossings this rank made since ``initialize`` began (moving the model
        included): calls and bytes each way (``backend.crossings()``; all zero on numpy)."""
        now = crossings().as_dict()
        return {k: v - self._crossings_at_start[k] for k, v in now.items()}

    def memory_totals(self) -> dict[str, int]:
        """Totals, kept apart from ``memory_report`` so that summing it counts nothing twice:
        ``held`` (Σ of its non-peak categories), ``device_bytes`` / ``host_bytes`` /
        ``nvme_bytes`` (model states and swap buffers by placement, docs/offload.md) and
        ``max_rss`` (the operating system's high-water mark of this whole process: a measured
        peak to set beside the counted one)."""
        import resource

        report = self.memory_report()
        held = sum(v for k, v in report.items() if not k.startswith("peak_"))
        max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return {"held": held, **self.strategy.placement(), "max_rss": max_rss}

    def save_16bit_model(self, save_dir: Any, save_filename: str = "zerosim_model.npz") -> bool:
        """Collective: the model's weights in its training dtype, as ``{name: array}`` in
        ``save_dir/save_filename`` (one ``.npz``, written by rank 0). DeepSpeed's method of the
        same name, streamed: each parameter is gathered (stage 3), written and dropped before the
        next, so no rank ever holds the whole model. At stage 3 only with
        ``stage3_gather_16bit_weights_on_model_save``; without it, as DeepSpeed, nothing is
        saved, a warning says why, and the result is False."""
        from pathlib import Path

        from zerosim.checkpoint.files import write_npz_streamed

        zero = self.config.zero_optimization
        if zero.stage == 3 and not zero.stage3_gather_16bit_weights_on_model_save:
            log.warning(
                "save_16bit_model: nothing saved, because "
                "zero_optimization.stage3_gather_16bit_weights_on_model_save is false; set it "
                "to true to gather each parameter, or save a checkpoint and consolidate it"
            )
            return False
        if not str(save_filename).endswith(".npz"):
            raise ValueError(f"save_filename must end in .npz, got {save_filename!r}")
        with self.comm.phase("save"):
            items = self.strategy.iter_params()
            if self.comm.rank == 0:
                write_npz_streamed(Path(save_dir) / save_filename, items)
            else:
                for _ in items:  # take part in each gather
                    pass
            self.comm.barrier()
        return True

    # -- checkpoints (zerosim/checkpoint/sharded.py) ---------------------------------------------
    def save_checkpoint(
        self, save_dir: Any, tag: str | None = None, client_state: Any = None
    ) -> Any:
        """Collective: save under ``save_dir/tag`` (default ``global_step{N}``); see
        ``docs/checkpoints.md``. Returns the tag directory."""
        from zerosim.checkpoint import save_checkpoint

        return save_checkpoint(self, save_dir, tag, client_state)

    def load_checkpoint(
        self,
        load_dir: Any,
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
    ) -> tuple[Any, Any]:
        """Collective: load a checkpoint saved at any world size, stage and layout.
        Returns ``(tag directory, client_state)``."""
        from zerosim.checkpoint import load_checkpoint

        return load_checkpoint(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states)


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
    engine = Engine(model, cfg, comm, optimizer, lr_scheduler)
    engine.remember_model()
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
