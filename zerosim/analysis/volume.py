"""Bytes each rank sends per optimizer step, by ledger phase, for zerosim's ZeRO stages.

With the ring model of nccl-tests (an all-gather or reduce-scatter of a buffer of S bytes sends
(N−1)/N · S per rank; an all-reduce twice that), Ψ_pad elements of b bytes, N ranks and
k micro-steps per optimizer step (gradient accumulation):

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
parallelism).

So stages 0-2 move 2(N−1)/N·Ψ_pad·b per step at k = 1 (ZeRO paper, Sec. 7: stage 2 costs the
same as data parallelism) and stage 2 moves (k+1)(N−1)/N·Ψ_pad·b at accumulation k, where stages
0 and 1 stay at 2(N−1)/N·Ψ_pad·b. Ψ_pad is the flat buffer after padding: a multiple of N in
DeepSpeed's layout, buckets padded to lcm(N, 128) in Megatron's. The clipping norm adds one
float64 all-reduce (phase ``clip``, ``clip_bytes``); the forward phase moves nothing.
"""

from __future__ import annotations


def collective_schedule(
    stage: int,
    padded_numel: int,
    accumulation: int = 1,
    persistent_numel: int = 0,
    backward_gather: bool = True,
) -> list[tuple[str, str, str, int]]:
    """The collectives of one optimizer step: (phase, op, "params" | "grads", elements).

    One entry per kind of collective per micro-step (buckets are not modelled: a stage's buckets
    together cover its buffer once). Stage 0: one all-reduce of the gradients at the boundary.
    Stages 1 and megatron: a reduce-scatter of the gradients at the boundary, an all-gather of the
    parameters after the step; stage 2 reduce-scatters every micro-step. Stage 3, every
    micro-step: an all-gather of the non-persistent parameters in forward, another in backward
    (unless reuse keeps them), a reduce-scatter of all gradients; after the step, an all-gather
    of the persistent parameters. The clipping all-reduce is ``clip_bytes``'s.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if accumulation < 1:
        raise ValueError(f"accumulation must be ≥ 1, got {accumulation}")
    k = accumulation
    if stage == 0:
        return [("backward", "all_reduce", "grads", padded_numel)]
    if stage == 1:
        return [
            ("backward", "reduce_scatter", "grads", padded_numel),
            ("step", "all_gather", "params", padded_numel),
        ]
    if stage == 2:
        return [("backward", "reduce_scatter", "grads", padded_numel)] * k + [
            ("step", "all_gather", "params", padded_numel)
        ]
    if not 0 <= persistent_numel <= padded_numel:
        raise ValueError(f"persistent_numel must be in [0, padded_numel], got {persistent_numel}")
    gathered = padded_numel - persistent_numel
    micro = [("forward", "all_gather", "params", gathered)]
    if backward_gather:
        micro.append(("backward", "all_gather", "params", gathered))
    micro.append(("backward", "reduce_scatter", "grads", padded_numel))
    return micro * k + [("step", "all_gather", "params", persistent_numel)]


def step_bytes(
    stage: int,
    world_size: int,
    padded_numel: int,
    itemsize: int,
    accumulation: int = 1,
    persistent_numel: int = 0,
    backward_gather: bool = True,
) -> dict[str, int]:
    """{phase: bytes one rank sends} for one optimizer step (megatron = stage 1).

    The ring model applied to ``collective_schedule``: (N−1)/N of each all-gather's or
    reduce-scatter's buffer, 2(N−1)/N of each all-reduce's. For stage 3, ``persistent_numel`` is
    Ψ_persist and ``backward_gather`` says whether the non-persistent parameters are gathered
    again in backward (False when reuse keeps them).
    """
    if world_size < 1 or padded_numel % world_size:
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
    schedule = collective_schedule(
        stage, padded_numel, accumulation, persistent_numel, backward_gather
    )
    for phase, op, _, numel in schedule:
        sends = (world_size - 1) * (numel // world_size) * itemsize
        out[phase] += 2 * sends if op == "all_reduce" else sends
    return out


def clip_bytes(world_size: int, rank: int) -> int:
    """Bytes ``rank`` sends in the one-element float64 all-reduce of the squared gradient norm.

    A ring all-reduce of one element: chunk 0 holds it, so rank r sends 2 − c_r − c_{r+1}
    elements: 8 bytes on ranks 0 and N−1, 16 on the others (0 when N = 1).
    """
    from zerosim.comm.ring import model_bytes

    return model_bytes("all_reduce", 1, world_size, rank, 8)[0]


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
