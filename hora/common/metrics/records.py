"""One step's metrics, computed from the engine's counters and the step's boundaries.

Pure arithmetic on numbers and time intervals (:func:`time.perf_counter` seconds): no threads,
files or sockets. :mod:`hora.common.metrics` calls :func:`step_timing` at each step's end; the
sinks (:mod:`hora.common.metrics.sinks`) write the :class:`StepRecord` it becomes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from hora.common.engine.counters import Totals


def covered(intervals: Iterable[tuple[float, float]], low: float, high: float) -> float:
    """How long the union of ``intervals`` covers within ``[low, high]`` (intervals that run at
    the same time count once)."""
    clipped = sorted((max(a, low), min(b, high)) for a, b in intervals if b > low and a < high)
    total = 0.0
    end = low
    for start, stop in clipped:
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


@dataclass(frozen=True)
class StepTiming:
    """Where one step's time went on this rank, and what the engine did meanwhile.

    Attributes:
        step_s: from the end of the previous step (or the start of metrics) to this one's end.
        comm_s: time in which at least one collective was running.
        overlap_s: the part of ``comm_s`` inside backward (first to last gradient); 0 when no
            ``DistributedOptimizer`` reported a backward pass.
        reduced_bytes: bytes reduced: allreduce results and reducescatter inputs.
        batches: collectives run (a fused batch counts once).
        tensors: tensors in those collectives.
        negotiation_s: time in negotiation exchanges.
        stall_s: time in which calls waited for some ranks to submit them (negotiated calls).
    """

    step_s: float
    comm_s: float
    overlap_s: float
    reduced_bytes: int
    batches: int
    tensors: int
    negotiation_s: float
    stall_s: float

    @property
    def comm_share(self) -> float:
        """``comm_s / step_s``, between 0 and 1."""
        return min(1.0, self.comm_s / self.step_s) if self.step_s > 0 else 0.0


def step_timing(
    start: float,
    end: float,
    before: Totals,
    after: Totals,
    intervals: Iterable[tuple[float, float]],
    backward: tuple[float, float] | None,
) -> StepTiming:
    """The step from ``start`` to ``end``, given the counters at its start and end, the
    collectives' intervals recorded meanwhile, and its backward pass (first, last gradient)."""
    spans = list(intervals)
    overlap = covered(spans, *backward) if backward is not None else 0.0
    return StepTiming(
        step_s=max(end - start, 0.0),
        comm_s=covered(spans, start, end),
        overlap_s=overlap,
        reduced_bytes=after.reduced_bytes - before.reduced_bytes,
        batches=after.batches - before.batches,
        tensors=after.tensors - before.tensors,
        negotiation_s=after.negotiation_s - before.negotiation_s,
        stall_s=after.stall_s - before.stall_s,
    )


@dataclass(frozen=True)
class StepRecord:
    """What a sink writes for one step of one rank.

    Attributes:
        rank: the rank that measured it.
        step: the step's number on this rank, from 1.
        timing: the engine's part (``None`` when ``log_step`` adds values to a step the
            optimizer already ended and published).
        samples: the batch size the script reported for the step, if it did.
        samples_per_s: ``samples`` over the step's time.
        scalars: the script's own values (``loss=...``).
    """

    rank: int
    step: int
    timing: StepTiming | None
    samples: int | None = None
    samples_per_s: float | None = None
    scalars: Mapping[str, float] = field(default_factory=dict)
