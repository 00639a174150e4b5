"""ModelDescription and its presets: the closed-form parameter count against the published totals
and against the built models; Transformer(desc) against its torch twin; GPT is GPT-2's
description; descriptions read from files, bad ones refused by name."""

import json

import numpy as np
import pytest
import torch
from torch_twins import TorchTransformer

import zerosim.nn as nn
from zerosim import meta
from zerosim.backend import shape_only_init
from zerosim.nn.gradcheck import relative_error

# The published totals, each from its own source (not from zerosim):
PUBLISHED = {
    # the parameter counts of Meta's Hugging Face checkpoints (model pages, safetensors totals)
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
    # llm-foundry scripts/train/benchmarking/README.md, NumParams at SeqLen 2048
    "mpt-125m": 125_311_488,
    "mpt-350m": 355_985_408,
    "mpt-760m": 760_470_528,
    "mpt-1b": 1_315_950_592,
    "mpt-3b": 2_651_837_440,
    "mpt-7b": 6_658_859_008,
    "mpt-13b": 12_853_954_560,
    "mpt-30b": 29_975_214_080,
    "mpt-70b": 64_862_437_376,
    # bigscience/bloom's model card
    "bloom-176b": 176_247_271_424,
}
BLOOMBERGGPT_BILLIONS = 50.6  # Wu et al. 2023: "50.6B parameters" (printed to 0.1B)


def llama_count(layers, hidden, heads, kv_heads, mlp, vocab):
    """Per layer q and o h², k and v h·(h/heads·kv_heads), three h·F matrices, two RMSNorms h;
    the final RMSNorm h; embedding and untied output layer V·h each."""
    kv_width = hidden // heads * kv_heads
    per_layer = 2 * hidden**2 + 2 * hidden * kv_width + 3 * hidden * mlp + 2 * hidden
    return layers * per_layer + hidden + 2 * vocab * hidden


def test_the_llama_shapes_give_the_published_totals():
    """An independent derivation from the config.json numbers (not ModelDescription's)."""
    assert llama_count(32, 4096, 32, 32, 11008, 32000) == PUBLISHED["llama2-7b"]
    assert llama_count(40, 5120, 40, 40, 13824, 32000) == PUBLISHED["llama2-13b"]
    assert llama_count(80, 8192, 64, 8, 28672, 32000) == PUBLISHED["llama2-70b"]
    assert llama_count(32, 4096, 32, 8, 14336, 128256) == PUBLISHED["llama3-8b"]
    assert llama_count(80, 8192, 64, 8, 28672, 128256) == PUBLISHED["llama3-70b"]
    assert llama_count(126, 16384, 128, 8, 53248, 128256) == PUBLISHED["llama3-405b"]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_every_preset_counts_its_published_total(name):
    assert nn.PRESETS[name].num_parameters() == PUBLISHED[name]


def test_bloomberggpt_counts_its_published_50_6_billion():
    desc = nn.PRESETS["bloomberggpt"]
    assert (desc.layers, desc.heads, desc.hidden, desc.vocab) == (70, 40, 7680, 131072)
    assert round(desc.num_parameters() / 1e8) / 10 == BLOOMBERGGPT_BILLIONS


def test_the_presets_state_their_families_parts():
    llama3 = nn.PRESETS["llama3-8b"]
    assert (llama3.mlp, llama3.norm, llama3.positions, llama3.bias, llama3.tied) == (
        "swiglu",
        "rmsnorm",
        "rotary",
        False,
        False,
    )
    assert llama3.rotary_base == 500000 and nn.PRESETS["llama2-7b"].rotary_base == 10000
    assert nn.PRESETS["llama2-70b"].kv_heads == 8 and nn.PRESETS["llama2-7b"].kv_heads == 32
    bloom = nn.PRESETS["bloom-176b"]
    assert bloom.positions == "alibi" and bloom.embedding_norm and bloom.tied
    assert {nn.PRESETS[f"mpt-{s}"].vocab for s in ("125m", "7b", "70b")} == {50368}


