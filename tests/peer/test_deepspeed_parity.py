"""DeepSpeed 0.19.8 itself as the oracle: the same JSON config, initial weights and data give
DeepSpeed's losses and weights (tests/peer/ds_driver.py under torchrun, zs_driver.py under
mpirun; cases.py says how both sides build the model and the data).

Bounds, and why (measured worst cases at N = 2 and 3 in brackets):
- fp32: both sides run the same arithmetic in a different order (NumPy/OpenBLAS against torch's
  kernels, an MPI all-reduce against gloo's), so losses differ by float32 rounding, about 1e-7
  relative [1.5e-7]: ``FP32_LOSS_RTOL`` = 1e-6. Weights after 5 steps: the MLP agrees to
  ``FP32_ATOL`` = 1e-6 absolute [6e-8], a few float32 ulps of weights near 0.25. The GPT's
  weights to ``GPT_ATOL`` = 1e-5 [3.7e-7, a query row of c_attn's weight in s1_gpt_adamw at
  N = 3]: Adam's m/√v divides each element's rounding by that element's own gradient, and the
  query's are small while attention is near uniform (the query bias's about 4e-5 at the first
  step); the bound is still far below one lr-sized step (1e-3).
- What no loss can see (unseen.py derives it): the attention key bias, whole (softmax ignores a
  number added to every score of a query), and under Muon the rows' mean of the MLP's output
  layer and of the GPT's c_proj weights (softmax, and LayerNorm after the residual stream,
  ignore a shift). Their gradient is the rounding of a sum that cancels (~1e-12), which Adam's
  m/√v, and Newton–Schulz along a zero singular value, turn into steps of either sign. Each
  weight is compared less that component, to the bounds here, and the component itself to
  2·Σ lr·B, twice the most the optimizer's steps can move it [the key bias: 1.2e-5 on one
  machine, 8.3e-6 on another, of a bound 1.0e-2 (Muon's Adam, lr 1e-3, five steps); the MLP's
  output rows' mean under Muon: 3.0e-7 in fp32 of 1.1e-1, 3.9e-3 in bf16 at stage 0 of 2.2e-2
  (one step, lr 0.02)]. The loss cannot tell those values apart; what is compared is that
  each side kept that component within what its optimizer can do there.
- bf16 (SGD, which does not normalise the update, so rounding stays rounding): both forwards run
  in bf16 but round different intermediates (zerosim accumulates each matmul in fp32 and rounds
  once; torch's CPU kernels may round partial results), so losses agree to a few bf16 ulps
  (``BF16_LOSS_RTOL`` = 3·2⁻⁸, the ulp of [0.5, 1) being 2⁻⁸) [6.4e-3] and the fp32 master
  weights to ``BF16_ATOL`` = 4 bf16 ulps of weights in [0.125, 0.25), 4·2⁻¹⁰ [2.3e-3].
- fp16 (DeepSpeed's CPU fp16 check patched on in ds_driver.py; dynamic loss scaling): losses as
  bf16's, weights to ``FP16_ATOL`` = 4 fp16 ulps of weights in [0.125, 0.25), 4·2⁻¹³ [2.3e-4,
  with accumulation 3 at N = 2: the fp16 gradients still differ by an ulp here and there, since
  torch rounds each op's output to fp16 (the log-softmax among them) where zerosim rounds a
  matmul's or the loss's fp32 result once, and SGD's momentum carries that over 5 steps]; both
  sides must skip the same steps. Cases: stages 1-3 from 2⁸ or 2¹⁰; with accumulation 3
  (the seed of backward, scale / 3, is rounded to fp16 on both sides, and each micro-step's fp16
  gradient is rounded before it is added to ``.grad``); from DeepSpeed's default 2¹⁶, which is
  not a float16, so the seed is inf and the first two steps (hysteresis 2) overflow and are
  skipped on both sides; with ``loss_scale_window`` 2, where the scale grows on steps 2 and 4
  and DeepSpeed updates it before it unscales, so those steps divide by the grown scale; and
  stage 0, from a scale of 1: DeepSpeed's stage 0 never multiplies
  the loss by the scale but divides the gradients by it (tests/test_deepspeed_fp16_stage0.py;
  zerosim scales, the deliberate difference docs/config.md lists), so only a scale of 1 compares
  the rest of its FP16_UnfusedOptimizer path.
- a nan and an inf injected (``nonfinite_cases``: a nan into rank 0's micro-batch of step 1, an
  inf into rank 1's of step 3) at every stage in fp32, bf16 with and without
  ``bf16.check_grad_overflow``, and fp16: where DeepSpeed skips, the weights are held to the
  bounds above and must be finite; where it does not (stage 0 in fp32; stages 1-2 in bf16
  without the check), both sides' weights are nan in the same places. After every step the
  skipped steps, the loss scale and the collectives are DeepSpeed's, exactly.
- Muon in bf16 (stages 0-3, 16 samples a rank): ``BF16_ATOL``, the output layer's weight compared
  less the component no loss can see (unseen.py): its gradient has a null direction (softmax's rows
  sum to zero) where Newton–Schulz turns each side's bf16 rounding into an O(1) update component of
  its own [whole: MLP 1.7e-3 at N = 2, 3.0e-3 at N = 3 at stages 1-3, 1.1e-2 at stage 0 after five
  steps, where the momentum is fp32; less that component: 8e-5 to 2.1e-4 at stages 1-3, offload
  included, 6e-4 at stage 0]. Stage 0 runs one step: from the second on, the fp32 momentum carries
  each side's amplified noise into the next update, and after five steps a few weights of the first
  layer (one hidden unit's row) differ by up to 6.8e-3 while the losses still agree within their
  bound (measured at N = 2; without clipping alike); the first step (FP16_UnfusedOptimizer's fp32
  copies and momentum, the clip over the raw gradients) agrees to 6e-4.
- Muon (fp32, Newton–Schulz "gram" in float32 on both sides): the same bounds as Adam's. Both
  sides orthogonalize the same reduced gradients up to float32 rounding, and the update is
  ~1 in size, so a matrix's weights move by lr·(update) with differences of lr·1e-6 [MLP
  2.1e-7 (s0_muon's first layer) less the output rows' mean; GPT 1.2e-7 less the key bias].
"""

