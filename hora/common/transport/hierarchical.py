"""Allreduce across hosts in three steps: within each host, across hosts, within each host again.

Members on one host share memory (:class:`~hora.common.transport.shm.ShmCommunicator`); only
what must cross hosts goes over the network. With ``L`` members on every host:

1. reduce-scatter within the host: local member ``l`` ends with shard ``l`` of the buffer,
   reduced over its host;
2. allreduce of shard ``l`` with the members of local rank ``l`` on the other hosts (Gloo, or
   MPI): every host's shard ``l`` is now the job's;
3. allgather within the host: every member has every shard.

Each member moves ``1/L`` of the buffer over the network, in parallel with its host's other
members. The other collectives (allgather, broadcast, alltoall, ...) use the flat communicator
among every member, as without a shared-memory path.

This module knows communicators and buffers; not requests or jobs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hora.common.transport import Communicator, Pending, Sizes
from hora.common.transport.shm import ShmCommunicator
from hora.common.vocabulary.message import ReduceOp


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
        flat = buffer.view(-1)
        parts = list(flat.tensor_split(self._local.size))
        shard = torch.empty_like(parts[self._local.rank])
        self._local.reducescatter_step(shard, parts, op)
        if self._cross.size > 1 and shard.numel():
            self._cross.allreduce_async(shard, op, timeout_s).wait()
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
