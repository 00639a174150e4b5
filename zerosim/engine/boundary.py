"""The two collectives of the accumulation boundary besides the strategy's own: the inf/nan flag
and the global gradient norm, each sent as the schedule's table says (``BoundaryChecks``,
zerosim/zero/schedule.py: which of them, reduced how, in which dtype).
"""

from __future__ import annotations

import math

import numpy as np

from zerosim.comm import Communicator
from zerosim.zero import Strategy
from zerosim.zero.schedule import BoundaryChecks


def overflow_seen(strategy: Strategy, comm: Communicator, checks: BoundaryChecks) -> bool:
    """Whether any rank's gradients hold inf/nan: this rank's own check, and, unless every
    rank holds the same reduced gradients, one max all-reduce of the flag (phase
    ``overflow``)."""
    local = checks.overflow == "local"
    flag = np.array([strategy.sharded_step.overflow(whole=local)], dtype=checks.flag_dtype)
    if not local:
        with comm.phase("overflow"):  # every rank agrees: one scalar, max
            comm.all_reduce(flag, op="max")
    return bool(flag[0] > 0)


def global_grad_norm(
    strategy: Strategy, comm: Communicator, checks: BoundaryChecks, inv_scale: float = 1.0
) -> float | None:
    """The global norm of the gradients times ``inv_scale``, as the schedule says; None
    without one.

    "sum_sq": each rank's partial Σg² over what it owns, summed by one all-reduce per norm
    group (``ShardedStep.grad_norm_sq_parts``: DeepSpeed's parameter groups or sub-groups); "mean":
    DeepSpeed's stage 0 all-reduces ‖g‖/N of the full local gradients; "per_param": torch's
    ``clip_grad_norm_`` on FSDP2's DTensors, one all-reduce of each parameter's partial ‖g‖²,
    the total the norm of the parameters' norms; "local": the full
    local gradients, no collective; "none": no norm (and so no clipping).
    """
    if checks.norm == "none":  # compute_grad_norm false
        return None
    if checks.norm == "sum_sq":  # a scalar per norm group, phase "clip" (DeepSpeed's)
        total = 0.0
        for part in strategy.sharded_step.grad_norm_sq_parts(inv_scale):
            message = np.array([part], dtype=checks.norm_dtype)
            with comm.phase("clip"):
                comm.all_reduce(message)
            total += float(message[0])
        return math.sqrt(total)
    if checks.norm == "per_param":
        parts = strategy.param_grad_norms_sq(inv_scale)
        message = np.array(parts, dtype=checks.norm_dtype)
        with comm.phase("clip"):
            comm.all_reduce(message)
        norms = np.sqrt(message)  # each parameter's norm, then the norm of those
        return float(np.sqrt(np.sum(norms * norms)))
    sum_sq = strategy.sharded_step.grad_norm_sq(inv_scale, whole=True)
    if checks.norm == "local":
        return math.sqrt(sum_sq)
    mean = checks.norm == "mean"  # one scalar, phase "clip": kept apart from the volume
    value = math.sqrt(sum_sq) / comm.size if mean else sum_sq
    message = np.array([value], dtype=checks.norm_dtype)
    with comm.phase("clip"):
        comm.all_reduce(message)
    return float(message[0]) if mean else math.sqrt(float(message[0]))
