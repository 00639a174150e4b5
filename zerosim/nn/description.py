"""``ModelDescription``: every way the GPT, Llama, MPT and BLOOM families differ, in one record.

A decoder-only transformer is fixed by a few numbers and a few choices:

    layers l, hidden h, heads n, key/value heads n_kv, vocabulary V, sequence s,
    MLP: GELU (h → F → h) or SwiGLU (three h·F matrices),   norm: LayerNorm or RMSNorm (ε),
    bias or not,  positions: learned table | rotary (base) | ALiBi,  tied output layer or not,
    BLOOM's LayerNorm right after the token embedding, and how attention is computed: standard
    (the s × s probabilities kept for backward) or flash (recomputed, ``zerosim.nn.flash``).

``zerosim.nn.Transformer`` builds the model a description states, and ``num_parameters`` counts
it in closed form from the shapes alone (d = h/n, a = 1 with biases, else 0):

    attention  2h² + 2·h·n_kv·d  + a·(2h + 2·n_kv·d)      (q, o; k, v)
    MLP        GELU: 2hF + a·(F + h)       SwiGLU: 3hF + a·(2F + h)
    norm       LayerNorm: h + a·h          RMSNorm: h
    Ψ = l·(attention + MLP + 2·norm) + norm  (final)  + V·h  (+ s·h learned positions)
        (+ norm after the embedding)  (+ V·h untied output layer)

GPT-2/3 (biases, 4h GELU, LayerNorm, learned positions): attention + MLP + 2 norms = 12h² + 13h,
Narayanan et al.'s count. ``parameter_shapes`` lists every parameter's name and shape as
``Transformer`` creates them (a tied weight once), the one source of the per-layer shapes: the
count above is their sum, and the dry run's padding, the volume of DeepSpeed's buckets and the
FLOP count (``matmul_parameters``: the weights every token is multiplied by, the output layer
included even when tied) are read from them. A description is read from a JSON or hjson file
holding its fields (``from_file``); unknown keys are refused, naming the allowed ones.
``describe``, in ``zerosim.nn.presets`` beside the presets, turns a preset name or a file path
into a description.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

MLPS = ("gelu", "swiglu")
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rotary", "alibi")
GELU_APPROXIMATIONS = ("none", "tanh")
ATTENTIONS = ("standard", "flash")


@dataclass(frozen=True)
class ModelDescription:
    """The shape and the parts of a decoder-only transformer (module docstring).

    ``kv_heads`` None means one per head (multi-head attention); ``mlp_hidden`` None means 4h
    (GELU only: a SwiGLU description states its width). ``source`` cites where the numbers come
    from.
    """

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    kv_heads: int | None = None
    mlp: str = "gelu"
    mlp_hidden: int | None = None
    gelu_approximate: str = "none"
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    bias: bool = True
    positions: str = "learned"
    rotary_base: float = 10000.0
    tied: bool = False
    embedding_norm: bool = False
    attention: str = "standard"
    name: str = "custom"
    source: str = ""

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "heads", "vocab", "seq"):
            _positive_int(key, getattr(self, key))
        kv = self.heads if self.kv_heads is None else _positive_int("kv_heads", self.kv_heads)
        object.__setattr__(self, "kv_heads", kv)
        if self.hidden % self.heads:
            raise ValueError(
                f"hidden must be a multiple of heads; got hidden={self.hidden}, heads={self.heads}"
            )
        if self.heads % kv:
            raise ValueError(f"kv_heads must divide heads={self.heads}; got kv_heads={kv}")
        for key, allowed in (
            ("mlp", MLPS),
            ("norm", NORMS),
            ("positions", POSITIONS),
            ("gelu_approximate", GELU_APPROXIMATIONS),
            ("attention", ATTENTIONS),
        ):
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key} must be one of {allowed}; got {getattr(self, key)!r}")
        if self.mlp_hidden is None:
            if self.mlp == "swiglu":
                raise ValueError("mlp='swiglu' needs mlp_hidden, its width F (Llama 2 7B: 11008)")
            object.__setattr__(self, "mlp_hidden", 4 * self.hidden)
        _positive_int("mlp_hidden", self.mlp_hidden)
        if self.positions == "rotary" and (self.hidden // self.heads) % 2:
            raise ValueError(
                f"positions='rotary' needs an even head size; got hidden/heads = "
                f"{self.hidden}/{self.heads}"
            )
        if self.attention == "flash" and not self.packed_attention:
            raise ValueError(
                "attention='flash' is built for packed attention (every head its own keys and "
                f"values, no rotary positions); got kv_heads={kv}, heads={self.heads}, "
                f"positions={self.positions!r}"
            )
        for key in ("norm_eps", "rotary_base"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{key} must be a positive number; got {value!r}")
        for key in ("bias", "tied", "embedding_norm"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key} must be true or false; got {getattr(self, key)!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def packed_attention(self) -> bool:
        """GPT-2's one packed ``c_attn`` (q, k, v in one h → 3h matrix): every head has its own
        keys and values and no rotation enters attention. Otherwise q/k/v/o_proj apart."""
        return self.kv_heads == self.heads and self.positions != "rotary"

    def parameter_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every parameter in ``Transformer``'s definition order, a tied output
        layer once (as ``wte.weight``): the shapes every count of this model is read from."""
        h, v = self.hidden, self.vocab
        out: list[tuple[str, tuple[int, ...]]] = [("wte.weight", (v, h))]
        if self.positions == "learned":
            out.append(("wpe.weight", (self.seq, h)))
        if self.embedding_norm:
            out += self._norm_shapes("ln_e")
        for i in range(self.layers):
            out += self._block_shapes(f"blocks.{i}")
        out += self._norm_shapes("ln_f")
        if not self.tied:
            out.append(("lm_head.weight", (v, h)))
        return out

    def _norm_shapes(self, name: str) -> list[tuple[str, tuple[int, ...]]]:
        with_bias = self.norm == "layernorm" and self.bias
        return [(f"{name}.weight", (self.hidden,))] + (
            [(f"{name}.bias", (self.hidden,))] if with_bias else []
        )

    def _block_shapes(self, name: str) -> list[tuple[str, tuple[int, ...]]]:
        """A block's parameters: ln_1, attention (packed, or GQA's smaller k and v), ln_2, MLP
        (GELU's two matrices or SwiGLU's three), each Linear as (out, in) + its bias."""
        h, f, kv = self.hidden, self.mlp_hidden, self.kv_heads * self.head_dim
        if self.packed_attention:
            attention = [("c_attn", 3 * h, h), ("c_proj", h, h)]
        else:
            attention = [("q_proj", h, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, h)]
        if self.mlp == "swiglu":
            mlp = [("gate_proj", f, h), ("up_proj", f, h), ("down_proj", h, f)]
        else:
            mlp = [("c_fc", f, h), ("c_proj", h, f)]

        def linears(part: str, layers: list) -> list[tuple[str, tuple[int, ...]]]:
            out = []
            for layer, rows, cols in layers:
                out.append((f"{name}.{part}.{layer}.weight", (rows, cols)))
                if self.bias:
                    out.append((f"{name}.{part}.{layer}.bias", (rows,)))
            return out

        return (
            self._norm_shapes(f"{name}.ln_1")
            + linears("attn", attention)
            + self._norm_shapes(f"{name}.ln_2")
            + linears("mlp", mlp)
        )

    def num_parameters(self) -> int:
        """Ψ: the sum of ``parameter_shapes`` (its closed form in the module docstring)."""
        return sum(math.prod(shape) for _, shape in self.parameter_shapes())

    def matmul_parameters(self) -> int:
        """N_matmul: the elements of every weight a token's activations are multiplied by, the
        blocks' matrices and the output layer (V·h, tied or not); embeddings are looked up, and
        norms and biases are not matrix products."""
        blocks = sum(
            math.prod(shape)
            for name, shape in self.parameter_shapes()
            if name.startswith("blocks.") and len(shape) == 2
        )
        return blocks + self.vocab * self.hidden

    def with_(self, **changes: Any) -> ModelDescription:
        """A copy with ``changes`` (validated again)."""
        return replace(self, **changes)

    def tiny(self) -> ModelDescription:
        """The family's parts at a size that trains on a laptop: 2 layers, hidden 64, 4 heads,
        key/value heads in the preset's ratio (at least 1), the preset's MLP-width ratio
        (SwiGLU's rounded to a multiple of 16), vocabulary 128, sequence 64."""
        kv = max(1, 4 * self.kv_heads // self.heads)
        mlp_hidden = None
        if self.mlp == "swiglu":
            mlp_hidden = 16 * max(1, round(64 * self.mlp_hidden / self.hidden / 16))
        elif self.mlp_hidden != 4 * self.hidden:
            mlp_hidden = max(1, round(64 * self.mlp_hidden / self.hidden))
        return replace(
            self,
            name=f"{self.name}-tiny",
            layers=2,
            hidden=64,
            heads=4,
            kv_heads=kv,
            mlp_hidden=mlp_hidden,
            vocab=128,
            seq=64,
            source=f"{self.name}'s parts at a small size (ModelDescription.tiny)",
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "model description") -> ModelDescription:
        """A description from its fields; unknown or missing keys are refused by name."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: must hold one object of fields; got {type(data).__name__}")
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; allowed: {allowed}")
        required = ("layers", "hidden", "heads", "vocab", "seq")
        missing = [k for k in required if k not in data]
        if missing:
            raise ValueError(f"{where}: missing keys {missing}; required: {list(required)}")
        try:
            return cls(**data)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> ModelDescription:
        """A description from a JSON or hjson file of its fields (``name`` defaults to the
        file's stem). A repeated key is refused."""
        import hjson  # pure Python; only needed when a file is read

        def no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
            keys = [k for k, _ in pairs]
            repeated = sorted({k for k in keys if keys.count(k) > 1})
            if repeated:
                raise ValueError(f"repeated keys {repeated}")
            return dict(pairs)

        path = Path(path)
        try:
            with open(path, encoding="utf-8") as f:
                data = hjson.load(f, object_pairs_hook=no_repeats)
        except (OSError, ValueError, hjson.HjsonDecodeError) as err:
            raise ValueError(
                f"{path}: not a readable JSON or hjson model description: {err}"
            ) from None
        data = json.loads(json.dumps(data))  # hjson's OrderedDicts and numbers as plain ones
        if isinstance(data, dict):
            data.setdefault("name", path.stem)
        return cls.from_dict(data, str(path))


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int; got {value!r}")
    return value
