"""Bytes each rank sends per optimizer step, by ledger phase, for zerosim's ZeRO stages.

Two schedules (``zerosim.schedule``): the ZeRO paper's and DeepSpeed 0.19.8's.

**The paper's** (``schedule="paper"``). With the ring model of nccl-tests (an all-gather or
reduce-scatter of a buffer of S bytes sends (N−1)/N · S per rank; an all-reduce twice that),
Ψ_pad elements of b bytes (Ψ padded to a multiple of N), N ranks and k micro-steps per optimizer
step (gradient accumulation):

    stage                                   backward           step
    0  (all-reduce at the boundary)         2(N−1)/N·Ψ_pad·b   0
    1, megatron (reduce-scatter there)       (N−1)/N·Ψ_pad·b   (N−1)/N·Ψ_pad·b  (all-gather)
    2  (reduce-scatter every micro-step)    k(N−1)/N·Ψ_pad·b   (N−1)/N·Ψ_pad·b  (all-gather)

    3  (all-gather around each module's forward and backward, reduce-scatter per bucket)
       forward k(N−1)/N·Ψ_np·b    backward k(N−1)/N·(Ψ_np + Ψ_pad)·b    step (N−1)/N·Ψ_persist·b

with Ψ_persist the padded elements of the persistent parameters (``stage3_param_persistence
_threshold``), Ψ_np = Ψ_pad − Ψ_persist, and the backward all-gather dropped for parameters kept
gathered from forward to backward (``stage3_max_reuse_distance``); without persistent parameters
and reuse, stage 3 moves 3(N−1)/N·Ψ_pad·b per micro-step (ZeRO paper, Sec. 7.2.2: 1.5× data
parallelism). So stages 0-2 move 2(N−1)/N·Ψ_pad·b per step at k = 1 (ZeRO paper, Sec. 7: stage
2 costs the same as data parallelism) and stage 2 moves (k+1)(N−1)/N·Ψ_pad·b at accumulation k.
Megatron's layout pads buckets to lcm(N, 128). The clipping norm adds one float64 all-reduce
(phase ``clip``, ``clip_bytes``); the forward phase moves nothing.

**DeepSpeed's** (``schedule="deepspeed"``, the engine's default). With Ψ the unpadded elements and
Ψ_pad = ⌈Ψ / 2N⌉·2N (DeepSpeed pads flat buffers to a multiple of 2·N), with its defaults:

    stage                                                    backward            step
    0  all-reduce of Ψ after the boundary backward           2(N−1)/N·Ψ·b        0
    1  all-reduce of Ψ at the boundary, all-gather           2(N−1)/N·Ψ·b        (N−1)/N·Ψ_pad·b
    2  all-reduce of Ψ every micro-step, all-gather         k·2(N−1)/N·Ψ·b       (N−1)/N·Ψ_pad·b
    3  as the paper's

so stages 1-2 cost ≈ 3(N−1)/N·Ψ·b per step, 1.5× the paper's: DeepSpeed all-reduces each
gradient bucket (``use_multi_rank_bucket_allreduce``) and every rank keeps its own part, where a
reduce-scatter would send each rank only its part. The messages follow DeepSpeed's buckets
(``deepspeed_gradient_messages``): the gradients in the order they are reduced, a bucket closed
before a parameter that would take it past ``reduce_bucket_size``, cut into the runs each rank's
partition owns; each message's bytes are the ring model's exactly (an all-reduce of c elements
sends 2c − c_r − c_{r+1} on rank r with the chunks of ``comm.ring.chunk_bounds``; a reduce sends
c on every rank but the root). Its norm and overflow all-reduces are ``boundary_messages``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from zerosim.analysis.stages import ZERO_STAGES

SCHEDULES = ("deepspeed", "paper", "fsdp2")  # whose collectives a stage issues: the one definition
EVERY_STAGE_SCHEDULES = SCHEDULES[:2]  # the schedules of stages 0-3 (FSDP2's is stage 3 only)
DEEPSPEED_ALIGNMENT = 2  # DeepSpeed pads stage 1-2 flat buffers to a multiple of 2·N
DEEPSPEED_STAGE0_MESSAGE = 500_000_000  # DeepSpeed's stage-0 all-reduce size (elements)
DEEPSPEED_BUCKET = 500_000_000  # zero_optimization.reduce_bucket_size's default


class Collective(NamedTuple):
    """One collective of a step: its ledger phase, op, what it carries ("params" or "grads"),
    its buffer's elements, and the root of a ``reduce`` (None otherwise)."""

    phase: str
    op: str
    what: str
    elements: int
    root: int | None = None


