"""Model presets: parameter counts from the published shapes, against the published figures."""

from __future__ import annotations

import pytest

from zerosim import meta
from zerosim.analysis.presets import PRESETS, PUBLISHED_PARAMS, gpt_shape, parse_gpt
from zerosim.backend import shape_only_init
from zerosim.dryrun import recipe
from zerosim.report.tables import gpt_params

# Brown et al. 2020, Table 2.1 (names and totals) and Narayanan et al. 2021 (the 529.6B model)
PUBLISHED = {
    "gpt3-125m": 125e6,
    "gpt3-350m": 350e6,
    "gpt3-760m": 760e6,
    "gpt3-1.3b": 1.3e9,
    "gpt3-2.7b": 2.7e9,
    "gpt3-6.7b": 6.7e9,
    "gpt3-13b": 13e9,
    "gpt3-175b": 175e9,
    "gpt-529b": 529.6e9,
}


def standard_count(layers: int, hidden: int, vocab: int, seq: int) -> int:
    """Per layer: attention 4h² + 4h, MLP 8h² + 5h, two LayerNorms 4h; embeddings (V + s)·h:
    12·l·h² + 13·l·h + (V + s)·h = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h))."""
    return 12 * layers * hidden**2 + 13 * layers * hidden + (vocab + seq) * hidden


@pytest.mark.parametrize("name", ["gpt3-175b", "gpt-529b"])
def test_the_large_presets_have_the_published_parameter_counts(name):
    s = PRESETS[name]
    count = standard_count(s.layers, s.hidden, s.vocab, s.seq)
    assert round(count / 1e8) / 10 == PUBLISHED_PARAMS[name] / 1e9  # 174.6, 529.6 (billions)
    assert s.formula_params() == pytest.approx(count, rel=1e-12)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_near_its_published_size_and_builds_to_the_formula(name):
    s = PRESETS[name]
    count = standard_count(s.layers, s.hidden, s.vocab, s.seq)
    # the family's totals are rounded names, counted with GPT-3's own vocabulary of 50,257
    assert count == pytest.approx(PUBLISHED[name], rel=0.03)
    with meta.tracking(), shape_only_init():
        model = recipe(name).build()
    assert model.num_parameters() == count + 2 * s.hidden  # + the final LayerNorm


def test_gpt3_175b_builds_shape_only_to_the_formula():
    s = PRESETS["gpt3-175b"]
    with meta.tracking() as t, shape_only_init():
        model = recipe("gpt3-175b").build()
    assert model.num_parameters() == standard_count(96, 12288, 51200, 2048) + 2 * 12288
    assert t.live["parameters"] > 4 * 174e9  # fp32, shape-only: counted, never held
    assert s.heads == 96 and s.seq == 2048


def test_the_project_form_is_the_project_model():
    s = parse_gpt("gpt:3,256,1000,128")
    assert (s.layers, s.hidden, s.vocab, s.seq, s.heads, s.tied) == (3, 256, 1000, 128, 2, False)
    with meta.tracking(), shape_only_init():
        model = recipe("gpt:3,256,1000,128").build()
    untied = standard_count(3, 256, 1000, 128) + 2 * 256 + 1000 * 256  # final LayerNorm, head
    assert model.num_parameters() == gpt_params(3, 256, 1000, 128) == untied
    assert parse_gpt("gpt:2,96,50,16,3").heads == 3
    assert parse_gpt("gpt:2,96,50,16").heads == 1


@pytest.mark.parametrize(
    "spec, message",
    [
        ("gpt:2,64,50", "LAYERS,HIDDEN,VOCAB,SEQ"),
        ("gpt:2,64,50,16,0", "positive integers"),
        ("gpt:2,64,50,16,5", "not a multiple of HEADS=5"),
        ("gpt3-999b", "allowed: .*gpt3-175b"),
    ],
)
def test_bad_model_names_are_refused_naming_what_is_allowed(spec, message):
    with pytest.raises(ValueError, match=message):
        gpt_shape(spec)


@pytest.mark.parametrize("name", ["gpt3-175b", "gpt-529b", "gpt3-1.3b"])
@pytest.mark.parametrize("recompute", [False, True])
def test_the_family_flop_count_of_a_gpt_is_narayanans_eq_3(name, recompute):
    """Per token, Narayanan et al.'s 72·l·h²·(1 + s/6h + V/12lh) (96·…·(1 + s/6h + V/16lh) with
    recomputation) for one sequence of s tokens, from the preset's shape alone."""
    from zerosim.analysis import transformer_flops_per_token
    from zerosim.nn import GPT

    s = PRESETS[name]
    layers, h, v, seq = s.layers, s.hidden, s.vocab, s.seq
    if recompute:
        want = 96 * seq * layers * h * h * (1 + seq / (6 * h) + v / (16 * layers * h))
    else:
        want = 72 * seq * layers * h * h * (1 + seq / (6 * h) + v / (12 * layers * h))
    desc = GPT.description(v, seq, layers, s.heads, h, tie_weights=True)
    got = transformer_flops_per_token(desc, recompute) * seq
    assert got == pytest.approx(want, rel=1e-12)
