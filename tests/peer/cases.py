"""The cases the DeepSpeed peer tests run on both sides, and the data both sides feed them.

A case is plain JSON: a DeepSpeed config, a model (zerosim's MLP, GPT or ``Transformer`` of a
model description, built with a seed; its torch twin loads the same weights by name) and a
number of optimizer steps. A transformer is ``{"kind": "transformer", "description": D}``, D a
preset name (``"llama3-8b-tiny"``) or a ``ModelDescription``'s fields. Every micro-batch is
drawn from ``numpy.random.default_rng([data_seed, step, micro, rank])``, so each rank of each
side sees the same numbers without any communication. An MLP case may list ``inject``:
``{"step": s, "rank": r, "value": "nan" | "inf"}`` puts that value into one input of rank r's
first micro-batch of step s, on both sides.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import numpy as np

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS.parent))

import zerosim as zs  # noqa: E402

MICRO = 4  # train_micro_batch_size_per_gpu


def description_of(spec: dict[str, Any]) -> Any:
    """The ``ModelDescription`` of a ``"transformer"`` model: a preset name or its fields."""
    fields = spec["description"]
    if isinstance(fields, str):
        return zs.nn.describe(fields)
    return zs.nn.ModelDescription.from_dict(fields, "the case's model description")


def model_of(case: dict[str, Any]) -> Any:
    """The zerosim model of a case, in float32, built with its seed."""
    spec = case["model"]
    if spec["kind"] == "mlp":
        return zs.nn.MLP(spec["sizes"], seed=case.get("seed", 0))
    if spec["kind"] == "transformer":
        return zs.nn.Transformer(description_of(spec), seed=0)
    return zs.nn.GPT(
        spec["vocab"], spec["block"], spec["layers"], spec["heads"], spec["embd"], seed=0
    )


def twin_of(case: dict[str, Any], zmodel: Any) -> Any:
    """The torch twin (tests/torch_twins.py) of a case's model, holding ``zmodel``'s weights
    (loaded by name). torch is imported here, not at the top: zs_driver.py runs without it."""
    import torch
    from torch_twins import TorchGPT, TorchMLP, TorchTransformer

    spec = case["model"]
    if spec["kind"] == "mlp":
        twin = TorchMLP(spec["sizes"], "relu", "cross_entropy")
    elif spec["kind"] == "transformer":
        twin = TorchTransformer(description_of(spec))
    else:
        twin = TorchGPT(spec["vocab"], spec["block"], spec["layers"], spec["heads"], spec["embd"])
    state = {k: torch.tensor(np.asarray(v)) for k, v in zmodel.state_dict().items()}
    twin.load_state_dict(state)
    return twin


def tokens_of(spec: dict[str, Any]) -> tuple[int, int]:
    """(vocabulary, sequence length) of a language model's spec."""
    if spec["kind"] == "transformer":
        desc = description_of(spec)
        return desc.vocab, desc.seq
    return spec["vocab"], spec["block"]


def micro_batch(case: dict[str, Any], step: int, micro: int, rank: int) -> tuple[Any, Any]:
    """(x, y) of this rank's micro-batch ``micro`` of optimizer step ``step``."""
    rng = np.random.default_rng([case.get("data_seed", 1), step, micro, rank])
    spec = case["model"]
    size = case["config"].get("train_micro_batch_size_per_gpu", MICRO)
    if spec["kind"] == "mlp":
        x = rng.normal(size=(size, spec["sizes"][0])).astype(np.float32)
        for bad in case.get("inject", []):
            if (bad["step"], bad["rank"], 0) == (step, rank, micro):
                x[1, 3] = float(bad["value"])
        return x, rng.integers(0, spec["sizes"][-1], size)
    vocab, seq = tokens_of(spec)
    return rng.integers(0, vocab, (size, seq)), rng.integers(0, vocab, (size, seq))


def zerosim_config(case: dict[str, Any]) -> dict[str, Any]:
    """The case's config as zerosim reads it: DeepSpeed's keys, minus the comms logger."""
    cfg = copy.deepcopy(case["config"])
    cfg.pop("comms_logger", None)
    return cfg


def gas(case: dict[str, Any]) -> int:
    return int(case["config"].get("gradient_accumulation_steps", 1))


def make_case(name: str, stage: int, model: dict, optimizer: dict, steps: int, zero=None, **top):
    """A case: micro-batch 4, ``stage`` with the ``zero`` keys, ``top`` as top-level config
    keys; an SGD case says ``zero_allow_untested_optimizer``, as DeepSpeed asks."""
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": optimizer,
        "zero_optimization": {"stage": stage, **(zero or {})},
        **top,
    }
    if optimizer["type"] == "SGD":
        config["zero_allow_untested_optimizer"] = True
    return {"name": name, "steps": steps, "model": model, "config": config}
