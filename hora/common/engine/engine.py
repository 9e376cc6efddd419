"""The engine: one background thread per process that negotiates, fuses and runs collectives.

User threads hand entries to the :class:`~hora.common.engine.intake.Intake` and wait on their
handles. The engine thread runs cycles (cycle.py): wait for a turn, exchange, integrate,
execute. When nothing has happened for a few cycles on any rank, every rank parks at the same
cycle and stops using CPU; the first rank that gets new work rings a doorbell in the store and
all resume (parking.py). Once the agreed allreduces repeat, the steady state's
:class:`~hora.common.engine.steady.replay.Replay` runs them without negotiation. A peer that
dies turns into :class:`HoraInternalError` on every survivor, naming the lost rank
(failures.py).

This module builds those parts, starts and stops the engine's threads, ends the job on a
failure, and is the API the framework layer uses. It does not know what a cycle exchanges,
which communicator a batch runs on (communicators.py), or how executors move bytes. The engine
sees requests and flat buffers, never modules or optimizers.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Protocol

from hora.common.engine.autotune import Autotuner
from hora.common.engine.communicators import Communicators
from hora.common.engine.context import EngineContext, NegotiationState
from hora.common.engine.counters import Counters
from hora.common.engine.cycle import Cycle
from hora.common.engine.failures import Watcher, diagnose
from hora.common.engine.finisher import Finisher
from hora.common.engine.handles import Entry, Handle
from hora.common.engine.intake import Intake
from hora.common.engine.negotiation import MessageTable
from hora.common.engine.parking import Parking
from hora.common.engine.stall import StallInspector
from hora.common.engine.steady import BatchLayout, Schedule
from hora.common.engine.steady.replay import Replay
from hora.common.engine.tracing import Tracer, nvtx_ranges
from hora.common.job.store import StoreClient
from hora.common.job.store_keys import CAUSE, GenerationKeys
from hora.common.job.topology import Topology
from hora.common.process_sets import ProcessSetTable
from hora.common.transport import (
    CallerLane,
    CommunicatorFactory,
    DeviceCommunicatorFactory,
    TransportError,
)
from hora.common.vocabulary.config import Settings
from hora.common.vocabulary.message import Request, RequestType
from hora.common.vocabulary.timeline_writer import Timeline

logger = logging.getLogger("hora")


class SignedAhead(Protocol):
    """An asynchronous call signed ahead on a lane, whose decision is taken later."""

    def force(self, ending: bool) -> None:
        """Settle it now: before another call, ``engine`` unless decided; when the session
        ends (``ending``), inline where every member signed it. Called by a thread that holds
        no lane's lock."""

    def flush(self) -> None:
        """Settle it if a decision was taken, without blocking (the engine's thread, between
        cycles: a call the lane left to the engine must reach it while its peers wait)."""


