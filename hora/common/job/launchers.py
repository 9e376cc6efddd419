"""What each launcher's variables say about this process, and where its job's store is.

One reader per launcher (torchrun, Open MPI, MPICH/Intel MPI, MVAPICH, SLURM's ``srun``, and
torch.distributed's ``env://`` convention) turns that launcher's environment variables into a
:class:`Reading`: rank and size, local rank and size where the launcher exports them, the node
index where it has one, and a :class:`StorePlan` that says how the job's key-value store is
reached. Readers only parse; choosing between launchers and checking that they agree is
:mod:`hora.common.job.topology`'s job, and reaching the store is :mod:`hora.common.job.joining`'s.
``horarun``'s own ``HORA_*`` variables are read in :mod:`hora.common.job.topology`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hora.common import settings_table as table
from hora.common.config import raw, read

logger = logging.getLogger("hora")

# torch.distributed's default store port (``MASTER_PORT``'s usual value).
TORCH_DEFAULT_PORT = 29500
# Ports derived from a job id fall in this range, as Lightning and submitit do.
DERIVED_PORT_LOW = 20000
DERIVED_PORT_HIGH = 60000
# Kubeflow's MPIJob mounts its hostfile here; Open MPI is pointed at it through MCA variables.
MPIJOB_HOSTFILE = "/etc/mpi/hostfile"
_HOSTFILE_VARIABLES = (
    "OMPI_MCA_orte_default_hostfile",
    "OMPI_MCA_prte_default_hostfile",
    "PRTE_MCA_prte_default_hostfile",
)


class LauncherError(ValueError):
    """A launcher's variables are malformed or not enough to start the job."""


@dataclass(frozen=True)
class StorePlan:
    """How the processes of a job started by another launcher reach one key-value store.

    Attributes:
        addr: where every rank connects ("" when rank 0 picks it and sends it over MPI).
        port: the store's port (0 when rank 0 picks a free one and sends it over MPI).
        host: whether this process starts the store (a ``TCPStore`` server) before connecting.
        shared: the store belongs to the launcher and outlives this round of workers (torchrun's
            agent store): the ranks first agree on a fresh key prefix for this round.
        prefix: key prefix for everything hora writes (inside a launcher's shared store).
        job_id: names this job: keys it apart from other jobs when no secret is available.
        derived: ``port`` was derived from the job id (no one chose it); with a secret file,
            rank 0 listens on a random port instead and publishes it beside that file.
        mpi4py: rank 0 sends the address, port and a fresh secret to the others with
            ``mpi4py``'s ``bcast`` (see :mod:`hora.common.job.joining`).
        exchange: local and cross ranks are not all in the variables; the ranks exchange host
            names through the store to work them out.
        how: one line for logs and errors: where the address and port came from.
    """

    addr: str = ""
    port: int = 0
    host: bool = False
    shared: bool = False
    prefix: str = ""
    job_id: str = ""
    derived: bool = False
    mpi4py: bool = False
    exchange: bool = False
    how: str = ""


@dataclass(frozen=True)
class Reading:
    """This process as one launcher describes it.

    ``local_rank``/``local_size``/``cross_rank``/``cross_size`` are ``None`` where the launcher does
    not say; the ranks then work them out by exchanging host names.
    """

    launcher: str
    rank: int
    size: int
    rank_var: str
    size_var: str
    local_rank: int | None
    local_size: int | None
    cross_rank: int | None
    cross_size: int | None
    hostname: str
    plan: StorePlan
    # Whether this launcher started exactly one process per node (as the outer launcher of a
    # nested launch does: ``srun --ntasks-per-node=1`` starting one ``torchrun`` per node).
    one_per_node: bool = False
    # torchrun: number of agents (nodes) in the rendezvous round.
    group_size: int | None = None


# ---------------------------------------------------------------- parsing helpers


def _int(env: Mapping[str, str], name: str, launcher: str) -> int:
    raw = env.get(name, "")
    try:
        return int(raw)
    except ValueError:
        if not raw:
            raise LauncherError(
                f"{launcher} set some of its variables but not {name}; hora cannot tell this "
                "process's place in the job. Start the job with the launcher itself (not by "
                "copying its variables), or set HORA_LAUNCHER=none to run as a job of one."
            ) from None
        raise LauncherError(
            f"{name} must be an integer, got {raw!r} (set by {launcher})."
        ) from None


