"""The demo workloads: the models and data that ``zerosim train``, ``compare``, the notebooks and
the benchmarks train, built the same way (same seed) on every rank: ``gpt``, ``mlp``, or the
``Transformer`` of a model description (a preset such as ``llama3-8b-tiny``, or a JSON/hjson
file) on the shipped corpus."""

from __future__ import annotations

from typing import Any

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
    samples. Any other ``model`` is a description (``zerosim.nn.describe``): its Transformer on
    the corpus in windows of its sequence length, which needs a vocabulary that holds the
    corpus's characters.
    """
    if model == "gpt":
        data = CharDataset(block_size=block_size)
        return GPT(data.vocab_size, block_size, n_layer, n_head, n_embd, seed=seed), data
    if model == "mlp":
        return MLP([32, 256, 256, 10], seed=seed), make_classification(4096, 32, 10, seed=seed)
    desc = describe(model)  # ValueError naming the presets when it is neither
    data = CharDataset(block_size=desc.seq)
    if desc.vocab < data.vocab_size:
        raise ValueError(
            f"model {model!r} has vocab {desc.vocab}; the corpus needs at least {data.vocab_size}"
        )
    return Transformer(desc, seed=seed), data
