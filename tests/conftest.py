"""Shared pytest set-up: make the helper modules importable by name.

The test files are in tests/; what they share (the mpirun launcher ``mpi_helpers``, the engine and
collective cases, the scripts ``mpirun`` runs) is in tests/helpers/, and ``torch_twins`` (the
torch models the nn tests compare with) beside the tests. Both folders go on ``sys.path``, so a
test says ``from mpi_helpers import run_mpi`` and a worker started as ``python
tests/helpers/X_worker.py`` finds its siblings the same way.
"""

import logging
import os
import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))


# --- DeepSpeed in this process (tests/test_deepspeed_config.py, test_deepspeed_fp16_stage0.py) ---


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def deepspeed_world():
    """A one-process gloo group for deepspeed.initialize, fp16 allowed on the CPU (patched)."""
    deepspeed = pytest.importorskip("deepspeed", reason="the DeepSpeed oracle tests need DeepSpeed")
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import logger

    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }
    saved_env = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    level = logger.level
    logger.setLevel(logging.ERROR)
    started = not torch.distributed.is_initialized()
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    accelerator = get_accelerator()
    before = vars(accelerator).get("is_fp16_supported")  # an instance attribute set earlier
    accelerator.is_fp16_supported = lambda: True  # the patch: DeepSpeed's CPU accelerator says no
    try:
        yield
    finally:
        if before is None:
            del accelerator.is_fp16_supported
        else:
            accelerator.is_fp16_supported = before
        if started:
            deepspeed.comm.destroy_process_group()
        logger.setLevel(level)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
