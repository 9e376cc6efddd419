"""A client's connection to hora's store service, in plain Python: no torch.

:class:`StoreConnection` connects to a :class:`~hora.common.job.store_service.StoreServer`,
proves the job secret and speaks :mod:`hora.common.job.store_protocol`, with the operations and
signatures of a ``torch.distributed.Store`` (``set``, ``get``, ``wait``, ``compare_set``, ...).
The launcher (``horarun``, the elastic driver, ``hora.run``) uses it as it is, so it never
imports torch; a worker's Gloo rendezvous reaches it through the ``torch.distributed.Store`` of
:mod:`hora.common.job.torch_store`.

Connecting retries with backoff while the server closes connections before taking the proof
(load, or a flood of other connections); a refused proof (:data:`REFUSED`) fails at once.

This module knows sockets and bytes; it does not know torch, the engine or the launchers.
"""

from __future__ import annotations

import hmac
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import NoReturn, Protocol, runtime_checkable

from hora.common.job.store_protocol import (
    GREETING,
    LENGTH,
    MAX_SEALED,
    NONCE_BYTES,
    PROOF_BYTES,
    REFUSED,
    Op,
    Seal,
    Status,
    StoreAuthenticationError,
    StoreConnectionError,
    StoreTimeout,
    StoreWaitEnded,
    auth_key,
    bytes_field,
    int_field,
    int_of,
    pack,
    proof_for,
    session_seals,
    unpack,
)

# While a check is set (StoreConnection.end_waits_when), how long one slice of a blocking get or
# wait lasts before the check runs again.
WAIT_SLICE_S = 0.2


class _ClosedEarly(ConnectionError):
    """The server closed a connection before it took this client's proof (load or a flood,
    not a wrong secret: that is answered with :data:`REFUSED`)."""


@runtime_checkable
class BoundedGetStore(Protocol):
    """A store whose ``get`` can be given a time limit of its own: hora's store, through a
    :class:`StoreConnection` or the ``torch.distributed.Store`` over one. torch's own stores
    (``TCPStore``, ``HashStore``) wait for a missing key until their full timeout."""

    def get_within(self, key: str, timeout: timedelta) -> bytes:
        """``get``, waiting at most ``timeout`` for the key (``StoreTimeout`` after that)."""


