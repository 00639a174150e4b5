"""Checkpoints: sharded engine checkpoints that reshard at load, and their file format.

``sharded.py`` saves and loads an engine (every rank writes what it owns; any world size, stage
and layout loads); ``files.py`` is the on-disk format (crash-safe writes, metadata, checksums,
memory-mapped reads) and ``consolidate``, which needs no communicator. docs/checkpoints.md.
"""

from zerosim.checkpoint.files import (
    CheckpointError,
    CheckpointNotFoundError,
    consolidate,
    load_16bit_model,
)
from zerosim.checkpoint.sharded import load_checkpoint, save_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "consolidate",
    "load_16bit_model",
    "load_checkpoint",
    "save_checkpoint",
]
