"""The cross-rank check: every rank of a group called the same collective with the same dtype,
size and root (a mismatch would otherwise hang or corrupt memory).

Each rank sends a signature of a few int64 (``SIGNATURE_FIELDS``) in one tiny exchange that the
world provides in two halves (``Communicator.post_signature`` sends, ``signatures_agree`` waits
and says whether every rank's is equal), so that the message travels while this rank writes its
ledger record. When they differ, ``disagreement`` builds the error every rank raises.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from zerosim.backend import dtype_name

OP_CODES = {
    "all_gather": 1,
    "reduce_scatter": 2,
    "all_reduce": 3,
    "broadcast": 4,
    "all_to_all": 5,
    "barrier": 6,
    "reduce": 7,
}
# what the cross-rank check compares, one int64 each ("pieces": a hash of uneven counts, or 0)
SIGNATURE_FIELDS = ("op", "dtype", "count", "root", "pieces")


@functools.cache
def dtype_code(dtype: Any) -> int:
    """A small non-negative int naming a dtype, for the cross-rank argument check."""
    code = np.frombuffer(dtype_name(dtype).encode()[:8].ljust(8), dtype=np.int64)[0]
    return int(code) & 0x7FFFFFFFFFFFFFFF


def signature(
    op: str, dtype: Any, count: int, root: int, counts: tuple[int, ...] | None
) -> tuple[int, ...]:
    """What this rank sends: one int per ``SIGNATURE_FIELDS``."""
    pieces = 0 if counts is None else hash(counts) & 0x7FFFFFFFFFFFFFFF
    return (OP_CODES[op], dtype_code(dtype), count, int(root), pieces)


def disagreement(
    group: str, rank: int, op: str, dtype: Any, mine: tuple[int, ...], every: list
) -> ValueError:
    """The error every rank raises when the signatures differ (``every``: each rank's)."""
    names = {v: k for k, v in OP_CODES.items()}
    described = ", ".join(
        f"rank {r}: {names.get(s[0], '?')}(count={s[2]}, root={s[3]})"
        + ("" if s[4] == mine[4] else " with other counts")
        + ("" if s[1] == mine[1] else " with another dtype")
        for r, s in enumerate(every)
    )
    return ValueError(
        f"ranks of group {group!r} called different collectives or "
        f"passed different sizes/dtypes/roots: {described}; every rank must "
        f"make the same call ({op} here on rank {rank}, "
        f"dtype {dtype_name(dtype)})"
    )
