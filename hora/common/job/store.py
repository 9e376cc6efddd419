"""The job's key-value store as workers see it: namespaced keys and authenticated values.

``horarun``, ``hora.run``, the elastic driver and Ray run hora's own store service
(:mod:`hora.common.job.store_service`), which only holders of the job secret can connect to;
under other launchers rank 0 runs one, or hora uses the launcher's own (torchrun's agent store,
a ``TCPStore`` without access control) under a key prefix (see
:mod:`hora.common.job.joining`). On top of that:

* every key lives under a namespace derived from the per-job secret;
* every value hora itself parses is signed with HMAC-SHA256 under the secret, and verified before
  it is decoded. Nothing is ever unpickled before its signature checks out;
* a value written through :meth:`StoreClient.set_signed` is signed together with its key's full
  name (under a key derived from the secret for that purpose). That name holds the job's
  namespace, the elastic round's prefix and the engine generation, so a signed value copied to
  another key, or replayed from an earlier round or generation, is rejected too;
* nothing is trusted for its mere existence: a *mark* (a key whose presence means something, such
  as "rank 3 is alive" or "round 2 wants a reset") holds a signed empty value, and
  :meth:`StoreClient.marked` and :meth:`StoreClient.wait` verify it before they say it is there.
  A forged value raises :class:`AuthenticationError`, which the callers turn into an error that
  names tampering.

A :class:`StoreClient` of hora's own store service talks through a
:class:`~hora.common.job.store_connection.StoreConnection`, which needs no torch: the launcher
uses it too. torch is imported only where a torch object is needed, on workers: torchrun's
``TCPStore``, the ``HashStore`` of a job of one, and :meth:`StoreClient.scoped` for Gloo.

This module knows stores and bytes; it does not know the engine.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

from hora.common.job.store_connection import BoundedGetStore, StoreConnection
from hora.common.job.store_keys import FAILURE, PARKED
from hora.common.job.store_protocol import StoreAuthenticationError, StoreTimeout

if TYPE_CHECKING:
    from hora.common.job.store_service import StoreServer
    from hora.common.job.torch_store import TorchStore

TAG_BYTES = 32
# How long a read waits for a key that was there a moment ago before taking it as deleted.
_GONE_AFTER_S = 0.05
# How long a named store port that is in use is tried again (see start_store_server).
BUSY_PORT_WAIT_S = 5.0


class AuthenticationError(RuntimeError):
    """A value in the store was not signed with this job's secret."""


def new_secret() -> str:
    """A fresh random job secret, as hex."""
    return secrets.token_hex(32)


def namespace_for(secret: str) -> str:
    """The key prefix for a job: unguessable without the secret."""
    return "hora-" + hashlib.sha256(b"hora-namespace:" + secret.encode()).hexdigest()[:32]


def _tag(secret: str, data: bytes, key: str | None) -> bytes:
    if key is None:
        return hmac.new(secret.encode(), data, hashlib.sha256).digest()
    # Values bound to a store key use their own HMAC key, derived from the secret, so a keyed tag
    # can never be mistaken for an unkeyed one (or the reverse). The key name is length-prefixed
    # so that no (key, data) pair signs the same bytes as another.
    keyed_secret = hashlib.sha256(b"hora-store-value:" + secret.encode()).digest()
    name = key.encode()
    message = len(name).to_bytes(4, "big") + name + data
    return hmac.new(keyed_secret, message, hashlib.sha256).digest()


def sign(secret: str, data: bytes, key: str | None = None) -> bytes:
    """``data`` preceded by its HMAC-SHA256 tag under ``secret``.

    Args:
        secret: the job secret (hex).
        data: the bytes to protect.
        key: the store key the value is written under; when given, the tag covers it too, and
            the blob verifies only under that key.
    """
    return _tag(secret, data, key) + data


