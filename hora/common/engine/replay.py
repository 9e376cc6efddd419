"""The steady state's replay: a repeating step's allreduces run batch after batch, without
negotiation, from buffers this object owns.

:mod:`hora.common.engine.steady` holds the pure parts (period detection, the schedule, the ranks'
codes); this module runs them. It enters when the agreed history repeats, stages tensors into
its batch buffers as they are submitted (``admit``, on the submitting thread), starts each
batch's allreduce as soon as this rank's tensors are there (``cycle``, on the engine thread),
delivers results (lending views of its buffers where the caller allows it), and leaves for
negotiation when any rank deviates. See docs/engine.md for the protocol.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from hora.common.config import Settings
from hora.common.engine import steady
from hora.common.engine.autotune import Autotuner
from hora.common.engine.buffers import (
    destination,
    on_default_stream,
    read_landed,
    referenced_beyond,
    scale,
    storage_references,
    torch_dtype,
)
from hora.common.engine.counters import Counters
from hora.common.engine.handles import Entry, finish
from hora.common.engine.intake import Intake
from hora.common.engine.negotiation import MessageTable
from hora.common.engine.timing import (
    PARKED_WAIT_S,
    STALL_PROBE_S,
    STEADY_BLOCKED_GRACE_S,
    STEADY_LONE_TENSOR_MAX_BYTES,
    WATCH_INTERVAL_S,
)
from hora.common.engine.tracing import Tracer
from hora.common.job.store import StoreClient
from hora.common.job.store_keys import GenerationKeys
from hora.common.message import Key, ReduceOp, Request, Response
from hora.common.transport import Communicator, Pending, TransportError

logger = logging.getLogger("hora")


@dataclass(eq=False)
class _Flight:
    """A steady-state batch whose allreduce was started (see ``Engine._steady_cycle``)."""

    schedule: steady.Schedule
    position: int
    entries: list[Entry | None]
    code: int
    deviation: str | None
    number: int = 0
    started: int = 0
    issued: int = 0
    pending: Pending | None = None
    # The number of this steady-state collective, the same on every rank (see _steady_started).
    steady_id: int = 0
    # When its allreduce was issued (the counters' clock).
    issued_s: float = 0.0
    # Its NVTX range (Tracer.begin), ended when it lands.
    on_the_wire: int = 0


class Replay:
    """The steady state of one engine.

    Args:
        intake: the engine's intake (its lock guards the schedule's shared state).
        settings: engine settings.
        rank, size: this rank and the job's size.
        comm_for: the global set's communicator for a device type (``"cpu"``, ``"cuda"``): a
            batch runs on the one for its tensors' device, in buffers on its device.
        control: the control communicator (autotune agrees on its scores there).
        store: the job's store (stall records), and ``keys`` its generation's keys.
        tracer: the engine's timeline.
        failure_seen: whether the watcher saw the job fail.
        counters: the engine's counters (each landed batch counts there).

    Attributes:
        schedule: the schedule being replayed, or ``None`` while negotiating.
        stats: times the steady state was entered and left, and batches it ran (tests and
            tools read it). "blocked": leaves where no rank deviated, only a user waited on a
            result whose batch could not fill (the next schedule is cut there). "buffers":
            batch buffers allocated besides the schedules' first ones (see ``_claim``).
    """

    def __init__(
        self,
        intake: Intake,
        settings: Settings,
        rank: int,
        size: int,
        comm_for: Callable[[str], Communicator],
        control: Communicator,
        store: StoreClient,
        keys: GenerationKeys,
        tracer: Tracer,
        failure_seen: Callable[[], bool],
        counters: Counters,
    ) -> None:
        self._intake = intake
        self._settings = settings
        self.rank = rank
        self.size = size
        self._comm_for = comm_for
        self._control = control
        self._store = store
        self._keys = keys
        self._tracer = tracer
        self._failure_seen = failure_seen
        self._counters = counters
        # A rank starts a batch as soon as its own tensors are there and waits inside the
        # allreduce for ranks still busy elsewhere (evaluating, writing a checkpoint). As a wait
        # in negotiation, that is no failure, however long: the batches get their own timeout,
        # HORA_STALL_SHUTDOWN_TIME_SECONDS (the job then ends as a stalled one would), or days
        # where that is 0. Dead peers are still noticed at once (a closed connection, the
        # launcher's record of the exit).
        self._steady_shutdown_s = steady_shutdown_s(settings)
        # How long a steady-state wait lasts before it counts as a stall (0: never).
        self._stall_after_s = settings.stall_check_time_s if settings.stall_check_enabled else 0.0
        self._steady_timeout_s = steady_batch_timeout_s(settings)
        self.history = steady.History()
        self.schedule: steady.Schedule | None = None
        # The batch whose allreduce runs while the next one fills.
        self.flight: _Flight | None = None
        # A user polled a result while a batch was held back (see _collect_batch).
        self.polled = False
        self.held: dict[Key, Entry] = {}
        self.awaiting: set[Key] = set()
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
        intake.on_poll = self.note_polled

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
            if request.key in self.awaiting:
                self.awaiting.discard(request.key)
                wake = wake or not self.awaiting
        _stage(schedule, staged)
        return wake

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

    def _build_schedule(self, period: list[Response]) -> steady.Schedule:
        """Cut ``period`` into batches (autotune's current sizes), allocate, and install it."""
        sizes: dict[str, int] = {}
        if self.autotuner is not None:
            current = self.autotuner.current
            sizes = {
                "first_bucket_bytes": current.first_bucket_bytes,
                "bucket_bytes": current.bucket_bytes,
            }
        schedule = steady.build_schedule(
            period, self._settings.fusion_threshold_bytes, self.cuts, **sizes
        )
        # One buffer per batch, reused every period (no allocation, no page faults per step);
        # after the data, one slot per rank for its code (see hora.common.engine.steady).
        for batch, counts in zip(schedule.batches, schedule.sizes):
            comm = self._comm_for(batch[0].device)
            batch_buffer = _batch_buffer(batch, counts, self.size, comm.device)
            schedule.comms.append(comm)
            schedule.batch_buffers.append(batch_buffer)
            schedule.pieces.update(batch_buffer.pieces)
            factor = batch[0].prescale
            if batch[0].reduce_op == ReduceOp.AVERAGE:
                factor /= self.size
            schedule.factors.append(factor)
            schedule.scale_each.append(
                factor != 1.0 and sum(counts) >= _SCALE_EACH_FROM * len(counts)
            )
        with self._intake.wakeup:
            self.schedule = schedule
            self._intake.steady = True
        return schedule

    def _claim(self, schedule: steady.Schedule, number: int) -> None:
        """Before batch ``number``'s buffer is written again after its results were lent: if a
        lent view is still in use (a gradient that was not reset, or a reference the caller
        kept), turn to the batch's spare buffer, or a new one, so that nothing lent ever changes
        under its holder. Called with the engine's lock held.

        A training loop that resets its gradients to ``None`` (``zero_grad()``'s default) before
        the next backward frees every lent view, so one buffer serves every step; gradients kept
        across steps stay views of the buffer they adopted first (DistributedOptimizer then
        copies into them), and the batch stages into a second one.
        """
        schedule.lent.discard(number)
        current = schedule.batch_buffers[number]
        if not _in_use(current):
            return
        spare = schedule.spares.get(number)
        if spare is None or _in_use(spare):
            spare = _batch_buffer(
                schedule.batches[number],
                schedule.sizes[number],
                self.size,
                schedule.comms[number].device,
            )
            self.stats["buffers"] += 1
        schedule.batch_buffers[number] = spare
        schedule.pieces.update(spare.pieces)
        # The buffer still in use is kept as the spare: it is free again once its holder lets go.
        schedule.spares[number] = current

    def _period_finished(self, schedule: steady.Schedule) -> None:
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
        if flight is not None and (
            flight.code != steady.FOLLOWING or not self._may_overlap(schedule)
        ):
            self.flight = None
            self._land(flight, None)
            return
        collected = self._collect_batch(schedule, flight)
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

    def _may_overlap(self, schedule: steady.Schedule) -> bool:
        """Whether the next batch may start before the one in flight has landed.

        Only within a period, and the same answer on every rank (it depends on agreed state
        only). A period's last batch lands before the next period's first starts: a training
        loop waits for a step's results before it submits the next step's gradients, so
        nothing is lost. One batch per period would also reuse the buffer in flight, and
        autotune scores and rebuilds the schedule between periods, with nothing in flight.
        """
        return len(schedule.batches) > 1 and schedule.position != 0

    def _start_batch(self, schedule: steady.Schedule, code: int, deviation: str | None) -> _Flight:
        """Fill the current batch's buffer (or zeros and this rank's code) and start it."""
        timeline = self._tracer.timeline
        started = timeline.now() if timeline is not None else 0
        number = self._tracer.next_batch()
        position = schedule.position
        batch = schedule.current
        entries = [] if code != steady.FOLLOWING else self._intake.take([r.key for r in batch])
        if position in schedule.lent:
            with self._intake.wakeup:
                self._claim(schedule, position)
        batch_buffer = schedule.batch_buffers[position]
        buffer, data, codes = batch_buffer.buffer, batch_buffer.data, batch_buffer.codes
        if code == steady.FOLLOWING:
            # Tensors are staged as they are submitted (see admit), except those submitted
            # while this buffer was still on the wire.
            _stage(
                schedule,
                [
                    (position, entry.request.name, entry.tensor)
                    for entry in entries
                    if entry is not None
                    and entry.tensor is not None
                    and entry.staged is not schedule
                ],
            )
            if not schedule.scale_each[position]:
                scaled = scale(data, schedule.factors[position])
                if scaled is not data:
                    data.copy_(scaled)
        else:
            data.zero_()
        codes.zero_()
        if code != steady.FOLLOWING:
            codes[self.rank] = code
        flight = _Flight(schedule, position, entries, code, deviation)
        flight.number, flight.started = number, started
        self._started_batches += 1
        flight.steady_id = self._started_batches
        with self._intake.wakeup:
            # From here the buffer is the transport's: tensors submitted meanwhile for this
            # batch (the next period's) are copied when it starts again.
            schedule.in_flight.add(position)
            schedule.advance()
        flight.issued = timeline.now() if timeline is not None else 0
        flight.issued_s = self._counters.now()
        flight.on_the_wire = self._tracer.begin("ALLREDUCE")
        try:
            flight.pending = schedule.comms[position].allreduce_async(
                buffer, ReduceOp.SUM, self._steady_timeout_s
            )
        except TransportError:
            self._intake.hand_back(entries)
            raise
        return flight

    def note_polled(self) -> None:
        """A user polled a result that is not in yet: land a batch held back (see
        ``_collect_batch``) now rather than when the next one starts. Under the intake's lock."""
        if self.flight is not None:
            self.polled = True
            self._intake.wakeup.notify_all()

    def _land(self, flight: _Flight, following: _Flight | None) -> None:
        """Wait for ``flight``; deliver its results or, if some rank deviated, leave."""
        schedule = flight.schedule
        assert flight.pending is not None
        try:
            self._wait_for_peers(flight)
            flight.pending.wait()
        except TransportError as exc:
            self._intake.hand_back(flight.entries + (following.entries if following else []))
            raise self._steady_error(flight, exc) from exc
        done_s = self._counters.now()
        self._tracer.finish(flight.on_the_wire)
        timeline = self._tracer.timeline
        done = timeline.now() if timeline is not None else 0
        codes = read_landed(schedule.batch_buffers[flight.position].codes)
        if any(codes):
            with self._intake.wakeup:
                schedule.in_flight.discard(flight.position)
            self._abort_following(schedule, following)
            entries = flight.entries + (following.entries if following else [])
            deviation = flight.deviation or (following.deviation if following else None)
            batch = schedule.batches[flight.position]
            self._leave(deviation, entries, batch, codes)
            return
        self.stats["batches"] += 1
        # The average's division happened before the sum (see Schedule.factors).
        postscale = schedule.batches[flight.position][0].postscale
        # Completed here rather than on the finisher: a hand-off between threads costs more
        # than the copy, and the next batch (if ready) is already running.
        data = schedule.batch_buffers[flight.position].data
        finished = [e for e in flight.entries if e is not None]
        self._counters.collective(
            flight.issued_s, done_s, data.numel() * data.itemsize, len(finished)
        )
        self._tracer.open("MEMCPY_OUT_FUSION_BUFFER")
        lent = _deliver(finished, data, schedule.pieces, postscale)
        self._tracer.close()
        with self._intake.wakeup:
            if lent:
                schedule.lent.add(flight.position)
            # Only now may the next period's tensors be staged into this buffer.
            schedule.in_flight.discard(flight.position)
        if timeline is not None:
            self._tracer.waited_for_batch(finished, flight.started)
            times = (flight.started, flight.issued, done, timeline.now())
            nbytes = data.numel() * data.itemsize
            self._tracer.collective(finished, "ALLREDUCE", flight.number, times, nbytes)
        if flight.position == len(schedule.batches) - 1:
            self._period_finished(schedule)

    def _wait_for_peers(self, flight: _Flight) -> None:
        """Wait for ``flight``; past the stall check time, record that this rank waits for it.

        Only a rank that waits inside the batch's allreduce knows that another rank is late;
        the late rank reads the record before it warns (see ``_wait_for_batch``), so that a
        pause on every rank at once, such as an evaluation, is no stall.
        """
        stall_after = self._stall_after_s
        if not stall_after:
            return
        assert flight.pending is not None
        if flight.pending.wait(stall_after):
            return
        names = _names([r.name for r in flight.schedule.batches[flight.position]])
        try:
            self._store.mark(self._keys.steady_wait(flight.steady_id))
        except Exception as exc:  # noqa: BLE001 - a lost store fails the batch on its own
            logger.debug("rank %d could not record its wait: %s", self.rank, exc)
        if self.rank == 0:
            logger.warning(
                "rank 0 has waited %.0f s for other ranks to submit %s (steady state); the ranks "
                "that keep it waiting log which tensors they have not submitted.",
                stall_after,
                names,
            )

    def _peers_wait(self) -> bool:
        """Whether another rank has recorded that it waits for the batch this rank collects."""
        try:
            return self._store.marked(self._keys.steady_wait(self._started_batches + 1))
        except Exception:  # noqa: BLE001 - a lost store fails the job elsewhere
            return False

    def _steady_error(self, flight: _Flight, exc: TransportError) -> TransportError:
        """Name the batch and the limit when a steady-state batch waited past its timeout."""
        if self._steady_shutdown_s <= 0 or "timed out" not in str(exc).lower():
            return exc
        shown = _names([r.name for r in flight.schedule.batches[flight.position]])
        return TransportError(
            f"some ranks did not submit {shown} within HORA_STALL_SHUTDOWN_TIME_SECONDS "
            f"({self._steady_shutdown_s:g} s) while rank {self.rank} waited for them; the job "
            f"is shut down as stalled ({exc})"
        )

    def _abort_following(self, schedule: steady.Schedule, following: _Flight | None) -> None:
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
            with self._intake.wakeup:
                schedule.in_flight.discard(following.position)
        elif self._may_overlap(schedule):
            self._started_batches += 1
            empty = torch.zeros_like(schedule.batch_buffers[schedule.position].buffer)
            comm = schedule.comms[schedule.position]
            comm.allreduce_async(empty, ReduceOp.SUM, self._steady_timeout_s).wait()

    def _collect_batch(
        self, schedule: steady.Schedule, flight: _Flight | None
    ) -> tuple[int, str | None] | None:
        """Wait until this rank holds every entry of the current batch, or say why it can't.

        The batch in ``flight`` (the one before, still on the wire or done) is landed after the
        next one starts, not as soon as it is done: during backward nobody needs its results
        yet, and landing it then would take the interpreter and a core from backward, plus a
        callback on the transport's thread to learn that it is done. It is landed first only
        when a user waits for (or polls) a result.

        Returns:
            (this rank's code for the batch, what deviated when it is not FOLLOWING), or None
            when ``flight`` must land first.
        """
        needed = [r.key for r in schedule.current]
        stall_after = self._stall_after_s
        started = time.monotonic()
        warned = False
        probe = 0.0
        with self._intake.wakeup:
            self.awaiting = set(needed)
            while True:
                outcome = self._batch_outcome(schedule, needed)
                if outcome is not None:
                    return outcome
                if flight is not None and self._flight_wanted(flight):
                    return None
                now = time.monotonic()
                blocked = self._blocked_cut(schedule, needed, started, now)
                if isinstance(blocked, tuple):
                    return blocked
                if stall_after and not warned and now - started > stall_after and now >= probe:
                    # Some rank waits for this one (it recorded so), or every rank is busy
                    # elsewhere at once, which is no stall: ask the store now and then.
                    probe = now + STALL_PROBE_S
                    warned = self._warn_if_peers_wait(schedule, now - started)
                self._intake.wakeup.wait(timeout=min(WATCH_INTERVAL_S, blocked))

    def _batch_outcome(
        self, schedule: steady.Schedule, needed: list[Key]
    ) -> tuple[int, str | None] | None:
        """Take what was submitted since; the batch's code once this rank's part is decided
        (every entry in, or a deviation), else None. Called with the intake's lock held."""
        queue = self._intake.queue
        while queue:
            entry = queue.popleft()
            self.held[entry.request.key] = entry
            if not schedule.expects(entry.request):
                return steady.DEVIATED, f"{entry.request.name} is not next in the schedule"
        self.awaiting.difference_update(self.held)
        if self._intake.shutdown_reason is not None:
            return steady.DEVIATED, "shutdown"
        if self._failure_seen():
            return steady.DEVIATED, "a failure was reported"
        if self.awaiting:
            return None
        for key in needed:
            del self.held[key]
        return steady.FOLLOWING, None

    def _flight_wanted(self, flight: _Flight) -> bool:
        """Whether a user polled, or waits for, a result of the batch in ``flight``."""
        blocked = self._intake.blocked
        if self.polled or any(e is not None and e.handle in blocked for e in flight.entries):
            self.polled = False
            return True
        return False

    def _blocked_cut(
        self, schedule: steady.Schedule, needed: list[Key], started: float, now: float
    ) -> tuple[int, str] | float:
        """A user blocked on a result this rank has not run yet: the batch may never fill (its
        user submits the rest only after the result). Past a grace period, the code that cuts
        the batch before the first tensor still missing; before it, how long to wait at most.
        Results already running are not waited for here."""
        blocked = self._intake.blocked
        since = [blocked[e.handle] for e in self.held.values() if e.handle in blocked]
        if not since:
            return WATCH_INTERVAL_S
        waited = now - max(min(since), started)
        grace = max(STEADY_BLOCKED_GRACE_S, 10 * self._settings.cycle_time_ms / 1000)
        if waited < grace:
            return grace - waited
        first = min(i for i, k in enumerate(needed) if k in self.awaiting)
        return steady.blocked_code(
            first
        ), f"a result is awaited before {schedule.current[first].name}"

    def _warn_if_peers_wait(self, schedule: steady.Schedule, waited: float) -> bool:
        """Warn once other ranks wait for this one's part of the batch; whether it warned."""
        if not self._peers_wait():
            return False
        logger.warning(
            "rank %d has not submitted %s for %.0f s while other ranks wait for them "
            "(steady state).",
            self.rank,
            _names([r.name for r in schedule.current if r.key not in self.held]),
            waited,
        )
        return True

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
        self.cuts |= steady.cuts_from(batch, codes)
        with self._intake.wakeup:
            self._intake.requeue([e for e in entries if e is not None] + list(self.held.values()))
            self.held.clear()
            self.schedule = None
            self.flight = None
            self._intake.steady = False
        self.history.clear()
        self.stats["left"] += 1
        if steady.DEVIATED not in codes:
            self.stats["blocked"] += 1
        self._tracer.mark("STEADY_STATE_LEAVE")
        # One more period before the schedule comes back for every leave since the last stable
        # schedule (at most 10), so that a pattern that keeps changing is not replayed in vain.
        # A schedule that ran STABLE_PERIODS periods ended a phase of the job (another model,
        # an evaluation loop): the next phase's pattern is taken up as quickly as the job's first.
        if self._periods >= steady.STABLE_PERIODS:
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


def steady_shutdown_s(settings: Settings) -> float:
    """How long a steady-state batch may wait for its peers before the job ends as stalled
    (``HORA_STALL_SHUTDOWN_TIME_SECONDS``; 0: no such limit)."""
    shutdown_s = settings.stall_shutdown_time_s
    if not settings.stall_check_enabled or shutdown_s < settings.stall_check_time_s:
        return 0.0
    return shutdown_s


def steady_batch_timeout_s(settings: Settings) -> float:
    """The time limit a steady-state batch's allreduce is started with (the longest limit of
    any operation the engine starts)."""
    shutdown_s = steady_shutdown_s(settings)
    return shutdown_s if shutdown_s > 0 else PARKED_WAIT_S


def _deliver(
    entries: list[Entry], data: torch.Tensor, pieces: dict[str, torch.Tensor], factor: float
) -> bool:
    """Deliver a steady-state batch: scale by ``factor``, hand each entry its piece (a view of
    ``data`` shaped as its tensor), and finish the entries. Returns whether a piece was lent.

    An entry that allows it (``Entry.lend``) gets a view of its piece as its result, which
    saves a pass over the data; the buffer is then only written again once no tensor refers
    to it (see ``_claim``). Other entries get a copy: large tensors are scaled straight into
    their destinations (one pass over the data); many small ones are cheaper scaled in the
    buffer by one operation, then copied by another.
    """
    # One pass over the entries (a grouped call has hundreds): results, copies, and whether a
    # destination was made in inference mode (see writing_to_inference).
    results: list[torch.Tensor | None] = []
    targets: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    lent = False
    inference = False
    for entry in entries:
        dest = destination(entry)
        if dest is None:
            results.append(None)
            continue
        piece = pieces[entry.request.name]
        if dest.is_inference():
            inference = True
        elif entry.lend and dest.is_cpu and dest.dtype == piece.dtype:
            # A view of its own (outside inference mode), so that the buffer's references
            # count whoever keeps it.
            results.append(piece.detach())
            lent = True
            continue
        results.append(dest)
        targets.append(dest)
        sources.append(piece)
    each = (
        factor != 1.0
        and not lent
        and data.dtype not in (torch.float16, torch.bfloat16)
        and data.numel() >= _SCALE_EACH_FROM * max(len(entries), 1)
    )
    with torch.inference_mode() if inference else contextlib.nullcontext():
        _write_copies(targets, sources, data, factor, each)
    for entry, result in zip(entries, results):
        finish(entry, result)
    return lent


# The mean elements per tensor from which tensors are scaled one by one rather than in their
# buffer by one operation (measured: 29 tensors of 2.7k elements on average took half the time
# scaled in the buffer first; 6 of 310k took a fifth more).
_SCALE_EACH_FROM = 1 << 16


def _write_copies(
    targets: list[torch.Tensor],
    sources: list[torch.Tensor],
    data: torch.Tensor,
    factor: float,
    each: bool,
) -> None:
    """Write a delivered batch's pieces (``sources``, views of ``data``) into ``targets``,
    scaled by ``factor``: one by one (``each``), or the buffer at once and then the copies."""
    if each:
        for dest, piece in zip(targets, sources):
            if dest.device == piece.device and dest.dtype == piece.dtype:
                torch.mul(piece, factor, out=dest)
            else:
                dest.copy_(piece.mul(factor))
        return
    scaled = scale(data, factor)
    if scaled is not data:
        data.copy_(scaled)
    if targets:
        torch._foreach_copy_(targets, sources)


def _stage(schedule: steady.Schedule, staged: list[tuple[int, str, torch.Tensor]]) -> None:
    """Copy each ``(batch number, name, tensor)`` into its piece of the batch's buffer, scaled
    when the batch's tensors are scaled one by one (see ``Schedule.scale_each``). The plain
    copies are made together, by one operation: a grouped call stages hundreds."""
    targets: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    for number, name, tensor in staged:
        # detach(), not no_grad(): a gradient needs neither, and the mode switch costs more
        # than the copy of a small tensor.
        source = tensor.detach() if tensor.requires_grad else tensor
        piece = schedule.pieces[name]
        if not schedule.scale_each[number]:
            targets.append(piece)
            sources.append(source)
        else:
            with on_default_stream(piece):
                if source.device == piece.device:
                    torch.mul(source, schedule.factors[number], out=piece)
                else:
                    piece.copy_(source).mul_(schedule.factors[number])
    if targets:
        # CUDA buffers are filled on the default stream, which the submitting call made wait
        # for the caller's stream, and after which NCCL runs the batch.
        with on_default_stream(targets[0]):
            torch._foreach_copy_(targets, sources)


class _BatchBuffer(NamedTuple):
    """A steady-state batch's buffer and the engine's views of it."""

    buffer: torch.Tensor
    data: torch.Tensor
    codes: torch.Tensor
    pieces: dict[str, torch.Tensor]
    baseline: tuple[int, int]


def _batch_buffer(
    batch: list[Request], counts: list[int], ranks: int, device: torch.device
) -> _BatchBuffer:
    """Allocate a batch's buffer on ``device``: its tensors' data, then one slot per rank for
    its code."""
    total = sum(counts)
    buffer = torch.empty(total + ranks, dtype=torch_dtype(batch[0].dtype), device=device)
    pieces = {}
    offset = 0
    for request, count in zip(batch, counts):
        # Shaped as the tensor: staging copies it without a reshape.
        pieces[request.name] = buffer[offset : offset + count].view(request.shape)
        offset += count
    data, codes = buffer[:total], buffer[total:]
    return _BatchBuffer(buffer, data, codes, pieces, storage_references(buffer))


def _in_use(batch_buffer: _BatchBuffer) -> bool:
    """Whether anything but the engine's own views still refers to a batch's buffer."""
    return referenced_beyond(batch_buffer.buffer, batch_buffer.baseline)


def _names(names: Sequence[str]) -> str:
    """Tensor names for a message (the first five)."""
    return ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
