"""Collectives on CUDA tensors over NCCL, through ``torch.distributed``'s ``ProcessGroupNCCL``.

Each :class:`NCCLCommunicator` owns one NCCL backend built directly on a store (as the Gloo
transport does), bound to one GPU of this process and connected when it is made: every member
makes it at the same point of the job, so the connection is one more collective. The engine
makes one per process set, the first time that set runs a collective on CUDA tensors
(``HORA_GPU_OPERATIONS=nccl``); negotiation stays on the CPU path.

Streams. ``ProcessGroupNCCL`` runs each collective on its own stream, after the work queued so
far on the calling thread's current stream (the engine's threads use the device's default
stream, which the submitting call has made wait for the caller's). A started collective is
waited for in two steps: the host polls until NCCL has finished it (so that a stall, a dead
peer or :meth:`NCCLCommunicator.abort` is seen as on the CPU path, and the engine only reports a
result that exists), then the default stream is made to wait for NCCL's, so that the engine's
copies out of the fused buffer come after the data. The caller's stream waits for those copies
when it takes the result (``hvd.synchronize``).

This module knows backends and buffers, never requests or names.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from hora.common.transport import TransportError
from hora.common.transport.process_group import ProcessGroupCommunicator, dist

if TYPE_CHECKING:
    from torch.distributed import Work

# The host polls a running collective every this many seconds at most (less at first, so that
# short collectives are seen as soon as they finish).
_POLL_MAX_S = 0.0005
# NCCL's watchdog ends a process whose collective outlives the group's timeout; hora's own limit
# (the same timeout, checked while the host polls) comes this much earlier, with an error.
_WATCHDOG_EXTRA_S = 60.0


def nccl_available() -> bool:
    """Whether this torch has NCCL and a CUDA device is visible."""
    return bool(dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available())


def nccl_compiled() -> bool:
    """Whether this torch was built with NCCL (whether or not a GPU is visible)."""
    return bool(dist.is_available() and dist.is_nccl_available())


def gpu_identity(device: torch.device) -> str:
    """A name of ``device``'s physical GPU that is the same in every process that sees it,
    whatever ``CUDA_VISIBLE_DEVICES`` numbers it as there (its UUID)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def shared_gpus(identities: list[str]) -> list[list[int]]:
    """The groups of members (positions in ``identities``) that share one GPU.

    NCCL needs one GPU per member: a group with two members on one device fails to connect.
    """
    members: dict[str, list[int]] = {}
    for member, identity in enumerate(identities):
        members.setdefault(identity, []).append(member)
    return [group for group in members.values() if len(group) > 1]


class NCCLPending:
    """A started NCCL collective: the host polls for its end, then orders the default stream
    after it (see the module's docstring).

    ``limit_s`` is how long the collective may take from its start, as a Gloo operation's
    timeout: past it, waiting raises :class:`TransportError` (the engine then aborts the group).
    """

    __slots__ = ("_comm", "_work", "_expires")

    def __init__(self, comm: NCCLCommunicator, work: Work, limit_s: float) -> None:
        self._comm = comm
        self._work = work
        self._expires = time.monotonic() + limit_s

    def wait(self, timeout_s: float | None = None) -> bool:
        work, comm = self._work, self._comm
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pause = 0.00001
        while not self._finished(work):
            if comm.aborted:
                raise TransportError("the communicator was aborted")
            now = time.monotonic()
            if now >= self._expires:
                raise TransportError(
                    f"a NCCL collective timed out on {comm.device}: it did not finish within "
                    f"{comm.timeout_s:g} s"
                )
            if deadline is not None and now >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)
        error = _error_of(work)
        if error is not None:
            raise TransportError(f"NCCL: {error}")
        try:
            with torch.cuda.device(comm.device):
                work.wait()
        except RuntimeError as exc:
            raise TransportError(f"NCCL: {exc}") from exc
        return True

    @staticmethod
    def _finished(work: Work) -> bool:
        try:
            return bool(work.is_completed())
        except RuntimeError:
            return True  # it failed: wait() reports how


def _error_of(work: Work) -> str | None:
    try:
        error = work.exception()
    except RuntimeError as exc:
        return str(exc)
    return None if error is None else str(error)


class NCCLCommunicator(ProcessGroupCommunicator):
    """A NCCL group among ``size`` members on GPU ``device`` of this process.

    Args:
        store: a ``torch.distributed.Store`` private to this group (NCCL's unique id travels
            through it).
        rank: this process's rank within the group.
        size: number of members.
        timeout_s: how long one collective may wait for its peers (an allreduce started with a
            timeout of its own gets that one).
        device: this process's GPU for the group (``cuda:N``).
        longest_s: the longest timeout any allreduce will be started with. NCCL's own watchdog,
            which ends the process, is given a minute more, so that hora's limit comes first
            and fails the job with an error instead.

    Raises:
        TransportError: the group could not be made or connected.
    """

    path = "nccl"

    def __init__(
        self,
        store: object,
        rank: int,
        size: int,
        timeout_s: float,
        device: torch.device,
        longest_s: float = 0.0,
    ) -> None:
        if not nccl_available():
            raise TransportError(
                "NCCL is not available here: this torch has no NCCL or no CUDA device is "
                "visible. Set HORA_GPU_OPERATIONS=host to stage GPU tensors through host memory."
            )
        self.timeout_s = timeout_s
        options = dist.ProcessGroupNCCL.Options()
        watchdog_s = max(timeout_s, longest_s) + _WATCHDOG_EXTRA_S
        options._timeout = timedelta(seconds=watchdog_s)
        options.is_high_priority_stream = False
        try:
            backend = dist.ProcessGroupNCCL(store, rank, size, options)
            # Binds the group to this GPU and connects it now, while every member makes it.
            backend.eager_connect_single_device(device)
        except (RuntimeError, ValueError) as exc:
            raise TransportError(f"could not connect the NCCL group on {device}: {exc}") from exc
        super().__init__(backend, rank, size, device)

    @property
    def aborted(self) -> bool:
        return self._aborted

    def _pending(self, work: Work, timeout_s: float | None = None) -> NCCLPending:
        return NCCLPending(self, work, self.timeout_s if timeout_s is None else timeout_s)
