"""This member's view of a shared-memory segment: where each member's bytes lie.

A segment (:mod:`.shm_segment`) holds one slot per member and, for a set whose data stays on one
host, one arena per member. :class:`Layout` gives the communicator's algorithms those as tensors;
hands out buffers in this member's arena (first fit, whole pages: :class:`ArenaPages`); keeps
the staging block there that a buffer outside the arena is copied into; and reduces views in
member order, into this member's own view or a private scratch buffer.

It knows bytes, members and reductions; not barriers, nor which algorithm a collective takes.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from itertools import accumulate
from typing import Protocol

import torch

from hora.common.transport.shm_segment import Segment
from hora.common.vocabulary.message import ReduceOp


class Reduction(Protocol):
    """An element-wise reduction of two tensors into ``out``."""

    def __call__(
        self, first: torch.Tensor, second: torch.Tensor, /, *, out: torch.Tensor
    ) -> torch.Tensor: ...


REDUCTIONS: dict[ReduceOp, Reduction] = {
    ReduceOp.SUM: torch.add,
    ReduceOp.MIN: torch.minimum,
    ReduceOp.MAX: torch.maximum,
    ReduceOp.PRODUCT: torch.mul,
}
# Chunks are cut at multiples of this many bytes (any dtype's element size divides it).
ALIGN = 64
# Arena buffers are whole pages.
BLOCK = 4096


class Layout:
    """Member ``segment.rank``'s slots, arenas, staging block and scratch buffer.

    Attributes:
        rank, size: this member and the number of members.
        slots: every member's slot, as bytes (emptied by :meth:`close`).
        arenas: every member's arena, as bytes, or ``None`` each where the segment has none.
    """

    def __init__(self, segment: Segment) -> None:
        self.rank = segment.rank
        self.size = segment.size
        self._segment = segment
        self.slots = [torch.frombuffer(slot, dtype=torch.uint8) for slot in segment.slots]
        self._pages = ArenaPages(segment.arena_bytes)
        self._staging: torch.Tensor | None = None
        self._scratch: torch.Tensor | None = None
        self.arenas = [
            torch.frombuffer(segment.arena(m), dtype=torch.uint8) if segment.arena_bytes else None
            for m in range(self.size)
        ]

    # ------------------------------------------------------------- arenas

    def arena_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A buffer of ``numel`` elements in this member's arena; its memory returns to the
        arena once nothing refers to it. ``None`` when the arena has no room (or ``/dev/shm``
        none for its pages)."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        taken = self._pages.take(nbytes)
        if taken is None:
            return None
        offset, size = taken
        if not self._segment.reserve(offset, size):
            self._pages.give_back(offset, size)
            return None
        block = self._segment.arena_block(offset, size)
        weakref.finalize(block, self._pages.give_back, offset, size)
        return torch.frombuffer(block, dtype=torch.uint8)[:nbytes].view(dtype)

    def arena_offset(self, buffer: torch.Tensor) -> int | None:
        """Where ``buffer`` starts in this member's arena, or ``None`` when it is not there."""
        own = self.arenas[self.rank]
        if own is None:
            return None
        offset = buffer.data_ptr() - own.data_ptr()
        return offset if 0 <= offset < own.numel() else None

    def staged(self, flat: torch.Tensor) -> torch.Tensor | None:
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

    # ------------------------------------------------------------- reducing

    def reduce(self, views: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
        """``op`` over ``views`` in member order; the result lies in this member's view when
        that is safe (two members), else in a private scratch buffer."""
        function = REDUCTIONS[op]
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

    def close(self) -> None:
        """Let go of the slots' views and the scratch buffer (before the segment is closed)."""
        self.slots = []
        self._scratch = None


class ArenaPages:
    """Which bytes of this member's arena are free: first fit, in whole pages.

    A block comes back when the last view of it is dropped, by a finalizer that runs on
    whichever thread drops it, at any allocation of that thread: also inside :meth:`take` or
    :meth:`give_back` themselves, when the cyclic garbage collector runs there. So giving back
    never waits for the lock: the block joins a list of returned blocks (one atomic append),
    and whoever holds the lock next merges that list into the free ranges.
    """

    def __init__(self, nbytes: int) -> None:
        self._free = [(0, nbytes)] if nbytes else []
        self._returned: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> tuple[int, int] | None:
        size = max(BLOCK, -(-nbytes // BLOCK) * BLOCK)
        with self._lock:
            self._merge_returned()
            for index, (start, length) in enumerate(self._free):
                if length >= size:
                    if length == size:
                        del self._free[index]
                    else:
                        self._free[index] = (start + size, length - size)
                    return start, size
        return None

    def give_back(self, start: int, size: int) -> None:
        self._returned.append((start, size))
        if self._lock.acquire(blocking=False):  # else its holder, maybe this thread, merges
            try:
                self._merge_returned()
            finally:
                self._lock.release()

    def _merge_returned(self) -> None:
        """Move the returned blocks into the free ranges (under the lock)."""
        if not self._returned:
            return
        free = list(self._free)
        while self._returned:
            free.append(self._returned.pop())
        free.sort()
        merged: list[tuple[int, int]] = []
        for begin, length in free:
            if merged and merged[-1][0] + merged[-1][1] == begin:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((begin, length))
        self._free = merged


def part(count: int, size: int, member: int) -> tuple[int, int]:
    """Member ``member``'s share of ``count`` elements cut into ``size`` parts, 64-aligned."""
    share = -(-count // size)
    share = -(-share // ALIGN) * ALIGN
    low = min(count, member * share)
    return low, min(count, low + share)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as bytes (a view)."""
    flat = tensor.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def offsets(sizes: Sequence[int]) -> list[int]:
    """Where each of consecutive blocks of ``sizes`` bytes starts."""
    return list(accumulate(sizes, initial=0))[:-1]