class Engine:
    """The background runtime of one process.

    The framework layer uses this API and nothing else: :meth:`handle` and :meth:`enqueue`
    submit a call (the handle tells the engine when a thread waits for or polls it);
    :meth:`register_process_set` changes the sets; :attr:`batch_layout` says which names the
    steady state reduces together (a hint: the engine handles whatever arrives); results lent
    from the steady state's buffers follow the rule of
    :func:`hora.common.engine.buffers.owns_its_memory`.

    Args:
        topology: this process's place in the job.
        settings: engine settings.
        store: a connection to the job's store (an in-process one for a job of one).
        communicator_factory: builds a communicator for ``(scope, rank_in_set, set_size)``.
        device_communicator_factory: builds a communicator whose buffers live on a GPU for
            ``(scope, rank_in_set, set_size, device)`` (NCCL), or returns ``None`` when the set
            cannot have one (its members share a GPU); ``None`` itself: CUDA tensors go
            through host memory on the set's communicator.
        generation: how many times ``init`` ran before in this process (keeps scopes distinct).
        process_sets: member lists of the sets registered at ``init`` (ids 1, 2, ...).
    """

    def __init__(
        self,
        topology: Topology,
        settings: Settings,
        store: StoreClient,
        communicator_factory: CommunicatorFactory,
        generation: int = 0,
        process_sets: list[tuple[int, ...]] | None = None,
        device_communicator_factory: DeviceCommunicatorFactory | None = None,
    ) -> None:
        self.topology = topology
        self.settings = settings
        # Handles this engine numbered (the collectives it was handed, for elastic's warning).
        self._handle_numbers = itertools.count(1)
        self.handles_made = 0
        # Serialises releasing a handle's waiters (the finisher may deliver a result while the
        # engine fails the job): one lock for all this engine's handles.
        self._opening = threading.Lock()
        self.rank = topology.rank
        self.size = topology.size
        self._store = store
        self._keys = GenerationKeys(generation)
        self.process_sets = ProcessSetTable(topology.size)
        # Rank 0's watch over tensors that some ranks submitted and others did not.
        stall = StallInspector(
            settings.stall_check_time_s,
            settings.stall_shutdown_time_s,
            settings.stall_check_enabled and self.rank == 0,
        )
        self.intake = Intake()
        self.tracer = Tracer(nvtx_ranges() if settings.enable_nvtx else None)
        # What the engine did, for live metrics (hora.common.metrics reads it at step ends).
        self.counters = Counters()
        # A call signed ahead on a lane and not settled yet (hora.common.ops.direct): at most
        # one per process, settled before any other call and at shutdown.
        self.signed_ahead: SignedAhead | None = None
        # Whether this process's asynchronous calls are signed ahead: it waited for its last
        # call before making another (set when it waits; see hora.common.ops.direct). A process
        # that starts many before it waits for any gets them batched by the engine instead.
        self.signs_ahead = False
        # The handle made while the process held no other (0: the last one was not).
        self.lone_handle = 0
        self._thread: threading.Thread | None = None
        self._watcher: Watcher | None = None
        self._finisher = Finisher(
            self.rank, lambda: self.intake.failure, self._transport_failed, self.intake.notify
        )
        self._fail_lock = threading.Lock()
        # Each process set's communicators (made when a set is registered or first used).
        self._communicators = Communicators(
            topology,
            self._keys,
            self.process_sets,
            communicator_factory,
            device_communicator_factory,
        )
        context = EngineContext(
            settings=settings,
            rank=self.rank,
            size=self.size,
            store=store,
            keys=self._keys,
            intake=self.intake,
            tracer=self.tracer,
            counters=self.counters,
            communicators=self._communicators,
            finisher=self._finisher,
            failure_seen=self._failure_seen,
        )
        negotiation = NegotiationState(MessageTable(self.process_sets), self.process_sets, stall)
        self._parking = Parking(context, negotiation, self._watch)
        self.replay = Replay(context)
        self._cycle = Cycle(context, negotiation, self.replay, self._parking)
        for ranks in process_sets or []:
            set_id = self.process_sets.reserve_id()
            self._communicators.register(set_id, ranks)

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self.intake.start()
        if self.size > 1:
            self._watcher = Watcher(
                self._store.reconnect(),
                self._store,
                self._keys,
                lambda: self.intake.running,
                self.intake.ring,
                self._abort_on_failure,
            )
            self._watcher.start()
        self._finisher.start()
        self._thread = threading.Thread(target=self._loop, name="hora-engine", daemon=True)
        self._thread.start()

    def shutdown(self, reason: str | None = None) -> None:
        """Stop this rank's engine and, through negotiation, every other rank's."""
        self.settle_ahead(ending=True)
        self.intake.request_shutdown(
            reason or f"rank {self.rank} called hvd.shutdown()", orderly=True
        )
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.settings.gloo_timeout_s + 10)
        if self._finisher.ident is not None and self._finisher is not threading.current_thread():
            self._finisher.join(timeout=self.settings.gloo_timeout_s + 10)
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher.join(timeout=10.0)
        finished = (self._thread is None or not self._thread.is_alive()) and not (
            self._finisher.is_alive()
        )
        if self.replay.autotuner is not None and self.intake.failure is None:
            self.replay.autotuner.end()
        for comm in self._communicators.all():
            # Tear groups down here rather than leave it to interpreter exit.
            if self.intake.failure is not None or not finished:
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
                self._store.key(CAUSE), "", self._store.signed(CAUSE, text.encode())
            )
        except Exception:  # best effort while exiting
            pass

    @property
    def failure(self) -> str | None:
        return self.intake.failure

    @property
    def running(self) -> bool:
        return self.intake.running

    @property
    def ended_orderly(self) -> bool:
        """Whether the engine ended because a rank called ``hvd.shutdown()`` or exited."""
        return self.intake.ended_orderly

    @property
    def timeline(self) -> Timeline | None:
        """The timeline being written, if any (set by ``hora.common.basics``)."""
        return self.tracer.timeline

    @timeline.setter
    def timeline(self, timeline: Timeline | None) -> None:
        self.tracer.timeline = timeline

    @property
    def schedule(self) -> Schedule | None:
        """The steady-state schedule being replayed, if any (for tests and tools)."""
        return self.replay.schedule

    @property
    def batch_layout(self) -> BatchLayout | None:
        """Which names the steady state reduces together, batch by batch; ``None`` while
        negotiating.

        Read without the engine's lock: a caller may use it only as a hint (``
        DistributedOptimizer`` submits a batch's gradients at once); the engine handles whatever
        is submitted, whenever, against its current schedule. A new schedule comes with a new
        layout object.
        """
        schedule = self.replay.schedule
        return schedule.layout if schedule is not None else None

    @property
    def steady_stats(self) -> dict[str, int]:
        """How often the steady state was entered and left, and what it ran (see Replay)."""
        return self.replay.stats

    @property
    def carried(self) -> int:
        """How many allreduces were reduced from bytes carried in the exchange (see carry.py)."""
        return self._cycle.carrier.reduced

    @property
    def autotuner(self) -> Autotuner | None:
        return self.replay.autotuner

    def data_path(self, set_id: int = 0) -> str:
        """The data path of process set ``set_id``'s CPU collectives (``shm``, ``gloo``,
        ``hierarchical``, ``mpi``), and of negotiation (``control``)."""
        if set_id < 0:
            return self._communicators.control.path
        return self._communicators.of_set(set_id).path

    def gpu_data_path(self, set_id: int = 0) -> str:
        """Where process set ``set_id``'s CUDA tensors went: ``nccl`` once the set's NCCL
        group is made, else ``host`` (through host memory and the set's CPU path)."""
        return "nccl" if set_id in self._communicators.device else "host"

    # ----------------------------------------------------------------- user threads

    def handle(self, count: int, kind: RequestType, grouped: bool = False) -> Handle:
        """A handle for a call of ``count`` tensors, whose waits this engine observes.

        Handles are numbered from 1 by each engine, so the numbers of a new session (after
        ``shutdown`` and ``init``, or an elastic round) start again on every rank alike.
        """
        number = next(self._handle_numbers)  # atomic, whichever thread calls
        self.handles_made = number
        return Handle(number, count, kind, grouped, self.intake, self._opening)

    def lane(self, set_id: int) -> CallerLane | None:
        """The lane of a process set whose members all share this host: the path of the calls
        its callers run on their own threads (:mod:`hora.common.ops.fast_path`)."""
        return self._communicators.lane(set_id)

    def lanes(self) -> list[CallerLane]:
        """The lanes of every set this rank is a member of."""
        return self._communicators.lanes()

    def caller_failed(self, error: str) -> str:
        """A collective a caller ran on its own thread failed (a lost peer, a timeout): the job
        fails as when one of the engine's collectives fails; returns the message."""
        return self._transport_failed(error)

    def enqueue(self, entries: list[Entry], posted: bool = False) -> None:
        """Queue entries atomically (a grouped call's entries reach negotiation together).
        The call takes its number on its set's lane first, unless it was ``posted`` there
        already (:mod:`hora.common.ops.fast_path`).

        Raises:
            HoraValueError: a name is already in flight on this rank in its process set.
            HoraInternalError: the engine has stopped.
        """
        self.settle_ahead()
        if not posted and entries:
            lane = self._communicators.lane(entries[0].request.process_set_id)
            if lane is not None:
                with lane.lock:
                    lane.post()
        self.intake.submit(entries, self.tracer.now(), self.replay.admit)

    def settle_ahead(self, ending: bool = False) -> None:
        """Settle this process's call signed ahead, if any, before it makes another call or
        as the session ends (the caller holds no lane's lock)."""
        ahead = self.signed_ahead
        if ahead is not None:
            ahead.force(ending)

    def register_process_set(self, ranks: tuple[int, ...], remove: bool = False) -> Handle:
        """Negotiate adding (or removing) a process set; the handle's result is its id."""
        if remove:
            set_id = self.process_sets.find(ranks)
            if set_id is None:
                raise ValueError(f"no registered process set has ranks {list(ranks)}")
            name = f"process_set.{set_id}.remove"
            kind = RequestType.REMOVE_PROCESS_SET
        else:
            # The id is taken when every rank agreed (see Cycle._change_process_set), so that a
            # change refused on some ranks leaves no rank's numbering behind the others'.
            name = "process_set.add." + ",".join(str(r) for r in ranks)
            kind = RequestType.ADD_PROCESS_SET
        handle = self.handle(1, kind)
        request = Request(name=name, kind=kind, dtype="uint8", ranks=ranks)
        self.enqueue([Entry(request, None, None, handle)])
        return handle

    # ----------------------------------------------------------------- engine thread

    def _loop(self) -> None:
        try:
            while self._cycle.run():
                ahead = self.signed_ahead
                if ahead is not None:
                    ahead.flush()
        except TransportError as exc:
            self.intake.hand_back_taken()
            self._transport_failed(str(exc))
        except Exception as exc:  # every failure must reach the user's handles
            self.intake.hand_back_taken()
            logger.exception("hora engine on rank %d stopped", self.rank)
            with self._fail_lock:
                if self.intake.failure is None:
                    self._fail(f"rank {self.rank}: the hora engine stopped: {exc!r}")
        finally:
            self.intake.stop()
            self._finisher.stop()

    def _watch(self, round_: int) -> None:
        """Have the watcher wait on the doorbell of parking round ``round_``."""
        assert self._watcher is not None
        self._watcher.watch(round_)

    def _failure_seen(self) -> bool:
        return self._watcher is not None and self._watcher.failure is not None

    # ----------------------------------------------------------------- endings

    def _abort_on_failure(self) -> None:
        """The watcher saw the job fail: unblock every collective, wake a parked engine."""
        self._communicators.abort()
        self._parking.wake()

    def _transport_failed(self, error: str) -> str:
        """A collective failed on this rank's engine or finisher thread: diagnose it once;
        returns the message every pending call fails with."""
        with self._fail_lock:
            if self.intake.failure is None:
                self._communicators.abort()
                self._fail(
                    diagnose(
                        self._store, self._keys, self.rank, self.size, error, self._failure_seen()
                    )
                )
            return self.intake.failure or error

    def _fail(self, message: str) -> None:
        self.intake.fail(message)
        self._communicators.abort()
        if self.rank == 0 or message:
            logger.error("%s", message)
        self.intake.end(message)
