"""The engine: one background thread per process that negotiates, fuses and runs collectives.

User threads hand entries to the :class:`~hora.common.engine.intake.Intake` and wait on their
handles. The engine thread runs cycles; one cycle is::

    exchange     every rank contributes its new requests (or response-cache bits)
    negotiate    every rank derives the same ordered list of agreed responses
    execute      fused batches run on the transport, in that order (executors.py)

When nothing has happened for a few cycles on any rank, every rank parks at the same cycle and
stops using CPU; the first rank that gets new work rings a doorbell in the store and all resume.
Once the agreed allreduces repeat, the steady state's :class:`~hora.common.engine.replay.Replay`
runs them without negotiation. A peer that dies turns into :class:`HoraInternalError` on every
survivor, naming the lost rank (failures.py). The engine sees requests and flat buffers, never
modules or optimizers.
"""

from __future__ import annotations

import logging
import math
import struct
import threading
import time
from collections.abc import Callable

import torch

from hora.common.config import Settings
from hora.common.engine import carry, fusion, steady
from hora.common.engine.autotune import Autotuner
from hora.common.engine.buffers import copy_out_pieces, local_gpu, writing_to_inference
from hora.common.engine.counters import Counters
from hora.common.engine.executors import Run, executor_for
from hora.common.engine.failures import DeadlockCheck, Watcher, diagnose
from hora.common.engine.finisher import Finisher
from hora.common.engine.handles import Entry, Handle, fail, finish
from hora.common.engine.intake import Intake
from hora.common.engine.negotiation import InlineSlot, MessageTable, ResponseCache
from hora.common.engine.replay import Replay
from hora.common.engine.stall import StallInspector
from hora.common.engine.timing import (
    HOLD_WHILE_IN_FLIGHT_S,
    PARK_AFTER_IDLE_S,
    WAIT_RECORD_AFTER_S,
    WATCH_INTERVAL_S,
)
from hora.common.engine.tracing import Tracer, nvtx_ranges
from hora.common.errors import HoraInternalError, shut_down_message
from hora.common.job.store import StoreClient
from hora.common.job.store_keys import CAUSE, PARKED, GenerationKeys
from hora.common.job.topology import Topology
from hora.common.message import CycleMessage, Key, Request, RequestType, Response
from hora.common.process_sets import ProcessSetTable
from hora.common.timeline_writer import Timeline
from hora.common.transport import Communicator, TransportError, allgather_bytes

