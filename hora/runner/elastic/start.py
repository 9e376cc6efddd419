"""``horarun``'s way into an elastic job: find the first hosts, then run the driver on the job.

:func:`plan_elastic` runs discovery once and checks how the hosts are reached; nothing is started
until then. The :class:`ElasticPlan` it returns runs the :class:`~hora.runner.elastic.driver.Driver`
on the job :mod:`hora.runner.launch` built from it, and turns how the driver ended into horarun's
exit status: ``0``, the last round's workers all exited 0; ``1``, the job failed or could not go
on (the message says why). Hosts named on the command line that cannot be used make it ``2``
before anything starts.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field

from hora.common.vocabulary import settings_table as table
from hora.runner.elastic.blacklist import Blacklist, HostManager, describe_hosts
from hora.runner.elastic.discovery import (
    Discovery,
    HostWatcher,
    ScriptDiscovery,
    StaticDiscovery,
)
from hora.runner.elastic.driver import Driver
from hora.runner.elastic.rounds import ElasticError, Limits
from hora.runner.elastic.workers import Spawner
from hora.runner.hosts import Host, is_local, parse_hostfile, parse_hosts
from hora.runner.job import Job, Network, Outcome, reach_hosts
from hora.runner.options import ElasticOptions, HostOptions

# Workers wait this much longer than the driver (HORA_ELASTIC_TIMEOUT), so that when a round
# cannot form, the driver, which sees the whole job, gives up first and says why.
WORKER_TIMEOUT_SLACK_S = 10.0

logger = logging.getLogger("hora.runner")


@dataclass
class Locality:
    """Which hosts are other machines (each host is looked up once)."""

    _local: dict[str, bool] = field(default_factory=dict)

    def is_remote(self, host: str) -> bool:
        if host not in self._local:
            self._local[host] = is_local(host)
        return not self._local[host]


@dataclass
class UsableHosts:
    """Leaves out the discovered hosts this job cannot use, saying so once for each (a warning).

    A host that is another machine cannot join when the store listens on loopback (every host
    was this machine when the job started), or when there is no ``ssh`` client here.
    """

    bind_address: str
    locality: Locality
    refused: set[str] = field(default_factory=set)

    def __call__(self, hosts: list[Host]) -> list[Host]:
        kept = []
        for host in hosts:
            why = self._why_not(host.name)
            if not why:
                kept.append(host)
            elif host.name not in self.refused:
                self.refused.add(host.name)
                logger.warning("%s; it is not used.", why)
        return kept

    def _why_not(self, name: str) -> str:
        if not self.locality.is_remote(name):
            return ""
        if self.bind_address.startswith("127."):
            return (
                f"host {name} is another machine, but the job's store listens on "
                f"{self.bind_address} (every host was this machine when the job started); "
                "pass --network-interface IFACE to let other machines join"
            )
        if shutil.which("ssh") is None:
            return f"host {name} is another machine and there is no `ssh` client here"
        return ""


@dataclass
class ElasticPlan:
    """An elastic job's hosts so far, the flags that limit its rounds, and how hosts are reached.

    Attributes:
        limits: the elastic flags.
        watcher: where the newest hosts come from (it has run discovery once).
        locality: which hosts are other machines.
        network: where the store listens and how hosts are reached.
    """

    limits: Limits
    watcher: HostWatcher
    locality: Locality
    network: Network
    # The driver records a failed worker's end in its round's store space itself.
    record_exits: bool = False

    def job_env(self) -> dict[str, str]:
        worker_timeout = self.limits.timeout_s + WORKER_TIMEOUT_SLACK_S
        return {table.ELASTIC_TIMEOUT.env: f"{worker_timeout:g}"}

    def run(self, job: Job, timeout_s: float | None = None) -> Outcome:
        """Drive the job's rounds to the end, watching the hosts meanwhile.

        Raises:
            TimeoutError: ``timeout_s`` passed first (``hora.run``'s; the caller stops the job).
        """
        driver = Driver(
            self.limits,
            HostManager(Blacklist(self.limits.cooldown)),
            self.watcher,
            Spawner(job, self.locality.is_remote),
            job.server.client,
            UsableHosts(self.network.bind_address, self.locality),
        )
        self.watcher.start()
        try:
            status = driver.run(timeout_s)
            return Outcome(status, f"the job failed.\n{driver.report()}" if status else "")
        except ElasticError as exc:
            details = driver.report()
            return Outcome(1, f"{exc}" + (f"\n{details}" if details else ""))
        finally:
            self.watcher.stop()


def discovery_for(hosts: HostOptions, limits: Limits) -> Discovery:
    """Where the job's hosts come from: the discovery script, else ``--hostfile`` or ``-H``."""
    if hosts.discovery_script:
        # One run never blocks the driver longer than the job waits for hosts.
        timeout_s = min(hosts.discovery_timeout_s, limits.timeout_s)
        return ScriptDiscovery(hosts.discovery_script, hosts.slots_per_host, timeout_s)
    if hosts.hostfile:
        return StaticDiscovery(parse_hostfile(hosts.hostfile))
    return StaticDiscovery(
        parse_hosts(hosts.host_list or f"localhost:{limits.max_np or limits.np}")
    )


def plan_elastic(np: int, hosts: HostOptions, elastic: ElasticOptions) -> ElasticPlan:
    """Run discovery once and check how the hosts it found are reached; nothing is started.

    Raises:
        HostError: the hosts named on the command line cannot be used.
        DiscoveryError: the discovery script failed; the job cannot start.
    """
    limits = Limits.from_options(np, elastic)
    discovery = discovery_for(hosts, limits)
    watcher = HostWatcher(discovery)
    first = watcher.first()
    logger.debug("hosts found: %s", describe_hosts([(h.name, h.slots) for h in first]))
    if isinstance(discovery, StaticDiscovery) and len(first) == 1:
        logger.debug(
            "every worker runs on one host (%s): a failed worker takes only its own slot out "
            "of the job (blacklisting the host would end it), and the job goes on with the "
            "host's other slots while at least --min-np %d are left.",
            first[0].name,
            limits.min_np,
        )
    locality = Locality()
    remote = [h.name for h in first if locality.is_remote(h.name)]
    network = reach_hosts(hosts, remote, hosts_may_join=True)
    return ElasticPlan(limits, watcher, locality, network)
