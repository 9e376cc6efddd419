"""Collectives among processes of one host through shared memory.

A :class:`ShmCommunicator` maps one segment (:mod:`.shm_segment`) with a slot per member. Every
collective runs in chunks that fit a slot, each chunk in phases separated by barriers (every
member stores its arrival counter, then waits for the others'):

- allreduce between two members: each copies its chunk into one half of its slot; barrier;
  each reduces the two halves straight into its own buffer (both compute the same sum, in the
  same order). The halves alternate from chunk to chunk, so the next chunk's barrier is also
  what tells a member that its peer has read the previous one: one barrier per chunk.
- allreduce among more members: each member copies its chunk into its slot; barrier; member
  ``r`` reduces part ``r`` of the chunk across every slot, in member order (so results are
  deterministic for a given number of members), and writes the result into part ``r`` of every
  slot; barrier; each member copies the whole chunk back from its own slot. A buffer that
  already lies in this member's slot (:meth:`ShmCommunicator.staging`) skips both copies.
- allreduce of buffers in the members' arenas (:meth:`ShmCommunicator.arena_buffer`, where
  the engine's steady state keeps its batches), from 256 KiB up: each member publishes where
  its buffer lies; barrier; member ``r`` reduces part ``r`` across every member's buffer, in
  member order, into its own buffer; barrier; each member copies the other parts from their
  reducers' buffers; barrier. No copy in or out: the buffer is filled where it lies and its
  result read there. A buffer outside the arena is copied into a staging block there; where
  some member's data cannot be put in its arena, every member takes the slots' way (they all
  see the published places, so they agree).
- allgather, broadcast, reducescatter, alltoall: write, barrier, read, barrier.
- sendrecv: the pair's own counters; the other members take no part.

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
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hora.common.message import ReduceOp
from hora.common.transport import FINISHED, TransportError
from hora.common.transport.shm_segment import (
    Aborted,
    PeerLost,
    Segment,
    WaitTimeout,
    reached,
)

_OPS: dict[ReduceOp, Callable[..., Any]] = {
    ReduceOp.SUM: torch.add,
    ReduceOp.MIN: torch.minimum,
    ReduceOp.MAX: torch.maximum,
    ReduceOp.PRODUCT: torch.mul,
}
# Chunks are cut at multiples of this many bytes (any dtype's element size divides it).
_ALIGN = 64
# Arena buffers are whole pages.
_BLOCK = 4096
# Allreduces of fewer bytes go through the slots even where buffers lie in the arenas: the
# arenas' way waits three times, the slots' once, and for small buffers the waits cost more
# than the copies they save.
ARENA_FROM_BYTES = 256 * 1024
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
    ) -> None:
        self.rank = segment.rank
        self.size = segment.size
        self.device = torch.device("cpu")
        self._segment = segment
        self._timeout_s = timeout_s
        self._describe = describe or (lambda member: f"member {member}")
        self._slots = [torch.frombuffer(slot, dtype=torch.uint8) for slot in segment.slots]
        self._others = [m for m in range(self.size) if m != self.rank]
        self._arrivals = 0
        self._pairs = [0] * self.size
        # Two members alternate the halves of their slots (see the module docstring); another
        # operation first waits until the peer has read the half used last (``_unfenced``).
        self._half = 0
        self._unfenced = False
        self._scratch: torch.Tensor | None = None
        self._lock = threading.Lock()  # one operation at a time
        self._queue: queue.SimpleQueue[_Queued | None] = queue.SimpleQueue()
        self._queued = 0  # started asynchronously and not yet finished
        self._counting = threading.Lock()
        self._worker: threading.Thread | None = None
        self._closed = False
        self._arena = _Arena(segment.arena_bytes)
        self._staging: torch.Tensor | None = None
        self._started = 0  # allreduces started through allreduce_async
        self._arenas = [
            torch.frombuffer(segment.arena(m), dtype=torch.uint8) if segment.arena_bytes else None
            for m in range(self.size)
        ]

    # ------------------------------------------------------------- running operations

    def _deadline(self, timeout_s: float | None = None) -> float:
        return time.monotonic() + (self._timeout_s if timeout_s is None else timeout_s)

    def _fence(self, deadline: float) -> None:
        """Before an operation writes the whole slot: wait until every member has read what
        the last two-member allreduce left in it."""
        if self._unfenced:
            self._unfenced = False
            self._barrier(deadline)

    def _barrier(self, deadline: float) -> None:
        self._arrivals += 1
        self._segment.arrive(self._arrivals)
        self._wait(lambda: self._segment.wait_arrivals(self._others, self._arrivals, deadline))

    def _wait(self, waiting: Callable[[], None]) -> None:
        try:
            waiting()
        except PeerLost as exc:
            raise TransportError(
                f"{self._shown(exc)} of this host's shared-memory group exited during a "
                "collective (connection closed)"
            ) from None
        except WaitTimeout as exc:
            raise TransportError(
                f"timed out waiting for {self._shown(exc)} in a shared-memory collective "
                f"({self._timeout_s:g} s)"
            ) from None
        except Aborted:
            raise TransportError("the communicator was aborted") from None

    def _shown(self, exc: BaseException) -> str:
        text = str(exc)
        if text.startswith("member "):
            number = text.split()[1]
            if number.isdigit():
                return self._describe(int(number)) + text[len(f"member {number}") :]
        return text

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
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        taken = self._arena.take(nbytes)
        if taken is None:
            return None
        offset, size = taken
        if not self._segment.reserve(offset, size):
            self._arena.give_back(offset, size)
            return None
        block = self._segment.arena_block(offset, size)
        weakref.finalize(block, self._arena.give_back, offset, size)
        return torch.frombuffer(block, dtype=torch.uint8)[:nbytes].view(dtype)

    def _arena_offset(self, buffer: torch.Tensor) -> int | None:
        """Where ``buffer`` starts in this member's arena, or ``None`` when it is not there."""
        own = self._arenas[self.rank]
        if own is None:
            return None
        offset = buffer.data_ptr() - own.data_ptr()
        return offset if 0 <= offset < own.numel() else None

    # ------------------------------------------------------------- the collectives

    def allreduce(self, buffer: torch.Tensor, op: ReduceOp) -> None:
        self._now(lambda: self._allreduce(buffer, op, self._deadline()))

    def allreduce_async(
        self, buffer: torch.Tensor, op: ReduceOp, timeout_s: float | None = None
    ) -> Any:
        run = lambda: self._allreduce(buffer, op, self._deadline(timeout_s))  # noqa: E731
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
        nbytes = flat.numel() * flat.element_size()
        # Small buffers take the slots' way, wherever they lie: one barrier instead of three,
        # and every member knows the size, so all of them take it without asking.
        if self._arenas[self.rank] is None or nbytes < ARENA_FROM_BYTES:
            self._allreduce_through_slots(flat, op, deadline)
            return
        # Every member says where its data lies before the first barrier, and all of them then
        # take the same way: through the arenas where every member's data is in its arena
        # (a buffer outside it is copied into a staging block when one can be had), else
        # through the slots.
        work: torch.Tensor | None = flat
        offset = self._arena_offset(flat)
        if offset is None:
            work = self._staged(flat)
            offset = None if work is None else self._arena_offset(work)
        self._segment.publish_block(offset, nbytes)
        self._barrier(deadline)
        if work is None or not self._every_block_published():
            self._allreduce_through_slots(flat, op, deadline)
            return
        self._allreduce_in_arenas(work, op, deadline)
        if work is not flat:
            flat.copy_(work)

    def _staged(self, flat: torch.Tensor) -> torch.Tensor | None:
        """``flat`` copied into this member's staging block in its arena (kept from one
        operation to the next), or ``None`` when the arena cannot hold it."""
        nbytes = flat.numel() * flat.element_size()
        if nbytes > self._segment.arena_bytes // 4:
            return None
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = None  # its block returns to the arena
            self._staging = self.arena_buffer(max(nbytes, 1 << 16), torch.uint8)
            if self._staging is None:
                return None
        work = self._staging[:nbytes].view(flat.dtype)
        work.copy_(flat)
        return work

    def _every_block_published(self) -> bool:
        return all(self._segment.block_of(m)[0] >= 0 for m in self._others)

    def _allreduce_through_slots(self, flat: torch.Tensor, op: ReduceOp, deadline: float) -> None:
        if self.size == 2:
            self._allreduce_pair(flat, op, deadline)
            return
        self._fence(deadline)
        itemsize = flat.element_size()
        per_chunk = max(1, (self._segment.slot_bytes // itemsize) // _ALIGN * _ALIGN)
        own = self._slots[self.rank].view(flat.dtype)
        for start in range(0, flat.numel(), per_chunk):
            count = min(per_chunk, flat.numel() - start)
            own[:count].copy_(flat[start : start + count])
            self._reduce_chunk(flat.dtype, count, op, deadline)
            flat[start : start + count].copy_(own[:count])

    def _allreduce_pair(self, flat: torch.Tensor, op: ReduceOp, deadline: float) -> None:
        """Two members: both reduce every element, from alternating halves of their slots."""
        half_bytes = self._segment.slot_bytes // 2
        per_chunk = max(1, (half_bytes // flat.element_size()) // _ALIGN * _ALIGN)
        function = _OPS[op]
        for start in range(0, flat.numel(), per_chunk):
            count = min(per_chunk, flat.numel() - start)
            offset = self._half * half_bytes
            self._half ^= 1
            halves = [s[offset : offset + half_bytes].view(flat.dtype)[:count] for s in self._slots]
            target = flat[start : start + count]
            halves[self.rank].copy_(target)
            self._barrier(deadline)
            function(halves[0], halves[1], out=target)
        self._unfenced = True

    def _allreduce_in_arenas(self, flat: torch.Tensor, op: ReduceOp, deadline: float) -> None:
        """Reduce buffers that lie in every member's arena, each where it lies (every member
        has published its buffer, and passed the barrier after)."""
        nbytes = flat.numel() * flat.element_size()
        buffers = []
        for member in range(self.size):
            if member == self.rank:
                buffers.append(flat)
                continue
            start, published = self._segment.block_of(member)
            arena = self._arenas[member]
            assert arena is not None
            if published != -(-nbytes // _BLOCK) * _BLOCK or start + nbytes > arena.numel():
                raise TransportError(
                    f"{self._describe(member)} reduces a buffer of {published} bytes in "
                    f"shared memory, this member one of {nbytes}"
                )
            buffers.append(arena[start : start + nbytes].view(flat.dtype))
        low, high = _part(flat.numel(), self.size, self.rank)
        if high > low:
            shares = [b[low:high] for b in buffers]
            result = self._reduce(shares, op)
            if result is not shares[self.rank]:  # more than two members: from the scratch
                shares[self.rank].copy_(result)
        self._barrier(deadline)
        # Each member's share of the result lies in its own buffer: take the others'.
        for member in self._others:
            low, high = _part(flat.numel(), self.size, member)
            if high > low:
                flat[low:high].copy_(buffers[member][low:high])
        self._barrier(deadline)

    def _reduce_chunk(self, dtype: torch.dtype, count: int, op: ReduceOp, deadline: float) -> None:
        """Reduce the first ``count`` elements of every slot into every slot."""
        self._barrier(deadline)
        low, high = _part(count, self.size, self.rank)
        if high > low:
            views = [slot.view(dtype)[low:high] for slot in self._slots]
            result = self._reduce(views, op)
            for view in views:
                if view is not result:
                    view.copy_(result)
        self._barrier(deadline)

    def _reduce(self, views: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
        """``op`` over ``views`` in member order; the result lies in this member's view when
        that is safe (two members), else in a private scratch buffer."""
        function = _OPS[op]
        own = views[self.rank]
        if self.size == 2:
            function(views[0], views[1], out=own)
            return own
        scratch = self._scratch_for(own)
        function(views[0], views[1], out=scratch)
        for view in views[2:]:
            function(scratch, view, out=scratch)
        return scratch

    def _scratch_for(self, like: torch.Tensor) -> torch.Tensor:
        nbytes = like.numel() * like.element_size()
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8)
        return self._scratch[:nbytes].view(like.dtype)

    def allgather(self, outputs: Sequence[torch.Tensor], buffer: torch.Tensor) -> None:
        self._now(lambda: self.allgather_step(outputs, buffer))

    def broadcast(self, buffer: torch.Tensor, root: int) -> None:
        self._now(lambda: self._broadcast(buffer, root))

    def _broadcast(self, buffer: torch.Tensor, root: int) -> None:
        deadline = self._deadline()
        self._fence(deadline)
        data = _bytes(buffer)
        step = self._segment.slot_bytes
        for start in range(0, max(data.numel(), 1), step):
            count = min(step, data.numel() - start)
            if self.rank == root:
                self._slots[root][:count].copy_(data[start : start + count])
            self._barrier(deadline)
            if self.rank != root:
                data[start : start + count].copy_(self._slots[root][:count])
            self._barrier(deadline)

    def reducescatter(
        self, output: torch.Tensor, chunks: Sequence[torch.Tensor], op: ReduceOp
    ) -> None:
        self._now(lambda: self._reducescatter(output, chunks, op))

    def _reducescatter(
        self, output: torch.Tensor, chunks: Sequence[torch.Tensor], op: ReduceOp
    ) -> None:
        deadline = self._deadline()
        self._fence(deadline)
        flats = [chunk.reshape(-1) for chunk in chunks]
        out = output.view(-1)
        dtype = out.dtype
        longest = max(f.numel() for f in flats)
        window = max(1, self._segment.slot_bytes // (self.size * out.element_size()))
        own = self._slots[self.rank].view(dtype)
        function = _OPS[op]
        for start in range(0, max(longest, 1), window):
            counts = [max(0, min(window, f.numel() - start)) for f in flats]
            for member, flat in enumerate(flats):
                own[member * window : member * window + counts[member]].copy_(
                    flat[start : start + counts[member]]
                )
            self._barrier(deadline)
            mine = counts[self.rank]
            if mine:
                base = self.rank * window
                views = [slot.view(dtype)[base : base + mine] for slot in self._slots]
                target = out[start : start + mine]
                function(views[0], views[1], out=target) if self.size > 1 else target.copy_(
                    views[0]
                )
                for view in views[2:]:
                    function(target, view, out=target)
            self._barrier(deadline)

    def alltoall(
        self,
        output: torch.Tensor,
        buffer: torch.Tensor,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
    ) -> None:
        self._now(lambda: self._alltoall(output, buffer, output_splits, input_splits))

    def _alltoall(
        self,
        output: torch.Tensor,
        buffer: torch.Tensor,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
    ) -> None:
        deadline = self._deadline()
        self._fence(deadline)
        rows = buffer.shape[0] if buffer.dim() else 0
        row_bytes = (_bytes(buffer).numel() // rows) if rows else 0
        if not row_bytes and output.dim() and output.shape[0]:
            row_bytes = _bytes(output).numel() // output.shape[0]
        sent = [int(s) * row_bytes for s in input_splits]
        received = [int(s) * row_bytes for s in output_splits]
        # Every member learns every member's sizes, so that all agree on the rounds' chunks.
        sizes = torch.tensor(sent, dtype=torch.int64)
        table = torch.empty(self.size * self.size, dtype=torch.int64)
        self.allgather_step(list(table.split(self.size)), sizes)
        matrix = table.view(self.size, self.size).tolist()
        source, target = _bytes(buffer), _bytes(output)
        sent_at = _offsets(sent)
        received_at = _offsets(received)
        step = self._segment.slot_bytes
        own = self._slots[self.rank]
        for shift in range(self.size):
            to, frm = (self.rank + shift) % self.size, (self.rank - shift) % self.size
            # The round's biggest transfer sets its number of chunks, the same on every member.
            biggest = max(matrix[m][(m + shift) % self.size] for m in range(self.size))
            for start in range(0, biggest, step):
                out_count = max(0, min(step, sent[to] - start))
                own[:out_count].copy_(source[sent_at[to] + start : sent_at[to] + start + out_count])
                self._barrier(deadline)
                in_count = max(0, min(step, received[frm] - start))
                target[received_at[frm] + start : received_at[frm] + start + in_count].copy_(
                    self._slots[frm][:in_count]
                )
                self._barrier(deadline)

    def sendrecv(self, send: torch.Tensor, receive: torch.Tensor, peer: int) -> None:
        self._now(lambda: self._sendrecv(send, receive, peer))

    def _sendrecv(self, send: torch.Tensor, receive: torch.Tensor, peer: int) -> None:
        deadline = self._deadline()
        self._fence(deadline)
        outgoing, incoming = _bytes(send), _bytes(receive)
        step = self._segment.slot_bytes
        segment = self._segment
        own = self._slots[self.rank]
        for start in range(0, max(outgoing.numel(), incoming.numel(), 1), step):
            count = max(0, min(step, outgoing.numel() - start))
            own[:count].copy_(outgoing[start : start + count])
            self._pairs[peer] += 1
            mark = self._pairs[peer]
            segment.post(peer, mark, 0)
            self._wait_pair(peer, mark, 0, deadline)
            got = max(0, min(step, incoming.numel() - start))
            incoming[start : start + got].copy_(self._slots[peer][:got])
            segment.post(peer, mark, 1)
            self._wait_pair(peer, mark, 1, deadline)

    def _wait_pair(self, peer: int, mark: int, which: int, deadline: float) -> None:
        self._wait(lambda: self._segment.wait_pair(peer, mark, which, deadline))

    def barrier(self) -> None:
        self._now(lambda: self._barrier(self._deadline()))

    def exchange(self, data: bytes) -> list[bytes]:
        """Every member's ``data`` (the same length on every member), in member order: one
        barrier, the halves of the slots alternating as in the two-member allreduce (what
        negotiation's exchanges use, every cycle)."""
        out: list[bytes] = []
        self._now(lambda: out.extend(self._exchange(data)))
        return out

    def _exchange(self, data: bytes) -> list[bytes]:
        deadline = self._deadline()
        half_bytes = self._segment.slot_bytes // 2
        if len(data) > half_bytes:
            self._fence(deadline)
            outputs = [torch.empty(len(data), dtype=torch.uint8) for _ in range(self.size)]
            self.allgather_step(outputs, torch.frombuffer(bytearray(data), dtype=torch.uint8))
            return [o.numpy().tobytes() for o in outputs]
        offset = self._half * half_bytes
        self._half ^= 1
        views = self._segment.slots
        views[self.rank][offset : offset + len(data)] = data
        self._barrier(deadline)
        self._unfenced = True
        return [bytes(view[offset : offset + len(data)]) for view in views]

    # ------------------------------------------------------------- steps of composed operations

    def start(self, steps: Callable[[], None]) -> Any:
        """Run ``steps`` on this communicator's worker, in order with its other operations;
        ``steps`` may call the ``*_step`` methods (and other communicators' operations)."""
        return self._start(steps)

    def reducescatter_step(
        self, output: torch.Tensor, chunks: Sequence[torch.Tensor], op: ReduceOp
    ) -> None:
        """:meth:`reducescatter`, from within :meth:`start`'s steps."""
        self._reducescatter(output, chunks, op)

    def allgather_step(self, outputs: Sequence[torch.Tensor], buffer: torch.Tensor) -> None:
        """Gather every member's ``buffer`` into ``outputs[member]`` (what :meth:`allgather`
        runs, and a step of :meth:`start`'s); the members' buffers may differ in size
        (``outputs`` says how)."""
        deadline = self._deadline()
        self._fence(deadline)
        source = _bytes(buffer)
        targets = [_bytes(out) for out in outputs]
        step = self._segment.slot_bytes
        own = self._slots[self.rank]
        longest = max(t.numel() for t in targets)
        for start in range(0, max(longest, 1), step):
            count = max(0, min(step, source.numel() - start))
            own[:count].copy_(source[start : start + count])
            self._barrier(deadline)
            for member, target in enumerate(targets):
                got = max(0, min(step, target.numel() - start))
                target[start : start + got].copy_(self._slots[member][:got])
            self._barrier(deadline)

    # ------------------------------------------------------------- ending

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(timeout=5.0)
        self._slots = []
        self._scratch = None
        self._segment.close()

    def abort(self) -> None:
        self._segment.aborted = True
        self._segment.wake_all()


class _Arena:
    """Which bytes of this member's arena are free: first fit, in whole pages."""

    def __init__(self, nbytes: int) -> None:
        self._free = [(0, nbytes)] if nbytes else []
        self._lock = threading.Lock()  # given back by whichever thread drops the last view

    def take(self, nbytes: int) -> tuple[int, int] | None:
        size = max(_BLOCK, -(-nbytes // _BLOCK) * _BLOCK)
        with self._lock:
            for index, (start, length) in enumerate(self._free):
                if length >= size:
                    if length == size:
                        del self._free[index]
                    else:
                        self._free[index] = (start + size, length - size)
                    return start, size
        return None

    def give_back(self, start: int, size: int) -> None:
        with self._lock:
            self._free.append((start, size))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for begin, length in self._free:
                if merged and merged[-1][0] + merged[-1][1] == begin:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((begin, length))
            self._free = merged


def _part(count: int, size: int, member: int) -> tuple[int, int]:
    """Member ``member``'s share of ``count`` elements cut into ``size`` parts, 64-aligned."""
    share = -(-count // size)
    share = -(-share // _ALIGN) * _ALIGN
    low = min(count, member * share)
    return low, min(count, low + share)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as bytes (a view)."""
    flat = tensor.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def _offsets(sizes: Sequence[int]) -> list[int]:
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += size
    return offsets
