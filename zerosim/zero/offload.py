"""ZeRO-Offload and ZeRO-Infinity: where master weights, optimizer states and parameters live.

``offload_optimizer: {device: cpu}`` keeps the master copy of the owned partition and its
optimizer states in host memory (``numpy``) and steps them there (ZeRO-Offload, Ren et al. 2021).
``device: nvme`` keeps them in files under ``nvme_path`` and streams them through a few in-memory
swap buffers during the step, ``sub_group_size`` elements (one tile) at a time (ZeRO-Infinity,
Rajbhandari et al. 2021). ``offload_param`` (stage 3) does the same for the rank's parameter
shard buffer: host memory, or a file that is read before each all-gather of a chunk.

Per rank and per step, with P the stepped elements, K the optimizer's state arrays and b_m the
master's bytes per element, the nvme swap reads and writes (1 + K)·P·b_m bytes each way; the
in-memory swap buffers hold ⌊buffer_count / (1 + K)⌋·(1 + K)·T·b_m bytes, T the largest tile.

``Offload`` is owned by a strategy; ``check_nvme_paths`` runs before anything is built;
``read_param_chunk`` is the stage-3 all-gather's source. See docs/offload.md.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from itertools import accumulate
from pathlib import Path
from typing import Any

import numpy as np

from zerosim.backend import from_host, nbytes, to_host
from zerosim.errors import ConfigError

log = logging.getLogger(__name__)

KEEP_ENV = "ZEROSIM_KEEP_NVME_FILES"  # set to 1 to keep the swap files after the run
PLACES = {"none": "device", "cpu": "host", "nvme": "nvme"}


def nvme_path_problem(path: str) -> str | None:
    """Why ``path`` cannot hold swap files (missing, not a directory, not writable), or None."""
    if not os.path.exists(path):
        return "does not exist"
    if not os.path.isdir(path):
        return "is not a directory"
    try:  # os.access is not enough: root passes it for read-only mounts
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        return f"is not writable ({err.strerror or err})"
    return None


def check_nvme_paths(zero: Any, comm: Any) -> None:
    """Collective when a section uses nvme: every rank checks its ``nvme_path``; all agree.

    One all-gather of a flag per rank (phase ``init``), so that a path that is bad on some ranks
    only (another node's disk) makes every rank raise ``ConfigError`` naming the key.
    """
    for key in ("offload_optimizer", "offload_param"):
        section = getattr(zero, key)
        if section.device != "nvme":
            continue
        problem = nvme_path_problem(section.nvme_path)
        flags = np.zeros(comm.size, dtype=np.int64)
        with comm.phase("init"):
            comm.all_gather(flags, np.array([problem is not None], dtype=np.int64))
        if flags.any():
            bad = [int(r) for r in np.flatnonzero(flags)]
            got = f"got {section.nvme_path!r}, which " + (problem or f"fails on rank(s) {bad}")
            raise ConfigError(
                f"zero_optimization.{key}.nvme_path",
                section.nvme_path,
                "an existing directory every rank can write to",
                got=got,
            )


def file_backed(array: Any) -> bool:
    """True for a view of a file (``numpy.memmap`` of a swap file), not of memory."""
    return isinstance(array, np.memmap) and array.filename is not None


def _remove(directory: str) -> None:
    if os.environ.get(KEEP_ENV, "0") not in ("", "0"):
        log.info("keeping nvme swap files in %s (%s is set)", directory, KEEP_ENV)
        return
    shutil.rmtree(directory, ignore_errors=True)


class NvmeStore:
    """One rank's directory of swap files: ``nvme_path/zerosim_rank{r}_{pid}_*``.

    ``array(name, numel, dtype)`` creates ``name.swp`` and maps it (``numpy.memmap``). The
    directory is removed when the store is closed or garbage collected, and at interpreter exit,
    unless the environment variable ``ZEROSIM_KEEP_NVME_FILES`` is set (to anything but 0).
    """

    def __init__(self, root: str, rank: int) -> None:
        prefix = f"zerosim_rank{rank}_{os.getpid()}_"
        # this rank's directory of swap files
        self.directory: Path = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
        self.files: dict[str, np.memmap] = {}  # name -> its mapped swap file
        self.bytes_read: int = 0  # bytes read from the files so far
        self.bytes_written: int = 0  # bytes written to them so far
        # removes the directory when the store goes
        self._finalizer: weakref.finalize = weakref.finalize(self, _remove, str(self.directory))

    def path(self, name: str) -> Path:
        return self.directory / f"{name}.swp"

    def array(self, name: str, numel: int, dtype: Any) -> np.ndarray:
        """A new zero-filled file of ``numel`` elements, mapped (no file for 0 elements)."""
        if name in self.files:
            raise ValueError(f"swap file {name!r} exists already in {self.directory}")
        if numel == 0:  # a file cannot be mapped empty; nothing to store
            return np.zeros(0, dtype=dtype)
        mapped = np.memmap(self.path(name), mode="w+", dtype=np.dtype(dtype), shape=(numel,))
        self.files[name] = mapped
        return mapped

    def read(self, name: str, start: int, count: int) -> np.ndarray:
        """Elements [start, start + count) of a file, read with one explicit read into memory."""
        mapped = self.files[name]
        out = np.fromfile(
            self.path(name), dtype=mapped.dtype, count=count, offset=start * mapped.itemsize
        )
        self.bytes_read += out.nbytes
        return out

    def flush(self) -> None:
        for mapped in self.files.values():
            mapped.flush()

    def close(self) -> None:
        """Drop the mappings and remove the directory (unless kept)."""
        self.files.clear()
        self._finalizer()


class NvmeOptimizerSwapper:
    """The optimizer step of ZeRO-Infinity: tiles swapped in from files, stepped, swapped out.

    Between steps each tile's ``.data`` (its master tile) and its state arrays are views of the
    swap files, so checkpoints and tests read and write the files themselves. ``step`` replaces
    the optimizer's ``step``: for ⌊buffer_count / (1 + K)⌋ tiles at a time it copies the master
    and each state tile into in-memory buffers, runs the optimizer's own step on those tiles only
    (the others' ``.grad`` are None for that call, and the optimizer skips them), and writes the
    buffers back to the files. The optimizer creates a tile's state at its first step, in memory;
    the swap-out moves it into the files.
    """

    def __init__(self, strategy: Any, store: NvmeStore, buffer_count: int) -> None:
        opt = strategy.optimizer
        self.optimizer: Any = opt  # whose step this replaces
        self.store: NvmeStore = store  # the swap files of the master and state tiles
        self.tiles: list[list[Any]] = strategy.sharded_step.tiles  # the tiles, per group
        # per group, the optimizer's state keys
        self.keys: list[list[str]] = [opt.state_keys(group) for group in opt.param_groups]
        # master file views
        self.views: list[list[Any]] = [[s.data for s in tiles] for tiles in self.tiles]
        self.offsets: list[list[int]] = []  # where each tile starts in its group's files
        self.numel: list[int] = []  # elements in each group's files
        for tiles in self.tiles:
            ends = list(accumulate(s.data.size for s in tiles))
            self.offsets.append([0, *ends[:-1]])
            self.numel.append(ends[-1] if ends else 0)
        per_tile = 1 + max(map(len, self.keys), default=0)
        self.slots: int = buffer_count // per_tile  # tiles swapped in at a time
        if self.slots == 0:
            raise ConfigError(
                "zero_optimization.offload_optimizer.buffer_count",
                buffer_count,
                f">= {per_tile}: one buffer for the master tile and one per optimizer state "
                f"({type(opt).__name__} keeps {list(max(self.keys, key=len))})",
            )
        tile = max((s.data.size for tiles in self.tiles for s in tiles), default=0)
        self.buffers: list[list[np.ndarray]] = [  # per slot, the master's and each state's buffer
            [np.empty(tile, dtype=strategy.master_dtype) for _ in range(per_tile)]
            for _ in range(self.slots)
        ]
        self._inner_step: Callable[..., Any] = opt.step  # the optimizer's own step
        opt.step = self.step

    @property
    def nbytes(self) -> int:
        """Bytes of the in-memory swap buffers (host memory)."""
        return sum(b.nbytes for slot in self.buffers for b in slot)

    def _state_view(self, gi: int, k: int, key: str, dtype: Any) -> Any:
        name = f"group{gi}.{key}"
        mapped = self.store.files.get(name)
        if mapped is None:
            mapped = self.store.array(name, self.numel[gi], dtype)
        at = self.offsets[gi][k]
        return mapped[at : at + self.views[gi][k].size]

    def _swap_in(self, slot: int, gi: int, k: int) -> None:
        s, buffers = self.tiles[gi][k], self.buffers[slot]
        n = s.data.size
        s.data = self._read(buffers[0][:n], s.data)
        state = self.optimizer.state.get(s) or {}
        for j, key in enumerate(self.keys[gi]):
            if key in state:
                state[key] = self._read(buffers[1 + j][:n], state[key])

    def _read(self, buffer: Any, source: Any) -> Any:
        buffer[...] = source  # through the mapping: the OS reads the file's pages
        self.store.bytes_read += buffer.nbytes
        return buffer

    def _swap_out(self, gi: int, k: int, write: bool) -> None:
        """Point the tile back at its files, writing the buffers first unless ``write`` is off
        (a failed step: the files keep the values from before it)."""
        s, view = self.tiles[gi][k], self.views[gi][k]
        pairs = [(view, s.data)]
        state = self.optimizer.state.get(s) or {}
        for key in self.keys[gi]:
            if key in state and not file_backed(state[key]):
                pairs.append((self._state_view(gi, k, key, state[key].dtype), state[key]))
                state[key] = pairs[-1][0]
        for target, source in pairs if write else ():
            target[...] = source
            self.store.bytes_written += target.nbytes
        s.data = view

    def step(self, closure: Any = None) -> Any:
        """The optimizer's step, ``slots`` tiles at a time through the swap buffers."""
        opt = self.optimizer
        if [opt.state_keys(g) for g in opt.param_groups] != self.keys:
            raise RuntimeError(
                "the optimizer's state arrays changed after the nvme swap buffers were sized "
                f"for {self.keys}; build a new engine to change amsgrad or the optimizer"
            )
        loss = None if closure is None else closure()
        jobs = [(gi, k) for gi, tiles in enumerate(self.tiles) for k in range(len(tiles))]
        grads = [self.tiles[gi][k].grad for gi, k in jobs]
        jobs = [job for job, grad in zip(jobs, grads, strict=True) if grad is not None]
        grads = [grad for grad in grads if grad is not None]
        for gi, k in jobs:
            self.tiles[gi][k].grad = None
        try:
            for first in range(0, len(jobs), self.slots):
                batch = jobs[first : first + self.slots]
                for slot, (gi, k) in enumerate(batch):
                    self._swap_in(slot, gi, k)
                    self.tiles[gi][k].grad = grads[first + slot]
                stepped = False
                try:
                    self._inner_step()
                    stepped = True
                finally:
                    for gi, k in batch:
                        self._swap_out(gi, k, write=stepped)
                        self.tiles[gi][k].grad = None
        finally:
            for (gi, k), grad in zip(jobs, grads, strict=True):  # master_to_params needs them
                self.tiles[gi][k].grad = grad
        return loss


class Offload:
    """A strategy's offload settings and the stores and swapper that carry them out."""

    def __init__(self, zero: Any, rank: int) -> None:
        opt_cfg, param_cfg = zero.offload_optimizer, zero.offload_param
        self.optimizer: str = opt_cfg.device  # "none", "cpu" or "nvme"
        self.param: str = param_cfg.device  # the same, for stage 3's parameters
        # offload_optimizer.buffer_count: nvme swap buffers
        self.buffer_count: int = opt_cfg.buffer_count
        self.stores: dict[str, NvmeStore] = {}  # one per directory
        self.optimizer_store: NvmeStore | None = None  # nvme: the optimizer's swap files
        self.param_store: NvmeStore | None = None  # nvme: stage 3's parameter swap files
        if self.optimizer == "nvme":
            self.optimizer_store = self._store(opt_cfg.nvme_path, rank)
        if self.param == "nvme":
            self.param_store = self._store(param_cfg.nvme_path, rank)
        self.swapper: NvmeOptimizerSwapper | None = None  # nvme: the swapped optimizer step

    def _store(self, root: str, rank: int) -> NvmeStore:
        key = os.path.realpath(root)
        if key not in self.stores:
            self.stores[key] = NvmeStore(root, rank)
        return self.stores[key]

    @property
    def active(self) -> bool:
        """Anything offloaded: then the optimizer always steps a separate master copy."""
        return self.optimizer != "none" or self.param != "none"

    def params_to_files(self, groups: list[Any]) -> None:
        """offload_param nvme (stage 3): move each group's shard buffer into a swap file."""
        for gi, g in enumerate(groups if self.param_store is not None else ()):
            g.param_file, flat = f"group{gi}.params", g.flat_param
            g.flat_param = self.param_store.array(g.param_file, flat.size, flat.dtype)
            g.flat_param[...] = to_host(flat)
            self.param_store.bytes_written += nbytes(flat)

    def new_master(self, gi: int, numel: int, dtype: Any, xp: Any) -> Any:
        """The master buffer of group ``gi``: a file (nvme), host memory (cpu) or the device's."""
        if self.optimizer == "nvme":
            return self.optimizer_store.array(f"group{gi}.master", numel, dtype)
        return (np if self.optimizer == "cpu" else xp).empty(numel, dtype=dtype)

    def attach_optimizer(self, strategy: Any) -> None:
        """optimizer nvme: the tile swapper takes over the optimizer's step."""
        if self.optimizer != "nvme":
            return
        try:
            self.swapper = NvmeOptimizerSwapper(strategy, self.optimizer_store, self.buffer_count)
        except ConfigError:
            self.close()
            raise

    def after_update(self) -> None:
        """Flush what the step wrote through the mappings (parameters, master) to the files."""
        for store in self.stores.values():
            store.flush()

    def split(self, strategy: Any, report: dict[str, int]) -> dict[str, int]:
        """{device_bytes, host_bytes, nvme_bytes} of a strategy's model states and swap buffers.

        ``params`` go where ``offload_param`` says, ``grads`` stay on the device; the master
        weights, master gradients and optimizer states are placed array by array (a swap file:
        nvme; else host memory under an optimizer offload, the device without). The swap
        buffers are host memory.
        """
        out = {"device_bytes": report["grads"], "host_bytes": 0, "nvme_bytes": 0}
        out[f"{PLACES[self.param]}_bytes"] += report["params"]
        memory = "host" if self.optimizer != "none" else "device"
        for a in optimizer_arrays(strategy):
            out[f"{'nvme' if file_backed(a) else memory}_bytes"] += nbytes(a)
        out["host_bytes"] += self.swap_nbytes()
        return out

    def swap_nbytes(self) -> int:
        """Bytes of the in-memory swap buffers of the nvme optimizer offload (host memory)."""
        return self.swapper.nbytes if self.swapper is not None else 0

    def close(self) -> None:
        """Remove the swap files now (unless ``ZEROSIM_KEEP_NVME_FILES`` is set)."""
        for store in self.stores.values():
            store.close()


def optimizer_arrays(strategy: Any) -> list[Any]:
    """The arrays an optimizer offload moves: master params and grads, optimizer states (Muon's
    momentum among them)."""
    out = [g.master for g in strategy.groups if g.master is not None]
    out += strategy.layout.master_grads  # Megatron's fp16 recipe: its fp32 gradient shard
    opt = strategy.optimizer
    for group, tiles in zip(opt.param_groups, strategy.sharded_step.tiles, strict=True):
        keys = opt.state_keys(group)
        for s in tiles:
            state = opt.state.get(s) or {}
            out += [state[k] for k in keys if k in state]
    if strategy.muon is not None:  # Muon's momentum, kept beside the optimizer's states
        out += strategy.muon.momentum_arrays()
    return out


def read_param_chunk(strategy: Any, group: Any, index: int) -> Any:
    """Stage 3's all-gather input for parameter ``index``: this rank's chunk of it.

    With ``offload_param: nvme`` the chunk is read from the swap file into memory first (one
    explicit read per gather, counted in the store's ``bytes_read``); otherwise it is the view of
    the shard buffer.
    """
    offload = strategy.offload
    if offload is None or offload.param_store is None:
        return group.chunk(index)
    start, count = group.partition.offsets[index], group.partition.chunks[index]
    return from_host(offload.param_store.read(group.param_file, start, count), xp=group.xp)
