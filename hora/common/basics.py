"""Horovod's questions about the running job: who am I, how many are we, what carries the data.

Every answer comes from the running :class:`~hora.common.runtime.Session`; each raises
``ValueError`` before ``init`` (Horovod's "not initialized"). Starting and stopping are
:mod:`hora.common.startup.lifecycle`'s, what the installation can do :mod:`hora.common.build_info`'s.
"""

from __future__ import annotations

from hora.common.engine import Engine
from hora.common.job.topology import Topology
from hora.common.runtime import runtime, session


def is_initialized() -> bool:
    """Whether ``init`` has run (and ``shutdown`` has not)."""
    return runtime().session is not None


def engine() -> Engine:
    """The running engine.

    Raises:
        ValueError: ``init`` has not been called.
    """
    return session().engine


def topology() -> Topology:
    """Where this process sits in the running job.

    Raises:
        ValueError: ``init`` has not been called.
    """
    return session().topology


def size() -> int:
    """Number of processes in the job."""
    return topology().size


def rank() -> int:
    """This process's global rank."""
    return topology().rank


def local_size() -> int:
    """Number of processes on this host."""
    return topology().local_size


def local_rank() -> int:
    """This process's rank among the processes on this host (use it to pick the GPU)."""
    return topology().local_rank


def cross_size() -> int:
    """Number of hosts that have a process with this process's local rank."""
    return topology().cross_size


def cross_rank() -> int:
    """Index of this host among the hosts with a process of this local rank."""
    return topology().cross_rank


def is_homogeneous() -> bool:
    """Whether every host runs the same number of processes."""
    t = topology()
    return t.local_size * t.cross_size == t.size


def data_path(process_set_id: int = 0) -> str:
    """hora's own question: the path a process set's CPU collectives take (``shm`` when its
    ranks share a host, ``hierarchical`` across hosts, ``gloo``, ``mpi``); see
    docs/deployment.md, "Choosing a data path".

    Raises:
        ValueError: ``init`` has not been called.
    """
    return engine().data_path(process_set_id)


def gpu_data_path(process_set_id: int = 0) -> str:
    """The path a process set's CUDA tensors took: ``nccl`` once they went over NCCL, else
    ``host`` (host memory, with ``HORA_GPU_OPERATIONS=host`` or ranks sharing a GPU).

    Raises:
        ValueError: ``init`` has not been called.
    """
    return engine().gpu_data_path(process_set_id)


def negotiation_path() -> str:
    """The path negotiation's exchanges take (``shm`` or ``gloo``, ``mpi``)."""
    return engine().data_path(-1)


def gloo_enabled() -> bool:
    """Whether the running job is on hora's own data path (``HORA_CPU_OPERATIONS=gloo``, the
    default: shared memory within a host, Gloo across hosts), not on MPI's."""
    from hora.common.build_info import gloo_built

    current = runtime().session
    return current is not None and current.cpu_operations == "gloo" and gloo_built()


def mpi_enabled() -> bool:
    """Whether the running job moves data over MPI (``HORA_CPU_OPERATIONS=mpi``)."""
    current = runtime().session
    return current is not None and current.cpu_operations == "mpi"


def mpi_threads_supported() -> bool:
    """Whether the job's MPI library runs with ``MPI_THREAD_MULTIPLE``.

    Raises:
        ValueError: the running job does not use MPI (not initialized, or over Gloo).
    """
    current = runtime().session
    if current is None or current.mpi_comm is None:
        raise ValueError(
            "MPI is not enabled: initialize hora in a job started by mpirun with "
            "HORA_CPU_OPERATIONS=mpi (or horarun --mpi), or with hvd.init(comm=...)."
        )
    from hora.common.transport.mpi import import_mpi

    mpi = import_mpi()
    return bool(mpi.Query_thread() == mpi.THREAD_MULTIPLE)
