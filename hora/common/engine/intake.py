"""The intake: where user threads hand entries to the engine, and wait for them.

It owns what both sides touch, under one lock: the queue of new entries, the table of entries
in flight (by key, so a name is unique within its process set), the threads blocked on
handles, and whether the engine still takes work. The engine thread drains the queue, takes
entries out when it runs them, and puts them back when it must negotiate them again. It knows
entries and handles, never tensors' contents or transports.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from hora.common.engine.handles import Entry, Handle, fail
from hora.common.errors import DUPLICATE_NAME, HoraInternalError, HoraValueError, shut_down_message
from hora.common.message import Key, key_parts


class Intake:
    """The user threads' side of the engine (a :class:`~hora.common.engine.handles.WaitObserver`).

    Attributes:
        wakeup: the lock, as a condition the engine thread waits on for new work.
        queue: entries submitted since the engine last drained them.
        in_flight: every entry submitted and not yet run, by key.
        blocked: handles user threads are blocked on, with when each started waiting.
        taken: entries the current cycle took out of ``in_flight`` (handed back should it fail).
        running: whether the engine takes work.
        shutdown_reason: why the job is ending, once it is.
        failure: the diagnosis every call raises once the job failed.
        steady: whether the steady state runs (waits then wake the engine).
        on_poll: called, under the lock, when a thread polls a handle that is not done.
    """

    def __init__(self) -> None:
        self.wakeup = threading.Condition(threading.Lock())
        self.queue: deque[Entry] = deque()
        self.in_flight: dict[Key, Entry] = {}
        self.blocked: dict[Handle, float] = {}
        self.taken: list[Entry] = []
        self.running = False
        self.shutdown_reason: str | None = None
        self.failure: str | None = None
        self.steady = False
        self.on_poll: Callable[[], None] | None = None

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
        with self.wakeup:
            if not self.running or self.shutdown_reason is not None:
                raise HoraInternalError(self.failure or shut_down_message(self.shutdown_reason))
            in_flight = self.in_flight
            for entry in entries:
                if entry.request.key in in_flight:
                    raise HoraValueError(DUPLICATE_NAME.format(name=entry.request.name))
            if len(entries) > 1 and len({e.request.key for e in entries}) != len(entries):
                raise HoraValueError(DUPLICATE_NAME.format(name=entries[0].request.name))
            for entry in entries:
                in_flight[entry.request.key] = entry
            if submitted:
                for entry in entries:
                    entry.submitted = submitted
            self.queue.extend(entries)
            if admit(entries):
                self.wakeup.notify_all()

    def waiting(self, handle: Handle, blocked: bool) -> None:
        with self.wakeup:
            if blocked:
                self.blocked[handle] = time.monotonic()
            else:
                self.blocked.pop(handle, None)
            if self.steady:
                self.wakeup.notify_all()

    def polled(self) -> None:
        with self.wakeup:
            if self.on_poll is not None:
                self.on_poll()

    # ------------------------------------------------------------- engine thread

    def drain(self) -> list[Entry]:
        with self.wakeup:
            new = list(self.queue)
            self.queue.clear()
            return new

    def take(self, keys: Sequence[Key]) -> list[Entry | None]:
        """Take these keys' entries out of the in-flight table (``None`` where there is none);
        should the cycle fail, they are handed back so that their handles fail too."""
        with self.wakeup:
            entries = [self.in_flight.pop(key, None) for key in keys]
        self.taken.extend(entry for entry in entries if entry is not None)
        return entries

    def get(self, keys: Iterable[Key]) -> list[Entry | None]:
        """The entries of these keys still in flight, without taking them."""
        with self.wakeup:
            return [self.in_flight.get(key) for key in keys]

    def hand_back(self, entries: Iterable[Entry | None]) -> None:
        """The job is failing: make entries visible again so that their handles fail with the
        diagnosis instead of waiting forever."""
        with self.wakeup:
            for entry in entries:
                if entry is not None:
                    self.in_flight[entry.request.key] = entry

    def requeue(self, entries: list[Entry]) -> None:
        """Put entries back in flight and at the front of the queue, in order (they are
        negotiated again). Called with the lock held."""
        for entry in entries:
            self.in_flight[entry.request.key] = entry
        self.queue.extendleft(reversed(entries))

    def wait_for_work(
        self, deadline: float | None, until: Callable[[], bool] = lambda: False
    ) -> None:
        """Return when there is new work, the job ends, ``until()`` holds (checked whenever the
        lock's condition is notified), or ``deadline`` (monotonic) passed; ``None`` waits for
        work however long it takes."""
        with self.wakeup:
            while not self.queue and self.shutdown_reason is None and not until():
                if deadline is None:
                    self.wakeup.wait()
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self.wakeup.wait(timeout=remaining)

    def notify(self) -> None:
        """Wake a thread waiting in :meth:`wait_for_work` to look at its condition again."""
        with self.wakeup:
            self.wakeup.notify_all()

    def end(self, message: str) -> None:
        """Orderly stop: every pending and future call fails with ``message``."""
        with self.wakeup:
            self.running = False
            pending = list(self.in_flight.values()) + list(self.queue)
            self.in_flight.clear()
            self.queue.clear()
        fail(pending, message)

    def awaited(self, after_s: float) -> list[Key]:
        """Keys still in flight that some thread has waited for ``after_s`` or longer."""
        now = time.monotonic()
        with self.wakeup:
            blocked = self.blocked
            awaited = [
                key
                for key, entry in self.in_flight.items()
                if now - blocked.get(entry.handle, now) >= after_s
            ]
        return sorted(awaited, key=key_parts)
