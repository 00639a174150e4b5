"""Model descriptions at published shapes: Llama 2 and 3, MPT, BLOOM and BloombergGPT.

Each preset's numbers are those of the source named in its ``source``; tests hold each preset's
closed-form parameter count (``ModelDescription.num_parameters``) to the published total.

- **Llama 2** 7B, 13B, 70B (Touvron et al. 2023) and **Llama 3** 8B, 70B and Llama 3.1 405B
  (Grattafiori et al. 2024, Table 3): the ``config.json`` of Meta's Hugging Face checkpoints
  (``hidden_size``, ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``,
  ``num_hidden_layers``, ``vocab_size``, ``rms_norm_eps``, ``rope_theta``; no biases, untied
  output layer). Sequence: Llama 2's 4,096; Llama 3's 8,192 (Llama 3.1 trains at 8,192 before
  its long-context stage; its RoPE frequency rescaling changes values, not shapes, and is not
  modelled). Totals: the checkpoints' parameter counts.
- **MPT** 125M … 70B: llm-foundry's ``scripts/train/yamls/pretrain/mpt-*.yaml`` (``d_model``,
  ``n_heads``, ``n_layers``, ``expansion_ratio: 4``, ``vocab_size: 50368``, ``max_seq_len:
  2048``). The yamls set no ``alibi`` and no ``no_bias``, so MPTConfig's defaults hold: learned
  positions, biases, LayerNorm ε = 1e-5, exact GELU, output layer tied to the embedding.
  Totals: the ``NumParams`` column at sequence 2048 of llm-foundry's
  ``scripts/train/benchmarking/README.md``.
- **BLOOM** 176B (BigScience 2022; ``bigscience/bloom``'s ``config.json``: 70 layers, 112 heads,
  hidden 14336, vocabulary 250,880): ALiBi, biases, LayerNorm also after the embedding, tanh
  GELU, tied; 176,247,271,424 parameters (its model card).
- **BloombergGPT** (Wu et al. 2023, arXiv:2303.17564, §3 and Table 4): BLOOM's architecture at 70
  layers, 40 heads, hidden 7680, vocabulary 131,072, sequence 2048; 50.6B parameters.
"""

from __future__ import annotations

from pathlib import Path

from zerosim.nn.description import ModelDescription

_HF = "Hugging Face config.json of"


def _llama(name: str, layers: int, hidden: int, heads: int, kv: int, mlp: int, **kw) -> tuple:
    return name, ModelDescription(
        layers,
        hidden,
        heads,
        kv_heads=kv,
        mlp="swiglu",
        mlp_hidden=mlp,
        norm="rmsnorm",
        norm_eps=1e-5,
        bias=False,
        positions="rotary",
        tied=False,
        name=name,
        **kw,
    )


def _llama2(name: str, *shape: int, repo: str) -> tuple:
    source = f"{_HF} meta-llama/{repo}"
    return _llama(name, *shape, vocab=32000, seq=4096, rotary_base=10000.0, source=source)


def _llama3(name: str, *shape: int, repo: str) -> tuple:
    source = f"{_HF} meta-llama/{repo}"
    return _llama(name, *shape, vocab=128256, seq=8192, rotary_base=500000.0, source=source)


def _mpt(size: str, d_model: int, n_heads: int, n_layers: int) -> tuple:
    name = f"mpt-{size}"
    return name, ModelDescription(
        n_layers,
        d_model,
        n_heads,
        vocab=50368,
        seq=2048,
        mlp="gelu",
        mlp_hidden=4 * d_model,
        norm="layernorm",
        bias=True,
        positions="learned",
        tied=True,
        name=name,
        source=f"llm-foundry scripts/train/yamls/pretrain/{name}.yaml",
    )


def _bloom(name: str, layers: int, hidden: int, heads: int, vocab: int, source: str) -> tuple:
    return name, ModelDescription(
        layers,
        hidden,
        heads,
        vocab=vocab,
        seq=2048,
        mlp="gelu",
        gelu_approximate="tanh",
        norm="layernorm",
        bias=True,
        positions="alibi",
        tied=True,
        embedding_norm=True,
        name=name,
        source=source,
    )


# layers, hidden, heads, kv heads, MLP width
PRESETS: dict[str, ModelDescription] = dict(
    [
        _llama2("llama2-7b", 32, 4096, 32, 32, 11008, repo="Llama-2-7b-hf"),
        _llama2("llama2-13b", 40, 5120, 40, 40, 13824, repo="Llama-2-13b-hf"),
        _llama2("llama2-70b", 80, 8192, 64, 8, 28672, repo="Llama-2-70b-hf"),
        _llama3("llama3-8b", 32, 4096, 32, 8, 14336, repo="Meta-Llama-3-8B"),
        _llama3("llama3-70b", 80, 8192, 64, 8, 28672, repo="Meta-Llama-3-70B"),
        _llama3("llama3-405b", 126, 16384, 128, 8, 53248, repo="Llama-3.1-405B"),
        # d_model, n_heads, n_layers as the yamls give them
        _mpt("125m", 768, 12, 12),
        _mpt("350m", 1024, 16, 24),
        _mpt("760m", 1536, 12, 24),
        _mpt("1b", 2048, 16, 24),
        _mpt("3b", 2560, 20, 32),
        _mpt("7b", 4096, 32, 32),
        _mpt("13b", 5120, 40, 40),
        _mpt("30b", 7168, 56, 48),
        _mpt("70b", 8192, 64, 80),
        _bloom("bloom-176b", 70, 14336, 112, 250880, f"{_HF} bigscience/bloom"),
        _bloom("bloomberggpt", 70, 7680, 40, 131072, "Wu et al. 2023, BloombergGPT, Table 4"),
    ]
)


def describe(spec: str | Path | ModelDescription) -> ModelDescription:
    """A description from a preset name (``zerosim.nn.presets.PRESETS``, each with a ``-tiny``
    variant), a JSON/hjson file path, or a description (returned as it is)."""
    if isinstance(spec, ModelDescription):
        return spec
    name = str(spec)
    if name in PRESETS:
        return PRESETS[name]
    if name.endswith("-tiny") and name[: -len("-tiny")] in PRESETS:
        return PRESETS[name[: -len("-tiny")]].tiny()
    if Path(name).is_file():
        return ModelDescription.from_file(name)
    raise ValueError(
        f"model {name!r} is neither a preset nor a model-description file; presets: "
        f"{sorted(PRESETS)} (each also as NAME-tiny)"
    )
