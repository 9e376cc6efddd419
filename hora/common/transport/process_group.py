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
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as _dist

from hora.common.transport import Pending, Sizes, TransportError
from hora.common.vocabulary.message import ReduceOp

if TYPE_CHECKING:
    from torch.distributed import Work

# torch.distributed's stubs omit the backends' constructors and options as hora uses them
# (ProcessGroupGloo's ``_Options``, the store argument): the Gloo and NCCL transports build
# their backends through this name, and type what they get back as a :class:`Backend`.
dist: Any = _dist

REDUCE_OPS: dict[ReduceOp, _dist.ReduceOp] = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}


class Backend(Protocol):
    """What hora calls of a ``torch.distributed`` backend (``ProcessGroupGloo``,
    ``ProcessGroupNCCL``): its collectives, each returning the started ``Work``."""

    def allreduce(self, tensors: list[torch.Tensor], options: _dist.AllreduceOptions) -> Work: ...

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> Work: ...

    def broadcast(self, tensors: list[torch.Tensor], options: _dist.BroadcastOptions) -> Work: ...

    def alltoall_base(
        self,
        output: torch.Tensor,
        source: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        options: _dist.AllToAllOptions,
    ) -> Work: ...

    def reduce_scatter(
        self,
        outputs: list[torch.Tensor],
        inputs: list[list[torch.Tensor]],
        options: _dist.ReduceScatterOptions,
    ) -> Work: ...

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> Work: ...

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> Work: ...

    def barrier(self) -> Work: ...

    def shutdown(self) -> None: ...

    def abort(self) -> None: ...


class WorkPending:
    """A started operation (``torch.distributed``'s ``Work``), waited for on the host."""

    __slots__ = ("_work",)

    def __init__(self, work: Work) -> None:
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

    def __init__(self, backend: Backend, rank: int, size: int, device: torch.device) -> None:
        self.rank = rank
        self.size = size
        self.device = device
        # None once closed.
        self._pg: Backend | None = backend
        self._aborted = False
        self._allreduce_options: dict[tuple[ReduceOp, float | None], _dist.AllreduceOptions] = {}

    def _pending(self, work: Work, timeout_s: float | None = None) -> Pending:
        """How a started operation is waited for (the host waits for ``Work.wait``);
        ``timeout_s``: the operation's own time limit, when it has one."""
        return WorkPending(work)

    def _backend(self) -> Backend:
        """The backend, for an operation to start on it.

        Raises:
            TransportError: the communicator was aborted or closed.
        """
        pg = self._pg
        if self._aborted or pg is None:
            raise TransportError("the communicator was aborted")
        return pg

    def _run(self, start: Callable[[Backend], Work]) -> None:
        pg = self._backend()
        try:
            work = start(pg)
        except RuntimeError as exc:
            raise TransportError(str(exc)) from exc
        self._pending(work).wait()

    def allreduce(self, buffer: torch.Tensor, op: ReduceOp) -> None:
        self.allreduce_async(buffer, op).wait()

    def allreduce_async(
        self, buffer: torch.Tensor, op: ReduceOp, timeout_s: float | None = None
    ) -> Pending:
        pg = self._backend()
        # Made once per op and timeout: the steady state starts one allreduce per batch.
        options = self._allreduce_options.get((op, timeout_s))
        if options is None:
            options = _dist.AllreduceOptions()
            options.reduceOp = REDUCE_OPS[op]
            if timeout_s is not None:
                options.timeout = timedelta(seconds=timeout_s)
            self._allreduce_options[(op, timeout_s)] = options
        try:
            return self._pending(pg.allreduce([buffer], options), timeout_s)
        except RuntimeError as exc:
            raise TransportError(str(exc)) from exc

    def allgather(self, outputs: Sequence[torch.Tensor], buffer: torch.Tensor) -> None:
        self._run(lambda pg: pg.allgather([list(outputs)], [buffer]))

    def broadcast(self, buffer: torch.Tensor, root: int) -> None:
        options = _dist.BroadcastOptions()
        options.rootRank = root
        options.rootTensor = 0
        self._run(lambda pg: pg.broadcast([buffer], options))

    def alltoall(
        self, output: torch.Tensor, buffer: torch.Tensor, output_splits: Sizes, input_splits: Sizes
    ) -> None:
        options = _dist.AllToAllOptions()
        self._run(
            lambda pg: pg.alltoall_base(
                output, buffer, list(output_splits), list(input_splits), options
            )
        )

    def reducescatter(
        self, output: torch.Tensor, chunks: Sequence[torch.Tensor], op: ReduceOp
    ) -> None:
        options = _dist.ReduceScatterOptions()
        options.reduceOp = REDUCE_OPS[op]
        self._run(lambda pg: pg.reduce_scatter([output], [list(chunks)], options))

    def sendrecv(self, send: torch.Tensor, receive: torch.Tensor, peer: int) -> None:
        pg = self._backend()
        try:
            # Both directions are started before either is waited for: a blocking send first
            # on both sides would wait for a receive that is never posted.
            works = []
            if send.numel():
                works.append(pg.send([send], peer, 0))
            if receive.numel():
                works.append(pg.recv([receive], peer, 0))
        except RuntimeError as exc:
            raise TransportError(str(exc)) from exc
        for work in works:
            self._pending(work).wait()

    def barrier(self) -> None:
        self._run(lambda pg: pg.barrier())

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
