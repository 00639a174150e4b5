"""DeepSpeed's JSON config, read into typed frozen objects and validated before anything is built.

``load_config(config, world_size)`` (``load.py``) reads a dict or a JSON/hjson file into a
``Config`` (``top_level.py``), one frozen dataclass per section (``sections.py``,
``optimizer.py``, ``features.py``), and checks the rules across sections (``rules.py``); the
parsing primitives are in ``values.py``. ``docs/config.md`` lists every key.
"""

from zerosim.config.load import (
    REMOVED_TOP_LEVEL_KEYS,
    load_config,
    read_config_file,
    reject_unbuilt,
    resolve_batch_size,
)
from zerosim.config.optimizer import OptimizerConfig, SchedulerConfig
from zerosim.config.sections import (
    BF16Config,
    CheckpointConfig,
    FP16Config,
    LossScaleSettings,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ZeroConfig,
    ZerosimConfig,
)
from zerosim.config.top_level import Config

__all__ = [
    "BF16Config",
    "CheckpointConfig",
    "Config",
    "FP16Config",
    "LossScaleSettings",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZeroConfig",
    "ZerosimConfig",
    "load_config",
    "read_config_file",
    "resolve_batch_size",
    "REMOVED_TOP_LEVEL_KEYS",
    "reject_unbuilt",
]