from __future__ import annotations

import math

import numpy as np
import pytest

deepspeed = pytest.importorskip("deepspeed", reason="the peer tests need DeepSpeed (test extra)")

from nonfinite_worker import deepspeed_skips  # noqa: E402
from runner import deepspeed_step, zerosim_step  # noqa: E402
from unseen import assert_weight_equal  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

FP32_LOSS_RTOL = 1e-6
FP32_ATOL = 1e-6
GPT_ATOL = 1e-5
BF16_LOSS_RTOL = 3 * 2.0**-8
BF16_ATOL = 4 * 2.0**-10
FP16_ATOL = 4 * 2.0**-13
MLP = {"kind": "mlp", "sizes": [20, 37, 5]}
GPT = {"kind": "gpt", "vocab": 11, "block": 8, "layers": 1, "heads": 2, "embd": 16}


def _case(name, stage, optimizer, model=MLP, steps=5, **top):
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": optimizer,
        "zero_optimization": {"stage": stage, **top.pop("zero", {})},
        **top,
    }
    return {"name": name, "steps": steps, "model": model, "config": config}


ADAM = {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}}
ADAM_L2 = {
    "type": "Adam",
    "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True, "adam_w_mode": False},
}
ADAM_FUSED = {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.01}}
ADAMW = {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.05, "torch_adam": True}}
SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
UNTESTED = {"zero_allow_untested_optimizer": True}
WARMUP = {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_type": "linear"}}
DECAY = {
    "type": "WarmupDecayLR",
    "params": {"warmup_num_steps": 2, "total_num_steps": 6, "warmup_max_lr": 0.05},
}
COSINE = {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 2, "total_num_steps": 6}}
# Muon with torch's AdamW as its auxiliary Adam (DeepSpeed's FusedAdam, the default, is not built
# on this machine; torch_adam changes nothing else)
MUON = {
    "type": "Muon",
    "params": {"lr": 0.02, "adam_lr": 1e-3, "weight_decay": 0.01, "torch_adam": True},
}
FP16_8 = {"enabled": True, "initial_scale_power": 8}
OFFLOAD = {"offload_optimizer": {"device": "cpu"}}
# The norm at stages 1-2 is taken over Muon's updates. The output layer's gradient (5 × 37) has
# a null direction (softmax rows sum to zero) that holds only rounding noise, which each side
# rounds differently and Newton–Schulz raises to a singular value anywhere in [0, 1.20] (five
# steps of its quintic map (0, 1] there): Σu² may differ by up to 1.20² ≈ 1.45 of about 32, the
# norm by up to 1.45 / (2·32) ≈ 2.3e-2 relative [offload, N = 3: 1.06e-2].
MUON_BF16_NORM_RTOL = 2.5e-2
BF16_MUON = {"bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 16}
# Stage 0: DeepSpeed's backward leaves the loss unscaled, zerosim's scales it (docs/config.md);
# from a scale of 1 the two agree, the dynamic scaler and FP16_UnfusedOptimizer's step included.
FP16_SCALE_1 = {"enabled": True, "initial_scale_power": 0}


# A nan into rank 0's micro-batch of step 1, an inf into rank 1's of step 3 (N = 2 and 3 both)
INJECT = [{"step": 1, "rank": 0, "value": "nan"}, {"step": 3, "rank": 1, "value": "inf"}]
PRECISION_SECTIONS = {
    "fp32": {},
    "bf16": {"bf16": {"enabled": True}},
    "bf16_unchecked": {"bf16": {"enabled": True, "check_grad_overflow": False}},
}


def nonfinite_cases(stages) -> list[dict]:
    """Every precision DeepSpeed runs on CPU (fp16 with its check patched, ds_driver.py) at each
    of ``stages``, with ``INJECT``'s nan and inf: DeepSpeed's default clipping (1.0), Adam in
    fp32 and SGD in 16 bits (see the bounds above), accumulation 2 at stage 2 in fp32."""
    out = []
    for stage in stages:
        for precision, section in PRECISION_SECTIONS.items():
            fp32 = precision == "fp32"
            more = {"gradient_accumulation_steps": 2} if fp32 and stage == 2 else {}
            opt, extra = (ADAM, {}) if fp32 else (SGD, UNTESTED if stage else {})
            out.append(
                _case(f"s{stage}_nonfinite_{precision}", stage, opt, **section, **more, **extra)
            )
        # stage 0 from a scale of 1 (FP16_SCALE_1); stages 1-3 from 2**8 with hysteresis 2, so
        # the nan is absorbed and the inf halves the scale
        fp16 = FP16_SCALE_1 if stage == 0 else FP16_8
        untested = UNTESTED if stage else {}
        out.append(_case(f"s{stage}_nonfinite_fp16", stage, SGD, fp16=fp16, **untested))
    for case in out:
        case["inject"] = INJECT
    return out


def cases() -> list[dict]:
    """Every stage, fp32 and bf16, accumulation 1 and 2, clipping by default and explicit, Adam
    under both of DeepSpeed's rules (adam_w_mode, torch_adam), AdamW, SGD with momentum (with
    zero_allow_untested_optimizer under ZeRO), with and without DeepSpeed's schedulers; and a
    nan and an inf at every stage and precision (``nonfinite_cases``: stages 0-2 first and stage
    3 last, as test_deepspeed_collectives.py says why, since their collectives are compared)."""
    bf16 = {"bf16": {"enabled": True}}
    return [
        *nonfinite_cases((0, 1, 2)),
        _case("s0_adam", 0, ADAM),
        _case("s0_sgd_bf16", 0, SGD, **bf16),
        _case("s1_adamw_clip_gas2", 1, ADAMW, gradient_clipping=0.3, gradient_accumulation_steps=2),
        _case("s1_adam_noclip", 1, ADAM, gradient_clipping=0.0),
        _case("s1_sgd_bf16", 1, SGD, **UNTESTED, **bf16),
        _case("s2_adam_l2_warmup", 2, ADAM_L2, scheduler=WARMUP),
        _case("s2_adam_fused", 2, ADAM_FUSED),
        _case(  # the round-robin layout moves which rank owns what (and so the weights' path)
            "s1_gpt_adam_round_robin",
            1,
            ADAM,
            model=GPT,
            zero={"round_robin_gradients": True, "use_multi_rank_bucket_allreduce": False},
        ),
        _case("s2_sgd_decay", 2, SGD, scheduler=DECAY, **UNTESTED),
        _case("s2_sgd_bf16_gas2", 2, SGD, gradient_accumulation_steps=2, **UNTESTED, **bf16),
        _case("s3_adam_gas2", 3, ADAM, gradient_accumulation_steps=2),
        _case("s3_sgd", 3, SGD, **UNTESTED),
        _case("s3_sgd_bf16", 3, SGD, **UNTESTED, **bf16),
        _case("s3_gpt_adam_cosine", 3, ADAM, model=GPT, scheduler=COSINE),
        _case("s1_gpt_adamw", 1, ADAMW, model=GPT),
        _case("s1_sgd_fp16", 1, SGD, fp16={"enabled": True, "initial_scale_power": 8}, **UNTESTED),
        _case("s2_sgd_fp16", 2, SGD, fp16={"enabled": True, "initial_scale_power": 8}, **UNTESTED),
        _case("s3_adam_fp16", 3, ADAM, fp16={"enabled": True, "initial_scale_power": 10}),
        _case("s0_sgd_fp16_gas3", 0, SGD, gradient_accumulation_steps=3, fp16=FP16_SCALE_1),
        _case("s1_sgd_fp16_gas3", 1, SGD, gradient_accumulation_steps=3, fp16=FP16_8, **UNTESTED),
        _case("s3_sgd_fp16_gas3", 3, SGD, gradient_accumulation_steps=3, fp16=FP16_8, **UNTESTED),
        _case("s2_sgd_fp16_default", 2, SGD, fp16={"enabled": True}, **UNTESTED),
        _case("s2_sgd_fp16_window2", 2, SGD, fp16=dict(FP16_8, loss_scale_window=2), **UNTESTED),
        # gradient_allreduce_op "sum": summed, unscaled gradients (the predivide factor unread)
        _case("s0_sgd_sum", 0, SGD, gradient_allreduce_op="sum"),
        _case(
            "s1_sgd_sum_gas2",
            1,
            SGD,
            gradient_allreduce_op="sum",
            gradient_accumulation_steps=2,
            **UNTESTED,
        ),
        _case(
            "s2_sgd_sum_predivide",
            2,
            SGD,
            gradient_allreduce_op="sum",
            gradient_predivide_factor=2.0,
            **UNTESTED,
        ),
        *nonfinite_cases((3,)),
        # Muon: stage 0 clips raw gradients, ZeRO clips the updates (the norms test holds both)
        _case("s0_muon", 0, MUON),
        _case("s1_muon_clip", 1, MUON, gradient_clipping=0.3),
        _case("s2_gpt_muon", 2, MUON, model=GPT),
        _case(  # split matrices all-reduced to their owners, the rest reduced to one
            "s2_muon_reduce_gas2",
            2,
            MUON,
            zero={"use_multi_rank_bucket_allreduce": False, "reduce_bucket_size": 300},
            gradient_accumulation_steps=2,
        ),
        _case("s3_muon", 3, MUON, zero={"reduce_scatter": False}),
        # Muon with ZeRO++'s hpZ (secondary partition = the world: what N = 2 and 3 both allow):
        # Muon's whole-matrix gathers stay full-precision over the world (DeepSpeed's stage3.py).
        # qwZ has no peer case: DeepSpeed's quantizer op has no CPU implementation.
        dict(_case("s3_muon_hpz", 3, MUON, zero={"reduce_scatter": False}), hpz_is_world=True),
        # hpZ with Adam, every parameter partitioned: after the first forward each gather is of
        # the secondary chunks, coalesced per module as DeepSpeed's coordinator fetches
        dict(
            _case("s3_adam_hpz", 3, ADAM, zero={"stage3_param_persistence_threshold": 0}),
            hpz_is_world=True,
        ),
        # Muon in bf16: at stage 0 momentum and update in fp32 (FP16_UnfusedOptimizer's fp32
        # copies), at stages 1-3 in bf16, on both sides; 16 samples a rank, so the MLP's first
        # matrix has a full-rank gradient (Newton–Schulz blows rounding noise in a gradient's
        # null space up to the size of the update; the output layer's null direction, which no
        # loss can see, is compared apart: unseen.py). Stage 0 one step (see
        # the module docstring)
        _case("s0_muon_bf16", 0, MUON, steps=1, **BF16_MUON),
        *(
            _case(f"s{stage}_muon_bf16", stage, MUON, **BF16_MUON, zero=zero)
            for stage, zero in ((1, {}), (2, {}), (3, {"reduce_scatter": False}))
        ),
        # optimizer offload to cpu (DeepSpeed's Muon path there: zero/muon_offload.py), whose
        # collectives test_offload_collectives_equal_deepspeeds also holds; nvme has no peer
        # case: DeepSpeed's async_io op does not build on this machine
        _case("s2_adam_offload", 2, ADAM, zero=OFFLOAD),
        _case("s3_adam_offload", 3, ADAM, zero=OFFLOAD),
        _case("s1_muon_offload_clip", 1, MUON, zero=OFFLOAD, gradient_clipping=0.3),
        _case(
            "s2_gpt_muon_offload_gas2",
            2,
            MUON,
            model=GPT,
            zero=OFFLOAD,
            gradient_accumulation_steps=2,
        ),  # fmt: skip
        _case("s3_muon_offload", 3, MUON, zero={**OFFLOAD, "reduce_scatter": False}),
        _case("s2_muon_offload_bf16", 2, MUON, zero=OFFLOAD, **BF16_MUON),
        _case(
            "s3_gpt_muon_gathered",
            3,
            MUON,
            model=GPT,
            zero={
                "reduce_scatter": False,
                "reduce_bucket_size": 300,
                "stage3_param_persistence_threshold": 0,
            },
        ),
    ]


@pytest.fixture
def runs(peer_runs):
    """(N, {case name: results}) of this module's cases (conftest.py's ``peer_runs``: one
    launch per side and world size for every peer module)."""
    n, results = peer_runs
    return n, results[__name__]


@pytest.mark.parametrize("name", [c["name"] for c in cases()])
def test_losses_and_weights_equal_deepspeeds(runs, name):
    n, results = runs
    ds, zs = results[name]["ds"], results[name]["zs"]
    bf16 = "bf16" in name or "fp16" in name  # 16-bit forward: rounding of a few ulps
    assert zs["ranks"][0]["skipped"] == ds["ranks"][0]["skipped"]  # the loss scaler's decisions
    for r in range(n):
        want, got = np.array(ds["ranks"][r]["losses"]), np.array(zs["ranks"][r]["losses"])
        assert want.shape == got.shape
        if bf16:
            np.testing.assert_allclose(got, want, rtol=BF16_LOSS_RTOL, err_msg=f"rank {r}")
        else:
            np.testing.assert_allclose(got, want, rtol=FP32_LOSS_RTOL, err_msg=f"rank {r}")
    assert sorted(ds["weights"]) == sorted(zs["weights"])
    atol = (
        FP16_ATOL
        if "fp16" in name
        else BF16_ATOL
        if bf16
        else GPT_ATOL
        if "gpt" in name
        else FP32_ATOL
    )
    case = next(c for c in cases() if c["name"] == name)
    for key, want in ds["weights"].items():  # what no loss can see apart (unseen.py)
        assert_weight_equal(case, key, zs["weights"][key], want, atol)


@pytest.mark.parametrize("name", [c["name"] for c in cases()])
def test_reported_gradient_norms_equal_deepspeeds(runs, name):
    """``engine.get_global_grad_norm()`` after each step: DeepSpeed's value (None at stage 0 in
    one precision, inf on a skipped step, the norm over the previous loss scale at stages 1-2
    when the scale grows), within the loss bounds (the norm of 16-bit gradients: bf16's)."""
    n, results = runs
    ds, zs = results[name]["ds"], results[name]["zs"]
    rtol = 1e-2 if ("bf16" in name or "fp16" in name) else 1e-5
    if "muon" in name and "bf16" in name:
        rtol = MUON_BF16_NORM_RTOL
    for r in range(n):
        want, got = ds["ranks"][r]["norms"], zs["ranks"][r]["norms"]
        assert len(want) == len(got)
        for k, (w, g) in enumerate(zip(want, got, strict=True)):
            if w is None or g is None or math.isinf(w):
                assert g == w, (r, k, g, w)
            else:
                assert g == pytest.approx(w, rel=rtol), (r, k, g, w)


@pytest.mark.parametrize("name", [c["name"] for c in cases() if "inject" in c])
def test_nan_and_inf_steps_are_skipped_as_deepspeed_skips_them(runs, name):
    """After each step, on every rank: zerosim's skipped steps, loss scale and collectives are
    DeepSpeed's (a step skipped on the overflow flag sends no norm; one skipped on its norm has
    sent it). DeepSpeed skips both poisoned steps exactly where tests/nonfinite_worker.py's
    reading of its source says, and its weights are finite exactly then."""
    n, results = runs
    case = next(c for c in cases() if c["name"] == name)
    stage = case["config"]["zero_optimization"]["stage"]
    skips = deepspeed_skips(stage, name.split("_nonfinite_")[1])
    ds, zs = results[name]["ds"], results[name]["zs"]
    assert ds["ranks"][0]["skips"] == ([0, 1, 1, 2, 2] if skips else [0] * 5)
    assert all(np.isfinite(w).all() for w in ds["weights"].values()) == skips
    for r in range(n):
        want, got = ds["ranks"][r], zs["ranks"][r]
        assert (got["skips"], got["scales"]) == (want["skips"], want["scales"]), f"rank {r}"
        for k, (w, g) in enumerate(zip(want["steps"], got["steps"], strict=True)):
            assert zerosim_step(g, n) == deepspeed_step(w, stage), f"rank {r}, step {k}"


COLLECTIVES_HELD = [
    c["name"]
    for c in cases()
    if "offload" in c["name"] or "muon" in c["name"] or "hpz" in c["name"]
]


@pytest.mark.parametrize("name", COLLECTIVES_HELD)
def test_offload_muon_and_hpz_collectives_equal_deepspeeds(runs, name):
    """Each step's collectives on every rank, for the optimizer-offload cases (stage 3's norm is
    an fp32 message there; Muon's gathers of every rank's owned slices, the gradient alone in
    the first step at stages 1-2; at stages 1-2 the split matrices still all-reduced to their
    owners in the backward pass), for every Muon case here (bf16 ones included, which
    test_deepspeed_collectives.py does not have) and for ZeRO++'s hpZ under DeepSpeed's
    schedule (its secondary chunks gathered coalesced, module by module, in the group)."""
    n, results = runs
    case = next(c for c in cases() if c["name"] == name)
    stage = case["config"]["zero_optimization"]["stage"]
    ds, zs = results[name]["ds"], results[name]["zs"]
    for r in range(n):
        for k, (w, g) in enumerate(zip(ds["ranks"][r]["steps"], zs["ranks"][r]["steps"],
                                       strict=True)):  # fmt: skip
            assert zerosim_step(g, n) == deepspeed_step(w, stage), f"rank {r}, step {k}"
        if "muon" in name and "offload" in name:  # every rank gathers every matrix
            assert any("all_gather" in deepspeed_step(w, stage) for w in ds["ranks"][r]["steps"])


def test_deepspeeds_default_loss_scale_overflows_on_the_first_two_steps(runs):
    """From 2**16 (not a float16) the seed of backward is inf: DeepSpeed skips steps 0 and 1
    (hysteresis 2), and the test above holds zerosim to the same skips."""
    _, results = runs
    assert results["s2_sgd_fp16_default"]["ds"]["ranks"][0]["skipped"] == 2


def test_deepspeeds_default_clipping_was_in_force(runs):
    """The cases without gradient_clipping ran with DeepSpeed's default, 1.0, on both sides."""
    _, results = runs
    assert results["s0_adam"]["ds"]["ranks"][0]["clip"] == 1.0
    assert results["s1_adam_noclip"]["ds"]["ranks"][0]["clip"] == 0.0
