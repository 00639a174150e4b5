"""Build a GPT partitioned with zero.Init, re-initialise a weight with GatheredParameters, train.

    mpirun -n 4 python examples/tie_weights_in_zero_init.py     (or plain python: one rank)

No rank ever holds the whole model: every parameter is cut to its chunk as its module creates it.
To change a weight after construction, gather it for a ``with`` block and name the rank whose
changes count (``modifier_rank``); every rank then keeps its chunk of them.
"""

from __future__ import annotations

import numpy as np

import zerosim as zs
from zerosim.comm import default_comm

CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100},
}


def main() -> None:
    comm = default_comm()
    data = zs.data.CharDataset(block_size=16)
    with zs.zero.Init(comm=comm, config=CONFIG):
        model = zs.nn.GPT(data.vocab_size, 16, n_layer=2, n_head=2, n_embd=32, seed=comm.rank)
    # Re-initialise the output layer from the token embedding (a copy, not a tie): gather both,
    # let rank 0 write, and every rank keeps its chunk of rank 0's values.
    head, embedding = model.lm_head.weight, model.wte.weight
    with zs.zero.GatheredParameters([head, embedding], modifier_rank=0):
        head.data[...] = embedding.data
    engine, _, loader, _ = zs.initialize(model, CONFIG, comm=comm, training_data=data)
    for step, (x, y) in zip(range(20), loader, strict=False):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        if comm.rank == 0 and step % 5 == 0:
            print(f"step {step:3d}  loss {loss:.3f}")
    with zs.zero.GatheredParameters(engine.module.lm_head.weight):
        norm = float(np.linalg.norm(engine.module.lm_head.weight.data))
    if comm.rank == 0:
        print(f"|lm_head.weight| after training: {norm:.4f}")


if __name__ == "__main__":
    main()
