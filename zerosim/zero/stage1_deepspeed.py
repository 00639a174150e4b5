"""Stage 1 under DeepSpeed 0.19.8's schedule: IPG buckets at the boundary, all-reduced.

What it changes relative to the paper's stage 1 (``stage1.py``) and why: DeepSpeed's stage 1
(``deepspeed/runtime/zero/stage_1_and_2.py``) does not reduce-scatter the gradient buffer. At the
boundary the gradients join IPG buckets (``reduce_independent_p_g_buckets_and_remove_grads``) in
definition order after backward (``reduce_gradients``), or in the order backward finishes them
with ``overlap_comm`` (its hooks); each full bucket is reduced (``reduce_ipg_grads`` →
``average_tensor``) and, with DeepSpeed's default switches, *all-reduced*, after which every rank
keeps the part it owns (``zerosim/zero/ipg.py``). Its flat buffers pad to a multiple of 2·N
(``layouts.DeepSpeedLayout``) and its norm is all-reduced per group (``ds_schedule.py``). Per
step: 2(N−1)/N · Ψ all-reduced + (N−1)/N · Ψ_pad all-gathered, about 3(N−1)/N · Ψ: 1.5× the
paper's. So the class is the paper's stage 1 given another reducer (``ipg.IpgAtBoundary``),
DeepSpeed's layout and its checks.
"""

from __future__ import annotations

from zerosim.zero.ds_schedule import DeepSpeedNormGroups
from zerosim.zero.ipg import IpgAtBoundary
from zerosim.zero.layouts import DeepSpeedLayout
from zerosim.zero.schedule import deepspeed_stage12_checks
from zerosim.zero.stage1 import Stage1


class Stage1DeepSpeed(DeepSpeedNormGroups, Stage1):
    """Partitioned optimizer state; DeepSpeed's IPG buckets at the boundary; all-gather."""

    boundary_rule = staticmethod(deepspeed_stage12_checks)
    layout_cls = DeepSpeedLayout  # padded to 2·N, round robin with round_robin_gradients
    reducer_cls = IpgAtBoundary  # DeepSpeed's IPG buckets, all-reduced at the boundary
