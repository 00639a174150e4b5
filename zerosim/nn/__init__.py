"""Framework-independent neural-network modules with hand-written backward (no autograd).

``Parameter`` and ``Module`` (forward/backward, torch-style names, state_dict, hooks),
layers, the ``MLP``, ``Transformer`` (of a ``ModelDescription``: GPT, Llama, MPT, BLOOM) and
``GPT`` models the ZeRO engine trains, and activation checkpointing. See docs/nn.md.
"""

from zerosim.nn.activation import GELU, Dropout, ReLU, Tanh
from zerosim.nn.attention import CausalSelfAttention
from zerosim.nn.containers import ModuleList, Sequential
from zerosim.nn.description import ModelDescription
from zerosim.nn.flash import FlashSelfAttention
from zerosim.nn.gqa import GroupedQueryAttention
from zerosim.nn.grad_mode import enable_grad, is_grad_enabled, no_grad
from zerosim.nn.grad_ready import GradReadyTracker
from zerosim.nn.linear import Embedding, Linear
from zerosim.nn.loss import CrossEntropyLoss, MSELoss
from zerosim.nn.metrics import LanguageCrossEntropy, LanguagePerplexity
from zerosim.nn.models import GPT, MLP, LossModel, Transformer
from zerosim.nn.module import LoadResult, Module, RemovableHandle, StateDictError
from zerosim.nn.norm import BatchNorm1d, LayerNorm, RMSNorm
from zerosim.nn.parameter import Parameter, accumulate_grad
from zerosim.nn.positions import RotaryEmbedding, alibi_slopes
from zerosim.nn.presets import PRESETS, describe
from zerosim.nn.recompute import Checkpoint, checkpoint, saved_bytes
from zerosim.nn.transformer import Block, DecoderBlock, FeedForward, SwiGLU

__all__ = [
    "GELU",
    "GPT",
    "GradReadyTracker",
    "MLP",
    "BatchNorm1d",
    "Block",
    "CausalSelfAttention",
    "FlashSelfAttention",
    "Checkpoint",
    "DecoderBlock",
    "GroupedQueryAttention",
    "ModelDescription",
    "PRESETS",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLU",
    "Transformer",
    "alibi_slopes",
    "describe",
    "CrossEntropyLoss",
    "Dropout",
    "Embedding",
    "FeedForward",
    "LanguageCrossEntropy",
    "LanguagePerplexity",
    "LayerNorm",
    "Linear",
    "LoadResult",
    "LossModel",
    "MSELoss",
    "Module",
    "ModuleList",
    "Parameter",
    "ReLU",
    "RemovableHandle",
    "Sequential",
    "StateDictError",
    "Tanh",
    "accumulate_grad",
    "checkpoint",
    "enable_grad",
    "is_grad_enabled",
    "no_grad",
    "saved_bytes",
]
