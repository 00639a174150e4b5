"""What no loss can see: the components of the peer cases' weights that the loss ignores and
that the optimizer moves by rounding alone, and how far the two sides may drift apart there.

Fixed directions no loss can see, for every input and every value of the other weights:

- softmax gives the same probabilities when one number is added to every score of a row. Logits: a
  vector added to every row of the output layer's weight (W + 1·aᵀ adds a·h to every logit) or one
  number to every element of its bias; the GPT's lm_head alike. Attention scores: the key bias b_k,
  whole: query i scores key j as q_i·(W_k·x_j + b_k), and q_i·b_k is the same for every key j, in
  every head, so b_k's gradient is zero in exact arithmetic.
- LayerNorm gives the same output when one number is added to every feature of its input (it
  subtracts the mean), and the GPT reads its residual stream only through LayerNorms (ln_1, ln_2,
  ln_f): one number added to every feature at a position is unseen. So a number added to each row
  of wte (per token) or wpe (per position), and for attn.c_proj and mlp.c_proj a vector added to
  every row of the weight or a number to every element of the bias.

Their gradients there are zero, so what arrives is the rounding of a sum that cancels (the key
bias's: about 3e-12 in float32 at the first step). Where that rounding becomes a step of its own,
the two sides' steps there have nothing in common but their size, and the weights are compared
apart (``unseen_part``):

- Adam steps each element by lr·m̂/(√v̂ + ε) whatever its gradient's size: an element whose whole
  gradient is unseen (every element of the key bias) moves by rounding alone, either way. The other
  directions above are sums of elements whose own gradients are not zero (a row's mean, a
  column's): Adam's step there is a function of those gradients, and rounding stays rounding.
- Muon replaces its momentum M = U·S·Vᵀ by about U·Vᵀ: Newton–Schulz's quintic has slope a⁵ ≈ 485
  at zero after five steps, so a singular value that is zero but for rounding δ·‖M‖ becomes about
  485·δ (at most ~5e-5 in float32, where δ ≲ 1e-7; O(1) in bfloat16). A vector 1 with 1ᵀ·G = 0
  makes a zero singular value where the matrix has no more rows than columns: the MLP's output
  layer (5 × 37) and the GPT's attn.c_proj (16 × 16) and mlp.c_proj (16 × 64), along 1·aᵀ, the
  rows' mean. wte (11 × 16) and wpe (8 × 16) have G·1 = 0, but a wide matrix has cols − rows null
  directions anyway: no singular value is added there, none is raised. lm_head and the biases are
  Adam's.

Directions that move with the weights (compared whole: neither optimizer raises rounding in them):
W_k along 1/γ₁ (ln_1's output x_j has (1/γ₁)·x_j = β₁·(1/γ₁), the same at every key); ln_f's bias
in null(lm_head) (5 of 16 directions) and along lm_head⁺·1; the value bias b_v where c_proj·b_v ∝ 1
(attention rows sum to one, so b_v reaches every position alike); the rescalings (a ReLU unit's
input by α, its output by 1/α; per head W_q → A·W_q with W_k → A⁻ᵀ·W_k, and W_v with c_proj);
LayerNorm's scale (unseen only without ε). At step 1 alone, γ = 1 and β = 0 make ln_1's and ln_2's
outputs sum to zero over features, so the gradients of c_attn (48 × 16) and c_fc (64 × 16) have
G·1 = 0 and Muon raises rounding along 1 once; unseen then, seen once γ and β have moved
[c_attn.weight 8e-8 at N = 2 and 3].

Losses are computed from what the loss sees: rounding alone. Norms: an unseen gradient's rounding
adds its square (≲ 1e-18) to ‖g‖² ≈ 1; Muon's norm at stages 1-2, taken over the updates, gains
(485·δ)² ≲ 3e-9 against Σu² ≈ 120 in float32 (bfloat16: ``MUON_BF16_NORM_RTOL`` in
test_deepspeed_parity.py).

How far apart (``unseen_bound``): each side moves an element by at most lr·B per step, so the two
differ by at most 2·Σₜ lr·Bₜ (weight decay multiplies the difference by 1 − lr·λ ≤ 1). Adam: by
Cauchy–Schwarz on m_t = (1 − β₁)·Σ β₁^(t−s)·g_s against v_t = (1 − β₂)·Σ β₂^(t−s)·g_s², for any
gradients,

    |m̂_t/(√v̂_t + ε)| ≤ √(1 − β₂ᵗ)/(1 − β₁ᵗ) · (1 − β₁)/√(1 − β₂) · √(Σ_{j<t} (β₁²/β₂)ʲ)

(1.00 to 1.01 for t ≤ 5). Muon: an element of the rows' mean of an update U is at most ‖U‖₂/√rows,
and ‖U‖₂ is at most the quintic's largest value on [0, 1] after five steps, 1.2024 (DeepSpeed's
aspect scale is 1 for rows ≤ cols; the √rows ≥ 2.2 of slack covers rounding).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

# DeepSpeed's Newton–Schulz (muon/original_muon.py): the quintic's coefficients and its steps
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NORMALISING = ("adam", "adamw", "muon")  # the optimizers whose step does not scale with g


def ns_largest_value() -> float:
    """The largest singular value Newton–Schulz returns: x ↦ a·x + b·x³ + c·x⁵ applied
    ``NS_STEPS`` times, over the input's singular values x ∈ [0, 1] (after X/‖X‖_F), 1.2024."""
    a, b, c = NS_COEFFICIENTS
    x = np.linspace(0.0, 1.0, 200_001)
    for _ in range(NS_STEPS):
        x = a * x + b * x**3 + c * x**5
    return float(x.max())


