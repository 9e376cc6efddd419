"""The intake: where user threads hand entries to the engine, and where the engine thread waits.

It owns what the user threads, the watcher, the finisher and the engine thread touch, under one
lock: the queue of new entries, the table of entries in flight (by key, so a name is unique
within its process set), the threads blocked on handles, whether the engine still takes work,
why the job is ending, and the parking rounds whose doorbell rang. The lock, as a condition the
engine thread waits on, is private to :class:`Intake`: everyone else calls its transitions, and
a transition that takes a callback runs it under the lock. That is how the steady state changes
what submitting threads stage into atomically with their submissions.

It knows entries and handles, never tensors' contents, schedules or transports.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from hora.common.engine.handles import Entry, Handle, fail
from hora.common.engine.timing import WATCH_INTERVAL_S
from hora.common.vocabulary.errors import (
    DUPLICATE_NAME,
    HoraInternalError,
    HoraValueError,
    shut_down_message,
)
from hora.common.vocabulary.message import Key, key_parts

_T = TypeVar("_T")


@dataclass(slots=True)
class Wait:
    """What a look in :meth:`Intake.wait_steady` returns while it must wait: this long at most
    (seconds), or until the condition is notified."""

    timeout_s: float


class Intake:
    """The user threads' side of the engine (a :class:`~hora.common.engine.handles.WaitObserver`).

    Transitions, by caller:

    - user threads: :meth:`submit`, :meth:`waiting`, :meth:`polled`;
    - the engine's lifecycle: :meth:`start`, :meth:`request_shutdown`, :meth:`fail`, :meth:`end`,
      :meth:`stop`;
    - a negotiated cycle: :meth:`begin_cycle`, :meth:`wait_for_work`, :meth:`drain`, :meth:`take`,
      :meth:`get`, :meth:`hand_back`, :meth:`hand_back_taken`; the finisher: :meth:`notify`;
    - parking: :meth:`wait_parked`, and :meth:`ring` (the watcher heard a doorbell);
    - the steady state: :meth:`when_polled`, :meth:`enter_steady`, :meth:`between_submissions`,
      :meth:`wait_steady`, :meth:`leave_steady`.
    """

    def __init__(self) -> None:
        # The lock over everything here, as a condition the engine thread waits on.
        self._wakeup = threading.Condition(threading.Lock())
        # Entries submitted since the engine last drained them.
        self._queue: deque[Entry] = deque()
        # Every entry submitted and not yet run, by key.
        self._in_flight: dict[Key, Entry] = {}
        # The latest handle submitted under each key whose result no thread has taken yet
        # (see _in_use), and the highest handle number whose result a thread took.
        self._unconsumed: dict[Key, Handle] = {}
        self._latest_consumed = 0
        # Handles user threads are blocked on, with when each started waiting.
        self._blocked: dict[Handle, float] = {}
        # Entries the current cycle took out of _in_flight (handed back should it fail); the
        # engine thread's alone.
        self._taken: list[Entry] = []
        self._running = False
        self._shutdown_reason: str | None = None
        # Whether this rank's shutdown request is orderly (hvd.shutdown() or the process's exit).
        self._shutdown_orderly = False
        # Whether the engine ended because some rank called hvd.shutdown() or exited.
        self._ended_orderly = False
        # What calls raise once the engine ended (the agreed cause first).
        self._ended_message: str | None = None
        self._failure: str | None = None
        # Whether the steady state runs (waits then wake the engine).
        self._steady = False
        # Called, under the lock, when a thread polls a handle that is not done; says whether
        # the engine thread must wake.
        self._on_poll: Callable[[], bool] | None = None
        # The latest parking round whose doorbell rang.
        self._rung = 0

    # ------------------------------------------------------------- what anyone may read

    @property
    def running(self) -> bool:
        """Whether the engine takes work."""
        return self._running

    @property
    def shutdown_reason(self) -> str | None:
        """Why the job is ending, once it is."""
        return self._shutdown_reason

    @property
    def shutdown_orderly(self) -> bool:
        """Whether this rank asked for the end through ``hvd.shutdown()`` or its exit."""
        return self._shutdown_orderly

    @property
    def ended_orderly(self) -> bool:
        """Whether the engine ended only because a rank called ``hvd.shutdown()`` or exited
        (not after a failure, a stall or a deadlock)."""
        return self._ended_orderly and not self._running and self._failure is None

    @property
    def failure(self) -> str | None:
        """The diagnosis every call raises once the job failed."""
        return self._failure

    @property
    def has_queued(self) -> bool:
        """Whether entries wait to be drained (read without the lock: a hint)."""
        return bool(self._queue)

    @property
    def blocked(self) -> Mapping[Handle, float]:
        """The handles user threads are blocked on, with when each started waiting; read it
        under the lock, from a transition's callback."""
        return self._blocked

    # ------------------------------------------------------------- user threads

    def submit(
        self, entries: list[Entry], submitted: int, admit: Callable[[list[Entry]], bool]
    ) -> None:
        """Queue entries atomically (a grouped call's entries reach negotiation together).

        Args:
            entries: the call's entries.
            submitted: when (timeline time; 0 without a timeline).
            admit: stages the entries in the steady state and says whether the engine thread
                must wake (always, outside the steady state); called under the lock.

        Raises:
            HoraValueError: a name is already in flight on this rank in its process set.
            HoraInternalError: the engine has stopped.
        """
        with self._wakeup:
            if not self._running or self._shutdown_reason is not None:
                raise HoraInternalError(
                    self._failure or self._ended_message or shut_down_message(self._shutdown_reason)
                )
            in_flight = self._in_flight
            for entry in entries:
                key = entry.request.key
                if key in in_flight or self._in_use(key, entry.handle):
                    raise HoraValueError(DUPLICATE_NAME.format(name=entry.request.name))
            if len(entries) > 1 and len({e.request.key for e in entries}) != len(entries):
                raise HoraValueError(DUPLICATE_NAME.format(name=entries[0].request.name))
            unconsumed = self._unconsumed
            by_handle: dict[Handle, list[Key]] = {}
            for entry in entries:
                key = entry.request.key
                in_flight[key] = entry
                unconsumed[key] = entry.handle
                by_handle.setdefault(entry.handle, []).append(key)
            for handle, keys in by_handle.items():
                handle.keys += tuple(keys)
            if submitted:
                for entry in entries:
                    entry.submitted = submitted
            self._queue.extend(entries)
            if admit(entries):
                self._wakeup.notify_all()

    def waiting(self, handle: Handle, blocked: bool) -> None:
        with self._wakeup:
            if blocked:
                self._blocked[handle] = time.monotonic()
            else:
                self._blocked.pop(handle, None)
            if self._steady:
                self._wakeup.notify_all()

    def polled(self) -> None:
        with self._wakeup:
            if self._on_poll is not None and self._on_poll():
                self._wakeup.notify_all()

    def consumed(self, handle: Handle) -> None:
        with self._wakeup:
            if handle.id > self._latest_consumed:
                self._latest_consumed = handle.id
            unconsumed = self._unconsumed
            for key in handle.keys:
                if unconsumed.get(key) is handle:
                    del unconsumed[key]

    def busy(self) -> bool:
        """Whether calls of this process are in flight on the engine (a hint: read unlocked)."""
        return bool(self._in_flight)

    def claim(self, key: Key, name: str, handle: Handle) -> None:
        """Hold ``key`` for ``handle``, a call that a caller's thread runs (and may hand to
        :meth:`submit` later), as :meth:`submit` holds the keys of the calls it queues.

        Raises:
            HoraValueError: a name is already in flight on this rank in its process set.
        """
        with self._wakeup:
            if key in self._in_flight or self._in_use(key, handle):
                raise HoraValueError(DUPLICATE_NAME.format(name=name))
            self._unconsumed[key] = handle
            handle.keys += (key,)

    def _in_use(self, key: Key, handle: Handle) -> bool:
        """Whether an earlier call under ``key`` still holds it (called under the lock).

        A name submitted stays in use (beyond its negotiation, which ``submit`` checks) until a
        thread takes its result or polls it done, or a later call of this rank is done. So
        ``allreduce_async(t, name="x")`` twice in a row is refused however fast the first one
        ran on the wire, and a result nobody waits for does not hold its name forever.
        """
        earlier = self._unconsumed.get(key)
        if earlier is None or earlier is handle:
            return False
        number = earlier.id
        if self._latest_consumed > number or any(
            other.id > number and other.done() for other in self._unconsumed.values()
        ):
            del self._unconsumed[key]
            return False
        return True

    def awaited(self, after_s: float) -> list[Key]:
        """Keys still in flight that some thread has waited for ``after_s`` or longer."""
        now = time.monotonic()
        with self._wakeup:
            blocked = self._blocked
            awaited = [
                key
                for key, entry in self._in_flight.items()
                if now - blocked.get(entry.handle, now) >= after_s
            ]
        return sorted(awaited, key=key_parts)

    # ------------------------------------------------------------- the engine's lifecycle

    def start(self) -> None:
        """The engine takes work from now on."""
        with self._wakeup:
            self._running = True

    def request_shutdown(self, reason: str, orderly: bool = False) -> None:
        """End the job (through the next exchange) for ``reason``, unless a reason was given
        before (the first one stands); wakes the engine thread.

        Args:
            orderly: asked for by ``hvd.shutdown()`` or the process's exit (not a failure,
                stall or deadlock).
        """
        with self._wakeup:
            if self._shutdown_reason is None:
                self._shutdown_reason = reason
                self._shutdown_orderly = orderly
            self._wakeup.notify_all()

    def fail(self, message: str) -> None:
        """The job failed: every call raises ``message`` from now on (:meth:`end` fails those
        pending)."""
        with self._wakeup:
            self._failure = message

    def end(self, message: str, orderly: bool = False) -> None:
        """Stop taking work: every pending and future call fails with ``message``.

        Args:
            orderly: every rank that asked for the end did so through ``hvd.shutdown()`` or its
                exit.
        """
        with self._wakeup:
            self._running = False
            self._ended_orderly = orderly
            self._ended_message = message
            pending = list(self._in_flight.values()) + list(self._queue)
            self._in_flight.clear()
            self._unconsumed.clear()
            self._queue.clear()
        fail(pending, message)

    def stop(self) -> None:
        """The engine thread has ended: it takes no more work."""
        with self._wakeup:
            self._running = False

    # ------------------------------------------------------------- a negotiated cycle

    def begin_cycle(self) -> None:
        """A cycle starts: what the last one took out of the in-flight table has run."""
        self._taken = []

    def drain(self) -> list[Entry]:
        with self._wakeup:
            new = list(self._queue)
            self._queue.clear()
            return new

    def take(self, keys: Sequence[Key]) -> list[Entry | None]:
        """Take these keys' entries out of the in-flight table (``None`` where there is none);
        should the cycle fail, they are handed back so that their handles fail too."""
        with self._wakeup:
            entries = [self._in_flight.pop(key, None) for key in keys]
        self._taken.extend(entry for entry in entries if entry is not None)
        return entries

    def get(self, keys: Iterable[Key]) -> list[Entry | None]:
        """The entries of these keys still in flight, without taking them."""
        with self._wakeup:
            return [self._in_flight.get(key) for key in keys]

    def hand_back(self, entries: Iterable[Entry | None]) -> None:
        """The job is failing: make entries visible again so that their handles fail with the
        diagnosis instead of waiting forever."""
        with self._wakeup:
            for entry in entries:
                if entry is not None:
                    self._in_flight[entry.request.key] = entry

    def hand_back_taken(self) -> None:
        """The cycle failed: hand back what it took (see :meth:`hand_back`)."""
        self.hand_back(self._taken)

    def wait_for_work(
        self, deadline: float | None, until: Callable[[], bool] = lambda: False
    ) -> None:
        """Return when there is new work, the job ends, ``until()`` holds (checked whenever the
        lock's condition is notified), or ``deadline`` (monotonic) passed; ``None`` waits for
        work however long it takes."""
        with self._wakeup:
            while not self._queue and self._shutdown_reason is None and not until():
                if deadline is None:
                    self._wakeup.wait()
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._wakeup.wait(timeout=remaining)

    def notify(self) -> None:
        """Wake a thread waiting in :meth:`wait_for_work` to look at its condition again."""
        with self._wakeup:
            self._wakeup.notify_all()

    # ------------------------------------------------------------- parking

    def ring(self, round_: int) -> None:
        """The doorbell of parking round ``round_`` rang: wake the engine if it is parked."""
        with self._wakeup:
            self._rung = max(self._rung, round_)
            self._wakeup.notify_all()

    def wait_parked(
        self,
        round_: int,
        failure_seen: Callable[[], bool],
        stalled: Callable[[], str | None],
        deadlocked: Callable[[], str | None],
    ) -> bool:
        """Sleep while parked in round ``round_``: until the watcher saw a failure, this rank has
        work or the job ends (returns True: ring the others' doorbell), or the round's doorbell
        rang.

        After each wait (``WATCH_INTERVAL_S`` at most), ``stalled()`` runs under the lock and
        ``deadlocked()`` without it; a reason either returns ends the job.
        """
        with self._wakeup:
            while True:
                if failure_seen():
                    return False
                if self._queue or self._shutdown_reason is not None:
                    return True
                if self._rung >= round_:
                    return False
                self._wakeup.wait(timeout=WATCH_INTERVAL_S)
                stall = stalled()
                # Every rank parks when nobody has anything new: that is where a deadlock
                # shows. The store calls run without the lock, which user threads need.
                self._wakeup.release()
                try:
                    deadlock = deadlocked()
                finally:
                    self._wakeup.acquire()
                self._shutdown_reason = self._shutdown_reason or stall or deadlock

    # ------------------------------------------------------------- the steady state

    def when_polled(self, callback: Callable[[], bool]) -> None:
        """Call ``callback`` (under the lock) when a thread polls a handle that is not done; it
        says whether the engine thread must wake."""
        with self._wakeup:
            self._on_poll = callback

    def enter_steady(self, install: Callable[[], None]) -> None:
        """Install a schedule (``install()``, under the lock): from now on a thread that starts
        or stops waiting on a handle wakes the engine."""
        with self._wakeup:
            install()
            self._steady = True

    def between_submissions(self, change: Callable[[], _T]) -> _T:
        """Run ``change`` while no thread submits: what submissions stage into (the steady
        state's buffers) changes atomically with respect to them."""
        with self._wakeup:
            return change()

    def wait_steady(
        self, begin: Callable[[], None], look: Callable[[deque[Entry]], _T | Wait]
    ) -> _T:
        """Wait for the steady state's next batch to be decided.

        Under the lock: ``begin()``, then ``look(queue)`` (it may take submitted entries from the
        front of the queue) each time the condition is notified, until it returns an outcome
        rather than a :class:`Wait`.
        """
        with self._wakeup:
            begin()
            while True:
                outcome = look(self._queue)
                if not isinstance(outcome, Wait):
                    return outcome
                self._wakeup.wait(timeout=outcome.timeout_s)

    def leave_steady(self, entries: list[Entry], uninstall: Callable[[], None]) -> None:
        """Back to negotiation: put ``entries`` back in flight and at the front of the queue, in
        order (they are negotiated again), and ``uninstall()`` the schedule, atomically."""
        with self._wakeup:
            for entry in entries:
                self._in_flight[entry.request.key] = entry
            self._queue.extendleft(reversed(entries))
            uninstall()
            self._steady = False