def _optional_int(env: Mapping[str, str], name: str, launcher: str) -> int | None:
    return _int(env, name, launcher) if env.get(name, "") != "" else None


def derived_port(job_id: str) -> int:
    """A port in 20000-59999 that every process of a job computes alike from its id."""
    digest = int(hashlib.sha256(job_id.encode()).hexdigest(), 16)
    return DERIVED_PORT_LOW + digest % (DERIVED_PORT_HIGH - DERIVED_PORT_LOW)


def _explicit_address(env: Mapping[str, str]) -> tuple[str, str]:
    """``(address, variable)`` from ``HORA_RENDEZVOUS_ADDR`` or ``MASTER_ADDR`` (``""`` if unset)."""
    for variable in (table.RENDEZVOUS_ADDR, table.GLOO_RENDEZVOUS_ADDR):
        value = raw(variable, env)
        if value:
            return value, variable.env
    return env.get("MASTER_ADDR", ""), "MASTER_ADDR"


def _explicit_port(env: Mapping[str, str]) -> tuple[int | None, str]:
    """``(port, variable)`` from ``HORA_RENDEZVOUS_PORT`` or ``MASTER_PORT`` (``None`` if unset)."""
    for variable in (table.RENDEZVOUS_PORT, table.GLOO_RENDEZVOUS_PORT):
        value = raw(variable, env)
        if value:
            return _port(value, variable.env), variable.env
    if env.get("MASTER_PORT"):
        return _port(env["MASTER_PORT"], "MASTER_PORT"), "MASTER_PORT"
    return None, ""


def _port(raw: str, variable: str) -> int:
    try:
        port = int(raw)
    except ValueError:
        raise LauncherError(f"{variable} must be a port number, got {raw!r}.") from None
    if not 0 < port < 65536:
        raise LauncherError(f"{variable} must be a port number between 1 and 65535, got {port}.")
    return port


# ---------------------------------------------------------------- SLURM's formats


_HOSTLIST_TOKEN = re.compile(r"([^\[\],]*)(\[[^\]]*\])?")


def expand_hostlist(text: str) -> list[str]:
    """Expand a SLURM host list such as ``node[01-03,07],gpu[1-2]-ib`` into host names.

    Handles comma-separated items, bracketed ranges with zero padding, and several bracket groups
    in one name (``rack[1-2]-node[1-2]`` gives four names, in SLURM's order). The same as
    ``scontrol show hostnames``, without needing SLURM's tools on the path. (The ``python-hostlist``
    package does this too, but it is GPL-2.0+, and hora is Apache-2.0.)

    Raises:
        LauncherError: the list is empty or malformed.
    """
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        hosts.extend(_expand_item(item, text))
    if not hosts:
        raise LauncherError(f"empty SLURM host list {text!r}.")
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item for item in items if item]


def _expand_item(item: str, whole: str) -> list[str]:
    names = [""]
    pos = 0
    while pos < len(item):
        match = _HOSTLIST_TOKEN.match(item, pos)
        if match is None or match.end() == pos:
            raise LauncherError(f"cannot parse SLURM host list {whole!r} near {item[pos:]!r}.")
        prefix, bracket = match.group(1), match.group(2)
        names = [name + prefix for name in names]
        if bracket:
            values = _expand_ranges(bracket[1:-1], whole)
            names = [name + value for name in names for value in values]
        pos = match.end()
    return names


def _expand_ranges(body: str, whole: str) -> list[str]:
    values: list[str] = []
    for part in body.split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise LauncherError(f"cannot parse range {part!r} in SLURM host list {whole!r}.")
        if not dash:
            values.append(low)
            continue
        width = len(low)
        if int(high) < int(low):
            raise LauncherError(f"range {part!r} runs backwards in SLURM host list {whole!r}.")
        values.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return values


def expand_tasks_per_node(text: str) -> list[int]:
    """Expand SLURM's ``2(x3),1`` (tasks on each node, in node order) into ``[2, 2, 2, 1]``.

    Raises:
        LauncherError: the text is malformed.
    """
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise LauncherError(f"cannot parse SLURM tasks per node {text!r} near {part!r}.")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def cross_from_counts(counts: list[int], node: int, local_rank: int) -> tuple[int, int]:
    """Horovod's cross rank and size from the number of processes on each node.

    The cross rank is this node's index among the nodes that run a process with this local rank.
    """
    cross_rank = sum(1 for count in counts[:node] if count > local_rank)
    cross_size = sum(1 for count in counts if count > local_rank)
    return cross_rank, cross_size


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


