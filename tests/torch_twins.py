"""torch twins of zerosim's MLP and GPT: the same structure and parameter names, so weights load
by name (``twin.load_state_dict`` of a zerosim ``state_dict``). Used as autograd oracles
(tests/test_nn_models.py) and as the models DeepSpeed trains in the peer tests (tests/peer/)."""

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
    def __init__(self, c, bias, approximate):
        super().__init__()
        self.c_fc = tnn.Linear(c, 4 * c, bias=bias)
        self.gelu = tnn.GELU(approximate=approximate)
        self.c_proj = tnn.Linear(4 * c, c, bias=bias)
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
