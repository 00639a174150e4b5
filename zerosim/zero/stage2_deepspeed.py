"""Stage 2 under DeepSpeed 0.19.8's schedule: IPG buckets, all-reduced, during every backward.

What it changes relative to the paper's stage 2 (``stage2.py``) and why: DeepSpeed's stage 2
(``deepspeed/runtime/zero/stage_1_and_2.py``) has no static buckets. Gradients join an IPG bucket
in the order backward finishes them (``reduce_independent_p_g_buckets_and_remove_grads``, from its
hooks), the bucket being reduced when the next gradient would overflow ``reduce_bucket_size`` and
at the end of backward (``overlapping_partition_gradients_reduce_epilogue`` →
``independent_gradient_partition_epilogue``). With DeepSpeed's default switches each bucket is
*all-reduced* (``reduce_ipg_grads`` → ``average_tensor``), after which every rank keeps the part
it owns; ``use_multi_rank_bucket_allreduce: false`` reduces each owner's part to it instead
(``zerosim/zero/ipg.py``). Its flat buffers pad to a multiple of 2·N, optionally round robin
(``layouts.DeepSpeedLayout``), and its norm is all-reduced per group (``ds_schedule.py``). A
step then sends k·2(N−1)/N · Ψ + (N−1)/N · Ψ_pad: about 3(N−1)/N · Ψ at k = 1, 1.5× the paper's.
So the class is the paper's stage 2 given another reducer (``ipg.IpgInBackward``), DeepSpeed's
layout and its checks; the reduced pieces land as the paper's do (``Stage2.land``).
"""

from __future__ import annotations

from zerosim.zero.ds_schedule import DeepSpeedNormGroups
from zerosim.zero.ipg import IpgInBackward
from zerosim.zero.layouts import DeepSpeedLayout
from zerosim.zero.schedule import deepspeed_stage12_checks
from zerosim.zero.stage2 import Stage2


class Stage2DeepSpeed(DeepSpeedNormGroups, Stage2):
    """Partitioned gradients: DeepSpeed's IPG buckets during every backward."""

    boundary_rule = staticmethod(deepspeed_stage12_checks)
    layout_cls = DeepSpeedLayout  # padded to 2·N, round robin with round_robin_gradients
    reducer_cls = IpgInBackward  # DeepSpeed's IPG buckets, all-reduced during every backward
