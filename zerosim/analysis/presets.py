"""Model shapes with published sizes, for the dry run (``zerosim dryrun --model``).

The GPT-3 family (Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1) and the
529.6B GPT of Narayanan et al. (SC21, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", Table 1, and Table 2 of §5.2's ZeRO-3 comparison), all with sequence
2048 and the vocabulary of 51,200 tokens that Narayanan et al. use (§5.1, a multiple of 1,024:
GPT-3's 50,257 padded), and the input embedding tied to the output layer, as both papers count
them. Their parameter count (Narayanan et al., eq. 2, biases and LayerNorms included):

    P = 12·l·h² · (1 + 13/(12·h) + (V + s)/(12·l·h))

gives 174.6B for GPT-3 175B and 529.6B for the SC21 model; ``zerosim.nn.GPT`` built from a preset
has P + 2h parameters (its final LayerNorm, which the formula leaves out).

Two shapes of Table 2.1 cannot be built as printed: GPT-3 XL's 24 heads of 128 do not make its
d_model of 2048 (16 heads of 128 do), and GPT-3 13B's d_model of 5140 is not a multiple of its 40
heads (5120 = 40·128 is, as in every reimplementation). The presets use 16 heads and 5120.

``gpt:LAYERS,HIDDEN,VOCAB,SEQ[,HEADS]`` is the model of ``zerosim project --model`` (untied
output layer, ``report.tables.gpt_params``), with HIDDEN/128 heads (1 when HIDDEN is not a
multiple of 128) unless given; ``gpt`` and ``mlp`` are the small models ``zerosim train --model``
trains (``report.workloads``).
"""

from __future__ import annotations

from dataclasses import dataclass

SEQUENCE = 2048
VOCABULARY = 51200


@dataclass(frozen=True)
class GPTShape:
    """A GPT's shape: layers l, hidden size h, heads, vocabulary V, sequence s; ``tied``: the
    output layer is the input embedding."""

    layers: int
    hidden: int
    heads: int
    vocab: int = VOCABULARY
    seq: int = SEQUENCE
    tied: bool = True

    def formula_params(self) -> float:
        """Narayanan et al.'s P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h)) (no final LayerNorm,
        one embedding matrix)."""
        layers, h = self.layers, self.hidden
        return (
            12 * layers * h * h * (1 + 13 / (12 * h) + (self.vocab + self.seq) / (12 * layers * h))
        )


# name → shape; the published total in the comment
PRESETS: dict[str, GPTShape] = {
    "gpt3-125m": GPTShape(12, 768, 12),  # 125M
    "gpt3-350m": GPTShape(24, 1024, 16),  # 350M
    "gpt3-760m": GPTShape(24, 1536, 16),  # 760M
    "gpt3-1.3b": GPTShape(24, 2048, 16),  # 1.3B (Table 2.1: 24 heads of 128, see above)
    "gpt3-2.7b": GPTShape(32, 2560, 32),  # 2.7B
    "gpt3-6.7b": GPTShape(32, 4096, 32),  # 6.7B
    "gpt3-13b": GPTShape(40, 5120, 40),  # 13B (Table 2.1: d_model 5140, see above)
    "gpt3-175b": GPTShape(96, 12288, 96),  # 175B; 174.6B in Narayanan et al.
    "gpt-529b": GPTShape(105, 20480, 128),  # 529.6B, Narayanan et al. SC21
}
# The published parameter counts these shapes must reproduce (Narayanan et al., Tables 1 and 2).
PUBLISHED_PARAMS = {"gpt3-175b": 174.6e9, "gpt-529b": 529.6e9}


def parse_gpt(spec: str) -> GPTShape:
    """``gpt:LAYERS,HIDDEN,VOCAB,SEQ[,HEADS]`` → its shape (untied, as ``zerosim project``)."""
    parts = spec[len("gpt:") :].split(",") if spec.startswith("gpt:") else []
    if len(parts) not in (4, 5) or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(
            f"--model {spec!r} is not gpt:LAYERS,HIDDEN,VOCAB,SEQ[,HEADS] with positive integers"
        )
    layers, hidden, vocab, seq, *heads = (int(p) for p in parts)
    n_head = heads[0] if heads else (hidden // 128 if hidden % 128 == 0 else 1)
    if hidden % n_head:
        raise ValueError(f"--model {spec!r}: HIDDEN={hidden} is not a multiple of HEADS={n_head}")
    return GPTShape(layers, hidden, n_head, vocab, seq, tied=False)


def gpt_shape(spec: str) -> GPTShape:
    """A preset name or a ``gpt:…`` spec → its shape; ValueError naming what is allowed."""
    if spec in PRESETS:
        return PRESETS[spec]
    if spec.startswith("gpt:"):
        return parse_gpt(spec)
    raise ValueError(
        f"--model {spec!r} is not a model; allowed: {sorted(PRESETS)}, 'gpt', 'mlp' or "
        "gpt:LAYERS,HIDDEN,VOCAB,SEQ[,HEADS]"
    )


def narayanan_flops(
    batch: int, seq: int, layers: int, hidden: int, vocab: int, recompute: bool = False
) -> float:
    """Model FLOPs of one step of ``batch`` sequences (Narayanan et al. SC21, §5.1, eq. 3):

        with recomputation of every block   96·B·s·l·h² · (1 + s/(6h) + V/(16·l·h))
        without                             72·B·s·l·h² · (1 + s/(6h) + V/(12·l·h))

    (matrix products only: forward 24·B·s·h² + 4·B·s²·h per layer and 2·B·s·h·V for the logits,
    backward twice the forward, recomputation one more forward of the layers).
    """
    b, s, l_, h, v = batch, seq, layers, hidden, vocab
    if recompute:
        return 96 * b * s * l_ * h * h * (1 + s / (6 * h) + v / (16 * l_ * h))
    return 72 * b * s * l_ * h * h * (1 + s / (6 * h) + v / (12 * l_ * h))
