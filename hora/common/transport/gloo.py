"""Collectives over ``torch.distributed``'s Gloo process groups.

Each :class:`GlooCommunicator` owns one ``ProcessGroupGloo`` built directly on a store, so hora
never touches the default process group that users (and PyTorch DDP) may be using themselves.
The collectives themselves are :class:`~hora.common.transport.process_group.ProcessGroupCommunicator`'s,
shared with the NCCL transport. This module knows about process groups and buffers, never about
requests or names.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from hora.common.transport import TransportError
from hora.common.transport.process_group import Backend, ProcessGroupCommunicator, dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroupGloo


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


def make_device(bind_address: str, interface: str) -> ProcessGroupGloo.Device:
    """The Gloo network device: a named interface, an address, or Gloo's default."""
    device: ProcessGroupGloo.Device
    if interface:
        device = dist.ProcessGroupGloo.create_device(interface=interface)
    elif bind_address:
        device = dist.ProcessGroupGloo.create_device(hostname=bind_address)
    else:
        device = dist.ProcessGroupGloo.create_default_device()
    return device


# How often a connect that may be given up asks whether to give up.
GIVE_UP_CHECK_S = 0.2


class GlooCommunicator(ProcessGroupCommunicator):
    """A Gloo process group among ``size`` members, this process being member ``rank``.

    Args:
        store: a ``torch.distributed.Store`` private to this group (a ``PrefixStore``), which
            only the backend reads.
        rank: this process's rank within the group.
        size: number of members.
        timeout_s: how long any one operation may wait for its peers.
        device: the Gloo device from :func:`make_device`.
        give_up: asked while the group connects; a reason ends the connecting at once (an
            elastic round that lost a member while it formed). ``None``: wait up to
            ``timeout_s``.
    """

    path = "gloo"

    def __init__(
        self,
        store: object,
        rank: int,
        size: int,
        timeout_s: float,
        device: ProcessGroupGloo.Device,
        give_up: Callable[[], str] | None = None,
    ) -> None:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timedelta(seconds=timeout_s)
        options._devices = [device]
        try:
            backend = _connect(store, rank, size, options, give_up)
        except RuntimeError as exc:
            raise TransportError(f"could not connect the Gloo group: {exc}") from exc
        super().__init__(backend, rank, size, torch.device("cpu"))


def _connect(
    store: object, rank: int, size: int, options: object, give_up: Callable[[], str] | None
) -> Backend:
    """A connected ``ProcessGroupGloo``.

    With ``give_up``, the group connects in a thread of its own while this one asks
    ``give_up`` every :data:`GIVE_UP_CHECK_S`. Gloo's store reads end early through the store's
    own check, but a peer that died after it published its address keeps Gloo retrying the
    connection in C++, out of the store's reach; a reason ends the wait here, and the thread is
    left behind (the GIL is free while it waits). It is a daemon thread: Gloo's side that
    listens for a dead peer waits five times its timeout (150 s by default), and a process that
    finished its work must not wait that out at exit. The cost is a narrow window: a thread that
    leaves C++ while the interpreter is finalizing aborts the process, so a job whose last
    milliseconds meet the end of that wait exits with SIGABRT instead of its status.

    Raises:
        RuntimeError: Gloo's error, or the reason to give up.
    """
    if give_up is None:
        connected: Backend = dist.ProcessGroupGloo(store, rank, size, options)
        return connected
    groups: list[Backend] = []
    errors: list[BaseException] = []

    def connect() -> None:
        try:
            groups.append(dist.ProcessGroupGloo(store, rank, size, options))
        except BaseException as exc:  # handed to the waiting thread
            errors.append(exc)

    thread = threading.Thread(target=connect, name="hora-gloo-connect", daemon=True)
    thread.start()
    while True:
        thread.join(GIVE_UP_CHECK_S)
        if not thread.is_alive():
            break
        reason = give_up()
        if reason:
            raise RuntimeError(f"gave up connecting: {reason}")
    if errors:
        raise errors[0]
    return groups[0]
