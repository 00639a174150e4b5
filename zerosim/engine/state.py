"""What a rank holds and what it saves, behind the engine's ``memory_report``,
``memory_totals`` and ``save_16bit_model`` (the sharded checkpoints are
``zerosim/checkpoint/sharded.py``'s).
"""

from __future__ import annotations

import logging
import resource
from pathlib import Path
from typing import Any

from zerosim.backend import nbytes
from zerosim.checkpoint.files import write_npz_streamed
from zerosim.comm import Communicator
from zerosim.nn import Module
from zerosim.zero import Strategy

log = logging.getLogger(__name__)


def memory_report(strategy: Strategy, module: Module) -> dict[str, int]:
    """Bytes this rank holds, by category, from the arrays actually alive. Categories do not
    overlap: ``held`` in ``memory_totals()`` is their sum without the ``peak_*`` entries."""
    report = strategy.memory_report()
    report["buffers"] = sum(nbytes(b) for _, b in module.named_buffers())
    return report


def memory_totals(strategy: Strategy, module: Module) -> dict[str, int]:
    """Totals, kept apart from ``memory_report`` so that summing it counts nothing twice:
    ``held`` (Σ of its non-peak categories), ``device_bytes`` / ``host_bytes`` /
    ``nvme_bytes`` (model states and swap buffers by placement, docs/offload.md) and
    ``max_rss`` (the operating system's high-water mark of this whole process: a measured
    peak to set beside the counted one)."""
    report = memory_report(strategy, module)
    held = sum(v for k, v in report.items() if not k.startswith("peak_"))
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"held": held, **strategy.placement(), "max_rss": max_rss}


def save_16bit_model(
    strategy: Strategy, comm: Communicator, zero: Any, save_dir: Any, save_filename: str
) -> bool:
    """Collective: the model's weights in its training dtype, as ``{name: array}`` in
    ``save_dir/save_filename`` (one ``.npz``, written by rank 0). DeepSpeed's method of the
    same name, streamed: each parameter is gathered (stage 3), written and dropped before the
    next, so no rank ever holds the whole model. Where parameters are partitioned (stage 3) only
    with ``stage3_gather_16bit_weights_on_model_save``; without it, as DeepSpeed, nothing is
    saved, a warning says why, and the result is False."""
    if strategy.partitions_params and not zero.stage3_gather_16bit_weights_on_model_save:
        log.warning(
            "save_16bit_model: nothing saved, because "
            "zero_optimization.stage3_gather_16bit_weights_on_model_save is false; set it "
            "to true to gather each parameter, or save a checkpoint and consolidate it"
        )
        return False
    if not str(save_filename).endswith(".npz"):
        raise ValueError(f"save_filename must end in .npz, got {save_filename!r}")
    with comm.phase("save"):
        items = strategy.iter_params()
        if comm.rank == 0:
            write_npz_streamed(Path(save_dir) / save_filename, items)
        else:
            for _ in items:  # take part in each gather
                pass
        comm.barrier()
    return True