@pytest.mark.parametrize("name", sorted(nn.PRESETS))
def test_every_tiny_variant_builds_to_its_closed_form_count(name):
    desc = nn.describe(f"{name}-tiny")
    model = nn.Transformer(desc)
    assert model.num_parameters() == desc.num_parameters()
    assert sum(p.numel for _, p in model.named_parameters()) == desc.num_parameters()
    built = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert built == desc.parameter_shapes()  # the shapes every count is read from
    parent = nn.PRESETS[name]
    assert (desc.mlp, desc.norm, desc.positions, desc.bias, desc.tied) == (
        parent.mlp,
        parent.norm,
        parent.positions,
        parent.bias,
        parent.tied,
    )


@pytest.mark.parametrize("name", ["llama3-8b", "llama2-70b", "mpt-7b", "bloom-176b"])
def test_presets_build_shape_only_to_the_published_count(name):
    with meta.tracking(), shape_only_init():
        model = nn.Transformer(name)
    assert model.num_parameters() == PUBLISHED[name]
    built = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert built == nn.PRESETS[name].parameter_shapes()
    if nn.PRESETS[name].positions != "learned":
        assert not any(n.startswith("wpe") for n, _ in model.named_parameters())


@pytest.mark.parametrize("name", ["llama3-8b", "llama2-70b", "mpt-7b", "bloom-176b"])
def test_matmul_parameters_are_the_blocks_matrices_and_the_output_layer(name):
    """N_matmul from the published shapes: Llama per layer q, o h², k, v h·(h/heads·kv_heads),
    three h·F; MPT and BLOOM 4h² of attention and 8h² of a 4h MLP; all + V·h, tied or not."""
    d = nn.PRESETS[name]
    h = d.hidden
    if d.mlp == "swiglu":
        kv = h // d.heads * d.kv_heads
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * d.mlp_hidden
    else:
        per_layer = 12 * h * h
    assert d.matmul_parameters() == d.layers * per_layer + d.vocab * h


# --- the model against torch ------------------------------------------------------------------

FAMILIES = {
    "llama (GQA, RoPE)": nn.ModelDescription(
        3, 24, 6, 29, 9, kv_heads=2, mlp="swiglu", mlp_hidden=37, norm="rmsnorm",
        bias=False, positions="rotary", rotary_base=500000.0,
    ),
    "llama multi-query": nn.ModelDescription(
        2, 16, 4, 23, 7, kv_heads=1, mlp="swiglu", mlp_hidden=20, norm="rmsnorm",
        norm_eps=1e-6, bias=False, positions="rotary",
    ),
    "mpt (learned, tied)": nn.ModelDescription(
        2, 12, 3, 31, 8, mlp="gelu", bias=True, positions="learned", tied=True
    ),
    "mpt alibi no bias": nn.ModelDescription(
        2, 12, 3, 31, 8, mlp="gelu", bias=False, positions="alibi", tied=True
    ),
    "bloom": nn.ModelDescription(
        2, 20, 5, 17, 9, gelu_approximate="tanh", positions="alibi", tied=True,
        embedding_norm=True,
    ),
    "alibi with GQA": nn.ModelDescription(
        2, 12, 6, 19, 6, kv_heads=3, positions="alibi", bias=False
    ),
}  # fmt: skip


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_transformer_loss_and_every_gradient_match_its_torch_twin(family, dtype):
    desc = FAMILIES[family]
    model = nn.Transformer(desc, seed=1, dtype=dtype)
    for name, p in model.named_parameters():  # norms away from 1, biases away from 0
        if name.split(".")[-2].startswith("ln_"):
            p.data[...] += 0.2 * np.random.default_rng(p.numel).standard_normal(p.shape)
    twin = TorchTransformer(desc).to({"float64": torch.float64, "float32": torch.float32}[dtype])
    twin.load_state_dict({k: torch.tensor(np.asarray(v)) for k, v in model.state_dict().items()})
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in twin.named_parameters()]
    rng = np.random.default_rng(0)
    t = desc.seq - 1
    idx, targets = rng.integers(0, desc.vocab, (3, t)), rng.integers(0, desc.vocab, (3, t))
    targets[0, 0] = -1
    loss = model(idx, targets)
    model.backward()
    tloss = twin(torch.tensor(idx), torch.tensor(targets))
    tloss.backward()
    tol = {"float64": 1e-10, "float32": 2e-5}[dtype]
    if desc.positions == "rotary" and dtype == "float64":
        tol = 1e-6  # zerosim's rotary tables are float32, the twin's float64
    assert relative_error(loss, tloss.item()) <= tol
    tparams = dict(twin.named_parameters())
    for name, p in model.named_parameters():
        assert relative_error(p.grad, tparams[name].grad.numpy()) <= tol, name


