"""Which discovered hosts an elastic job may use: first-seen order, less the blacklisted ones.

A worker that fails blacklists its whole host: for good, or, with
``--blacklist-cooldown-range``, for a cooldown that grows with each blacklisting. When losing the
host would leave fewer than ``--min-np`` slots (a job on one host, most often), only the failed
worker's slot is taken out instead, on the same terms: the host's other slots go on.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hora.runner.hosts import Host


@dataclass
class _Listing:
    count: int = 0  # how many times the host was blacklisted
    until: float | None = None  # when it may come back; None: never
    active: bool = False


class Blacklist:
    """Hosts (or slots, by worker id) taken out of the job after a failure: for good, or for a
    cooldown.

    With ``cooldown=(lo, hi)`` a host's ``k``-th blacklisting (``k`` from 0) lasts
    ``lo * 2**k + uniform(0, 1) * lo`` seconds, clamped to ``[lo, hi]`` (Horovod's rule); once it
    has passed the host counts as available again.

    Args:
        cooldown: ``(lo, hi)`` seconds, or ``None`` to blacklist for good.
        clock: the time (seconds, monotonic).
        rand: a uniform random number in ``[0, 1)``.
    """

    def __init__(
        self,
        cooldown: tuple[float, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.cooldown = cooldown
        self.clock = clock
        self.rand = rand
        self._hosts: dict[str, _Listing] = {}

    def add(self, host: str) -> float | None:
        """Blacklist ``host``; returns for how many seconds (``None``: for good)."""
        listing = self._hosts.setdefault(host, _Listing())
        listing.active = True
        if self.cooldown is None:
            listing.count += 1
            listing.until = None
            return None
        low, high = self.cooldown
        delay = low * 2.0 ** min(listing.count, 60) + self.rand() * low
        delay = max(low, min(high, delay))
        listing.count += 1
        listing.until = self.clock() + delay
        return delay

    def blocked(self, host: str) -> bool:
        """Whether ``host`` is blacklisted now."""
        listing = self._hosts.get(host)
        if listing is None or not listing.active:
            return False
        if listing.until is not None and self.clock() >= listing.until:
            listing.active = False
            return False
        return True

    def hosts(self) -> list[str]:
        """The hosts blacklisted now."""
        return [host for host in self._hosts if self.blocked(host)]


class HostManager:
    """The hosts discovery reports, in first-seen order, less the blacklisted ones; and the
    slots taken out on their own (:attr:`slots_out`, by worker id ``host:slot``).

    Args:
        blacklist: the hosts' blacklist.
        slots_out: the slots' own (default: one on the same terms as ``blacklist``).
    """

    def __init__(
        self, blacklist: Blacklist | None = None, slots_out: Blacklist | None = None
    ) -> None:
        self.blacklist = blacklist or Blacklist()
        self.slots_out = slots_out or Blacklist(
            self.blacklist.cooldown, self.blacklist.clock, self.blacklist.rand
        )
        self._order: dict[str, None] = {}
        self._slots: dict[str, int] = {}

    def update(self, hosts: Sequence[Host]) -> None:
        """Take discovery's newest answer."""
        for host in hosts:
            self._order.setdefault(host.name, None)
        self._slots = {host.name: host.slots for host in hosts}

    def discovered(self) -> list[tuple[str, int]]:
        """Every host discovery reports now, with its slots, in first-seen order."""
        return [(name, self._slots[name]) for name in self._order if name in self._slots]

    def available(self) -> list[tuple[str, int]]:
        """The discovered hosts that are not blacklisted, with all their slots (some may be
        out: :meth:`out`)."""
        return [(name, n) for name, n in self.discovered() if not self.blacklist.blocked(name)]

    def out(self) -> list[str]:
        """The slots (worker ids) taken out now, of hosts that are not blacklisted."""
        hosts = dict(self.available())
        return [w for w in self.slots_out.hosts() if _has_slot(hosts, w)]

    def usable(self, without: str = "") -> list[tuple[str, int]]:
        """The available hosts (less ``without``) with the slots that are not out, in
        first-seen order; hosts left with none are left out."""
        out = set(self.out())
        counts = [
            (name, sum(f"{name}:{i}" not in out for i in range(slots)))
            for name, slots in self.available()
            if name != without
        ]
        return [(name, count) for name, count in counts if count]

    def usable_slots(self, without: str = "") -> int:
        """How many slots :meth:`usable` offers."""
        return sum(count for _, count in self.usable(without))

    def take_out(self, worker_id: str, min_np: int) -> TakenOut | None:
        """Take a failed worker's host out of the job; or only its slot (``host:slot``) when
        blacklisting the host would leave fewer than ``min_np`` slots and the host has others.
        ``None`` when its host is blacklisted already."""
        host = worker_id.rpartition(":")[0]
        if self.blacklist.blocked(host):
            return None
        left = self.usable_slots(without=host)
        if left < min_np and dict(self.usable()).get(host, 0) > 1:
            delay = self.slots_out.add(worker_id)
            return TakenOut(
                worker_id, delay, host, f"{left} slot{'' if left == 1 else 's'}", min_np
            )
        return TakenOut(host, self.blacklist.add(host))


@dataclass(frozen=True)
class TakenOut:
    """A host blacklisted, or a single slot taken out (``kept``: its host, which stays).

    Attributes:
        name: the host, or the slot's worker id.
        delay: for how long, in seconds (``None``: for good).
        kept: the slot's host; ``""`` when the host itself went.
        left: the slots the job would have had without the kept host (``2 slots``).
        min_np: ``--min-np``, which that is fewer than.
    """

    name: str
    delay: float | None
    kept: str = ""
    left: str = ""
    min_np: int = 0

    @property
    def span(self) -> str:
        return "for good" if self.delay is None else f"for {self.delay:.1f} s"

    @property
    def summary(self) -> str:
        """For the next round's reason: ``host b blacklisted``."""
        if not self.kept:
            return f"host {self.name} blacklisted"
        return (
            f"slot {self.name} taken out (blacklisting host {self.kept} would leave "
            f"{self.left}, fewer than --min-np {self.min_np})"
        )

    @property
    def detail(self) -> str:
        """For ``--verbose``: ``blacklisted host b for good``."""
        if not self.kept:
            return f"blacklisted host {self.name} {self.span}"
        return f"took slot {self.name} out of the job {self.span} (host {self.kept} stays)"

    def stops(self, worker_id: str) -> bool:
        """Whether the worker ``worker_id`` must stop (it runs on a blacklisted host)."""
        return not self.kept and worker_id.rpartition(":")[0] == self.name


def _has_slot(hosts: dict[str, int], worker_id: str) -> bool:
    """Whether the host of ``worker_id`` (``host:slot``) is in ``hosts`` with that slot."""
    host, _, index = worker_id.rpartition(":")
    return host in hosts and index.isdigit() and int(index) < hosts[host]


def describe_hosts(hosts: Sequence[tuple[str, int]]) -> str:
    """``a:2, b:1`` (``none`` when empty)."""
    return ", ".join(f"{name}:{slots}" for name, slots in hosts) or "none"