# ---------------------------------------------------------------- readers


def read_torchrun(env: Mapping[str, str]) -> Reading | None:
    """torchrun (``torch.distributed.run``): present when ``TORCHELASTIC_RUN_ID`` is set.

    The store is the agent's ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` when
    ``TORCHELASTIC_USE_AGENT_STORE=True`` (every rank connects as a client, as
    ``init_process_group("env://")`` does); otherwise rank 0 starts one there.
    """
    if "TORCHELASTIC_RUN_ID" not in env:
        return None
    launcher = "torchrun"
    rank = _int(env, "RANK", launcher)
    size = _int(env, "WORLD_SIZE", launcher)
    local_rank = _int(env, "LOCAL_RANK", launcher)
    local_size = _int(env, "LOCAL_WORLD_SIZE", launcher)
    group_rank = _optional_int(env, "GROUP_RANK", launcher)
    group_size = _optional_int(env, "GROUP_WORLD_SIZE", launcher)
    if group_size is None and local_size and size % local_size == 0:
        group_size = size // local_size
    addr = env.get("MASTER_ADDR", "")
    if not addr:
        raise LauncherError(
            "torchrun started this process without MASTER_ADDR; hora cannot "
            "find the job's store. Is this a torchrun older than 1.9?"
        )
    port = _port(env.get("MASTER_PORT", ""), "MASTER_PORT")
    run_id = env["TORCHELASTIC_RUN_ID"] or "none"
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "") == "True"
    plan = StorePlan(
        addr=addr,
        port=port,
        host=not agent_store and rank == 0,
        shared=agent_store,
        prefix=f"hora/{run_id}/",
        job_id=f"torchrun-{run_id}",
        how=(
            f"torchrun's agent store at MASTER_ADDR:MASTER_PORT={addr}:{port}"
            if agent_store
            else f"a store started by rank 0 at MASTER_ADDR:MASTER_PORT={addr}:{port}"
        ),
    )
    return Reading(
        launcher=launcher,
        rank=rank,
        size=size,
        rank_var="RANK",
        size_var="WORLD_SIZE",
        local_rank=local_rank,
        local_size=local_size,
        # torchrun gives every node the same number of workers.
        cross_rank=group_rank,
        cross_size=group_size,
        hostname=socket.gethostname(),
        plan=plan,
        group_size=group_size,
    )


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
    addr, addr_var = _explicit_address(env)
    port, port_var = _explicit_port(env)
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
        for variable in _HOSTFILE_VARIABLES:
            if env.get(variable):
                path = env[variable]
                break
        else:
            path = MPIJOB_HOSTFILE if os.path.exists(MPIJOB_HOSTFILE) else ""
        first = first_hostfile_host(path) if path else None
        if first:
            addr, how = first, f"the first host of {path}"
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
    rank = _int(env, names[0], launcher)
    size = _int(env, names[1], launcher)
    local_rank = _optional_int(env, local_names[0], launcher)
    local_size = _optional_int(env, local_names[1], launcher)
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


