"""The steady state's replay: a repeating step's allreduces run batch after batch, without
negotiation, from buffers it owns.

:mod:`.schedule` holds the pure parts (period detection, the schedule, the ranks' codes); this
module runs them. It enters when the agreed history repeats, stages tensors into its batch
buffers as they are submitted (``admit``, on the submitting thread; :mod:`.staging`), starts
each batch's allreduce as soon as this rank's tensors are there (``cycle``, on the engine thread;
:mod:`.collect` decides when), delivers results (lending views of its buffers where the caller
allows it), and leaves for negotiation when any rank deviates. It does not know negotiation,
process sets or how communicators are made. See docs/engine.md for the protocol.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from hora.common.engine.autotune import Autotuner
from hora.common.engine.buffers import read_landed
from hora.common.engine.context import EngineContext
from hora.common.engine.handles import Entry
from hora.common.engine.negotiation import MessageTable
from hora.common.engine.steady.collect import Collector
from hora.common.engine.steady.schedule import (
    DEVIATED,
    FOLLOWING,
    STABLE_PERIODS,
    History,
    Schedule,
    build_schedule,
    cuts_from,
)
from hora.common.engine.steady.staging import allocate, claim, deliver, fill, stage
from hora.common.engine.steady.waits import Waits
from hora.common.engine.timing import STEADY_LONE_TENSOR_MAX_BYTES
from hora.common.transport import Pending, TransportError
from hora.common.vocabulary.message import ReduceOp, Request, Response

logger = logging.getLogger("hora")


@dataclass(eq=False)
class _Flight:
    """A steady-state batch whose allreduce was started (see ``Replay._start_batch``)."""

    schedule: Schedule
    position: int
    entries: list[Entry | None]
    code: int
    deviation: str | None
    number: int = 0
    started: int = 0
    issued: int = 0
    pending: Pending | None = None
    # The number of this steady-state collective, the same on every rank (see _started_batches).
    steady_id: int = 0
    # When its allreduce was issued (the counters' clock).
    issued_s: float = 0.0
    # Its NVTX range (Tracer.begin), ended when it lands.
    on_the_wire: int = 0


class Replay:
    """The steady state of one engine.

    Args:
        context: the engine's shared parts: its intake (whose lock guards the schedule's
            shared state), the global set's communicators (a batch runs on the one for its
            tensors' device, in buffers on its device; autotune agrees on its scores on the
            control communicator), the store (stall records), the tracer and the counters
            (each landed batch counts there).

    Attributes:
        schedule: the schedule being replayed, or ``None`` while negotiating.
        stats: times the steady state was entered and left, and batches it ran (tests and
            tools read it). "blocked": leaves where no rank deviated, only a user waited on a
            result whose batch could not fill (the next schedule is cut there). "buffers":
            batch buffers allocated besides the schedules' first ones (see ``staging.claim``).
    """

    def __init__(self, context: EngineContext) -> None:
        settings, rank, size = context.settings, context.rank, context.size
        intake = context.intake
        self._intake = intake
        self._settings = settings
        self.rank = rank
        self.size = size
        self._comm_for = context.communicators.of_global_set
        self._control = context.communicators.control
        self._tracer = context.tracer
        self._counters = context.counters
        self._waits = Waits(settings, rank, context.store, context.keys)
        self._collector = Collector(context, self._waits)
        # The side stream, per device, that landed batches' codes are read on (read_landed).
        self._reading_streams: dict[torch.device, torch.cuda.Stream] = {}
        self.history = History()
        self.schedule: Schedule | None = None
        # The batch whose allreduce runs while the next one fills.
        self.flight: _Flight | None = None
        self.cuts: set[str] = set()
        self.stats = {"entered": 0, "left": 0, "blocked": 0, "batches": 0, "buffers": 0}
        self.autotuner = (
            Autotuner(
                settings.fusion_threshold_bytes,
                settings.autotune_warmup_samples,
                settings.autotune_steps_per_sample,
                settings.autotune_log,
                rank,
            )
            if settings.autotune and settings.steady_state and size > 1
            else None
        )
        self._period_started = 0.0
        # Steady-state data allreduces issued so far: every rank issues the same ones, so the
        # count names a batch across ranks (for stall reports).
        self._started_batches = 0
        # Periods the current schedule completed, and leaves since the last schedule that ran
        # long enough to count as stable (both the same on every rank: they follow from the
        # batches every rank lands).
        self._periods = 0
        self._unstable_leaves = 0
        intake.when_polled(self.note_polled)

    @property
    def active(self) -> bool:
        return self.schedule is not None

    def record(self, responses: list[Response]) -> None:
        """Note the negotiated responses this rank runs (the history a period is found in)."""
        for response in responses:
            self.history.record(response)

    def admit(self, entries: list[Entry]) -> bool:
        """Stage new entries; return whether the engine thread must wake (under the intake's
        lock, on the submitting thread).

        An expected tensor is copied into its batch's buffer now, on the submitting thread: as
        DDP fills its buckets from autograd hooks, this overlaps the copy with the rest of
        backward instead of adding it to the critical path after the last gradient. The engine
        wakes for an unexpected entry (a deviation) or the one that completes its batch.
        """
        schedule = self.schedule
        if schedule is None:
            return True
        wake = False
        awaiting = self._collector.awaiting
        staged: list[tuple[int, str, torch.Tensor]] = []
        for entry in entries:
            request = entry.request
            if not schedule.expects(request):
                wake = True
                continue
            tensor = entry.tensor
            number = schedule.index[request.name][0]
            if tensor is not None and number not in schedule.in_flight:
                if number in schedule.lent:
                    self._claim(schedule, number)
                staged.append((number, request.name, tensor))
                entry.staged = schedule
            if request.key in awaiting:
                awaiting.discard(request.key)
                wake = wake or not awaiting
        stage(schedule, staged)
        return wake

    def note_polled(self) -> bool:
        """A user polled a result that is not in yet: land a batch held back (see
        ``Collector.collect``) now rather than when the next one starts. Under the intake's
        lock; returns whether the engine thread must wake."""
        if self.flight is None:
            return False
        self._collector.note_polled()
        return True

    def maybe_enter(self, table: MessageTable) -> None:
        """After a negotiated cycle: start replaying if the agreed allreduces repeat (the same
        decision on every rank, from the same agreed history)."""
        if not self._settings.steady_state or self.size == 1 or table.pending:
            return
        if table.joined or self._intake.shutdown_reason is not None:
            return
        period = self.history.period()
        if period is None:
            return
        if (
            len(period) == 1
            and len(period[0].names) == 1
            and period[0].num_bytes > STEADY_LONE_TENSOR_MAX_BYTES
        ):
            self.history.clear()
            return
        schedule = self._build_schedule(period)
        self._period_started = 0.0
        self._periods = 0
        self.history.clear()
        self.stats["entered"] += 1
        self._tracer.mark("STEADY_STATE_ENTER")
        logger.debug(
            "rank %d: steady state, %d allreduces in %d batches per period",
            self.rank,
            len(period),
            len(schedule.batches),
        )

    def _build_schedule(self, period: list[Response]) -> Schedule:
        """Cut ``period`` into batches (autotune's current sizes), allocate, and install it."""
        sizes: dict[str, int] = {}
        if self.autotuner is not None:
            current = self.autotuner.current
            sizes = {
                "first_bucket_bytes": current.first_bucket_bytes,
                "bucket_bytes": current.bucket_bytes,
            }
        schedule = build_schedule(period, self._settings.fusion_threshold_bytes, self.cuts, **sizes)
        allocate(schedule, self._comm_for, self.size)

        def install() -> None:
            self.schedule = schedule

        self._intake.enter_steady(install)
        return schedule

    def _claim(self, schedule: Schedule, number: int) -> None:
        """See ``staging.claim`` (with the intake's lock held)."""
        if claim(schedule, number, self.size):
            self.stats["buffers"] += 1

    def _period_finished(self, schedule: Schedule) -> None:
        """The schedule wrapped around: one step is done. Feed autotune."""
        self._periods += 1
        now = time.monotonic()
        started, self._period_started = self._period_started, now
        tuner = self.autotuner
        if tuner is None or tuner.done or not started:
            return
        local = tuner.step_finished(now - started)
        if local is None:
            return
        # Every rank is at this same point of the same schedule: agree on the score.
        slowest = torch.tensor([local], dtype=torch.float64)
        self._control.allreduce(slowest, ReduceOp.MAX)
        before = tuner.current
        after = tuner.scored(local, float(slowest[0]))
        if after != before:
            self._build_schedule(schedule.period)
        self._period_started = 0.0

    def cycle(self) -> None:
        """Start the schedule's next batch, land the one in flight, or leave on a deviation.

        Two batches may be in flight, as DDP queues its buckets: batch k starts as soon as its
        tensors are there, before batch k-1's result (and its codes) came back. Every rank
        starts the same batches in the same order; waiting for them is local. A batch is
        *landed* (its codes read, its results delivered) before the one after next starts.
        """
        flight = self.flight
        try:
            self._step(flight)
        except BaseException:
            # Batches started in earlier cycles hold entries too: give them back to fail.
            entries = list(flight.entries) if flight is not None else []
            if self.flight is not None and self.flight is not flight:
                entries += self.flight.entries
            self._intake.hand_back(entries)
            raise

    def _step(self, flight: _Flight | None) -> None:
        schedule = self.schedule
        assert schedule is not None
        # A rank that deviated starts nothing more: it lands that batch and leaves (the
        # deviating entry is among those it holds).
        if flight is not None and (flight.code != FOLLOWING or not self._may_overlap(schedule)):
            self.flight = None
            self._land(flight, None)
            return
        collected = self._collector.collect(
            schedule, flight.entries if flight is not None else None, self._started_batches + 1
        )
        if collected is None:
            # The batch in flight came back before the next one filled: deliver it first.
            assert flight is not None
            self.flight = None
            self._land(flight, None)
            return
        following = self._start_batch(schedule, *collected)
        self.flight = following
        if flight is not None:
            self._land(flight, following)

    def _may_overlap(self, schedule: Schedule) -> bool:
        """Whether the next batch may start before the one in flight has landed.

        Only within a period, and the same answer on every rank (it depends on agreed state
        only). A period's last batch lands before the next period's first starts: a training
        loop waits for a step's results before it submits the next step's gradients, so
        nothing is lost. One batch per period would also reuse the buffer in flight, and
        autotune scores and rebuilds the schedule between periods, with nothing in flight.
        """
        return len(schedule.batches) > 1 and schedule.position != 0

    def _start_batch(self, schedule: Schedule, code: int, deviation: str | None) -> _Flight:
        """Fill the current batch's buffer (or zeros and this rank's code) and start it."""
        timeline = self._tracer.timeline
        started = timeline.now() if timeline is not None else 0
        number = self._tracer.next_batch()
        position = schedule.position
        batch = schedule.current
        entries = [] if code != FOLLOWING else self._intake.take([r.key for r in batch])
        if position in schedule.lent:
            self._intake.between_submissions(lambda: self._claim(schedule, position))
        buffer = fill(schedule, position, entries, code, self.rank)
        flight = _Flight(schedule, position, entries, code, deviation)
        flight.number, flight.started = number, started
        self._started_batches += 1
        flight.steady_id = self._started_batches
        # From here the buffer is the transport's: tensors submitted meanwhile for this batch
        # (the next period's) are copied when it starts again.
        self._intake.between_submissions(schedule.started)
        flight.issued = timeline.now() if timeline is not None else 0
        flight.issued_s = self._counters.now()
        flight.on_the_wire = self._tracer.begin("ALLREDUCE")
        try:
            flight.pending = schedule.comms[position].allreduce_async(
                buffer, ReduceOp.SUM, self._waits.batch_timeout_s
            )
        except TransportError:
            self._intake.hand_back(entries)
            raise
        return flight

    def _land(self, flight: _Flight, following: _Flight | None) -> None:
        """Wait for ``flight``; deliver its results or, if some rank deviated, leave."""
        schedule = flight.schedule
        batch = schedule.batches[flight.position]
        assert flight.pending is not None
        try:
            self._waits.wait_for_peers(flight.pending, flight.steady_id, batch)
            flight.pending.wait()
        except TransportError as exc:
            self._intake.hand_back(flight.entries + (following.entries if following else []))
            raise self._waits.error(batch, exc) from exc
        done_s = self._counters.now()
        self._tracer.finish(flight.on_the_wire)
        timeline = self._tracer.timeline
        done = timeline.now() if timeline is not None else 0
        codes = read_landed(schedule.batch_buffers[flight.position].codes, self._reading_streams)
        if any(codes):
            self._intake.between_submissions(lambda: schedule.landed(flight.position))
            self._abort_following(schedule, following)
            entries = flight.entries + (following.entries if following else [])
            deviation = flight.deviation or (following.deviation if following else None)
            self._leave(deviation, entries, batch, codes)
            return
        self.stats["batches"] += 1
        # The average's division happened before the sum (see Schedule.factors).
        postscale = batch[0].postscale
        # Completed here rather than on the finisher: a hand-off between threads costs more
        # than the copy, and the next batch (if ready) is already running.
        data = schedule.batch_buffers[flight.position].data
        finished = [e for e in flight.entries if e is not None]
        self._counters.collective(
            flight.issued_s, done_s, data.numel() * data.itemsize, len(finished)
        )
        self._tracer.open("MEMCPY_OUT_FUSION_BUFFER")
        lent = deliver(finished, data, schedule.pieces, postscale)
        self._tracer.close()
        # Only now may the next period's tensors be staged into this buffer.
        self._intake.between_submissions(lambda: schedule.landed(flight.position, lent))
        if timeline is not None:
            self._tracer.waited_for_batch(finished, flight.started)
            times = (flight.started, flight.issued, done, timeline.now())
            nbytes = data.numel() * data.itemsize
            path = schedule.comms[flight.position].path
            self._tracer.collective(finished, "ALLREDUCE", flight.number, times, nbytes, path)
        if flight.position == len(schedule.batches) - 1:
            self._period_finished(schedule)

    def _abort_following(self, schedule: Schedule, following: _Flight | None) -> None:
        """A landed batch deviated: finish the batch after it, so every rank ran the same ones.

        Where overlap was allowed, some ranks may have started the next batch before they saw
        the deviation; the others start it now, empty. Its result is discarded everywhere.
        """
        if following is not None:
            assert following.pending is not None
            try:
                following.pending.wait()
            except TransportError:
                self._intake.hand_back(following.entries)
                raise
            self._intake.between_submissions(lambda: schedule.landed(following.position))
        elif self._may_overlap(schedule):
            self._started_batches += 1
            empty = torch.zeros_like(schedule.batch_buffers[schedule.position].buffer)
            comm = schedule.comms[schedule.position]
            comm.allreduce_async(empty, ReduceOp.SUM, self._waits.batch_timeout_s).wait()

    def _leave(
        self,
        deviation: str | None,
        entries: list[Entry | None],
        batch: list[Request],
        codes: list[int],
    ) -> None:
        """Some rank deviated (every rank sees the same codes): put entries back, negotiate.

        A rank that was blocked names where its batch must be cut next time; every rank learns
        the same cut, so the next schedule does not make a user wait on its own later tensors.
        """
        self.cuts |= cuts_from(batch, codes)
        requeued = [e for e in entries if e is not None] + self._collector.release()

        def uninstall() -> None:
            self.schedule = None
            self.flight = None

        self._intake.leave_steady(requeued, uninstall)
        self.history.clear()
        self.stats["left"] += 1
        if DEVIATED not in codes:
            self.stats["blocked"] += 1
        self._tracer.mark("STEADY_STATE_LEAVE")
        # One more period before the schedule comes back for every leave since the last stable
        # schedule (at most 10), so that a pattern that keeps changing is not replayed in vain.
        # A schedule that ran STABLE_PERIODS periods ended a phase of the job (another model,
        # an evaluation loop): the next phase's pattern is taken up as quickly as the job's first.
        if self._periods >= STABLE_PERIODS:
            self._unstable_leaves = 0
        else:
            self._unstable_leaves += 1
        self.history.repeats = min(2 + self._unstable_leaves, 10)
        logger.debug(
            "rank %d: leaving the steady state (ranks' codes %s; here: %s)",
            self.rank,
            codes,
            deviation or "following",
        )