def verify(
    secret: str, blob: bytes, what: str = "value", key: str | None = None, shown: str = ""
) -> bytes:
    """The data inside a signed blob.

    Args:
        secret: the job secret (hex).
        blob: what :func:`sign` returned.
        what: how to name the value in an error.
        key: the store key the value was read from, when it was signed with one.
        shown: the key's name as an error shows it (default: ``key``).

    Raises:
        AuthenticationError: the tag does not match (wrong secret, a forged blob, or a signed
            value moved from another key).
    """
    if len(blob) < TAG_BYTES:
        raise AuthenticationError(f"rejected an unsigned {what} (too short to carry a signature)")
    tag, data = blob[:TAG_BYTES], blob[TAG_BYTES:]
    if not hmac.compare_digest(tag, _tag(secret, data, key)):
        where = (
            ""
            if key is None
            else f" for key {shown or key!r} (it may have been copied from another key)"
        )
        raise AuthenticationError(
            f"rejected a {what} that was not signed with this job's secret{where}; another "
            "process may be writing to the job's rendezvous port"
        )
    return data


class RawStore(Protocol):
    """What hora calls on a store it reaches without a :class:`StoreClient` (torchrun's agent
    store): ``torch.distributed.Store``'s names and signatures."""

    def set(self, key: str, value: bytes) -> None:
        """Write ``value`` under ``key``."""

    def get(self, key: str) -> bytes:
        """The value under ``key`` (waits for it)."""

    def check(self, keys: list[str]) -> bool:
        """Whether every one of ``keys`` is there."""

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        """Wait until every one of ``keys`` is there (``RuntimeError`` after ``timeout``)."""


