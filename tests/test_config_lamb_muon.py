"""The Lamb and Muon config sections: accepted and refused as DeepSpeed 0.19.8 does (its own
verdicts are in tests/test_deepspeed_config.py's corpus), Muon's split into two param groups,
and the combinations zerosim does not build, each a ConfigError naming key, value and what is
allowed."""

from __future__ import annotations

import pytest

import zerosim as zs
from zerosim.config import load_config
from zerosim.config.optimizer import uses_muon
from zerosim.errors import ConfigError

BATCH = {"train_batch_size": 2}


def load(optimizer, **top):
    return load_config({**BATCH, "optimizer": optimizer, **top}, 1)


def test_muon_takes_the_matrices_without_embed_or_lm_head_in_their_name():
    assert uses_muon("blocks.0.mlp.c_fc.weight", (24, 6))
    assert uses_muon("wte.weight", (13, 6))  # DeepSpeed's test is on the name: "wte" passes
    assert not uses_muon("transformer.Embed_tokens.weight", (13, 6))  # any case
    assert not uses_muon("lm_head.weight", (13, 6))
    assert not uses_muon("blocks.0.mlp.c_fc.bias", (24,))


def test_a_muon_section_splits_the_model_into_a_muon_and_an_adam_group():
    params = {
        "lr": 0.01,
        "adam_lr": 1e-3,
        "momentum": 0.9,
        "ns_method": "standard",
        "betas": [0.8, 0.9],
        "eps": 1e-9,
        "weight_decay": 0.1,
        "adam_w_mode": False,
        "torch_adam": True,
    }
    section = load({"type": "muon", "params": params}).optimizer
    assert section.type == section.class_name == "Muon"
    model = zs.nn.GPT(11, 8, 1, 2, 16, seed=0)
    named = list(model.named_parameters())
    (muon, muon_hyper), (adam, adam_hyper) = section.param_groups(named)
    matrices = [(n, p.shape) for n, p in named if p.ndim == 2 and "lm_head" not in n]
    by_shape = sorted(matrices, key=lambda item: item[1], reverse=True)  # as DeepSpeed sorts
    assert [n for n, _ in muon] == [n for n, _ in by_shape]
    assert [n for n, _ in muon][:2] == ["blocks.0.mlp.c_fc.weight", "blocks.0.attn.c_attn.weight"]
    assert [n for n, _ in adam] == [n for n, p in named if p.ndim == 1 or "lm_head" in n]
    assert muon_hyper == {
        "use_muon": True,
        "lr": 0.01,
        "momentum": 0.9,
        "weight_decay": 0.1,
        "ns_method": "standard",
    }
    assert adam_hyper == {
        "use_muon": False,
        "lr": 1e-3,
        "betas": (0.8, 0.9),
        "eps": 1e-9,
        "weight_decay": 0.1,
        "adam_w_mode": False,
    }


def test_a_muon_section_builds_a_trainable_engine_with_its_two_groups():
    engine, opt, *_ = zs.initialize(
        zs.nn.MLP([4, 5, 3], seed=0),
        {**BATCH, "optimizer": {"type": "Muon", "params": {"muon_lr": 0.05}}},
        comm=zs.LocalWorld(1).comms()[0],
    )
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    assert [g["lr"] for g in opt.param_groups] == [0.05, 3e-4]  # Adam's default lr


def test_a_model_without_matrices_leaves_the_muon_group_out():
    section = load({"type": "Muon"}).optimizer
    bias = zs.nn.MLP([4, 3]).named_parameters()
    vectors = [(n, p) for n, p in bias if p.ndim == 1]
    assert [h["use_muon"] for _, h in section.param_groups(vectors)] == [False]


def test_a_lamb_section_passes_fusedlambs_arguments():
    params = {"lr": 0.1, "bias_correction": False, "max_coeff": 5.0, "amsgrad": False}
    section = load({"type": "LAMB", "params": params}).optimizer
    assert section.class_name == "Lamb"
    assert section.kwargs() == {"lr": 0.1, "bias_correction": False, "max_coeff": 5.0}


@pytest.mark.parametrize(
    ("optimizer", "top", "key"),
    [
        ({"type": "Lamb", "params": {"amsgrad": True}}, {}, "optimizer.params.amsgrad"),
        ({"type": "Lamb"}, {"fp16": {"enabled": True, "loss_scale": 64}}, "fp16.loss_scale"),
        ({"type": "Lamb"}, {"zero_optimization": {"stage": 1}}, "optimizer.type"),
        ({"type": "Muon", "params": {"ns_method": "newton"}}, {}, "optimizer.params.ns_method"),
        ({"type": "Muon", "params": {"foo": 1}}, {}, "optimizer.params.foo"),
        ({"type": "Muon", "params": {"per_head_muon": True}}, {}, "optimizer.params.per_head_muon"),
        ({"type": "Muon"}, {"zero_optimization": {"stage": 3}}, "zero_optimization.reduce_scatter"),
        (
            {"type": "Muon"},
            {
                "zero_optimization": {
                    "stage": 3,
                    "reduce_scatter": False,
                    "zero_quantized_gradients": True,
                }
            },
            "zero_optimization.zero_quantized_gradients",
        ),
        ({"type": "Muon"}, {"zerosim": {"schedule": "paper"}}, "zerosim.schedule"),
        (
            {"type": "Muon"},
            {"zero_optimization": {"stage": 1}, "zerosim": {"layout": "megatron"}},
            "zerosim.layout",
        ),
    ],
)
def test_refused_combinations_name_the_key(optimizer, top, key):
    with pytest.raises(ConfigError) as err:
        load(optimizer, **top)
    assert err.value.path == key
    assert err.value.allowed


@pytest.mark.parametrize(("stage", "device"), [(1, "cpu"), (2, "cpu"), (3, "cpu"), (3, "nvme")])
def test_muon_is_accepted_with_optimizer_offload_as_deepspeed_accepts_it(stage, device, tmp_path):
    zero = {
        "stage": stage,
        "offload_optimizer": {"device": device, "nvme_path": str(tmp_path)},
        **({"reduce_scatter": False} if stage == 3 else {}),
    }
    cfg = load({"type": "Muon"}, zero_optimization=zero)
    assert (cfg.optimizer.type, cfg.zero_optimization.offload_optimizer.device) == ("Muon", device)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("section", ["bf16", "fp16"])
def test_muon_is_accepted_in_16_bit_training_at_every_stage_as_deepspeed_accepts_it(section, stage):
    zero = {"stage": stage, **({"reduce_scatter": False} if stage == 3 else {})}
    cfg = load({"type": "Muon"}, **{section: {"enabled": True}}, zero_optimization=zero)
    assert (cfg.optimizer.type, cfg.mixed_precision) == ("Muon", section)


def test_lamb_at_a_zero_stage_needs_the_untested_optimizer_switch():
    cfg = load({"type": "Lamb"}, zero_optimization={"stage": 2}, zero_allow_untested_optimizer=True)
    assert cfg.optimizer.type == "Lamb"
    assert load({"type": "Muon"}, zero_optimization={"stage": 2}).optimizer.type == "Muon"


def test_save_muon_momentum_buffer_in_memory_is_read_at_either_value():
    for value in (True, False):
        zero = {"stage": 3, "reduce_scatter": False, "save_muon_momentum_buffer_in_memory": value}
        cfg = load({"type": "Muon"}, zero_optimization=zero)
        assert cfg.zero_optimization.save_muon_momentum_buffer_in_memory is value
