"""Optimizers without autodiff: update rules over arrays, wrapped in torch.optim's API.

``zerosim.optim.functional`` holds the rules (one implementation, used both by these
classes on whole parameters and by the ZeRO engine on flat shards); the classes manage
param groups, state and state_dict exactly as torch.optim does. See docs/optim.md.
"""

from zerosim.optim import functional, lr_scheduler, swa_utils
from zerosim.optim.adagrad import Adagrad
from zerosim.optim.adam import Adam, AdamW
from zerosim.optim.adamax import Adamax
from zerosim.optim.lamb import Lamb
from zerosim.optim.lion import Lion
from zerosim.optim.muon import Muon
from zerosim.optim.nadam import NAdam
from zerosim.optim.optimizer import Optimizer
from zerosim.optim.radam import RAdam
from zerosim.optim.rmsprop import RMSprop
from zerosim.optim.sgd import SGD

__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "Lamb",
    "Lion",
    "Muon",
    "NAdam",
    "Optimizer",
    "RAdam",
    "RMSprop",
    "functional",
    "lr_scheduler",
    "swa_utils",
]
