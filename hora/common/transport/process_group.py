"""What the Gloo and NCCL transports share: a ``torch.distributed`` backend (``ProcessGroupGloo``
or ``ProcessGroupNCCL``) built directly on a store, behind hora's communicator protocol.

:class:`ProcessGroupCommunicator` issues every collective and maps the library's errors to
:class:`~hora.common.transport.TransportError`; a subclass builds its backend and says how a
started operation is waited for (:meth:`ProcessGroupCommunicator._pending`). This module knows
backends and buffers, never requests or names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as _dist

from hora.common.transport import Pending, TransportError
from hora.common.vocabulary.message import ReduceOp

# torch.distributed's stubs omit the process-group methods used here.
dist: Any = _dist

REDUCE_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}


class WorkPending:
    """A started operation (``torch.distributed``'s ``Work``), waited for on the host."""

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


class ProcessGroupCommunicator:
    """Collectives on one ``torch.distributed`` backend among ``size`` members.

    Attributes:
        rank, size: this member and the number of members.
        device: where the backend's buffers live (``cpu`` for Gloo, a GPU for NCCL).
    """

    rank: int
    size: int
    device: torch.device

    def __init__(self, backend: Any, rank: int, size: int, device: torch.device) -> None:
        self.rank = rank
        self.size = size
        self.device = device
        self._pg: Any = backend
        self._aborted = False
        self._allreduce_options: dict[tuple[ReduceOp, float | None], Any] = {}

    def _pending(self, work: Any, timeout_s: float | None = None) -> Pending:
        """How a started operation is waited for (the host waits for ``Work.wait``);
        ``timeout_s``: the operation's own time limit, when it has one."""
        return WorkPending(work)

    def _check(self) -> None:
        if self._aborted:
            raise TransportError("the communicator was aborted")

    def _run(self, work_fn: Callable[[], Any]) -> None:
        self._check()
        try:
            work = work_fn()
        except RuntimeError as exc:
            raise TransportError(str(exc)) from exc
        self._pending(work).wait()

    def allreduce(self, buffer: torch.Tensor, op: ReduceOp) -> None:
        self.allreduce_async(buffer, op).wait()

    def allreduce_async(
        self, buffer: torch.Tensor, op: ReduceOp, timeout_s: float | None = None
    ) -> Pending:
        self._check()
        # Made once per op and timeout: the steady state starts one allreduce per batch.
        options = self._allreduce_options.get((op, timeout_s))
        if options is None:
            options = dist.AllreduceOptions()
            options.reduceOp = REDUCE_OPS[op]
            if timeout_s is not None:
                options.timeout = timedelta(seconds=timeout_s)
            self._allreduce_options[(op, timeout_s)] = options
        try:
            return self._pending(self._pg.allreduce([buffer], options), timeout_s)
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
        options.reduceOp = REDUCE_OPS[op]
        self._run(lambda: self._pg.reduce_scatter([output], [list(chunks)], options))

    def sendrecv(self, send: torch.Tensor, receive: torch.Tensor, peer: int) -> None:
        self._check()
        try:
            # Both directions are started before either is waited for: a blocking send first
            # on both sides would wait for a receive that is never posted.
            works = []
            if send.numel():
                works.append(self._pg.send([send], peer, 0))
            if receive.numel():
                works.append(self._pg.recv([receive], peer, 0))
        except RuntimeError as exc:
            raise TransportError(str(exc)) from exc
        for work in works:
            self._pending(work).wait()

    def barrier(self) -> None:
        self._run(lambda: self._pg.barrier())

    def close(self) -> None:
        """Release the backend now: its worker threads hold tensors, and destroying it during
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
