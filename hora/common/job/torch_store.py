"""hora's store service as a ``torch.distributed.Store``, for workers.

Gloo's rendezvous (``ProcessGroupGloo`` over a ``PrefixStore``) needs a store that is a
``torch.distributed.Store``. :class:`TorchStore` is one, over a
:class:`~hora.common.job.store_connection.StoreConnection`: every call goes to the connection,
and the connection's timeouts and lost connections reach torch as torch's own store errors
(``DistStoreError``, ``DistNetworkError``; ``RuntimeError`` both, as ``TCPStore``'s). Only
:meth:`hora.common.job.store.StoreClient.scoped` makes one, on a worker; the launcher never
imports this module, or torch.

This module knows torch's ``Store`` interface; the protocol is the connection's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from typing import NoReturn

import torch.distributed as dist
from torch._C._distributed_c10d import Store as _Store

from hora.common.job.store_connection import StoreConnection
from hora.common.job.store_protocol import StoreConnectionError, StoreTimeout


class TorchStoreTimeout(StoreTimeout, dist.DistStoreError):
    """A ``get`` or ``wait`` through a :class:`TorchStore` timed out (torch's store timeout)."""


class TorchStoreConnectionError(StoreConnectionError, dist.DistNetworkError):
    """The store closed a :class:`TorchStore`'s connection or stopped answering."""


@contextlib.contextmanager
def _as_torch_errors() -> Iterator[None]:
    """Raise the connection's timeouts and lost connections as torch's store errors, with the
    same message and cause (other errors are ``RuntimeError`` already)."""
    try:
        yield
    except StoreTimeout as exc:
        raise TorchStoreTimeout(*exc.args).with_traceback(exc.__traceback__) from exc.__cause__
    except StoreConnectionError as exc:
        raise TorchStoreConnectionError(*exc.args).with_traceback(
            exc.__traceback__
        ) from exc.__cause__


class TorchStore(_Store):
    """A ``torch.distributed.Store`` over a connection to hora's store service.

    Keep a reference to it while a ``PrefixStore`` or a process group uses it: C++ reaches these
    methods through the Python object.

    Args:
        connection: the connection every call goes through (shared with its other users: one
            request at a time).

    Example:
        >>> store = TorchStore(StoreConnection(addr, port, secret, timeout_s=60.0))
        >>> group = dist.ProcessGroupGloo(dist.PrefixStore("g/", store), rank, size, timeout)
    """

    def __init__(self, connection: StoreConnection) -> None:
        super().__init__()
        self.connection = connection

    def set(self, key: str, value: str | bytes) -> None:
        with _as_torch_errors():
            self.connection.set(key, value)

    def get(self, key: str) -> bytes:
        with _as_torch_errors():
            return self.connection.get(key)

    def get_within(self, key: str, timeout: timedelta) -> bytes:
        """``get``, waiting at most ``timeout`` for the key (``StoreTimeout`` after that)."""
        with _as_torch_errors():
            return self.connection.get_within(key, timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        with _as_torch_errors():
            return self.connection.multi_get(keys)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        with _as_torch_errors():
            self.connection.multi_set(keys, values)

    def add(self, key: str, value: int) -> int:
        with _as_torch_errors():
            return self.connection.add(key, value)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        with _as_torch_errors():
            return self.connection.compare_set(key, expected, desired)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        with _as_torch_errors():
            self.connection.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        with _as_torch_errors():
            return self.connection.check(keys)

    def delete_key(self, key: str) -> bool:
        with _as_torch_errors():
            return self.connection.delete_key(key)

    def num_keys(self) -> int:
        with _as_torch_errors():
            return self.connection.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.connection.set_timeout(timeout)

    def close(self) -> None:
        self.connection.close()

    def __getstate__(self) -> NoReturn:
        raise TypeError("a store connection cannot be pickled; connect again in the new process")
