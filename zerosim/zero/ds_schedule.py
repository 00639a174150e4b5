"""What DeepSpeed's schedule changes in the paper's gradient norm, whatever the stage.

The paper's stage files send the boundary's gradient norm as one partial Σg² per rank.
DeepSpeed 0.19.8 all-reduces the norm once per parameter group (``get_grad_norm_direct``, called
per group by ``scaled_global_norm`` in ``deepspeed/runtime/zero/stage_1_and_2.py``), not once in
all; at stage 3 (``stage3.py``) a norm group is a ``sub_group_size`` sub-group of a parameter
group. The sharded step (``sharded_step.py``) sends ``norm_parts`` where a class says so
(``norm_per_group``, set by ``DeepSpeedNormGroups``). DeepSpeed's padding and round robin are its
layout part (``layouts.DeepSpeedLayout``).
"""

from __future__ import annotations

from typing import Any

from zerosim.zero.partition import Range, deepspeed_sub_groups


def norm_parts(step: Any, inv_scale: float = 1.0) -> list[float]:
    """This rank's partial Σg² (unscaled) per DeepSpeed norm group of a sharded step
    (``sharded_step.py``): a parameter group where the flat buffer is partitioned (stages 1-2: its
    owned ranges), a ``sub_group_size`` sub-group of one where each parameter is
    (``partitions_params``, stage 3: ``deepspeed_sub_groups``). Muon's matrices hold their
    updates first (its norm is theirs)."""
    if step.muon is not None:
        step.muon.make_updates()
    strategy, parts = step.strategy, []
    for gi, g in enumerate(strategy.groups):
        inv2 = step.group_inv_scale(gi, inv_scale) ** 2  # 1 for Muon's updates
        if not strategy.partitions_params:  # the group's owned ranges
            parts.append(sum(step.range_sum_sq(g, rng) for rng in g.owned) * inv2)
            continue
        for sub in deepspeed_sub_groups(g.partition.chunks, strategy.zero.sub_group_size):
            lo = g.partition.offsets[sub[0]]
            hi = g.partition.offsets[sub[-1]] + g.partition.chunks[sub[-1]]
            parts.append(step.range_sum_sq(g, Range(lo, hi)) * inv2)
    return parts


class DeepSpeedNormGroups:
    """Mixin: one norm all-reduce per DeepSpeed norm group (``get_grad_norm_direct``): the
    sharded step sends ``norm_parts``."""

    norm_per_group = True
