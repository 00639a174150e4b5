"""The demo workloads: the models and data that ``zerosim train``, ``compare``, the notebooks and
the benchmarks train, built the same way (same seed) on every rank: ``gpt``, ``mlp``, or the
``Transformer`` of a model description (a preset such as ``llama3-8b-tiny``, or a JSON/hjson
file) on the shipped corpus."""

from __future__ import annotations

from typing import Any

from zerosim.analysis.presets import PRESETS as GPT_PRESETS
from zerosim.analysis.presets import gpt_shape
from zerosim.data import CharDataset, make_classification
from zerosim.nn import GPT, MLP, Transformer, describe

MODELS = ("gpt", "mlp")


def build(
    model: str,
    *,
    seed: int = 0,
    block_size: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_embd: int = 64,
) -> tuple[Any, Any]:
    """(model, dataset): a character-level GPT on the shipped corpus, or an MLP classifier.

    ``block_size`` … ``n_embd`` shape the GPT; the MLP is [32, 256, 256, 10] on 4,096 synthetic
    samples. A GPT preset (``gpt3-125m`` …) or ``gpt:LAYERS,HIDDEN,VOCAB,SEQ[,HEADS]`` is the GPT
    of that shape (as ``zerosim dryrun`` builds it). Any other ``model`` is a description
    (``zerosim.nn.describe``): its Transformer. Both train on the corpus in windows of their
    sequence length, which needs a vocabulary that holds the corpus's characters.
    """
    if model == "gpt":
        data = CharDataset(block_size=block_size)
        return GPT(data.vocab_size, block_size, n_layer, n_head, n_embd, seed=seed), data
    if model == "mlp":
        return MLP([32, 256, 256, 10], seed=seed), make_classification(4096, 32, 10, seed=seed)
    if model in GPT_PRESETS or model.startswith("gpt:"):
        s = gpt_shape(model)  # ValueError naming the forms when the spec is malformed
        data = _corpus(model, s.vocab, s.seq)
        return GPT(s.vocab, s.seq, s.layers, s.heads, s.hidden, seed=seed, tie_weights=s.tied), data
    desc = describe(model)  # ValueError naming the presets when it is neither
    return Transformer(desc, seed=seed), _corpus(model, desc.vocab, desc.seq)


def _corpus(model: str, vocab: int, seq: int) -> CharDataset:
    """The shipped corpus in windows of ``seq``; refused when ``vocab`` cannot hold it."""
    data = CharDataset(block_size=seq)
    if vocab < data.vocab_size:
        raise ValueError(
            f"model {model!r} has vocab {vocab}; the corpus needs at least {data.vocab_size}"
        )
    return data