def adam_step_bound(beta1: float, beta2: float, t: int) -> float:
    """The largest |m̂_t/(√v̂_t + ε)| any gradients give at step t (module docstring)."""
    ratio = beta1**2 / beta2
    bias = math.sqrt(1 - beta2**t) / (1 - beta1**t)
    return bias * (1 - beta1) / math.sqrt(1 - beta2) * math.sqrt(sum(ratio**j for j in range(t)))


def _rule(case: dict[str, Any]) -> str:
    return case["config"]["optimizer"]["type"].lower()


def _muon_rows_mean(case: dict[str, Any], key: str, shape: tuple[int, ...]) -> bool:
    """Whether Muon trains weight ``key`` and raises the rounding along its rows' mean: the
    output layer of the MLP, the GPT's c_proj weights, where rows ≤ cols."""
    model = case["model"]
    if _rule(case) != "muon" or len(shape) != 2 or shape[0] > shape[1]:
        return False
    if model["kind"] == "mlp":
        return key == f"layers.{2 * (len(model['sizes']) - 2)}.weight"
    return key.endswith(".c_proj.weight")


def _key_bias(case: dict[str, Any], key: str) -> slice | None:
    """The key bias's elements in c_attn's bias (q, k, v stacked), under an optimizer that
    normalises its step, or None."""
    model = case["model"]
    if model["kind"] != "gpt" or _rule(case) not in NORMALISING:
        return None
    if not key.endswith(".attn.c_attn.bias"):
        return None
    return slice(model["embd"], 2 * model["embd"])


def unseen_part(case: dict[str, Any], key: str, w: np.ndarray) -> np.ndarray | None:
    """The component of weight ``key`` (value ``w``) that no loss can see and that the case's
    optimizer moves by rounding alone, as an array of w's shape; None where there is none."""
    w = np.asarray(w, dtype=np.float64)
    keys = _key_bias(case, key)
    if keys is not None:
        out = np.zeros_like(w)
        out[keys] = w[keys]
        return out
    if _muon_rows_mean(case, key, w.shape):
        return np.broadcast_to(w.mean(axis=0, keepdims=True), w.shape).copy()
    return None


def _peak_lr(case: dict[str, Any], lr: float) -> float:
    """The largest learning rate the case's scheduler reaches from the optimizer's ``lr``."""
    scheduler = case["config"].get("scheduler")
    if scheduler is None or scheduler["type"] == "WarmupCosineLR":  # lr times a ratio ≤ 1
        return lr
    if scheduler["type"] in ("WarmupLR", "WarmupDecayLR"):  # up to warmup_max_lr
        return max(lr, scheduler["params"].get("warmup_max_lr", 1e-3))
    raise ValueError(f"scheduler {scheduler['type']!r}: its peak learning rate is not derived")


def unseen_bound(case: dict[str, Any], key: str, shape: tuple[int, ...]) -> float:
    """How far the two sides' ``unseen_part`` of weight ``key`` may differ after the case's
    steps: 2·Σₜ lr·Bₜ (module docstring)."""
    params = case["config"]["optimizer"]["params"]
    muon = _rule(case) == "muon"
    steps = range(1, case["steps"] + 1)
    if _muon_rows_mean(case, key, shape):
        lr = params.get("muon_lr", params["lr"])
        per_step = [ns_largest_value() / math.sqrt(shape[0])] * len(steps)
    elif _key_bias(case, key) is not None:
        lr = params.get("adam_lr", params["lr"]) if muon else params["lr"]
        beta1, beta2 = params.get("betas", (0.9, 0.95) if muon else (0.9, 0.999))
        per_step = [adam_step_bound(beta1, beta2, t) for t in steps]
    else:
        raise ValueError(f"weight {key!r} of case {case['name']!r} has no unseen part")
    return 2 * _peak_lr(case, lr) * sum(per_step)


def _worst(got: np.ndarray, want: np.ndarray) -> float:
    """max |got − want|: 0 where both are nan (both sides stepped a nan in), inf where one is."""
    diff = np.abs(got - want)
    both = np.isnan(got) & np.isnan(want)
    return float(np.max(np.where(both, 0.0, np.where(np.isnan(diff), np.inf, diff)), initial=0))


def differences(case: dict[str, Any], key: str, got: Any, want: Any) -> tuple[float, float, float]:
    """(worst |got − want| in what a loss can see, worst in what it cannot, ``unseen_bound``)
    for weight ``key``; the last two are 0 where the weight has no unseen part."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    hidden_got, hidden_want = unseen_part(case, key, got), unseen_part(case, key, want)
    if hidden_want is None:
        return _worst(got, want), 0.0, 0.0
    seen = _worst(got - hidden_got, want - hidden_want)
    return seen, _worst(hidden_got, hidden_want), unseen_bound(case, key, want.shape)


def assert_weight_equal(case: dict[str, Any], key: str, got: Any, want: Any, atol: float) -> None:
    """``got`` is ``want`` to ``atol`` in every component of weight ``key`` a loss can see, and
    within ``unseen_bound`` in the one it cannot."""
    seen, unseen, bound = differences(case, key, got, want)
    assert seen <= atol, f"{key}: differs by {seen:.3g} where the loss sees it (atol {atol:.3g})"
    assert unseen <= bound, (
        f"{key}: differs by {unseen:.3g} where no loss sees it, more than its optimizer's steps "
        f"can move it apart ({bound:.3g})"
    )
