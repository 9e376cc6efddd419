"""Allreduce across hosts in three steps: within each host, across hosts, within each host again.

Members on one host share memory (:class:`~hora.common.transport.shm.ShmCommunicator`); only
what must cross hosts goes over the network. With ``L`` members on every host:

1. reduce-scatter within the host: local member ``l`` ends with shard ``l`` of the buffer,
   reduced over its host;
2. allreduce of shard ``l`` with the members of local rank ``l`` on the other hosts (Gloo, or
   MPI): every host's shard ``l`` is now the job's;
3. allgather within the host: every member has every shard.

Each member moves ``1/L`` of the buffer over the network, in parallel with its host's other
members. Buffers of several MiB go through the three steps in chunks, so that the network is
busy while the members reduce and gather the chunks before and after the one it carries: the
shared-memory steps of a large buffer then cost little beyond the network's time (two hosts of
two ranks over 1 Gbit/s links: 64 MiB in 0.59-0.60 s, 90% of what the links allow, against
0.75-0.93 s unpipelined; docs/cluster.md). The other collectives (allgather, broadcast,
alltoall, ...) use the flat communicator among every member, as without a shared-memory path.

This module knows communicators and buffers; not requests or jobs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from hora.common.transport import FINISHED, Communicator, Pending, Sizes
from hora.common.transport.shm import ShmCommunicator
from hora.common.vocabulary.message import ReduceOp

# Chunks of at least this many bytes, at most this many of them: each chunk costs two
# shared-memory steps and one cross-host allreduce of fixed overhead, so small buffers stay
# whole. 1 MiB chunks, up to 64, three in flight: on two hosts of two ranks over 1 Gbit/s (the emulated
# cluster of docs/cluster.md), 2 MiB chunks with two in flight were a few % slower at 16 and
# 64 MiB, and no chunks at all 15-25% slower.
PIPELINE_CHUNK_BYTES = 1 << 20
PIPELINE_MAX_CHUNKS = 64
# Cross-host allreduces a member keeps in flight before it waits for the oldest.
PIPELINE_DEPTH = 3


def pipeline_chunks(nbytes: int) -> int:
    """How many chunks the allreduce of ``nbytes`` is pipelined in (1: not at all)."""
    return max(1, min(PIPELINE_MAX_CHUNKS, nbytes // PIPELINE_CHUNK_BYTES))


class HierarchicalCommunicator:
    """Every member of a set that spans hosts with the same number of members on each.

    Args:
        flat: a communicator among every member (the other collectives use it).
        local: this host's members, through shared memory (its ``start`` runs the steps).
        cross: the members of this local rank on every host.

    Attributes:
        rank, size, device: as ``flat``'s.
        path: ``hierarchical``, for the timeline and ``hora doctor``.
    """

    path = "hierarchical"

    def __init__(self, flat: Communicator, local: ShmCommunicator, cross: Communicator) -> None:
        self.rank = flat.rank
        self.size = flat.size
        self.device = flat.device
        self._flat = flat
        self._local = local
        self._cross = cross

    def _steps(self, buffer: torch.Tensor, op: ReduceOp, timeout_s: float | None) -> None:
        """The three steps, pipelined over chunks of the buffer (see :func:`pipeline_chunks`):
        chunk ``k`` is reduced within the host and sent across hosts while the network still
        carries the chunks before it, and gathered within the host once its
        cross-host allreduce is done. Every member of a host runs the same schedule, so their
        shared-memory steps line up whatever the network does."""
        flat = buffer.view(-1)
        chunks = flat.tensor_split(pipeline_chunks(flat.numel() * flat.element_size()))
        in_flight: deque[tuple[list[torch.Tensor], torch.Tensor, Pending]] = deque()
        for chunk in chunks:
            parts = list(chunk.tensor_split(self._local.size))
            shard = torch.empty_like(parts[self._local.rank])
            self._local.reducescatter_step(shard, parts, op)
            pending: Pending = FINISHED
            if self._cross.size > 1 and shard.numel():
                pending = self._cross.allreduce_async(shard, op, timeout_s)
            in_flight.append((parts, shard, pending))
            if len(in_flight) > PIPELINE_DEPTH:
                self._gather(*in_flight.popleft())
        while in_flight:
            self._gather(*in_flight.popleft())

    def _gather(self, parts: list[torch.Tensor], shard: torch.Tensor, pending: Pending) -> None:
        pending.wait()
        self._local.allgather_step(parts, shard)

    def allreduce(self, buffer: torch.Tensor, op: ReduceOp) -> None:
        self.allreduce_async(buffer, op).wait()

    def allreduce_async(
        self, buffer: torch.Tensor, op: ReduceOp, timeout_s: float | None = None
    ) -> Pending:
        return self._local.start(lambda: self._steps(buffer, op, timeout_s))

    def allgather(self, outputs: Sequence[torch.Tensor], buffer: torch.Tensor) -> None:
        self._flat.allgather(outputs, buffer)

    def broadcast(self, buffer: torch.Tensor, root: int) -> None:
        self._flat.broadcast(buffer, root)

    def alltoall(
        self, output: torch.Tensor, buffer: torch.Tensor, output_splits: Sizes, input_splits: Sizes
    ) -> None:
        self._flat.alltoall(output, buffer, output_splits, input_splits)

    def reducescatter(
        self, output: torch.Tensor, chunks: Sequence[torch.Tensor], op: ReduceOp
    ) -> None:
        self._flat.reducescatter(output, chunks, op)

    def sendrecv(self, send: torch.Tensor, receive: torch.Tensor, peer: int) -> None:
        self._flat.sendrecv(send, receive, peer)

    def barrier(self) -> None:
        self._flat.barrier()

    def close(self) -> None:
        for comm in (self._local, self._cross, self._flat):
            comm.close()

    def abort(self) -> None:
        for comm in (self._local, self._cross, self._flat):
            comm.abort()
