"""The training engine: DeepSpeed's verbs over a ZeRO strategy.

    loss = engine(x, y)      # forward on this rank's micro-batch
    engine.backward(loss)    # gradients of loss / gradient_accumulation_steps
    engine.step()            # at the accumulation boundary: reduce, clip, update, gather

The engine owns the loop's bookkeeping (micro-steps, the accumulation boundary, loss scaling,
clipping, ledger phases, the scheduler); where gradients and parameters live and how they travel
is the strategy's business (``zerosim.zero``), and so is whatever differs between stages. It never
calls MPI itself; besides the strategy's, a step's only collectives are the boundary's overflow
flag and gradient norm (``boundary.py``, as ``zerosim/zero/schedule.py``'s table says).
The rest of ``initialize`` and of the engine's checks and reports: the package's other modules.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from zerosim import checkpoint
from zerosim.backend import (
    Backend,
    crossings,
    from_host,
    item,
    np_dtype,
    resolve_dtype,
    to_host,
    xp_of,
)
from zerosim.comm import Communicator
from zerosim.config import Config
from zerosim.engine.boundary import global_grad_norm, overflow_seen
from zerosim.engine.guards import VerbGuard
from zerosim.engine.reporting import StepLog, reported_norm
from zerosim.engine.state import memory_report, memory_totals, save_16bit_model
from zerosim.nn import Module
from zerosim.zero import Strategy
from zerosim.zero.loss_scaler import LossScalerBase
from zerosim.zero.schedule import BoundaryChecks

log = logging.getLogger(__name__)


def _to_float16(x: Any) -> Any:
    """``x`` cast to float16 when it is a floating-point array (``fp16.auto_cast``)."""
    if x is None or not hasattr(x, "dtype") or not np.issubdtype(np_dtype(x.dtype), np.floating):
        return x
    return xp_of(x).astype(x, np.float16)


def to_device(batch: Any, backend: Backend) -> Any:
    """A host batch crosses to the backend's device (``backend.from_host``, counted); one
    already there stays."""
    if batch is None or backend.name == "numpy" or xp_of(batch) is backend.xp:
        return batch
    return from_host(to_host(batch), xp=backend.xp)


def loss_seed(loss_scale: float, accumulation_steps: int, dtype: Any = None) -> float:
    """d(loss)/d(loss) as DeepSpeed seeds backward: loss scale / gradient_accumulation_steps,
    rounded to ``dtype``, the model dtype under fp16 or bf16 (None in one precision).

    Under fp16 or bf16 torch's loss is a 16-bit tensor, and so is its gradient: DeepSpeed's
    ``(loss / gas) * scale`` hands backward round(round(scale) / gas) in the model dtype. A
    scale above float16's largest value, 65504 (DeepSpeed's default 2**16 included), is inf
    there, so that step overflows and is skipped whatever the gradients.
    """
    if dtype is None:
        return loss_scale / accumulation_steps
    dtype = resolve_dtype(dtype)
    with np.errstate(over="ignore"):
        scale = np.float32(np.asarray(loss_scale, dtype=dtype))
        return float(np.asarray(scale / accumulation_steps, dtype=dtype))


def clip_coef(norm: float | None, max_norm: float) -> float:
    """The factor ``gradient_clipping`` (``max_norm``) applies to the unscaled gradients whose
    norm is ``norm``: max_norm / (norm + 1e-6) where that is below 1, else 1; 0 for an inf norm,
    and nan for a nan one (DeepSpeed's stage 0: ``torch.min(1, coefficient)``)."""
    if norm is None or max_norm <= 0:
        return 1.0
    coef = max_norm / (norm + 1e-6)
    return coef if coef < 1 or math.isnan(coef) else 1.0


class Engine:
    """DeepSpeed-like engine over one of zerosim's ZeRO strategies (``initialize`` builds it)."""

    def __init__(
        self,
        model: Module,
        config: Config,
        comm: Communicator,
        *,
        strategy: Strategy,
        checks: BoundaryChecks,
        loss_scaler: LossScalerBase,
        lr_scheduler: Any,
        backend: Backend,
        crossings_at_start: dict[str, int],
    ) -> None:
        self.module, self.config, self.comm, self.backend = model, config, comm, backend
        self.strategy = strategy
        self.optimizer = strategy.optimizer
        self.checks = checks  # the boundary's overflow and norm collectives
        self.loss_scaler = loss_scaler
        self.lr_scheduler = lr_scheduler
        self.gradient_accumulation_steps = config.gradient_accumulation_steps
        self.micro_steps = 0
        self.global_steps = 0
        self.skipped_steps = 0
        self._global_grad_norm: float | None = None
        self.guard = VerbGuard(self, model, strategy.partitions_params, strategy.gathered_dtype())
        self.step_log = StepLog(comm.rank, config.steps_per_print, config.wall_clock_breakdown)
        self.wall_clock = self.step_log.wall_clock  # seconds per phase, cumulative
        self._crossings_at_start = crossings_at_start
        self.training_dataloader = None

    # -- the training verbs ----------------------------------------------------------------------
    def __call__(self, x: Any, y: Any = None) -> Any:
        """Forward this rank's micro-batch; with targets, returns the loss (mean over it)."""
        self.guard.check_forward(x, y)
        x, y = to_device(x, self.backend), to_device(y, self.backend)
        if self.config.fp16.auto_cast:  # DeepSpeed casts floating-point inputs to float16
            x, y = _to_float16(x), _to_float16(y)
        with self._phase("forward"), self._fp16_quiet():
            self.strategy.before_forward()
            out = self.module(x, y) if y is not None else self.module(x)
        return out if y is None else self.guard.new_loss(item(out))

    forward = __call__

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the current micro-step is the last of its accumulation window."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def backward(self, loss: Any) -> None:
        """Backpropagate ``loss`` / gradient_accumulation_steps and reduce as the stage says."""
        self.guard.check_backward(loss)
        boundary = self.is_gradient_accumulation_boundary()
        with self._phase("backward"), self._fp16_quiet():
            self.strategy.before_backward(boundary)
            dtype = None if self.config.mixed_precision is None else self.config.model_dtype
            seed = loss_seed(self.loss_scale, self.gradient_accumulation_steps, dtype)
            self.module.backward(grad_scale=seed)
            self.strategy.after_backward(boundary)
        self.guard.backward_done()

    def step(self) -> None:
        """End a micro-step; at the boundary: clip, update the owned shard, gather, schedule."""
        self.guard.check_step()
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
        self.step_log.after_step(
            self.global_steps,
            self.get_lr(),
            self._global_grad_norm,
            self.loss_scale,
            self.skipped_steps,
        )

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        """Label the ledger with ``name`` and add the time spent to ``wall_clock[name]``."""
        with self.step_log.timed(name), self.comm.phase(name):
            yield

    def _fp16_quiet(self) -> Any:
        """Under fp16 an overflow is expected now and then: it becomes inf/nan in the gradients,
        which the step detects and skips, so NumPy need not warn about it."""
        if self.config.fp16.enabled:
            return np.errstate(over="ignore", invalid="ignore")
        return contextlib.nullcontext()

    # -- the boundary: overflow, norm, clipping, update -------------------------------------------
    def _update(self) -> bool:
        """The boundary's work; False when the step was skipped: an inf/nan gradient that the
        overflow flag saw, or a gradient norm that is not finite where the schedule skips on it
        (``self.checks``, the table of zerosim/zero/schedule.py)."""
        checks = self.checks
        if checks.overflow != "none" and overflow_seen(self.strategy, self.strategy.comm, checks):
            return self._skip("gradient overflow")
        # As in DeepSpeed 0.19.8, the norm is taken of the gradients as they stand (scaled by the
        # current loss scale) and judged before the scale is updated; and, as in every fp16
        # optimizer of it, the scale is updated before the gradients are unscaled: on a step
        # where it grows, they are divided by the new scale.
        prev_scale = self.loss_scaler.loss_scale  # the norm is of the gradients over it
        # over the strategy's group of ranks: under HSDP one replica's shards (the others match)
        norm = global_grad_norm(self.strategy, self.strategy.comm, checks, 1.0 / prev_scale)
        if norm is not None and not math.isfinite(norm):
            if checks.bad_norm == "skip":
                return self._skip("the gradient norm is not finite")
            if checks.bad_norm == "inf":  # DeepSpeed's ZeRO optimizers mask a nan norm to inf
                norm = math.inf
        self.loss_scaler.update_scale(False)
        scale = self.loss_scaler.loss_scale
        unscaled = None if norm is None else norm * (prev_scale / scale)  # over the new scale
        mixed = self.config.mixed_precision is not None
        self._global_grad_norm = reported_norm(self.strategy.reported_norm, mixed, norm, unscaled)
        coef = clip_coef(unscaled, self.config.gradient_clipping)
        sharded = self.strategy.sharded_step  # the optimizer step over this rank's shard
        if self.strategy.master_dtype is None and coef != 1.0:  # one precision: clip in place
            sharded.clip(coef)
        sharded.unscale_grads(1.0 / scale)
        if self.strategy.master_dtype is not None and coef != 1.0:  # the fp32 gradients made
            sharded.clip(coef)
        self.optimizer.step()
        sharded.master_to_params()
        self.strategy.gather()
        self.strategy.zero_grad()
        return True

    def _skip(self, reason: str) -> bool:
        """Skip this step as DeepSpeed does: nothing is updated, the gradients are dropped,
        ``skipped_steps`` grows, the reported norm is inf (None where no norm is computed) and
        the loss scaler is told of an overflow (it may raise LossScaleError, on every rank)."""
        self.strategy.step_skipped()
        self.strategy.zero_grad()
        self.skipped_steps += 1
        self._global_grad_norm = None if self.checks.norm == "none" else math.inf
        self.loss_scaler.update_scale(True)
        log.info(
            "step %d skipped: %s; loss scale now %g", self.global_steps, reason, self.loss_scale
        )
        return False

    # -- queries, state and files ----------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without fp16)."""
        return self.loss_scaler.loss_scale

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm (before clipping) of the last optimizer step, as DeepSpeed reports
        it: inf after a skipped step, None at stage 0 without fp16/bf16 (engine/reporting.py)."""
        return self._global_grad_norm

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def crossings(self) -> dict[str, int]:
        """Host <-> device crossings this rank made since ``initialize`` began (moving the model
        included): calls and bytes each way (``backend.crossings()``; all zero on numpy)."""
        now = crossings().as_dict()
        return {k: v - self._crossings_at_start[k] for k, v in now.items()}

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds, by category (``engine/state.py``)."""
        return memory_report(self.strategy, self.module)

    def memory_totals(self) -> dict[str, int]:
        """``held``, the bytes by placement and ``max_rss`` (``engine/state.py``)."""
        return memory_totals(self.strategy, self.module)

    def full_state_dict(self) -> dict[str, np.ndarray]:
        """Collective: every rank gets {name: full parameter as a host numpy array}."""
        with self.comm.phase("state_dict"):
            return self.strategy.full_state_dict()

    def save_16bit_model(self, save_dir: Any, save_filename: str = "zerosim_model.npz") -> bool:
        """Collective: the weights in the training dtype, one ``.npz`` (``engine/state.py``)."""
        zero = self.config.zero_optimization
        return save_16bit_model(self.strategy, self.comm, zero, save_dir, save_filename)

    def save_checkpoint(
        self, save_dir: Any, tag: str | None = None, client_state: Any = None
    ) -> Any:
        """Collective: save under ``save_dir/tag`` (default ``global_step{N}``); see
        ``docs/checkpoints.md``. Returns the tag directory."""
        return checkpoint.save_checkpoint(self, save_dir, tag, client_state)

    def load_checkpoint(
        self,
        load_dir: Any,
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
    ) -> tuple[Any, Any]:
        """Collective: load a checkpoint saved at any world size, stage and layout.
        Returns ``(tag directory, client_state)``."""
        return checkpoint.load_checkpoint(
            self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states
        )
