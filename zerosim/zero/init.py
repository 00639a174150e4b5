"""``zero.Init`` and ``GatheredParameters``: build a model already partitioned, look inside it.

Stage 3 lets N ranks train a model none of them could hold, but only if no rank ever builds the
whole model. Inside ``Init`` every ``Parameter`` a module registers is partitioned on the spot
(through ``nn.module``'s parameter-registration hook, as DeepSpeed's ``zero.Init`` wraps module
constructors): rank 0's value is broadcast (so every rank agrees whatever its seed; phase
``init``), cast to the training dtype, and cut to this rank's chunk of ceil(numel / N) elements
(DeepSpeed's per-parameter partition, ``partition.per_param_partition``); the full array is
dropped and ``param.data`` becomes empty. A rank therefore holds, while building, its chunks so far
plus the one parameter being created. Parameters of at most ``stage3_param_persistence_threshold``
elements stay whole, as DeepSpeed keeps them.

``param.partition`` (a ``ParamChunk``) remembers the communicator and the chunk; stage 3 adopts the
chunk as is. ``GatheredParameters`` all-gathers such parameters for the length of a ``with`` block
and, with ``modifier_rank``, copies that rank's changes back into every rank's chunk on exit.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import numpy as np
from array_api_compat import is_array_api_obj

from zerosim.backend import contiguous, flat, move_like, nbytes, np_dtype, resolve_dtype, xp_of
from zerosim.comm import Communicator, default_comm
from zerosim.nn import Module, Parameter
from zerosim.nn.module import register_module_parameter_registration_hook
from zerosim.zero.partition import chunk_numel


def _ndim(value: Any) -> int:
    """Axes of an array of any namespace, or of a Python scalar or sequence."""
    return value.ndim if is_array_api_obj(value) else np.ndim(value)


class ParamChunk:
    """This rank's chunk of one partitioned parameter, and what gathering it needs."""

    def __init__(self, comm: Communicator, numel: int, chunk: Any) -> None:
        self.comm: Communicator = comm  # the ranks the parameter is partitioned over
        self.numel: int = numel  # elements of the whole parameter
        self.chunk: Any = chunk  # ceil(numel / N) elements; past the parameter's end: zero padding

    @property
    def valid(self) -> int:
        """Elements of the chunk that belong to the parameter (the rest is padding)."""
        start = self.comm.rank * self.chunk.size
        return max(0, min(self.chunk.size, self.numel - start))

    def store(self, value: Any) -> None:
        """Keep this rank's piece of the full ``value`` (an array of the parameter's size, or a
        scalar)."""
        start, n = self.comm.rank * self.chunk.size, self.valid
        if _ndim(value) == 0:
            self.chunk[:n] = value
        else:
            self.chunk[:n] = flat(move_like(value, self.chunk))[start : start + n]

    def set_full(self, value: Any) -> None:
        """Collective: rank 0's full ``value`` becomes the parameter (every rank keeps its
        chunk), as ``Parameter.set_full_`` does for a whole parameter; what a model's own
        post-construction initialisation calls, so ranks need not share a seed."""
        if _ndim(value) != 0 and self.comm.size > 1:
            xp = xp_of(self.chunk)
            value = contiguous(xp.astype(move_like(value, self.chunk), self.chunk.dtype))
            with self.comm.phase("init"):
                self.comm.broadcast(value, root=0)
        self.store(value)

    def gather(self) -> Any:
        """Collective: the full parameter (flat), all-gathered from every rank's chunk."""
        xp = xp_of(self.chunk)
        full = xp.empty(self.chunk.size * self.comm.size, dtype=self.chunk.dtype)
        self.comm.all_gather(full, self.chunk)
        return full[: self.numel]


