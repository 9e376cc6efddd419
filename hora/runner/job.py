"""A job's shared parts, made in one place for the static driver, the elastic one and ``hora.run``.

A driver decides where workers run and when: :mod:`hora.runner.static` starts one per slot and
waits, :mod:`hora.runner.elastic` forms rounds. Neither builds what every job has once, which is
the :class:`Job`: the secret and the store (:mod:`hora.runner.store_server`), the supervisor with its
output forwarding (:mod:`hora.runner.supervisor`), the environment every worker starts from, and
how other hosts are reached (:class:`Network`, from :func:`reach_hosts`). Leaving a job (it is a
context manager) stops any worker still running and closes the store.

Importing this module never imports PyTorch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Protocol

from hora.common.job.shm_names import sweep_job
from hora.common.vocabulary import settings_table as table
from hora.runner import options
from hora.runner.fork_server import ForkServer
from hora.runner.hosts import Slot
from hora.runner.options import HostOptions, LaunchOptions, OutputOptions
from hora.runner.remote import (
    SshSettings,
    check_hosts,
    interface_address,
    rendezvous_address,
    require_ssh,
)
from hora.runner.store_server import RendezvousServer
from hora.runner.supervisor import (
    OutputForwarder,
    Supervisor,
    Worker,
    install_signal_handlers,
)

# Topology variables no worker inherits from the launcher: each gets its own (a static worker
# from its slot, an elastic one from the round it joins).
TOPOLOGY_VARS = frozenset(
    name
    for variable in (
        table.RANK,
        table.SIZE,
        table.LOCAL_RANK,
        table.LOCAL_SIZE,
        table.CROSS_RANK,
        table.CROSS_SIZE,
    )
    for name in variable.environ_names
)

logger = logging.getLogger("hora.runner")


@dataclass(frozen=True)
class Network:
    """How a job's hosts are reached and where its store listens.

    Attributes:
        bind_address: where the job's store listens.
        ssh: how remote hosts are reached.
        interfaces: ``--network-interface``: the first one for Gloo and the store, all of them
            for NCCL; none: each worker's watchdog picks the interface that reaches the store.
    """

    bind_address: str = "127.0.0.1"
    ssh: SshSettings = field(default_factory=SshSettings)
    interfaces: tuple[str, ...] = ()

    def env(self) -> dict[str, str]:
        """The network-interface variables every worker gets."""
        if not self.interfaces:
            return {}
        return {
            table.GLOO_IFACE.env: self.interfaces[0],
            "NCCL_SOCKET_IFNAME": ",".join(self.interfaces),
        }


def reach_hosts(
    hosts: HostOptions, remote_hosts: Sequence[str], hosts_may_join: bool = False
) -> Network:
    """Check that the remote hosts can be reached, and pick the store's address.

    A static job probes every remote host over SSH before anything starts. An elastic job's hosts
    come and go (``hosts_may_join``): only an ``ssh`` client is required, and with
    ``--network-interface`` its store listens on that interface even when every host found so far
    is this machine, so that other machines can join later.

    Raises:
        HostError: the hosts cannot be used or reached; nothing has been started.
    """
    ssh = hosts.ssh
    if remote_hosts:
        if hosts_may_join:
            require_ssh()
        else:
            logger.debug("checking SSH to %s", ", ".join(remote_hosts))
            check_hosts(remote_hosts, ssh)
    interfaces = hosts.interfaces
    if interfaces and hosts_may_join:
        bind_address = interface_address(interfaces[0])
    else:
        bind_address = rendezvous_address(remote_hosts, ssh, interfaces)
    return Network(bind_address, ssh, interfaces)


class Job:
    """One job's shared parts; every worker of the job is started through :meth:`spawn`.

    Built from its parts (tests pass stand-ins); :meth:`open` makes the real ones.

    Args:
        command: what every worker runs.
        server: the job's store; it holds the secret.
        supervisor: starts, watches and stops the workers.
        env: variables every worker gets (the store's address and the secret are added).
        ssh: how remote workers are reached.
        base_env: the environment workers start from (default: ours), less :data:`TOPOLOGY_VARS`.
        cwd: the workers' directory (default: ours).
    """

    def __init__(
        self,
        command: Sequence[str],
        server: RendezvousServer,
        supervisor: Supervisor,
        env: Mapping[str, str] | None = None,
        ssh: SshSettings | None = None,
        base_env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> None:
        self.command = list(command)
        self.server = server
        self.supervisor = supervisor
        self.env = {**server.env(), **(env or {})}
        self.ssh = ssh or SshSettings()
        base = os.environ if base_env is None else base_env
        self.base_env = {k: v for k, v in base.items() if k not in TOPOLOGY_VARS}
        self.cwd = cwd or os.getcwd()

    @classmethod
    def open(
        cls,
        command: Sequence[str],
        network: Network | None = None,
        env: Mapping[str, str] | None = None,
        base_env: Mapping[str, str] | None = None,
        forwarder: OutputForwarder | None = None,
        record_exits: bool = True,
        handle_signals: bool = False,
        launcher_timeout_s: float | None = None,
        fork_server: ForkServer | None = None,
    ) -> Job:
        """Start the job's store (with a fresh secret) and make its supervisor.

        Args:
            command: what every worker runs.
            network: where the store listens and how hosts are reached (default: this machine).
            env: variables every worker gets, besides the network's and the store's.
            base_env: the environment workers start from (default: ours).
            forwarder: how workers' output is copied (default: prefixed lines).
            record_exits: the supervisor records a failed worker's end in the store (the
                elastic driver records it in the round's space itself).
            handle_signals: Ctrl-C or TERM stops every worker before the process exits.
            launcher_timeout_s: how long a watchdog waits for this launcher's heartbeat before
                it stops its worker (default ``HORA_LAUNCHER_TIMEOUT_SECONDS``).
            fork_server: forks this machine's workers, when it takes the command.
        """
        network = network or Network()
        server = RendezvousServer(network.bind_address)
        logger.debug("rendezvous store listening on %s:%s", server.address, server.port)
        supervisor = Supervisor(
            on_exit=server.record_exit if record_exits else None,
            forwarder=forwarder,
            launcher_timeout_s=launcher_timeout_s,
            fork_server=fork_server,
        )
        if handle_signals:
            install_signal_handlers(supervisor)
        return cls(
            command, server, supervisor, {**(env or {}), **network.env()}, network.ssh, base_env
        )

    def spawn(self, slot: Slot, env: Mapping[str, str], remote: bool = False) -> Worker:
        """Start one worker of the job's command for ``slot``, over SSH when ``remote``.

        Args:
            slot: where it runs; its rank numbers the worker's output.
            env: the worker's own variables, on top of the job's.
            remote: ``slot.hostname`` is another machine.
        """
        worker = options.worker_env(self.base_env, {**self.env, **env})
        return self.supervisor.spawn(
            slot, self.command, worker, cwd=self.cwd, ssh=self.ssh if remote else None
        )

    def close(self) -> None:
        """Stop the workers still running, remove the shared-memory segments a killed worker
        of this machine left (see :mod:`hora.common.job.shm_names`) and close the store."""
        self.supervisor.stop()
        for path in sweep_job(self.server.secret):
            logger.info("removed %s, left by a worker that was killed", path)
        self.server.close()

    def __enter__(self) -> Job:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def forwarder_for(output: OutputOptions) -> OutputForwarder:
    """Output forwarding as ``horarun``'s flags ask for it."""
    return OutputForwarder(
        prefix=not output.disable_prefix, timestamp=output.timestamp, log_dir=output.directory
    )


@dataclass(frozen=True)
class Outcome:
    """How a job ended: ``horarun``'s exit status, and what to tell the user (empty: nothing)."""

    status: int
    message: str = ""


class Plan(Protocol):
    """Where a job runs, decided before anything starts, and the driver that runs it."""

    @property
    def network(self) -> Network:
        """Where the store listens and how hosts are reached."""
        ...

    @property
    def record_exits(self) -> bool:
        """Whether the supervisor records a failed worker's end in the job's store."""
        ...

    def job_env(self) -> dict[str, str]:
        """Variables every worker of this driver gets, besides the flags'."""
        ...

    def run(self, job: Job) -> Outcome:
        """Start the workers, drive them to the end, and say how the job ended."""
        ...


def open_job(launch: LaunchOptions, plan: Plan) -> Job:
    """The job ``horarun``'s options describe, for ``plan``'s driver."""
    return Job.open(
        launch.command,
        plan.network,
        env={**launch.engine_env, **plan.job_env()},
        forwarder=forwarder_for(launch.output),
        record_exits=plan.record_exits,
        handle_signals=True,
        launcher_timeout_s=launch.launcher_timeout_s,
    )
