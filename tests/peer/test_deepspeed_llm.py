"""DeepSpeed 0.19.8 on today's model families: a Llama-style and an MPT-style ``Transformer``
under ZeRO stages 1-3, against the torch twin DeepSpeed trains (tests/torch_twins.py's
``TorchTransformer``, built from the same ``ModelDescription`` and loading zerosim's initial
weights by name). Losses, weights, reported gradient norms and every step's collectives on
every rank equal DeepSpeed's, as the GPT cases of test_deepspeed_parity.py and
test_deepspeed_collectives.py are held.

The models (plain JSON, the description's fields; cases.py builds them on both sides):

- Llama-style: RMSNorm, SwiGLU (its own width), rotary positions (Llama 3's base 5·10⁵) and
  grouped-query attention with 2 key/value heads for 4 heads, no biases, an untied output layer.
- MPT-style, as the released MPT-7B checkpoint has it: ALiBi and no position table, no biases
  (LayerNorm without β), exact GELU, the output layer tied to the token embedding, one packed
  ``c_attn`` (MPT's ``Wqkv``).

Bounds: the GPT's, for the same reasons (test_deepspeed_parity.py's docstring; measured worst
cases at N = 2 and 3 in brackets). fp32 losses to ``FP32_LOSS_RTOL`` [2.0e-7]. Weights after 5
steps to ``GPT_ATOL`` = 1e-5: Adam's m/√v divides each element's rounding by that element's own
gradient [6.0e-7 for every weight but one; 5.4e-6 for one element of blocks.1.mlp.c_proj.weight
in s1_mpt_adamw_gas2 at N = 3, whose first gradient is the smallest of its matrix, 1.4e-7 against
a median of 9e-3: a sum that nearly cancels, so its rounding is a part in 1e2 of it]; still far
below one lr-sized step (2e-3). bf16 (SGD, stage 2): ``BF16_LOSS_RTOL`` [6.6e-3] and
``BF16_ATOL`` [2.3e-4]; the gradient norms to 1e-5 relative in fp32 [2.2e-7], 1e-2 in bf16
[9.9e-4].

What no loss can see (unseen.py's list, gone through for these models): nothing that the
optimizer moves by rounding alone. The key bias, the one GPT weight whose every element has a
zero gradient, does not exist here (no biases); rotary positions and ALiBi's slopes are buffers,
not parameters. The directions that remain unseen are sums of elements that each have a gradient
of their own, where Adam's step is a function of those gradients and rounding stays rounding:
a vector added to every row of lm_head (softmax ignores a number added to every logit); for the
MPT-style model, whose residual stream is read only through LayerNorms, a number added to every
feature: to each row of wte (tied, so also a number added to each row of lm_head: seen through
1·ln_f(x) = Σγ_f·x̂, which is 0 only while γ_f = 1, at the first step) and a vector added to
every row of attn.c_proj and mlp.c_proj; and the rescalings (RMSNorm's or LayerNorm's γ against
the next matrix's columns, SwiGLU's up_proj against down_proj, a head's queries against its
keys). RMSNorm does not subtract the mean, so the Llama-style residual stream has no such
direction. So every weight is compared whole (``unseen_part`` returns None for every key).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

deepspeed = pytest.importorskip("deepspeed", reason="the peer tests need DeepSpeed (test extra)")

from cases import make_case  # noqa: E402
from runner import deepspeed_step, zerosim_step  # noqa: E402
from test_deepspeed_parity import (  # noqa: E402
    BF16_ATOL,
    BF16_LOSS_RTOL,
    FP32_LOSS_RTOL,
    GPT_ATOL,
)
from unseen import unseen_part  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

LLAMA = {
    "kind": "transformer",
    "description": {
        "name": "llama-style",
        "layers": 2,
        "hidden": 16,
        "heads": 4,
        "kv_heads": 2,
        "vocab": 11,
        "seq": 8,
        "mlp": "swiglu",
        "mlp_hidden": 24,
        "norm": "rmsnorm",
        "norm_eps": 1e-5,
        "bias": False,
        "positions": "rotary",
        "rotary_base": 500000.0,
        "tied": False,
    },
}
MPT = {
    "kind": "transformer",
    "description": {
        "name": "mpt-style",
        "layers": 2,
        "hidden": 16,
        "heads": 4,
        "vocab": 11,
        "seq": 8,
        "mlp": "gelu",
        "gelu_approximate": "none",
        "norm": "layernorm",
        "bias": False,
        "positions": "alibi",
        "tied": True,
    },
}
ADAMW = {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.05, "torch_adam": True}}
SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}


def _case(name, stage, model, optimizer=ADAMW, zero=None, **top):
    return make_case(name, stage, model, optimizer, 5, zero, **top)


def cases() -> list[dict]:
    """Each model at stages 1, 2 and 3 in fp32 with AdamW and DeepSpeed's default clipping
    (accumulation 2 once per model), and the Llama-style one in bf16 at stage 2 (at stage 3 it
    would double the case's time: DeepSpeed's stage 3 gathers module by module)."""
    return [
        _case("s1_llama_adamw", 1, LLAMA),
        _case("s2_llama_adamw_gas2", 2, LLAMA, gradient_accumulation_steps=2),
        _case("s3_llama_adamw", 3, LLAMA),
        _case("s1_mpt_adamw_gas2", 1, MPT, gradient_accumulation_steps=2),
        _case("s2_mpt_adamw", 2, MPT),
        _case("s3_mpt_adamw", 3, MPT),
        _case("s2_llama_sgd_bf16", 2, LLAMA, optimizer=SGD, bf16={"enabled": True}),
    ]


def bounds(name: str) -> tuple[float, float]:
    """(loss rtol, weight atol) of a case (module docstring)."""
    if "bf16" in name:
        return BF16_LOSS_RTOL, BF16_ATOL
    return FP32_LOSS_RTOL, GPT_ATOL


@pytest.fixture
def runs(peer_runs):
    """(N, {case name: results}) of this module's cases (conftest.py's ``peer_runs``: one
    launch per side and world size for every peer module)."""
    n, results = peer_runs
    return n, results[__name__]


def _case_named(name: str) -> dict:
    return next(c for c in cases() if c["name"] == name)


@pytest.mark.parametrize("name", [c["name"] for c in cases()])
def test_losses_and_weights_equal_deepspeeds(runs, name):
    n, results = runs
    ds, zs = results[name]["ds"], results[name]["zs"]
    rtol, atol = bounds(name)
    for r in range(n):
        want, got = np.array(ds["ranks"][r]["losses"]), np.array(zs["ranks"][r]["losses"])
        assert want.shape == got.shape == (5 * _gas(name),)
        np.testing.assert_allclose(got, want, rtol=rtol, err_msg=f"rank {r}")
    assert sorted(ds["weights"]) == sorted(zs["weights"])
    for key, want in ds["weights"].items():
        assert unseen_part(_case_named(name), key, want) is None  # module docstring
        np.testing.assert_allclose(zs["weights"][key], want, rtol=0, atol=atol, err_msg=key)


def _gas(name: str) -> int:
    return int(_case_named(name)["config"].get("gradient_accumulation_steps", 1))


@pytest.mark.parametrize("name", [c["name"] for c in cases()])
def test_reported_gradient_norms_equal_deepspeeds(runs, name):
    n, results = runs
    ds, zs = results[name]["ds"], results[name]["zs"]
    rtol = 1e-2 if "bf16" in name else 1e-5
    for r in range(n):
        want, got = ds["ranks"][r]["norms"], zs["ranks"][r]["norms"]
        assert len(want) == len(got) == 5
        for k, (w, g) in enumerate(zip(want, got, strict=True)):
            assert w is not None and math.isfinite(w), (r, k, w)
            assert g == pytest.approx(w, rel=rtol), (r, k, g, w)


@pytest.mark.parametrize("name", [c["name"] for c in cases()])
def test_each_steps_collectives_equal_deepspeeds(runs, name):
    """On every rank, every optimizer step's collectives by kind, calls and message size (stage
    3's broadcasts left out, as test_deepspeed_collectives.py says why)."""
    n, results = runs
    stage = _case_named(name)["config"]["zero_optimization"]["stage"]
    ds, zs = results[name]["ds"], results[name]["zs"]
    for r in range(n):
        want = [deepspeed_step(s, stage) for s in ds["ranks"][r]["steps"]]
        got = [zerosim_step(s, n) for s in zs["ranks"][r]["steps"]]
        assert len(got) == len(want) == 5
        for k in range(5):
            assert got[k] == want[k], f"rank {r}, step {k}"


