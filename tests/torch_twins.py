"""torch twins of zerosim's MLP, GPT and Transformer (of a ModelDescription): the same structure
and parameter names, so weights load by name (``twin.load_state_dict`` of a zerosim
``state_dict``). Used as autograd oracles (tests/test_nn_models.py, test_nn_description.py) and
as the models DeepSpeed trains in the peer tests (tests/peer/)."""

import math

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn as tnn


class TorchMLP(tnn.Module):
    def __init__(self, sizes, activation, loss):
        super().__init__()
        act = {"relu": tnn.ReLU, "gelu": tnn.GELU, "tanh": tnn.Tanh}[activation]
        layers = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            layers += [act()] if i else []
            layers.append(tnn.Linear(a, b))
        self.layers = tnn.Sequential(*layers)
        self.loss_fn = tnn.CrossEntropyLoss() if loss == "cross_entropy" else tnn.MSELoss()

    def forward(self, x, y=None):
        out = self.layers(x)
        return out if y is None else self.loss_fn(out, y)


class TorchAttention(tnn.Module):
    def __init__(self, c, h, bias):
        super().__init__()
        self.n_head = h
        self.c_attn = tnn.Linear(c, 3 * c, bias=bias)
        self.attn_dropout = tnn.Dropout(0.0)
        self.c_proj = tnn.Linear(c, c, bias=bias)
        self.resid_dropout = tnn.Dropout(0.0)

    def forward(self, x):
        b, t, c = x.shape
        heads = lambda z: z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)  # noqa: E731
        q, k, v = map(heads, self.c_attn(x).split(c, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class TorchFeedForward(tnn.Module):
    def __init__(self, c, bias, approximate, hidden=None):
        super().__init__()
        f = 4 * c if hidden is None else hidden
        self.c_fc = tnn.Linear(c, f, bias=bias)
        self.gelu = tnn.GELU(approximate=approximate)
        self.c_proj = tnn.Linear(f, c, bias=bias)
        self.dropout = tnn.Dropout(0.0)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class TorchBlock(tnn.Module):
    def __init__(self, c, h, bias, approximate):
        super().__init__()
        self.ln_1 = tnn.LayerNorm(c, bias=bias)
        self.attn = TorchAttention(c, h, bias)
        self.ln_2 = tnn.LayerNorm(c, bias=bias)
        self.mlp = TorchFeedForward(c, bias, approximate)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TorchGPT(tnn.Module):
    def __init__(self, vocab, block_size, n_layer, n_head, c, bias=True, tie=False, gelu="tanh"):
        super().__init__()
        self.wte = tnn.Embedding(vocab, c)
        self.wpe = tnn.Embedding(block_size, c)
        self.drop = tnn.Dropout(0.0)
        self.blocks = tnn.ModuleList(TorchBlock(c, n_head, bias, gelu) for _ in range(n_layer))
        self.ln_f = tnn.LayerNorm(c, bias=bias)
        self.lm_head = tnn.Linear(c, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.wte.weight
        self.loss_fn = tnn.CrossEntropyLoss(ignore_index=-1)

    def forward(self, idx, targets=None):
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1])))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return self.loss_fn(logits.view(-1, logits.shape[-1]), targets.view(-1))


# --- the Transformer of a ModelDescription (Llama, MPT, BLOOM), written from HF's code --------


