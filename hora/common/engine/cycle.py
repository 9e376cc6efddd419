"""The engine's cycle: wait for a turn, exchange, integrate, execute.

One cycle, as every rank runs it::

    wait for turn   new local work, or a cycle time since the last cycle, or parked (parking.py)
    exchange        every rank contributes its new requests, or response-cache bits (exchange.py)
    integrate       every rank feeds every rank's requests into the same table, in rank order
    execute         the agreed responses run as fused batches, in order (executors.py)

While the steady state replays a schedule, a cycle is the replay's instead (steady/). The cycle
knows requests, responses and which executor runs a batch; not how executors move bytes, how
communicators are made, or the engine's lifecycle and failure endings (engine.py).
"""

from __future__ import annotations

import time

import torch

from hora.common.engine import carry, fusion
from hora.common.engine.buffers import copy_out_pieces, writing_to_inference
from hora.common.engine.context import EngineContext, NegotiationState
from hora.common.engine.exchange import Contribution, Exchange
from hora.common.engine.executors import Run, executor_for
from hora.common.engine.handles import fail, finish
from hora.common.engine.negotiation import ResponseCache
from hora.common.engine.parking import Parking
from hora.common.engine.steady.replay import Replay
from hora.common.engine.timing import HOLD_WHILE_IN_FLIGHT_S
from hora.common.vocabulary.errors import shut_down_message
from hora.common.vocabulary.message import Key, RequestType, Response