def test_the_models_are_the_families_parts():
    """The Llama-style model has grouped-query attention with rotary positions, SwiGLU and
    RMSNorm and no bias; the MPT-style one ALiBi, no position table, no bias and a tied output
    layer: what the cases claim to compare."""
    from cases import model_of

    llama = model_of(_case_named("s1_llama_adamw"))
    names = dict(llama.named_parameters())
    assert names["blocks.0.attn.k_proj.weight"].shape == (8, 16)  # 2 of 4 heads' keys
    assert "blocks.0.mlp.gate_proj.weight" in names and "lm_head.weight" in names
    assert not any(k.endswith(".bias") or k.startswith("wpe") for k in names)
    mpt = model_of(_case_named("s2_mpt_adamw"))
    names = dict(mpt.named_parameters())
    assert "blocks.0.attn.c_attn.weight" in names and "lm_head.weight" not in names  # tied
    assert not any(k.endswith(".bias") or k.startswith("wpe") for k in names)
    assert mpt.blocks[0].attn.alibi_slopes is not None


def test_a_case_may_name_a_preset_or_state_the_fields():
    """The case JSON's description: a preset name or the fields, refused by name when wrong."""
    from cases import description_of

    import zerosim as zs

    spec = {"kind": "transformer", "description": "llama3-8b-tiny"}
    assert description_of(spec) == zs.nn.PRESETS["llama3-8b"].tiny()
    fields = description_of(LLAMA).to_dict()
    assert description_of({"kind": "transformer", "description": fields}) == description_of(LLAMA)
    with pytest.raises(ValueError, match=r"unknown keys \['kv_head'\]"):
        description_of({"kind": "transformer", "description": {**fields, "kv_head": 2}})
