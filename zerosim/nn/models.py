"""The models the ZeRO engine trains: ``MLP``, the ``Transformer`` of a ``ModelDescription``
(Llama, MPT, BLOOM, …) and nanoGPT's ``GPT``, the Transformer of GPT-2's description.

One calling convention for both:

    model(x)        → output (logits / predictions)
    model(x, y)     → scalar loss (a 0-d array; float(loss) for a Python number)
    model.backward(grad_scale=1.0)   backpropagates the last loss, seeded with grad_scale

Parameter names match what torch would give the same structure (``layers.0.weight`` for
the MLP; ``wte.weight``, ``blocks.0.attn.c_attn.weight``, … for GPT; ``blocks.0.attn.q_proj``,
``blocks.0.mlp.gate_proj``, … for Llama's parts; see docs/nn.md),
so weights can be exchanged with torch by name.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from zerosim.backend import resolve_dtype, xp_of
from zerosim.nn.activation import GELU, Dropout, ReLU, Tanh
from zerosim.nn.containers import ModuleList, Sequential
from zerosim.nn.description import ModelDescription
from zerosim.nn.functional import compute_dtype, reduce, reshape
from zerosim.nn.init import check_positive_int, normal
from zerosim.nn.linear import Embedding, Linear
from zerosim.nn.loss import CrossEntropyLoss, MSELoss
from zerosim.nn.module import Module
from zerosim.nn.norm import LayerNorm, RMSNorm
from zerosim.nn.presets import describe
from zerosim.nn.transformer import DecoderBlock, make_norm

ACTIVATIONS = {"relu": ReLU, "gelu": GELU, "tanh": Tanh}
LOSSES = {"cross_entropy": CrossEntropyLoss, "mse": MSELoss}


class LossModel(Module):
    """Base of the models: an output network plus ``loss_fn``, with the loss-seeded backward.

    Subclasses define ``_output(x)``, ``_output_backward(grad)`` and, when the loss needs
    other shapes than the output, ``_loss_args(output, target)``.

    With ``keep_output`` set, ``model(x, y)`` also keeps the output in ``output`` until its next
    forward replaces it (or the caller sets it to None): what a trainer that updates metrics
    from the logits after backward holds (Composer's ``state.outputs``; ``zerosim.nn.metrics``).
    """

    keep_output = False
    output: Any = None

    def _output(self, x: Any) -> Any:
        raise NotImplementedError

    def _output_backward(self, grad: Any) -> Any:
        raise NotImplementedError

    def _loss_args(self, output: Any, target: Any) -> tuple[Any, Any]:
        return output, target

    def forward(self, x: Any, y: Any = None) -> Any:
        output = self._output(x)
        if y is None:
            self.save_for_backward(False, output.shape, output.dtype, xp_of(output))
            return output
        prediction, target = self._loss_args(output, y)
        loss = self.loss_fn(prediction, target)
        if self.keep_output:
            self.output = output
        self.save_for_backward(True, output.shape, loss.dtype, xp_of(loss))
        return loss

    def backward(self, grad_scale: Any = 1.0) -> Any:
        """Backpropagate the last forward; its hooks and every child's fire on the way.

        After ``model(x, y)``: the seed d loss = ``grad_scale`` (a loss scale, or
        1/accumulation steps). After ``model(x)``: pass the gradient of the output instead.
        Returns the gradient of ``x`` (None for token ids).
        """
        if not self._saved:
            raise RuntimeError(
                f"{type(self).__name__}.backward() needs a forward first "
                "(with grad enabled, i.e. not under no_grad())"
            )
        with_loss, shape, dtype, xp = self._saved[-1]
        if with_loss:
            if np.ndim(grad_scale) != 0:
                raise ValueError(
                    f"grad_scale must be a scalar after model(x, y); got shape "
                    f"{np.shape(grad_scale)}"
                )
            if xp is not np and isinstance(grad_scale, np.ndarray | np.generic):
                grad_scale = float(grad_scale)  # a host number: the standard takes Python's
            seed = xp.asarray(grad_scale, dtype=dtype)
        else:
            if tuple(np.shape(grad_scale)) != tuple(shape):
                raise ValueError(
                    f"after model(x) pass the gradient of the output, shape "
                    f"{tuple(shape)}; got shape {np.shape(grad_scale)}"
                )
            seed = grad_scale
        return super().backward(seed)

    def _backward(self, grad: Any) -> Any:
        with_loss = self.pop_saved()[0]
        if not with_loss:
            return self._output_backward(grad)
        dprediction, _ = self.loss_fn.backward(grad)
        return self._output_backward(dprediction), None

    def num_parameters(self) -> int:
        """Σ numel over distinct parameters (a tied weight counts once)."""
        return sum(p.numel for p in self.parameters())

    def _name_parameters(self) -> None:
        for name, p in self.named_parameters():
            p.name = name


class MLP(LossModel):
    """``layers`` = Linear(sizes[0], sizes[1]), activation, …, Linear(sizes[-2], sizes[-1]);
    ``loss_fn`` = CrossEntropyLoss (y: class ids) or MSELoss (y: targets like the output).

    Weights are initialised like torch's Linear from ``numpy.random.default_rng(seed)``,
    layer by layer (weight, then bias).
    """

    def __init__(
        self,
        sizes: Sequence[int],
        activation: str = "relu",
        loss: str = "cross_entropy",
        seed: int = 0,
        dtype: Any = "float32",
    ) -> None:
        super().__init__()
        if len(sizes) < 2:
            raise ValueError(f"sizes must list at least 2 layer widths; got {list(sizes)}")
        sizes = [check_positive_int(f"sizes[{i}]", n) for i, n in enumerate(sizes)]
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}; got {activation!r}")
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {sorted(LOSSES)}; got {loss!r}")
        dtype = resolve_dtype(dtype)
        rng = np.random.default_rng(seed)
        layers: list[Module] = []
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            if i:
                layers.append(ACTIVATIONS[activation]())
            layers.append(Linear(n_in, n_out, rng=rng, dtype=dtype))
        self.sizes = sizes
        self.layers = Sequential(*layers)
        self.loss_fn = LOSSES[loss]()
        self._name_parameters()

    def _output(self, x: Any) -> Any:
        return self.layers(x)

    def _output_backward(self, grad: Any) -> Any:
        return self.layers.backward(grad)


class Transformer(LossModel):
    """The decoder-only transformer a ``ModelDescription`` states (``zerosim.nn.description``):
    ``wte`` (+ ``wpe``, learned positions only) (→ ``ln_e``, BLOOM's norm after the embedding)
    → ``drop`` → ``blocks.{i}`` (``DecoderBlock``) → ``ln_f`` → ``lm_head``.

    ``desc`` is a description, a preset name or a description file (``describe``).
    ``model(idx)`` → logits (B, T, vocab); ``model(idx, targets)`` → mean cross-entropy of
    next-token targets (B, T), target −1 ignored (nanoGPT's convention).
    Initialisation (nanoGPT's, for every family): every Linear weight and the embeddings
    ~ N(0, 0.02²), residual projections (``c_proj``, ``o_proj``, ``down_proj``) ~
    N(0, (0.02/√(2·layers))²), biases 0, norm weights 1 / biases 0; drawn in
    ``named_parameters`` order from ``default_rng(seed)``. A tied ``lm_head`` shares
    ``wte.weight``.
    """

    RESIDUAL_PROJECTIONS = ("c_proj.weight", "o_proj.weight", "down_proj.weight")

    def __init__(
        self,
        desc: ModelDescription | str,
        dropout: float = 0.0,
        seed: int = 0,
        dtype: Any = "float32",
    ) -> None:
        super().__init__()
        desc = describe(desc)
        self.desc = desc
        self.vocab_size, self.block_size, self.n_layer = desc.vocab, desc.seq, desc.layers
        dtype = resolve_dtype(dtype)
        rng = np.random.default_rng(seed)
        self.wte = Embedding(desc.vocab, desc.hidden, rng=rng, dtype=dtype)
        if desc.positions == "learned":
            self.wpe = Embedding(desc.seq, desc.hidden, rng=rng, dtype=dtype)
        if desc.embedding_norm:
            self.ln_e = make_norm(desc, dtype)
        self.drop = Dropout(dropout, rng=rng.spawn(1)[0])
        self.blocks = ModuleList(
            DecoderBlock(desc, dropout, rng=rng, dtype=dtype) for _ in range(desc.layers)
        )
        self.ln_f = make_norm(desc, dtype)
        self.lm_head = Linear(desc.hidden, desc.vocab, bias=False, rng=rng, dtype=dtype)
        if desc.tied:
            self.lm_head.weight = self.wte.weight
        self.loss_fn = CrossEntropyLoss(ignore_index=-1)
        self._init_weights(rng)
        self._name_parameters()

    def _init_weights(self, rng: np.random.Generator) -> None:
        residual_std = 0.02 / math.sqrt(2 * self.n_layer)
        norm_params = {
            id(p)
            for m in self.modules()
            if isinstance(m, LayerNorm | RMSNorm)
            for p in m.parameters()
        }
        for name, p in self.named_parameters():
            if id(p) in norm_params:
                continue  # norms keep weight 1, bias 0
            if name.endswith(".bias"):
                p.set_full_(0)
            else:
                std = residual_std if name.endswith(self.RESIDUAL_PROJECTIONS) else 0.02
                p.set_full_(normal(rng, p.shape, std, p.dtype))

    def _output(self, idx: Any) -> Any:
        if idx.ndim != 2:
            raise ValueError(
                f"{type(self).__name__} expects token ids of shape (B, T); got {tuple(idx.shape)}"
            )
        t = idx.shape[1]
        if not 0 < t <= self.block_size:
            raise ValueError(
                f"sequence length T must be in [1, block_size={self.block_size}]; got T={t}"
            )
        x = self.wte(idx)
        if self.desc.positions == "learned":
            x = x + self.wpe(xp_of(idx).arange(t))
        if self.desc.embedding_norm:
            x = self.ln_e(x)
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def _loss_args(self, logits: Any, targets: Any) -> tuple[Any, Any]:
        if targets.shape != logits.shape[:2]:
            raise ValueError(
                f"targets must have the shape of the ids {tuple(logits.shape[:2])}; "
                f"got {tuple(targets.shape)}"
            )
        return reshape(logits, (-1, self.vocab_size)), reshape(targets, (-1,))

    def _output_backward(self, grad: Any) -> None:
        grad = self.ln_f.backward(self.lm_head.backward(grad))
        for block in reversed(list(self.blocks)):
            grad = block.backward(grad)
        grad = self.drop.backward(grad)
        if self.desc.embedding_norm:
            grad = self.ln_e.backward(grad)
        if self.desc.positions == "learned":
            self.wpe.backward(reduce("sum", grad, axis=0, dtype=compute_dtype(grad.dtype)))
        self.wte.backward(grad)
        return None


class GPT(Transformer):
    """nanoGPT's GPT-2: the ``Transformer`` of the description with learned positions,
    LayerNorm (ε = 1e-5), a 4C GELU MLP and multi-head attention (``description``).

    ``wte`` + ``wpe`` → ``drop`` → ``blocks.{i}`` → ``ln_f`` → ``lm_head``; initialised as
    ``Transformer`` says (residual projections ``*.c_proj.weight``). ``tie_weights`` makes
    ``lm_head`` share ``wte.weight``. ``gelu_approximate="tanh"`` (default) is GPT-2's original
    GELU; "none" is the exact one.
    """

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int,
        n_head: int,
        n_embd: int,
        dropout: float = 0.0,
        bias: bool = True,
        tie_weights: bool = False,
        seed: int = 0,
        dtype: Any = "float32",
        gelu_approximate: str = "tanh",
    ) -> None:
        desc = self.description(
            vocab_size, block_size, n_layer, n_head, n_embd, bias, tie_weights, gelu_approximate
        )
        super().__init__(desc, dropout, seed, dtype)

    @staticmethod
    def description(
        vocab_size: int,
        block_size: int,
        n_layer: int,
        n_head: int,
        n_embd: int,
        bias: bool = True,
        tie_weights: bool = False,
        gelu_approximate: str = "tanh",
    ) -> ModelDescription:
        """The ``ModelDescription`` of ``GPT(...)`` with these arguments."""
        for name, value in (
            ("vocab_size", vocab_size),
            ("block_size", block_size),
            ("n_layer", n_layer),
            ("n_head", n_head),
            ("n_embd", n_embd),
        ):
            check_positive_int(name, value)
        if n_embd % n_head:
            raise ValueError(
                f"n_embd must be divisible by n_head; got n_embd={n_embd}, n_head={n_head}"
            )
        return ModelDescription(
            n_layer,
            n_embd,
            n_head,
            vocab_size,
            block_size,
            mlp="gelu",
            gelu_approximate=gelu_approximate,
            norm="layernorm",
            norm_eps=1e-5,
            bias=bias,
            positions="learned",
            tied=tie_weights,
            name="gpt",
        )
