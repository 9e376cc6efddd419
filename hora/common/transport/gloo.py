"""Collectives over ``torch.distributed``'s Gloo process groups.

Each :class:`GlooCommunicator` owns one ``ProcessGroupGloo`` built directly on a store, so hora
never touches the default process group that users (and PyTorch DDP) may be using themselves.
This module knows about process groups and buffers, never about requests or names.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as _dist

from hora.common.message import ReduceOp
from hora.common.transport import TransportError

# torch.distributed's stubs omit the process-group methods used here.
dist: Any = _dist

_REDUCE_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}


def gloo_available() -> bool:
    return bool(dist.is_available() and dist.is_gloo_available())


# The soft limit on open files that hora raises a worker to (never above the hard limit).
OPEN_FILES_WANTED = 65536


def raise_open_file_limit(wanted: int = OPEN_FILES_WANTED) -> tuple[int, int]:
    """Raise this process's soft limit on open files towards ``wanted`` (within the hard limit).

    Gloo accepts every connection to its listening ports and keeps it; hora cannot refuse them
    (docs/security.md). Many systems start processes with a soft limit of 1024 under a much
    higher hard limit; raising it leaves the worker room for its own pairs when stray
    connections arrive. Returns the ``(old, new)`` soft limit.
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return soft, target
        except (ValueError, OSError):
            pass
    return soft, soft


def make_device(bind_address: str, interface: str) -> Any:
    """The Gloo network device: a named interface, an address, or Gloo's default."""
    if interface:
        return dist.ProcessGroupGloo.create_device(interface=interface)
    if bind_address:
        return dist.ProcessGroupGloo.create_device(hostname=bind_address)
    return dist.ProcessGroupGloo.create_default_device()


class _GlooPending:
    """A started Gloo operation (``torch.distributed``'s ``Work``)."""

    __slots__ = ("_work",)

    def __init__(self, work: Any) -> None:
        self._work = work

    def wait(self, timeout_s: float | None = None) -> bool:
        work = self._work
        try:
            if timeout_s is None:
                work.wait()
            else:
                work.wait(timeout=timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            if timeout_s is None:
                raise TransportError(str(exc)) from exc
            if not work.is_completed():
                return False  # still running: only this wait timed out
            # It finished (or failed) as the wait timed out: its own outcome.
            return self.wait()
        return True


class GlooCommunicator:
    """A Gloo process group among ``size`` members, this process being member ``rank``.

    Args:
        store: a ``torch.distributed.Store`` private to this group (a ``PrefixStore``).
        rank: this process's rank within the group.
        size: number of members.
        timeout_s: how long any one operation may wait for its peers.
        device: the Gloo device from :func:`make_device`.
    """

    def __init__(self, store: Any, rank: int, size: int, timeout_s: float, device: Any) -> None:
        self.rank = rank
        self.size = size
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timedelta(seconds=timeout_s)
        options._devices = [device]
        try:
            self._pg: Any = dist.ProcessGroupGloo(store, rank, size, options)
        except RuntimeError as exc:
            raise TransportError(f"could not connect the Gloo group: {exc}") from exc
        self._aborted = False
        self._allreduce_options: dict[tuple[ReduceOp, float | None], Any] = {}

    def _run(self, work_fn: Any) -> None:
        if self._aborted:
            raise TransportError("the communicator was aborted")
        try:
            work_fn().wait()
        except RuntimeError as exc:
            raise TransportError(str(exc)) from exc

    def allreduce(self, buffer: torch.Tensor, op: ReduceOp) -> None:
        self.allreduce_async(buffer, op).wait()

    def allreduce_async(
        self, buffer: torch.Tensor, op: ReduceOp, timeout_s: float | None = None
    ) -> _GlooPending:
        if self._aborted:
            raise TransportError("the communicator was aborted")
        # Made once per op and timeout: the steady state starts one allreduce per batch.
        options = self._allreduce_options.get((op, timeout_s))
        if options is None:
            options = dist.AllreduceOptions()
            options.reduceOp = _REDUCE_OPS[op]
            if timeout_s is not None:
                options.timeout = timedelta(seconds=timeout_s)
            self._allreduce_options[(op, timeout_s)] = options
        try:
            return _GlooPending(self._pg.allreduce([buffer], options))
        except RuntimeError as exc:
            raise TransportError(str(exc)) from exc

    def allgather(self, outputs: Sequence[torch.Tensor], buffer: torch.Tensor) -> None:
        self._run(lambda: self._pg.allgather([list(outputs)], [buffer]))

    def broadcast(self, buffer: torch.Tensor, root: int) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = root
        options.rootTensor = 0
        self._run(lambda: self._pg.broadcast([buffer], options))

    def alltoall(
        self,
        output: torch.Tensor,
        buffer: torch.Tensor,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
    ) -> None:
        options = dist.AllToAllOptions()
        self._run(
            lambda: self._pg.alltoall_base(
                output, buffer, list(output_splits), list(input_splits), options
            )
        )

    def reducescatter(
        self, output: torch.Tensor, chunks: Sequence[torch.Tensor], op: ReduceOp
    ) -> None:
        options = dist.ReduceScatterOptions()
        options.reduceOp = _REDUCE_OPS[op]
        self._run(lambda: self._pg.reduce_scatter([output], [list(chunks)], options))

    def sendrecv(self, send: torch.Tensor, receive: torch.Tensor, peer: int) -> None:
        if self._aborted:
            raise TransportError("the communicator was aborted")
        try:
            # Both directions are started before either is waited for: a blocking send first
            # on both sides would wait for a receive that is never posted.
            works = []
            if send.numel():
                works.append(self._pg.send([send], peer, 0))
            if receive.numel():
                works.append(self._pg.recv([receive], peer, 0))
            for work in works:
                work.wait()
        except RuntimeError as exc:
            raise TransportError(str(exc)) from exc

    def barrier(self) -> None:
        self._run(lambda: self._pg.barrier())

    def close(self) -> None:
        """Release the group now: its worker threads hold tensors, and destroying it during
        interpreter shutdown can abort the process (pytorch/pytorch#179291)."""
        pg, self._pg = self._pg, None
        self._aborted = True
        if pg is not None:
            try:
                pg.shutdown()
            except RuntimeError:
                pass
            del pg

    def abort(self) -> None:
        if self._aborted:
            return
        self._aborted = True
        pg = self._pg
        if pg is None:
            return
        try:
            pg.abort()
        except RuntimeError:
            pass
