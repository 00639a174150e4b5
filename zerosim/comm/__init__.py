"""Communicators: one interface (``Communicator``), two worlds (``MPIComm``, ``LocalWorld``).

``MPIComm`` is imported on first use, so notebooks that only use ``LocalWorld`` never
initialise MPI.
"""

from typing import Any

from zerosim.comm.base import Communicator, Handle
from zerosim.comm.ledger import Ledger, Record
from zerosim.comm.local import LocalComm, LocalWorld, WorldAborted

__all__ = [
    "Communicator",
    "Handle",
    "Ledger",
    "LocalComm",
    "LocalWorld",
    "MPIComm",
    "Record",
    "WorldAborted",
    "default_comm",
    "world_size_from_env",
]


def __getattr__(name: str) -> Any:
    if name == "MPIComm":
        from zerosim.comm.mpi import MPIComm

        return MPIComm
    raise AttributeError(f"module 'zerosim.comm' has no attribute {name!r}")


def world_size_from_env() -> int:
    """The job size the launcher announced (mpirun/mpiexec/srun), or 1 outside any launcher."""
    import os

    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


def default_comm() -> Communicator:
    """MPIComm over COMM_WORLD under a launcher with more than one rank, else a 1-rank world."""
    if world_size_from_env() > 1:
        from zerosim.comm.mpi import MPIComm

        return MPIComm()
    return LocalWorld(1).comms()[0]
