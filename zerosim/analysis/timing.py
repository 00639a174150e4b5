"""The α-β time model: collectives on a flat ring and on a two-level cluster, compute, and steps.

A message of n bytes between two devices costs α + n/B (α latency in s, B bandwidth in bytes/s;
Hockney 1994). A collective on p ranks then costs c_α(p)·α + c_β(p)·n/B, where n is the full
buffer (nccl-tests' S: the output of an all-gather, the input of a reduce-scatter, the buffer of
an all-reduce or broadcast, all that one rank sends in an all-to-all). Thakur, Rabenseifner & Gropp
2005, "Optimization of collective communication operations in MPICH":

    op                          c_α                       c_β
    all_gather, reduce_scatter  p − 1                     (p − 1)/p        ring
    all_reduce                  2(p − 1)                  2(p − 1)/p       ring RS + AG
    all_to_all                  p − 1                     (p − 1)/p        pairwise exchange
    broadcast  tree             ⌈log2 p⌉                  ⌈log2 p⌉         binomial tree
               chain            p − 1                     p − 1            zerosim's ring module
               scatter_allgather ⌈log2 p⌉ + p − 1         2(p − 1)/p       van de Geijn

p = 1 costs nothing. A cluster of M nodes with g devices each (p = M·g) runs a two-level
("2D") version: the ranks sharing a local index form g inter-node rings, each over M ranks (with
g = 1 these are the node leaders), and each node runs an intra-node ring:

    all_gather(n)      = AG_inter(n/g, M) + AG_intra(n, g)
    reduce_scatter(n)  = RS_intra(n, g)   + RS_inter(n/g, M)
    all_reduce(n)      = RS_intra(n, g)   + AR_inter(n/g, M) + AG_intra(n, g)
    broadcast(n)       = BC_inter(n, M)   + BC_intra(n, g)
    all_to_all(n)      = A2A_intra(n, g)  + A2A_inter(n, M)       (two hops, as qgZ does)

Each inter-node ring gets ``inter_bandwidth`` (a per-device NIC, as on rail-optimised clusters);
every intra-node ring gets ``intra_bandwidth``. Compute takes FLOPs / (device FLOP/s ·
efficiency). A step takes compute + communication with no overlap, and max(compute,
communication) with perfect overlap — the two bounds between which a real step falls.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")
BROADCAST_ALGORITHMS = ("tree", "chain", "scatter_allgather")


def _check_count(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def _check_p(p: int) -> int:
    return _check_count("p", p)


def _check_positive(name: str, value: float) -> None:
    if not value > 0 or math.isinf(value):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _check_nonnegative(name: str, value: float) -> None:
    if not value >= 0 or math.isinf(value):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def alpha_beta_coefficients(op: str, p: int, algorithm: str = "tree") -> tuple[float, float]:
    """(c_α, c_β) of ``op`` on a flat group of p ranks (table in the module docstring).

    ``algorithm`` only matters for broadcast.
    """
    p = _check_p(p)
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if op == "broadcast" and algorithm not in BROADCAST_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {BROADCAST_ALGORITHMS}, got {algorithm!r}")
    if p == 1:
        return 0.0, 0.0
    steps = p - 1
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return float(steps), steps / p
    if op == "all_reduce":
        return 2.0 * steps, 2 * steps / p
    log_p = math.ceil(math.log2(p))
    if algorithm == "tree":
        return float(log_p), float(log_p)
    if algorithm == "chain":
        return float(steps), float(steps)
    return float(log_p + steps), 2 * steps / p


def collective_time(
    op: str, n_bytes: float, p: int, alpha: float, bandwidth: float, algorithm: str = "tree"
) -> float:
    """Seconds for ``op`` on a flat group: c_α(p)·α + c_β(p)·n/B."""
    _check_nonnegative("n_bytes", n_bytes)
    _check_nonnegative("alpha", alpha)
    _check_positive("bandwidth", bandwidth)
    c_alpha, c_beta = alpha_beta_coefficients(op, p, algorithm)
    return c_alpha * alpha + c_beta * n_bytes / bandwidth


def ring_all_gather_time(n_bytes: float, p: int, alpha: float, bandwidth: float) -> float:
    """(p − 1)·α + (p − 1)/p · n/B."""
    return collective_time("all_gather", n_bytes, p, alpha, bandwidth)


def ring_reduce_scatter_time(n_bytes: float, p: int, alpha: float, bandwidth: float) -> float:
    """(p − 1)·α + (p − 1)/p · n/B."""
    return collective_time("reduce_scatter", n_bytes, p, alpha, bandwidth)


def ring_all_reduce_time(n_bytes: float, p: int, alpha: float, bandwidth: float) -> float:
    """2(p − 1)·α + 2(p − 1)/p · n/B."""
    return collective_time("all_reduce", n_bytes, p, alpha, bandwidth)


@dataclass(frozen=True)
class Cluster:
    """A cluster as the time model sees it: M nodes × g devices, two networks, device FLOP/s."""

    nodes: int
    devices_per_node: int
    intra_bandwidth: float  # bytes/s per device inside a node
    inter_bandwidth: float  # bytes/s per device between nodes
    intra_latency: float  # s
    inter_latency: float  # s
    device_flops: float  # FLOP/s per device

    def __post_init__(self) -> None:
        for name in ("nodes", "devices_per_node"):
            _check_count(name, getattr(self, name))
        for name in ("intra_bandwidth", "inter_bandwidth", "device_flops"):
            _check_positive(name, getattr(self, name))
        for name in ("intra_latency", "inter_latency"):
            _check_nonnegative(name, getattr(self, name))

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def _intra(self, op: str, n: float, algorithm: str) -> float:
        return collective_time(
            op, n, self.devices_per_node, self.intra_latency, self.intra_bandwidth, algorithm
        )

    def _inter(self, op: str, n: float, algorithm: str) -> float:
        return collective_time(
            op, n, self.nodes, self.inter_latency, self.inter_bandwidth, algorithm
        )

    def collective_time(self, op: str, n_bytes: float, algorithm: str = "tree") -> float:
        """Seconds for ``op`` over the whole cluster, two-level (decomposition in module doc)."""
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        g, n = self.devices_per_node, n_bytes
        if op == "all_gather":
            return self._inter(op, n / g, algorithm) + self._intra(op, n, algorithm)
        if op == "reduce_scatter":
            return self._intra(op, n, algorithm) + self._inter(op, n / g, algorithm)
        if op == "all_reduce":
            return (
                self._intra("reduce_scatter", n, algorithm)
                + self._inter("all_reduce", n / g, algorithm)
                + self._intra("all_gather", n, algorithm)
            )
        if op == "broadcast":
            return self._inter(op, n, algorithm) + self._intra(op, n, algorithm)
        return self._intra(op, n, algorithm) + self._inter(op, n, algorithm)

    def comm_time(self, collectives: Iterable[tuple[str, float]]) -> float:
        """Seconds for a sequence of (op, n_bytes) run one after another."""
        return sum(self.collective_time(op, n) for op, n in collectives)

    def compute_time(self, flops: float, efficiency: float = 1.0) -> float:
        """Seconds for ``flops`` on one device of this cluster."""
        return compute_time(flops, self.device_flops, efficiency)


# Cluster's fields, in order: the keys a cluster file gives them by
CLUSTER_KEYS = tuple(Cluster.__dataclass_fields__)


def compute_time(flops: float, device_flops: float, efficiency: float = 1.0) -> float:
    """flops / (device_flops · efficiency); efficiency ∈ (0, 1] is the achieved fraction of peak."""
    _check_nonnegative("flops", flops)
    _check_positive("device_flops", device_flops)
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency!r}")
    return flops / (device_flops * efficiency)


def transformer_training_flops(num_params: float, tokens: float, recompute: bool = False) -> float:
    """6·Ψ·T FLOPs to train Ψ parameters on T tokens (forward 2, backward 4; Kaplan et al. 2020),
    8·Ψ·T with full activation recomputation (Narayanan et al. 2021). Attention's O(s²) is left out.
    """
    _check_nonnegative("num_params", num_params)
    _check_nonnegative("tokens", tokens)
    return (8.0 if recompute else 6.0) * num_params * tokens


def transformer_flops_per_token(desc: Any, recompute: bool = False) -> int:
    """Model FLOPs per trained token of the decoder a ``ModelDescription`` states, its own family's
    count (every product counted 2·m·k·n; softmax, norms and elementwise work left out):

        6·N_matmul + 12·l·h·s            (forward 2·N_matmul + 4·l·h·s, backward twice it)
        with recomputation of every block: + 2·N_blocks + 4·l·h·s  (one more forward of them)

    N_matmul = ``desc.matmul_parameters()``: the blocks' matrices (GQA's k and v of h·n_kv·d
    each, SwiGLU's three h·F matrices, GELU's two) and the output layer V·h, tied or not;
    N_blocks = N_matmul − V·h. Attention's scores q·kᵀ and its P·v are 2·s·h each per token and
    layer: every one of the n query heads meets all s keys, however few key/value heads they
    share, and the count is the whole s×s matrix (causal masking is not subtracted). For GPT
    (N_matmul = 12·l·h² + V·h) this is Narayanan et al.'s eq. 3 per token
    (``analysis.presets.narayanan_flops``); position tables, rotary and ALiBi add no product.
    """
    n_matmul = desc.matmul_parameters()
    attention = 4 * desc.layers * desc.hidden * desc.seq
    flops = 3 * (2 * n_matmul + attention)
    if recompute:
        flops += 2 * (n_matmul - desc.vocab * desc.hidden) + attention
    return flops


def step_time(compute_s: float, comm_s: float, overlap: bool) -> float:
    """max(compute, comm) with perfect overlap, compute + comm without."""
    _check_nonnegative("compute_s", compute_s)
    _check_nonnegative("comm_s", comm_s)
    return max(compute_s, comm_s) if overlap else compute_s + comm_s


@dataclass(frozen=True)
class AlphaBetaFit:
    """Result of :func:`fit_alpha_beta`: latency (s), bandwidth (bytes/s), RMS residual (s)."""

    alpha: float
    bandwidth: float
    residual_rms: float


def fit_alpha_beta(
    sizes_bytes: Sequence[float], times_s: Sequence[float], p: int, op: str, algorithm: str = "tree"
) -> AlphaBetaFit:
    """Least-squares α and B from measured times: t_i ≈ c_α·α + c_β·n_i·β, B = 1/β.

    Needs at least two distinct sizes and p ≥ 2 (on one rank a collective moves nothing).
    """
    sizes = np.asarray(sizes_bytes, dtype=np.float64)
    times = np.asarray(times_s, dtype=np.float64)
    if sizes.ndim != 1 or sizes.shape != times.shape:
        raise ValueError(
            f"sizes_bytes and times_s must be 1-D of equal length, got shapes "
            f"{sizes.shape} and {times.shape}"
        )
    if np.any(sizes < 0) or np.any(times < 0) or not np.all(np.isfinite(sizes + times)):
        raise ValueError("sizes_bytes and times_s must be finite and >= 0")
    if np.unique(sizes).size < 2:
        raise ValueError(f"need at least two distinct sizes to fit α and B, got {sizes.tolist()}")
    c_alpha, c_beta = alpha_beta_coefficients(op, p, algorithm)
    if c_alpha == 0:
        raise ValueError(f"p must be >= 2 to fit α and B (p = {p} moves no bytes)")
    design = np.column_stack([np.full_like(sizes, c_alpha), c_beta * sizes])
    (alpha, beta), *_ = np.linalg.lstsq(design, times, rcond=None)
    if beta <= 0:
        raise ValueError(f"the fit gave a non-positive 1/B ({beta!r}): times do not grow with size")
    residual = times - design @ np.array([alpha, beta])
    return AlphaBetaFit(float(alpha), float(1 / beta), float(np.sqrt(np.mean(residual**2))))
