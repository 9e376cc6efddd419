"""The MPI launchers (Open MPI, MPICH/Intel MPI, MVAPICH): their variables read into a
:class:`~hora.common.job.launcher_reading.Reading`, and mpi4py where it may carry the store's
address.

:func:`mpi_identity` says which MPI set its variables; :func:`read_mpi` reads rank, size and
local rank and size, and plans where rank 0's store is: sent with mpi4py when
:func:`mpi4py_usable` (mpi4py imports and its MPI is the launcher's), else the address given, loopback
when every rank is on this host, or the first host of the hostfile (:func:`first_hostfile_host`),
on a port given or derived from the job id. :func:`import_mpi` imports ``mpi4py.MPI`` without
initializing MPI. Choosing MPI over another launcher is :mod:`hora.common.job.topology`'s job, and
sending the address :mod:`hora.common.job.joining`'s.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import warnings
from collections.abc import Callable, Mapping
from types import ModuleType

from hora.common.job.launcher_reading import (
    LauncherError,
    Reading,
    StorePlan,
    derived_port,
    explicit_address,
    explicit_port,
    integer_variable,
    optional_integer_variable,
)
from hora.common.vocabulary import settings_table as table
from hora.common.vocabulary.config import read

logger = logging.getLogger("hora")

# Kubeflow's MPIJob mounts its hostfile here; Open MPI is pointed at it through MCA variables.
MPIJOB_HOSTFILE = "/etc/mpi/hostfile"
_HOSTFILE_VARIABLES = (
    "OMPI_MCA_orte_default_hostfile",
    "OMPI_MCA_prte_default_hostfile",
    "PRTE_MCA_prte_default_hostfile",
)


def first_hostfile_host(path: str) -> str | None:
    """The first host named in an Open MPI (``host slots=N``) or MPICH (``host:N``) hostfile."""
    try:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                words = line.split("#", 1)[0].split()
                if words:
                    return words[0].split(":", 1)[0]
    except OSError:
        return None
    return None


def _mpi_plan(
    env: Mapping[str, str],
    launcher: str,
    rank: int,
    all_local: bool,
    job_id: str,
    mpi4py: bool,
) -> StorePlan:
    """Where an MPI job's store is (rank 0 starts it).

    In order: ``mpi4py`` (rank 0 picks a free port, its own address unless one is given, and a
    fresh secret, and broadcasts them); ``HORA_RENDEZVOUS_ADDR``/``MASTER_ADDR`` with
    ``HORA_RENDEZVOUS_PORT``/``MASTER_PORT``; loopback when every rank is on this host; the first
    host of the MPIJob/Open MPI hostfile. The port, when not given, is derived from the job id.
    """
    addr, addr_var = explicit_address(env)
    port, port_var = explicit_port(env)
    if mpi4py:
        return StorePlan(
            addr=addr,
            port=port or 0,
            host=rank == 0,
            job_id=job_id,
            mpi4py=True,
            exchange=True,
            how=f"rank 0's address and port, sent with mpi4py ({launcher})",
        )
    how = f"{addr_var}={addr}" if addr else ""
    if not addr and all_local:
        addr, how = "127.0.0.1", "loopback (every rank on this host)"
    if not addr:
        addr, how = _hostfile_host(env)
    if not addr:
        raise LauncherError(
            f"this {launcher} job spans several hosts, and hora cannot tell where rank 0's store "
            "is: install mpi4py (pip install mpi4py) so that rank 0 can send its address, or set "
            "MASTER_ADDR (rank 0's host name) and MASTER_PORT for every rank, e.g. "
            "`mpirun -x MASTER_ADDR=$(hostname) -x MASTER_PORT=29500 ...`."
        )
    derived = port is None
    if port is None:
        if not job_id:
            raise LauncherError(
                f"{launcher} exports no job id to derive a port from: set MASTER_PORT (or "
                "HORA_RENDEZVOUS_PORT) to a free port for every rank, e.g. `mpiexec -genv "
                "MASTER_PORT 29500 ...`, or install mpi4py so that rank 0 picks one."
            )
        port, port_var = derived_port(job_id), f"derived from the job id {job_id!r}"
    return StorePlan(
        addr=addr,
        port=port,
        host=rank == 0,
        job_id=job_id or f"{addr}:{port}",
        derived=derived,
        exchange=True,
        how=f"a store started by rank 0 at {addr}:{port} ({how}; port {port_var})",
    )


def _hostfile_host(env: Mapping[str, str]) -> tuple[str, str]:
    """``(host, how)``: the first host of the hostfile Open MPI is pointed at (or of the
    MPIJob's), and where it was read; ``("", "")`` when there is none."""
    for variable in _HOSTFILE_VARIABLES:
        if env.get(variable):
            path = env[variable]
            break
    else:
        path = MPIJOB_HOSTFILE if os.path.exists(MPIJOB_HOSTFILE) else ""
    first = first_hostfile_host(path) if path else None
    if first:
        return first, f"the first host of {path}"
    return "", ""


def mpi_identity(
    env: Mapping[str, str],
) -> tuple[str, tuple[str, str], tuple[str, str], str] | None:
    """Which MPI set its variables: ``(launcher, (rank, size) variables, (local rank, local
    size) variables, job id)``, or ``None``."""
    if "OMPI_COMM_WORLD_SIZE" in env:
        # PMIX_NAMESPACE names the job (e.g. "prterun-vm-5489@1").
        job_id = env.get("PMIX_NAMESPACE", "") or env.get("OMPI_MCA_ess_base_jobid", "")
        return (
            "Open MPI",
            ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
            job_id,
        )
    if "PMI_SIZE" in env and "PMI_RANK" in env:
        # Hydra exports no job id; srun --mpi=pmi2 does.
        return (
            "MPICH/Intel MPI",
            ("PMI_RANK", "PMI_SIZE"),
            ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
            env.get("PMI_JOBID", ""),
        )
    if "MV2_COMM_WORLD_SIZE" in env:
        return (
            "MVAPICH",
            ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"),
            ("MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
            "",
        )
    return None


def read_mpi(env: Mapping[str, str], use_mpi4py: Callable[[str], bool]) -> Reading | None:
    """Open MPI, MPICH/Intel MPI (Hydra's PMI variables) or MVAPICH, whichever set its variables.

    Args:
        env: the environment.
        use_mpi4py: called with the launcher's name; whether rank 0 may send the store's address
            with mpi4py (the caller knows whether mpi4py is importable and built for this MPI).
    """
    identity = mpi_identity(env)
    if identity is None:
        return None
    launcher, names, local_names, job_id = identity
    rank = integer_variable(env, names[0], launcher)
    size = integer_variable(env, names[1], launcher)
    local_rank = optional_integer_variable(env, local_names[0], launcher)
    local_size = optional_integer_variable(env, local_names[1], launcher)
    all_local = local_size == size
    return Reading(
        launcher=launcher,
        rank=rank,
        size=size,
        rank_var=names[0],
        size_var=names[1],
        local_rank=local_rank,
        local_size=local_size,
        cross_rank=0 if all_local else None,
        cross_size=1 if all_local else None,
        hostname=socket.gethostname(),
        plan=(
            _mpi_plan(env, launcher, rank, all_local, job_id, use_mpi4py(launcher))
            if size > 1
            else StorePlan()
        ),
    )


def mpi4py_usable(launcher: str) -> bool:
    """Whether rank 0 may send the store's address with mpi4py under ``launcher``.

    True when ``HORA_MPI4PY`` is not 0, mpi4py imports, and its MPI library is the launcher's
    (an mpi4py built for Open MPI started by MPICH's ``mpiexec`` would see a world of one).
    Importing ``mpi4py.MPI`` here does not initialize MPI; :func:`join` does.
    """
    if not read(table.MPI4PY):
        return False
    try:
        mpi = import_mpi()
    except ImportError:
        return False
    except Exception as exc:  # a broken MPI install must not stop hvd.init()
        logger.debug("mpi4py is installed but cannot be loaded (%s); not using it", exc)
        return False
    version = str(mpi.Get_library_version())
    if launcher == "Open MPI":
        matches = "Open MPI" in version
    elif launcher == "MVAPICH":
        matches = "MVAPICH" in version
    else:
        matches = "Open MPI" not in version
    if not matches:
        logger.debug(
            "mpi4py's MPI (%s) is not %s's; rendezvous without mpi4py",
            version.splitlines()[0] if version else "?",
            launcher,
        )
    return matches


def import_mpi() -> ModuleType:
    """``mpi4py.MPI``, imported without initializing MPI (hora initializes it once it knows
    it is the launcher's MPI, and finalizes it at exit)."""
    if "mpi4py.MPI" not in sys.modules:
        import mpi4py

        # Initialize MPI ourselves, only once we know it is the launcher's MPI; finalize at exit.
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = True
        with warnings.catch_warnings():
            # mpi4py warns at import about another MPI's launcher variables; hora says it better.
            warnings.simplefilter("ignore", RuntimeWarning)
            from mpi4py import MPI
        return MPI
    return sys.modules["mpi4py.MPI"]
