"""The transport interface: collectives on flat, contiguous buffers among the members of one set.

The engine talks only to :class:`Communicator`. Implementations wrap a real library
(``torch.distributed``'s Gloo and NCCL backends, mpi4py); hora never writes its own network
transport.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from hora.common.vocabulary.message import ReduceOp


class TransportError(RuntimeError):
    """A collective failed: a peer closed its connection, timed out, or the group was aborted."""


class PeerProofError(TransportError):
    """A member did not prove, over its connection to this one, that it holds the job secret."""


class Pending(Protocol):
    """A collective that was started and has not been waited for."""

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until it is done, or for ``timeout_s`` at most; return whether it is done.

        Raises :class:`TransportError` if it failed.
        """


class _Finished:
    """An operation that was done by the time it was started (see :data:`FINISHED`)."""

    __slots__ = ()

    def wait(self, timeout_s: float | None = None) -> bool:
        return True


# What ``allreduce_async`` returns when it ran the operation on the calling thread; the engine
# then completes it there too, rather than handing it to its finisher.
FINISHED: Pending = _Finished()


# How many rows of an alltoall's buffer go to (or come from) each member, in member order.
Sizes = Sequence[int]


class CallerLane(Protocol):
    """What the engine knows of a process set's lane, the path of the calls its callers run
    themselves (``hora.common.transport.shm_lane.Lane``): every call on the set takes a
    number there, under its lock."""

    lock: threading.Lock
    ranks: Sequence[int]

    def post(self) -> None: ...

    def begin_join(self) -> None: ...

    def new_epoch(self) -> None: ...


class Communicator(Protocol):
    """Collectives among the members of one process set.

    ``rank`` and ``size`` are within the set. Every method blocks until the operation is done
    and raises :class:`TransportError` on failure. Buffers are contiguous torch tensors on
    ``device``: the CPU, or this process's GPU for a NCCL communicator.
    """

    rank: int
    size: int
    device: torch.device
    # The data path, as the timeline and ``hora doctor`` name it: ``gloo``, ``shm``,
    # ``hierarchical``, ``mpi``, ``nccl``, ``local``.
    path: str

    def allreduce(self, buffer: torch.Tensor, op: ReduceOp) -> None:
        """Reduce ``buffer`` element-wise across members, in place (Sum, Min, Max or Product)."""

    def allreduce_async(
        self, buffer: torch.Tensor, op: ReduceOp, timeout_s: float | None = None
    ) -> Pending:
        """Start :meth:`allreduce` and return at once; ``buffer`` is not touched after ``wait``.

        Operations started on one communicator are matched across members in the order they
        were started, so every member must start the same sequence. ``timeout_s`` replaces the
        communicator's timeout for this operation (how long it may wait for its peers).
        """

    def allgather(self, outputs: Sequence[torch.Tensor], buffer: torch.Tensor) -> None:
        """Gather every member's ``buffer`` (all the same size) into ``outputs[member]``."""

    def broadcast(self, buffer: torch.Tensor, root: int) -> None:
        """Copy member ``root``'s buffer into every member's ``buffer``."""

    def alltoall(
        self, output: torch.Tensor, buffer: torch.Tensor, output_splits: Sizes, input_splits: Sizes
    ) -> None:
        """Send ``input_splits[j]`` rows to member j; receive ``output_splits[j]`` rows from it."""

    def reducescatter(
        self, output: torch.Tensor, chunks: Sequence[torch.Tensor], op: ReduceOp
    ) -> None:
        """Reduce ``chunks[j]`` across members into member j's ``output``."""

    def sendrecv(self, send: torch.Tensor, receive: torch.Tensor, peer: int) -> None:
        """Send ``send`` to member ``peer`` and receive ``receive`` from it, both at once.

        Both members call it with each other as ``peer``; either buffer may be empty.
        """

    def barrier(self) -> None:
        """Return when every member has called it."""

    def close(self) -> None:
        """Release the communicator after the last operation (orderly shutdown)."""

    def abort(self) -> None:
        """Fail every operation in flight, now, so blocked callers return."""


# What makes a process set's communicator: ``(scope, rank_in_set, set_size)``; the scope names
# the set's keys in the job's store, distinct for every set and every ``init``.
CommunicatorFactory = Callable[[str, int, int], Communicator]
# What makes a communicator whose buffers live on a GPU: ``(scope, rank_in_set, set_size,
# device)``; ``None`` where the set cannot have one (its members share a GPU).
DeviceCommunicatorFactory = Callable[[str, int, int, torch.device], Communicator | None]