class KeyValueStore(RawStore, Protocol):
    """The store under a :class:`StoreClient`: hora's :class:`StoreConnection`, or torch's
    ``TCPStore`` (a launcher's) or ``HashStore`` (a job of one)."""

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values under ``keys`` (waits for them)."""

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Write ``desired`` where ``key`` holds ``expected`` (``""``: is unset); the value now."""

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; whether it was there."""


def put_mark(store: RawStore, key: str, secret: str) -> None:
    """Write a mark (a signed empty value bound to ``key``) into a raw ``torch`` store."""
    store.set(key, sign(secret, b"", key=key))


def has_mark(store: RawStore, key: str, secret: str) -> bool:
    """Whether a raw ``torch`` store holds a genuine mark under ``key``.

    Raises:
        AuthenticationError: the key holds a value this job did not write.
    """
    if not store.check([key]):
        return False
    verify(secret, bytes(store.get(key)), what=f"mark {key!r}", key=key)
    return True


def start_store_server(
    bind_address: str, port: int, secret: str, busy_wait_s: float = BUSY_PORT_WAIT_S
) -> tuple[StoreServer, int]:
    """Start hora's store service (:class:`~hora.common.job.store_service.StoreServer`) listening
    only on ``bind_address``; only holders of ``secret`` can use it.

    A named port that is in use is tried again for up to ``busy_wait_s``: a port every rank
    derives from the job id can be held for a moment by another program's outgoing connection,
    which ends on its own; a port another server listens on stays taken, and the error comes
    after the wait.

    Args:
        bind_address: an IP address of this host (``127.0.0.1`` for a job on this host).
        port: the port, or 0 for one chosen by the OS.
        secret: the job secret (hex) every client must prove.
        busy_wait_s: how long a named port that is in use is tried again.

    Returns:
        ``(server, port)``; the server runs until :meth:`StoreServer.close` or process exit.

    Raises:
        OSError: the address is not this host's, or the port is still taken after the wait.
    """
    from hora.common.job.store_service import StoreServer

    deadline = time.monotonic() + busy_wait_s
    while True:
        try:
            server = StoreServer(bind_address, port, secret)
        except OSError as exc:
            if port == 0 or exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                raise
            time.sleep(0.1)
            continue
        return server, server.port


def _torch_distributed() -> ModuleType:
    """``torch.distributed``, imported only where a torch store is made (on workers)."""
    import torch.distributed

    return torch.distributed


def _unreachable(addr: str, port: int, timeout_s: float, exc: Exception) -> RuntimeError:
    return RuntimeError(
        f"cannot reach the job's rendezvous store at {addr}:{port} within {timeout_s:g} s "
        f"({exc}). Was this process started by horarun, and is the launcher still running? "
        "Raise HORA_START_TIMEOUT if start-up is slow."
    )


@dataclass(eq=False, repr=False)
class StoreClient:
    """A connection to the job's store, with namespaced keys and signed values.

    Args:
        addr: the store's address; empty for a job of one (an in-process store is used).
        port: the store's port.
        secret: the job secret (hex).
        timeout_s: how long a ``get``/``wait`` may block before failing.
        prefix: put in front of every key (a job's space inside a store it shares, such as
            torchrun's agent store).
        foreign: the store is a launcher's ``TCPStore`` (torchrun's agent store), not hora's
            own store service.
    """

    addr: str
    port: int
    secret: str
    timeout_s: float
    prefix: str = ""
    foreign: bool = False

    def __post_init__(self) -> None:
        addr, port, secret, timeout_s = self.addr, self.port, self.secret, self.timeout_s
        # The torch.distributed.Store over self.store, once scoped() made one: kept while the
        # process groups made over it live (C++ reaches it through the Python object).
        self._torch_store: TorchStore | None = None
        self.store: KeyValueStore
        if addr and not self.foreign:
            try:
                self.store = StoreConnection(addr, port, secret, timeout_s)
            except StoreAuthenticationError as exc:
                raise RuntimeError(
                    f"the job's rendezvous store at {addr}:{port} refused this process or could "
                    f"not prove itself: {exc}. Every process of a job must get the same secret "
                    "(HORA_SECRET_KEY) from its launcher."
                ) from exc
            except (RuntimeError, ValueError) as exc:
                raise _unreachable(addr, port, timeout_s, exc) from exc
        elif addr:
            try:
                self.store = _torch_distributed().TCPStore(
                    addr,
                    port,
                    None,
                    False,
                    timedelta(seconds=timeout_s),
                    wait_for_workers=False,
                )
            except (RuntimeError, ValueError) as exc:
                raise _unreachable(addr, port, timeout_s, exc) from exc
        else:
            self.store = _torch_distributed().HashStore()
        self.namespace = self.prefix + namespace_for(secret)

    def reconnect(self) -> StoreClient:
        """A second, independent connection (a blocked ``wait`` holds its connection)."""
        if not self.addr:
            clone = object.__new__(StoreClient)
            clone.__dict__.update(self.__dict__)
            return clone
        return replace(self)

    def under(self, prefix: str) -> StoreClient:
        """This client's connection, with its keys under ``prefix`` instead (no new
        connection: for reading another elastic round's keys)."""
        clone = object.__new__(StoreClient)
        clone.__dict__.update(self.__dict__)
        clone.prefix = prefix
        clone.namespace = prefix + namespace_for(self.secret)
        clone._torch_store = None
        return clone

    def end_waits_when(self, check: Callable[[], str] | None) -> None:
        """End this connection's blocking reads (Gloo's rendezvous through :meth:`scoped`
        included) once ``check`` gives a reason, with
        :class:`~hora.common.job.store_protocol.StoreWaitEnded`; ``None`` turns it off. Only
        hora's own store service can; on another store this does nothing."""
        if isinstance(self.store, StoreConnection):
            self.store.end_waits_when(check)

    def wait_ender(self) -> Callable[[], str] | None:
        """The check :meth:`end_waits_when` set, if any: for waits outside the store's reach
        (Gloo's connections to its peers) that should end for the same reasons."""
        if isinstance(self.store, StoreConnection):
            return self.store.wait_ender
        return None

    def key(self, name: str) -> str:
        return f"{self.namespace}/{name}"

    def scoped(self, scope: str) -> object:
        """A ``torch.distributed.PrefixStore`` for a process group's own rendezvous (on a
        worker: this imports torch); only the group's backend reads it."""
        prefix = f"{self.namespace}/{scope}/"
        return _torch_distributed().PrefixStore(prefix, self._as_torch_store())

    def _as_torch_store(self) -> object:
        """``self.store`` as a ``torch.distributed.Store`` (hora's connection needs one over
        it; torch's stores are one)."""
        if not isinstance(self.store, StoreConnection):
            return self.store
        if self._torch_store is None:
            from hora.common.job.torch_store import TorchStore

            self._torch_store = TorchStore(self.store)
        return self._torch_store

    def signed(self, name: str, data: bytes) -> bytes:
        """``data`` signed for the key ``name`` (for a ``compare_set`` of a signed value)."""
        return sign(self.secret, data, key=self.key(name))

    def set_signed(self, name: str, data: bytes) -> None:
        """Write ``data`` under ``name``, signed together with the key's full name."""
        self.store.set(self.key(name), self.signed(name, data))

    def verified(self, name: str, blob: bytes) -> bytes:
        """The data of ``blob``, read from the key ``name``, once its signature checks out."""
        return verify(self.secret, blob, f"store value {name!r}", self.key(name), name)

    def get_signed(self, name: str) -> bytes:
        """The verified value of a key (blocks until it exists, up to the store timeout).

        Raises:
            AuthenticationError: the value was not written by :meth:`set_signed` of this job
                under this very key (a forged, moved or replayed value).
        """
        return self.verified(name, bytes(self.store.get(self.key(name))))

    def _read_seen(self, name: str) -> bytes | None:
        """The verified value of a key that was just seen to exist, or ``None`` when it was
        deleted since (as rank 0 deletes an old parking round's doorbell). hora's own store
        answers that at once; another store (torchrun's) waits up to its timeout instead.

        Raises:
            AuthenticationError: the value was not written by :meth:`set_signed` of this job.
        """
        key = self.key(name)
        if not isinstance(self.store, BoundedGetStore):
            return self.verified(name, bytes(self.store.get(key)))
        try:
            blob = self.store.get_within(key, timedelta(seconds=_GONE_AFTER_S))
        except StoreTimeout:
            return None
        return self.verified(name, bytes(blob))

    def mark(self, name: str) -> None:
        """Set a mark: a key whose presence is what it says, holding a signed empty value."""
        self.set_signed(name, b"")

    def marked(self, name: str) -> bool:
        """Whether ``name`` holds a genuine value (a mark, or any value of :meth:`set_signed`).

        Raises:
            AuthenticationError: the key holds a value this job did not write.
        """
        if not self.store.check([self.key(name)]):
            return False
        return self._read_seen(name) is not None

    def all_marked(self, names: list[str]) -> bool:
        """Whether every key of ``names`` holds a genuine value (one round trip when not).

        Raises:
            AuthenticationError: one of the keys holds a value this job did not write.
        """
        keys = [self.key(name) for name in names]
        if not self.store.check(keys):
            return False
        for name, blob in zip(names, self.store.multi_get(keys)):
            self.verified(name, bytes(blob))
        return True

    def check(self, name: str) -> bool:
        """Whether the key exists, genuine or not: for keys read with :meth:`get_signed` next."""
        return bool(self.store.check([self.key(name)]))

    def wait(self, name: str, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a key to hold a genuine value; ``False`` on timeout.

        Raises:
            AuthenticationError: the key holds a value this job did not write.
        """
        try:
            self.store.wait([self.key(name)], timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
                return False
            raise
        return self._read_seen(name) is not None

    def delete(self, name: str) -> None:
        try:
            self.store.delete_key(self.key(name))
        except RuntimeError:
            pass


def read_failure(store: StoreClient) -> str:
    """The job's first failure report (see :func:`report_failure`), or ``""``.

    Raises:
        AuthenticationError: the failure key holds a report this job did not write.
    """
    if not store.check(FAILURE):
        return ""
    return store.get_signed(FAILURE).decode(errors="replace")


def report_failure(store: StoreClient, text: str) -> None:
    """Mark the job failed (first report wins) and wake ranks parked on their doorbell."""
    try:
        store.store.compare_set(store.key(FAILURE), "", store.signed(FAILURE, text.encode()))
    except RuntimeError:
        pass
    if store.check(PARKED):
        wake_key = store.get_signed(PARKED).decode(errors="replace")
        store.mark(wake_key)


def tampering(exc: AuthenticationError, rank: int | None = None) -> str:
    """The message for a job that found a value in its store it did not write."""
    who = "hora" if rank is None else f"rank {rank}"
    return (
        f"{who} found tampering in the job's store: {exc}. The job stopped rather than act on "
        "it. Run jobs on hosts and networks other users cannot reach, and give every job a "
        "secret (docs/security.md)."
    )
