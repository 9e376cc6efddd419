"""Parking: idle ranks sleep on a doorbell in the store instead of exchanging empty cycles.

When nothing has happened for a few cycles on any rank, every rank parks at the same cycle (the
count follows from the exchanges, which every rank sees alike) and stops using CPU. The first
rank that gets new work, or ends the job, rings the round's doorbell in the store, and all
resume; the watcher thread hears the doorbell (``Intake.ring``). While parked, each rank looks
for a stall and records what its blocked threads wait for, and rank 0 looks for a deadlock.

This module knows the store's doorbell keys, the intake's parked wait and the deadlock check;
not what a cycle exchanges or runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from hora.common.engine.context import EngineContext, NegotiationState
from hora.common.engine.failures import DeadlockCheck
from hora.common.engine.timing import PARK_AFTER_IDLE_S, WAIT_RECORD_AFTER_S
from hora.common.job.store_keys import PARKED


class Parking:
    """When this rank parks, and its parked sleep.

    Args:
        context: the engine's shared parts: the intake (the parked wait, and the doorbell the
            watcher heard), the store (the doorbell), the tracer (flushed before sleeping).
        negotiation: the table and the stall inspector (stalls and deadlocks are read there).
        watch: tells the watcher thread which round's doorbell to wait on.
    """

    def __init__(
        self,
        context: EngineContext,
        negotiation: NegotiationState,
        watch: Callable[[int], None],
    ) -> None:
        self._context = context
        self._intake = context.intake
        self._size = context.size
        self._table = negotiation.table
        self._stall = negotiation.stall
        self._watch = watch
        self._deadlocks = DeadlockCheck(context, negotiation.stall)
        # The latest parking round (the same on every rank).
        self.round = 0
        self._idle_cycles = 0
        self._park_after = max(
            2, math.ceil(PARK_AFTER_IDLE_S * 1000 / max(context.settings.cycle_time_ms, 0.1))
        )

    def cycle_ended(self, had_news: bool) -> None:
        """Count a negotiated cycle: whether any rank had anything new in it."""
        self._idle_cycles = 0 if had_news else self._idle_cycles + 1

    @property
    def due(self) -> bool:
        """Whether this rank parks instead of running the next cycle (every rank decides
        alike)."""
        return self._size > 1 and self._idle_cycles >= self._park_after

    def park(self) -> None:
        """Sleep until this rank has work, another rank rings, or a check is due."""
        context = self._context
        store, keys = context.store, context.keys
        round_ = self.round = self.round + 1
        wake_key = keys.wake(round_)
        timeline = context.tracer.timeline
        if timeline is not None:
            # Idle: what happened so far reaches the file now, for anyone reading it meanwhile.
            timeline.flush()
        if context.rank == 0:
            if round_ > 1:
                store.delete(keys.wake(round_ - 1))
            # Whoever reports a failure rings the doorbell named here, to wake parked ranks.
            store.set_signed(PARKED, wake_key.encode())
        self._watch(round_)
        ring = self._intake.wait_parked(
            round_, context.failure_seen, self._stalled, self._deadlocked
        )
        if ring:
            store.mark(wake_key)
        self._idle_cycles = 0

    def wake(self) -> None:
        """The job failed: wake this rank if it is parked."""
        self._intake.ring(self.round)

    def _stalled(self) -> str | None:
        return self._stall.check_if_due(self._table)

    def _deadlocked(self) -> str | None:
        """Record what this rank's blocked threads wait for; on rank 0, the reason to end a
        deadlocked job (store calls: the intake's lock is not held)."""
        awaited = self._intake.awaited(WAIT_RECORD_AFTER_S)
        self._deadlocks.record(awaited)
        return self._deadlocks.check(self._table, awaited)