def repeated_buffer(comm: Communicator, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A buffer of ``numel`` elements for a collective that runs again and again (a steady-state
    batch): where the communicator offers one (shared memory's ``arena_buffer``), in memory it
    reduces where it lies, without copies; else a plain tensor on its device."""
    offer = getattr(comm, "arena_buffer", None)
    made = offer(numel, dtype) if offer is not None else None
    return made if made is not None else torch.empty(numel, dtype=dtype, device=comm.device)


def allgather_bytes(comm: Communicator, data: bytes) -> list[bytes]:
    """Every member's ``data`` (the same length on every member), in member order.

    With a power-of-two number of members this is recursive doubling over :meth:`sendrecv`:
    ``log2(size)`` exchanges with one partner each, where the library's allgather takes
    ``size - 1`` ring steps. For the few hundred bytes of a negotiation header between two
    processes, one exchange costs about half of Gloo's allgather. Other sizes use the allgather.
    """
    exchange = getattr(comm, "exchange", None)
    if exchange is not None:
        gathered_bytes: list[bytes] = exchange(data)
        return gathered_bytes
    size, rank, length = comm.size, comm.rank, len(data)
    gathered = torch.empty(size * length, dtype=torch.uint8)
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8) if length else gathered[:0]
    if size & (size - 1):
        outputs = list(gathered.split(length)) if length else []
        comm.allgather(outputs, mine)
    else:
        gathered[rank * length : (rank + 1) * length] = mine
        distance = 1
        while distance < size:
            # This member holds the blocks of its aligned group of ``distance`` members; the
            # partner holds those of the neighbouring group. Swap them.
            partner = rank ^ distance
            ours, theirs = rank & -distance, partner & -distance
            comm.sendrecv(
                gathered[ours * length : (ours + distance) * length],
                gathered[theirs * length : (theirs + distance) * length],
                partner,
            )
            distance *= 2
    raw = gathered.numpy().tobytes()
    return [raw[i * length : (i + 1) * length] for i in range(size)]


_NONCE = 16


def _peer_tag(key: bytes, scope: str, sender: int, recipient: int, nonce: bytes) -> bytes:
    message = b"hora-peer:" + scope.encode() + b"\0" + sender.to_bytes(4, "little")
    return hmac.new(key, message + recipient.to_bytes(4, "little") + nonce, hashlib.sha256).digest()


def _swap_blocks(comm: Communicator, blocks: bytes, width: int) -> bytes:
    """Send block j (``width`` bytes) of ``blocks`` to member j; the blocks received, in member
    order."""
    received = torch.empty(width * comm.size, dtype=torch.uint8, device=comm.device)
    counts = [width] * comm.size
    sent = torch.frombuffer(bytearray(blocks), dtype=torch.uint8).to(comm.device)
    comm.alltoall(received, sent, counts, counts)
    return received.cpu().numpy().tobytes()


def prove_peers(comm: Communicator, secret: str, scope: str) -> None:
    """Every two members prove to each other, over the connection between them, that both hold
    ``secret``; call it once, right after the communicator is built.

    Two alltoalls, which use every pair's own connection: each member sends every other member a
    fresh nonce, then answers each nonce it received with an HMAC of it (bound to ``scope`` and
    to both members' ranks) under a key derived from the secret. A connection taken over by a
    process without the secret, or paired with the wrong peer, fails the check.

    Raises:
        PeerProofError: naming the members whose proof was wrong.
    """
    size, me = comm.size, comm.rank
    if size == 1:
        return
    key = hashlib.sha256(b"hora-peer-proof:" + secret.encode()).digest()
    sent = os.urandom(_NONCE * size)
    nonces = _swap_blocks(comm, sent, _NONCE)
    answers = b"".join(
        _peer_tag(key, scope, me, peer, nonces[peer * _NONCE : (peer + 1) * _NONCE])
        for peer in range(size)
    )
    width = hashlib.sha256().digest_size
    got = _swap_blocks(comm, answers, width)
    wrong = [
        peer
        for peer in range(size)
        if peer != me
        and not hmac.compare_digest(
            got[peer * width : (peer + 1) * width],
            _peer_tag(key, scope, peer, me, sent[peer * _NONCE : (peer + 1) * _NONCE]),
        )
    ]
    if wrong:
        raise PeerProofError(
            f"member {me} of {size}: the connection to member(s) {wrong} did not prove the job "
            "secret. Another process may have taken over the connection, or the members were "
            "started with different secrets. Run multi-host jobs on an isolated network "
            "(docs/security.md)."
        )
