"""Every rank's text on every rank: the one helper for gathering bytes of unequal length."""

from __future__ import annotations

from typing import Any

import numpy as np


def gather_text(comm: Any, text: str) -> list[str]:
    """Every rank's ``text``, in rank order (two all-gathers: lengths, then padded bytes)."""
    data = np.frombuffer(text.encode(), dtype=np.uint8)
    lengths = np.empty(comm.size, dtype=np.int64)
    comm.all_gather(lengths, np.array([data.size], dtype=np.int64))
    padded = np.zeros(int(lengths.max()), dtype=np.uint8)
    padded[: data.size] = data
    every = np.empty(comm.size * padded.size, dtype=np.uint8)
    comm.all_gather(every, padded)
    width = padded.size
    return [every[r * width : r * width + lengths[r]].tobytes().decode() for r in range(comm.size)]
