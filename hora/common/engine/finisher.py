"""The finisher thread: completes started allreduces in the order they were started.

Completing means scaling the result and copying it out of the fusion buffer into the callers'
tensors, then finishing their handles; it runs here so that the engine thread can negotiate and
start the next collectives meanwhile. It knows pending transport operations and callbacks, not
requests.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

import torch

from hora.common.engine.handles import Entry, fail
from hora.common.engine.timing import MAX_STARTED, WATCH_INTERVAL_S
from hora.common.transport import Pending, TransportError

logger = logging.getLogger("hora")


class Finisher(threading.Thread):
    """Waits for started collectives, in order, and completes them.

    Args:
        rank: this process's rank (for messages).
        failure: the engine's failure message, or ``None`` while it runs.
        transport_failed: called with a transport error's text; returns the message every
            affected handle fails with (the engine's diagnosis).
        on_idle: called (without the finisher's lock) each time the last started collective
            has completed.
    """

    def __init__(
        self,
        rank: int,
        failure: Callable[[], str | None],
        transport_failed: Callable[[str], str],
        on_idle: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(name="hora-finisher", daemon=True)
        self._rank = rank
        self._failure = failure
        self._transport_failed = transport_failed
        self._on_idle = on_idle
        self._cv = threading.Condition()
        self._items: deque[tuple[Pending, Callable[[], None], list[Entry]]] = deque()
        self._stopping = False

    def add(self, pending: Pending, complete: Callable[[], None], entries: list[Entry]) -> None:
        """Complete ``pending`` with ``complete()`` once it is done; ``entries`` fail if not."""
        with self._cv:
            while len(self._items) >= MAX_STARTED and self._failure() is None:
                self._cv.wait(timeout=WATCH_INTERVAL_S)
            self._items.append((pending, complete, entries))
            self._cv.notify_all()

    @property
    def busy(self) -> bool:
        """Whether a started collective has not completed yet."""
        return bool(self._items)

    def drain(self) -> None:
        """Return when everything started so far has completed or failed."""
        if self is threading.current_thread():
            return
        with self._cv:
            while self._items and self.is_alive():
                self._cv.wait(timeout=WATCH_INTERVAL_S)

    def stop(self) -> None:
        """Finish what was started, then end."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()

    def run(self) -> None:
        while True:
            with self._cv:
                while not self._items and not self._stopping:
                    self._cv.wait()
                if not self._items:
                    return
                pending, complete, entries = self._items[0]
            error: str | None = None
            try:
                pending.wait()
                with torch.no_grad():
                    complete()
            except TransportError as exc:
                error = self._transport_failed(str(exc))
            except Exception as exc:  # every failure must reach the user's handles
                logger.exception("hora could not complete an allreduce on rank %d", self._rank)
                error = f"rank {self._rank}: completing an allreduce failed: {exc!r}"
            if error is not None:
                fail(entries, error)
            with self._cv:
                self._items.popleft()
                idle = not self._items
                self._cv.notify_all()
            # Let go of the completed collective while the next is awaited: its buffer may be a
            # view of a caller's tensor, which may adopt memory only where nothing else refers
            # to it (see owns_its_memory).
            del pending, complete, entries
            if idle:
                self._on_idle()
