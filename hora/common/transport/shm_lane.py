"""The calling thread's path among the members of one host: a settled call in one wait.

A :class:`Lane` is a segment of its own (:mod:`.shm_segment`), next to a process set's
shared-memory communicator, for collectives that a caller runs on its own thread instead of
handing them to the engine (:mod:`hora.common.ops.fast_path`). Every call on the set passes
through it, whichever path it then takes, and takes the member's next *sequence number*:

- a call for the engine (asynchronous, or one the lane cannot run) only *posts* its number;
- a synchronous call the lane can run also *signs* it: a 24-byte signature of what every member
  must agree on, and the first :data:`HEAD_BYTES` of its data, then posts. It then waits until
  every member has posted that number, and reads their signatures.

Each number gets one *decision*, taken once for all members by a compare-and-swap on a shared
cell: ``inline`` when every member signed the same signature for that number (each member
then runs the call at once, from the heads and then through alternating half-slots), else
``engine`` (every member hands its call to the engine, whose negotiation runs it or reports the
mismatch as it always does). A member that has waited :data:`SETTLE_S` for the others' posts,
or sees one of them joining (:meth:`Lane.begin_join`), decides ``engine``: ranks that make
their calls in different orders, or a call made synchronously on one rank and asynchronously
on another, never wait on each other here. Since the decision is one shared word, no two
members can take different paths for one call.

Cells are reused every :data:`CELLS` numbers, once every member has read the old decision;
sequence numbers restart together in a new *epoch* after a join (:meth:`Lane.new_epoch`),
and a member's marks are compared with the epoch in their high bits, so that a late member's
old numbers never match new ones.

Waiting: a member looks at the words for a while (no ``sched_yield``: on a busy core it hands
the core to another process for a whole time slice), then sleeps on the peer's *bell* (a futex
word each post rings; the ringer makes the system call only if someone sleeps). How long it
looks depends on whether its peers can run at the same time: :data:`SPIN_S` when the members
have a core each (a sleeping member takes 100 to 400 microseconds to wake here, so a shorter
look makes members that call in step take turns sleeping), :data:`OVERSUBSCRIBED_SPIN_S` when
there are more members than cores (a member that looks keeps a peer it waits for off the
core). A wait in the data phase longer than the stall time logs which
members have not arrived, and fails at the communicator's timeout; a lost peer ends it at once.

Results are reduced in member order, as the communicator's own collectives reduce them: a call
gives the same bits on this path and on the engine's.

This module knows buffers, signatures and members; not requests, names or handles.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

import torch

from hora.common.transport import TransportError
from hora.common.transport.shm_barriers import Barriers
from hora.common.transport.shm_layout import ALIGN, REDUCTIONS, Layout
from hora.common.transport.shm_segment import Segment, reached
from hora.common.vocabulary.message import ReduceOp

logger = logging.getLogger("hora")

# A member's control line: the first 64 bytes of its slot, as 64-bit words.
LINE_BYTES = 64
_POST, _CONSUMED, _SIGNED, _JOINING, _SIGNATURE = 0, 1, 2, 3, 4  # signature: words 4, 5, 6
# The decisions' cells (in member 0's slot, after its line): sequence number modulo CELLS.
CELLS = 4096
_INLINE, _ENGINE = 1, 2
HEAD_OFFSET = 9 * 4096  # the line and the cells, in whole pages
HEAD_BYTES = 1 << 20
# The members' heads viewed as (dtype, count) pairs: how many pairs a lane keeps made.
HEAD_VIEWS_KEPT = 256
HALF_BYTES = 1 << 20
SLOT_BYTES = HEAD_OFFSET + 2 * HEAD_BYTES + 2 * HALF_BYTES
# How long a signed call waits for every member's post before it goes to the engine.
SETTLE_S = 0.05
# How long a waiter looks at the words before it sleeps: with a core per member, and with more
# members than cores. Measured at np 2 on 2 cores (4-byte allreduce, medians of blocks of 20):
# 45-110 us with 300 us, 46-89 us with 1 ms, 55-360 us with 50 us; at np 4 on 2 cores: 400-800
# us with 50 us or 300 us, 1.5 ms with 1 ms.
SPIN_S = 500e-6
OVERSUBSCRIBED_SPIN_S = 50e-6
# How long a waiter sleeps on a bell before it looks again.
BELL_SLICE_S = 0.002
_BELL_WRAP = 1 << 31
# A call's signature: three 64-bit words (see hora.common.ops.fast_path.header).
Signature = tuple[int, int, int]


@functools.cache
def _compare_exchange() -> Callable[..., bool]:
    """libatomic's 64-bit compare-and-swap (sequentially consistent)."""
    function = getattr(ctypes.CDLL("libatomic.so.1"), "__atomic_compare_exchange_8")
    function.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_uint64,
        ctypes.c_int,
        ctypes.c_int,
    ]
    function.restype = ctypes.c_bool
    return function  # type: ignore[no-any-return]