def deepspeed_padded_numel(numel: int, world_size: int) -> int:
    """Ψ_pad of DeepSpeed's stage 1-2 flat buffer: Ψ rounded up to a multiple of 2·N."""
    multiple = DEEPSPEED_ALIGNMENT * world_size
    return max(1, -(-numel // multiple)) * multiple


def _runs(sizes: list[int], limit: int) -> list[int]:
    """DeepSpeed's message cutting: consecutive sizes summed, a run closed once > ``limit``."""
    runs, total = [], 0
    for size in sizes:
        total += size
        if total > limit:
            runs.append(total)
            total = 0
    return runs + ([total] if total else [])


def counted_runs(sizes: list[tuple[int, int]], limit: int) -> dict[int, int]:
    """``_runs`` of sizes given as (size, repeats) pairs: {run: how many times it occurs}.

    A size s repeated r times, starting a run with t elements held, closes it after
    ⌊(limit − t)/s⌋ + 1 of them, then every ⌊limit/s⌋ + 1: the arithmetic of ``_runs`` done
    per pair, so the time does not grow with the repeats.
    """
    out: dict[int, int] = {}
    held = 0
    for size, repeats in sizes:
        if size <= 0 or repeats <= 0:
            continue
        first = (limit - held) // size + 1  # the sizes that take the open run past the limit
        if repeats < first:
            held += repeats * size
            continue
        out[held + first * size] = out.get(held + first * size, 0) + 1
        per_run = limit // size + 1
        full, rest = divmod(repeats - first, per_run)
        if full:
            out[per_run * size] = out.get(per_run * size, 0) + full
        held = rest * size
    if held:
        out[held] = out.get(held, 0) + 1
    return out


def deepspeed_buckets(numels: list[int], order: list[int], limit: int) -> list[list[int]]:
    """The parameters (indices, in ``order``) of each gradient bucket: a bucket is reduced
    before a parameter that would take it past ``limit`` elements; empty parameters skipped."""
    buckets: list[list[int]] = [[]]
    held = 0
    for i in order:
        if numels[i] == 0:
            continue
        if held + numels[i] > limit and buckets[-1]:
            buckets.append([])
            held = 0
        buckets[-1].append(i)
        held += numels[i]
    return [b for b in buckets if b]


def _owner_runs(start: int, numel: int, part: int) -> list[tuple[int, int]]:
    """(owner, elements) of the pieces of [start, start + numel) that each partition of
    ``part`` elements holds."""
    runs = []
    at, stop = start, start + numel
    while at < stop:
        owner = at // part
        end = min((owner + 1) * part, stop)
        runs.append((owner, end - at))
        at = end
    return runs


def _group_partitions(
    numels: list[int], groups: list[int], n: int
) -> tuple[list[int], dict[int, int], list[range]]:
    """Each parameter's start in its group's flat buffer, each group's partition size
    (Ψ_pad / N, DeepSpeed's padding) and the partitions each parameter touches."""
    totals: dict[int, int] = {}  # running, then final, elements of each group
    starts = []
    for m, g in zip(numels, groups, strict=True):
        starts.append(totals.get(g, 0))
        totals[g] = starts[-1] + m
    parts = {g: deepspeed_padded_numel(total, n) // n for g, total in totals.items()}
    touched = [
        range(starts[i] // parts[groups[i]], -(-(starts[i] + numels[i]) // parts[groups[i]]))
        for i in range(len(numels))
    ]
    return starts, parts, touched


def deepspeed_gradient_messages(
    numels: list[int],
    world_size: int,
    order: list[int] | None = None,
    reduce_bucket_size: int = DEEPSPEED_BUCKET,
    reduce_scatter: bool = True,
    use_multi_rank_bucket_allreduce: bool = True,
    contiguous_gradients: bool = True,
    groups: list[int] | None = None,
    copied: set[int] | None = None,
) -> list[tuple[str, int, int | None]]:
    """(op, elements, root) of the gradient reductions of one stage-1/2 backward, DeepSpeed's way.

    ``numels``: the parameters' sizes in definition order (their flat-buffer order); ``order``:
    the order their gradients are reduced (stage 2 and stage 1 with ``overlap_comm``: as backward
    finishes them; stage 1 otherwise: definition order; default: reversed definition order). A
    bucket is reduced before a parameter that would take it past ``reduce_bucket_size``. With
    ``contiguous_gradients`` and ``reduce_scatter`` a bucket is cut into the runs of each
    parameter that one rank's partition (P = Ψ_pad / N elements) owns, consecutive runs of one
    owner merged; then either all-reduces of runs of them (``use_multi_rank_bucket_allreduce``)
    or, per owner in order of first appearance, reduces of runs of its pieces to it, a run closed
    once it holds more than ``reduce_bucket_size`` elements. Otherwise one all-reduce per bucket.

    Several parameter groups (``groups``: each parameter's group, the groups' parameters in
    ``numels`` one group after another) each have a flat buffer and a partition size of their
    own. ``copied``: the parameters whose slices every rank owning a piece of them receives
    (Muon's matrices): when such a parameter is split, its slices merge only with each other and
    are all-reduced even where the others are reduced to their owner.
    """
    n = world_size
    groups = [0] * len(numels) if groups is None else list(groups)
    copied = set() if copied is None else copied
    starts, parts, touched = _group_partitions(numels, groups, n)
    order = list(range(len(numels)))[::-1] if order is None else list(order)
    out: list[tuple[str, int, int | None]] = []
    for bucket in deepspeed_buckets(numels, order, reduce_bucket_size):
        if not (contiguous_gradients and reduce_scatter):
            out.append(("all_reduce", sum(numels[i] for i in bucket), None))
            continue
        owned: list[list] = []  # [(owner, the partitions of a split copied parameter), elements]
        for i in bucket:
            shared = i in copied and len(touched[i]) > 1
            for owner, elements in _owner_runs(starts[i], numels[i], parts[groups[i]]):
                key = (owner, touched[i] if shared else None)
                if owned and owned[-1][0] == key:  # consecutive runs of one owner merge
                    owned[-1][1] += elements
                else:
                    owned.append([key, elements])
        if use_multi_rank_bucket_allreduce:
            sizes = [size for _, size in owned]
            out += [("all_reduce", m, None) for m in _runs(sizes, reduce_bucket_size)]
            continue
        roots = [None if key[1] is not None else key[0] for key, _ in owned]
        for root in dict.fromkeys(roots):
            sizes = [size for (_, size), r in zip(owned, roots, strict=True) if r == root]
            op = "all_reduce" if root is None else "reduce"
            out += [(op, m, root) for m in _runs(sizes, reduce_bucket_size)]
    return out


def deepspeed_stage0_messages(numels: list[int]) -> list[int]:
    """DeepSpeed's stage-0 all-reduces: the parameters in definition order, a message closed
    once it holds more than 5e8 elements (``allreduce_gradients``' ``MEMORY_OPT_ALLREDUCE_SIZE``,
    whatever ``reduce_bucket_size`` says)."""
    return _runs([n for n in numels if n], DEEPSPEED_STAGE0_MESSAGE)


def collective_schedule(
    stage: int,
    padded_numel: int,
    accumulation: int = 1,
    persistent_numel: int = 0,
    backward_gather: bool = True,
    *,
    schedule: str = "paper",
    numels: list[int] | None = None,
    world_size: int | None = None,
    order: list[int] | None = None,
    reduce_bucket_size: int = DEEPSPEED_BUCKET,
    reduce_scatter: bool = True,
    use_multi_rank_bucket_allreduce: bool = True,
    contiguous_gradients: bool = True,
    overlap_comm: bool = False,
    groups: list[int] | None = None,
    copied: set[int] | None = None,
) -> list[Collective]:
    """The collectives of one optimizer step (the clip and overflow all-reduces are apart):
    ``schedule="paper"`` as ``paper_schedule`` lists them; ``schedule="deepspeed"``: stage 3 as
    the paper's, stages 0-2 as ``deepspeed_schedule`` lists them, which needs ``numels`` (the
    parameters' sizes in definition order) and ``world_size`` and does not use ``padded_numel``.
    """
    if stage not in ZERO_STAGES:
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if accumulation < 1:
        raise ValueError(f"accumulation must be ≥ 1, got {accumulation}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule == "paper" or stage == 3:
        return paper_schedule(stage, padded_numel, accumulation, persistent_numel, backward_gather)
    if numels is None or world_size is None:
        raise ValueError("schedule='deepspeed' needs numels and world_size at stages 0-2")
    switches = dict(
        reduce_bucket_size=reduce_bucket_size,
        reduce_scatter=reduce_scatter,
        use_multi_rank_bucket_allreduce=use_multi_rank_bucket_allreduce,
        contiguous_gradients=contiguous_gradients,
        groups=groups,
        copied=copied,
    )
    return deepspeed_schedule(
        stage, accumulation, numels, world_size, order, overlap_comm, switches
    )


def paper_schedule(
    stage: int,
    padded_numel: int,
    accumulation: int = 1,
    persistent_numel: int = 0,
    backward_gather: bool = True,
) -> list[Collective]:
    """The ZeRO paper's collectives of one step: one entry per kind of collective per
    micro-step (buckets are not modelled: a stage's buckets together cover its buffer once).

    Stage 0: one all-reduce of the gradients at the boundary. Stage 1 (and megatron): a
    reduce-scatter of the gradients at the boundary, an all-gather of the parameters after the
    step; stage 2 reduce-scatters every micro-step. Stage 3, every micro-step: an all-gather of
    the non-persistent parameters in forward, another in backward (unless reuse keeps them), a
    reduce-scatter of all gradients; after the step, an all-gather of the persistent parameters.
    """
    k = accumulation
    if stage == 0:
        return [Collective("backward", "all_reduce", "grads", padded_numel)]
    if stage == 1:
        return [
            Collective("backward", "reduce_scatter", "grads", padded_numel),
            Collective("step", "all_gather", "params", padded_numel),
        ]
    if stage == 2:
        return [Collective("backward", "reduce_scatter", "grads", padded_numel)] * k + [
            Collective("step", "all_gather", "params", padded_numel)
        ]
    if not 0 <= persistent_numel <= padded_numel:
        raise ValueError(f"persistent_numel must be in [0, padded_numel], got {persistent_numel}")
    gathered = padded_numel - persistent_numel
    micro = [Collective("forward", "all_gather", "params", gathered)]
    if backward_gather:
        micro.append(Collective("backward", "all_gather", "params", gathered))
    micro.append(Collective("backward", "reduce_scatter", "grads", padded_numel))
    return micro * k + [Collective("step", "all_gather", "params", persistent_numel)]


def deepspeed_schedule(
    stage: int,
    accumulation: int,
    numels: list[int],
    world_size: int,
    order: list[int] | None,
    overlap_comm: bool,
    switches: dict[str, Any],
) -> list[Collective]:
    """DeepSpeed 0.19.8's collectives of one step at stages 0-2.

    Stage 0 all-reduces ``deepspeed_stage0_messages``; stage 1 issues
    ``deepspeed_gradient_messages`` once at the boundary, in definition order (in ``order``,
    the order backward finishes gradients, with ``overlap_comm``), stage 2 every micro-step in
    ``order``; both then all-gather Ψ_pad (``deepspeed_padded_numel``) in one call, one per
    parameter group. ``switches``: the keyword arguments of ``deepspeed_gradient_messages``
    from ``reduce_bucket_size`` on (``groups`` and ``copied`` among them).
    """
    if stage == 0:
        return [
            Collective("backward", "all_reduce", "grads", m)
            for m in deepspeed_stage0_messages(numels)
        ]
    definition = list(range(len(numels)))
    grad_order = order if stage == 2 or overlap_comm else definition
    once = [
        Collective("backward", op, "grads", m, root)
        for op, m, root in deepspeed_gradient_messages(numels, world_size, grad_order, **switches)
    ]
    groups = switches.get("groups")
    member = [0] * len(numels) if groups is None else groups
    gathers = [
        Collective("step", "all_gather", "params", deepspeed_padded_numel(total, world_size))
        for total in (
            sum(m for m, h in zip(numels, member, strict=True) if h == g)
            for g in dict.fromkeys(member)
        )
    ]
    return once * (accumulation if stage == 2 else 1) + gathers


def step_bytes(
    stage: int,
    world_size: int,
    padded_numel: int,
    itemsize: int,
    accumulation: int = 1,
    persistent_numel: int = 0,
    backward_gather: bool = True,
    *,
    schedule: str = "paper",
    numels: list[int] | None = None,
    rank: int = 0,
    **switches: object,
) -> dict[str, int]:
    """{phase: bytes ``rank`` sends} for one optimizer step (megatron = stage 1).

    The ring model applied to ``collective_schedule``: (N−1)/N of each all-gather's or
    reduce-scatter's buffer, 2(N−1)/N of each all-reduce's (exactly 2c − c_r − c_{r+1} elements
    when N does not divide its c), a reduce's whole buffer on every rank but its root. For stage
    3, ``persistent_numel`` is Ψ_persist and ``backward_gather`` says whether the non-persistent
    parameters are gathered again in backward (False when reuse keeps them). ``schedule``,
    ``numels`` and ``switches`` (``order``, ``reduce_bucket_size``, ``reduce_scatter``,
    ``use_multi_rank_bucket_allreduce``, ``contiguous_gradients``, ``overlap_comm``) as in
    ``collective_schedule``; with the paper's schedule every rank sends the same.
    """
    from zerosim.comm.ring import model_bytes

    deepspeed = schedule == "deepspeed" and stage < 3
    if world_size < 1 or (not deepspeed and padded_numel % world_size):
        raise ValueError(
            f"padded_numel must be a multiple of world_size ≥ 1, got {padded_numel} and "
            f"{world_size}"
        )
    if persistent_numel % world_size:
        raise ValueError(
            f"persistent_numel must be a multiple of world_size, got {persistent_numel} and "
            f"{world_size}"
        )
    out = {"forward": 0, "backward": 0, "step": 0}
    calls = collective_schedule(
        stage,
        padded_numel,
        accumulation,
        persistent_numel,
        backward_gather,
        schedule=schedule,
        numels=numels,
        world_size=world_size,
        **switches,  # type: ignore[arg-type]
    )
    for c in calls:
        if c.elements:
            root = 0 if c.root is None else c.root
            out[c.phase] += model_bytes(c.op, c.elements, world_size, rank, itemsize, root)[0]
    return out


def deepspeed_bucketed_step_bytes(
    stage: int,
    world_size: int,
    numel: int,
    itemsize: int,
    accumulation: int = 1,
    rank: int = 0,
) -> dict[str, int]:
    """{phase: bytes ``rank`` sends} at stages 0-2 under DeepSpeed's schedule with its defaults,
    for Ψ = ``numel`` elements held as q = ⌊Ψ/B⌋ parameters of exactly B = reduce_bucket_size
    (5e8) elements and one of r = Ψ − qB: what ``step_bytes(stage, world_size, 0, itemsize,
    accumulation, schedule="deepspeed", numels=[B] * q + [r], rank=rank)`` gives, in a time
    that does not grow with Ψ (no list of q parameters).

    Stages 1-2 reduce each parameter as a bucket of its own (a second would take it past B);
    its runs of one owner sum to B, never past it, so they merge into one all-reduce of B: q
    all-reduces of B and one of r per reduction (every micro-step at stage 2), then the
    all-gather of Ψ_pad (``deepspeed_padded_numel``). Stage 0 cuts the same sizes into messages
    closed past 5e8 elements (``counted_runs``).
    """
    from zerosim.comm.ring import model_bytes

    if stage not in (0, 1, 2):
        raise ValueError(f"stage must be 0, 1 or 2, got {stage!r}")
    if accumulation < 1:
        raise ValueError(f"accumulation must be ≥ 1, got {accumulation}")
    full, rest = divmod(numel, DEEPSPEED_BUCKET)
    sizes = [(DEEPSPEED_BUCKET, full), (rest, 1)]
    if stage == 0:
        messages = counted_runs(sizes, DEEPSPEED_STAGE0_MESSAGE)
    else:
        messages = {size: count for size, count in sizes if size and count}

    def sent(op: str, elements: int) -> int:
        return model_bytes(op, elements, world_size, rank, itemsize)[0]

    backward = sum(count * sent("all_reduce", size) for size, count in messages.items())
    out = {"forward": 0, "backward": backward * (accumulation if stage == 2 else 1), "step": 0}
    if stage > 0 and numel:  # no parameter, no flat buffer to gather
        out["step"] = sent("all_gather", deepspeed_padded_numel(numel, world_size))
    return out


def clip_bytes(world_size: int, rank: int, itemsize: int = 8, elements: int = 1) -> int:
    """Bytes ``rank`` sends in the all-reduce of the norm (or the overflow flag): one element,
    except under FSDP2, where torch's ``clip_grad_norm_`` sends one per parameter.

    A ring all-reduce of one element: chunk 0 holds it, so rank r sends 2 − c_r − c_{r+1}
    elements: one element (``itemsize`` bytes; 8 for the paper schedule's float64) on ranks 0 and
    N−1, two on the others (0 when N = 1).
    """
    from zerosim.comm.ring import model_bytes

    return model_bytes("all_reduce", elements, world_size, rank, itemsize)[0]


def boundary_messages(
    stage: int,
    *,
    schedule: str = "paper",
    precision: str = "fp32",
    clip: float = 1.0,
    float64: bool = False,
    bf16_overflow: bool = True,
    compute_grad_norm: bool = True,
) -> dict[str, int]:
    """{phase: bytes of its one-element all-reduce} at the accumulation boundary: "overflow"
    (the inf/nan flag) and "clip" (the gradient norm), absent when not sent.

    paper: the norm in float64 (8), the flag in float64 under fp16. deepspeed: stage 0 sends no
    flag (each rank holds the reduced gradients) and a float32 norm (4) only without fp16/bf16
    and with clipping; stages 1-2 a uint8 flag (1) under fp16 and under bf16 with
    ``bf16_overflow``, a float32 norm unless ``compute_grad_norm`` is false; stage 3 a uint8
    flag under fp16 and a float64 norm. fsdp2: no flag, and a norm only with clipping, a float32
    element per parameter (``clip_bytes``'s ``elements``). ``float64``: zerosim's float64
    reference mode, whose norm is float64 (8) where DeepSpeed's and torch's are float32.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    fp16, bf16 = precision == "fp16", precision == "bf16"
    f32 = 8 if float64 else 4
    if schedule == "fsdp2":  # torch's clip_grad_norm_: only to clip, each element fp32
        return {"clip": f32} if clip > 0 else {}
    if schedule == "paper":
        return {"clip": 8, **({"overflow": 8} if fp16 else {})}
    if stage == 0:
        return {"clip": f32} if clip > 0 and not (fp16 or bf16) else {}
    if stage in (1, 2):
        flag = {"overflow": 1} if fp16 or (bf16 and bf16_overflow) else {}
        return {**flag, **({"clip": f32} if compute_grad_norm else {})}
    return {**({"overflow": 1} if fp16 else {}), "clip": 8}


def norm_messages(
    stage: int,
    group_numels: list[list[int]],
    world_size: int,
    *,
    schedule: str = "deepspeed",
    sub_group_size: int = 1_000_000_000,
) -> int:
    """How many norm all-reduces one step sends (each of ``boundary_messages``'s "clip" size).

    DeepSpeed's ZeRO takes each group's norm with an all-reduce of its own: one per parameter
    group at stages 1-2 (``group_numels``: the numels of each group's parameters), one per
    sub-group at stage 3, where a group is cut after the parameter whose chunks
    (⌈numel/N⌉ each) bring the running total to ``sub_group_size`` or more (unless the whole
    group fits). Stage 0 and the paper's schedule send one.
    """
    if schedule == "paper" or stage == 0:
        return 1
    if stage in (1, 2):
        return len(group_numels)
    count = 0
    for numels in group_numels:
        chunks = [-(-m // world_size) for m in numels]
        if sub_group_size >= sum(chunks):
            count += 1
            continue
        running = 0
        for i, chunk in enumerate(chunks):
            running += chunk
            if running >= sub_group_size or i == len(chunks) - 1:
                count += 1
                running = 0
    return count


# -- ZeRO++ (Wang et al. 2023, arXiv:2306.10209) ------------------------------------------------
#
# Per-rank bytes of stage 3 with qwZ, hpZ and qgZ, split into bytes sent within this rank's node
# and bytes sent to other nodes. Ranks sit on nodes of ``ranks_per_node`` consecutive ranks (one
# node for all when None). Ring collectives send everything to the next rank of their group, so a
# ring collective's bytes are all intra or all inter by that neighbour's node; an all-to-all
# sends block j to rank j. With c_i = ceil(numel_i / N), g the hpZ group size, c'_i =
# ceil(numel_i / g), w a gradient bucket's elements per rank, L ranks per node, n = N / L nodes,
# B the block size and 4-byte scales, per micro-step:
#
#   forward all-gather   plain  (N−1)·c_i·b            qwZ  (N−1)·(c_i + 4·ceil(c_i / B))
#   backward all-gather  plain  (N−1)·c_i·b  (world)   hpZ  (g−1)·c'_i·b  (inside the group)
#   gradients            plain  (N−1)·w·b  (reduce-scatter)
#                        qgZ    hop 1 (L−1)·n·Q(w) intra + hop 2 (n−1)·Q(w) inter,
#                               Q(w) = ceil(w·bits / 8) + 4·ceil(w / B)
#
# so qwZ sends 1/b of the forward bytes plus the scales (0.5× with 16-bit parameters, 0.25× with
# float32), hpZ sends no backward byte across nodes when g divides ranks_per_node, and qgZ sends
# (N−1)·Q(w) ≈ (N−1)·w/2: 0.25× of a 16-bit reduce-scatter (0.125× of a float32 one).


def quantized_nbytes(numel: int, bits: int, block_size: int, scale_bytes: int = 4) -> int:
    """Bytes of ``numel`` quantized values: ceil(numel·bits/8) + scale_bytes·ceil(numel/B).

    int4 codes are packed two per byte; one scale per block of B = ``block_size`` elements.
    """
    if numel < 0 or bits not in (4, 8) or block_size < 1:
        raise ValueError(
            f"need numel ≥ 0, bits 4 or 8 and block_size ≥ 1, got {numel}, {bits}, {block_size}"
        )
    return -(-numel * bits // 8) + scale_bytes * -(-numel // block_size)


def ring_split(sent: int, rank: int, members: list[int], ranks_per_node: int | None) -> dict:
    """{"intra", "inter"} of ``sent`` bytes a ring collective over ``members`` (world ranks in
    group order) makes ``rank`` send: all of it to the next member."""
    if ranks_per_node is None:
        return {"intra": sent, "inter": 0}
    position = members.index(rank)
    right = members[(position + 1) % len(members)]
    same = rank // ranks_per_node == right // ranks_per_node
    return {"intra": sent if same else 0, "inter": 0 if same else sent}


def _add(total: dict, part: dict, times: int = 1) -> None:
    for key in ("intra", "inter"):
        total[key] += times * part[key]


def zeropp_step_bytes(
    gathered_numels: list[int],
    bucket_widths: list[int],
    world_size: int,
    rank: int,
    itemsize: int,
    ranks_per_node: int | None = None,
    quantized_weights: bool = False,
    hpz_partition_size: int = 1,
    quantized_gradients: bool = False,
    accumulation: int = 1,
    weight_block_size: int = 256,
    gradient_block_size: int = 256,
    gradient_bits: int = 4,
) -> dict[str, dict[str, int]]:
    """Bytes ``rank`` sends in one optimizer step of stage 3 with ZeRO++, by collective and node.

    ``gathered_numels``: elements of each parameter gathered around its module's forward and
    backward (persistent parameters excluded), each gathered once per pass (no reuse);
    ``bucket_widths``: elements per rank of each gradient bucket (Σ c_i of its parameters).
    Returns {"forward_all_gather", "backward_all_gather", "gradients"} → {"intra", "inter"};
    the formulas are in the comment above this function.
    """
    n, k = world_size, accumulation
    if n < 1 or not 0 <= rank < n or k < 1 or n % hpz_partition_size:
        raise ValueError(
            f"need 0 ≤ rank < world_size, accumulation ≥ 1 and hpz_partition_size dividing "
            f"world_size; got rank {rank}, world_size {n}, accumulation {k}, "
            f"hpz_partition_size {hpz_partition_size}"
        )
    world = list(range(n))
    out = {key: {"intra": 0, "inter": 0} for key in ("forward_all_gather", "backward_all_gather")}
    out["gradients"] = {"intra": 0, "inter": 0}
    g = hpz_partition_size
    group = [r for r in world if r // g == rank // g]
    for numel in gathered_numels:
        chunk = max(1, -(-numel // n))
        fwd = (n - 1) * (
            quantized_nbytes(chunk, 8, weight_block_size) if quantized_weights else chunk * itemsize
        )
        _add(out["forward_all_gather"], ring_split(fwd, rank, world, ranks_per_node), k)
        if g > 1:
            bwd = (g - 1) * max(1, -(-numel // g)) * itemsize
            _add(out["backward_all_gather"], ring_split(bwd, rank, group, ranks_per_node), k)
        else:
            bwd = (n - 1) * chunk * itemsize
            _add(out["backward_all_gather"], ring_split(bwd, rank, world, ranks_per_node), k)
    local = n if ranks_per_node is None else ranks_per_node
    nodes = n // local
    for w in bucket_widths:
        if quantized_gradients:
            q = quantized_nbytes(w, gradient_bits, gradient_block_size)
            _add(out["gradients"], {"intra": (local - 1) * nodes * q, "inter": (nodes - 1) * q}, k)
        else:
            sent = (n - 1) * w * itemsize
            _add(out["gradients"], ring_split(sent, rank, world, ranks_per_node), k)
    return out


def stage3_backward_gathers(
    schedule: str, zero: Any, gathered_numel: int, recorded: bool = True
) -> bool | None:
    """Whether stage 3 all-gathers its non-persistent parameters (``gathered_numel`` elements)
    again in backward, once the module trace is ``recorded`` (after the first step).

    The paper's schedule keeps every parameter from forward to backward when its next use is
    within ``stage3_max_reuse_distance`` (> Ψ_np: all of them) and the live cap holds them all.
    DeepSpeed's coordinator keeps a parameter when its next use is within the reuse distance or
    a prefetch took it: when one prefetch bucket and the live cap hold every gathered
    parameter, the first fetch prefetches the rest and nothing is gathered again; without
    prefetch it regathers as the paper's does. Any other DeepSpeed setting: None, the module
    trace decides (docs/formulas.md; tests/peer/test_deepspeed_collectives.py holds it to
    DeepSpeed's own log).
    """
    get = zero.get if isinstance(zero, dict) else lambda key, default: getattr(zero, key)
    reuse = get("stage3_max_reuse_distance", 1_000_000_000)
    live = get("stage3_max_live_parameters", 1_000_000_000)
    prefetch = get("stage3_prefetch_bucket_size", 50_000_000)
    kept = reuse > gathered_numel and live >= gathered_numel and recorded
    if schedule == "paper" or kept:
        return not kept
    if prefetch >= gathered_numel and live >= gathered_numel and recorded:
        return False
    return True if prefetch == 0 and reuse == 0 else None


def fsdp2_step_bytes(
    module_shards: list[int],
    world_size: int,
    param_bytes: int,
    reduce_bytes: int,
    accumulation: int = 1,
    reshard_after_forward: bool | int = True,
    reshard_after_backward: bool = True,
    *,
    group_shards: list[int] | None = None,
    replicate: int = 1,
    replica: int = 0,
    reduce_every_micro_batch: bool = False,
) -> dict[str, int]:
    """{phase: bytes one rank sends} in one optimizer step of PyTorch FSDP2's schedule
    (``zero/stage3_fsdp2.py``). ``module_shards``: S_u, the elements of each unit's all-gather
    input on one rank (Σ ceil(dim0_i / N) · numel_i / dim0_i over its parameters), the blocks
    first and the root last; b_p, b_r the bytes of param_dtype and reduce_dtype; k micro-batches.
    N (``world_size``) is the shard group's size: under HSDP, N / R of the whole world.

        forward    (N−1)·b_p·Σ_u S_u · (k, or 1 when parameters stay gathered between them)
        backward   (N−1)·b_p·k·Σ_blocks S_u   (blocks resharded after forward; the root is not)
                 + (N−1)·b_r·Σ_u S_u          (one reduce-scatter per unit, last micro-batch;
                                                k of them with ``reduce_every_micro_batch``)

    An int ``reshard_after_forward`` g keeps ceil(dim0 / g) rows per rank after forward, so
    backward gathers inside groups of g ranks: (g−1)·b_p·k·Σ_blocks S_u(g), ``group_shards``
    giving each unit's S_u(g) in the same order. HSDP (``replicate`` R > 1): each reduced row of
    S_u elements is all-reduced across the R replicas, a ring in which replica ``replica`` sends
    2·S_u − c_i − c_{i+1} elements of b_r bytes (c_i: the ring's chunks of the row).
    """
    from zerosim.comm.ring import model_bytes

    n, blocks, total = world_size, sum(module_shards[:-1]), sum(module_shards)
    forward_passes = accumulation if reshard_after_backward else 1
    if reshard_after_forward is True:
        regathered = (n - 1) * accumulation * blocks
    elif reshard_after_forward is False:
        regathered = 0
    else:
        if group_shards is None:
            raise ValueError(
                f"reshard_after_forward={reshard_after_forward!r}: an int needs group_shards, "
                "each block's elements per rank in groups of that many ranks"
            )
        regathered = (reshard_after_forward - 1) * accumulation * sum(group_shards[:-1])
    reductions = accumulation if reduce_every_micro_batch else 1
    replicas = sum(
        model_bytes("all_reduce", u, replicate, replica, reduce_bytes)[0] for u in module_shards
    )
    return {
        "forward": (n - 1) * param_bytes * total * forward_passes,
        "backward": param_bytes * regathered
        + reductions * ((n - 1) * reduce_bytes * total + replicas),
        "step": 0,
    }
