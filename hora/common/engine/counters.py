"""What the engine did, counted as it happens, for live metrics (:mod:`hora.common.metrics`).

The engine's threads add to these counters at points they pass anyway (a batch's collective
started and done, a negotiation exchange, a cycle that left requests waiting for other ranks):
a clock read and a few additions per batch or cycle, no I/O. The user's thread reads them at
step boundaries with :meth:`Counters.take`. This module knows numbers and times, never tensors,
files or sockets.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

# Collective intervals kept between two reads; a step with more batches than this loses its
# oldest intervals from the communication time (the byte and batch counts stay exact).
MAX_INTERVALS = 8192


@dataclass(frozen=True)
class Totals:
    """The counters' values at one moment, each counted from the engine's start.

    Attributes:
        reduced_bytes: bytes reduced: allreduce results (fused batches, steady-state batches,
            allreduces carried in the negotiation exchange) and reducescatter inputs.
        batches: collectives run (a fused batch of many tensors counts once).
        tensors: tensors in those collectives.
        negotiation_s: time the engine thread spent in negotiation exchanges.
        stall_s: time during which calls submitted by some ranks waited for other ranks to
            submit them too (negotiated calls only: in the steady state, that wait happens
            inside the collective and counts as communication).
        cycles: negotiation cycles run.
    """

    reduced_bytes: int = 0
    batches: int = 0
    tensors: int = 0
    negotiation_s: float = 0.0
    stall_s: float = 0.0
    cycles: int = 0


class Counters:
    """The engine's counters; safe to add to from the engine and finisher threads.

    Times are :func:`time.perf_counter` seconds.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reduced_bytes = 0
        self._batches = 0
        self._tensors = 0
        # Only the engine thread adds these (no lock needed).
        self.negotiation_s = 0.0
        self.stall_s = 0.0
        self.cycles = 0
        self._intervals: deque[tuple[float, float]] = deque(maxlen=MAX_INTERVALS)

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def collective(self, issued: float, done: float, nbytes: int, tensors: int) -> None:
        """A collective over ``tensors`` tensors that ran from ``issued`` to ``done``, having
        reduced ``nbytes`` (allreduce results, reducescatter inputs; 0 for other collectives)."""
        with self._lock:
            self._batches += 1
            self._tensors += tensors
            self._reduced_bytes += nbytes
            self._intervals.append((issued, done))

    def carried(self, nbytes: int) -> None:
        """An allreduce reduced from bytes carried in the negotiation exchange (no wire time
        of its own)."""
        with self._lock:
            self._batches += 1
            self._tensors += 1
            self._reduced_bytes += nbytes

    def negotiated(self, seconds: float, stalled: float) -> None:
        """One negotiation cycle: ``seconds`` in its exchange, and ``stalled`` seconds since the
        previous cycle left requests waiting for other ranks (0 when it left none)."""
        self.cycles += 1
        self.negotiation_s += seconds
        self.stall_s += stalled

    def take(self) -> tuple[Totals, list[tuple[float, float]]]:
        """The totals now, and the collective intervals recorded since the last call."""
        with self._lock:
            intervals = list(self._intervals)
            self._intervals.clear()
            totals = Totals(
                self._reduced_bytes,
                self._batches,
                self._tensors,
                self.negotiation_s,
                self.stall_s,
                self.cycles,
            )
        return totals, intervals
