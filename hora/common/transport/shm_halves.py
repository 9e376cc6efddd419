"""The two-member allreduce, and the exchange, through alternating halves of the slots.

Each member copies its chunk into one half of its slot; one barrier; each reads every member's
half (two members reduce the two halves straight into their own buffers, both computing the
same sum in the same order). The halves alternate from one chunk or exchange to the next, so
the next one's barrier is also what tells a member that its peers have read the previous one:
one barrier per chunk. An operation that writes whole slots first passes the fence this leaves
(:meth:`~hora.common.transport.shm_barriers.Barriers.fence`).

:class:`Halves` owns which half is next; the slots are the :class:`~.shm_layout.Layout`'s and the
barriers the :class:`~.shm_barriers.Barriers`'. It knows buffers and members; not requests.
"""

from __future__ import annotations

import torch

from hora.common.transport.shm_barriers import Barriers
from hora.common.transport.shm_layout import ALIGN, REDUCTIONS, Layout
from hora.common.transport.shm_segment import Segment
from hora.common.vocabulary.message import ReduceOp


class Halves:
    """Operations of one barrier per chunk, through alternating halves of the slots.

    Args:
        segment: the mapped segment (this member's view): its slots as bytes.
        layout: its slots as tensors.
        barriers: this member's barriers.

    Attributes:
        half_bytes: the bytes of half a slot: the most :meth:`exchange` takes.
    """

    def __init__(self, segment: Segment, layout: Layout, barriers: Barriers) -> None:
        self.half_bytes = segment.slot_bytes // 2
        self._segment = segment
        self._layout = layout
        self._barriers = barriers
        self._half = 0

    def allreduce(self, flat: torch.Tensor, op: ReduceOp, deadline: float) -> None:
        """Two members: both reduce every element, from alternating halves of their slots."""
        half_bytes = self.half_bytes
        per_chunk = max(1, (half_bytes // flat.element_size()) // ALIGN * ALIGN)
        function = REDUCTIONS[op]
        slots, rank = self._layout.slots, self._layout.rank
        for start in range(0, flat.numel(), per_chunk):
            count = min(per_chunk, flat.numel() - start)
            offset = self._half * half_bytes
            self._half ^= 1
            halves = [s[offset : offset + half_bytes].view(flat.dtype)[:count] for s in slots]
            target = flat[start : start + count]
            halves[rank].copy_(target)
            self._barriers.barrier(deadline)
            function(halves[0], halves[1], out=target)
        self._barriers.leave_unfenced()

    def exchange(self, data: bytes, deadline: float) -> list[bytes]:
        """Every member's ``data`` (the same length on every member, at most
        :attr:`half_bytes`), in member order."""
        offset = self._half * self.half_bytes
        self._half ^= 1
        views = self._segment.slots
        views[self._layout.rank][offset : offset + len(data)] = data
        self._barriers.barrier(deadline)
        self._barriers.leave_unfenced()
        return [bytes(view[offset : offset + len(data)]) for view in views]
