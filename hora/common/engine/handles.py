"""What a call hands the engine and gets back: :class:`Entry` (one tensor of one call) and
:class:`Handle` (the pending result of the call).

A handle tells its :class:`WaitObserver` (the engine's intake) when a thread starts and stops
waiting for it, and when a thread polls it before it is done: the engine uses both to decide
when to deliver results (see docs/engine.md). This module knows requests and tensors as opaque
values; it holds no engine state.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from hora.common.vocabulary.errors import HoraInternalError
from hora.common.vocabulary.message import Key, Request, RequestType

if TYPE_CHECKING:
    import torch

    from hora.common.engine.steady import Schedule


class WaitObserver(Protocol):
    """Told about the threads that wait for handles (the engine's intake implements it)."""

    def waiting(self, handle: Handle, blocked: bool) -> None:
        """A thread starts (``True``) or stops (``False``) blocking on ``handle``."""

    def polled(self) -> None:
        """A thread polled a handle that is not done yet."""

    def consumed(self, handle: Handle) -> None:
        """A thread took ``handle``'s result (or its failure), or polled it done: its names
        are free again."""


class Handle:
    """The pending result of one collective call (several tensors for a grouped call).

    Args:
        number: the handle's number among its engine's (Horovod's handles are integers).
        count: the number of tensors (entries) of the call.
        kind: the operation.
        grouped: whether it is a grouped call (its result is a list).
        observer: told when threads wait for or poll this handle (``None``: nobody).
        opening: serialises releasing the waiters (the finisher may deliver a result while the
            engine fails the job): its engine's lock, shared by the engine's handles (``None``:
            a lock of the handle's own).
    """

    __slots__ = (
        "_done",
        "_latch",
        "_opening",
        "_remaining",
        "error",
        "grouped",
        "id",
        "keys",
        "kind",
        "observer",
        "results",
        "settle",
    )

    def __init__(
        self,
        number: int,
        count: int,
        kind: RequestType,
        grouped: bool = False,
        observer: WaitObserver | None = None,
        opening: threading.Lock | None = None,
    ) -> None:
        self.id = number
        self.kind = kind
        self.grouped = grouped
        self.observer = observer
        # Each tensor's result, of the call's own kind (a tensor, a tensor and its splits, a set
        # id, ...): the caller that made the handle reads it as such.
        self.results: list[Any] = [None] * count
        self.error: str | None = None
        # The keys its call was submitted under (set by the intake; see WaitObserver.consumed).
        self.keys: tuple[Key, ...] = ()
        self._remaining = count
        # A latch: held until the result is in (a bare lock costs a fraction of an Event,
        # and every gradient of every step makes a handle).
        self._done = count == 0
        self._latch = threading.Lock()
        if not self._done:
            self._latch.acquire()
        self._opening = opening if opening is not None else threading.Lock()
        # For a call signed ahead on a lane (hora.common.ops.direct): settles it on the thread
        # that polls (False: without waiting) or waits (True) for this handle.
        self.settle: Callable[[bool], None] | None = None

    def done(self) -> bool:
        return self._done

    def poll(self) -> bool:
        """Whether the result is in; tells the observer when it is not (never blocks)."""
        settle = self.settle
        if settle is not None and not self._done:
            settle(False)
        if self._done:
            if self.observer is not None and self.keys:
                self.observer.consumed(self)
            return True
        if self.observer is not None:
            self.observer.polled()
        return False

    def wait(self) -> list[Any]:
        """Block until done; return the per-tensor results.

        Raises:
            HoraInternalError: the operation failed on this rank.
        """
        observer = self.observer
        settle = self.settle
        if settle is not None and not self._done:
            settle(True)
        if not self._done:
            if observer is not None:
                observer.waiting(self, True)
            try:
                # Any number of waiters pass, one after another.
                with self._latch:
                    pass
            finally:
                if observer is not None:
                    observer.waiting(self, False)
        if observer is not None and self.keys:
            observer.consumed(self)
        if self.error is not None:
            raise HoraInternalError(self.error)
        return self.results

    def deliver(self, index: int, value: object) -> None:
        """One tensor's result, delivered by the caller's own thread (the fast path)."""
        self._set(index, value)

    def deliver_all(self, values: Sequence[object]) -> None:
        """Every tensor's result at once, delivered by the caller's own thread (the fast
        path)."""
        self.results[: len(values)] = values
        self._remaining -= len(values)
        if self._remaining == 0 and self.error is None:
            self._open()

    def fail(self, message: str) -> None:
        """The call failed on the caller's own thread (the fast path)."""
        self._fail(message)

    def _set(self, index: int, value: object) -> None:
        self.results[index] = value
        self._remaining -= 1
        if self._remaining == 0 and self.error is None:
            self._open()

    def _fail(self, message: str) -> None:
        if not self._done:
            self.error = message
            self._open()

    def _open(self) -> None:
        """Release the waiters, once (results and failures may race to get here)."""
        with self._opening:
            if self._done:
                return
            self._done = True
            self._latch.release()


@dataclass(eq=False, slots=True)
class Entry:
    """One tensor of one call: what was asked, the input, and where the result goes."""

    request: Request
    tensor: torch.Tensor | None
    output: torch.Tensor | None
    handle: Handle
    index: int = 0
    # The steady-state schedule whose batch buffer already holds this entry's tensor.
    staged: Schedule | None = None
    # When it was submitted (timeline microseconds; 0 when no timeline was running).
    submitted: int = 0
    # Whether the result may be lent instead of written into the destination: a view of the
    # engine's steady-state buffer, which the caller adopts (``grad.set_(result)``).
    lend: bool = False


def finish(entry: Entry, result: object) -> None:
    """Deliver one entry's result to its handle."""
    entry.handle._set(entry.index, result)


def fail(entries: list[Entry], message: str) -> None:
    """Fail the handles of ``entries`` with ``message``."""
    for entry in entries:
        entry.handle._fail(message)
