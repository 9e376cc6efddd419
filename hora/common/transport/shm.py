"""Collectives among processes of one host through shared memory.

A :class:`ShmCommunicator` maps one segment (:mod:`.shm_segment`) with a slot per member, and
runs its operations; the ways they take are modules of their own, each over this member's view
of the segment (:mod:`.shm_layout`: slots, arenas, staging) and its barriers
(:mod:`.shm_barriers`: every member stores its arrival counter, then waits for the others'):

- allreduce between two members, and the exchange of negotiation (:mod:`.shm_halves`): one
  barrier per chunk, through alternating halves of the slots.
- allreduce of buffers in the members' arenas (:meth:`ShmCommunicator.arena_buffer`, where
  the engine's steady state keeps its batches), from 256 KiB up (:mod:`.shm_arena`): each
  buffer is reduced where it lies, without copies in or out.
- allreduce among more members, allgather, broadcast, reducescatter, alltoall, sendrecv
  (:mod:`.shm_slots`): chunk by chunk through whole slots.

Operations run in inference mode (as Gloo's kernels, they write into the callers' tensors, which
may be inference tensors) and in the order they are started: an asynchronous allreduce goes to
a worker thread, and an operation started while others are queued waits its turn. A wait sleeps on a
futex after a few microseconds of spinning, so a rank that waits for a slower one leaves its
core to computation.

This module knows buffers and members; not requests, names or jobs.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence

import torch

from hora.common.transport import FINISHED, Pending, Sizes, TransportError
from hora.common.transport.shm_arena import ArenaAllreduce
from hora.common.transport.shm_barriers import Barriers
from hora.common.transport.shm_halves import Halves
from hora.common.transport.shm_lane import Lane
from hora.common.transport.shm_layout import Layout
from hora.common.transport.shm_segment import (
    Aborted,
    PeerLost,
    Segment,
    WaitTimeout,
    reached,
)
from hora.common.transport.shm_slots import SlotCollectives
from hora.common.vocabulary.message import ReduceOp

# Allreduces up to this many bytes run on the calling thread when nothing else is queued and
# every peer has started it too: the hand-off to the worker thread would cost more than the
# operation. A member that is first hands it off, so that its caller is free while it waits and
# a long wait is one its caller sees (the steady state's stall records).
INLINE_BYTES = 4 * 1024 * 1024


def _done() -> None:
    """What a finished operation runs: nothing (its closure and buffers are let go)."""


class _Queued:
    """An operation queued to the worker thread."""

    __slots__ = ("_done", "error", "run")

    def __init__(self, run: Callable[[], None]) -> None:
        self.run = run
        self.error: BaseException | None = None
        self._done = threading.Event()

    def finish(self, error: BaseException | None) -> None:
        self.error = error
        self.run = _done
        self._done.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        if not self._done.wait(timeout_s):
            return False
        if self.error is not None:
            raise TransportError(str(self.error)) from self.error
        return True


class ShmCommunicator:
    """Collectives among ``size`` processes of one host that map the same segment.

    Args:
        segment: the mapped segment (this member's view).
        timeout_s: how long any one operation may wait for its peers.
        describe: how errors name a member (``member 2`` by default), e.g. by global rank.
        limit: the setting ``timeout_s`` comes from, for messages (``""``: none named).

    Attributes:
        rank, size: this member and the number of members.
        device: ``cpu``.
        path: ``shm``, for the timeline and ``hora doctor``.
    """

    path = "shm"

    def __init__(
        self,
        segment: Segment,
        timeout_s: float,
        describe: Callable[[int], str] | None = None,
        limit: str = "",
    ) -> None:
        self.rank = segment.rank
        self.size = segment.size
        self.device = torch.device("cpu")
        self._segment = segment
        describe = describe or (lambda member: f"member {member}")
        self._layout = Layout(segment)
        self._barriers = Barriers(segment, timeout_s, describe, limit)
        self._halves = Halves(segment, self._layout, self._barriers)
        self._through_slots = SlotCollectives(segment, self._layout, self._barriers)
        self._in_arenas = ArenaAllreduce(segment, self._layout, self._barriers, describe)
        self._others = [m for m in range(self.size) if m != self.rank]
        self._lock = threading.Lock()  # one operation at a time
        self._queue: queue.SimpleQueue[_Queued | None] = queue.SimpleQueue()
        self._queued = 0  # started asynchronously and not yet finished
        self._counting = threading.Lock()
        self._worker: threading.Thread | None = None
        self._closed = False
        # The calling thread's path for this set (hora.common.ops.fast_path), when it has one.
        self.lane: Lane | None = None
        self._started = 0  # allreduces started through allreduce_async

    # ------------------------------------------------------------- running operations

    def _now(self, run: Callable[[], None]) -> None:
        """Run an operation on the calling thread, after those already queued."""
        if self._closed or self._segment.aborted:
            raise TransportError("the communicator was aborted")
        if self._queued:
            self._start(run).wait()
            return
        with self._lock, torch.inference_mode():
            try:
                run()
            except TransportError:
                raise
            except (PeerLost, WaitTimeout, Aborted) as exc:
                raise TransportError(str(exc)) from None

    def _start(self, run: Callable[[], None]) -> _Queued:
        if self._closed or self._segment.aborted:
            raise TransportError("the communicator was aborted")
        job = _Queued(run)
        with self._counting:
            self._queued += 1
        if self._worker is None:
            self._worker = threading.Thread(target=self._serve, name="hora-shm", daemon=True)
            self._worker.start()
        self._queue.put(job)
        return job

    def _serve(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            error: BaseException | None = None
            with self._lock, torch.inference_mode():
                try:
                    job.run()
                except BaseException as exc:
                    error = exc
            with self._counting:
                self._queued -= 1
            job.finish(error)
            # Nothing of a finished operation stays referenced from here while the next is
            # awaited: its buffer may be a view of a caller's tensor, and a caller may adopt
            # memory only where nothing else refers to it (see owns_its_memory).
            del job

    # ------------------------------------------------------------- arenas

    def arena_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A buffer of ``numel`` elements in this member's arena, for a collective that runs
        again and again: :meth:`allreduce` reduces it where it lies, without copies. Its
        memory returns to the arena once nothing refers to it. ``None`` when the arena has no
        room (or ``/dev/shm`` none for its pages): the caller makes a buffer of its own."""
        return self._layout.arena_buffer(numel, dtype)

    # ------------------------------------------------------------- the collectives

    def allreduce(self, buffer: torch.Tensor, op: ReduceOp) -> None:
        self._now(lambda: self._allreduce(buffer, op, self._barriers.deadline()))

    def allreduce_async(
        self, buffer: torch.Tensor, op: ReduceOp, timeout_s: float | None = None
    ) -> Pending:
        run = lambda: self._allreduce(buffer, op, self._barriers.deadline(timeout_s))  # noqa: E731
        self._started += 1
        self._segment.announce(self._started)
        small = buffer.numel() * buffer.element_size() <= INLINE_BYTES
        if small and not self._queued and self._peers_started():
            self._now(run)
            return FINISHED
        return self._start(run)

    def _peers_started(self) -> bool:
        """Whether every peer has started the allreduce this member starts now (so that it
        will reach its barrier without waiting for anyone)."""
        target = self._started
        return all(reached(self._segment.announced(m), target) for m in self._others)

    def _allreduce(self, buffer: torch.Tensor, op: ReduceOp, deadline: float) -> None:
        flat = buffer.view(-1)
        if self._in_arenas.allreduce(flat, op, deadline):
            return
        if self.size == 2:
            self._halves.allreduce(flat, op, deadline)
        else:
            self._through_slots.allreduce(flat, op, deadline)

    def allgather(self, outputs: Sequence[torch.Tensor], buffer: torch.Tensor) -> None:
        self._now(lambda: self._through_slots.allgather(outputs, buffer))

    def broadcast(self, buffer: torch.Tensor, root: int) -> None:
        self._now(lambda: self._through_slots.broadcast(buffer, root))

    def reducescatter(
        self, output: torch.Tensor, chunks: Sequence[torch.Tensor], op: ReduceOp
    ) -> None:
        self._now(lambda: self._through_slots.reducescatter(output, chunks, op))

    def alltoall(
        self, output: torch.Tensor, buffer: torch.Tensor, output_splits: Sizes, input_splits: Sizes
    ) -> None:
        self._now(lambda: self._through_slots.alltoall(output, buffer, output_splits, input_splits))

    def sendrecv(self, send: torch.Tensor, receive: torch.Tensor, peer: int) -> None:
        self._now(lambda: self._through_slots.sendrecv(send, receive, peer))

    def barrier(self) -> None:
        self._now(lambda: self._barriers.barrier(self._barriers.deadline()))

    def exchange(self, data: bytes) -> list[bytes]:
        """Every member's ``data`` (the same length on every member), in member order: one
        barrier, the halves of the slots alternating as in the two-member allreduce (what
        negotiation's exchanges use, every cycle)."""
        out: list[bytes] = []
        self._now(lambda: out.extend(self._exchange(data)))
        return out

    def _exchange(self, data: bytes) -> list[bytes]:
        deadline = self._barriers.deadline()
        if len(data) > self._halves.half_bytes:
            self._barriers.fence(deadline)
            outputs = [torch.empty(len(data), dtype=torch.uint8) for _ in range(self.size)]
            self.allgather_step(outputs, torch.frombuffer(bytearray(data), dtype=torch.uint8))
            return [o.numpy().tobytes() for o in outputs]
        return self._halves.exchange(data, deadline)

    # ------------------------------------------------------------- steps of composed operations

    def start(self, steps: Callable[[], None]) -> Pending:
        """Run ``steps`` on this communicator's worker, in order with its other operations;
        ``steps`` may call the ``*_step`` methods (and other communicators' operations)."""
        return self._start(steps)

    def reducescatter_step(
        self, output: torch.Tensor, chunks: Sequence[torch.Tensor], op: ReduceOp
    ) -> None:
        """:meth:`reducescatter`, from within :meth:`start`'s steps."""
        self._through_slots.reducescatter(output, chunks, op)

    def allgather_step(self, outputs: Sequence[torch.Tensor], buffer: torch.Tensor) -> None:
        """Gather every member's ``buffer`` into ``outputs[member]`` (what :meth:`allgather`
        runs, and a step of :meth:`start`'s); the members' buffers may differ in size
        (``outputs`` says how)."""
        self._through_slots.allgather(outputs, buffer)

    # ------------------------------------------------------------- ending

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(timeout=5.0)
        self._layout.close()
        self._segment.close()
        if self.lane is not None:
            self.lane.close()

    def abort(self) -> None:
        self._segment.aborted = True
        self._segment.wake_all()
        if self.lane is not None:
            self.lane.abort()