class StoreConnection:
    """A connection to a :class:`~hora.common.job.store_service.StoreServer`.

    Thread-safe: one request at a time on the connection (a blocked ``get`` or ``wait`` holds
    it, as ``TCPStore``'s does; use a second connection to wait and write at once).

    Args:
        addr: the server's address.
        port: the server's port.
        secret: the job secret.
        timeout_s: how long connecting, ``get`` and ``wait`` may take.

    Raises:
        StoreTimeout: the server could not be reached, or did not take this process's proof,
            in time (the message says which, and names a possible flood of connections).
        StoreAuthenticationError: the server refused the proof (the secrets differ), or did not
            prove the secret itself.
    """

    def __init__(self, addr: str, port: int, secret: str, timeout_s: float) -> None:
        self.addr, self.port = addr, port
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._ends_wait: Callable[[], str] | None = None
        self._sock, (self._opener, self._sealer) = self._open(auth_key(secret), timeout_s)

    def _open(self, key: bytes, timeout_s: float) -> tuple[socket.socket, tuple[Seal, Seal]]:
        """Connect and prove the secret, again with backoff when the connection is closed
        before the server answered: under load, or a flood of other connections, the server
        may close a connection it has not read yet."""
        deadline = time.monotonic() + timeout_s
        pause, closed = 0.01, 0
        while True:
            self._sock = self._connect(self.addr, self.port, max(0.1, deadline - time.monotonic()))
            try:
                return self._sock, self._handshake(key, max(0.1, deadline - time.monotonic()))
            except _ClosedEarly as exc:
                self._sock.close()
                closed += 1
                if time.monotonic() + pause > deadline:
                    raise StoreTimeout(self._unproven_message(timeout_s, closed, exc)) from None
            except BaseException:
                self._sock.close()
                raise
            time.sleep(pause)
            pause = min(pause * 2, 0.5)

    def _unproven_message(self, timeout_s: float, closed: int, last: Exception) -> str:
        return (
            f"could not prove the job secret to the store at {self.addr}:{self.port} within "
            f"{timeout_s:g} s: it closed {closed} connection(s) before taking the proof (last: "
            f"{last}). The store is overloaded, or another process is flooding its port with "
            "connections (see docs/security.md, 'What a flood of connections can do'); a wrong "
            "secret would have been refused outright. Raise HORA_START_TIMEOUT to wait longer."
        )

    @staticmethod
    def _connect(addr: str, port: int, timeout_s: float) -> socket.socket:
        deadline = time.monotonic() + timeout_s
        pause = 0.01
        while True:
            try:
                sock = socket.create_connection((addr, port), timeout=max(0.1, timeout_s))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
            except OSError as exc:
                if time.monotonic() + pause > deadline:
                    raise StoreTimeout(
                        f"could not connect to the store at {addr}:{port} within "
                        f"{timeout_s:g} s: {exc}"
                    ) from exc
                time.sleep(pause)
                pause = min(pause * 2, 0.25)

    def _handshake(self, key: bytes, timeout_s: float) -> tuple[Seal, Seal]:
        self._sock.settimeout(max(timeout_s, 1.0))
        greeting = self._receive_until_closed(len(GREETING) + NONCE_BYTES)
        if not greeting.startswith(GREETING[: len(greeting)]):
            raise StoreAuthenticationError(
                f"the process at {self.addr}:{self.port} is not a hora store"
            )
        if len(greeting) < len(GREETING) + NONCE_BYTES:
            raise _ClosedEarly("closed before its greeting")
        server_nonce = greeting[len(GREETING) :]
        client_nonce = os.urandom(NONCE_BYTES)
        try:
            self._sock.sendall(client_nonce + proof_for(key, b"client", server_nonce, client_nonce))
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise _ClosedEarly(f"closed before the proof arrived ({exc})") from None
        answer = self._receive_until_closed(PROOF_BYTES)
        if answer == REFUSED:
            raise StoreAuthenticationError(
                f"the store at {self.addr}:{self.port} refused this process's proof of the job "
                "secret: the secret differs from the one the store was started with"
            )
        if len(answer) < PROOF_BYTES:
            raise _ClosedEarly("closed before it answered the proof")
        if not hmac.compare_digest(answer, proof_for(key, b"server", client_nonce, server_nonce)):
            raise StoreAuthenticationError(
                f"the process at {self.addr}:{self.port} did not prove that it holds the job "
                "secret: another process may have taken the store's port"
            )
        self._sock.settimeout(None)
        return session_seals(key, server_nonce, client_nonce, server=False)

    def _receive_until_closed(self, count: int) -> bytes:
        """Up to ``count`` bytes: fewer when the server closes the connection first."""
        data = bytearray()
        try:
            while len(data) < count:
                chunk = self._sock.recv(count - len(data))
                if not chunk:
                    break
                data += chunk
        except ConnectionResetError:
            pass
        return bytes(data)

    def _receive(self, count: int) -> bytes:
        data = bytearray()
        while len(data) < count:
            chunk = self._sock.recv(count - len(data))
            if not chunk:
                raise ConnectionError(f"the store at {self.addr}:{self.port} closed the connection")
            data += chunk
        return bytes(data)

    def _call(self, op: int, *fields: bytes, wait_s: float = 0.0) -> tuple[int, list[bytes]]:
        with self._lock:
            # An answer is due within the store's timeout (plus what the request itself may
            # wait): a store that stopped answering becomes an error, not a hang.
            self._sock.settimeout(self._timeout_s + wait_s + 5.0)
            try:
                self._sock.sendall(self._sealer.seal(pack(op, *fields)))
                (length,) = LENGTH.unpack(self._receive(LENGTH.size))
                if length > MAX_SEALED:
                    raise StoreAuthenticationError("the store sent an oversized message")
                status, answer = unpack(self._opener.open(self._receive(length)))
            except OSError as exc:
                # The connection is out of step now: nothing more goes over it.
                self._sock.close()
                raise StoreConnectionError(
                    f"lost the connection to the store at {self.addr}:{self.port}: {exc}"
                ) from exc
        if status == Status.ERROR:
            raise RuntimeError(answer[0].decode(errors="replace"))
        return status, answer

    def _timeout_ms(self, timeout: timedelta | None) -> int:
        seconds = self._timeout_s if timeout is None else timeout.total_seconds()
        return max(1, int(seconds * 1000))

    def end_waits_when(self, check: Callable[[], str] | None) -> None:
        """End every blocking ``get`` and ``wait`` early once ``check`` gives a reason.

        While ``check`` is set, such a call waits in slices of :data:`WAIT_SLICE_S` and calls
        ``check()`` between them; a non-empty answer ends the call with :class:`StoreWaitEnded`
        carrying that reason. ``None`` turns it off. An elastic worker sets one while its round
        forms: a round that lost a worker must not keep the others waiting for it until their
        timeouts. ``check`` must not wait on this connection itself.
        """
        self._ends_wait = check

    @property
    def wait_ender(self) -> Callable[[], str] | None:
        """The check :meth:`end_waits_when` set, if any."""
        return self._ends_wait

    def _waited(self, op: int, keys: Sequence[str], timeout: timedelta | None) -> list[bytes]:
        ms = self._timeout_ms(timeout)
        names = [k.encode() for k in keys]
        check = self._ends_wait
        if check is None:
            status, values = self._call(op, int_field(ms), *names, wait_s=ms / 1000)
        else:
            status, values = self._waited_in_slices(op, names, ms, check)
        if status == Status.TIMEOUT:
            raise StoreTimeout(
                f"timed out after {ms / 1000:g} s waiting for store keys {list(keys)[:4]}"
            )
        return values

    def _waited_in_slices(
        self, op: int, names: list[bytes], ms: int, check: Callable[[], str]
    ) -> tuple[int, list[bytes]]:
        """The answer to a blocking request of up to ``ms``, asked a slice at a time, with
        ``check`` run between slices (see :meth:`end_waits_when`)."""
        deadline = time.monotonic() + ms / 1000
        while True:
            left_ms = max(1, int((deadline - time.monotonic()) * 1000))
            slice_ms = min(left_ms, int(WAIT_SLICE_S * 1000))
            status, values = self._call(op, int_field(slice_ms), *names, wait_s=slice_ms / 1000)
            if status != Status.TIMEOUT or slice_ms == left_ms:
                return status, values
            reason = check()
            if reason:
                raise StoreWaitEnded(reason)

    # The operations, with torch.distributed.Store's names and signatures.

    def set(self, key: str, value: str | bytes) -> None:
        self._call(Op.SET, key.encode(), bytes_field(value))

    def get(self, key: str) -> bytes:
        return self._waited(Op.GET, [key], None)[0]

    def get_within(self, key: str, timeout: timedelta) -> bytes:
        """``get``, waiting at most ``timeout`` for the key (``StoreTimeout`` after that)."""
        return self._waited(Op.GET, [key], timeout)[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._waited(Op.MULTI_GET, keys, None)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        fields = [f for k, v in zip(keys, values) for f in (k.encode(), bytes_field(v))]
        self._call(Op.MULTI_SET, *fields)

    def add(self, key: str, value: int) -> int:
        return int_of(self._call(Op.ADD, key.encode(), int_field(value))[1][0])

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        answer = self._call(
            Op.COMPARE_SET, key.encode(), bytes_field(expected), bytes_field(desired)
        )
        return answer[1][0]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._waited(Op.WAIT, keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return bool(int_of(self._call(Op.CHECK, *(k.encode() for k in keys))[1][0]))

    def delete_key(self, key: str) -> bool:
        return bool(int_of(self._call(Op.DELETE, key.encode())[1][0]))

    def num_keys(self) -> int:
        return int_of(self._call(Op.NUM_KEYS)[1][0])

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout_s = timeout.total_seconds()

    def close(self) -> None:
        self._sock.close()

    def __getstate__(self) -> NoReturn:
        raise TypeError("a store connection cannot be pickled; connect again in the new process")