def read_slurm(env: Mapping[str, str]) -> Reading | None:
    """A task of a SLURM job step (``srun``): present when ``SLURM_STEP_ID`` and ``SLURM_PROCID``
    are set. The batch script itself (no step) is not a SLURM launch.

    The store runs on the step's first node (the task with ``SLURM_NODEID=0``, ``SLURM_LOCALID=0``)
    at that node's name from ``SLURM_STEP_NODELIST``, on a port derived from the job and step ids,
    unless ``HORA_RENDEZVOUS_ADDR``/``MASTER_ADDR`` and ``HORA_RENDEZVOUS_PORT``/``MASTER_PORT``
    say otherwise (then global rank 0 starts it, as torch.distributed's ``env://`` does).
    """
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", ""))
    if not step or "SLURM_PROCID" not in env:
        return None
    launcher = "SLURM's srun"
    rank = _int(env, "SLURM_PROCID", launcher)
    size_var = next(
        (n for n in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS") if env.get(n)),
        "SLURM_STEP_NUM_TASKS",
    )
    size = _int(env, size_var, launcher)
    local_rank = _int(env, "SLURM_LOCALID", launcher)
    node = _int(env, "SLURM_NODEID", launcher)
    counts_text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "")
    counts = expand_tasks_per_node(counts_text) if counts_text else [size]
    if node >= len(counts):
        raise LauncherError(
            f"SLURM_NODEID={node} but SLURM_STEP_TASKS_PER_NODE={counts_text!r} lists only "
            f"{len(counts)} nodes."
        )
    if sum(counts) != size:
        raise LauncherError(
            f"SLURM_STEP_TASKS_PER_NODE={counts_text!r} adds up to {sum(counts)} tasks but "
            f"{size_var}={size}."
        )
    local_size = counts[node]
    cross_rank, cross_size = cross_from_counts(counts, node, local_rank)
    nodelist_var = next(
        (n for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(n)),
        "",
    )
    job_id = f"slurm-{env.get('SLURM_JOB_ID', env.get('SLURM_JOBID', ''))}.{step}"
    addr, addr_var = _explicit_address(env)
    port, port_var = _explicit_port(env)
    if addr:
        host, how = rank == 0, f"{addr_var}={addr}"
    else:
        host = node == 0 and local_rank == 0
        if len(counts) == 1:
            addr, how = "127.0.0.1", "loopback (a one-node step)"
        elif nodelist_var:
            addr = expand_hostlist(env[nodelist_var])[0]
            how = f"the first host of {nodelist_var}={env[nodelist_var]}"
        else:
            raise LauncherError(
                "this SLURM step spans several nodes but SLURM_STEP_NODELIST is not set: set "
                "MASTER_ADDR to the first node's name and MASTER_PORT to a free port."
            )
    derived = port is None
    if port is None:
        port, port_var = derived_port(job_id), f"derived from job {job_id}"
    plan = StorePlan(
        addr=addr,
        port=port,
        host=host,
        job_id=job_id,
        derived=derived,
        how=f"a store on {addr}:{port} ({how}; port {port_var})",
    )
    return Reading(
        launcher=launcher,
        rank=rank,
        size=size,
        rank_var="SLURM_PROCID",
        size_var=size_var,
        local_rank=local_rank,
        local_size=local_size,
        cross_rank=cross_rank,
        cross_size=cross_size,
        hostname=env.get("SLURMD_NODENAME") or socket.gethostname(),
        plan=plan,
        one_per_node=all(count == 1 for count in counts),
    )


def read_env_method(env: Mapping[str, str]) -> Reading | None:
    """torch.distributed's ``env://`` variables without torchrun: ``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT`` (e.g. Kubeflow's PyTorchJob, or a script that exports them).

    Rank 0 starts the store at ``MASTER_ADDR:MASTER_PORT``, as ``init_process_group`` does.
    """
    if "WORLD_SIZE" not in env or "RANK" not in env:
        return None
    launcher = "torch.distributed env:// variables"
    rank = _int(env, "RANK", launcher)
    size = _int(env, "WORLD_SIZE", launcher)
    local_rank = _optional_int(env, "LOCAL_RANK", launcher)
    local_size = _optional_int(env, "LOCAL_WORLD_SIZE", launcher)
    plan = StorePlan()
    if size > 1:
        addr = env.get("MASTER_ADDR", "")
        if not addr:
            raise LauncherError(
                f"RANK={rank} and WORLD_SIZE={size} are set but MASTER_ADDR is not: set "
                "MASTER_ADDR and MASTER_PORT (rank 0's host and a free port), as for "
                "init_process_group('env://'), or unset RANK and WORLD_SIZE."
            )
        port = _port(env.get("MASTER_PORT", str(TORCH_DEFAULT_PORT)), "MASTER_PORT")
        plan = StorePlan(
            addr=addr,
            port=port,
            host=rank == 0,
            job_id=f"env-{addr}:{port}",
            exchange=True,
            how=f"a store started by rank 0 at MASTER_ADDR:MASTER_PORT={addr}:{port}",
        )
    all_local = local_size == size
    return Reading(
        launcher=launcher,
        rank=rank,
        size=size,
        rank_var="RANK",
        size_var="WORLD_SIZE",
        local_rank=local_rank,
        local_size=local_size,
        cross_rank=0 if all_local else None,
        cross_size=1 if all_local else None,
        hostname=socket.gethostname(),
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


def import_mpi() -> Any:
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
