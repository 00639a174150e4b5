"""The GPT-2 transformer block (pre-LayerNorm), as in nanoGPT (Radford et al. 2019):

    h = x + attn(ln_1(x)),   y = h + mlp(ln_2(h)),   mlp(u) = dropout(c_proj(gelu(c_fc(u))))

Backward follows the residuals: dh = dy + ln_2ᵀ(mlpᵀ(dy)),  dx = dh + ln_1ᵀ(attnᵀ(dh)).

``DecoderBlock`` is the same block with the parts a ``ModelDescription`` names: LayerNorm or
RMSNorm, GELU or SwiGLU MLP (Shazeer 2020, "GLU Variants Improve Transformer", as Llama):

    swiglu(u) = down_proj(silu(gate_proj(u)) ⊙ up_proj(u)),   silu(a) = a·σ(a)

(Llama's paper calls the matrices w1, w3 and w2.) With a = gate_proj(u), b = up_proj(u),
s = σ(a) and dh the gradient at down_proj's input:

    da = dh ⊙ b ⊙ s·(1 + a·(1 − s)),   db = dh ⊙ a·s,   du = gate_projᵀ(da) + up_projᵀ(db).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zerosim.backend import xp_of
from zerosim.nn.activation import GELU, Dropout
from zerosim.nn.attention import CausalSelfAttention
from zerosim.nn.flash import FlashSelfAttention
from zerosim.nn.functional import downcast, upcast
from zerosim.nn.gqa import GroupedQueryAttention
from zerosim.nn.init import RngLike, as_generator, check_positive_int
from zerosim.nn.linear import Linear
from zerosim.nn.module import Module
from zerosim.nn.norm import LayerNorm, RMSNorm

if TYPE_CHECKING:
    from zerosim.nn.description import ModelDescription


class FeedForward(Module):
    """The block's MLP: ``c_fc`` (C → F), ``gelu``, ``c_proj`` (F → C), ``dropout``; the
    hidden width F is 4C unless ``hidden`` says otherwise."""

    def __init__(
        self,
        n_embd: int,
        dropout: float = 0.0,
        bias: bool = True,
        gelu_approximate: str = "none",
        *,
        hidden: int | None = None,
        rng: RngLike = None,
        dtype: Any = "float32",
    ) -> None:
        super().__init__()
        rng = as_generator(rng)
        f = 4 * n_embd if hidden is None else check_positive_int("hidden", hidden)
        self.c_fc = Linear(n_embd, f, bias, rng=rng, dtype=dtype)
        self.gelu = GELU(gelu_approximate)
        self.c_proj = Linear(f, n_embd, bias, rng=rng, dtype=dtype)
        self.dropout = Dropout(dropout, rng=rng.spawn(1)[0])

    def forward(self, x: Any) -> Any:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))

    def _backward(self, grad: Any) -> Any:
        grad = self.c_proj.backward(self.dropout.backward(grad))
        return self.c_fc.backward(self.gelu.backward(grad))


class Block(Module):
    """Children ``ln_1``, ``attn``, ``ln_2``, ``mlp``; input and output are (B, T, C)."""

    def __init__(
        self,
        n_embd: int,
        n_head: int,
        dropout: float = 0.0,
        bias: bool = True,
        gelu_approximate: str = "none",
        *,
        rng: RngLike = None,
        dtype: Any = "float32",
    ) -> None:
        super().__init__()
        rng = as_generator(rng)
        self.ln_1 = LayerNorm(n_embd, bias=bias, dtype=dtype)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias, rng=rng, dtype=dtype)
        self.ln_2 = LayerNorm(n_embd, bias=bias, dtype=dtype)
        self.mlp = FeedForward(n_embd, dropout, bias, gelu_approximate, rng=rng, dtype=dtype)

    def forward(self, x: Any) -> Any:
        h = x + self.attn(self.ln_1(x))
        return h + self.mlp(self.ln_2(h))

    def _backward(self, grad: Any) -> Any:
        dh = grad + self.ln_2.backward(self.mlp.backward(grad))
        return dh + self.ln_1.backward(self.attn.backward(dh))


class SwiGLU(Module):
    """Llama's MLP: ``gate_proj`` and ``up_proj`` (C → F), ``down_proj`` (F → C); see the module
    docstring for the math. Saves the two (…, F) products a and b."""

    def __init__(
        self,
        n_embd: int,
        hidden: int,
        bias: bool = False,
        *,
        rng: RngLike = None,
        dtype: Any = "float32",
    ) -> None:
        super().__init__()
        rng = as_generator(rng)
        f = check_positive_int("hidden", hidden)
        self.gate_proj = Linear(n_embd, f, bias, rng=rng, dtype=dtype)
        self.up_proj = Linear(n_embd, f, bias, rng=rng, dtype=dtype)
        self.down_proj = Linear(f, n_embd, bias, rng=rng, dtype=dtype)

    def forward(self, x: Any) -> Any:
        a, b = self.gate_proj(x), self.up_proj(x)
        self.save_for_backward(a, b)
        xp = xp_of(a)
        ac = upcast(a)
        h = ac / (1 + xp.exp(-ac))  # silu(a) = a·σ(a)
        h *= upcast(b)
        return self.down_proj(downcast(h, a.dtype))

    def _backward(self, grad: Any) -> Any:
        a, b = self.pop_saved()
        xp = xp_of(a)
        dh = upcast(self.down_proj.backward(grad))
        ac = upcast(a)
        s = 1 / (1 + xp.exp(-ac))  # σ(a)
        db = dh * ac * s  # dh ⊙ silu(a)
        da = dh * upcast(b)
        da *= s * (1 + ac * (1 - s))  # silu'(a) = s·(1 + a·(1 − s))
        dx = upcast(self.up_proj.backward(downcast(db, a.dtype)))  # torch's order: up, then gate
        dx += upcast(self.gate_proj.backward(downcast(da, a.dtype)))
        return downcast(dx, grad.dtype)

    def extra_repr(self) -> str:
        return f"{self.gate_proj.in_features}, hidden={self.gate_proj.out_features}"


NORMS = ("layernorm", "rmsnorm")


def make_norm(desc: ModelDescription, dtype: Any) -> Module:
    """The description's norm over its hidden size: LayerNorm (with a bias when ``desc.bias``)
    or RMSNorm."""
    if desc.norm == "rmsnorm":
        return RMSNorm(desc.hidden, desc.norm_eps, dtype=dtype)
    return LayerNorm(desc.hidden, desc.norm_eps, bias=desc.bias, dtype=dtype)


class DecoderBlock(Block):
    """The pre-norm block of a ``ModelDescription``: children ``ln_1``, ``attn``, ``ln_2``,
    ``mlp`` as in ``Block`` (whose forward and backward it uses).

    ``attn`` is GPT-2's ``CausalSelfAttention`` (one packed ``c_attn``, ALiBi when the positions
    are ALiBi; ``FlashSelfAttention`` when the description's attention is flash) when every head
    has its own keys and values and no rotation enters attention;
    otherwise ``GroupedQueryAttention`` (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``). ``mlp``
    is ``FeedForward`` (GELU) or ``SwiGLU``. A GPT-2 description builds exactly ``Block``.
    """

    def __init__(
        self, desc: ModelDescription, dropout: float = 0.0, *, rng: RngLike = None, dtype: Any
    ) -> None:
        Module.__init__(self)
        rng = as_generator(rng)
        c = desc.hidden
        self.ln_1 = make_norm(desc, dtype)
        if desc.packed_attention:
            alibi = desc.positions == "alibi"
            packed = FlashSelfAttention if desc.attention == "flash" else CausalSelfAttention
            self.attn = packed(c, desc.heads, dropout, desc.bias, alibi=alibi, rng=rng, dtype=dtype)
        else:
            attn_positions = {"rotary": "rotary", "alibi": "alibi"}.get(desc.positions, "none")
            self.attn = GroupedQueryAttention(
                c,
                desc.heads,
                desc.kv_heads,
                desc.bias,
                attn_positions,
                desc.seq,
                desc.rotary_base,
                rng=rng,
                dtype=dtype,
            )
        self.ln_2 = make_norm(desc, dtype)
        if desc.mlp == "swiglu":
            self.mlp = SwiGLU(c, desc.mlp_hidden, desc.bias, rng=rng, dtype=dtype)
        else:
            self.mlp = FeedForward(
                c,
                dropout,
                desc.bias,
                desc.gelu_approximate,
                hidden=desc.mlp_hidden,
                rng=rng,
                dtype=dtype,
            )
