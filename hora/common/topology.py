"""Where this process sits in the job: rank, size, local and cross ranks, and the rendezvous.

This module reads the variables a launcher exports and turns them into a :class:`Topology`.
It knows nothing of transports or tensors. ``horarun`` and ``hora.run`` export the ``HORA_*``
variables (and their ``HOROVOD_*`` twins); a process started without any launcher is a job of one.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from hora.common.config import lookup


class TopologyError(ValueError):
    """The launcher's variables are missing, malformed or contradict each other."""


@dataclass(frozen=True)
class Topology:
    """This process's place in the job.

    Attributes:
        rank: global rank, 0..size-1.
        size: number of processes.
        local_rank: rank among the processes on this host.
        local_size: processes on this host.
        cross_rank: index of this host among the hosts that have a process with this local rank.
        cross_size: number of hosts that have a process with this local rank.
        hostname: how the launcher names this host.
        rendezvous_addr: address of the job's key-value store ("" for a job of one).
        rendezvous_port: its port.
        secret: the job's secret key (hex), used to authenticate everything sent through the store.
        source: which launcher's variables were used.
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    hostname: str = "localhost"
    rendezvous_addr: str = ""
    rendezvous_port: int = 0
    secret: str = ""
    source: str = "single process"

    @property
    def all_local(self) -> bool:
        """Every process of the job runs on this host."""
        return self.local_size == self.size

    def validate(self) -> None:
        if self.size < 1:
            raise TopologyError(f"{self.source}: world size must be >= 1, got {self.size}.")
        if not 0 <= self.rank < self.size:
            raise TopologyError(
                f"{self.source}: rank {self.rank} is outside 0..{self.size - 1} (size {self.size})."
            )
        if not 0 <= self.local_rank < self.local_size:
            raise TopologyError(
                f"{self.source}: local rank {self.local_rank} is outside 0..{self.local_size - 1}."
            )
        if not 0 <= self.cross_rank < self.cross_size:
            raise TopologyError(
                f"{self.source}: cross rank {self.cross_rank} is outside 0..{self.cross_size - 1}."
            )
        if self.size > 1 and not self.rendezvous_addr:
            raise TopologyError(
                f"{self.source}: a job of {self.size} processes needs a rendezvous address "
                "(HORA_RENDEZVOUS_ADDR); start it with horarun or hora.run."
            )


def _int_var(name: str, env: Mapping[str, str], default: int | None = None) -> int:
    raw = lookup(name, env)
    if raw is None:
        if default is None:
            raise TopologyError(f"HORA_{name} is not set but other HORA_* topology variables are.")
        return default
    try:
        return int(raw)
    except ValueError:
        raise TopologyError(f"HORA_{name} must be an integer, got {raw!r}.") from None


def _from_hora(env: Mapping[str, str]) -> Topology | None:
    if lookup("RANK", env) is None:
        return None
    size = _int_var("SIZE", env)
    local_size = _int_var("LOCAL_SIZE", env, default=size)
    addr = lookup("RENDEZVOUS_ADDR", env) or lookup("GLOO_RENDEZVOUS_ADDR", env) or ""
    port_raw = lookup("RENDEZVOUS_PORT", env) or lookup("GLOO_RENDEZVOUS_PORT", env) or "0"
    try:
        port = int(port_raw)
    except ValueError:
        raise TopologyError(f"HORA_RENDEZVOUS_PORT must be an integer, got {port_raw!r}.") from None
    return Topology(
        rank=_int_var("RANK", env),
        size=size,
        local_rank=_int_var("LOCAL_RANK", env, default=0),
        local_size=local_size,
        cross_rank=_int_var("CROSS_RANK", env, default=0),
        cross_size=_int_var("CROSS_SIZE", env, default=1),
        hostname=lookup("HOSTNAME", env) or socket.gethostname(),
        rendezvous_addr=addr,
        rendezvous_port=port,
        secret=env.get("HORA_SECRET_KEY", ""),
        source="horarun",
    )


# Variables other launchers set, with the world size they imply. hora reads its own (and
# Horovod's) variables; a job started by one of these with several processes would otherwise
# silently run as several jobs of one.
_FOREIGN_SIZES = (
    ("torchrun", "WORLD_SIZE"),
    ("Open MPI's mpirun", "OMPI_COMM_WORLD_SIZE"),
    ("MPICH/Intel MPI", "PMI_SIZE"),
    ("SLURM's srun", "SLURM_NTASKS"),
)


def _foreign_launcher(env: Mapping[str, str]) -> str | None:
    for launcher, variable in _FOREIGN_SIZES:
        raw = env.get(variable, "")
        if raw.isdigit() and int(raw) > 1:
            if variable == "SLURM_NTASKS" and "SLURM_STEP_ID" not in env:
                continue  # inside an allocation but not started by srun
            return f"{launcher} ({variable}={raw})"
    return None


def detect(env: Mapping[str, str] | None = None) -> Topology:
    """Work out this process's topology from the environment.

    Args:
        env: the variables to read (default: ``os.environ``).

    Raises:
        TopologyError: the variables are inconsistent.
    """
    source = os.environ if env is None else env
    topology = _from_hora(source)
    if topology is None:
        foreign = _foreign_launcher(source)
        if foreign is not None:
            raise TopologyError(
                f"this process was started by {foreign}, whose variables this version of hora "
                "does not read yet; without them every process would run alone. Launch the "
                "job with `horarun -np N python script.py` instead."
            )
        topology = Topology(hostname=socket.gethostname())
    topology.validate()
    return topology
