"""The training engine: DeepSpeed's ``initialize`` and verbs over a ZeRO strategy.

engine, optimizer, loader, scheduler = zerosim.initialize(model=model, config=cfg)
for x, y in loader:
    loss = engine(x, y)      # forward on this rank's micro-batch
    engine.backward(loss)    # gradients of loss / gradient_accumulation_steps
    engine.step()            # at the accumulation boundary: reduce, clip, update, gather

engine.py       Engine: the training verbs, accumulation, loss scaling, clipping
build.py        initialize(): the config and model checks, then the engine's parts
consistency.py  every rank loaded the same config and built the same model
guards.py       misuse of the verbs, caught before anything is computed or sent
reporting.py    DeepSpeed's reporting: get_global_grad_norm() per stage, the step log
state.py        memory report and totals, save_16bit_model
"""

from zerosim.engine.build import initialize
from zerosim.engine.engine import Engine

__all__ = ["Engine", "initialize"]
