"""Which discovered hosts an elastic job may use: first-seen order, less the blacklisted ones.

A worker that fails blacklists its whole host: for good, or, with
``--blacklist-cooldown-range``, for a cooldown that grows with each blacklisting.
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
    """Hosts taken out of the job after a failure: for good, or for a cooldown.

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
    """The hosts discovery reports, in first-seen order, less the blacklisted ones."""

    def __init__(self, blacklist: Blacklist | None = None) -> None:
        self.blacklist = blacklist or Blacklist()
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
        """The discovered hosts that are not blacklisted."""
        return [(name, n) for name, n in self.discovered() if not self.blacklist.blocked(name)]


def describe_hosts(hosts: Sequence[tuple[str, int]]) -> str:
    """``a:2, b:1`` (``none`` when empty)."""
    return ", ".join(f"{name}:{slots}" for name, slots in hosts) or "none"
