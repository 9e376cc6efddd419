"""How a rank learns that the job failed, and says why: the watcher thread, the diagnosis of a
failed collective, and the deadlock check.

- :class:`Watcher` watches the store for the job's failure key (set by the launcher when a
  process exits, or by a rank whose collective failed) and for the doorbell of a parked engine.
- :func:`diagnose` turns a transport error into a message that names the lost rank, from the
  launcher's exit records and the other ranks' alive marks.
- :class:`DeadlockCheck` records what this rank's blocked threads wait for and, on rank 0,
  finds the moment every rank waits for something another rank never submitted.

This module knows the store and the negotiation table, never tensors.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

from hora.common.engine.context import EngineContext
from hora.common.engine.negotiation import MessageTable
from hora.common.engine.stall import StallInspector, ranks_text
from hora.common.engine.timing import (
    DEADLOCK_PROBE_S,
    DIAGNOSE_WINDOW_S,
    WATCH_INTERVAL_S,
)
from hora.common.job.store import (
    AuthenticationError,
    StoreClient,
    read_failure,
    report_failure,
    tampering,
)
from hora.common.job.store_keys import FAILURE, GenerationKeys, exit_key
from hora.common.vocabulary.message import Key, key_parts, make_key

logger = logging.getLogger("hora")


class Watcher(threading.Thread):
    """Watches the store for a doorbell while the engine is parked, and for failures always.

    Uses its own store connection: a blocking ``wait`` holds the connection it runs on.

    Args:
        store: this thread's own store connection.
        ring_store: another connection, to ring the doorbell when stopping.
        keys: the generation's store keys.
        running: whether the engine still runs.
        woken: called with a parking round whose doorbell rang.
        abort: called once a failure is seen: aborts the communicators and wakes the engine.
    """

    def __init__(
        self,
        store: StoreClient,
        ring_store: StoreClient,
        keys: GenerationKeys,
        running: Callable[[], bool],
        woken: Callable[[int], None],
        abort: Callable[[], None],
    ) -> None:
        super().__init__(name="hora-watcher", daemon=True)
        self._store = store
        self._ring_store = ring_store
        self._keys = keys
        self._running = running
        self._woken = woken
        self._abort = abort
        self._watching = 0
        self._stop_flag = False
        self._event = threading.Event()
        self.failure: str | None = None

    def watch(self, round_: int) -> None:
        """Wait on the doorbell of parking round ``round_``."""
        self._watching = round_
        self._event.set()

    def stop(self) -> None:
        self._stop_flag = True
        self._event.set()
        try:
            self._ring_store.set_signed(self._keys.wake(self._watching), b"")
        except Exception:  # best effort at exit
            pass

    def run(self) -> None:
        seen = 0
        try:
            while not self._stop_flag and self._running():
                target = self._watching
                if target > seen:
                    self._check_failure()
                    if self.failure is not None:
                        return
                    # Bounded, then the newest round again: rank 0 deletes a round's key when
                    # the next round parks, and a watcher that load kept from running may only
                    # get here after that. Waiting on with no timeout, it would never see the
                    # next round's doorbell, and the job would stall until a collective timed
                    # out on the ranks that did wake.
                    if self._store.wait(self._keys.wake(target), WATCH_INTERVAL_S):
                        seen = target
                        self._woken(target)
                    continue
                self._event.wait(WATCH_INTERVAL_S)
                self._event.clear()
                self._check_failure()
        except AuthenticationError as exc:
            self.failure = tampering(exc)
            self._abort()
        except Exception as exc:  # store gone: let the engine find out
            if self._running() and not self._stop_flag:
                self.failure = f"the job's rendezvous store became unreachable: {exc}"
                self._abort()

    def _check_failure(self) -> None:
        if self.failure is None and self._store.check(FAILURE):
            read_failure(self._store)  # a forged report raises AuthenticationError
            self.failure = "another rank or the launcher reported a failure"
            self._abort()


def diagnose(
    store: StoreClient, keys: GenerationKeys, rank: int, size: int, error: str, reported: bool
) -> str:
    """Turn a transport error into a message that names the lost rank.

    Marks this rank alive and the job failed in the store, then waits up to
    ``DIAGNOSE_WINDOW_S`` for the launcher's exit records and the other ranks' alive marks.

    Args:
        error: the transport's error text.
        reported: whether another rank or the launcher had reported a failure first.
    """
    others = [r for r in range(size) if r != rank]
    try:
        store.mark(keys.alive(rank))
        report_failure(store, f"rank {rank}: {error}")
        deadline = time.monotonic() + DIAGNOSE_WINDOW_S
        silent = others
        while True:
            exits = [r for r in others if store.check(exit_key(r))]
            if exits:
                details = "; ".join(
                    store.get_signed(exit_key(r)).decode(errors="replace") for r in exits
                )
                return (
                    f"hora lost {ranks_text(exits)}: {details}. Rank {rank} cannot continue "
                    f"the collective (transport error: {error})"
                )
            silent = [r for r in others if not store.marked(keys.alive(r))]
            if not silent or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        # Aborted because another rank reported a failure first: its report says why.
        report = read_failure(store) if reported else ""
    except AuthenticationError as exc:
        return tampering(exc, rank)
    except Exception as exc:  # the store itself may be gone
        return (
            f"rank {rank}: a collective failed ({error}) and the job's rendezvous store "
            f"is unreachable ({exc}); the launcher or the host of rank 0 may have exited."
        )
    if silent:
        return (
            f"hora lost {ranks_text(silent)}: {'it' if len(silent) == 1 else 'they'} stopped "
            f"responding (the process exited, was killed, or its host is unreachable). "
            f"Rank {rank} saw: {error}"
        )
    if report and not report.startswith(f"rank {rank}: "):
        return f"rank {rank} stopped after a failure on another rank: {report}"
    return f"rank {rank}: a collective failed while every rank is still alive: {error}"


class DeadlockCheck:
    """Every rank records what its blocked threads wait for; rank 0 looks for a deadlock.

    Both run while the engine is parked, which is where a deadlock shows: nobody has anything
    new. Rank 0 declares one when the negotiation table has stood still for as long as a
    collective may wait for its peers (``HORA_GLOO_TIMEOUT_SECONDS``) and every rank waits for
    a call that another rank has not submitted.

    Args:
        context: the engine's shared parts (the store the records go to, this rank).
        stall: the stall inspector (whether checks are on; it words the verdict).
    """

    def __init__(self, context: EngineContext, stall: StallInspector) -> None:
        self._store = context.store
        self._keys = context.keys
        self._rank = context.rank
        self._size = context.size
        self._stall = stall
        # A deadlock is declared no sooner than a collective would time out.
        self._after_s = context.settings.gloo_timeout_s
        self._recorded = ""
        self._probe = 0.0

    def record(self, awaited: list[Key]) -> None:
        """Record in the store what this rank's blocked threads wait for (when it changed)."""
        text = json.dumps([key_parts(k) for k in awaited]) if self._size > 1 else ""
        if text == self._recorded:
            return
        try:
            self._store.set_signed(self._keys.waits(self._rank), text.encode())
            self._recorded = text
        except Exception as exc:  # a lost store fails the job elsewhere
            logger.debug("rank %d could not record its waits: %s", self._rank, exc)

    def check(self, table: MessageTable, awaited: list[Key]) -> str | None:
        """On rank 0: the shutdown reason when every rank has waited long for calls
        that other ranks never submitted, with nothing arriving meanwhile."""
        if self._rank != 0 or self._size == 1 or not self._stall.enabled or not table:
            return None
        now = time.monotonic()
        idle = now - table.changed
        if idle < self._after_s or now < self._probe:
            return None
        self._probe = now + DEADLOCK_PROBE_S
        waits: dict[int, list[Key]] = {0: awaited}
        try:
            for rank in range(1, self._size):
                key = self._keys.waits(rank)
                if not self._store.check(key):
                    return None
                waits[rank] = _keys_from_json(self._store.get_signed(key))
        except Exception as exc:  # a record that cannot be read is no deadlock
            logger.debug("rank 0 could not read the ranks' waits: %s", exc)
            return None
        reason = self._stall.deadlock(table, waits, idle)
        if reason is not None:
            logger.error("%s", reason)
        return reason


def _keys_from_json(data: bytes) -> list[Key]:
    """Keys as :meth:`DeadlockCheck.record` writes them; malformed records count as none."""
    try:
        items = json.loads(data.decode())
        return [make_key(int(set_id), str(name)) for set_id, name in items]
    except (ValueError, TypeError):
        return []