class Init:
    """``with zerosim.zero.Init(comm, config): model = …`` builds ``model`` partitioned.

    ``config``: the DeepSpeed config the engine will get (a dict, path or ``Config``); it gives
    ``stage3_param_persistence_threshold`` and, unless ``dtype`` is given, the training dtype
    (fp16/bf16 or ``zerosim.dtype``). Without a config nothing is persistent and parameters keep
    the dtype their modules made. ``enabled=False`` builds the model whole, as without ``Init``.
    """

    def __init__(
        self,
        comm: Communicator | None = None,
        config: Any = None,
        enabled: bool = True,
        dtype: Any = None,
    ) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be True or False, got {enabled!r}")
        self.enabled: bool = enabled  # False: the block builds whole parameters
        # the ranks parameters are partitioned over
        self.comm: Communicator | None = comm if comm is not None or not enabled else default_comm()
        self.threshold: int = 0  # stage3_param_persistence_threshold: smaller ones stay whole
        # the dtype parameters are cast to, if any
        self.dtype: np.dtype | None = None if dtype is None else resolve_dtype(dtype)
        if config is not None and enabled:
            from zerosim.config import load_config

            cfg = load_config(config, self.comm.size)
            self.threshold = cfg.zero_optimization.stage3_param_persistence_threshold
            if self.dtype is None:
                self.dtype = resolve_dtype(cfg.model_dtype)
        self._handle: Any = None  # the parameter-registration hook, removed on exit
        self._thread: int = 0  # the thread that entered: under LocalWorld every rank is a thread
        self.partitioned: int = 0  # parameters partitioned by this context
        self.peak_full_bytes: int = 0  # the largest whole parameter held while building

    def __enter__(self) -> Init:
        if self.enabled:
            self._thread = threading.get_ident()
            self._handle = register_module_parameter_registration_hook(self._partition)
        return self

    def __exit__(self, *_exc: Any) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _partition(self, module: Module, name: str, p: Parameter) -> None:
        if threading.get_ident() != self._thread:
            return  # another rank's thread building its own model (LocalWorld)
        if p.partition is not None:  # already partitioned (a tied weight assigned again)
            return
        comm = self.comm
        if self.dtype is not None and np_dtype(p.data.dtype) != self.dtype:
            p.data = xp_of(p.data).astype(p.data, self.dtype)
            p.dtype = self.dtype
        p.data = contiguous(p.data)
        self.peak_full_bytes = max(self.peak_full_bytes, nbytes(p.data))
        if comm.size > 1:
            with comm.phase("init"):
                comm.broadcast(p.data, root=0)
        if p.numel <= self.threshold:
            return  # persistent: stays whole on every rank
        xp = xp_of(p.data)
        chunk = xp.zeros(chunk_numel(p.numel, comm.size), dtype=p.data.dtype)
        p.partition = ParamChunk(comm, p.numel, chunk)
        p.partition.store(p.data)
        p.data = xp.empty(0, dtype=p.data.dtype)
        self.partitioned += 1


def is_partitioned(model: Module) -> bool:
    """Whether any parameter of ``model`` was built partitioned (inside ``Init``)."""
    return any(p.partition is not None for p in model.parameters())


class GatheredParameters:
    """``with GatheredParameters(params, modifier_rank=None): …`` — DeepSpeed's semantics.

    Collective over the parameters' communicator (every rank enters the block). Inside, each
    partitioned parameter in ``params`` holds its full value in ``.data``; whole parameters are
    left alone. On exit, with ``modifier_rank`` r, rank r's values are broadcast and every rank
    keeps its chunk of them (changes made on other ranks are discarded); without it, changes are
    discarded. Then the gathered copies are freed. After ``initialize`` at stage 3 the chunks are
    the engine's model-dtype shard; under fp16/bf16 its fp32 master is not changed (as in
    DeepSpeed, modify before ``initialize``, or load a checkpoint).
    """

    def __init__(
        self,
        params: Parameter | Iterable[Parameter],
        modifier_rank: int | None = None,
        enabled: bool = True,
    ) -> None:
        params = [params] if isinstance(params, Parameter) else list(params)
        for i, p in enumerate(params):
            if not isinstance(p, Parameter):
                raise TypeError(f"params[{i}] must be a Parameter, got {type(p).__name__}")
        # the partitioned ones among those given
        self.params: list[Parameter] = (
            [p for p in params if p.partition is not None] if enabled else []
        )
        comms = {id(p.partition.comm): p.partition.comm for p in self.params}
        if len(comms) > 1:
            raise ValueError("params are partitioned over different communicators; gather each")
        # their communicator (None: nothing to gather)
        self.comm: Communicator | None = next(iter(comms.values()), None)
        if modifier_rank is not None and self.comm is not None:
            if not isinstance(modifier_rank, int) or not 0 <= modifier_rank < self.comm.size:
                raise ValueError(
                    f"modifier_rank must be None or a rank in [0, {self.comm.size}), "
                    f"got {modifier_rank!r}"
                )
        self.modifier_rank: int | None = modifier_rank  # whose changes are kept (None: none)

    def __enter__(self) -> GatheredParameters:
        for p in self.params:
            full = p.partition.gather()
            p.data = xp_of(full).reshape(full, p.shape)
        return self

    def __exit__(self, exc_type: Any, *_exc: Any) -> None:
        for p in self.params:
            if exc_type is None and self.modifier_rank is not None:
                p.data = contiguous(p.data)
                self.comm.broadcast(p.data, root=self.modifier_rank)
                p.partition.store(p.data)
            p.data = xp_of(p.data).empty(0, dtype=p.data.dtype)
