"""What every launcher's reading is made of: :class:`Reading`, :class:`StorePlan`, and the
variables all readers parse alike.

A reader (:mod:`hora.common.job.launchers`, :mod:`hora.common.job.mpi_launchers`,
:mod:`hora.common.job.slurm`) turns one launcher's environment into a :class:`Reading`: rank and
size, local rank and size where the launcher exports them, the node index where it has one, and a
:class:`StorePlan` that says how the job's key-value store is reached. This module holds those
two, :class:`LauncherError`, and what the readers share: integers and ports read from variables
with errors that name them, the store's address and port given explicitly
(``HORA_RENDEZVOUS_ADDR``/``MASTER_ADDR``, ``HORA_RENDEZVOUS_PORT``/``MASTER_PORT``), and the port
every process derives alike from a job id.

It knows variables, not launchers: which launcher set them is the readers' business.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from hora.common.vocabulary import settings_table as table
from hora.common.vocabulary.config import raw

# torch.distributed's default store port (``MASTER_PORT``'s usual value).
TORCH_DEFAULT_PORT = 29500
# Ports derived from a job id fall in this range: below Linux's range for the local ports of
# outgoing connections (32768-60999 by default), so that no client socket on the host holds one.
DERIVED_PORT_LOW = 20000
DERIVED_PORT_HIGH = 32768


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


def integer_variable(env: Mapping[str, str], name: str, launcher: str) -> int:
    """``name`` of ``env``, set by ``launcher``, as an integer.

    Raises:
        LauncherError: it is unset or not an integer; the message names it.
    """
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


def optional_integer_variable(env: Mapping[str, str], name: str, launcher: str) -> int | None:
    """``name`` of ``env`` as an integer, or ``None`` where ``launcher`` does not set it."""
    return integer_variable(env, name, launcher) if env.get(name, "") != "" else None


def derived_port(job_id: str) -> int:
    """A port in 20000-32767 that every process of a job computes alike from its id."""
    digest = int(hashlib.sha256(job_id.encode()).hexdigest(), 16)
    return DERIVED_PORT_LOW + digest % (DERIVED_PORT_HIGH - DERIVED_PORT_LOW)


def explicit_address(env: Mapping[str, str]) -> tuple[str, str]:
    """``(address, variable)`` from ``HORA_RENDEZVOUS_ADDR`` or ``MASTER_ADDR`` (``""`` if unset)."""
    for variable in (table.RENDEZVOUS_ADDR, table.GLOO_RENDEZVOUS_ADDR):
        value = raw(variable, env)
        if value:
            return value, variable.env
    return env.get("MASTER_ADDR", ""), "MASTER_ADDR"


def explicit_port(env: Mapping[str, str]) -> tuple[int | None, str]:
    """``(port, variable)`` from ``HORA_RENDEZVOUS_PORT`` or ``MASTER_PORT`` (``None`` if unset)."""
    for variable in (table.RENDEZVOUS_PORT, table.GLOO_RENDEZVOUS_PORT):
        value = raw(variable, env)
        if value:
            return port_number(value, variable.env), variable.env
    if env.get("MASTER_PORT"):
        return port_number(env["MASTER_PORT"], "MASTER_PORT"), "MASTER_PORT"
    return None, ""


def port_number(raw: str, variable: str) -> int:
    """``raw``, the value of ``variable``, as a port number.

    Raises:
        LauncherError: it is not a number from 1 to 65535; the message names ``variable``.
    """
    try:
        port = int(raw)
    except ValueError:
        raise LauncherError(f"{variable} must be a port number, got {raw!r}.") from None
    if not 0 < port < 65536:
        raise LauncherError(f"{variable} must be a port number between 1 and 65535, got {port}.")
    return port
