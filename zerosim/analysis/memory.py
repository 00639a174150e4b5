"""Per-rank model-state memory of ZeRO stages 0–3 and Megatron's distributed optimizer.

Model states are the parameters, their gradients, the fp32 master copy of the parameters (mixed
precision only) and the optimizer states. With Ψ parameters (after padding), N data-parallel
ranks, b_p / b_g bytes per 16-bit (or full-precision) parameter / gradient, b_m bytes per master
weight and K_s optimizer state arrays of b_s bytes each, a rank holds (ZeRO paper, Rajbhandari
et al. 2020, Sec. 5 — P_os is stage 1, P_os+g stage 2, P_os+g+p stage 3):

    stage   params      grads       master_params   optimizer_states
    0       Ψ·b_p       Ψ·b_g       Ψ·b_m           K_s·Ψ·b_s
    1       Ψ·b_p       Ψ·b_g       Ψ·b_m / N       K_s·Ψ·b_s / N
    2       Ψ·b_p       Ψ·b_g / N   Ψ·b_m / N       K_s·Ψ·b_s / N
    3       Ψ·b_p / N   Ψ·b_g / N   Ψ·b_m / N       K_s·Ψ·b_s / N

With mixed-precision Adam (b_p = b_g = 2, b_m = 4, K_s = 2, b_s = 4) the paper folds master weights
and states into K = b_m + K_s·b_s = 12 bytes per parameter and writes (Sec. 5, Table 1):

    baseline (stage 0)  (2 + 2 + K)·Ψ = 16Ψ        P_os    4Ψ + K·Ψ/N
    P_os+g              2Ψ + (2 + K)·Ψ/N           P_os+g+p  (4 + K)·Ψ/N

Full-precision training (zerosim's float64 / float32 modes) has no separate master copy: the
parameter is the master, and the K_s states share its dtype (b bytes). Then, per rank,

    stage 0: (1 + 1 + K_s)·Ψ·b        stage 1: (1 + 1)·Ψ·b + K_s·Ψ·b / N
    stage 2: Ψ·b + (1 + K_s)·Ψ·b / N  stage 3: (2 + K_s)·Ψ·b / N

Values are exact: an int when N divides the byte count (always, once Ψ is padded to a multiple of
N), else a float. Offload (ZeRO-Offload / ZeRO-Infinity) moves categories off the device: an
optimizer offload moves master_params, master_grads and optimizer_states to host (``cpu``) or
NVMe; a parameter offload (stage 3 only) moves the parameter partition. Gradients stay on the
device. Transient buffers (NVMe swap tiles, gathered stage-3 layers, communication buckets) are
not model states and are not counted here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction

from zerosim.analysis.stages import ZERO_STAGES
from zerosim.backend import PRECISION_DTYPES, resolve_dtype

CATEGORIES = ("params", "grads", "master_params", "master_grads", "optimizer_states")
PLACES = ("device", "host", "nvme")
OFFLOAD_DEVICES = {"none": "device", "cpu": "host", "nvme": "nvme"}

Number = int | float


def _exact(x: Fraction) -> Number:
    return int(x) if x.denominator == 1 else float(x)


def _count(name: str, value: float, minimum: int) -> int:
    """An integral count ≥ minimum (floats such as 7.5e9 are accepted when integral)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class ModelStateMemory:
    """Bytes of model states held by one rank, by category, and where each category lives."""

    params: Number
    grads: Number
    master_params: Number
    master_grads: Number
    optimizer_states: Number
    placement: dict[str, str] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, "device"))

    @property
    def total(self) -> Number:
        return sum(getattr(self, c) for c in CATEGORIES)

    def split(self) -> dict[str, Number]:
        """Bytes on each of device, host and nvme."""
        out: dict[str, Number] = dict.fromkeys(PLACES, 0)
        for c in CATEGORIES:
            out[self.placement[c]] += getattr(self, c)
        return out

    def as_dict(self) -> dict[str, Number]:
        """{category: bytes} plus ``total``."""
        return {**{c: getattr(self, c) for c in CATEGORIES}, "total": self.total}