logger = logging.getLogger("hora")


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
        communicator_factory: Callable[[str, int, int], Communicator],
        generation: int = 0,
        process_sets: list[tuple[int, ...]] | None = None,
        device_communicator_factory: Callable[[str, int, int, torch.device], Communicator | None]
        | None = None,
    ) -> None:
        self.topology = topology
        self.settings = settings
        self.rank = topology.rank
        self.size = topology.size
        self._store = store
        self._keys = GenerationKeys(generation)
        self._make_communicator = communicator_factory
        self.process_sets = ProcessSetTable(topology.size)
        self._communicators: dict[int, Communicator] = {}
        # GPU data paths: per process set, made the first time the set moves CUDA tensors.
        self._make_device_communicator = device_communicator_factory
        self._device_communicators: dict[int, Communicator] = {}
        # Sets whose CUDA tensors go through host memory after all (members share a GPU).
        self._host_only: set[int] = set()
        self._gpu: torch.device | None = None
        self._cache = ResponseCache(settings.cache_capacity)
        self._table = MessageTable(self.process_sets)
        self._inline = InlineSlot()
        self._carrier = carry.Carrier(settings.carry_threshold_bytes if topology.size > 1 else 0)
        self._stall = StallInspector(
            settings.stall_check_time_s,
            settings.stall_shutdown_time_s,
            settings.stall_check_enabled and topology.rank == 0,
        )
        self.intake = Intake()
        self.tracer = Tracer(nvtx_ranges() if settings.enable_nvtx else None)
        # What the engine did, for live metrics (hora.common.metrics reads it at step ends).
        self.counters = Counters()
        # When the last cycle ended with requests still waiting for other ranks (0: it did not).
        self._waiting_since = 0.0
        self._thread: threading.Thread | None = None
        self._watcher: Watcher | None = None
        self._finisher = Finisher(
            self.rank, lambda: self.intake.failure, self._transport_failed, self.intake.notify
        )
        self._fail_lock = threading.Lock()
        self._parked_round = 0
        self._woken_round = 0
        self._idle_cycles = 0
        self._park_after = max(
            2, math.ceil(PARK_AFTER_IDLE_S * 1000 / max(settings.cycle_time_ms, 0.1))
        )
        self._last_cycle_end = 0.0
        self._deadlocks = DeadlockCheck(
            store, self._keys, self.rank, self.size, self._stall, settings.gloo_timeout_s
        )
        self._control = self._connect("control", 0, self.rank, self.size)
        self._communicators[0] = self._connect("ps0", 0, self.rank, self.size)
        self.replay = Replay(
            self.intake,
            settings,
            self.rank,
            self.size,
            lambda device: self._data_communicator(0, device, None),
            self._control,
            store,
            self._keys,
            self.tracer,
            self._failure_seen,
            self.counters,
        )
        for ranks in process_sets or []:
            set_id = self.process_sets.reserve_id()
            self._register_process_set(set_id, ranks)

    # ----------------------------------------------------------------- lifecycle

    def _connect(self, scope: str, set_id: int, rank: int, size: int) -> Communicator:
        try:
            return self._make_communicator(self._keys.scope(scope), rank, size)
        except TransportError as exc:
            raise HoraInternalError(
                f"rank {self.rank}: could not connect to the other ranks of process set {set_id} "
                f"({exc}). Check that every rank called hvd.init() and that the hosts can reach "
                "each other (HORA_GLOO_IFACE selects the network interface). Gloo accepts any "
                "connection to the workers' ports, so other processes connecting to them cause "
                "this too: keep the job's network private (docs/security.md)."
            ) from exc

    def start(self) -> None:
        self.intake.running = True
        if self.size > 1:
            self._watcher = Watcher(
                self._store.reconnect(),
                self._store,
                self._keys,
                lambda: self.intake.running,
                self._wake,
                self._abort_on_failure,
            )
            self._watcher.start()
        self._finisher.start()
        self._thread = threading.Thread(target=self._loop, name="hora-engine", daemon=True)
        self._thread.start()

    def shutdown(self, reason: str | None = None) -> None:
        """Stop this rank's engine and, through negotiation, every other rank's."""
        intake = self.intake
        with intake.wakeup:
            if intake.shutdown_reason is None:
                intake.shutdown_reason = reason or f"rank {self.rank} called hvd.shutdown()"
            intake.wakeup.notify_all()
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
        for comm in self._all_communicators():
            # Tear groups down here rather than leave it to interpreter exit.
            if intake.failure is not None or not finished:
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
        except Exception:  # noqa: BLE001 - best effort while exiting
            pass

    @property
    def failure(self) -> str | None:
        return self.intake.failure

    @property
    def running(self) -> bool:
        return self.intake.running

    @property
    def timeline(self) -> Timeline | None:
        """The timeline being written, if any (set by ``hora.common.basics``)."""
        return self.tracer.timeline

    @timeline.setter
    def timeline(self, timeline: Timeline | None) -> None:
        self.tracer.timeline = timeline

    @property
    def schedule(self) -> steady.Schedule | None:
        """The steady-state schedule being replayed, if any (for tests and tools)."""
        return self.replay.schedule

    @property
    def batch_layout(self) -> steady.BatchLayout | None:
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
        return self._carrier.reduced

    @property
    def autotuner(self) -> Autotuner | None:
        return self.replay.autotuner

    # ----------------------------------------------------------------- user threads

    def handle(self, count: int, kind: RequestType, grouped: bool = False) -> Handle:
        """A handle for a call of ``count`` tensors, whose waits this engine observes."""
        return Handle(count, kind, grouped, self.intake)

    def enqueue(self, entries: list[Entry]) -> None:
        """Queue entries atomically (a grouped call's entries reach negotiation together).

        Raises:
            HoraValueError: a name is already in flight on this rank in its process set.
            HoraInternalError: the engine has stopped.
        """
        self.intake.submit(entries, self.tracer.now(), self.replay.admit)

    def register_process_set(self, ranks: tuple[int, ...], remove: bool = False) -> Handle:
        """Negotiate adding (or removing) a process set; the handle's result is its id."""
        if remove:
            set_id = self.process_sets.find(ranks)
            if set_id is None:
                raise ValueError(f"no registered process set has ranks {list(ranks)}")
            name = f"process_set.{set_id}.remove"
            kind = RequestType.REMOVE_PROCESS_SET
        else:
            # The id is taken when every rank agreed (see _change_process_set), so that a
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
            while self._cycle():
                pass
        except TransportError as exc:
            self.intake.hand_back(self.intake.taken)
            self._transport_failed(str(exc))
        except Exception as exc:  # noqa: BLE001 - every failure must reach the user's handles
            self.intake.hand_back(self.intake.taken)
            logger.exception("hora engine on rank %d stopped", self.rank)
            with self._fail_lock:
                if self.intake.failure is None:
                    self._fail(f"rank {self.rank}: the hora engine stopped: {exc!r}")
        finally:
            self.intake.running = False
            self._finisher.stop()

    def _cycle(self) -> bool:
        # Entries this cycle takes out of the in-flight table; should the cycle raise, their
        # handles fail with the engine rather than wait forever (see _loop).
        self.intake.taken = []
        if self.replay.active:
            # Results are written into the caller's tensors outside autograd, as in _execute.
            with torch.no_grad():
                self.replay.cycle()
            if not self.replay.active:
                self._last_cycle_end = 0.0  # back to negotiation: at once
            return True
        self._wait_for_turn()
        if self.tracer.timeline is not None and self.tracer.timeline.mark_cycles:
            self.tracer.mark("CYCLE_START")
        exchanged = self.counters.now()
        self.tracer.open("NEGOTIATE")
        contributions, carried = self._exchange(self.intake.drain())
        shutdown_reason = self._integrate(contributions)
        responses = self._table.ready(self._cache)
        self.tracer.close()
        agreed = self.counters.now()
        waiting_since = self._waiting_since
        self.counters.negotiated(
            agreed - exchanged, agreed - waiting_since if waiting_since else 0.0
        )
        self.tracer.agreed_at = self.tracer.now()
        had_news = any(reqs for reqs, _ in contributions) or bool(responses)
        self._idle_cycles = 0 if had_news else self._idle_cycles + 1
        self._execute(responses, carried)
        self._carrier.keep_only(self._table.pending)
        self._last_cycle_end = time.monotonic()
        self._waiting_since = self.counters.now() if self._table else 0.0
        if shutdown_reason is not None:
            # Collectives started before the shutdown was agreed still deliver their results.
            self._finisher.drain()
            self.intake.end(shut_down_message(shutdown_reason))
            return False
        self._check_stall()
        self.replay.maybe_enter(self._table)
        return True

    def _stall_reason(self) -> str | None:
        """The stall inspector's shutdown reason, when a check is due and finds one."""
        return self._stall.check(self._table) if self._stall.due() and self._table else None

    def _check_stall(self) -> None:
        reason = self._stall_reason()
        if reason is not None:
            with self.intake.wakeup:
                self.intake.shutdown_reason = self.intake.shutdown_reason or reason

    def _wait_for_turn(self) -> None:
        """Start the next cycle when local work arrives or a cycle time has passed.

        Starting at once on local work keeps a lone synchronous op's latency near the
        transport's; requests that arrive while a cycle runs are batched into the next one.
        """
        if self.size > 1 and self._idle_cycles >= self._park_after:
            self._park()
            return
        if self.size == 1:
            if self.tracer.timeline is not None and not self.intake.queue:
                self.tracer.timeline.flush()  # a job of one waits for work without parking
            self.intake.wait_for_work(None)
            return
        # Counted from the end of the last cycle: after a long cycle, the user thread gets a
        # cycle time to submit its next request before an idle exchange goes out without it.
        cycle_s = self.settings.cycle_time_ms / 1000
        deadline = self._last_cycle_end + cycle_s
        if self._finisher.busy:
            # Collectives this rank started are on the wire, and nothing new is here: join the
            # next exchange when they land or work arrives (within HOLD_WHILE_IN_FLIGHT_S),
            # rather than every cycle time. Idle exchanges meanwhile take cores and the
            # transport's attention from the data (over MPI, both threads poll the library).
            # Every member of those collectives started them, so they land without an exchange.
            hold = self._last_cycle_end + HOLD_WHILE_IN_FLIGHT_S
            self.intake.wait_for_work(max(deadline, hold), lambda: not self._finisher.busy)
            if not self._finisher.busy:
                # They landed: the callers that waited for them get a cycle time to submit
                # their next requests before an idle exchange goes out without them.
                self.intake.wait_for_work(time.monotonic() + cycle_s)
            return
        self.intake.wait_for_work(deadline)

    def _park(self) -> None:
        """Sleep until this rank has work, another rank rings, or a check is due."""
        round_ = self._parked_round = self._parked_round + 1
        wake_key = self._keys.wake(round_)
        if self.tracer.timeline is not None:
            # Idle: what happened so far reaches the file now, for anyone reading it meanwhile.
            self.tracer.timeline.flush()
        if self.rank == 0:
            if round_ > 1:
                self._store.delete(self._keys.wake(round_ - 1))
            # Whoever reports a failure rings the doorbell named here, to wake parked ranks.
            self._store.set_signed(PARKED, wake_key.encode())
        assert self._watcher is not None
        self._watcher.watch(round_)
        ring = False
        intake = self.intake
        with intake.wakeup:
            while True:
                if self._failure_seen():
                    break
                if intake.queue or intake.shutdown_reason is not None:
                    ring = True
                    break
                if self._woken_round >= round_:
                    break
                intake.wakeup.wait(timeout=WATCH_INTERVAL_S)
                stalled = self._stall_reason()
                # Every rank parks when nobody has anything new: that is where a deadlock
                # shows. The store calls run without the lock, which user threads need.
                intake.wakeup.release()
                try:
                    awaited = intake.awaited(WAIT_RECORD_AFTER_S)
                    self._deadlocks.record(awaited)
                    deadlock = self._deadlocks.check(self._table, awaited)
                finally:
                    intake.wakeup.acquire()
                intake.shutdown_reason = intake.shutdown_reason or stalled or deadlock
        if ring:
            self._store.mark(wake_key)
        self._idle_cycles = 0
        # Whoever rang has work: go at once.
        self._last_cycle_end = 0.0

    def _failure_seen(self) -> bool:
        return self._watcher is not None and self._watcher.failure is not None

    def _wake(self, round_: int) -> None:
        with self.intake.wakeup:
            self._woken_round = max(self._woken_round, round_)
            self.intake.wakeup.notify_all()

    # ----------------------------------------------------------------- negotiation

    def _exchange(
        self, new: list[Entry]
    ) -> tuple[list[tuple[tuple[Request, ...], str | None]], list[dict[Key, bytes]]]:
        """Every rank's new requests this cycle, and the small allreduces' bytes it carried
        (see carry.py), in rank order.

        The header every rank contributes: its payload's length, the bytes its carried
        allreduces wanted, the response-cache bitmap, the request slot, the carried slot.
        """
        self._carrier.add(new)
        bits: list[int] = []
        full: list[Request] = []
        for entry in new:
            bit = self._cache.bit_for(entry.request, self.rank)
            if bit is None:
                full.append(entry.request)
            else:
                bits.append(bit)
        message = CycleMessage(tuple(full), tuple(bits), self.intake.shutdown_reason)
        if self.size == 1:
            return [(tuple(entry.request for entry in new), message.shutdown)], [{}]
        payload = message.encode_payload()
        bitmap = 0
        for bit in bits:
            bitmap |= 1 << bit
        nbytes = (max(self._cache.capacity, 1) + 7) // 8
        slot = self._inline.size
        inline = payload[:slot]
        carried, wanted = self._carrier.section()
        header = (
            struct.pack("<qq", len(payload), wanted)
            + bitmap.to_bytes(nbytes, "little")
            + inline
            + bytes(slot - len(inline))
            + carried
        )
        headers = self._allgather_bytes(header)
        lengths = [struct.unpack_from("<q", h)[0] for h in headers]
        start = 16 + nbytes
        sections: list[dict[Key, bytes]] = [{}] * self.size
        if carried:
            sections = [self._carried(rank, h[start + slot :]) for rank, h in enumerate(headers)]
        self._carrier.slot.after(max(struct.unpack_from("<q", h, 8)[0] for h in headers))
        payloads = [h[start : start + min(n, slot)] for h, n in zip(headers, lengths)]
        longest = max(lengths)
        if longest > slot:
            # What did not fit in the slot, from every rank (padded to the longest remainder).
            rest = payload[slot:]
            padded = self._allgather_bytes(rest + bytes(longest - slot - len(rest)))
            payloads = [p + r[: max(0, n - slot)] for p, r, n in zip(payloads, padded, lengths)]
        self._inline.after(longest)
        contributions = [
            self._contribution(rank, headers[rank][16:start], payloads[rank])
            for rank in range(self.size)
        ]
        return contributions, sections

    @staticmethod
    def _carried(rank: int, section: bytes) -> dict[Key, bytes]:
        try:
            return carry.parse(section)
        except ValueError as exc:
            raise HoraInternalError(f"rank {rank} sent malformed carried tensors: {exc}") from exc

    def _contribution(
        self, rank: int, bitmap: bytes, payload: bytes
    ) -> tuple[tuple[Request, ...], str | None]:
        """One rank's requests (its cache bits expanded, then its full requests) and shutdown
        reason."""
        received = int.from_bytes(bitmap, "little")
        expanded: list[Request] = []
        while received:
            low = received & -received
            expanded.append(self._cache.expand(low.bit_length() - 1, rank))
            received ^= low
        try:
            requests, shutdown = CycleMessage.decode_payload(payload)
        except ValueError as exc:
            raise HoraInternalError(f"rank {rank} sent a malformed message: {exc}") from exc
        return tuple(expanded) + requests, shutdown

    def _allgather_bytes(self, data: bytes) -> list[bytes]:
        return allgather_bytes(self._control, data)

    def _integrate(self, contributions: list[tuple[tuple[Request, ...], str | None]]) -> str | None:
        reason: str | None = None
        for rank, (requests, shutdown) in enumerate(contributions):
            for request in requests:
                self._table.add(rank, request)
            if shutdown is not None and reason is None:
                reason = shutdown
        return reason

    # ----------------------------------------------------------------- execution

    def _execute(self, responses: list[Response], carried: list[dict[Key, bytes]]) -> None:
        """Run the agreed responses: those whose bytes every member carried in this cycle's
        exchange are reduced here; the others run as fused batches, in order, each by its
        executor."""
        self.replay.record(responses)
        if any(carried):
            with torch.no_grad():
                responses = [r for r in responses if not self._reduce_carried(r, carried)]
        plan = fusion.plan(
            responses, self.settings.fusion_threshold_bytes, self.settings.disable_group_fusion
        )
        # Results are written into the caller's tensors (parameters among them) outside autograd.
        with torch.no_grad():
            for batch in plan:
                self._execute_batch(batch)

    def _execute_batch(self, batch: list[Response]) -> None:
        head = batch[0]
        number = self.tracer.next_batch()
        tracer = self.tracer
        if (
            head.kind in (RequestType.ADD_PROCESS_SET, RequestType.REMOVE_PROCESS_SET)
            and head.error is None
        ):
            if tracer.timeline is not None:
                tracer.negotiated(batch, self.intake.get(head.keys))
            self._change_process_set(head)
            return
        entries = self.intake.take([key for response in batch for key in response.keys])
        start = tracer.negotiated(batch, entries) if tracer.timeline is not None else 0
        if head.error is not None:
            fail([e for e in entries if e is not None], head.error)
            return
        members = self.process_sets.members(head.process_set_id)
        if self.rank not in members:
            return
        executor = executor_for(head)
        hint = next(
            (e.tensor.device for e in entries if e is not None and e.tensor is not None), None
        )
        run = Run(
            batch,
            entries,
            self._data_communicator(head.process_set_id, head.template().device, hint),
            self._communicators[head.process_set_id],
            members,
            self.rank,
            number,
            tracer,
            self._finisher,
            self.counters,
        )
        if head.kind == RequestType.ALLREDUCE:
            # A destination made in inference mode is written in inference mode.
            with writing_to_inference(entries):
                executor.execute(run)
            return
        issued = self.counters.now()
        tracer.open(head.kind.name)
        executor.execute(run)
        tracer.close()
        if not executor.traces_itself:
            # Allreduces count themselves when they complete; these ran synchronously here.
            self.counters.collective(issued, self.counters.now(), 0, len(entries))
        if not executor.traces_itself and tracer.timeline is not None:
            end = tracer.now()
            tracer.collective(
                entries, head.kind.name, number, (start, start, end, end), head.num_bytes
            )

    def _reduce_carried(self, response: Response, carried: list[dict[Key, bytes]]) -> bool:
        """Reduce ``response`` from the bytes every member carried; whether it was (the same
        answer on every rank)."""
        set_id = response.process_set_id
        if not self.process_sets.contains(set_id):
            return False
        members = self.process_sets.members(set_id)
        parts = carry.carried_parts(response, members, carried)
        if parts is None:
            return False
        number = self.tracer.next_batch()
        self._carrier.reduced += 1
        if self.rank not in members:
            return True
        (entry,) = self.intake.take(response.keys)
        if entry is None:
            return True
        tracer = self.tracer
        start = tracer.negotiated([response], [entry]) if tracer.timeline is not None else 0
        result = carry.reduce_parts(response.template(), parts)
        with writing_to_inference([entry]):
            copy_out_pieces([entry], result.reshape(-1), [result.numel()])
        self.counters.carried(result.numel() * result.element_size())
        if tracer.timeline is not None:
            end = tracer.now()
            nbytes = result.numel() * result.element_size()
            tracer.collective([entry], "ALLREDUCE", number, (start, start, end, end), nbytes)
        return True

    def _change_process_set(self, response: Response) -> None:
        template = response.template()
        ranks = template.ranks or ()
        if response.kind == RequestType.ADD_PROCESS_SET:
            # Every rank runs agreed changes in the same order: the ids agree.
            set_id = self.process_sets.reserve_id()
            self._register_process_set(set_id, ranks)
        else:
            set_id = int(template.name.split(".")[1])
            self._finisher.drain()
            self.process_sets.remove(set_id)
            self._host_only.discard(set_id)
            for table in (self._communicators, self._device_communicators):
                removed = table.pop(set_id, None)
                if removed is not None:
                    removed.close()
        (entry,) = self.intake.take([template.key])
        if entry is not None:
            finish(entry, set_id)

    def _register_process_set(self, set_id: int, ranks: tuple[int, ...]) -> None:
        self.process_sets.add(set_id, ranks)
        if self.rank in ranks:
            self._communicators[set_id] = self._connect(
                f"ps{set_id}", set_id, ranks.index(self.rank), len(ranks)
            )

    def _data_communicator(
        self, set_id: int, device: str, hint: torch.device | None
    ) -> Communicator:
        """The communicator that moves a batch's data: the set's own for CPU tensors (and for
        CUDA tensors through host memory), else the set's GPU communicator, made now the first
        time (every member runs the same batches in the same order, so all make it together).

        ``hint`` is the device of this rank's tensors in the batch, if it holds any: the GPU
        communicator lives there (a joined rank, holding none, uses the GPU of its first
        tensors, or that of its local rank).
        """
        if device != "cuda" or self._make_device_communicator is None or set_id in self._host_only:
            return self._communicators[set_id]
        if hint is not None and hint.type == "cuda" and self._gpu is None:
            self._gpu = hint
        comm = self._device_communicators.get(set_id)
        if comm is None:
            gpu = self._gpu or local_gpu(self.topology.local_rank)
            members = self.process_sets.members(set_id)
            try:
                comm = self._make_device_communicator(
                    self._keys.scope(f"gpu-ps{set_id}"),
                    members.index(self.rank),
                    len(members),
                    gpu,
                )
            except TransportError as exc:
                raise HoraInternalError(
                    f"rank {self.rank}: could not connect the NCCL group of process set "
                    f"{set_id} on {gpu} ({exc}). NCCL_DEBUG=INFO shows why; "
                    "HORA_GPU_OPERATIONS=host moves CUDA tensors through host memory instead."
                ) from exc
            if comm is None:
                self._host_only.add(set_id)
                return self._communicators[set_id]
            self._device_communicators[set_id] = comm
        return comm

    # ----------------------------------------------------------------- endings

    def _all_communicators(self) -> list[Communicator]:
        return [self._control, *self._communicators.values(), *self._device_communicators.values()]

    def _abort_on_failure(self) -> None:
        """The watcher saw the job fail: unblock every collective, wake a parked engine."""
        for comm in self._all_communicators():
            comm.abort()
        self._wake(self._parked_round)

    def _transport_failed(self, error: str) -> str:
        """A collective failed on this rank's engine or finisher thread: diagnose it once;
        returns the message every pending call fails with."""
        with self._fail_lock:
            if self.intake.failure is None:
                for comm in self._all_communicators():
                    comm.abort()
                self._fail(
                    diagnose(
                        self._store, self._keys, self.rank, self.size, error, self._failure_seen()
                    )
                )
            return self.intake.failure or error

    def _fail(self, message: str) -> None:
        self.intake.failure = message
        for comm in self._all_communicators():
            comm.abort()
        if self.rank == 0 or message:
            logger.error("%s", message)
        self.intake.end(message)
