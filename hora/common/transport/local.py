"""An in-process transport: threads of one process stand in for the ranks of a job.

:func:`local_group` returns one :class:`LocalCommunicator` per member; each member's calls run
on its own thread, and the collectives meet in shared memory. It implements the same
:class:`~hora.common.transport.Communicator` protocol as the Gloo transport, with the same
matching rule (every member starts the same operations in the same order), so the engine's
parts (executors, Adasum, the steady state's batches) can be tested in milliseconds without
processes. Multi-process tests still run over real transports.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar, cast

import torch

from hora.common.transport import Sizes, TransportError
from hora.common.vocabulary.message import ReduceOp

# What a member posts for an operation, and what the operation's result is.
_V = TypeVar("_V")
_R = TypeVar("_R")

_REDUCE = {
    ReduceOp.SUM: lambda a, b: a + b,
    ReduceOp.MIN: torch.minimum,
    ReduceOp.MAX: torch.maximum,
    ReduceOp.PRODUCT: lambda a, b: a * b,
}


class _Shared:
    """What the members of one group share: posted buffers per operation, and mailboxes."""

    def __init__(self, size: int, timeout_s: float) -> None:
        self.size = size
        self.timeout_s = timeout_s
        self.cv = threading.Condition()
        # Per operation: what each member posted, and the result (each operation's own types).
        self.posted: dict[int, dict[int, object]] = {}
        self.results: dict[int, object] = {}
        self.taken: dict[int, int] = {}
        self.mail: dict[tuple[int, int, int], torch.Tensor] = {}
        self.aborted = False


class _Ticket(Generic[_R]):
    """Operation ``number``, posted; its result is an ``_R``."""

    __slots__ = ("number",)

    def __init__(self, number: int) -> None:
        self.number = number


class _Done:
    """A started operation, as :class:`~hora.common.transport.Pending`: the first ``wait``
    collects the result."""

    def __init__(self, collect: Callable[[], object]) -> None:
        self._collect: Callable[[], object] | None = collect

    def wait(self, timeout_s: float | None = None) -> bool:
        if self._collect is not None:
            collect, self._collect = self._collect, None
            collect()
        return True


class LocalCommunicator:
    """Member ``rank`` of an in-process group (see :func:`local_group`)."""

    path = "local"

    def __init__(self, shared: _Shared, rank: int) -> None:
        self._shared = shared
        self.rank = rank
        self.size = shared.size
        self.device = torch.device("cpu")
        self._sequence = 0
        self._pairs: dict[tuple[int, int], int] = {}

    # ------------------------------------------------------------- matching

    def _meet(self, value: _V, combine: Callable[[dict[int, _V]], _R]) -> _R:
        """Post ``value`` for the next operation and wait for its result (see ``_post``)."""
        return self._collect(self._post(value, combine))

    def _post(self, value: _V, combine: Callable[[dict[int, _V]], _R]) -> _Ticket[_R]:
        """Post ``value`` for the next operation (numbered in call order, as every member
        numbers its calls); the last member to post computes ``combine(values by rank)``."""
        shared = self._shared
        number = self._sequence
        self._sequence += 1
        with shared.cv:
            self._check()
            # Every member posts a _V for operation ``number``.
            posted = cast(dict[int, _V], shared.posted.setdefault(number, {}))
            posted[self.rank] = value
            if len(posted) == shared.size:
                shared.results[number] = combine(posted)
                shared.cv.notify_all()
        return _Ticket(number)

    def _collect(self, ticket: _Ticket[_R]) -> _R:
        """Wait until every member posted the ticket's operation; its result."""
        shared = self._shared
        number = ticket.number
        with shared.cv:
            if not shared.cv.wait_for(
                lambda: number in shared.results or shared.aborted, shared.timeout_s
            ):
                raise TransportError(f"rank {self.rank} waited {shared.timeout_s:g} s for peers")
            self._check()
            result = cast(_R, shared.results[number])
            shared.taken[number] = shared.taken.get(number, 0) + 1
            if shared.taken[number] == shared.size:
                del shared.posted[number], shared.results[number], shared.taken[number]
            return result

    def _check(self) -> None:
        if self._shared.aborted:
            raise TransportError("the communicator was aborted")

    # ------------------------------------------------------------- collectives

    def allreduce(self, buffer: torch.Tensor, op: ReduceOp) -> None:
        self.allreduce_async(buffer, op).wait()

    def allreduce_async(
        self, buffer: torch.Tensor, op: ReduceOp, timeout_s: float | None = None
    ) -> _Done:
        reduce = _REDUCE[op]

        def combine(posted: dict[int, torch.Tensor]) -> torch.Tensor:
            total = posted[0].clone()
            for rank in range(1, len(posted)):
                total = reduce(total, posted[rank])
            return total

        ticket = self._post(buffer.clone(), combine)
        return _Done(lambda: buffer.copy_(self._collect(ticket)))

    def allgather(self, outputs: Sequence[torch.Tensor], buffer: torch.Tensor) -> None:
        gathered = self._meet(buffer.clone(), lambda posted: posted)
        for rank, output in enumerate(outputs):
            output.copy_(gathered[rank])

    def broadcast(self, buffer: torch.Tensor, root: int) -> None:
        buffer.copy_(self._meet(buffer.clone(), lambda posted: posted[root]))

    def alltoall(
        self, output: torch.Tensor, buffer: torch.Tensor, output_splits: Sizes, input_splits: Sizes
    ) -> None:
        parts = list(buffer.clone().split(list(input_splits)))
        everyone = self._meet(parts, lambda posted: posted)
        received = [everyone[source][self.rank] for source in range(self.size)]
        output.copy_(torch.cat(received) if received else output)

    def reducescatter(
        self, output: torch.Tensor, chunks: Sequence[torch.Tensor], op: ReduceOp
    ) -> None:
        reduce = _REDUCE[op]
        everyone = self._meet([c.clone() for c in chunks], lambda posted: posted)
        total = everyone[0][self.rank].clone()
        for rank in range(1, self.size):
            total = reduce(total, everyone[rank][self.rank])
        output.copy_(total)

    def sendrecv(self, send: torch.Tensor, receive: torch.Tensor, peer: int) -> None:
        shared = self._shared
        pair = (min(self.rank, peer), max(self.rank, peer))
        number = self._pairs.get(pair, 0)
        self._pairs[pair] = number + 1
        with shared.cv:
            self._check()
            shared.mail[(self.rank, peer, number)] = send.clone()
            shared.cv.notify_all()
            key = (peer, self.rank, number)
            if not shared.cv.wait_for(
                lambda: key in shared.mail or shared.aborted, shared.timeout_s
            ):
                raise TransportError(f"rank {self.rank} waited {shared.timeout_s:g} s for {peer}")
            self._check()
            receive.copy_(shared.mail.pop(key))

    def barrier(self) -> None:
        self._meet(None, lambda posted: None)

    def close(self) -> None:
        pass

    def abort(self) -> None:
        with self._shared.cv:
            self._shared.aborted = True
            self._shared.cv.notify_all()


def local_group(size: int, timeout_s: float = 30.0) -> list[LocalCommunicator]:
    """One communicator per member of a new in-process group of ``size``."""
    shared = _Shared(size, timeout_s)
    return [LocalCommunicator(shared, rank) for rank in range(size)]