def press_alibi_slopes(n):
    """ALiBi's slopes as Press et al.'s code and HF BLOOM's ``build_alibi_tensor`` compute them."""

    def power_of_2(k):
        start = 2 ** (-(2 ** -(math.log2(k) - 3)))
        return [start * start**i for i in range(k)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    p = 2 ** math.floor(math.log2(n))
    return power_of_2(p) + power_of_2(2 * p)[0::2][: n - p]


def rotate_half(x):
    """HF Llama's ``rotate_half``."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(t, d, base, dtype):
    """HF Llama's rotary tables: inv_freq = 1/base^(2i/d), emb = cat(freqs, freqs)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = torch.outer(torch.arange(t, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class TorchGQA(tnn.Module):
    """Llama's attention (q/k/v/o_proj, ``repeat_kv``, optional RoPE) or, with ``alibi``,
    BLOOM's bias m_h·j added to the scores; causal."""

    def __init__(self, c, h, kv, bias, positions, base):
        super().__init__()
        self.h, self.kv, self.d, self.positions, self.base = h, kv, c // h, positions, base
        self.q_proj = tnn.Linear(c, c, bias=bias)
        self.k_proj = tnn.Linear(c, kv * self.d, bias=bias)
        self.v_proj = tnn.Linear(c, kv * self.d, bias=bias)
        self.o_proj = tnn.Linear(c, c, bias=bias)

    def forward(self, x):
        b, t, c = x.shape
        q = self.q_proj(x).view(b, t, self.h, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv, self.d).transpose(1, 2)
        if self.positions == "rotary":
            cos, sin = rope_cos_sin(t, self.d, self.base, x.dtype)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(self.h // self.kv, dim=1)  # repeat_kv
        v = v.repeat_interleave(self.h // self.kv, dim=1)
        y = causal_attention(q, k, v, self.positions == "alibi")
        return self.o_proj(y.transpose(1, 2).reshape(b, t, c))


def causal_attention(q, k, v, alibi):
    """softmax(q kᵀ/√d + causal mask (+ BLOOM's alibi m_h·j)) v, by torch's SDPA."""
    h, t = q.shape[1], q.shape[2]
    mask = torch.zeros(t, t, dtype=q.dtype).masked_fill(
        torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")
    )
    if alibi:
        slopes = torch.tensor(press_alibi_slopes(h), dtype=q.dtype)
        mask = mask + slopes[:, None, None] * torch.arange(t, dtype=q.dtype)[None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class TorchPackedAlibiAttention(TorchAttention):
    """GPT-2's packed c_attn/c_proj with BLOOM's ALiBi bias (MPT's Wqkv/out_proj)."""

    def forward(self, x):
        b, t, c = x.shape
        heads = lambda z: z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)  # noqa: E731
        q, k, v = map(heads, self.c_attn(x).split(c, dim=2))
        y = causal_attention(q, k, v, alibi=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class TorchSwiGLU(tnn.Module):
    """HF Llama's MLP: down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self, c, f, bias):
        super().__init__()
        self.gate_proj = tnn.Linear(c, f, bias=bias)
        self.up_proj = tnn.Linear(c, f, bias=bias)
        self.down_proj = tnn.Linear(f, c, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def torch_norm(desc):
    if desc.norm == "rmsnorm":
        return tnn.RMSNorm(desc.hidden, eps=desc.norm_eps)
    return tnn.LayerNorm(desc.hidden, eps=desc.norm_eps, bias=desc.bias)


class TorchDecoderBlock(tnn.Module):
    def __init__(self, desc):
        super().__init__()
        c, h, kv = desc.hidden, desc.heads, desc.kv_heads
        self.ln_1 = torch_norm(desc)
        if kv == h and desc.positions == "learned":
            self.attn = TorchAttention(c, h, desc.bias)
        elif kv == h and desc.positions == "alibi":
            self.attn = TorchPackedAlibiAttention(c, h, desc.bias)
        else:
            positions = {"rotary": "rotary", "alibi": "alibi"}.get(desc.positions, "none")
            self.attn = TorchGQA(c, h, kv, desc.bias, positions, desc.rotary_base)
        self.ln_2 = torch_norm(desc)
        if desc.mlp == "swiglu":
            self.mlp = TorchSwiGLU(c, desc.mlp_hidden, desc.bias)
        else:
            self.mlp = TorchFeedForward(c, desc.bias, desc.gelu_approximate, desc.mlp_hidden)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TorchTransformer(tnn.Module):
    """zerosim.nn.Transformer's twin, built from the same ModelDescription."""

    def __init__(self, desc):
        super().__init__()
        self.desc = desc
        self.wte = tnn.Embedding(desc.vocab, desc.hidden)
        if desc.positions == "learned":
            self.wpe = tnn.Embedding(desc.seq, desc.hidden)
        if desc.embedding_norm:
            self.ln_e = torch_norm(desc)
        self.blocks = tnn.ModuleList(TorchDecoderBlock(desc) for _ in range(desc.layers))
        self.ln_f = torch_norm(desc)
        self.lm_head = tnn.Linear(desc.hidden, desc.vocab, bias=False)
        if desc.tied:
            self.lm_head.weight = self.wte.weight
        self.loss_fn = tnn.CrossEntropyLoss(ignore_index=-1)

    def forward(self, idx, targets=None):
        x = self.wte(idx)
        if self.desc.positions == "learned":
            x = x + self.wpe(torch.arange(idx.shape[1]))
        if self.desc.embedding_norm:
            x = self.ln_e(x)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return self.loss_fn(logits.view(-1, logits.shape[-1]), targets.view(-1))
