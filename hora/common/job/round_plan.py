"""Who trains in one round of an elastic job, and as which rank: the plan the driver publishes
and every worker reads (the protocol around it is :mod:`hora.common.job.rounds`'s).

Plain data: it imports nothing of hora, so what keeps a worker's rounds
(:class:`hora.common.runtime.RoundProgress`) can name it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Assignment:
    """One worker's place in a round (as :class:`~hora.common.job.topology.Topology` has it)."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostname: str


@dataclass
class RoundPlan:
    """Who trains in one round, and as which rank.

    Attributes:
        number: the round (0 for the job's first).
        updates: the number of the last host-change notice this round already reflects.
        workers: assignment by worker id (``host:slot``), ranks ``0..size-1`` each once.
    """

    number: int
    updates: int = 0
    workers: dict[str, Assignment] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.workers)

    def ranked(self) -> list[str]:
        """Worker ids in rank order."""
        return sorted(self.workers, key=lambda w: self.workers[w].rank)

    def to_json(self) -> bytes:
        body = {
            "number": self.number,
            "updates": self.updates,
            "workers": {w: asdict(a) for w, a in self.workers.items()},
        }
        return json.dumps(body, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> RoundPlan:
        body = json.loads(data)
        workers = {w: Assignment(**a) for w, a in body["workers"].items()}
        return cls(int(body["number"]), int(body["updates"]), workers)

    @classmethod
    def from_order(cls, number: int, updates: int, order: list[str]) -> RoundPlan:
        """A plan giving ``order[i]`` rank ``i``; local and cross ranks follow from the hosts
        (the part of a worker id before its last ``:``)."""
        hosts: dict[str, list[str]] = {}
        for worker in order:
            hosts.setdefault(host_of(worker), []).append(worker)
        host_order = list(hosts)
        workers: dict[str, Assignment] = {}
        for rank, worker in enumerate(order):
            host = host_of(worker)
            local_rank = hosts[host].index(worker)
            peers = [h for h in host_order if len(hosts[h]) > local_rank]
            workers[worker] = Assignment(
                rank=rank,
                size=len(order),
                local_rank=local_rank,
                local_size=len(hosts[host]),
                cross_rank=peers.index(host),
                cross_size=len(peers),
                hostname=host,
            )
        return cls(number, updates, workers)


def host_of(worker_id: str) -> str:
    """The host part of a worker id ``host:slot``."""
    return worker_id.rsplit(":", 1)[0]
