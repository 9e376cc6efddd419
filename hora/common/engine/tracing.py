"""What the engine writes into the timeline: each call's negotiation and queueing, and each
batch's copy in, collective and copy out, on the rows of its tensors.

The timeline writer itself (files, rows, flushing) is :mod:`hora.common.vocabulary.timeline_writer`; this module
knows entries and responses, and the span names of docs/timeline-format.md.

The same phases are NVTX ranges when ``HORA_ENABLE_NVTX=1`` (:class:`Ranges`): the timeline is
written after a phase ends, with its start and end times, while an NVTX range must be opened
and closed as the phase runs, so the engine marks each phase's start and end through the tracer
too. The ranges bear the timeline's span names, prefixed with ``hora``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hora.common.engine.handles import Entry
from hora.common.vocabulary.message import ReduceOp, RequestType, Response, key_label
from hora.common.vocabulary.timeline_writer import ENGINE_ROW, Timeline

logger = logging.getLogger("hora")

RANGE_PREFIX = "hora "


@dataclass(frozen=True)
class Ranges:
    """The NVTX functions the tracer calls (``torch.cuda.nvtx``'s, or a test's).

    ``push``/``pop`` nest ranges on the calling thread; ``start``/``end`` make a range that may
    end on another thread (an allreduce is started by the engine and finished by the finisher).
    """

    push: Callable[[str], object]
    pop: Callable[[], object]
    start: Callable[[str], int]
    end: Callable[[int], object]


def nvtx_ranges() -> Ranges | None:
    """``torch.cuda.nvtx``'s functions, or ``None`` when this PyTorch has no NVTX (a build
    without CUDA raises on every call): the ranges then cost nothing."""
    try:
        import torch.cuda.nvtx as nvtx

        nvtx.range_push(RANGE_PREFIX + "NVTX_CHECK")
        nvtx.range_pop()
    except (ImportError, RuntimeError, AttributeError) as exc:
        logger.info("HORA_ENABLE_NVTX=1, but this PyTorch has no NVTX (%s): no ranges", exc)
        return None
    return Ranges(nvtx.range_push, nvtx.range_pop, nvtx.range_start, nvtx.range_end)


def op_label(response: Response) -> str:
    """The operation's name in the timeline: the request kind, or ADASUM (as Horovod names it)."""
    if response.kind == RequestType.ALLREDUCE and response.template().reduce_op == ReduceOp.ADASUM:
        return "ADASUM"
    return response.kind.name


class Tracer:
    """The engine's view of the timeline; does nothing while none is being written.

    Attributes:
        timeline: the timeline being written, if any (set and cleared at run time).
        agreed_at: when the last negotiation cycle agreed on its responses (timeline time).
        batch_number: the number of the last batch started on this rank; every rank numbers
            batches alike, so a number names one collective across ranks.
        ranges: the NVTX functions, when ranges are on (``HORA_ENABLE_NVTX=1`` with CUDA).
    """

    def __init__(self, ranges: Ranges | None = None) -> None:
        self.timeline: Timeline | None = None
        self.agreed_at = 0
        self.batch_number = 0
        self.ranges = ranges

    def open(self, phase: str) -> None:
        """A phase starts on this thread (an NVTX range, closed by :meth:`close`)."""
        if self.ranges is not None:
            self.ranges.push(RANGE_PREFIX + phase)

    def close(self) -> None:
        """The phase this thread opened last ends."""
        if self.ranges is not None:
            self.ranges.pop()

    def begin(self, phase: str) -> int:
        """A phase starts that may end on another thread; returns what :meth:`finish` takes."""
        return self.ranges.start(RANGE_PREFIX + phase) if self.ranges is not None else 0

    def finish(self, begun: int) -> None:
        """The phase :meth:`begin` returned ``begun`` for ends."""
        if self.ranges is not None:
            self.ranges.end(begun)

    def next_batch(self) -> int:
        self.batch_number += 1
        return self.batch_number

    def now(self) -> int:
        return self.timeline.now() if self.timeline is not None else 0

    def mark(self, name: str) -> None:
        """An instant on the engine's row (a cycle, entering or leaving the steady state)."""
        if self.timeline is not None:
            self.timeline.instant(ENGINE_ROW, name)

    def negotiated(self, batch: list[Response], entries: Sequence[Entry | None]) -> int:
        """NEGOTIATE_<OP> and QUEUE for this rank's tensors of a batch that starts now.

        Returns:
            the batch's start.
        """
        timeline = self.timeline
        assert timeline is not None
        start = timeline.now()
        kind = op_label(batch[0])
        args = f'{{"op":"{kind}"}}'
        negotiate = f"NEGOTIATE_{kind}"
        for entry in entries:
            if entry is None or not entry.submitted:
                continue
            row = timeline.row(key_label(entry.request.key))
            agreed = max(self.agreed_at, entry.submitted)
            timeline.complete(row, negotiate, entry.submitted, agreed, args)
            timeline.complete(row, "QUEUE", agreed, start)
        return start

    def waited_for_batch(self, entries: Sequence[Entry], started: int) -> None:
        """WAIT_FOR_BATCH: from each steady-state entry's submission to its batch's start."""
        timeline = self.timeline
        if timeline is None:
            return
        args = '{"op":"ALLREDUCE"}'
        for entry in entries:
            if entry.submitted:
                row = timeline.row(key_label(entry.request.key))
                timeline.complete(row, "WAIT_FOR_BATCH", entry.submitted, started, args)

    def collective(
        self,
        entries: Sequence[Entry | None],
        label: str,
        number: int,
        times: tuple[int, int, int, int],
        nbytes: int,
        path: str = "",
    ) -> None:
        """A batch's copy in, collective and copy out, on each of its tensors' rows.

        Args:
            times: batch start, collective start, collective end, results delivered.
            path: the data path it took (the communicator's, ``exchange`` for a small
                allreduce carried in negotiation's exchange).
        """
        timeline = self.timeline
        if timeline is None:
            return
        start, issued, done, end = times
        batch = f'{{"batch":{number}}}'
        where = f',"path":"{path}"' if path else ""
        detail = f'{{"batch":{number},"tensors":{len(entries)},"bytes":{nbytes}{where}}}'
        for entry in entries:
            if entry is None:
                continue
            row = timeline.row(key_label(entry.request.key))
            if issued > start:
                timeline.complete(row, "MEMCPY_IN_FUSION_BUFFER", start, issued, batch)
            timeline.complete(row, label, issued, done, detail)
            if end > done:
                timeline.complete(row, "MEMCPY_OUT_FUSION_BUFFER", done, end, batch)
