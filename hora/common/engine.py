"""The per-process engine: a background thread that negotiates, fuses and runs collectives.

The user's thread hands in :class:`Entry` objects (a request plus its tensors) and gets a
:class:`Handle`. The background thread runs cycles; one cycle is::

    _exchange()    every rank contributes its new requests (or response-cache bits)
    _negotiate()   every rank derives the same ordered list of agreed responses
    _execute()     fused batches run on the transport, in that order
    _complete()    handles finish with a result or an error

When nothing has happened for a few cycles on any rank, every rank parks at the same cycle and
stops using CPU; the first rank that gets new work rings a doorbell in the store and all resume.
A peer that dies or hangs turns into :class:`HoraInternalError` on every survivor, naming the
lost rank. The engine sees requests and flat buffers, never modules or optimizers.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from hora.common import adasum, fusion, steady
from hora.common.autotune import Autotuner
from hora.common.config import Settings
from hora.common.dtypes import FLOATING, INTEGER
from hora.common.errors import DUPLICATE_NAME, HoraInternalError, HoraValueError, shut_down_message
from hora.common.message import (
    CycleMessage,
    Key,
    ReduceOp,
    Request,
    RequestType,
    Response,
    key_label,
    key_parts,
    make_key,
)
from hora.common.negotiation import MessageTable, ResponseCache
from hora.common.process_sets import ProcessSetTable
from hora.common.rendezvous import (
    CAUSE_KEY,
    FAILURE_KEY,
    PARKED_KEY,
    StoreClient,
    exit_key,
    read_failure,
    report_failure,
    sign,
)
from hora.common.stall import StallInspector
from hora.common.timeline import ENGINE_ROW, Timeline
from hora.common.topology import Topology
from hora.common.transport import Communicator, Pending, TransportError

logger = logging.getLogger("hora")

# Park after this many consecutive cycles in which no rank had anything new (at least ~5 ms).
PARK_AFTER_IDLE_S = 0.005
# How often a parked or waiting thread looks at the store for failures.
WATCH_INTERVAL_S = 0.5
# Started allreduces awaiting completion before the engine waits to start another.
MAX_STARTED = 16
# In the steady state, a user thread blocked on a result while the batch this rank needs
# cannot fill makes the rank leave the schedule after this long (at least).
STEADY_BLOCKED_GRACE_S = 0.02
# A step that is one allreduce of one tensor this large (bytes) is not replayed in the steady
# state: negotiated, it is reduced in place; replayed, it would be copied into its batch's buffer
# and back, which costs more than the negotiation saves (measured: a 16 MiB allreduce repeated
# took 3 to 4 ms more of the engine's CPU in the steady state, on 2 ranks of a 2-core machine).
STEADY_LONE_TENSOR_MAX_BYTES = 1 << 20
# A parked rank waits on its doorbell this long at most (a ring always comes first).
PARKED_WAIT_S = 7 * 24 * 3600.0
# In the steady state, how often a rank that has not submitted a batch for the stall check time
# asks the store whether another rank waits for it.
STALL_PROBE_S = 2.0
# How long a survivor waits for the launcher's (or other survivors') account of a failure.
DIAGNOSE_WINDOW_S = 2.0
# A user thread blocked this long on a call still being negotiated is recorded in the store,
# where rank 0 looks for a deadlock (every rank waiting for what another never submits).
WAIT_RECORD_AFTER_S = 1.0
# How often rank 0 reads those records once the negotiation table has stood still long enough.
DEADLOCK_PROBE_S = 1.0


# Called when a user thread starts (True) and stops (False) blocking on a handle.
_wait_hook: Callable[[Handle, bool], None] | None = None
# Serialises Handle._open (the finisher may deliver a result while the engine fails the job).
_OPENING = threading.Lock()


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


class Handle:
    """The pending result of one collective call (several tensors for a grouped call)."""

    __slots__ = ("_done", "_latch", "_remaining", "error", "grouped", "id", "kind", "results")

    _ids = itertools.count(1)

    def __init__(self, count: int, kind: RequestType, grouped: bool = False) -> None:
        self.id = next(Handle._ids)
        self.kind = kind
        self.grouped = grouped
        self.results: list[Any] = [None] * count
        self.error: str | None = None
        self._remaining = count
        # A latch: held until the result is in (a bare lock costs a fraction of an Event,
        # and every gradient of every step makes a handle).
        self._done = count == 0
        self._latch = threading.Lock()
        if not self._done:
            self._latch.acquire()

    @classmethod
    def restart_numbering(cls) -> None:
        """Number handles from 1 again (at ``init``: unnamed ops are named after the number,
        and every rank of a new job, or of an elastic job's new round, must count alike)."""
        cls._ids = itertools.count(1)

    def done(self) -> bool:
        return self._done

    def wait(self) -> list[Any]:
        """Block until done; return the per-tensor results.

        Raises:
            HoraInternalError: the operation failed on this rank.
        """
        if not self._done:
            hook = _wait_hook
            if hook is not None:
                hook(self, True)
            try:
                # Any number of waiters pass, one after another.
                with self._latch:
                    pass
            finally:
                if hook is not None:
                    hook(self, False)
        if self.error is not None:
            raise HoraInternalError(self.error)
        return self.results

    def _set(self, index: int, value: Any) -> None:
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
        with _OPENING:
            if self._done:
                return
            self._done = True
            self._latch.release()


@dataclass(eq=False)
class Entry:
    """One tensor of one call: what was asked, the input, and where the result goes."""

    request: Request
    tensor: torch.Tensor | None
    output: torch.Tensor | None
    handle: Handle
    index: int = 0
    on_done: Callable[[Any], Any] | None = field(default=None)
    # The steady-state schedule whose batch buffer already holds this entry's tensor.
    staged: steady.Schedule | None = None
    # When it was submitted (timeline microseconds; 0 when no timeline was running).
    submitted: int = 0
    # Whether the result may be lent instead of written into the destination: a view of the
    # engine's steady-state buffer, which the caller adopts (``grad.set_(result)``).
    lend: bool = False


def _compute_dtype(dtype: torch.dtype, op: ReduceOp) -> tuple[torch.dtype, ReduceOp]:
    """The dtype and op the transport reduces in, where Gloo lacks a kernel for ``dtype``."""
    if dtype == torch.bool:
        # Logical or for Sum/Max, logical and for Min/Product.
        return torch.uint8, (ReduceOp.MAX if op in (ReduceOp.SUM, ReduceOp.MAX) else ReduceOp.MIN)
    if dtype == torch.int16:
        return torch.int32, op
    return dtype, op


def _scale(buffer: torch.Tensor, factor: float) -> torch.Tensor:
    """Multiply by ``factor`` as Horovod does: integers via float64, truncating; halves via fp32."""
    if factor == 1.0:
        return buffer
    if buffer.dtype in (torch.float16, torch.bfloat16):
        return buffer.float().mul_(factor).to(buffer.dtype)
    if not buffer.is_floating_point():
        return buffer.double().mul_(factor).trunc_().to(buffer.dtype)
    return buffer.mul_(factor)


def _postscale(buffer: torch.Tensor, divisor: int, factor: float) -> torch.Tensor:
    """A reduced buffer divided by ``divisor`` (an average's number of ranks), then scaled.

    The average is a division, so it is correctly rounded (an integer average truncates
    exactly); multiplying by a rounded ``1 / divisor`` can be one unit off in the last place.
    """
    if divisor == 1:
        return _scale(buffer, factor)
    if buffer.is_floating_point():
        return _scale(buffer.div_(divisor), factor)
    if factor == 1.0:
        return buffer.div_(divisor, rounding_mode="trunc")
    return _scale(buffer, factor / divisor)


def _destination(entry: Entry | None) -> torch.Tensor | None:
    """Where an allreduce result goes: the output tensor, or the input for in-place calls."""
    if entry is None:
        return None
    return entry.output if entry.output is not None else entry.tensor


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


class Engine:
    """The background runtime of one process.

    Args:
        topology: this process's place in the job.
        settings: engine settings.
        store: a connection to the job's store (an in-process one for a job of one).
        communicator_factory: builds a communicator for ``(scope, rank_in_set, set_size)``.
        generation: how many times ``init`` ran before in this process (keeps scopes distinct).
    """

    def __init__(
        self,
        topology: Topology,
        settings: Settings,
        store: StoreClient,
        communicator_factory: Callable[[str, int, int], Communicator],
        generation: int = 0,
        process_sets: list[tuple[int, ...]] | None = None,
    ) -> None:
        self.topology = topology
        self.settings = settings
        self.rank = topology.rank
        self.size = topology.size
        self._store = store
        self._make_communicator = communicator_factory
        self._generation = generation
        self.process_sets = ProcessSetTable(topology.size)
        self._communicators: dict[int, Communicator] = {}
        self._cache = ResponseCache(settings.cache_capacity)
        self._table = MessageTable(self.process_sets)
        self._stall = StallInspector(
            settings.stall_check_time_s,
            settings.stall_shutdown_time_s,
            settings.stall_check_enabled and topology.rank == 0,
        )
        # In the steady state a rank starts a batch as soon as its own tensors are there and
        # waits inside the allreduce for ranks still busy elsewhere (evaluating, writing a
        # checkpoint). As a wait in negotiation, that is no failure, however long: the batches
        # get their own timeout, HORA_STALL_SHUTDOWN_TIME_SECONDS when set (the job then ends
        # as a stalled one would), else days. Dead peers are still noticed at once (a closed
        # connection, the launcher's record of the exit).
        shutdown_s = settings.stall_shutdown_time_s
        if not settings.stall_check_enabled or shutdown_s < settings.stall_check_time_s:
            shutdown_s = 0.0
        self._steady_shutdown_s = shutdown_s
        # How long a steady-state wait lasts before it counts as a stall (0: never).
        self._stall_after_s = settings.stall_check_time_s if settings.stall_check_enabled else 0.0
        self._steady_timeout_s = shutdown_s if shutdown_s > 0 else PARKED_WAIT_S
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._queue: deque[Entry] = deque()
        # Entries submitted and not finished, by (process set, name).
        self._in_flight: dict[Key, Entry] = {}
        self._shutdown_reason: str | None = None
        self._failure: str | None = None
        self._running = False
        self._parked_generation = 0
        self._woken_generation = 0
        self._idle_cycles = 0
        self._park_after = max(
            2, math.ceil(PARK_AFTER_IDLE_S * 1000 / max(settings.cycle_time_ms, 0.1))
        )
        self._last_cycle_end = 0.0
        self._thread: threading.Thread | None = None
        self._watcher: _Watcher | None = None
        self._finisher = _Finisher(self)
        self._fail_lock = threading.Lock()
        self._history = steady.History()
        self._schedule: steady.Schedule | None = None
        # The steady-state batch whose allreduce runs while the next one fills.
        self._flight: _Flight | None = None
        # A user polled a result while a batch was held back (see _collect_batch).
        self._polled = False
        self._held: dict[Key, Entry] = {}
        self._taken: list[Entry] = []
        self._awaiting: set[Key] = set()
        self._cuts: set[str] = set()
        # Times the steady state was entered and left, and batches it ran (tests and tools read it).
        # "blocked": leaves where no rank deviated, only a user waited on a result whose batch
        # could not fill (the next schedule is cut there).
        # "buffers": batch buffers allocated besides the schedules' first ones (see _claim).
        self.steady_stats = {"entered": 0, "left": 0, "blocked": 0, "batches": 0, "buffers": 0}
        # The timeline being written, if any (set by hora.common.basics).
        self.timeline: Timeline | None = None
        self._autotuner = (
            Autotuner(
                settings.fusion_threshold_bytes,
                settings.autotune_warmup_samples,
                settings.autotune_steps_per_sample,
                settings.autotune_log,
                topology.rank,
            )
            if settings.autotune and settings.steady_state and topology.size > 1
            else None
        )
        self._period_started = 0.0
        self._batch_number = 0
        # Steady-state data allreduces issued so far: every rank issues the same ones, so the
        # count names a batch across ranks (for stall reports).
        self._steady_started = 0
        self._agreed_at = 0
        self._blocked: dict[Handle, float] = {}
        # What this rank last recorded as the calls its blocked threads wait for (see
        # _record_waits); when rank 0 next reads every rank's record (_check_deadlock).
        self._recorded_waits = ""
        self._deadlock_probe = 0.0
        self._control = self._connect("control", 0, self.rank, self.size)
        self._communicators[0] = self._connect("ps0", 0, self.rank, self.size)
        for ranks in process_sets or []:
            set_id = self.process_sets.reserve_id()
            self._register_process_set(set_id, ranks)

    # ----------------------------------------------------------------- lifecycle

    def _connect(self, scope: str, set_id: int, rank: int, size: int) -> Communicator:
        try:
            return self._make_communicator(f"g{self._generation}/{scope}", rank, size)
        except TransportError as exc:
            raise HoraInternalError(
                f"rank {self.rank}: could not connect to the other ranks of process set {set_id} "
                f"({exc}). Check that every rank called hvd.init() and that the hosts can reach "
                "each other (HORA_GLOO_IFACE selects the network interface)."
            ) from exc

    def start(self) -> None:
        global _wait_hook
        self._running = True
        _wait_hook = self._note_blocked
        if self.size > 1:
            self._watcher = _Watcher(self, self._store.reconnect())
            self._watcher.start()
        self._finisher.start()
        self._thread = threading.Thread(target=self._loop, name="hora-engine", daemon=True)
        self._thread.start()

    def shutdown(self, reason: str | None = None) -> None:
        """Stop this rank's engine and, through negotiation, every other rank's."""
        with self._wakeup:
            if self._shutdown_reason is None:
                self._shutdown_reason = reason or f"rank {self.rank} called hvd.shutdown()"
            self._wakeup.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.settings.gloo_timeout_s + 10)
        if self._finisher.ident is not None and self._finisher is not threading.current_thread():
            self._finisher.join(timeout=self.settings.gloo_timeout_s + 10)
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher.join(timeout=10.0)
        global _wait_hook
        if _wait_hook == self._note_blocked:
            _wait_hook = None
        finished = (self._thread is None or not self._thread.is_alive()) and not (
            self._finisher.is_alive()
        )
        for comm in [self._control, *self._communicators.values()]:
            # Tear groups down here rather than leave it to interpreter exit.
            if self._failure is not None or not finished:
                comm.abort()
            if finished:
                comm.close()

    def report_cause(self, text: str) -> None:
        """Record in the store that this rank is ending the job (first report wins).

        The launcher reads it to name the rank that caused a failure, which is not always the
        rank whose process ended first.
        """
        if self.size == 1:
            return
        try:
            self._store.store.compare_set(
                self._store.key(CAUSE_KEY),
                "",
                sign(self._store.secret, text.encode(), key=CAUSE_KEY),
            )
        except Exception:  # noqa: BLE001 - best effort while exiting
            pass

    @property
    def failure(self) -> str | None:
        return self._failure

    @property
    def schedule(self) -> steady.Schedule | None:
        """The steady-state schedule being replayed, if any.

        Read without the engine's lock: a caller may use it only as a hint about which names
        will be reduced together (``DistributedOptimizer`` submits a batch's gradients at once);
        the engine handles whatever is submitted, whenever, against its current schedule.
        """
        return self._schedule

    @property
    def running(self) -> bool:
        return self._running

    # ----------------------------------------------------------------- user thread

    def enqueue(self, entries: list[Entry]) -> None:
        """Queue entries atomically (a grouped call's entries reach negotiation together).

        Raises:
            ValueError: a name is already in flight on this rank.
            HoraInternalError: the engine has stopped.
        """
        with self._wakeup:
            if not self._running or self._shutdown_reason is not None:
                raise HoraInternalError(self._failure or shut_down_message(self._shutdown_reason))
            keys = [e.request.key for e in entries]
            for entry in entries:
                if entry.request.key in self._in_flight:
                    raise HoraValueError(DUPLICATE_NAME.format(name=entry.request.name))
            if len(keys) > 1 and len(set(keys)) != len(keys):
                raise HoraValueError(DUPLICATE_NAME.format(name=entries[0].request.name))
            for entry in entries:
                self._in_flight[entry.request.key] = entry
            timeline = self.timeline
            if timeline is not None:
                submitted = timeline.now()
                for entry in entries:
                    entry.submitted = submitted
            self._queue.extend(entries)
            if self._schedule is None or self._admit(self._schedule, entries):
                self._wakeup.notify_all()

    def _admit(self, schedule: steady.Schedule, entries: list[Entry]) -> bool:
        """In the steady state: stage new entries; return whether the engine thread must wake.

        An expected tensor is copied into its batch's buffer now, on the submitting thread: as
        DDP fills its buckets from autograd hooks, this overlaps the copy with the rest of
        backward instead of adding it to the critical path after the last gradient. The engine
        wakes for an unexpected entry (a deviation) or the one that completes its batch.
        """
        wake = False
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
                _stage(schedule, number, request.name, tensor)
                entry.staged = schedule
            if request.key in self._awaiting:
                self._awaiting.discard(request.key)
                wake = wake or not self._awaiting
        return wake

    def register_process_set(self, ranks: tuple[int, ...], remove: bool = False) -> Handle:
        """Negotiate adding (or removing) a process set; the handle's result is its id."""
        if remove:
            set_id = self.process_sets.find(ranks)
            if set_id is None:
                raise ValueError(f"no registered process set has ranks {list(ranks)}")
            name = f"process_set.{set_id}.remove"
            kind = RequestType.REMOVE_PROCESS_SET
        else:
            set_id = self.process_sets.reserve_id()
            name = f"process_set.{set_id}.add"
            kind = RequestType.ADD_PROCESS_SET
        handle = Handle(1, kind)
        request = Request(name=name, kind=kind, dtype="uint8", ranks=ranks)
        self.enqueue([Entry(request, None, None, handle)])
        return handle

    # ----------------------------------------------------------------- background thread

    def _loop(self) -> None:
        try:
            while self._cycle():
                pass
        except TransportError as exc:
            self._hand_back(self._taken)
            self._transport_failed(str(exc))
        except Exception as exc:  # noqa: BLE001 - every failure must reach the user's handles
            self._hand_back(self._taken)
            logger.exception("hora engine on rank %d stopped", self.rank)
            with self._fail_lock:
                if self._failure is None:
                    self._fail(f"rank {self.rank}: the hora engine stopped: {exc!r}")
        finally:
            self._running = False
            self._finisher.stop()

    def _transport_failed(self, error: str) -> None:
        """A collective failed on this rank's engine or finisher thread: diagnose it once."""
        with self._fail_lock:
            if self._failure is None:
                self._fail(self._diagnose(error))

    def _note_blocked(self, handle: Handle, blocked: bool) -> None:
        with self._wakeup:
            if blocked:
                self._blocked[handle] = time.monotonic()
            else:
                self._blocked.pop(handle, None)
            if self._schedule is not None:
                self._wakeup.notify_all()

    def _cycle(self) -> bool:
        # Entries this cycle takes out of the in-flight table; should the cycle raise, their
        # handles fail with the engine rather than wait forever (see _loop).
        self._taken = []
        if self._schedule is not None:
            # Results are written into the caller's tensors outside autograd, as in _execute.
            with torch.no_grad():
                return self._steady_cycle()
        self._wait_for_turn()
        timeline = self.timeline
        if timeline is not None and timeline.mark_cycles:
            timeline.instant(ENGINE_ROW, "CYCLE_START")
        new = self._drain()
        contributions = self._exchange(new)
        shutdown_reason = self._integrate(contributions)
        responses = self._table.ready(self._cache)
        if timeline is not None:
            self._agreed_at = timeline.now()
        had_news = any(reqs for reqs, _ in contributions) or bool(responses)
        self._idle_cycles = 0 if had_news else self._idle_cycles + 1
        self._execute(responses)
        self._last_cycle_end = time.monotonic()
        if shutdown_reason is not None:
            # Collectives started before the shutdown was agreed still deliver their results.
            self._finisher.drain()
            self._finish(shut_down_message(shutdown_reason))
            return False
        if self._stall.due() and self._table:
            reason = self._stall.check(self._table)
            if reason is not None:
                with self._wakeup:
                    self._shutdown_reason = self._shutdown_reason or reason
        self._maybe_enter_steady_state()
        return True

    def _wait_for_turn(self) -> None:
        """Start the next cycle when local work arrives or a cycle time has passed.

        Starting at once on local work keeps a lone synchronous op's latency near the
        transport's; requests that arrive while a cycle runs are batched into the next one.
        """
        if self.size > 1 and self._idle_cycles >= self._park_after:
            self._park()
            return
        # Counted from the end of the last cycle: after a long cycle, the user thread gets a
        # cycle time to submit its next request before an idle exchange goes out without it.
        deadline = self._last_cycle_end + self.settings.cycle_time_ms / 1000
        if self.size == 1 and self.timeline is not None and not self._queue:
            self.timeline.flush()  # a job of one waits for work without parking
        with self._wakeup:
            while not self._queue and self._shutdown_reason is None:
                remaining = deadline - time.monotonic()
                if self.size > 1 and remaining <= 0:
                    break
                self._wakeup.wait(timeout=remaining if self.size > 1 else None)

    def _park(self) -> None:
        """Sleep until this rank has work, another rank rings, or a check is due."""
        generation = self._parked_generation = self._parked_generation + 1
        wake_key = f"g{self._generation}/wake/{generation}"
        if self.timeline is not None:
            # Idle: what happened so far reaches the file now, for anyone reading it meanwhile.
            self.timeline.flush()
        if self.rank == 0:
            if generation > 1:
                self._store.delete(f"g{self._generation}/wake/{generation - 1}")
            # Whoever reports a failure rings the doorbell named here, to wake parked ranks.
            self._store.set_signed(PARKED_KEY, wake_key.encode())
        assert self._watcher is not None
        self._watcher.watch(generation)
        ring = False
        with self._wakeup:
            while True:
                if self._failure_seen():
                    break
                if self._queue or self._shutdown_reason is not None:
                    ring = True
                    break
                if self._woken_generation >= generation:
                    break
                self._wakeup.wait(timeout=WATCH_INTERVAL_S)
                if self._stall.due() and self._table:
                    reason = self._stall.check(self._table)
                    if reason is not None:
                        self._shutdown_reason = self._shutdown_reason or reason
                # Every rank parks when nobody has anything new: that is where a deadlock
                # shows. The store calls run without the lock, which user threads need.
                self._wakeup.release()
                try:
                    self._record_waits()
                    reason = self._check_deadlock()
                finally:
                    self._wakeup.acquire()
                if reason is not None:
                    self._shutdown_reason = self._shutdown_reason or reason
        if ring:
            self._store.set_signed(wake_key, b"")
        self._idle_cycles = 0
        # Whoever rang has work: go at once.
        self._last_cycle_end = 0.0

    def _waits_key(self, rank: int) -> str:
        return f"g{self._generation}/waits/{rank}"

    def _awaited(self) -> list[Key]:
        """Keys still in negotiation that this rank's threads have waited for a while."""
        now = time.monotonic()
        with self._wakeup:
            blocked = self._blocked
            awaited = [
                key
                for key, entry in self._in_flight.items()
                if now - blocked.get(entry.handle, now) >= WAIT_RECORD_AFTER_S
            ]
        return sorted(awaited, key=key_parts)

    def _record_waits(self) -> None:
        """Record in the store what this rank's blocked threads wait for (when it changed)."""
        text = json.dumps([key_parts(k) for k in self._awaited()]) if self.size > 1 else ""
        if text == self._recorded_waits:
            return
        try:
            self._store.set_signed(self._waits_key(self.rank), text.encode())
            self._recorded_waits = text
        except Exception as exc:  # noqa: BLE001 - a lost store fails the job elsewhere
            logger.debug("rank %d could not record its waits: %s", self.rank, exc)

    def _check_deadlock(self) -> str | None:
        """On rank 0: the shutdown reason when every rank has waited ``HORA_GLOO_TIMEOUT_SECONDS``
        for calls that other ranks never submitted, with nothing arriving meanwhile."""
        if self.rank != 0 or self.size == 1 or not self._stall.enabled or not self._table:
            return None
        now = time.monotonic()
        idle = now - self._table.changed
        if idle < self.settings.gloo_timeout_s or now < self._deadlock_probe:
            return None
        self._deadlock_probe = now + DEADLOCK_PROBE_S
        waits: dict[int, list[Key]] = {0: self._awaited()}
        try:
            for rank in range(1, self.size):
                key = self._waits_key(rank)
                if not self._store.check(key):
                    return None
                waits[rank] = _keys_from_json(self._store.get_signed(key))
        except Exception as exc:  # noqa: BLE001 - a record that cannot be read is no deadlock
            logger.debug("rank 0 could not read the ranks' waits: %s", exc)
            return None
        reason = self._stall.deadlock(self._table, waits, idle)
        if reason is not None:
            logger.error("%s", reason)
        return reason

    def _failure_seen(self) -> bool:
        return self._watcher is not None and self._watcher.failure is not None

    def _wake(self, generation: int) -> None:
        with self._wakeup:
            self._woken_generation = max(self._woken_generation, generation)
            self._wakeup.notify_all()

    def _drain(self) -> list[Entry]:
        with self._wakeup:
            new = list(self._queue)
            self._queue.clear()
            return new

    # ----------------------------------------------------------------- steady state

    def _maybe_enter_steady_state(self) -> None:
        """After a cycle: start replaying if the agreed allreduces repeat (same on every rank)."""
        if not self.settings.steady_state or self.size == 1 or self._table.pending:
            return
        if self._table.joined or self._shutdown_reason is not None:
            return
        period = self._history.period()
        if period is None:
            return
        if (
            len(period) == 1
            and len(period[0].names) == 1
            and period[0].num_bytes > STEADY_LONE_TENSOR_MAX_BYTES
        ):
            self._history.clear()
            return
        schedule = self._build_schedule(period)
        self._period_started = 0.0
        self._history.clear()
        self.steady_stats["entered"] += 1
        if self.timeline is not None:
            self.timeline.instant(ENGINE_ROW, "STEADY_STATE_ENTER")
        logger.debug(
            "rank %d: steady state, %d allreduces in %d batches per period",
            self.rank,
            len(period),
            len(schedule.batches),
        )

    def _build_schedule(self, period: list[Response]) -> steady.Schedule:
        """Cut ``period`` into batches (autotune's current sizes), allocate, and install it."""
        sizes: dict[str, int] = {}
        if self._autotuner is not None:
            current = self._autotuner.current
            sizes = {
                "first_bucket_bytes": current.first_bucket_bytes,
                "bucket_bytes": current.bucket_bytes,
            }
        schedule = steady.build_schedule(
            period, self.settings.fusion_threshold_bytes, self._cuts, **sizes
        )
        # One buffer per batch, reused every period (no allocation, no page faults per step);
        # after the data, one slot per rank for its code (see hora.common.steady).
        for batch, counts in zip(schedule.batches, schedule.sizes):
            batch_buffer = _batch_buffer(batch, counts, self.size)
            schedule.batch_buffers.append(batch_buffer)
            schedule.pieces.update(batch_buffer.pieces)
            factor = batch[0].prescale
            if batch[0].reduce_op == ReduceOp.AVERAGE:
                factor /= self.size
            schedule.factors.append(factor)
            schedule.scale_each.append(
                factor != 1.0 and sum(counts) >= _SCALE_EACH_FROM * len(counts)
            )
        with self._wakeup:
            self._schedule = schedule
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
            spare = _batch_buffer(schedule.batches[number], schedule.sizes[number], self.size)
            self.steady_stats["buffers"] += 1
        schedule.batch_buffers[number] = spare
        schedule.pieces.update(spare.pieces)
        # The buffer still in use is kept as the spare: it is free again once its holder lets go.
        schedule.spares[number] = current

    def _period_finished(self, schedule: steady.Schedule) -> None:
        """The schedule wrapped around: one step is done. Feed autotune."""
        now = time.monotonic()
        started, self._period_started = self._period_started, now
        tuner = self._autotuner
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

    def _steady_cycle(self) -> bool:
        """Start the schedule's next batch, land the one in flight, or leave on a deviation.

        Two batches may be in flight, as DDP queues its buckets: batch k starts as soon as its
        tensors are there, before batch k-1's result (and its codes) came back. Every rank
        starts the same batches in the same order; waiting for them is local. A batch is
        *landed* (its codes read, its results delivered) before the one after next starts.
        """
        flight = self._flight
        try:
            return self._steady_step(flight)
        except BaseException:
            # Batches started in earlier cycles hold entries too: give them back to fail.
            entries = list(flight.entries) if flight is not None else []
            if self._flight is not None and self._flight is not flight:
                entries += self._flight.entries
            self._hand_back(entries)
            raise

    def _steady_step(self, flight: _Flight | None) -> bool:
        schedule = self._schedule
        assert schedule is not None
        # A rank that deviated starts nothing more: it lands that batch and leaves (the
        # deviating entry is among those it holds).
        if flight is not None and (
            flight.code != steady.FOLLOWING or not self._may_overlap(schedule)
        ):
            self._flight = None
            self._land(flight, None)
            return True
        collected = self._collect_batch(schedule, flight)
        if collected is None:
            # The batch in flight came back before the next one filled: deliver it first.
            assert flight is not None
            self._flight = None
            self._land(flight, None)
            return True
        following = self._start_batch(schedule, *collected)
        self._flight = following
        if flight is not None:
            self._land(flight, following)
        return True

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
        timeline = self.timeline
        started = timeline.now() if timeline is not None else 0
        self._batch_number += 1
        position = schedule.position
        batch = schedule.current
        entries = [] if code != steady.FOLLOWING else self._take_all([r.key for r in batch])
        if position in schedule.lent:
            with self._wakeup:
                self._claim(schedule, position)
        batch_buffer = schedule.batch_buffers[position]
        buffer, data, codes = batch_buffer.buffer, batch_buffer.data, batch_buffer.codes
        if code == steady.FOLLOWING:
            # Tensors are staged as they are submitted (see _admit), except those submitted
            # while this buffer was still on the wire.
            for entry in entries:
                if entry is not None and entry.tensor is not None and entry.staged is not schedule:
                    _stage(schedule, position, entry.request.name, entry.tensor)
            if not schedule.scale_each[position]:
                scaled = _scale(data, schedule.factors[position])
                if scaled is not data:
                    data.copy_(scaled)
        else:
            data.zero_()
        codes.zero_()
        if code != steady.FOLLOWING:
            codes[self.rank] = code
        flight = _Flight(schedule, position, entries, code, deviation)
        flight.number, flight.started = self._batch_number, started
        self._steady_started += 1
        flight.steady_id = self._steady_started
        with self._wakeup:
            # From here the buffer is the transport's: tensors submitted meanwhile for this
            # batch (the next period's) are copied when it starts again.
            schedule.in_flight.add(position)
            schedule.advance()
        flight.issued = timeline.now() if timeline is not None else 0
        try:
            flight.pending = self._communicators[0].allreduce_async(
                buffer, ReduceOp.SUM, self._steady_timeout_s
            )
        except TransportError:
            self._hand_back(entries)
            raise
        return flight

    def note_polled(self) -> None:
        """A user polled a result that is not in yet: land a batch held back (see
        ``_collect_batch``) now rather than when the next one starts."""
        with self._wakeup:
            if self._flight is not None:
                self._polled = True
                self._wakeup.notify_all()

    def _hand_back(self, entries: Sequence[Entry | None]) -> None:
        """The job is failing: make entries visible again so that their handles fail with the
        diagnosis instead of waiting forever."""
        with self._wakeup:
            for entry in entries:
                if entry is not None:
                    self._in_flight[entry.request.key] = entry

    def _land(self, flight: _Flight, following: _Flight | None) -> None:
        """Wait for ``flight``; deliver its results or, if some rank deviated, leave."""
        schedule = flight.schedule
        assert flight.pending is not None
        try:
            self._wait_for_peers(flight)
            flight.pending.wait()
        except TransportError as exc:
            self._hand_back(flight.entries + (following.entries if following else []))
            raise self._steady_error(flight, exc) from exc
        timeline = self.timeline
        done = timeline.now() if timeline is not None else 0
        codes = schedule.batch_buffers[flight.position].codes
        if bool(codes.any()):
            with self._wakeup:
                schedule.in_flight.discard(flight.position)
            self._abort_following(schedule, following)
            entries = flight.entries + (following.entries if following else [])
            deviation = flight.deviation or (following.deviation if following else None)
            batch = schedule.batches[flight.position]
            self._leave_steady_state(deviation, entries, batch, [int(c) for c in codes.tolist()])
            return
        self.steady_stats["batches"] += 1
        # The average's division happened before the sum (see Schedule.factors).
        postscale = schedule.batches[flight.position][0].postscale
        # Completed here rather than on the finisher: a hand-off between threads costs more
        # than the copy, and the next batch (if ready) is already running.
        data = schedule.batch_buffers[flight.position].data
        finished = [e for e in flight.entries if e is not None]
        lent = _deliver(finished, data, schedule.pieces, postscale)
        with self._wakeup:
            if lent:
                schedule.lent.add(flight.position)
            # Only now may the next period's tensors be staged into this buffer.
            schedule.in_flight.discard(flight.position)
        if timeline is not None:
            args = '{"op":"ALLREDUCE"}'
            for entry in finished:
                if entry.submitted:
                    row = timeline.row(key_label(entry.request.key))
                    timeline.complete(row, "WAIT_FOR_BATCH", entry.submitted, flight.started, args)
            times = (flight.started, flight.issued, done, timeline.now())
            nbytes = data.numel() * data.itemsize
            self._trace_collective(finished, "ALLREDUCE", flight.number, times, nbytes)
        if flight.position == len(schedule.batches) - 1:
            self._period_finished(schedule)
        self._last_cycle_end = time.monotonic()

    def _waiting_key(self, steady_id: int) -> str:
        return f"g{self._generation}/steady_wait/{steady_id}"

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
            self._store.set_signed(self._waiting_key(flight.steady_id), str(self.rank).encode())
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
            return bool(self._store.check(self._waiting_key(self._steady_started + 1)))
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
                self._hand_back(following.entries)
                raise
            with self._wakeup:
                schedule.in_flight.discard(following.position)
        elif self._may_overlap(schedule):
            self._steady_started += 1
            empty = torch.zeros_like(schedule.batch_buffers[schedule.position].buffer)
            comm = self._communicators[0]
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
        with self._wakeup:
            self._awaiting = set(needed)
            while True:
                while self._queue:
                    entry = self._queue.popleft()
                    self._held[entry.request.key] = entry
                    if not schedule.expects(entry.request):
                        return steady.DEVIATED, f"{entry.request.name} is not next in the schedule"
                self._awaiting.difference_update(self._held)
                if self._shutdown_reason is not None:
                    return steady.DEVIATED, "shutdown"
                if self._failure_seen():
                    return steady.DEVIATED, "a failure was reported"
                if not self._awaiting:
                    for key in needed:
                        del self._held[key]
                    return steady.FOLLOWING, None
                if flight is not None and (
                    self._polled
                    or any(e is not None and e.handle in self._blocked for e in flight.entries)
                ):
                    self._polled = False
                    return None
                now = time.monotonic()
                timeout = WATCH_INTERVAL_S
                # A user blocked on a result this rank has not run yet: the batch may never
                # fill (its user submits the rest only after the result). Results already
                # running are not waited for here.
                since = [
                    self._blocked[e.handle]
                    for e in self._held.values()
                    if e.handle in self._blocked
                ]
                if since:
                    waited = now - max(min(since), started)
                    grace = max(STEADY_BLOCKED_GRACE_S, 10 * self.settings.cycle_time_ms / 1000)
                    if waited >= grace:
                        first = min(i for i, k in enumerate(needed) if k in self._awaiting)
                        return steady.blocked_code(
                            first
                        ), f"a result is awaited before {schedule.current[first].name}"
                    timeout = min(timeout, grace - waited)
                if stall_after and not warned and now - started > stall_after and now >= probe:
                    # Some rank waits for this one (it recorded so), or every rank is busy
                    # elsewhere at once, which is no stall: ask the store now and then.
                    probe = now + STALL_PROBE_S
                    if self._peers_wait():
                        warned = True
                        logger.warning(
                            "rank %d has not submitted %s for %.0f s while other ranks wait for "
                            "them (steady state).",
                            self.rank,
                            _names([r.name for r in schedule.current if r.key not in self._held]),
                            now - started,
                        )
                self._wakeup.wait(timeout=timeout)

    def _leave_steady_state(
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
        self._cuts |= steady.cuts_from(batch, codes)
        with self._wakeup:
            held = [e for e in entries if e is not None] + list(self._held.values())
            for entry in held:
                self._in_flight[entry.request.key] = entry
            self._queue.extendleft(reversed(held))
            self._held.clear()
            self._schedule = None
            self._flight = None
        self._history.clear()
        self.steady_stats["left"] += 1
        if steady.DEVIATED not in codes:
            self.steady_stats["blocked"] += 1
        if self.timeline is not None:
            self.timeline.instant(ENGINE_ROW, "STEADY_STATE_LEAVE")
        # One more period for every deviation so far before the schedule comes back (at most 10).
        self._history.repeats = min(2 + self.steady_stats["left"], 10)
        self._last_cycle_end = 0.0
        logger.debug(
            "rank %d: leaving the steady state (ranks' codes %s; here: %s)",
            self.rank,
            codes,
            deviation or "following",
        )

    # ----------------------------------------------------------------- negotiation

    def _exchange(self, new: list[Entry]) -> list[tuple[tuple[Request, ...], str | None]]:
        """Every rank's new requests this cycle, in rank order."""
        bits: list[int] = []
        full: list[Request] = []
        for entry in new:
            bit = self._cache.bit_for(entry.request, self.rank)
            if bit is None:
                full.append(entry.request)
            else:
                bits.append(bit)
        message = CycleMessage(tuple(full), tuple(bits), self._shutdown_reason)
        if self.size == 1:
            return [(tuple(entry.request for entry in new), message.shutdown)]
        payload = message.encode_payload()
        bitmap = 0
        for bit in bits:
            bitmap |= 1 << bit
        nbytes = (max(self._cache.capacity, 1) + 7) // 8
        header = struct.pack("<q", len(payload)) + bitmap.to_bytes(nbytes, "little")
        headers = self._allgather_bytes(header)
        lengths = [struct.unpack("<q", h[:8])[0] for h in headers]
        payloads: list[bytes] = [b""] * self.size
        longest = max(lengths)
        if longest > 0:
            padded = self._allgather_bytes(payload + bytes(longest - len(payload)))
            payloads = [p[:n] for p, n in zip(padded, lengths)]
        contributions: list[tuple[tuple[Request, ...], str | None]] = []
        for rank in range(self.size):
            received = int.from_bytes(headers[rank][8:], "little")
            expanded: list[Request] = []
            while received:
                low = received & -received
                expanded.append(self._cache.expand(low.bit_length() - 1, rank))
                received ^= low
            try:
                requests, shutdown = CycleMessage.decode_payload(payloads[rank])
            except ValueError as exc:
                raise HoraInternalError(f"rank {rank} sent a malformed message: {exc}") from exc
            contributions.append((tuple(expanded) + requests, shutdown))
        return contributions

    def _allgather_bytes(self, data: bytes) -> list[bytes]:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        outputs = [torch.empty_like(buffer) for _ in range(self.size)]
        self._control.allgather(outputs, buffer)
        return [o.numpy().tobytes() for o in outputs]

    def _integrate(self, contributions: list[tuple[tuple[Request, ...], str | None]]) -> str | None:
        reason: str | None = None
        for rank, (requests, shutdown) in enumerate(contributions):
            for request in requests:
                self._table.add(rank, request)
            if shutdown is not None and reason is None:
                reason = shutdown
        return reason

    # ----------------------------------------------------------------- execution

    def _execute(self, responses: list[Response]) -> None:
        # Results are written into the caller's tensors (parameters among them) outside autograd.
        with torch.no_grad():
            self._execute_batches(responses)

    def _execute_batches(self, responses: list[Response]) -> None:
        for response in responses:
            self._history.record(response)
        for batch in fusion.plan(
            responses, self.settings.fusion_threshold_bytes, self.settings.disable_group_fusion
        ):
            head = batch[0]
            self._batch_number += 1
            traced = self._trace_negotiated(batch) if self.timeline is not None else None
            if head.error is not None:
                for key in head.keys:
                    self._fail_name(key, head.error)
                continue
            if head.kind in (RequestType.ADD_PROCESS_SET, RequestType.REMOVE_PROCESS_SET):
                self._change_process_set(head)
                continue
            if head.kind == RequestType.JOIN:
                entry = self._take(head.keys[0])
                if entry is not None:
                    _finish(entry, head.last_joined_rank)
                continue
            members = self.process_sets.members(head.process_set_id)
            if self.rank not in members:
                continue
            if head.kind == RequestType.BARRIER:
                entry = self._take(head.keys[0])
                if entry is not None:
                    _finish(entry, None)
                continue
            comm = self._communicators[head.process_set_id]
            if head.kind == RequestType.ALLREDUCE:
                waiting = [self._in_flight.get(r.keys[0]) for r in batch]
                with _writing_to_inference(waiting):
                    if head.template().reduce_op == ReduceOp.ADASUM:
                        self._adasum(batch, comm)
                    else:
                        self._allreduce(batch, comm)
            elif head.kind == RequestType.ALLGATHER:
                self._allgather(head, comm, members)
            elif head.kind == RequestType.BROADCAST:
                self._broadcast(head, comm, members)
            elif head.kind == RequestType.ALLTOALL:
                self._alltoall(head, comm, members)
            elif head.kind == RequestType.REDUCESCATTER:
                self._reducescatter(head, comm, members)
            if traced is not None and head.kind != RequestType.ALLREDUCE and self.timeline:
                entries, start = traced
                end = self.timeline.now()
                times = (start, start, end, end)
                self._trace_collective(
                    entries, head.kind.name, self._batch_number, times, head.num_bytes
                )

    def _trace_negotiated(self, batch: list[Response]) -> tuple[list[Entry | None], int]:
        """NEGOTIATE_<OP> and QUEUE for this rank's tensors of a batch that starts now.

        Returns:
            (the batch's entries on this rank, the batch's start).
        """
        timeline = self.timeline
        assert timeline is not None
        start = timeline.now()
        kind = _op_label(batch[0])
        args = f'{{"op":"{kind}"}}'
        negotiate = f"NEGOTIATE_{kind}"
        with self._wakeup:
            entries = [self._in_flight.get(key) for r in batch for key in r.keys]
        for entry in entries:
            if entry is None or not entry.submitted:
                continue
            row = timeline.row(key_label(entry.request.key))
            agreed = max(self._agreed_at, entry.submitted)
            timeline.complete(row, negotiate, entry.submitted, agreed, args)
            timeline.complete(row, "QUEUE", agreed, start)
        return entries, start

    def _trace_collective(
        self,
        entries: Sequence[Entry | None],
        label: str,
        number: int,
        times: tuple[int, int, int, int],
        nbytes: int,
    ) -> None:
        """A batch's copy in, collective and copy out, on each of its tensors' rows.

        Args:
            times: batch start, collective start, collective end, results delivered.
        """
        timeline = self.timeline
        if timeline is None:
            return
        start, issued, done, end = times
        batch = f'{{"batch":{number}}}'
        detail = f'{{"batch":{number},"tensors":{len(entries)},"bytes":{nbytes}}}'
        for entry in entries:
            if entry is None:
                continue
            row = timeline.row(key_label(entry.request.key))
            if issued > start:
                timeline.complete(row, "MEMCPY_IN_FUSION_BUFFER", start, issued, batch)
            timeline.complete(row, label, issued, done, detail)
            if end > done:
                timeline.complete(row, "MEMCPY_OUT_FUSION_BUFFER", done, end, batch)

    def _take(self, key: Key) -> Entry | None:
        return self._take_all([key])[0]

    def _take_all(self, keys: list[Key]) -> list[Entry | None]:
        """Take these keys' entries out of the in-flight table (``None`` where there is none);
        should the cycle raise, their handles fail with the engine (see ``_cycle``)."""
        with self._wakeup:
            entries = [self._in_flight.pop(key, None) for key in keys]
        self._taken.extend(entry for entry in entries if entry is not None)
        return entries

    def _fail_name(self, key: Key, message: str) -> None:
        entry = self._take(key)
        if entry is not None:
            entry.handle._fail(message)

    def _allreduce(self, batch: list[Response], comm: Communicator) -> None:
        """Start one fused allreduce; the finisher thread completes it.

        The engine goes on negotiating (and starting) the next batches while this one is on
        the wire, as gradients of earlier layers arrive during backward.
        """
        timeline = self.timeline
        started = timeline.now() if timeline is not None else 0
        number = self._batch_number
        entries = [self._take(r.keys[0]) for r in batch]
        head = batch[0].template()
        inputs: list[torch.Tensor] = []
        for response, entry in zip(batch, entries):
            if entry is None or entry.tensor is None:  # joined: contribute zeros
                template = response.template()
                inputs.append(torch.zeros(template.shape, dtype=_torch_dtype(template.dtype)))
            else:
                inputs.append(entry.tensor)
        device = inputs[0].device
        if len(inputs) == 1:
            flat = inputs[0].reshape(-1)
            entry = entries[0]
            if entry is not None and entry.output is not None and entry.output is not inputs[0]:
                entry.output.copy_(inputs[0])
                flat = entry.output.reshape(-1)
        else:
            flat = torch.cat([t.reshape(-1) for t in inputs])
        set_size = len(self.process_sets.members(batch[0].process_set_id))
        divisor = set_size if head.reduce_op == ReduceOp.AVERAGE else 1
        op = ReduceOp.SUM if head.reduce_op == ReduceOp.AVERAGE else head.reduce_op
        work_dtype, work_op = _compute_dtype(flat.dtype, op)
        work = flat
        if work_dtype != flat.dtype or device.type != "cpu":
            work = flat.to(device="cpu", dtype=work_dtype)
        work = _scale(work, head.prescale)
        issued = timeline.now() if timeline is not None else 0
        pending = comm.allreduce_async(work, work_op)

        def complete() -> None:
            done = timeline.now() if timeline is not None else 0
            # On the finisher thread: a single tensor is reduced in its own storage, which
            # may be an inference tensor (as when _allreduce scaled it before the wire).
            with _writing_to_inference(entries):
                result = _postscale(work, divisor, head.postscale)
                if result is not flat:
                    flat.copy_(result)
                _copy_out_pieces(entries, flat, [t.numel() for t in inputs])
            if timeline is not None:
                times = (started, issued, done, timeline.now())
                nbytes = flat.numel() * flat.itemsize
                self._trace_collective(entries, "ALLREDUCE", number, times, nbytes)

        self._finisher.add(pending, complete, [e for e in entries if e is not None])

    def _adasum(self, batch: list[Response], comm: Communicator) -> None:
        """Run one fused Adasum allreduce (see hora.common.adasum) on this thread.

        Adasum is a sequence of exchanges with partners, not one collective; allreduces still
        completing on the finisher use the same communicator, so they finish first.
        """
        self._finisher.drain()
        timeline = self.timeline
        started = timeline.now() if timeline is not None else 0
        entries = [self._take(r.keys[0]) for r in batch]
        head = batch[0].template()
        dtype = _torch_dtype(head.dtype)
        inputs = [
            entry.tensor.reshape(-1)
            if entry is not None and entry.tensor is not None
            else torch.zeros(response.template().num_elements, dtype=dtype)  # joined: zeros
            for response, entry in zip(batch, entries)
        ]
        counts = [t.numel() for t in inputs]
        # Halves are combined in float32 (their products and sums would lose too much).
        work_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        work = torch.cat([t.to(device="cpu", dtype=work_dtype) for t in inputs])
        work = _scale(work, head.prescale)
        issued = timeline.now() if timeline is not None else 0
        adasum.allreduce(work, counts, comm)
        done = timeline.now() if timeline is not None else 0
        work = _scale(work, head.postscale)
        _copy_out_pieces(entries, work.to(device=inputs[0].device, dtype=dtype), counts)
        if timeline is not None:
            times = (started, issued, done, timeline.now())
            nbytes = work.numel() * work.itemsize
            self._trace_collective(entries, "ADASUM", self._batch_number, times, nbytes)

    def _allgather(self, response: Response, comm: Communicator, members: tuple[int, ...]) -> None:
        entry = self._take(response.keys[0])
        if entry is None or entry.tensor is None:
            return
        requests = response.requests[0]
        tensor = entry.tensor
        rows = [requests[r].shape[0] for r in members]
        rest = tuple(tensor.shape[1:])
        row_bytes = math.prod(rest) * tensor.element_size()
        output = torch.empty((sum(rows), *rest), dtype=tensor.dtype)
        source = _as_bytes(tensor.cpu())
        chunks = list(_as_bytes(output).split([n * row_bytes for n in rows]))
        if len(set(rows)) == 1:
            comm.allgather(chunks, source)
        else:
            longest = max(rows) * row_bytes
            padded = torch.zeros(longest, dtype=torch.uint8)
            padded[: source.numel()] = source
            gathered = [torch.empty(longest, dtype=torch.uint8) for _ in members]
            comm.allgather(gathered, padded)
            torch._foreach_copy_(chunks, [g[: c.numel()] for g, c in zip(gathered, chunks)])
        _finish(entry, output.to(tensor.device))

    def _broadcast(self, response: Response, comm: Communicator, members: tuple[int, ...]) -> None:
        entry = self._take(response.keys[0])
        if entry is None or entry.tensor is None:
            return
        output = entry.output if entry.output is not None else entry.tensor
        if output is not entry.tensor:
            output.copy_(entry.tensor)
        host = output if output.device.type == "cpu" else output.cpu()
        comm.broadcast(_as_bytes(host), members.index(response.template().root_rank))
        if host is not output:
            output.copy_(host)
        _finish(entry, output)

    def _alltoall(self, response: Response, comm: Communicator, members: tuple[int, ...]) -> None:
        entry = self._take(response.keys[0])
        if entry is None or entry.tensor is None:
            return
        requests = response.requests[0]
        me = members.index(self.rank)
        tensor = entry.tensor

        def splits_of(rank: int) -> tuple[int, ...]:
            req = requests[rank]
            if req.splits is not None:
                return req.splits
            return tuple([req.shape[0] // len(members)] * len(members))

        send = splits_of(self.rank)
        receive = [splits_of(r)[me] for r in members]
        rest = tuple(tensor.shape[1:])
        row_bytes = math.prod(rest) * tensor.element_size()
        output = torch.empty((sum(receive), *rest), dtype=tensor.dtype)
        source = _as_bytes(tensor.cpu()[: sum(send)])
        comm.alltoall(
            _as_bytes(output),
            source,
            [n * row_bytes for n in receive],
            [n * row_bytes for n in send],
        )
        received = torch.tensor(receive, dtype=torch.int32)
        _finish(entry, (output.to(tensor.device), received))

    def _reducescatter(
        self, response: Response, comm: Communicator, members: tuple[int, ...]
    ) -> None:
        entry = self._take(response.keys[0])
        if entry is None or entry.tensor is None:
            return
        request = response.template()
        tensor = entry.tensor
        count = len(members)
        first = tensor.shape[0]
        rows = [first // count + (1 if i < first % count else 0) for i in range(count)]
        me = members.index(self.rank)
        rest = tuple(tensor.shape[1:])
        op = ReduceOp.SUM if request.reduce_op == ReduceOp.AVERAGE else request.reduce_op
        work_dtype, work_op = _compute_dtype(tensor.dtype, op)
        work = tensor.to(device="cpu", dtype=work_dtype)
        if work is tensor:
            work = tensor.clone()
        work = _scale(work, request.prescale)
        row = math.prod(rest)
        chunks = list(work.reshape(-1).split([n * row for n in rows]))
        output = torch.empty(rows[me] * row, dtype=work_dtype)
        comm.reducescatter(output, chunks, work_op)
        divisor = count if request.reduce_op == ReduceOp.AVERAGE else 1
        output = _postscale(output, divisor, request.postscale)
        result = output.reshape((rows[me], *rest)).to(device=tensor.device, dtype=tensor.dtype)
        _finish(entry, result)

    def _change_process_set(self, response: Response) -> None:
        template = response.template()
        set_id = int(template.name.split(".")[1])
        ranks = template.ranks or ()
        if response.kind == RequestType.ADD_PROCESS_SET:
            self._register_process_set(set_id, ranks)
        else:
            self._finisher.drain()
            self.process_sets.remove(set_id)
            removed = self._communicators.pop(set_id, None)
            if removed is not None:
                removed.close()
        entry = self._take(template.key)
        if entry is not None:
            _finish(entry, set_id)

    def _register_process_set(self, set_id: int, ranks: tuple[int, ...]) -> None:
        self.process_sets.add(set_id, ranks)
        if self.rank in ranks:
            self._communicators[set_id] = self._connect(
                f"ps{set_id}", set_id, ranks.index(self.rank), len(ranks)
            )

    # ----------------------------------------------------------------- endings

    def _finish(self, message: str) -> None:
        """Orderly stop: every pending and future call fails with ``message``."""
        with self._wakeup:
            self._running = False
            pending = list(self._in_flight.values()) + list(self._queue)
            self._in_flight.clear()
            self._queue.clear()
        for entry in pending:
            entry.handle._fail(message)

    def _fail(self, message: str) -> None:
        self._failure = message
        for comm in [self._control, *self._communicators.values()]:
            comm.abort()
        if self.rank == 0 or message:
            logger.error("%s", message)
        self._finish(message)

    def _diagnose(self, error: str) -> str:
        """Turn a transport error into a message that names the lost rank."""
        for comm in [self._control, *self._communicators.values()]:
            comm.abort()
        store = self._store
        others = [r for r in range(self.size) if r != self.rank]
        try:
            store.set_signed(f"g{self._generation}/alive/{self.rank}", b"")
            report_failure(store, f"rank {self.rank}: {error}")
            deadline = time.monotonic() + DIAGNOSE_WINDOW_S
            silent = others
            while True:
                exits = [r for r in others if store.check(exit_key(r))]
                if exits:
                    details = "; ".join(
                        store.get_signed(exit_key(r)).decode(errors="replace") for r in exits
                    )
                    return (
                        f"hora lost {_ranks(exits)}: {details}. Rank {self.rank} cannot continue "
                        f"the collective (transport error: {error})"
                    )
                silent = [r for r in others if not store.check(f"g{self._generation}/alive/{r}")]
                if not silent or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            # Aborted because another rank reported a failure first: its report says why.
            report = read_failure(store) if self._failure_seen() else ""
        except Exception as exc:  # noqa: BLE001 - the store itself may be gone
            return (
                f"rank {self.rank}: a collective failed ({error}) and the job's rendezvous store "
                f"is unreachable ({exc}); the launcher or the host of rank 0 may have exited."
            )
        if silent:
            return (
                f"hora lost {_ranks(silent)}: {'it' if len(silent) == 1 else 'they'} stopped "
                f"responding (the process exited, was killed, or its host is unreachable). "
                f"Rank {self.rank} saw: {error}"
            )
        if report and not report.startswith(f"rank {self.rank}: "):
            return f"rank {self.rank} stopped after a failure on another rank: {report}"
        return f"rank {self.rank}: a collective failed while every rank is still alive: {error}"


def _keys_from_json(data: bytes) -> list[Key]:
    """Keys as ``_record_waits`` writes them; malformed records count as no waits."""
    try:
        items = json.loads(data.decode())
        return [make_key(int(set_id), str(name)) for set_id, name in items]
    except (ValueError, TypeError):
        return []


def _op_label(response: Response) -> str:
    """The operation's name in the timeline: the request kind, or ADASUM (as Horovod names it)."""
    if response.kind == RequestType.ALLREDUCE and response.template().reduce_op == ReduceOp.ADASUM:
        return "ADASUM"
    return response.kind.name


def _writing_to_inference(entries: Sequence[Entry | None]) -> Any:
    """``torch.inference_mode()`` when a destination was made in inference mode (a caller in
    ``torch.inference_mode()``, as PyTorch Lightning's validation), where only it may write."""
    for entry in entries:
        dest = _destination(entry)
        if dest is not None and dest.is_inference():
            return torch.inference_mode()
    return contextlib.nullcontext()


def _copy_out_pieces(entries: Sequence[Entry | None], flat: torch.Tensor, sizes: list[int]) -> None:
    """Copy pieces of a reduced buffer to the entries' destinations and finish them."""
    pairs = [
        (dest.reshape(-1), piece)
        for dest, piece in zip(map(_destination, entries), flat.split(sizes))
        if dest is not None and dest.data_ptr() != piece.data_ptr()
    ]
    if pairs:
        torch._foreach_copy_([d for d, _ in pairs], [p for _, p in pairs])
    for entry in entries:
        if entry is not None:
            _finish(entry, _destination(entry))


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
    destinations = [_destination(entry) for entry in entries]
    results: list[torch.Tensor | None] = list(destinations)
    copies = []
    lent = False
    for index, (entry, dest) in enumerate(zip(entries, destinations)):
        if dest is None:
            continue
        piece = pieces[entry.request.name]
        if entry.lend and dest.is_cpu and dest.dtype == piece.dtype and not dest.is_inference():
            # A view of its own (outside inference mode), so that the buffer's references
            # count whoever keeps it.
            results[index] = piece.detach()
            lent = True
        else:
            copies.append((dest, piece))
    with _writing_to_inference(entries):
        each = (
            factor != 1.0
            and not lent
            and data.dtype not in (torch.float16, torch.bfloat16)
            and data.numel() >= _SCALE_EACH_FROM * max(len(entries), 1)
        )
        if each:
            for dest, piece in copies:
                if dest.device == piece.device and dest.dtype == piece.dtype:
                    torch.mul(piece, factor, out=dest)
                else:
                    dest.copy_(piece.mul(factor))
        else:
            scaled = _scale(data, factor)
            if scaled is not data:
                data.copy_(scaled)
            if copies:
                torch._foreach_copy_([d for d, _ in copies], [p for _, p in copies])
    for entry, result in zip(entries, results):
        _finish(entry, result)
    return lent


# The mean elements per tensor from which tensors are scaled one by one rather than in their
# buffer by one operation (measured: 29 tensors of 2.7k elements on average took half the time
# scaled in the buffer first; 6 of 310k took a fifth more).
_SCALE_EACH_FROM = 1 << 16


def _stage(schedule: steady.Schedule, number: int, name: str, tensor: torch.Tensor) -> None:
    """Copy ``tensor`` into its piece of batch ``number``'s buffer, scaled when the batch's
    tensors are scaled one by one (see ``Schedule.scale_each``)."""
    # detach(), not no_grad(): a gradient needs neither, and the mode switch costs more than
    # the copy of a small tensor.
    source = tensor.detach() if tensor.requires_grad else tensor
    piece = schedule.pieces[name]
    if not schedule.scale_each[number]:
        piece.copy_(source)
    elif source.device == piece.device:
        torch.mul(source, schedule.factors[number], out=piece)
    else:
        piece.copy_(source).mul_(schedule.factors[number])


class _BatchBuffer(NamedTuple):
    """A steady-state batch's buffer and the engine's views of it."""

    buffer: torch.Tensor
    data: torch.Tensor
    codes: torch.Tensor
    pieces: dict[str, torch.Tensor]
    baseline: tuple[int, int]


def _batch_buffer(batch: list[Request], counts: list[int], ranks: int) -> _BatchBuffer:
    """Allocate a batch's buffer: its tensors' data, then one slot per rank for its code."""
    total = sum(counts)
    buffer = torch.empty(total + ranks, dtype=_torch_dtype(batch[0].dtype))
    pieces = {}
    offset = 0
    for request, count in zip(batch, counts):
        # Shaped as the tensor: staging copies it without a reshape.
        pieces[request.name] = buffer[offset : offset + count].view(request.shape)
        offset += count
    data, codes = buffer[:total], buffer[total:]
    return _BatchBuffer(buffer, data, codes, pieces, storage_references(buffer))


def storage_references(tensor: torch.Tensor) -> tuple[int, int]:
    """How many tensors refer to ``tensor``'s memory, and the references to its storage
    object from Python (a caller that kept ``grad.untyped_storage()`` holds no tensor)."""
    storage = tensor.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata), sys.getrefcount(storage)


def _referenced_beyond(tensor: torch.Tensor, baseline: tuple[int, int]) -> bool:
    """Whether ``tensor``'s memory has more references than ``baseline`` (see
    ``storage_references``)."""
    tensors, objects = storage_references(tensor)
    return tensors > baseline[0] or objects > baseline[1]


# The references to the memory of a tensor that nothing else shares.
_SOLE = storage_references(torch.empty(1))


def owns_its_memory(tensor: torch.Tensor) -> bool:
    """Whether no other tensor (a view, or a buffer it is a view of) shares ``tensor``'s
    memory and no storage object of it is held."""
    return not _referenced_beyond(tensor, _SOLE)


def _in_use(batch_buffer: _BatchBuffer) -> bool:
    """Whether anything but the engine's own views still refers to a batch's buffer."""
    return _referenced_beyond(batch_buffer.buffer, batch_buffer.baseline)


def _finish(entry: Entry, result: Any) -> None:
    """Deliver one entry's result (through its ``on_done``) to its handle."""
    if entry.on_done is not None:
        result = entry.on_done(result)
    entry.handle._set(entry.index, result)


def _names(names: Sequence[str]) -> str:
    """Tensor names for a message (the first five)."""
    return ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


_DTYPES = {
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "bool": torch.bool,
}
assert set(_DTYPES) == FLOATING | INTEGER | {"bool"}


def _torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


_DTYPE_NAMES = {value: name for name, value in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str | None:
    """hora's name for a torch dtype, or ``None`` when hora does not support it."""
    return _DTYPE_NAMES.get(dtype)


class _Watcher(threading.Thread):
    """Watches the store for a doorbell while the engine is parked, and for failures always.

    Uses its own store connection: a blocking ``wait`` holds the connection it runs on.
    """

    def __init__(self, engine: Engine, store: StoreClient) -> None:
        super().__init__(name="hora-watcher", daemon=True)
        self._engine = engine
        self._store = store
        self._watching = 0
        self._stop_flag = False
        self._event = threading.Event()
        self.failure: str | None = None

    def watch(self, generation: int) -> None:
        self._watching = generation
        self._event.set()

    def stop(self) -> None:
        self._stop_flag = True
        self._event.set()
        try:
            self._engine._store.set_signed(
                f"g{self._engine._generation}/wake/{self._watching}", b""
            )
        except Exception:  # noqa: BLE001 - best effort at exit
            pass

    def run(self) -> None:
        engine = self._engine
        seen = 0
        try:
            while not self._stop_flag and engine.running:
                target = self._watching
                if target > seen:
                    self._check_failure()
                    if self.failure is not None:
                        return
                    # No timeout: a failure or a shutdown rings this key too.
                    self._store.wait(f"g{engine._generation}/wake/{target}", PARKED_WAIT_S)
                    seen = target
                    engine._wake(target)
                    continue
                self._event.wait(WATCH_INTERVAL_S)
                self._event.clear()
                self._check_failure()
        except Exception as exc:  # noqa: BLE001 - store gone: let the engine find out
            if engine.running and not self._stop_flag:
                self.failure = f"the job's rendezvous store became unreachable: {exc}"
                self._abort()

    def _check_failure(self) -> None:
        if self.failure is None and self._store.check(FAILURE_KEY):
            self.failure = "another rank or the launcher reported a failure"
            self._abort()

    def _abort(self) -> None:
        engine = self._engine
        for comm in [engine._control, *engine._communicators.values()]:
            comm.abort()
        engine._wake(engine._parked_generation)


class _Finisher(threading.Thread):
    """Completes started allreduces in the order they were started.

    Completing means scaling the result and copying it out of the fusion buffer into the
    callers' tensors, then finishing their handles; it runs here so that the engine thread can
    negotiate and start the next collectives meanwhile.
    """

    def __init__(self, engine: Engine) -> None:
        super().__init__(name="hora-finisher", daemon=True)
        self._engine = engine
        self._cv = threading.Condition()
        self._items: deque[tuple[Pending, Callable[[], None], list[Entry]]] = deque()
        self._stopping = False

    def add(self, pending: Pending, complete: Callable[[], None], entries: list[Entry]) -> None:
        with self._cv:
            while len(self._items) >= MAX_STARTED and self._engine.failure is None:
                self._cv.wait(timeout=WATCH_INTERVAL_S)
            self._items.append((pending, complete, entries))
            self._cv.notify_all()

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
        engine = self._engine
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
                engine._transport_failed(str(exc))
                error = engine.failure or str(exc)
            except Exception as exc:  # noqa: BLE001 - every failure must reach the user's handles
                logger.exception("hora could not complete an allreduce on rank %d", engine.rank)
                error = f"rank {engine.rank}: completing an allreduce failed: {exc!r}"
            if error is not None:
                for entry in entries:
                    entry.handle._fail(error)
            with self._cv:
                self._items.popleft()
                self._cv.notify_all()
