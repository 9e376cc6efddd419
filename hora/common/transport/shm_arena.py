"""The allreduce of buffers in the members' arenas, reduced where they lie.

Where the engine's steady state keeps its batches in the members' arenas
(:meth:`~hora.common.transport.shm.ShmCommunicator.arena_buffer`), an allreduce from
:data:`ARENA_FROM_BYTES` up copies nothing in or out: each member publishes where its buffer
lies; barrier; member ``r`` reduces part ``r`` across every member's buffer, in member order,
into its own buffer; barrier; each member copies the other parts from their reducers' buffers;
barrier. A buffer outside the arena is first copied into the staging block there. Where some
member's data cannot be put in its arena, every member takes the slots' way instead (they all
see the published places, so they agree).

:class:`ArenaAllreduce` decides and runs that way; the arenas are the
:class:`~.shm_layout.Layout`'s. It knows buffers and members; not requests.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hora.common.transport import TransportError
from hora.common.transport.shm_barriers import Barriers
from hora.common.transport.shm_layout import BLOCK, Layout, part
from hora.common.transport.shm_segment import Segment
from hora.common.vocabulary.message import ReduceOp

# Allreduces of fewer bytes go through the slots even where buffers lie in the arenas: the
# arenas' way waits three times, the slots' once, and for small buffers the waits cost more
# than the copies they save.
ARENA_FROM_BYTES = 256 * 1024


class ArenaAllreduce:
    """Allreduces of buffers that every member holds in its arena.

    Args:
        segment: the mapped segment (this member's view), where members publish their blocks.
        layout: every member's arena.
        barriers: this member's barriers.
        describe: how errors name a member.
    """

    def __init__(
        self,
        segment: Segment,
        layout: Layout,
        barriers: Barriers,
        describe: Callable[[int], str],
    ) -> None:
        self._segment = segment
        self._layout = layout
        self._barriers = barriers
        self._describe = describe
        self._rank = segment.rank
        self._size = segment.size
        self._others = [m for m in range(segment.size) if m != segment.rank]

    def allreduce(self, flat: torch.Tensor, op: ReduceOp, deadline: float) -> bool:
        """Reduce ``flat`` in the arenas and return ``True``; or return ``False``, every member
        alike, when the allreduce must go through the slots (small, or some member's data not
        in its arena)."""
        nbytes = flat.numel() * flat.element_size()
        # Small buffers take the slots' way, wherever they lie: one barrier instead of three,
        # and every member knows the size, so all of them take it without asking.
        if self._layout.arenas[self._rank] is None or nbytes < ARENA_FROM_BYTES:
            return False
        # Every member says where its data lies before the first barrier, and all of them then
        # take the same way: through the arenas where every member's data is in its arena
        # (a buffer outside it is copied into a staging block when one can be had), else
        # through the slots.
        work: torch.Tensor | None = flat
        offset = self._layout.arena_offset(flat)
        if offset is None:
            work = self._layout.staged(flat)
            offset = None if work is None else self._layout.arena_offset(work)
        self._segment.publish_block(offset, nbytes)
        self._barriers.barrier(deadline)
        if work is None or not self._every_block_published():
            return False
        self._reduce_where_they_lie(work, op, deadline)
        if work is not flat:
            flat.copy_(work)
        return True

    def _every_block_published(self) -> bool:
        return all(self._segment.block_of(m)[0] >= 0 for m in self._others)

    def _reduce_where_they_lie(self, flat: torch.Tensor, op: ReduceOp, deadline: float) -> None:
        """Reduce buffers that lie in every member's arena, each where it lies (every member
        has published its buffer, and passed the barrier after)."""
        buffers = self._buffers(flat)
        low, high = part(flat.numel(), self._size, self._rank)
        if high > low:
            shares = [b[low:high] for b in buffers]
            result = self._layout.reduce(shares, op)
            if result is not shares[self._rank]:  # more than two members: from the scratch
                shares[self._rank].copy_(result)
        self._barriers.barrier(deadline)
        # Each member's share of the result lies in its own buffer: take the others'.
        for member in self._others:
            low, high = part(flat.numel(), self._size, member)
            if high > low:
                flat[low:high].copy_(buffers[member][low:high])
        self._barriers.barrier(deadline)

    def _buffers(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Every member's buffer, in member order: ``flat`` for this one, the others where
        they published them."""
        nbytes = flat.numel() * flat.element_size()
        buffers = []
        for member in range(self._size):
            if member == self._rank:
                buffers.append(flat)
                continue
            start, published = self._segment.block_of(member)
            arena = self._layout.arenas[member]
            assert arena is not None
            if published != -(-nbytes // BLOCK) * BLOCK or start + nbytes > arena.numel():
                raise TransportError(
                    f"{self._describe(member)} reduces a buffer of {published} bytes in "
                    f"shared memory, this member one of {nbytes}"
                )
            buffers.append(arena[start : start + nbytes].view(flat.dtype))
        return buffers