def zero_model_states(
    num_params: float,
    dp_degree: int,
    stage: int,
    *,
    param_bytes: int = 2,
    grad_bytes: int | None = None,
    master_bytes: int | None = 4,
    state_bytes: int = 4,
    num_states: int = 2,
    offload_optimizer: str = "none",
    offload_param: str = "none",
) -> ModelStateMemory:
    """Per-rank model-state bytes for ZeRO ``stage`` (table in the module docstring).

    ``grad_bytes`` defaults to ``param_bytes``; ``master_bytes=None`` means no separate master copy
    (full-precision training). ``num_states`` is K_s: Adam 2, SGD with momentum 1, plain SGD 0.
    ``offload_optimizer`` ∈ {none, cpu, nvme} needs stage ≥ 1; ``offload_param`` needs stage 3.
    """
    psi = _count("num_params", num_params, 0)
    n = _count("dp_degree", dp_degree, 1)
    if stage not in ZERO_STAGES:
        raise ValueError(f"stage must be one of {ZERO_STAGES}, got {stage!r}")
    grad_bytes = param_bytes if grad_bytes is None else grad_bytes
    for name, b in (
        ("param_bytes", param_bytes),
        ("grad_bytes", grad_bytes),
        ("state_bytes", state_bytes),
    ):
        _count(name, b, 1)
    if master_bytes is not None:
        _count("master_bytes", master_bytes, 1)
    k = _count("num_states", num_states, 0)
    for name, dev in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if dev not in OFFLOAD_DEVICES:
            raise ValueError(f"{name} must be one of {sorted(OFFLOAD_DEVICES)}, got {dev!r}")
    if offload_optimizer != "none" and stage == 0:
        raise ValueError(
            f"offload_optimizer={offload_optimizer!r} needs ZeRO stage 1, 2 or 3, got stage 0"
        )
    if offload_param != "none" and stage != 3:
        raise ValueError(f"offload_param={offload_param!r} needs ZeRO stage 3, got stage {stage}")

    def held(nbytes: int, partitioned: bool) -> Number:
        return _exact(Fraction(psi * nbytes, n if partitioned else 1))

    placement = dict.fromkeys(CATEGORIES, "device")
    for c in ("master_params", "master_grads", "optimizer_states"):
        placement[c] = OFFLOAD_DEVICES[offload_optimizer]
    placement["params"] = OFFLOAD_DEVICES[offload_param]
    return ModelStateMemory(
        params=held(param_bytes, stage >= 3),
        grads=held(grad_bytes, stage >= 2),
        master_params=0 if master_bytes is None else held(master_bytes, stage >= 1),
        master_grads=0,
        optimizer_states=held(k * state_bytes, stage >= 1),
        placement=placement,
    )


def full_precision_model_states(
    num_params: float,
    dp_degree: int,
    stage: int,
    *,
    dtype_bytes: int = 4,
    num_states: int = 2,
    offload_optimizer: str = "none",
    offload_param: str = "none",
) -> ModelStateMemory:
    """fp32 / fp64 training, no master copy: stage 0 (2 + K_s)·Ψ·b … stage 3 (2 + K_s)·Ψ·b / N."""
    return zero_model_states(
        num_params,
        dp_degree,
        stage,
        param_bytes=dtype_bytes,
        grad_bytes=dtype_bytes,
        master_bytes=None,
        state_bytes=dtype_bytes,
        num_states=num_states,
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
    )


def bucket_pool_bytes(
    reduce_bucket_size: int,
    largest_numel: int,
    padded_numel: int,
    world_size: int,
    itemsize: int,
    in_flight: int = 2,
) -> int:
    """Upper bound of ZeRO-R's constant-size gradient buffers (Rajbhandari et al. 2020, §6.2)
    at stages 2 and 3: the bucket pool of ``zerosim/zero/buckets.py``.

    A bucket closes at the first parameter boundary past ``reduce_bucket_size`` = B elements, so
    it holds at most B + L (L the largest parameter, padded), and never more than Ψ_pad. Open at
    once: two buckets being filled (a boundary inside a module's parameters) and ``in_flight``
    launched ones, each launched one with its reduced piece of 1/N of it::

        pool ≤ (2 + in_flight · (1 + 1/N)) · min(B + L, Ψ_pad) · b

    Independent of the model's size once Ψ_pad > B + L: constant-size, as ZeRO-R says (with
    DeepSpeed's default B = 5e8 a model under 500M parameters has one model-sized bucket).
    """
    bucket = min(reduce_bucket_size + largest_numel, padded_numel)
    return int((2 + in_flight * Fraction(world_size + 1, world_size)) * bucket * itemsize)


def zero_paper_bytes(num_params: float, dp_degree: int, stage: int, k: int = 12) -> Number:
    """The ZeRO paper's per-device model-state bytes (Sec. 5, Table 1), 2-byte params and grads.

    stage 0 (baseline DP): (2 + 2 + K)·Ψ;  1 (P_os): 4Ψ + K·Ψ/N;  2 (P_os+g): 2Ψ + (2 + K)·Ψ/N;
    3 (P_os+g+p): (4 + K)·Ψ/N.  K = 12 for mixed-precision Adam.
    """
    psi, n = _count("num_params", num_params, 0), _count("dp_degree", dp_degree, 1)
    k = _count("k", k, 0)
    forms = {
        0: Fraction((4 + k) * psi),
        1: 4 * psi + Fraction(k * psi, n),
        2: 2 * psi + Fraction((2 + k) * psi, n),
        3: Fraction((4 + k) * psi, n),
    }
    if stage not in forms:
        raise ValueError(f"stage must be one of {ZERO_STAGES}, got {stage!r}")
    return _exact(forms[stage])


