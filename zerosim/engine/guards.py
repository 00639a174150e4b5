"""Misuse of the engine's verbs, caught before anything is computed or sent.

A training loop calls ``loss = engine(x, y)``, ``engine.backward(loss)``, ``engine.step()`` in
that order, once per micro-batch, on the model given to ``initialize``. ``VerbGuard`` checks each
call against that contract and raises an error saying what was wrong and what to call instead
(docs/faults.md lists the messages); the engine itself then only trains.
"""

from __future__ import annotations

from typing import Any

from zerosim.backend import np_dtype
from zerosim.nn import Module


class Loss(float):
    """The loss ``engine(x, y)`` returns: a float that remembers which engine made it."""

    engine: Any
    serial: int


class VerbGuard:
    """The order of the verbs and what they are given, for one engine."""

    def __init__(
        self, engine: Any, module: Module, partitions_params: bool, gathered_dtype: Any = None
    ) -> None:
        self.engine = engine
        self.module = module
        # stage 3 releases and gathers its parameters by swapping their .data
        self.swaps_param_data = partitions_params
        # the dtype gathered parameters may have besides their own (FSDP2's param_dtype)
        self.gathered_dtype = None if gathered_dtype is None else np_dtype(gathered_dtype)
        self.serial = 0  # forwards that returned a loss
        self.last_loss: Loss | None = None  # the latest such loss, until its backward
        self.backwards_since_step = 0
        self.first_batch: tuple[int, str] | None = None  # (ndim, dtype kind) of x, 1st forward
        # each parameter and the array behind it, once the strategy put them in its buffers
        self.model_at_init = [(n, p, p.data) for n, p in module.named_parameters()]

    # -- forward ---------------------------------------------------------------------------------
    def check_forward(self, x: Any, y: Any) -> None:
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
        if self.first_batch is None:
            self.first_batch = spec
        elif spec != self.first_batch:
            raise ValueError(
                f"engine(x, y): x has {x.ndim} axes and dtype {x.dtype}, but the first batch had "
                f"{self.first_batch[0]} axes and a dtype of kind {self.first_batch[1]!r}; "
                f"every micro-batch must be laid out alike"
            )
        self.check_model()

    def check_model(self) -> None:
        """The parameters are those of ``initialize``, of the same shapes, still backed by the
        engine's arrays (stages 0-2: the very arrays; stage 3 swaps them itself)."""
        if not self.model_at_init:
            return
        now = [(n, p) for n, p in self.module.named_parameters()]
        before = [(n, p) for n, p, _ in self.model_at_init]
        if [id(p) for _, p in now] != [id(p) for _, p in before]:
            names = {n for n, _ in now}
            old = {n for n, _ in before}
            raise RuntimeError(
                f"the model changed after initialize: parameters added {sorted(names - old)}, "
                f"removed {sorted(old - names)}, or replaced by new Parameter objects; the "
                f"engine trains the parameters it was given: call initialize again"
            )
        for name, p, data in self.model_at_init:
            if p.data is data:
                continue
            shape, dtype = tuple(p.data.shape), np_dtype(p.data.dtype)
            swapped = p.data.size == 0 or shape == p.shape
            allowed = (np_dtype(data.dtype), self.gathered_dtype)
            if self.swaps_param_data and swapped and dtype in allowed:
                continue  # stage 3 releases and gathers parameters by swapping .data
            raise RuntimeError(
                f"the model changed after initialize: parameter {name!r} no longer holds the "
                f"engine's array (now shape {shape}, dtype {dtype}; at initialize "
                f"{tuple(data.shape)}, {np_dtype(data.dtype)}), so the engine's updates would "
                f"not reach it; change weights in place (p.data[...] = values, "
                f"model.load_state_dict, engine.load_checkpoint) or call initialize again"
            )

    def new_loss(self, value: float) -> Loss:
        """The loss of this forward, numbered, for ``check_backward``."""
        loss = Loss(value)
        self.serial += 1
        loss.engine, loss.serial = self.engine, self.serial
        self.last_loss = loss
        return loss

    # -- backward and step -----------------------------------------------------------------------
    def check_backward(self, loss: Any) -> None:
        """``loss`` is this engine's latest, not yet backpropagated, and step() came since the
        last backward()."""
        if getattr(loss, "engine", None) is not self.engine:
            source = "another engine" if isinstance(loss, Loss) else "elsewhere"
            raise ValueError(
                "backward(loss) needs the loss this engine's forward returned "
                f"(got a {type(loss).__name__} from {source})"
            )
        if loss.serial == self.serial and self.last_loss is None:
            raise RuntimeError(
                f"backward(loss) was already called for the loss of forward #{loss.serial}; "
                "each loss is backpropagated once: call loss = engine(x, y) again first"
            )
        if loss is not self.last_loss:
            raise ValueError(
                f"backward(loss) got the loss of forward #{loss.serial}; only the latest "
                f"(#{self.serial}) can be backpropagated"
            )
        if self.backwards_since_step:
            steps = self.engine.gradient_accumulation_steps
            raise RuntimeError(
                "backward() was called again before step(): call engine.step() after every "
                "backward(), also inside an accumulation window; step() counts the "
                f"micro-batches and updates only at the boundary (every "
                f"gradient_accumulation_steps = {steps}), so a "
                "PyTorch-style loop of several backward() and one step() would not reach it"
            )

    def backward_done(self) -> None:
        self.last_loss = None
        self.backwards_since_step += 1

    def check_step(self) -> None:
        """A backward() came since the last step(); the count starts again."""
        if self.backwards_since_step == 0:
            raise RuntimeError(
                "step() was called without a backward() since the last step(); call "
                "loss = engine(x, y); engine.backward(loss); engine.step() for each micro-batch"
            )
        self.backwards_since_step = 0
