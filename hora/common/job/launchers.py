"""What each launcher's variables say about this process, and where its job's store is.

One reader per launcher (torchrun, Open MPI, MPICH/Intel MPI, MVAPICH, SLURM's ``srun``, and
torch.distributed's ``env://`` convention) turns that launcher's environment variables into a
:class:`Reading`: rank and size, local rank and size where the launcher exports them, the node
index where it has one, and a :class:`StorePlan` that says how the job's key-value store is
reached. :data:`READERS` lists them in the order they are tried. This module reads torchrun's
and the ``env://`` variables; the MPI launchers are read in :mod:`hora.common.job.mpi_launchers`,
``srun`` in :mod:`hora.common.job.slurm`, and what every reader shares is
:mod:`hora.common.job.launcher_reading`'s (their names are re-exported here). Readers only parse;
choosing between launchers and checking that they agree is :mod:`hora.common.job.topology`'s job,
and reaching the store is :mod:`hora.common.job.joining`'s. ``horarun``'s own ``HORA_*``
variables are read in :mod:`hora.common.job.topology`.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping
from dataclasses import replace

from hora.common.job.launcher_reading import (
    DERIVED_PORT_HIGH,
    DERIVED_PORT_LOW,
    TORCH_DEFAULT_PORT,
    LauncherError,
    Reading,
    StorePlan,
    derived_port,
    integer_variable,
    optional_integer_variable,
    port_number,
)
from hora.common.job.mpi_launchers import (
    MPIJOB_HOSTFILE,
    first_hostfile_host,
    import_mpi,
    mpi4py_usable,
    mpi_identity,
    read_mpi,
)
from hora.common.job.slurm import (
    cross_from_counts,
    expand_hostlist,
    expand_tasks_per_node,
    read_slurm,
)

__all__ = [
    "DERIVED_PORT_HIGH",
    "DERIVED_PORT_LOW",
    "MPIJOB_HOSTFILE",
    "READERS",
    "TORCH_DEFAULT_PORT",
    "LauncherError",
    "Reading",
    "StorePlan",
    "cross_from_counts",
    "derived_port",
    "expand_hostlist",
    "expand_tasks_per_node",
    "first_hostfile_host",
    "import_mpi",
    "mpi4py_usable",
    "mpi_identity",
    "read_env_method",
    "read_mpi",
    "read_slurm",
    "read_torchrun",
]


def _torch_variables(env: Mapping[str, str], launcher: str, local_required: bool) -> Reading:
    """This process as torch.distributed's variables place it (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), before its launcher says where the store is."""
    rank = integer_variable(env, "RANK", launcher)
    size = integer_variable(env, "WORLD_SIZE", launcher)
    if local_required:
        local_rank: int | None = integer_variable(env, "LOCAL_RANK", launcher)
        local_size: int | None = integer_variable(env, "LOCAL_WORLD_SIZE", launcher)
    else:
        local_rank = optional_integer_variable(env, "LOCAL_RANK", launcher)
        local_size = optional_integer_variable(env, "LOCAL_WORLD_SIZE", launcher)
    return Reading(
        launcher=launcher,
        rank=rank,
        size=size,
        rank_var="RANK",
        size_var="WORLD_SIZE",
        local_rank=local_rank,
        local_size=local_size,
        cross_rank=None,
        cross_size=None,
        hostname=socket.gethostname(),
        plan=StorePlan(),
    )


def read_torchrun(env: Mapping[str, str]) -> Reading | None:
    """torchrun (``torch.distributed.run``): present when ``TORCHELASTIC_RUN_ID`` is set.

    The store is the agent's ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` when
    ``TORCHELASTIC_USE_AGENT_STORE=True`` (every rank connects as a client, as
    ``init_process_group("env://")`` does); otherwise rank 0 starts one there.
    """
    if "TORCHELASTIC_RUN_ID" not in env:
        return None
    launcher = "torchrun"
    place = _torch_variables(env, launcher, local_required=True)
    size, local_size = place.size, place.local_size
    group_rank = optional_integer_variable(env, "GROUP_RANK", launcher)
    group_size = optional_integer_variable(env, "GROUP_WORLD_SIZE", launcher)
    if group_size is None and local_size and size % local_size == 0:
        group_size = size // local_size
    addr = env.get("MASTER_ADDR", "")
    if not addr:
        raise LauncherError(
            "torchrun started this process without MASTER_ADDR; hora cannot "
            "find the job's store. Is this a torchrun older than 1.9?"
        )
    port = port_number(env.get("MASTER_PORT", ""), "MASTER_PORT")
    run_id = env["TORCHELASTIC_RUN_ID"] or "none"
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "") == "True"
    plan = StorePlan(
        addr=addr,
        port=port,
        host=not agent_store and place.rank == 0,
        shared=agent_store,
        prefix=f"hora/{run_id}/",
        job_id=f"torchrun-{run_id}",
        how=(
            f"torchrun's agent store at MASTER_ADDR:MASTER_PORT={addr}:{port}"
            if agent_store
            else f"a store started by rank 0 at MASTER_ADDR:MASTER_PORT={addr}:{port}"
        ),
    )
    # torchrun gives every node the same number of workers.
    return replace(
        place, cross_rank=group_rank, cross_size=group_size, plan=plan, group_size=group_size
    )


def read_env_method(env: Mapping[str, str]) -> Reading | None:
    """torch.distributed's ``env://`` variables without torchrun: ``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT`` (e.g. Kubeflow's PyTorchJob, or a script that exports them).

    Rank 0 starts the store at ``MASTER_ADDR:MASTER_PORT``, as ``init_process_group`` does.
    """
    if "WORLD_SIZE" not in env or "RANK" not in env:
        return None
    place = _torch_variables(env, "torch.distributed env:// variables", local_required=False)
    rank, size = place.rank, place.size
    plan = StorePlan()
    if size > 1:
        addr = env.get("MASTER_ADDR", "")
        if not addr:
            raise LauncherError(
                f"RANK={rank} and WORLD_SIZE={size} are set but MASTER_ADDR is not: set "
                "MASTER_ADDR and MASTER_PORT (rank 0's host and a free port), as for "
                "init_process_group('env://'), or unset RANK and WORLD_SIZE."
            )
        port = port_number(env.get("MASTER_PORT", str(TORCH_DEFAULT_PORT)), "MASTER_PORT")
        plan = StorePlan(
            addr=addr,
            port=port,
            host=rank == 0,
            job_id=f"env-{addr}:{port}",
            exchange=True,
            how=f"a store started by rank 0 at MASTER_ADDR:MASTER_PORT={addr}:{port}",
        )
    all_local = place.local_size == size
    return replace(
        place,
        cross_rank=0 if all_local else None,
        cross_size=1 if all_local else None,
        plan=plan,
    )


# Detection order: the launcher that started this process is the innermost one, and the
# innermost launchers come first (torchrun under srun, Open MPI under srun). ``env://`` variables
# are last: any launcher may have left them behind.
READERS: dict[str, Callable[[Mapping[str, str], Callable[[str], bool]], Reading | None]] = {
    "torchrun": lambda env, _: read_torchrun(env),
    "mpi": read_mpi,
    "slurm": lambda env, _: read_slurm(env),
    "env": lambda env, _: read_env_method(env),
}