def test_gpt_is_the_transformer_of_gpt2_s_description():
    gpt = nn.GPT(13, 8, 2, 2, 8, bias=False, tie_weights=True, seed=3)
    desc = nn.GPT.description(13, 8, 2, 2, 8, bias=False, tie_weights=True)
    same = nn.Transformer(desc, seed=3)
    assert isinstance(gpt, nn.Transformer) and gpt.desc == desc
    assert (desc.mlp, desc.norm, desc.positions, desc.gelu_approximate) == (
        "gelu",
        "layernorm",
        "learned",
        "tanh",
    )
    a, b = gpt.state_dict(), same.state_dict()
    assert list(a) == list(b) and all(np.array_equal(a[k], b[k]) for k in a)
    assert gpt.num_parameters() == desc.num_parameters()


# --- files and bad input ------------------------------------------------------------------------


def test_a_description_file_round_trips_and_hjson_reads(tmp_path):
    desc = nn.PRESETS["llama3-8b"].tiny()
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(desc.to_dict()))
    assert nn.describe(str(path)) == desc
    hjson_path = tmp_path / "small.hjson"
    hjson_path.write_text(
        "{\n  # a Llama-style model\n  layers: 2\n  hidden: 32\n  heads: 4\n  kv_heads: 2\n"
        "  vocab: 70\n  seq: 16\n  mlp: swiglu\n  mlp_hidden: 48\n  norm: rmsnorm\n"
        "  bias: false\n  positions: rotary\n  rotary_base: 500000\n}\n"
    )
    small = nn.describe(hjson_path)
    assert small.name == "small" and small.kv_heads == 2 and small.rotary_base == 500000
    assert nn.Transformer(str(hjson_path)).num_parameters() == small.num_parameters()


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"kv_heads": 3}, "kv_heads must divide heads=4; got kv_heads=3"),
        ({"mlp": "relu"}, r"mlp must be one of \('gelu', 'swiglu'\); got 'relu'"),
        ({"mlp": "swiglu"}, "mlp='swiglu' needs mlp_hidden"),
        ({"positions": "sinusoidal"}, "positions must be one of"),
        ({"hidden": 30}, "hidden must be a multiple of heads; got hidden=30, heads=4"),
        ({"layers": 0}, "layers must be a positive int; got 0"),
        ({"window": 8}, r"unknown keys \['window'\]; allowed: \['layers'"),
        ({"bias": "no"}, "bias must be true or false; got 'no'"),
    ],
)
def test_bad_descriptions_are_refused_naming_the_field_and_what_is_allowed(fields, message):
    data = {"layers": 2, "hidden": 32, "heads": 4, "vocab": 50, "seq": 16, **fields}
    with pytest.raises(ValueError, match=message):
        nn.ModelDescription.from_dict(data)


def test_an_unknown_model_name_lists_the_presets(tmp_path):
    with pytest.raises(ValueError, match=r"neither a preset nor .*'llama3-8b'.*NAME-tiny"):
        nn.describe("llama9-1t")
    path = tmp_path / "twice.json"
    path.write_text('{"layers": 2, "layers": 3}')
    with pytest.raises(ValueError, match=r"repeated keys \['layers'\]"):
        nn.describe(path)
