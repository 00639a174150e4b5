"""zerosim: ZeRO-style sharded data parallelism with NumPy arrays and MPI.

``docs/concepts.md`` defines the vocabulary (partition, shard, owner, flat buffer, bucket).
"""

from zerosim import analysis, comm, data, nn, optim, zero
from zerosim.comm import LocalWorld
from zerosim.config import Config, load_config
from zerosim.engine import Engine, initialize
from zerosim.engine import fsdp2_api as fsdp  # torch's fully_shard and MixedPrecisionPolicy
from zerosim.errors import ConfigError

__version__ = "0.1.0"
__all__ = [
    "Config",
    "ConfigError",
    "Engine",
    "LocalWorld",
    "analysis",
    "comm",
    "data",
    "fsdp",
    "initialize",
    "load_config",
    "nn",
    "optim",
    "zero",
]