def megatron_model_states(
    num_params: float,
    dp_degree: int,
    *,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    master_bytes: int = 4,
    state_bytes: int = 4,
    num_states: int = 2,
) -> ModelStateMemory:
    """Per-rank bytes with Megatron-LM's distributed optimizer over d = ``dp_degree`` ranks.

    Parameters and the gradient buffer stay whole on every rank (the buffer is reduce-scattered in
    place); the optimizer shards its fp32 main parameters, an fp32 copy of the gradients when they
    are not already fp32, and its states. Megatron-LM docs (distributed optimizer), bytes per
    parameter, non-distributed vs distributed:

        fp16 param, fp16 grads   20   4 + 16/d   (2 + 2 | main param 4, main grad 4, Adam 8)
        bf16 param, fp32 grads   18   6 + 12/d   (2 + 4 | main param 4, Adam 8)
        fp32 param, fp32 grads   16   8 + 8/d    (4 + 4 | Adam 8; the param is its own main copy)
    """
    psi, d = _count("num_params", num_params, 0), _count("dp_degree", dp_degree, 1)
    for name, b in (
        ("param_bytes", param_bytes),
        ("grad_bytes", grad_bytes),
        ("master_bytes", master_bytes),
        ("state_bytes", state_bytes),
    ):
        _count(name, b, 1)
    k = _count("num_states", num_states, 0)
    shard = Fraction(psi, d)
    return ModelStateMemory(
        params=psi * param_bytes,
        grads=psi * grad_bytes,
        master_params=_exact(shard * master_bytes) if param_bytes != master_bytes else 0,
        master_grads=_exact(shard * master_bytes) if grad_bytes != master_bytes else 0,
        optimizer_states=_exact(shard * k * state_bytes),
    )


@dataclass(frozen=True)
class MegatronRow:
    """A row of Megatron's table: bytes/param = replicated + sharded/d (d = 1: non_distributed)."""

    param_dtype: str
    grad_dtype: str
    non_distributed: int
    replicated: int
    sharded: int


_DTYPE_BYTES = {k: resolve_dtype(v).itemsize for k, v in PRECISION_DTYPES.items()}


def megatron_table() -> list[MegatronRow]:
    """Megatron's bytes-per-parameter table, computed from :func:`megatron_model_states`."""
    rows = []
    for p, g in (("fp16", "fp16"), ("bf16", "fp32"), ("fp32", "fp32")):
        m = megatron_model_states(1, 1, param_bytes=_DTYPE_BYTES[p], grad_bytes=_DTYPE_BYTES[g])
        replicated = m.params + m.grads
        rows.append(MegatronRow(p, g, m.total, replicated, m.total - replicated))
    return rows


TABLE1_MODELS = (("7.5B", 7.5e9), ("128B", 128e9), ("1T", 1e12))
TABLE1_DP = (1, 4, 16, 64, 256, 1024)


@dataclass(frozen=True)
class Table1Row:
    """One (model, N_d) cell group of the ZeRO paper's Table 1, in GB = 1e9 bytes, unrounded."""

    model: str
    num_params: int
    dp_degree: int
    baseline: float
    p_os: float
    p_os_g: float
    p_os_g_p: float


def table1(k: int = 12) -> list[Table1Row]:
    """The ZeRO paper's Table 1: per-device model-state memory (GB = 1e9 bytes) vs DP degree.

    The paper prints no baseline column (its N_d = 1 row is the baseline, 16Ψ); it is given here
    for comparison. Use :func:`format_paper_gb` to print a value as the paper does.
    """
    rows = []
    for label, psi in TABLE1_MODELS:
        for n in TABLE1_DP:
            gb = [zero_paper_bytes(psi, n, s, k) / 1e9 for s in ZERO_STAGES]
            rows.append(Table1Row(label, int(psi), n, *gb))
    return rows


def format_paper_gb(gb: float | Fraction) -> str:
    """Write a GB value as Table 1 prints it.

    The paper truncates values ≥ 100 to whole GB (4187.5 → 4187, 513.5 → 513) and rounds smaller
    ones half up to three significant figures, at most two decimals (41.25 → 41.3, 1.875 → 1.88,
    0.46875 → 0.47), dropping trailing zeros (30.0 → 30). A ``Fraction`` (bytes / 10^9) is
    truncated exactly, however many digits it has.
    """
    if gb >= 100:
        return str(int(gb))  # int() truncates, exactly for a Fraction
    value = Decimal(repr(float(gb)))
    places = Decimal("0.1") if value >= 10 else Decimal("0.01")
    text = str(value.quantize(places, rounding=ROUND_HALF_UP))
    return text.rstrip("0").rstrip(".") if "." in text else text


def table1_markdown(k: int = 12) -> str:
    """Table 1 as a Markdown table, one row per DP degree, values formatted as the paper prints."""
    head = (
        "| N_d | "
        + " | ".join(f"{m} P_os | {m} P_os+g | {m} P_os+g+p" for m, _ in TABLE1_MODELS)
        + " |"
    )
    lines = [head, "|" + "---|" * (1 + 3 * len(TABLE1_MODELS))]
    rows = table1(k)
    for n in TABLE1_DP:
        cells = []
        for label, _ in TABLE1_MODELS:
            r = next(r for r in rows if r.model == label and r.dp_degree == n)
            cells += [format_paper_gb(v) for v in (r.p_os, r.p_os_g, r.p_os_g_p)]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
