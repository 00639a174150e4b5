"""DeepSpeed 0.19.8 itself as the oracle: the same JSON config, initial weights and data give
DeepSpeed's losses and weights (tests/peer/ds_driver.py under torchrun, zs_driver.py under
mpirun; cases.py says how both sides build the model and the data).

Bounds, and why (measured worst cases at N = 2 and 3 in brackets):
- fp32: both sides run the same arithmetic in a different order (NumPy/OpenBLAS against torch's
  kernels, an MPI all-reduce against gloo's), so losses differ by float32 rounding, about 1e-7
  relative [1.5e-7]: ``FP32_LOSS_RTOL`` = 1e-6. Weights after 5 steps: the MLP agrees to
  ``FP32_ATOL`` = 1e-6 absolute [6e-8], a few float32 ulps of weights near 0.25. In the GPT,
  Adam's m/√v turns the rounding noise of gradients whose true value is zero (the attention key
  bias: softmax ignores a per-row shift) into steps of up to lr, so the GPT's bound is
  ``GPT_ATOL`` = 1e-5 [1.9e-6], still far below one lr-sized step (1e-3).
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
- Muon (fp32, Newton–Schulz "gram" in float32 on both sides): the same bounds as Adam's. Both
  sides orthogonalize the same reduced gradients up to float32 rounding, and the update is
  ~1 in size, so a matrix's weights move by lr·(update) with differences of lr·1e-6 [MLP
  6e-8; GPT 4.5e-6, its Adam half's key bias as above].
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

deepspeed = pytest.importorskip("deepspeed", reason="the peer tests need DeepSpeed (test extra)")

from runner import run_both  # noqa: E402

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
# Stage 0: DeepSpeed's backward leaves the loss unscaled, zerosim's scales it (docs/config.md);
# from a scale of 1 the two agree, the dynamic scaler and FP16_UnfusedOptimizer's step included.
FP16_SCALE_1 = {"enabled": True, "initial_scale_power": 0}


def cases() -> list[dict]:
    """Every stage, fp32 and bf16, accumulation 1 and 2, clipping by default and explicit, Adam
    under both of DeepSpeed's rules (adam_w_mode, torch_adam), AdamW, SGD with momentum (with
    zero_allow_untested_optimizer under ZeRO), with and without DeepSpeed's schedulers."""
    bf16 = {"bf16": {"enabled": True}}
    return [
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


@pytest.fixture(scope="module", params=[2, 3], ids=["N2", "N3"])
def runs(request, tmp_path_factory):
    n = request.param
    return n, run_both(n, copy.deepcopy(cases()), tmp_path_factory.mktemp(f"peer{n}"))


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
    for key, want in ds["weights"].items():
        np.testing.assert_allclose(zs["weights"][key], want, rtol=0, atol=atol, err_msg=key)


@pytest.mark.parametrize("name", [c["name"] for c in cases()])
def test_reported_gradient_norms_equal_deepspeeds(runs, name):
    """``engine.get_global_grad_norm()`` after each step: DeepSpeed's value (None at stage 0 in
    one precision, inf on a skipped step, the norm over the previous loss scale at stages 1-2
    when the scale grows), within the loss bounds (the norm of 16-bit gradients: bf16's)."""
    n, results = runs
    ds, zs = results[name]["ds"], results[name]["zs"]
    rtol = 1e-2 if ("bf16" in name or "fp16" in name) else 1e-5
    for r in range(n):
        want, got = ds["ranks"][r]["norms"], zs["ranks"][r]["norms"]
        assert len(want) == len(got)
        for k, (w, g) in enumerate(zip(want, got, strict=True)):
            if w is None or g is None or math.isinf(w):
                assert g == w, (r, k, g, w)
            else:
                assert g == pytest.approx(w, rel=rtol), (r, k, g, w)


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
