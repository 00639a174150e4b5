"""The optimizer update rules as functions over arrays: one implementation for every caller.

The torch-like classes (``zerosim.optim.Adam`` …) call these on whole parameters; the
ZeRO engine calls them on its flat float32 shards. Every function updates ``param`` and
its named state arrays **in place** and returns nothing (``nadam`` returns its running
momentum product, ``lamb`` its trust ratio). Arguments follow one pattern::

    rule(param, grad, *state_arrays, step=t, lr=…, <hyperparameters>, scratch=None)

- ``param``: float64/float32/float16/bfloat16 array (numpy or cupy; float64/float32 on an
  Array API standard namespace such as array_api_strict), updated in place.
- ``grad``: same shape; read only, never modified.
- state arrays: same shape, dtype ``state_dtype(param.dtype)`` (float32 for 16-bit
  parameters); create them with ``zeros_state(param)``.
- ``step``: the number of this update, 1 on the first (only rules with bias corrections).
- ``scratch``: optional reusable work buffer from ``make_scratch(param)``. The rules walk
  the arrays in cache-sized blocks, so the work buffers are a few blocks, never
  full-size; without ``scratch`` they are allocated on each call.

Two rules need whole parameters and do not fit the pattern: ``lamb`` (a trust ratio of
whole-parameter norms; split into ``lamb_moments``, ``trust_ratio`` and ``lamb_apply`` for
ZeRO) and ``muon_update`` (Newton–Schulz on a whole matrix; returns the update, which
``muon_apply`` steps).

The formulas, with their sources, are in each function's docstring; docs/optim.md
compares them with torch.optim and Keras.
"""

from zerosim.optim.functional.adagrad import adagrad
from zerosim.optim.functional.adam import adam
from zerosim.optim.functional.adamax import adamax
from zerosim.optim.functional.common import (
    SCRATCH_SLOTS,
    VARIANTS,
    block_length,
    make_scratch,
    state_dtype,
    zeros_state,
)
from zerosim.optim.functional.lamb import (
    lamb,
    lamb_apply,
    lamb_moments,
    lamb_step_size,
    trust_ratio,
)
from zerosim.optim.functional.lion import lion
from zerosim.optim.functional.muon import muon, muon_apply, muon_update
from zerosim.optim.functional.nadam import nadam
from zerosim.optim.functional.radam import radam
from zerosim.optim.functional.rmsprop import rmsprop
from zerosim.optim.functional.sgd import sgd

__all__ = [
    "SCRATCH_SLOTS",
    "VARIANTS",
    "adagrad",
    "adam",
    "adamax",
    "block_length",
    "lamb",
    "lamb_apply",
    "lamb_moments",
    "lamb_step_size",
    "lion",
    "make_scratch",
    "muon",
    "muon_apply",
    "muon_update",
    "nadam",
    "radam",
    "rmsprop",
    "sgd",
    "state_dtype",
    "trust_ratio",
    "zeros_state",
]
