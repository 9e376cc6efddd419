"""The collectives that go through whole slots of a shared-memory segment.

Every one runs in chunks that fit a slot, each chunk in phases separated by barriers:

- allreduce among more than two members: each member copies its chunk into its slot; barrier;
  member ``r`` reduces part ``r`` of the chunk across every slot, in member order (so results
  are deterministic for a given number of members), and writes the result into part ``r`` of
  every slot; barrier; each member copies the whole chunk back from its own slot.
- allgather, broadcast, reducescatter, alltoall: write, barrier, read, barrier.
- sendrecv: the pair's own counters; the other members take no part.

Each first passes the fence of an operation through alternating half-slots
(:mod:`.shm_halves`), since it overwrites the halves its peers may not have read yet.

:class:`SlotCollectives` holds no state of its own: the slots are the
:class:`~.shm_layout.Layout`'s, the counters the :class:`~.shm_barriers.Barriers`'. It knows
buffers and members; not requests.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hora.common.transport import Sizes
from hora.common.transport.shm_barriers import Barriers
from hora.common.transport.shm_layout import ALIGN, REDUCTIONS, Layout, as_bytes, offsets, part
from hora.common.transport.shm_segment import Segment
from hora.common.vocabulary.message import ReduceOp


class SlotCollectives:
    """Collectives through the slots, each on the calling thread.

    Args:
        segment: the mapped segment (this member's view).
        layout: its slots as tensors.
        barriers: this member's barriers.
    """

    def __init__(self, segment: Segment, layout: Layout, barriers: Barriers) -> None:
        self._slot_bytes = segment.slot_bytes
        self._layout = layout
        self._barriers = barriers
        self._rank = layout.rank
        self._size = layout.size

    def allreduce(self, flat: torch.Tensor, op: ReduceOp, deadline: float) -> None:
        """More than two members: chunk by chunk, each member reduces its part of every slot."""
        self._barriers.fence(deadline)
        itemsize = flat.element_size()
        per_chunk = max(1, (self._slot_bytes // itemsize) // ALIGN * ALIGN)
        own = self._layout.slots[self._rank].view(flat.dtype)
        for start in range(0, flat.numel(), per_chunk):
            count = min(per_chunk, flat.numel() - start)
            own[:count].copy_(flat[start : start + count])
            self._reduce_chunk(flat.dtype, count, op, deadline)
            flat[start : start + count].copy_(own[:count])

    def _reduce_chunk(self, dtype: torch.dtype, count: int, op: ReduceOp, deadline: float) -> None:
        """Reduce the first ``count`` elements of every slot into every slot."""
        self._barriers.barrier(deadline)
        low, high = part(count, self._size, self._rank)
        if high > low:
            views = [slot.view(dtype)[low:high] for slot in self._layout.slots]
            result = self._layout.reduce(views, op)
            for view in views:
                if view is not result:
                    view.copy_(result)
        self._barriers.barrier(deadline)

    def allgather(self, outputs: Sequence[torch.Tensor], buffer: torch.Tensor) -> None:
        """Gather every member's ``buffer`` into ``outputs[member]``; the members' buffers may
        differ in size (``outputs`` says how)."""
        deadline = self._barriers.deadline()
        self._barriers.fence(deadline)
        source = as_bytes(buffer)
        targets = [as_bytes(out) for out in outputs]
        step = self._slot_bytes
        slots = self._layout.slots
        own = slots[self._rank]
        longest = max(t.numel() for t in targets)
        for start in range(0, max(longest, 1), step):
            count = max(0, min(step, source.numel() - start))
            own[:count].copy_(source[start : start + count])
            self._barriers.barrier(deadline)
            for member, target in enumerate(targets):
                got = max(0, min(step, target.numel() - start))
                target[start : start + got].copy_(slots[member][:got])
            self._barriers.barrier(deadline)

    def broadcast(self, buffer: torch.Tensor, root: int) -> None:
        deadline = self._barriers.deadline()
        self._barriers.fence(deadline)
        data = as_bytes(buffer)
        step = self._slot_bytes
        slots = self._layout.slots
        for start in range(0, max(data.numel(), 1), step):
            count = min(step, data.numel() - start)
            if self._rank == root:
                slots[root][:count].copy_(data[start : start + count])
            self._barriers.barrier(deadline)
            if self._rank != root:
                data[start : start + count].copy_(slots[root][:count])
            self._barriers.barrier(deadline)

    def reducescatter(
        self, output: torch.Tensor, chunks: Sequence[torch.Tensor], op: ReduceOp
    ) -> None:
        deadline = self._barriers.deadline()
        self._barriers.fence(deadline)
        flats = [chunk.reshape(-1) for chunk in chunks]
        out = output.view(-1)
        dtype = out.dtype
        longest = max(f.numel() for f in flats)
        window = max(1, self._slot_bytes // (self._size * out.element_size()))
        slots = self._layout.slots
        own = slots[self._rank].view(dtype)
        function = REDUCTIONS[op]
        for start in range(0, max(longest, 1), window):
            counts = [max(0, min(window, f.numel() - start)) for f in flats]
            for member, flat in enumerate(flats):
                own[member * window : member * window + counts[member]].copy_(
                    flat[start : start + counts[member]]
                )
            self._barriers.barrier(deadline)
            mine = counts[self._rank]
            if mine:
                base = self._rank * window
                views = [slot.view(dtype)[base : base + mine] for slot in slots]
                target = out[start : start + mine]
                function(views[0], views[1], out=target) if self._size > 1 else target.copy_(
                    views[0]
                )
                for view in views[2:]:
                    function(target, view, out=target)
            self._barriers.barrier(deadline)

    def alltoall(
        self, output: torch.Tensor, buffer: torch.Tensor, output_splits: Sizes, input_splits: Sizes
    ) -> None:
        deadline = self._barriers.deadline()
        self._barriers.fence(deadline)
        rows = buffer.shape[0] if buffer.dim() else 0
        row_bytes = (as_bytes(buffer).numel() // rows) if rows else 0
        if not row_bytes and output.dim() and output.shape[0]:
            row_bytes = as_bytes(output).numel() // output.shape[0]
        sent = [int(s) * row_bytes for s in input_splits]
        received = [int(s) * row_bytes for s in output_splits]
        # Every member learns every member's sizes, so that all agree on the rounds' chunks.
        sizes = torch.tensor(sent, dtype=torch.int64)
        table = torch.empty(self._size * self._size, dtype=torch.int64)
        self.allgather(list(table.split(self._size)), sizes)
        matrix = table.view(self._size, self._size).tolist()
        source, target = as_bytes(buffer), as_bytes(output)
        sent_at = offsets(sent)
        received_at = offsets(received)
        step = self._slot_bytes
        slots = self._layout.slots
        own = slots[self._rank]
        for shift in range(self._size):
            to, frm = (self._rank + shift) % self._size, (self._rank - shift) % self._size
            # The round's biggest transfer sets its number of chunks, the same on every member.
            biggest = max(matrix[m][(m + shift) % self._size] for m in range(self._size))
            for start in range(0, biggest, step):
                out_count = max(0, min(step, sent[to] - start))
                own[:out_count].copy_(source[sent_at[to] + start : sent_at[to] + start + out_count])
                self._barriers.barrier(deadline)
                in_count = max(0, min(step, received[frm] - start))
                target[received_at[frm] + start : received_at[frm] + start + in_count].copy_(
                    slots[frm][:in_count]
                )
                self._barriers.barrier(deadline)

    def sendrecv(self, send: torch.Tensor, receive: torch.Tensor, peer: int) -> None:
        deadline = self._barriers.deadline()
        self._barriers.fence(deadline)
        outgoing, incoming = as_bytes(send), as_bytes(receive)
        step = self._slot_bytes
        slots = self._layout.slots
        own = slots[self._rank]
        for start in range(0, max(outgoing.numel(), incoming.numel(), 1), step):
            count = max(0, min(step, outgoing.numel() - start))
            own[:count].copy_(outgoing[start : start + count])
            mark = self._barriers.next_mark(peer)
            self._barriers.meet(peer, mark, 0, deadline)
            got = max(0, min(step, incoming.numel() - start))
            incoming[start : start + got].copy_(slots[peer][:got])
            self._barriers.meet(peer, mark, 1, deadline)
