"""A ledger record: one collective call as one rank saw it, and nccl-tests' bus-bandwidth factor.

Its own module so that the ledger, the flight recorder and DeepSpeed's log layout can all name it
without importing each other (``comm/ledger.py`` describes the fields' conventions).
"""

from __future__ import annotations

from dataclasses import dataclass


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw · factor."""
    if n <= 1:
        return 0.0 if op != "broadcast" else 1.0
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


@dataclass(slots=True)
class Record:
    """One collective call as seen by one rank."""

    op: str
    phase: str
    group: str
    dtype: str
    elements: int  # elements of the full buffer (S / itemsize)
    size_bytes: int  # S
    bytes_sent: int
    bytes_recv: int
    peers: int  # ranks in the group
    step: int
    counted: str  # "model" (ring formula) or "wire" (our ring's real sends)
    blocking: bool
    start: float  # seconds since the ledger was created
    wall_time: float | None = None  # None until a non-blocking call is waited on
    intra_bytes: int = 0  # of bytes_sent, to ranks on this rank's node
    inter_bytes: int = 0  # of bytes_sent, to ranks on other nodes
    # how the data travelled: "host" (NumPy buffers to MPI; every LocalWorld call, whose ranks
    # share one process and copy arrays in their own namespace), "staged" (a device array copied
    # through host memory), "cuda-aware" (device memory handed to MPI), "nccl" (comm/cuda.py)
    transport: str = "host"

    @property
    def algbw(self) -> float:
        return self.size_bytes / self.wall_time if self.wall_time else 0.0

    @property
    def busbw(self) -> float:
        return self.algbw * busbw_factor(self.op, self.peers)
