"""Which sample indices each rank reads at each micro-step of data-parallel training.

`DistributedBatchSampler` cuts one epoch's permutation of the dataset into
global batches and hands every rank its micro-batches, so that N ranks with
gradient accumulation see exactly the samples one process would see with the
same global batch. The loader (``loader.py``) turns these indices into arrays.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def check_int(name: str, value: object, minimum: int) -> int:
    """Return ``value`` as an int, or raise naming the argument and what is allowed."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


class DistributedBatchSampler:
    """Split every global batch of an epoch into per-rank, per-micro-step index arrays.

    With ``N = world_size``, ``k = gradient_accumulation_steps`` and
    ``m = micro_batch_size``, a global step consumes a global batch of
    ``G = m·k·N`` indices, taken in order from the epoch's permutation. At
    micro-step ``j`` (0..k-1) rank ``r`` reads the positions

        [(j·N + r)·m, (j·N + r + 1)·m)        of the global batch.

    Example, m = 2, k = 2, N = 3 (G = 12 positions of one global batch):

    ==========  ========  ========  ========
    micro-step  rank 0    rank 1    rank 2
    ==========  ========  ========  ========
    j = 0       0, 1      2, 3      4, 5
    j = 1       6, 7      8, 9      10, 11
    ==========  ========  ========  ========

    Ranks are the fast-moving index within a micro-step, so the union of all
    ranks' micro-batches at micro-step ``j`` is the contiguous block
    ``[j·N·m, (j+1)·N·m)``: exactly what a single process with micro-batch
    ``m·N`` (and the same ``k``) reads at micro-step ``j``. A 1-rank reference
    run therefore reproduces an N-rank run sample for sample.

    Epoch order: ``shuffle=True`` draws a permutation of ``range(dataset_len)``
    from ``numpy.random.default_rng((seed, epoch))``, the same on every rank
    and different for every epoch (`set_epoch`); ``shuffle=False`` uses
    ``0, 1, …, dataset_len-1``.

    Incomplete last global batch (``dataset_len`` not a multiple of ``G``):

    - ``drop_last=True``: dropped; an epoch has ``dataset_len // G`` steps and
      the left-over samples of this epoch's permutation are not read.
    - ``drop_last=False``: kept and padded by wrapping around to the start of
      the permutation (position ``p`` reads ``perm[p % dataset_len]``), like
      ``torch.utils.data.DistributedSampler``; an epoch has
      ``ceil(dataset_len / G)`` steps and a few samples are read twice.

    Resuming at another position (``start``): a run resumed from a checkpoint
    continues an epoch at position ``s``, the number of samples already read,
    which need not be a multiple of ``G`` when the world size changed. Its
    global steps are laid from ``s``: step ``t`` of the rest of the epoch reads
    positions ``[s + t·G, s + (t+1)·G)``, with the same per-rank split as above,
    and the epoch ends when fewer than ``G`` positions remain (drop_last) or its
    last global batch is padded by wrapping around. Nothing before ``s`` is read
    again and nothing after it is skipped. ``start=0`` is the whole epoch.

    Iterating yields this rank's ``k·steps_per_epoch`` index arrays (int64,
    length ``m``) for the current epoch, in micro-step order.
    """

    def __init__(
        self,
        dataset_len: int,
        micro_batch_size: int,
        world_size: int = 1,
        rank: int = 0,
        gradient_accumulation_steps: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        self.dataset_len = check_int("dataset_len", dataset_len, 1)
        self.micro_batch_size = check_int("micro_batch_size", micro_batch_size, 1)
        self.world_size = check_int("world_size", world_size, 1)
        self.rank = check_int("rank", rank, 0)
        if self.rank >= self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        self.gradient_accumulation_steps = check_int(
            "gradient_accumulation_steps", gradient_accumulation_steps, 1
        )
        self.seed = check_int("seed", seed, 0)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        if self.drop_last and self.dataset_len < self.global_batch_size:
            raise ValueError(
                f"dataset_len={self.dataset_len} is smaller than the global batch "
                f"micro_batch_size·gradient_accumulation_steps·world_size = "
                f"{self.global_batch_size}; with drop_last=True an epoch would have no "
                "step. Use a smaller batch or drop_last=False (pads by wrapping around)."
            )
        self.epoch = 0
        self._cached_epoch: int | None = None
        self._cached_perm: np.ndarray | None = None

    # -- sizes ---------------------------------------------------------------
    @property
    def global_batch_size(self) -> int:
        """``G = micro_batch_size · gradient_accumulation_steps · world_size``."""
        return self.micro_batch_size * self.gradient_accumulation_steps * self.world_size

    @property
    def micro_step_width(self) -> int:
        """Samples all ranks read together in one micro-step: ``m·N``."""
        return self.micro_batch_size * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        """Global steps per epoch: ``floor(len/G)`` with drop_last, else ``ceil(len/G)``."""
        return self.steps_from(0)

    def steps_from(self, start: int) -> int:
        """Global steps in the rest of an epoch laid from position ``start``.

        ``floor((len − start)/G)`` with drop_last, else ``ceil((len − start)/G)``; 0 once
        ``start ≥ len`` (the epoch was read to its end).
        """
        start = check_int("start", start, 0)
        full, rest = divmod(max(self.dataset_len - start, 0), self.global_batch_size)
        return full if (self.drop_last or rest == 0) else full + 1

    def __len__(self) -> int:
        """Micro-batches this rank reads per epoch: ``steps_per_epoch · k``."""
        return self.steps_per_epoch * self.gradient_accumulation_steps

    # -- epoch order -----------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose permutation the next iteration uses."""
        self.epoch = check_int("epoch", epoch, 0)

    def epoch_order(self, epoch: int | None = None, start: int = 0) -> np.ndarray:
        """The dataset indices read in ``epoch`` from position ``start`` on, position by position.

        Length ``steps_from(start) · G``: the permutation from ``start``, truncated (drop_last)
        or wrapped around (no drop_last). The same on every rank.
        """
        epoch = self.epoch if epoch is None else check_int("epoch", epoch, 0)
        if epoch != self._cached_epoch:
            if self.shuffle:
                perm = np.random.default_rng((self.seed, epoch)).permutation(self.dataset_len)
            else:
                perm = np.arange(self.dataset_len)
            self._cached_perm = perm.astype(np.int64)
            self._cached_epoch = epoch
        assert self._cached_perm is not None
        positions = start + np.arange(self.steps_from(start) * self.global_batch_size)
        return self._cached_perm[positions % self.dataset_len]

    def global_batch(self, step: int, epoch: int | None = None) -> np.ndarray:
        """The ``G`` dataset indices of global step ``step`` of ``epoch`` (all ranks)."""
        step = check_int("step", step, 0)
        if step >= self.steps_per_epoch:
            raise IndexError(f"step must be in [0, {self.steps_per_epoch}), got {step}")
        g = self.global_batch_size
        return self.epoch_order(epoch)[step * g : (step + 1) * g]

    def rank_batches(self, epoch: int | None = None, start: int = 0) -> np.ndarray:
        """This rank's micro-batches of ``epoch`` from position ``start``, shape
        ``(steps_from(start)·k, m)``.

        Row ``s·k + j`` is micro-step ``j`` of global step ``s`` (counted from ``start``): the
        epoch order seen as ``(step, micro_step, rank, m)`` and sliced at this rank.
        """
        order = self.epoch_order(epoch, start).reshape(
            -1,
            self.gradient_accumulation_steps,
            self.world_size,
            self.micro_batch_size,
        )
        return order[:, :, self.rank, :].reshape(-1, self.micro_batch_size)

    def micro_batch(self, step: int, micro_step: int, epoch: int | None = None) -> np.ndarray:
        """This rank's ``m`` indices at ``micro_step`` of global ``step``."""
        k = self.gradient_accumulation_steps
        micro_step = check_int("micro_step", micro_step, 0)
        if micro_step >= k:
            raise IndexError(
                f"micro_step must be in [0, gradient_accumulation_steps={k}), got {micro_step}"
            )
        batch = self.global_batch(step, epoch)
        m, n = self.micro_batch_size, self.world_size
        start = (micro_step * n + self.rank) * m
        return batch[start : start + m]

    def __iter__(self) -> Iterator[np.ndarray]:
        yield from self.rank_batches()
