"""Collecting the steady state's current batch: waiting until this rank's part of it is decided.

This rank's part is decided when every tensor of the batch is in (it follows the schedule), when
it submitted something the schedule does not expect, or the job ends (it deviates), or when a
user has waited past a grace period on a result this rank has not run yet, so the batch may
never fill (it is blocked, and names where the next schedule must cut). Meanwhile the batch in
flight before it may have to land first: a user waits for, or polled, one of its results.

This module knows the schedule, the intake's queue and blocked handles; not batch buffers or
transports (:mod:`.replay` starts and lands batches).
"""

from __future__ import annotations

import logging
import time
from collections import deque

from hora.common.engine.context import EngineContext
from hora.common.engine.handles import Entry
from hora.common.engine.intake import Wait
from hora.common.engine.steady.schedule import DEVIATED, FOLLOWING, Schedule, blocked_code
from hora.common.engine.steady.waits import Waits, name_list
from hora.common.engine.timing import STALL_PROBE_S, STEADY_BLOCKED_GRACE_S, WATCH_INTERVAL_S
from hora.common.vocabulary.message import Key

logger = logging.getLogger("hora")


class Collector:
    """What this rank holds toward the steady state's current batch.

    Args:
        context: the engine's shared parts: its intake (whose lock guards what submitting
            threads touch here), and whether the watcher saw the job fail.
        waits: the steady state's stall records (whether other ranks wait for this one).

    Attributes:
        held: entries taken from the intake's queue and not run yet, by key (the engine
            thread's alone).
        awaiting: keys of the current batch not submitted yet; ``Replay.admit`` discards them
            as they arrive, under the intake's lock.
    """

    def __init__(self, context: EngineContext, waits: Waits) -> None:
        self._intake = context.intake
        self._rank = context.rank
        self._waits = waits
        self._failure_seen = context.failure_seen
        # How long a user may wait on a result whose batch cannot fill before it is cut.
        self._grace_s = max(STEADY_BLOCKED_GRACE_S, 10 * context.settings.cycle_time_ms / 1000)
        self.held: dict[Key, Entry] = {}
        self.awaiting: set[Key] = set()
        # A user polled a result while a batch was held back (see collect).
        self._polled = False

    def note_polled(self) -> None:
        """A user polled a result that is not in yet (under the intake's lock)."""
        self._polled = True

    def release(self) -> list[Entry]:
        """Everything held, in the order it was taken; nothing is held any more."""
        held = list(self.held.values())
        self.held.clear()
        return held

    def collect(
        self, schedule: Schedule, flight: list[Entry | None] | None, next_batch: int
    ) -> tuple[int, str | None] | None:
        """Wait until this rank holds every entry of the current batch, or say why it can't.

        The batch in flight (``flight``: its entries; the one before, still on the wire or
        done) is landed after the next one starts, not as soon as it is done: during backward
        nobody needs its results yet, and landing it then would take the interpreter and a core
        from backward, plus a callback on the transport's thread to learn that it is done. It is
        landed first only when a user waits for (or polls) a result.

        Args:
            schedule: the schedule being replayed.
            flight: the entries of the batch in flight, if any.
            next_batch: the number the batch will have once started (the same on every rank).

        Returns:
            (this rank's code for the batch, what deviated when it is not FOLLOWING), or None
            when ``flight`` must land first.
        """
        needed = [r.key for r in schedule.current]
        stall_after = self._waits.stall_after_s
        started = time.monotonic()
        warned = False
        probe = 0.0

        def begin() -> None:
            self.awaiting = set(needed)

        def look(queue: deque[Entry]) -> tuple[int, str | None] | None | Wait:
            nonlocal warned, probe
            outcome = self._outcome(queue, schedule, needed)
            if outcome is not None:
                return outcome
            if flight is not None and self._flight_wanted(flight):
                return None
            now = time.monotonic()
            blocked = self._blocked_cut(schedule, needed, started, now)
            if isinstance(blocked, tuple):
                return blocked
            if stall_after and not warned and now - started > stall_after and now >= probe:
                # Some rank waits for this one (it recorded so), or every rank is busy
                # elsewhere at once, which is no stall: ask the store now and then.
                probe = now + STALL_PROBE_S
                warned = self._warn_if_peers_wait(schedule, now - started, next_batch)
            return Wait(min(WATCH_INTERVAL_S, blocked))

        return self._intake.wait_steady(begin, look)

    def _outcome(
        self, queue: deque[Entry], schedule: Schedule, needed: list[Key]
    ) -> tuple[int, str | None] | None:
        """Take what was submitted since; the batch's code once this rank's part is decided
        (every entry in, or a deviation), else None. Called with the intake's lock held."""
        while queue:
            entry = queue.popleft()
            self.held[entry.request.key] = entry
            if not schedule.expects(entry.request):
                return DEVIATED, f"{entry.request.name} is not next in the schedule"
        self.awaiting.difference_update(self.held)
        if self._intake.shutdown_reason is not None:
            return DEVIATED, "shutdown"
        if self._failure_seen():
            return DEVIATED, "a failure was reported"
        if self.awaiting:
            return None
        for key in needed:
            del self.held[key]
        return FOLLOWING, None

    def _flight_wanted(self, flight: list[Entry | None]) -> bool:
        """Whether a user polled, or waits for, a result of the batch in flight."""
        blocked = self._intake.blocked
        if self._polled or any(e is not None and e.handle in blocked for e in flight):
            self._polled = False
            return True
        return False

    def _blocked_cut(
        self, schedule: Schedule, needed: list[Key], started: float, now: float
    ) -> tuple[int, str] | float:
        """A user blocked on a result this rank has not run yet: the batch may never fill (its
        user submits the rest only after the result). Past a grace period, the code that cuts
        the batch before the first tensor still missing; before it, how long to wait at most.
        Results already running are not waited for here."""
        blocked = self._intake.blocked
        since = [blocked[e.handle] for e in self.held.values() if e.handle in blocked]
        if not since:
            return WATCH_INTERVAL_S
        waited = now - max(min(since), started)
        grace = self._grace_s
        if waited < grace:
            return grace - waited
        first = min(i for i, k in enumerate(needed) if k in self.awaiting)
        return blocked_code(first), f"a result is awaited before {schedule.current[first].name}"

    def _warn_if_peers_wait(self, schedule: Schedule, waited: float, next_batch: int) -> bool:
        """Warn once other ranks wait for this one's part of the batch; whether it warned.
        (Under the intake's lock: the store is asked at most every STALL_PROBE_S.)"""
        if not self._waits.peers_wait(next_batch):
            return False
        logger.warning(
            "rank %d has not submitted %s for %.0f s while other ranks wait for them "
            "(steady state).",
            self._rank,
            name_list([r.name for r in schedule.current if r.key not in self.held]),
            waited,
        )
        return True
