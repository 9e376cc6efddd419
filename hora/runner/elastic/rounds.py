"""An elastic job's rounds: the limits on them, the rank order of the next one, and the
bookkeeping of where the job is.

Rank 0 of a round holds the freshest state: the workers that survive from the previous round come
first, in their previous rank order, host by host (a host's workers stay contiguous), then the new
workers (:func:`order_workers`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from hora.common.job.rounds import HOSTS_ADDED, HOSTS_REMOVED, RoundPlan, host_of
from hora.runner.options import ElasticOptions


class ElasticError(RuntimeError):
    """The elastic job cannot go on; the message tells the user why."""


def order_workers(
    previous: Sequence[str],
    running: Collection[str],
    stopping: Collection[str],
    available: Sequence[tuple[str, int]],
    max_np: int | None = None,
    out: Collection[str] = (),
) -> list[str]:
    """The next round's worker ids, in rank order.

    Workers of the previous round whose process still runs come first, in their previous rank
    order, host by host; each host's remaining slots follow its survivors (a host's workers stay
    contiguous); hosts without survivors follow in first-seen order. At most ``max_np``.

    Args:
        previous: the previous round's worker ids in rank order (empty for round 0).
        running: ids with a worker process that has not ended.
        stopping: ids among ``running`` whose process horarun is stopping (never survivors).
        available: ``(host, slots)`` usable now, in first-seen order.
        max_np: the most workers a round may have (``None``: no limit).
        out: worker ids of slots taken out of the job (after a failure) on available hosts.

    A running process that is not a survivor (one left out of an earlier round and not yet
    ended) keeps its slot out of use until it ends.
    """
    slots = {
        host: [w for w in (f"{host}:{i}" for i in range(count)) if w not in out]
        for host, count in available
    }
    usable = {worker for ids in slots.values() for worker in ids}
    survivors = [w for w in previous if w in usable and w in running and w not in stopping]
    kept = set(survivors)
    hosts = list(dict.fromkeys([host_of(w) for w in survivors] + list(slots)))
    order: list[str] = []
    for host in hosts:
        order += [w for w in survivors if host_of(w) == host]
        order += [w for w in slots[host] if w not in kept and w not in running]
    return order if max_np is None else order[:max_np]


def update_flags(current: Collection[str], desired: Collection[str]) -> int:
    """The host-change flags (``HOSTS_ADDED | HOSTS_REMOVED``) going from one set of worker ids
    to another."""
    flags = 0
    if set(desired) - set(current):
        flags |= HOSTS_ADDED
    if set(current) - set(desired):
        flags |= HOSTS_REMOVED
    return flags


def plural(count: int, word: str) -> str:
    """``1 worker``, ``2 workers``."""
    return f"{count} {word}{'' if count == 1 else 's'}"


def describe_change(current: Collection[str], desired: Collection[str]) -> str:
    """``hosts changed: added b:0, b:1; removed c:0``."""
    added = [w for w in desired if w not in current]
    removed = [w for w in current if w not in desired]
    parts = []
    if added:
        parts.append(f"added {', '.join(added)}")
    if removed:
        parts.append(f"removed {', '.join(removed)}")
    return "hosts changed: " + "; ".join(parts)


@dataclass(frozen=True)
class Limits:
    """The elastic flags, with their defaults applied."""

    np: int
    min_np: int
    max_np: int | None
    timeout_s: float
    reset_limit: int | None
    cooldown: tuple[float, float] | None

    @classmethod
    def from_options(cls, np: int, elastic: ElasticOptions) -> Limits:
        """The limits of a job that starts with ``np`` workers."""
        return cls(
            np=np,
            min_np=elastic.min_np,
            max_np=elastic.max_np,
            timeout_s=elastic.timeout_s,
            reset_limit=elastic.reset_limit,
            cooldown=elastic.cooldown_s,
        )


@dataclass
class Rounds:
    """Where the job is in its rounds.

    Attributes:
        plan: the newest round published (``None`` before round 0).
        forced: why the next round must come even with the same workers (failures, a worker's
            request); emptied when it is published.
        resets: rounds published after round 0 (``--reset-limit`` counts them).
        updates: host-change notices published.
        short_since: since when too few slots are available for the next round.
        short_told: when the driver last said so.
        reset_seen: rounds whose workers' request for a new round was granted.
        reset_asked: the round whose request is waiting for its grace period, and when the
            driver saw it.
    """

    plan: RoundPlan | None = None
    forced: list[str] = field(default_factory=list)
    resets: int = 0
    updates: int = 0
    short_since: float | None = None
    short_told: float | None = None
    reset_seen: set[int] = field(default_factory=set)
    reset_asked: tuple[int, float] | None = None

    @property
    def next_number(self) -> int:
        return 0 if self.plan is None else self.plan.number + 1