def supported() -> str | None:
    """Why this process cannot have lanes (``None``: it can)."""
    try:
        _compare_exchange()
    except (OSError, AttributeError) as exc:
        return f"no atomic compare-and-swap from libatomic ({exc})"
    return None


def spin_time(members: int) -> float:
    """How long a member of ``members`` on this host looks before it sleeps (see the module's
    docstring): whether each can have a core of those this process may run on."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return SPIN_S if members <= cores else OVERSUBSCRIBED_SPIN_S


def _tag(epoch: int, seq: int) -> int:
    return epoch << 32 | seq


_SEQ_MASK = (1 << 32) - 1
# How a member takes the decision on a call signed ahead (Lane.settle): waiting as a signed call
# does; looking once, deciding where the members' lines allow; deciding now, "engine" where the
# lines allow no other (at the end of a session: the call runs if every member signed it);
# deciding "engine" unless a decision was taken (the member makes another call first: an
# engine's batch keeps a burst of calls together, where inline runs would split it); or only
# reading a decision taken.
WAIT, PEEK, SETTLE, FORCE, LOOK = 0, 1, 2, 3, 4


class Lane:
    """One member's view of a lane segment (see the module's docstring).

    Args:
        segment: the lane's mapped segment (this member's view), of :data:`SLOT_BYTES` slots.
        timeout_s: how long the data phase may wait for its peers before it fails.
        stall_s: after how long a wait logs the members it still waits for (0: never).
        limit: the setting ``timeout_s`` comes from, for messages (``""``: none named).

    Attributes:
        rank, size: this member and the number of members.
        ranks: each member's global rank, for messages (set by the set's owner).
        inline_calls: how many calls this member ran here.
        room: the data bytes a signed call carries with its signature.
        lock: held through a call (one call at a time per process on a set).
    """

    def __init__(self, segment: Segment, timeout_s: float, stall_s: float, limit: str = "") -> None:
        self.rank = segment.rank
        self.size = segment.size
        self.ranks: Sequence[int] = range(self.size)
        self._segment = segment
        self._layout = Layout(segment)
        self._barriers = Barriers(segment, timeout_s, self.describe, limit)
        self._timeout_s = timeout_s
        self._stall_s = stall_s
        self._others = [m for m in range(self.size) if m != self.rank]
        self._lines = [slot[:LINE_BYTES].cast("q") for slot in segment.slots]
        self._cells = segment.slots[0][LINE_BYTES : LINE_BYTES + 8 * CELLS].cast("q")
        self._cells_address = segment.address(0) + LINE_BYTES
        self._swap = _compare_exchange()
        self._expected = ctypes.c_uint64()
        self._heads = [
            (s[HEAD_OFFSET : HEAD_OFFSET + HEAD_BYTES], s[HEAD_OFFSET + HEAD_BYTES :][:HEAD_BYTES])
            for s in self._layout.slots
        ]
        self._head_in_use = 0  # which of its two heads a member signs its next call with
        self._head_views: dict[tuple[int, torch.dtype, int], tuple[torch.Tensor, ...]] = {}
        start = HEAD_OFFSET + 2 * HEAD_BYTES
        self._halves = [
            (s[start : start + HALF_BYTES], s[start + HALF_BYTES : start + 2 * HALF_BYTES])
            for s in self._layout.slots
        ]
        self.room = HEAD_BYTES
        self.lock = threading.Lock()
        self._spin_s = spin_time(self.size)
        self._epoch = 0
        self._seq = 0
        # A call signed ahead, not settled yet: its mark and signature, and what settles it.
        self._ahead: tuple[int, Signature] | None = None
        self._settle_ahead: Callable[[], None] | None = None
        self._bells = 0
        self._half = 0
        self._arrivals = 0
        self.inline_calls = 0

    def describe(self, member: int) -> str:
        return f"rank {self.ranks[member]}"

    @property
    def number(self) -> int:
        """The sequence number of this member's last call: the same call on every member,
        within an epoch."""
        return self._seq

    # ------------------------------------------------------------- posts and decisions

    def post(self) -> None:
        """This member's next call goes to the engine: take its number, tell the others."""
        self._before_next_number()
        self._seq += 1
        mark = _tag(self._epoch, self._seq)
        line = self._lines[self.rank]
        line[_POST] = mark
        line[_CONSUMED] = mark
        self._ring()

    def sign(
        self, signature: Signature, data: torch.Tensor | None = None, scale: float = 1.0
    ) -> bool:
        """This member's next call, which the lane could run: sign it (``signature``: three
        64-bit words) with the first :attr:`room` bytes of ``data`` (multiplied by ``scale``),
        post, and wait for the call's decision: whether every member runs it here (then each
        calls the collective's own method next, and :meth:`finish` once it read the heads)."""
        mark = self._publish(signature, data, scale)
        decision = self._decide(mark, signature, WAIT)
        return self._concluded(mark, decision)

    def sign_ahead(
        self,
        signature: Signature,
        data: torch.Tensor,
        scale: float,
        settle: Callable[[], None],
    ) -> None:
        """Sign this member's next call as :meth:`sign` does, without waiting for its
        decision: the call is *signed ahead* (an asynchronous call), and :meth:`settle` takes
        its decision later. Before this member takes another number, ``settle`` is called
        (under the lane's lock): it must settle the call, with ``settle(FORCE)`` at least."""
        self._ahead = (self._publish(signature, data, scale), signature)
        self._settle_ahead = settle

    def settle(self, mode: int) -> bool | None:
        """The decision on the call signed ahead: ``True`` (every member runs it here: the
        collective's own method next, which calls :meth:`finish`), ``False`` (the engine's),
        or ``None`` while none is taken (``PEEK``, ``LOOK``). ``WAIT`` waits as :meth:`sign`
        does; ``PEEK`` decides where the members' lines allow; ``SETTLE`` decides now (``engine``
        where the lines allow no other); ``FORCE`` decides ``engine`` unless a decision was
        taken; ``LOOK`` only reads a decision taken."""
        assert self._ahead is not None, "no call is signed ahead"
        mark, signature = self._ahead
        decision = self._decide(mark, signature, mode)
        if not decision:
            return None
        self._ahead = None
        self._settle_ahead = None
        return self._concluded(mark, decision)

    def _publish(self, signature: Signature, data: torch.Tensor | None, scale: float) -> int:
        """Take the next number, write the signature and the head's data, post; the mark."""
        self._before_next_number()
        self._seq += 1
        mark = _tag(self._epoch, self._seq)
        line = self._lines[self.rank]
        numel = 0 if data is None else data.numel()
        if numel:
            assert data is not None
            count = min(numel, self.room // data.element_size())
            own = self._heads_of(data.dtype, count)[self.rank]
            _copy_scaled(own, data if count == numel else data[:count], scale)
        line[_SIGNATURE], line[_SIGNATURE + 1], line[_SIGNATURE + 2] = signature
        line[_SIGNED] = mark
        line[_POST] = mark
        self._ring()
        return mark

    def _concluded(self, mark: int, decision: int) -> bool:
        inline = decision == _INLINE
        if inline:
            self.inline_calls += 1
        else:
            self._lines[self.rank][_CONSUMED] = mark
        return inline

    def _before_next_number(self) -> None:
        """Settle a call signed ahead before this member takes another number (its head and
        its number must be done with first)."""
        if self._settle_ahead is not None:
            self._settle_ahead()
        if self._ahead is not None:
            raise TransportError("a call signed ahead on the fast path was not settled")

    def signed(self, member: int) -> Signature:
        """The signature ``member`` signed its last signed call with."""
        line = self._lines[member]
        return line[_SIGNATURE], line[_SIGNATURE + 1], line[_SIGNATURE + 2]

    def finish(self) -> None:
        """This member has read every head of its inline call."""
        self._lines[self.rank][_CONSUMED] = _tag(self._epoch, self._seq)
        self._head_in_use ^= 1
        self._ring()

    def begin_join(self) -> None:
        """This member joins: the others' calls go to the engine until every member joined."""
        self._before_next_number()
        self._lines[self.rank][_JOINING] = self._epoch + 1
        self._ring()

    def new_epoch(self) -> None:
        """Every member has joined (this member's ``join`` returned): numbers restart, in an
        epoch that no earlier mark matches."""
        self._before_next_number()
        self._epoch += 1
        self._seq = 0
        mark = _tag(self._epoch, 0)
        line = self._lines[self.rank]
        line[_SIGNED] = 0
        line[_CONSUMED] = mark
        line[_POST] = mark
        self._ring()

    def _decide(self, mark: int, words: Sequence[int], mode: int) -> int:
        """The decision on ``mark`` (:data:`_INLINE` or :data:`_ENGINE`), taken by this member
        if no other member took it yet; 0 when ``PEEK`` or ``LOOK`` finds none taken."""
        cell = (mark & _SEQ_MASK) % CELLS
        cells = self._cells
        started = time.monotonic()
        settle_until = started + SETTLE_S
        while True:
            value = cells[cell]
            if value >> 2 == mark:
                return value & 3
            if mode == LOOK:
                return 0
            verdict, waiting_for = self._proposal(mark, words, mode, settle_until)
            if mode == PEEK and (not verdict or self._lagging(value >> 2) is not None):
                return 0
            if verdict:
                lagging = self._lagging(value >> 2)
                if lagging is None:
                    self._expected.value = value
                    address = self._cells_address + 8 * cell
                    self._swap(address, ctypes.addressof(self._expected), mark << 2 | verdict, 5, 5)
                    continue
                waiting_for = lagging
                if time.monotonic() > started + self._timeout_s:
                    raise TransportError(
                        f"{self.describe(lagging)} is {CELLS} calls or more behind on the "
                        "shared-memory fast path"
                    )
            now = time.monotonic()
            if now - started > self._spin_s:
                self._sleep_on(waiting_for, now + BELL_SLICE_S)

    def _proposal(
        self, mark: int, words: Sequence[int], mode: int, settle_until: float
    ) -> tuple[int, int]:
        """The decision this member would take for ``mark`` now (0: none yet), and a member
        not posted yet: ``FORCE`` proposes ``engine``; ``WAIT``, past the settle time, too."""
        if mode == FORCE:
            return _ENGINE, -1
        verdict, waiting_for = self._verdict(mark, words)
        if not verdict and (mode == SETTLE or (mode == WAIT and time.monotonic() >= settle_until)):
            verdict = _ENGINE
        return verdict, waiting_for

    def _verdict(self, mark: int, words: Sequence[int]) -> tuple[int, int]:
        """The decision the members' lines give for ``mark`` (0: none yet), and a member not
        posted yet."""
        joining = self._epoch + 1
        waiting_for = -1
        for member in self._others:
            line = self._lines[member]
            if line[_POST] >= mark:
                if (
                    line[_SIGNED] != mark
                    or line[_SIGNATURE] != words[0]
                    or line[_SIGNATURE + 1] != words[1]
                    or line[_SIGNATURE + 2] != words[2]
                ):
                    return _ENGINE, member
            elif line[_JOINING] == joining:
                return _ENGINE, member
            else:
                waiting_for = member
        return (0 if waiting_for >= 0 else _INLINE), waiting_for

    def _lagging(self, old: int) -> int | None:
        """A member that may still read the decision ``old`` of a cell (``None``: none)."""
        for member in range(self.size):
            if self._lines[member][_CONSUMED] < old:
                return member
        return None

    def _ring(self) -> None:
        self._bells = (self._bells + 1) % _BELL_WRAP
        self._segment.ring(self._bells)

    def _sleep_on(self, member: int, until: float) -> None:
        """Sleep until ``member`` rings, or ``until``."""
        if member < 0:
            os.sched_yield()
            return
        target = (self._segment.bell(member) + 1) % _BELL_WRAP
        self._barriers.wait(functools.partial(self._segment.wait_bell, member, target, until))

    def _warn(self, members: Sequence[int], waited_s: float) -> None:
        logger.warning(
            "%s has waited %.0f s on the shared-memory fast path for %s, which have not "
            "made this collective call yet. Check that every rank makes the same calls "
            "in the same order.",
            self.describe(self.rank),
            waited_s,
            ", ".join(self.describe(m) for m in members),
        )

    # ------------------------------------------------------------- collectives

    def allreduce(self, flat: torch.Tensor, out: torch.Tensor, op: ReduceOp, scale: float) -> None:
        """The data phase of an inline allreduce of ``flat`` (its head already signed, scaled
        by ``scale``) into ``out`` (which may be ``flat``)."""
        function = REDUCTIONS[op]
        numel = flat.numel()
        first = min(numel, self.room // flat.element_size())
        heads = self._heads_of(flat.dtype, first)
        _reduce(function, heads, out if first == numel else out[:first])
        self.finish()
        if first == numel:
            return
        per_chunk = max(1, (HALF_BYTES // flat.element_size()) // ALIGN * ALIGN)
        for start in range(first, flat.numel(), per_chunk):
            count = min(per_chunk, flat.numel() - start)
            half = self._next_half()
            view = self._halves[self.rank][half].view(flat.dtype)[:count]
            _copy_scaled(view, flat[start : start + count], scale)
            self._barrier()
            views = [h[half].view(flat.dtype)[:count] for h in self._halves]
            _reduce(function, views, out[start : start + count])

    def broadcast(self, flat: torch.Tensor, out: torch.Tensor, root: int) -> None:
        """The data phase of an inline broadcast of member ``root``'s ``flat`` (its head
        already signed) into every member's ``out``."""
        first = min(flat.numel(), self.room // flat.element_size())
        if self.rank == root:
            if out.data_ptr() != flat.data_ptr():
                out.copy_(flat)
        else:
            out[:first].copy_(self._heads_of(flat.dtype, first)[root])
        self.finish()
        per_chunk = max(1, (HALF_BYTES // flat.element_size()) // ALIGN * ALIGN)
        for start in range(first, flat.numel(), per_chunk):
            count = min(per_chunk, flat.numel() - start)
            half = self._next_half()
            if self.rank == root:
                self._halves[root][half].view(flat.dtype)[:count].copy_(flat[start:][:count])
            self._barrier()
            if self.rank != root:
                out[start:][:count].copy_(self._halves[root][half].view(flat.dtype)[:count])

    def abort(self) -> None:
        """Unblock every wait of this member; the lane is unusable afterwards."""
        self._segment.aborted = True
        self._segment.wake_all()

    def close(self) -> None:
        self._heads = []
        self._head_views = {}
        self._halves = []
        for line in self._lines:
            line.release()
        self._lines = []
        self._cells.release()
        self._layout.close()
        self._segment.close()

    # ------------------------------------------------------------- parts

    def _heads_of(self, dtype: torch.dtype, count: int) -> tuple[torch.Tensor, ...]:
        """Every member's head in use, as its first ``count`` elements of ``dtype``: made once
        per head, dtype and count (a view costs a small call's time), as normal tensors even in
        inference mode, so that a call in either mode may write them."""
        key = (self._head_in_use, dtype, count)
        views = self._head_views.get(key)
        if views is None:
            if len(self._head_views) >= HEAD_VIEWS_KEPT:
                self._head_views.clear()
            with torch.inference_mode(False):
                views = tuple(heads[self._head_in_use].view(dtype)[:count] for heads in self._heads)
            self._head_views[key] = views
        return views

    def _next_half(self) -> int:
        half = self._half
        self._half ^= 1
        return half

    def _barrier(self) -> None:
        """Arrive, and return once every other member has arrived as often."""
        self._arrivals += 1
        target = self._arrivals
        segment = self._segment
        segment.arrive_quietly(target)
        arrival = segment.arrival
        pending = [m for m in self._others if not reached(arrival(m), target)]
        if not pending:
            return
        until = time.monotonic() + self._spin_s
        while time.monotonic() < until:
            if all(reached(arrival(m), target) for m in pending):
                return
        self._sleep_until(target)

    def _wait(self, target: int, until: float) -> None:
        self._segment.wait_arrivals(self._others, target, until, flagged=True)

    def _sleep_until(self, target: int) -> None:
        """The slow part of a wait: sleep on the peers' counters, log a stall, time out."""
        started = time.monotonic()
        deadline = started + self._timeout_s
        told = self._stall_s <= 0
        while True:
            until = deadline if told else min(deadline, started + self._stall_s)
            try:
                self._barriers.wait(functools.partial(self._wait, target, until))
                return
            except TransportError:
                if told or time.monotonic() >= deadline:
                    raise
            told = True
            missing = [m for m in self._others if not reached(self._segment.arrival(m), target)]
            self._warn(missing, time.monotonic() - started)


def _reduce(
    function: Callable[..., torch.Tensor], views: Sequence[torch.Tensor], out: torch.Tensor
) -> None:
    """Reduce ``views`` into ``out``, in member order."""
    if not out.numel():
        return
    function(views[0], views[1], out=out)
    for view in views[2:]:
        function(out, view, out=out)


def _copy_scaled(target: torch.Tensor, source: torch.Tensor, factor: float) -> None:
    """``source`` into ``target``, multiplied by ``factor`` as the engine scales its buffer
    (:func:`hora.common.engine.buffers.scale`: integers via float64, truncating; halves via
    float32)."""
    if factor == 1.0:
        target.copy_(source)
    elif source.dtype in (torch.float16, torch.bfloat16):
        target.copy_(source.float().mul_(factor))
    elif not source.is_floating_point():
        target.copy_(source.double().mul_(factor).trunc_())
    else:
        torch.mul(source, factor, out=target)
