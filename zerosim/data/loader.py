"""The loader that turns a rank's sampled indices into ``(x, y)`` micro-batches.

`DataLoader` pairs a dataset (batched indexing: ``dataset[idx]`` with an int
array) with a `DistributedBatchSampler`, and remembers how far into the epoch
it is, so that a checkpoint can resume at the same sample. `build_loader` is
the one-call form the engine uses.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from zerosim.backend import Backend, get_backend
from zerosim.data.sampler import DistributedBatchSampler, check_int


class BatchDataset(Protocol):
    """What a loader needs from a dataset: a length and ``dataset[int array] -> (x, y)``."""

    def __len__(self) -> int: ...

    def __getitem__(self, idx: Any) -> tuple[Any, Any]: ...


class DataLoader:
    """Yield this rank's ``(x, y)`` micro-batches of one epoch, in micro-step order.

    ``for x, y in loader`` reads the rest of the current epoch and then moves
    to the next epoch (new permutation), so ``for epoch in range(E): for x, y
    in loader: ...`` needs no `set_epoch` call.

    Checkpoint state (`state_dict`) counts samples, not this rank's batches, so
    that a run can resume with another world size, micro-batch or accumulation:

    - ``epoch``, ``position``: the number of samples of epoch ``e``'s global
      order that all ranks together have consumed;
    - ``batch_start``: the position where the global batch in progress began
      (equal to ``position`` at an accumulation boundary, where the engine saves);
    - ``dataset_len``, ``shuffle``, ``seed``: what the epoch order is made of; a
      loader with other values would read another order, so it refuses the state.

    A resumed loader lays its global batches from ``batch_start`` with its own
    sizes (`DistributedBatchSampler`: "Resuming at another position"), so no
    sample is read twice or skipped whatever the new world size.

    ``backend`` (a `zerosim.backend.Backend` or its name) moves every batch to
    that backend's arrays (cupy on a GPU); ``None`` yields the dataset's arrays
    as they are.
    """

    def __init__(
        self,
        dataset: BatchDataset,
        sampler: DistributedBatchSampler,
        backend: Backend | str | None = None,
    ) -> None:
        if len(dataset) != sampler.dataset_len:
            raise ValueError(
                f"sampler.dataset_len={sampler.dataset_len} does not match "
                f"len(dataset)={len(dataset)}"
            )
        self.dataset = dataset
        self.sampler = sampler
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.epoch = sampler.epoch
        self.position = 0  # samples of this epoch consumed, all ranks together
        self.batch_start = 0  # where the global batch in progress began

    def __len__(self) -> int:
        """Micro-batches this rank reads in a whole epoch."""
        return len(self.sampler)

    @property
    def micro_batch_size(self) -> int:
        return self.sampler.micro_batch_size

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first sample (discards the current position)."""
        self.epoch = check_int("epoch", epoch, 0)
        self.position = self.batch_start = 0

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        sampler = self.sampler
        width, k = sampler.micro_step_width, sampler.gradient_accumulation_steps
        if self.position == self.batch_start and sampler.steps_from(self.batch_start) == 0:
            self.set_epoch(self.epoch + 1)  # the last epoch was read to its end
        sampler.set_epoch(self.epoch)
        start = self.batch_start  # global batches are laid from here (docstring)
        batches = sampler.rank_batches(self.epoch, start)
        for row in range((self.position - start) // width, len(batches)):
            x, y = self.dataset[batches[row]]
            if self.backend is not None:
                x, y = self.backend.asarray(x), self.backend.asarray(y)
            self.position = start + (row + 1) * width
            if (row + 1) % k == 0:  # this micro-step ends a global batch
                self.batch_start = self.position
            yield x, y
        self.set_epoch(self.epoch + 1)

    # -- checkpoint state ----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this loader is in the global sample stream (class docstring)."""
        sampler = self.sampler
        return {
            "epoch": self.epoch,
            "position": self.position,
            "batch_start": self.batch_start,
            "dataset_len": sampler.dataset_len,
            "shuffle": sampler.shuffle,
            "seed": sampler.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``: the next micro-batch is the one after ``position``.

        ``batch_start`` may be missing (a state saved before it existed, always at an
        accumulation boundary): it is then ``position``. Raises naming the key, the value and
        what is allowed before anything changes.
        """
        missing = {"epoch", "position"} - set(state)
        if missing:
            raise KeyError(f"loader state is missing {sorted(missing)}; got keys {sorted(state)}")
        sampler = self.sampler
        for key in ("dataset_len", "shuffle", "seed"):
            mine = getattr(sampler, key)
            if key in state and state[key] != mine:
                raise ValueError(
                    f"state[{key!r}]={state[key]!r}, but this loader's {key} is {mine!r}: it "
                    "would read another order of the samples, so the saved position would "
                    "repeat some and skip others; load with the same dataset, shuffle and seed"
                )
        epoch = check_int("state['epoch']", state["epoch"], 0)
        position = check_int("state['position']", state["position"], 0)
        start = check_int("state['batch_start']", state.get("batch_start", position), 0)
        done = position - start
        width, size = sampler.micro_step_width, sampler.global_batch_size
        if done < 0:
            raise ValueError(
                f"state['batch_start']={start} must be at most state['position']={position}"
            )
        if done and (done % width or done >= size or sampler.steps_from(start) == 0):
            raise ValueError(
                f"state['position']={position} is {done} samples into the global batch that "
                f"began at {start}; this loader can continue it only if that is a whole number "
                f"of its micro-steps (micro_batch_size·world_size = {width}) less than its "
                f"global batch ({size}) and the batch fits in the epoch; resume from a state "
                "taken at an accumulation boundary (as engine checkpoints are)"
            )
        self.epoch, self.position, self.batch_start = epoch, position, start


def build_loader(
    dataset: BatchDataset,
    micro_batch_size: int,
    world_size: int = 1,
    rank: int = 0,
    gradient_accumulation_steps: int = 1,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = True,
    backend: Backend | str | None = None,
) -> DataLoader:
    """A `DataLoader` over ``dataset`` with a `DistributedBatchSampler` for ``rank``."""
    sampler = DistributedBatchSampler(
        len(dataset),
        micro_batch_size,
        world_size=world_size,
        rank=rank,
        gradient_accumulation_steps=gradient_accumulation_steps,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    return DataLoader(dataset, sampler, backend=backend)