class Cycle:
    """The cycles of one engine, run one after another on its thread.

    Args:
        context: the engine's shared parts: settings, rank and size, the intake, the tracer,
            the counters, the communicators, and the finisher that completes the allreduces a
            cycle starts.
        negotiation: the negotiation table, the process sets, the stall inspector.
        replay: the steady state (runs instead of negotiating once the allreduces repeat).
        parking: when and how this rank parks.

    Attributes:
        carrier: this rank's small allreduces carried in the exchange (see carry.py).
    """

    def __init__(
        self,
        context: EngineContext,
        negotiation: NegotiationState,
        replay: Replay,
        parking: Parking,
    ) -> None:
        settings = context.settings
        self._context = context
        self._settings = settings
        self._rank = context.rank
        self._size = context.size
        self._intake = context.intake
        self._tracer = context.tracer
        self._counters = context.counters
        self._finisher = context.finisher
        self._communicators = context.communicators
        # What the cycle reads and changes of negotiation's state.
        self._process_sets = negotiation.process_sets
        self._table = negotiation.table
        self._stall = negotiation.stall
        self._replay = replay
        self._parking = parking
        self._cache = ResponseCache(settings.cache_capacity)
        self.carrier = carry.Carrier(settings.carry_threshold_bytes if context.size > 1 else 0)
        self._exchange = Exchange(context, self._cache, self.carrier)
        # When the last cycle ended with requests still waiting for other ranks (0: it did not).
        self._waiting_since = 0.0
        self._last_cycle_end = 0.0

    def run(self) -> bool:
        """Run one cycle (the steady state's, while it replays); False once the job ended."""
        # Entries this cycle takes out of the in-flight table; should the cycle raise, their
        # handles fail with the engine rather than wait forever (see Engine._loop).
        self._intake.begin_cycle()
        if self._replay.active:
            # Results are written into the caller's tensors outside autograd, as in _execute.
            with torch.no_grad():
                self._replay.cycle()
            if not self._replay.active:
                self._last_cycle_end = 0.0  # back to negotiation: at once
            return True
        self._wait_for_turn()
        if self._tracer.timeline is not None and self._tracer.timeline.mark_cycles:
            self._tracer.mark("CYCLE_START")
        exchanged = self._counters.now()
        self._tracer.open("NEGOTIATE")
        new = self._intake.drain()
        contributions, carried = self._exchange.run(
            new, self._intake.shutdown_reason, self._intake.shutdown_orderly
        )
        shutdown_reason, orderly = self._integrate(contributions)
        responses = self._table.ready(self._cache)
        self._tracer.close()
        agreed = self._counters.now()
        waiting_since = self._waiting_since
        self._counters.negotiated(
            agreed - exchanged, agreed - waiting_since if waiting_since else 0.0
        )
        self._tracer.agreed_at = self._tracer.now()
        self._parking.cycle_ended(any(c[0] for c in contributions) or bool(responses))
        self._execute(responses, carried)
        self.carrier.keep_only(self._table.pending)
        self._last_cycle_end = time.monotonic()
        self._waiting_since = self._counters.now() if self._table else 0.0
        if shutdown_reason is not None:
            # Collectives started before the shutdown was agreed still deliver their results.
            self._finisher.drain()
            self._intake.end(shut_down_message(shutdown_reason), orderly)
            return False
        self._check_stall()
        self._replay.maybe_enter(self._table)
        return True

    def _check_stall(self) -> None:
        reason = self._stall.check_if_due(self._table)
        if reason is not None:
            self._intake.request_shutdown(reason)

    def _wait_for_turn(self) -> None:
        """Start the next cycle when local work arrives or a cycle time has passed.

        Starting at once on local work keeps a lone synchronous op's latency near the
        transport's; requests that arrive while a cycle runs are batched into the next one.
        """
        if self._parking.due:
            self._parking.park()
            # Whoever rang has work: go at once.
            self._last_cycle_end = 0.0
            return
        if self._size == 1:
            if self._tracer.timeline is not None and not self._intake.has_queued:
                self._tracer.timeline.flush()  # a job of one waits for work without parking
            self._intake.wait_for_work(None)
            return
        # Counted from the end of the last cycle: after a long cycle, the user thread gets a
        # cycle time to submit its next request before an idle exchange goes out without it.
        cycle_s = self._settings.cycle_time_ms / 1000
        deadline = self._last_cycle_end + cycle_s
        if self._finisher.busy:
            # Collectives this rank started are on the wire, and nothing new is here: join the
            # next exchange when they land or work arrives (within HOLD_WHILE_IN_FLIGHT_S),
            # rather than every cycle time. Idle exchanges meanwhile take cores and the
            # transport's attention from the data (over MPI, both threads poll the library).
            # Every member of those collectives started them, so they land without an exchange.
            hold = self._last_cycle_end + HOLD_WHILE_IN_FLIGHT_S
            self._intake.wait_for_work(max(deadline, hold), lambda: not self._finisher.busy)
            if not self._finisher.busy:
                # They landed: the callers that waited for them get a cycle time to submit
                # their next requests before an idle exchange goes out without them.
                self._intake.wait_for_work(time.monotonic() + cycle_s)
            return
        self._intake.wait_for_work(deadline)

    def _integrate(self, contributions: list[Contribution]) -> tuple[str | None, bool]:
        """Adds every rank's requests to the table; returns the lowest rank's shutdown reason,
        if any rank gave one, and whether every reason given is orderly."""
        reason: str | None = None
        orderly = True
        for rank, (requests, shutdown, shutdown_orderly) in enumerate(contributions):
            for request in requests:
                self._table.add(rank, request)
            if shutdown is not None:
                reason = shutdown if reason is None else reason
                orderly = orderly and shutdown_orderly
        return reason, orderly

    def _execute(self, responses: list[Response], carried: list[dict[Key, bytes]]) -> None:
        """Run the agreed responses: those whose bytes every member carried in this cycle's
        exchange are reduced here; the others run as fused batches, in order, each by its
        executor."""
        self._replay.record(responses)
        if any(carried):
            with torch.no_grad():
                responses = [r for r in responses if not self._reduce_carried(r, carried)]
        plan = fusion.plan(
            responses, self._settings.fusion_threshold_bytes, self._settings.disable_group_fusion
        )
        # Results are written into the caller's tensors (parameters among them) outside autograd.
        with torch.no_grad():
            for batch in plan:
                self._execute_batch(batch)

    def _execute_batch(self, batch: list[Response]) -> None:
        head = batch[0]
        number = self._tracer.next_batch()
        tracer = self._tracer
        if (
            head.kind in (RequestType.ADD_PROCESS_SET, RequestType.REMOVE_PROCESS_SET)
            and head.error is None
        ):
            if tracer.timeline is not None:
                tracer.negotiated(batch, self._intake.get(head.keys))
            self._change_process_set(head)
            return
        entries = self._intake.take([key for response in batch for key in response.keys])
        start = tracer.negotiated(batch, entries) if tracer.timeline is not None else 0
        if head.error is not None:
            fail([e for e in entries if e is not None], head.error)
            return
        members = self._process_sets.members(head.process_set_id)
        if self._rank not in members:
            return
        executor = executor_for(head)
        hint = next(
            (e.tensor.device for e in entries if e is not None and e.tensor is not None), None
        )
        run = Run(
            batch,
            entries,
            self._communicators.for_batch(head.process_set_id, head.template().device, hint),
            self._communicators.of_set(head.process_set_id),
            members,
            number,
            self._context,
        )
        if head.kind == RequestType.ALLREDUCE:
            # A destination made in inference mode is written in inference mode.
            with writing_to_inference(entries):
                executor.execute(run)
            return
        issued = self._counters.now()
        tracer.open(head.kind.name)
        executor.execute(run)
        tracer.close()
        if not executor.traces_itself:
            # Allreduces count themselves when they complete; these ran synchronously here. A
            # reducescatter reduces its inputs (a sharded optimizer's gradients) as an
            # allreduce would.
            reduced = head.num_bytes if head.kind == RequestType.REDUCESCATTER else 0
            self._counters.collective(issued, self._counters.now(), reduced, len(entries))
        if not executor.traces_itself and tracer.timeline is not None:
            end = tracer.now()
            tracer.collective(
                entries,
                head.kind.name,
                number,
                (start, start, end, end),
                head.num_bytes,
                run.comm.path,
            )

    def _reduce_carried(self, response: Response, carried: list[dict[Key, bytes]]) -> bool:
        """Reduce ``response`` from the bytes every member carried; whether it was (the same
        answer on every rank)."""
        set_id = response.process_set_id
        if not self._process_sets.contains(set_id):
            return False
        members = self._process_sets.members(set_id)
        parts = carry.carried_parts(response, members, carried)
        if parts is None:
            return False
        number = self._tracer.next_batch()
        self.carrier.reduced += 1
        if self._rank not in members:
            return True
        (entry,) = self._intake.take(response.keys)
        if entry is None:
            return True
        tracer = self._tracer
        start = tracer.negotiated([response], [entry]) if tracer.timeline is not None else 0
        result = carry.reduce_parts(response.template(), parts)
        with writing_to_inference([entry]):
            copy_out_pieces([entry], result.reshape(-1), [result.numel()])
        self._counters.carried(result.numel() * result.element_size())
        if tracer.timeline is not None:
            end = tracer.now()
            nbytes = result.numel() * result.element_size()
            times = (start, start, end, end)
            tracer.collective([entry], "ALLREDUCE", number, times, nbytes, "exchange")
        return True

    def _change_process_set(self, response: Response) -> None:
        template = response.template()
        ranks = template.ranks or ()
        if response.kind == RequestType.ADD_PROCESS_SET:
            # Every rank runs agreed changes in the same order: the ids agree.
            set_id = self._process_sets.reserve_id()
            self._communicators.register(set_id, ranks)
        else:
            set_id = int(template.name.split(".")[1])
            self._finisher.drain()
            self._communicators.remove(set_id)
        (entry,) = self._intake.take([template.key])
        if entry is not None:
            finish(entry, set_id)
