"""The static driver: one worker per slot, started at once, supervised until they all end.

:func:`plan_job` resolves the hosts and slots of ``-np``, ``-H`` or ``--hostfile``, checks SSH to
every remote host and picks the store's address; nothing is started until then. The
:class:`StaticPlan` it returns runs the job on a :class:`~hora.runner.job.Job`: it starts one
worker per slot, waits for all of them (the supervisor stops the rest after a failure), and
reports the rank that caused the failure, with its last stderr lines.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from hora.runner.hosts import Slot, assign_slots, is_local, parse_hostfile, parse_hosts
from hora.runner.job import Job, Network, Outcome, reach_hosts
from hora.runner.options import HostOptions

logger = logging.getLogger("hora.runner")


@dataclass(frozen=True)
class StaticPlan:
    """Where every rank runs and how the workers find each other.

    Attributes:
        slots: one per rank.
        remote_hosts: the hosts reached over SSH (every other host is this machine).
        network: where the store listens and how remote hosts are reached.
    """

    slots: list[Slot]
    remote_hosts: list[str]
    network: Network
    record_exits: bool = True

    def job_env(self) -> dict[str, str]:
        return {}

    def run(self, job: Job) -> Outcome:
        """Start one worker per slot, wait for them all, and report how the job ended."""
        for slot in self.slots:
            logger.debug("starting %s: %s", self.describe(slot), " ".join(job.command))
            job.spawn(slot, slot.env(), remote=slot.hostname in self.remote_hosts)
        codes = job.supervisor.wait()
        if all(code == 0 for code in codes.values()):
            return Outcome(0)
        report = job.supervisor.failure_report(codes, job.server.cause_rank())
        return Outcome(1, f"the job failed.\n{report}")

    def describe(self, slot: Slot) -> str:
        where = "over ssh" if slot.hostname in self.remote_hosts else "on this machine"
        return (
            f"rank {slot.rank} on {slot.hostname} {where} (local rank {slot.local_rank} of "
            f"{slot.local_size}, cross rank {slot.cross_rank} of {slot.cross_size})"
        )


def plan_job(np: int, hosts: HostOptions) -> StaticPlan:
    """Resolve the slots of ``np`` workers on ``hosts``, check SSH to every remote host, and pick
    the store's address.

    Raises:
        HostError: the hosts cannot be used or reached; nothing has been started.
    """
    if hosts.hostfile:
        listed = parse_hostfile(hosts.hostfile)
    else:
        listed = parse_hosts(hosts.host_list or f"localhost:{np}")
    slots = assign_slots(listed, np)
    used = list(dict.fromkeys(slot.hostname for slot in slots))
    remote_hosts = [name for name in used if not is_local(name)]
    return StaticPlan(slots, remote_hosts, reach_hosts(hosts, remote_hosts))
