"""Communicators: one interface (``Communicator``), two worlds (``MPIComm``, ``LocalWorld``).

``MPIComm`` is imported on first use, so notebooks that only use ``LocalWorld`` never
initialise MPI.
"""

from typing import Any

from zerosim.comm.base import Communicator
from zerosim.comm.call import Handle
from zerosim.comm.ledger import Ledger
from zerosim.comm.local import LocalComm, LocalWorld, WorldAborted
from zerosim.comm.record import Record

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


# Variables that announce the job size, by launcher: MPICH/Intel MPI (Hydra), Open MPI, PMIx,
# MPICH's gforker.
SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")
# Prefixes of variables that some launcher set: then MPI itself is asked for the world size.
LAUNCHER_PREFIXES = (
    "PMI_",
    "PMIX_",
    "OMPI_",
    "HYDRA_",
    "MPIR_",
    "MPI_LOCAL",
    "I_MPI_",
    "MV2_",
    "PALS_",
    "SLURM_STEP",
    "FLUX_",
    "JSM_",
)


def _announced_size() -> tuple[int, str | None]:
    """(job size, the variable that said so) from the launcher's environment; (1, None)."""
    import os

    for var in SIZE_VARIABLES:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var]), var
    return 1, None


def world_size_from_env() -> int:
    """The job size the launcher announced (mpirun/mpiexec/srun), or 1 outside any launcher."""
    return _announced_size()[0]


def _launched() -> bool:
    """True when a launcher seems to have started this process, or MPI is already running."""
    import os
    import sys

    if "mpi4py.MPI" in sys.modules:
        return True
    return any(name.startswith(LAUNCHER_PREFIXES) for name in os.environ)


def default_comm() -> Communicator:
    """The communicator of ``initialize(comm=None)``: MPIComm over COMM_WORLD when MPI runs more
    than one rank, else a 1-rank world.

    The launcher's environment decides without starting MPI when it names the job size. Started
    by a launcher zerosim does not know (some variable of its kind is set, or mpi4py is already
    imported), MPI itself is asked. A launcher that announced N > 1 ranks to a process whose MPI
    sees one rank (mpi4py built against another MPI than the launcher's, or ``srun`` without an
    MPI plugin) is an error: N copies of a one-rank job would each train alone.
    """
    import os
    import warnings

    size, var = _announced_size()
    if size > 1 or _launched():
        try:
            from mpi4py import MPI
        except ImportError as err:
            if size > 1:
                raise RuntimeError(
                    f"the launcher started {size} ranks ({var}={size}) but mpi4py cannot be "
                    f"imported ({err}); pip install mpi4py mpich, or pass comm=LocalWorld(n)"
                ) from err
            return LocalWorld(1).comms()[0]
        mpi_size = MPI.COMM_WORLD.Get_size()
        if mpi_size > 1:
            from zerosim.comm.mpi import MPIComm

            return MPIComm()
        if size > 1:
            raise RuntimeError(
                f"the launcher started {size} ranks ({var}={size}) but MPI sees a world of "
                f"1 rank in this process: mpi4py is built against another MPI than the "
                f"launcher's ({MPI.Get_library_version().splitlines()[0].strip()}); "
                f"each rank would train alone"
            )
        tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "")
        if tasks.isdigit() and int(tasks) > 1:
            warnings.warn(
                f"srun started {tasks} tasks (SLURM_STEP_NUM_TASKS) but MPI sees a world of 1 "
                f"rank: each task trains alone; give srun an MPI plugin (srun --mpi=pmix)",
                stacklevel=2,
            )
    return LocalWorld(1).comms()[0]
