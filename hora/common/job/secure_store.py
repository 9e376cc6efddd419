"""hora's own store service: a key-value store that only holders of the job secret can use.

``torch.distributed.TCPStore`` lets anyone who can connect list, read, write and delete every
key. This store is what ``horarun``, ``hora.run``, the elastic driver, Ray and the launchers
whose rank 0 hosts the store serve instead. Protocol, on one TCP connection:

1. The server sends a greeting and a fresh 32-byte nonce; the client answers with its own nonce
   and a proof, an HMAC of both nonces under a key derived from the secret; the server checks
   it and sends its own proof, which the client checks (so neither side talks to an impostor,
   such as a process that took the port first).
2. Both derive a session key from the secret and both nonces. Every message after that is
   sealed with ChaCha20-Poly1305 under that key, with a nonce made of its direction and a
   sequence number that counts up from zero. A message that was changed, replayed, reordered,
   dropped, or taken from another connection fails to open, and the connection is closed. An
   observer on the network sees neither keys nor values.

The server keeps at most :data:`MAX_UNPROVEN` connections that have not proved the secret yet,
each for at most :data:`HANDSHAKE_S` seconds, so stray connections cannot use up its file
descriptors. Every connection it accepts gets :data:`GRACE_S` to prove itself before a newer one
may push it out; while all of them are that young, the server stops accepting and new
connections wait in the kernel's queue. A flood of connections can therefore delay a worker's
handshake, never cut it short. A wrong proof is answered with :data:`REFUSED` before the
connection closes, so a client tells a wrong secret (fail at once) from a connection closed
under load (try again, with backoff, until its timeout). ``SecureStore`` is a
``torch.distributed.Store``, so Gloo's own rendezvous goes through it too.

This module knows sockets and bytes; it does not know the engine or the launchers.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from torch._C._distributed_c10d import Store as _Store

logger = logging.getLogger("hora")

GREETING = b"hora-store/1\n"
NONCE_BYTES = 32
PROOF_BYTES = 32
# How long a new connection may take to prove the secret.
HANDSHAKE_S = 5.0
# Connections that have not proved the secret yet. Beyond this, a new one pushes out the oldest
# that has had GRACE_S to prove itself; when none has, the server stops accepting for a while.
MAX_UNPROVEN = 64
# What every accepted connection is given to prove itself: a worker answers the greeting within
# a round trip, far less than this even on a loaded machine.
GRACE_S = 1.0
# The server's answer to a wrong proof, before it closes the connection.
REFUSED = b"hora-store/refused\n"
# The largest message (a hora.run payload travels through the store).
MAX_MESSAGE = 1 << 30
_LENGTH = struct.Struct("<I")
_TO_SERVER, _TO_CLIENT = b"c2s\0", b"s2c\0"

# Operations.
SET, GET, ADD, COMPARE_SET, CHECK, WAIT, DELETE, NUM_KEYS, MULTI_GET, MULTI_SET = range(10)
# Answers.
OK, TIMEOUT, ERROR = range(3)


class StoreAuthenticationError(RuntimeError):
    """The other end of a store connection did not prove that it holds the job secret, or a
    message on the connection did not open (changed, replayed, or from another connection)."""


class StoreConnectionError(dist.DistNetworkError):
    """The store closed the connection or stopped answering (a ``RuntimeError``)."""


class StoreTimeout(dist.DistStoreError):
    """A ``get`` or ``wait`` timed out (a ``RuntimeError``, as ``TCPStore``'s)."""


class _ClosedEarly(ConnectionError):
    """The server closed a connection before it took this client's proof (load or a flood,
    not a wrong secret: that is answered with :data:`REFUSED`)."""


def _auth_key(secret: str) -> bytes:
    return hashlib.sha256(b"hora-store-auth:" + secret.encode()).digest()


def _proof(key: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, role + first + second, hashlib.sha256).digest()


def _session_key(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, b"session" + server_nonce + client_nonce, hashlib.sha256).digest()


class _Seal:
    """One direction's sealing or opening of messages, with its sequence number."""

    def __init__(self, session_key: bytes, direction: bytes) -> None:
        self._aead = ChaCha20Poly1305(session_key)
        self._direction = direction
        self._sequence = 0

    def _nonce(self) -> bytes:
        nonce = self._direction + self._sequence.to_bytes(8, "little")
        self._sequence += 1
        return nonce

    def seal(self, message: bytes) -> bytes:
        sealed = self._aead.encrypt(self._nonce(), message, None)
        return _LENGTH.pack(len(sealed)) + sealed

    def open(self, sealed: bytes) -> bytes:
        try:
            return self._aead.decrypt(self._nonce(), sealed, None)
        except InvalidTag:
            raise StoreAuthenticationError(
                "a store message did not open with this connection's key: it was changed, "
                "replayed or injected"
            ) from None


# ---------------------------------------------------------------- message fields


def _pack(op: int, *fields: bytes) -> bytes:
    parts = [struct.pack("<BH", op, len(fields))]
    for item in fields:
        parts.append(_LENGTH.pack(len(item)))
        parts.append(item)
    return b"".join(parts)


def _unpack(message: bytes) -> tuple[int, list[bytes]]:
    if len(message) < 3:
        raise ValueError("a store message is too short")
    op, count = struct.unpack_from("<BH", message)
    offset = 3
    fields = []
    for _ in range(count):
        (length,) = _LENGTH.unpack_from(message, offset)
        offset += _LENGTH.size
        if offset + length > len(message):
            raise ValueError("a store message field runs past its end")
        fields.append(message[offset : offset + length])
        offset += length
    return op, fields


def _int(value: int) -> bytes:
    return struct.pack("<q", value)


def _as_int(data: bytes) -> int:
    return int(struct.unpack("<q", data)[0])


def _as_bytes(value: str | bytes | Sequence[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


# ---------------------------------------------------------------- server


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    peer: str
    server_nonce: bytes
    accepted: float
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytearray = field(default_factory=bytearray)
    opener: _Seal | None = None
    sealer: _Seal | None = None
    # A request waiting for keys: (op, keys, deadline).
    waiting: tuple[int, list[bytes], float] | None = None


class StoreServer:
    """Serves one job's keys on ``bind_address:port`` from a background thread.

    Args:
        bind_address: the address to listen on (only that one).
        port: 0 for a port chosen by the OS.
        secret: the job secret every client must prove.

    Raises:
        OSError: the address is not this host's, or the port is taken.
    """

    def __init__(self, bind_address: str, port: int, secret: str) -> None:
        family = socket.AF_INET6 if ":" in bind_address else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((bind_address, port))
            listener.listen(1024)
        except OSError:
            listener.close()
            raise
        listener.setblocking(False)
        self.port = int(listener.getsockname()[1])
        self.rejected = 0  # connections closed for not proving the secret (for tests and logs)
        self._key = _auth_key(secret)
        self._listener = listener
        self._data: dict[bytes, bytes] = {}
        self._connections: dict[socket.socket, _Connection] = {}
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ)
        self._listening = True
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._running = True
        self._thread = threading.Thread(target=self._serve, name="hora-store", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and close every connection."""
        self._running = False
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    # The loop, on the server's thread.

    def _serve(self) -> None:
        try:
            while self._running:
                for selected, events in self._selector.select(self._next_timeout()):
                    sock = selected.fileobj
                    if sock is self._listener:
                        self._accept()
                    elif sock is self._wake_r:
                        self._wake_r.recv(64)
                    else:
                        connection = self._connections.get(sock)  # type: ignore[call-overload]
                        if connection is not None:
                            self._service(connection, events)
                self._expire()
                self._resume_listening()
        except Exception:  # noqa: BLE001 - the store must not die silently
            logger.exception("hora's store server stopped")
        finally:
            for connection in list(self._connections.values()):
                self._drop(connection)
            self._selector.close()
            self._listener.close()
            self._wake_r.close()
            self._wake_w.close()

    def _unproven(self) -> list[_Connection]:
        return [c for c in self._connections.values() if c.opener is None]

    def _next_timeout(self) -> float:
        unproven = self._unproven()
        deadlines = [c.accepted + HANDSHAKE_S for c in unproven]
        deadlines += [c.waiting[2] for c in self._connections.values() if c.waiting is not None]
        if not self._listening:
            deadlines += [c.accepted + GRACE_S for c in unproven]
        if not deadlines:
            return 1.0
        return max(0.0, min(min(deadlines) - time.monotonic(), 1.0))

    def _make_room(self) -> bool:
        """Whether a new connection may be accepted: below the cap, or once the oldest unproven
        connection that has had its grace is pushed out."""
        unproven = self._unproven()
        if len(unproven) < MAX_UNPROVEN:
            return True
        oldest = min(unproven, key=lambda c: c.accepted)
        if time.monotonic() < oldest.accepted + GRACE_S:
            return False
        self.rejected += 1
        self._drop(oldest)
        return True

    def _accept(self) -> None:
        while True:
            if not self._make_room():
                # Every unproven connection is still within its grace: leave new ones queued
                # in the kernel until one proves itself or its grace runs out.
                self._selector.unregister(self._listener)
                self._listening = False
                return
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # Out of file descriptors, or the like: those connecting retry.
                logger.warning("hora's store could not accept a connection: %s", exc)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = os.urandom(NONCE_BYTES)
            connection = _Connection(sock, f"{address[0]}:{address[1]}", nonce, time.monotonic())
            connection.outbox += GREETING + nonce
            self._connections[sock] = connection
            self._selector.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)

    def _resume_listening(self) -> None:
        if self._listening or not self._running:
            return
        unproven = self._unproven()
        now = time.monotonic()
        if len(unproven) < MAX_UNPROVEN or any(now >= c.accepted + GRACE_S for c in unproven):
            self._selector.register(self._listener, selectors.EVENT_READ)
            self._listening = True

    def _service(self, connection: _Connection, events: int) -> None:
        try:
            if events & selectors.EVENT_READ:
                data = connection.sock.recv(1 << 16)
                if not data:
                    self._drop(connection)
                    return
                connection.inbox += data
                self._take_messages(connection)
            self._flush(connection)
        except (ConnectionResetError, BrokenPipeError) as exc:
            # The peer went away (a worker that was stopped or killed): its own end says why.
            logger.debug("hora's store lost a connection from %s: %s", connection.peer, exc)
            self._drop(connection)
        except (OSError, ValueError, StoreAuthenticationError) as exc:
            if connection.opener is not None:
                logger.warning("hora's store closed a connection from %s: %s", connection.peer, exc)
            self._drop(connection)

    def _take_messages(self, connection: _Connection) -> None:
        if connection.opener is None:
            if len(connection.inbox) < NONCE_BYTES + PROOF_BYTES:
                return
            client_nonce = bytes(connection.inbox[:NONCE_BYTES])
            proof = bytes(connection.inbox[NONCE_BYTES : NONCE_BYTES + PROOF_BYTES])
            del connection.inbox[: NONCE_BYTES + PROOF_BYTES]
            expected = _proof(self._key, b"client", connection.server_nonce, client_nonce)
            if not hmac.compare_digest(proof, expected):
                self.rejected += 1
                logger.warning(
                    "hora's store refused a connection from %s that did not prove the job secret",
                    connection.peer,
                )
                # Best effort: a fresh connection's send buffer takes these few bytes at once.
                with contextlib.suppress(OSError):
                    connection.sock.send(REFUSED)
                raise ValueError("wrong proof")
            session = _session_key(self._key, connection.server_nonce, client_nonce)
            connection.opener = _Seal(session, _TO_SERVER)
            connection.sealer = _Seal(session, _TO_CLIENT)
            connection.outbox += _proof(self._key, b"server", client_nonce, connection.server_nonce)
        while connection.waiting is None and len(connection.inbox) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(connection.inbox)
            if length > MAX_MESSAGE + 64:
                raise ValueError(f"a store message of {length} bytes is too large")
            if len(connection.inbox) < _LENGTH.size + length:
                return
            sealed = bytes(connection.inbox[_LENGTH.size : _LENGTH.size + length])
            del connection.inbox[: _LENGTH.size + length]
            op, fields = _unpack(connection.opener.open(sealed))
            self._handle(connection, op, fields)

    def _handle(self, connection: _Connection, op: int, fields: list[bytes]) -> None:
        if op in (GET, WAIT, MULTI_GET):
            timeout_ms = _as_int(fields[0])
            deadline = time.monotonic() + timeout_ms / 1000 if timeout_ms > 0 else float("inf")
            connection.waiting = (op, fields[1:], deadline)
            self._answer_waiting(connection)
            return
        operation = self._OPERATIONS.get(op)
        if operation is None:
            self._reply(connection, ERROR, f"unknown store operation {op}".encode())
            return
        changed, answer = operation(self, fields)
        self._reply(connection, OK, *answer)
        if changed:
            # The writer's answer leaves before any waiter's: a waiter may be a process that
            # exits once it has its answer (the host lingering for its peers), taking this
            # thread with it.
            self._flush(connection)
            self._keys_changed()

    # Each returns whether it changed a key, and the answer's fields.

    def _set(self, fields: list[bytes]) -> tuple[bool, list[bytes]]:
        self._data[fields[0]] = fields[1]
        return True, []

    def _multi_set(self, fields: list[bytes]) -> tuple[bool, list[bytes]]:
        for key, value in zip(fields[::2], fields[1::2]):
            self._data[key] = value
        return True, []

    def _add(self, fields: list[bytes]) -> tuple[bool, list[bytes]]:
        value = int(self._data.get(fields[0], b"0")) + _as_int(fields[1])
        self._data[fields[0]] = str(value).encode()
        return True, [_int(value)]

    def _compare_set(self, fields: list[bytes]) -> tuple[bool, list[bytes]]:
        key, expected, desired = fields
        current = self._data.get(key)
        if (current is None and expected == b"") or current == expected:
            self._data[key] = desired
            return True, [desired]
        return False, [expected if current is None else current]

    def _check(self, fields: list[bytes]) -> tuple[bool, list[bytes]]:
        return False, [_int(all(k in self._data for k in fields))]

    def _delete(self, fields: list[bytes]) -> tuple[bool, list[bytes]]:
        return False, [_int(self._data.pop(fields[0], None) is not None)]

    def _num_keys(self, fields: list[bytes]) -> tuple[bool, list[bytes]]:
        return False, [_int(len(self._data))]

    _OPERATIONS: dict[int, Callable[[StoreServer, list[bytes]], tuple[bool, list[bytes]]]] = {
        SET: _set,
        MULTI_SET: _multi_set,
        ADD: _add,
        COMPARE_SET: _compare_set,
        CHECK: _check,
        DELETE: _delete,
        NUM_KEYS: _num_keys,
    }

    def _answer_waiting(self, connection: _Connection) -> bool:
        assert connection.waiting is not None
        op, keys, deadline = connection.waiting
        if all(k in self._data for k in keys):
            connection.waiting = None
            values = [self._data[k] for k in keys] if op != WAIT else []
            self._reply(connection, OK, *values)
            return True
        if time.monotonic() >= deadline:
            connection.waiting = None
            self._reply(connection, TIMEOUT)
            return True
        return False

    def _keys_changed(self) -> None:
        for other in list(self._connections.values()):
            if other.waiting is not None and self._answer_waiting(other):
                self._resume(other)

    def _resume(self, connection: _Connection) -> None:
        """Go on with a connection whose waiting request was answered."""
        try:
            self._take_messages(connection)
            self._flush(connection)
        except (OSError, ValueError, StoreAuthenticationError):
            self._drop(connection)

    def _expire(self) -> None:
        now = time.monotonic()
        for connection in list(self._connections.values()):
            if connection.opener is None and now >= connection.accepted + HANDSHAKE_S:
                self.rejected += 1
                self._drop(connection)
            elif connection.waiting is not None and self._answer_waiting(connection):
                self._resume(connection)

    def _reply(self, connection: _Connection, status: int, *fields: bytes) -> None:
        assert connection.sealer is not None
        connection.outbox += connection.sealer.seal(_pack(status, *fields))

    def _flush(self, connection: _Connection) -> None:
        if connection.outbox:
            try:
                sent = connection.sock.send(connection.outbox)
            except BlockingIOError:
                sent = 0
            del connection.outbox[:sent]
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if connection.outbox else 0)
        self._selector.modify(connection.sock, events)

    def _drop(self, connection: _Connection) -> None:
        self._connections.pop(connection.sock, None)
        try:
            self._selector.unregister(connection.sock)
        except (KeyError, ValueError):
            pass
        connection.sock.close()


# ---------------------------------------------------------------- client


class SecureStore(_Store):
    """A connection to a :class:`StoreServer`; a ``torch.distributed.Store``.

    Thread-safe: one request at a time on the connection (a blocked ``get`` or ``wait`` holds
    it, as ``TCPStore``'s does; use a second connection to wait and write at once). Keep a
    reference to it while a ``PrefixStore`` or a process group uses it: C++ reaches these
    methods through the Python object.

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
        super().__init__()
        self.addr, self.port = addr, port
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._sock, (self._opener, self._sealer) = self._open(_auth_key(secret), timeout_s)

    def _open(self, key: bytes, timeout_s: float) -> tuple[socket.socket, tuple[_Seal, _Seal]]:
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

    def _handshake(self, key: bytes, timeout_s: float) -> tuple[_Seal, _Seal]:
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
            self._sock.sendall(client_nonce + _proof(key, b"client", server_nonce, client_nonce))
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
        if not hmac.compare_digest(answer, _proof(key, b"server", client_nonce, server_nonce)):
            raise StoreAuthenticationError(
                f"the process at {self.addr}:{self.port} did not prove that it holds the job "
                "secret: another process may have taken the store's port"
            )
        self._sock.settimeout(None)
        session = _session_key(key, server_nonce, client_nonce)
        return _Seal(session, _TO_CLIENT), _Seal(session, _TO_SERVER)

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
                self._sock.sendall(self._sealer.seal(_pack(op, *fields)))
                (length,) = _LENGTH.unpack(self._receive(_LENGTH.size))
                if length > MAX_MESSAGE + 64:
                    raise StoreAuthenticationError("the store sent an oversized message")
                status, answer = _unpack(self._opener.open(self._receive(length)))
            except OSError as exc:
                # The connection is out of step now: nothing more goes over it.
                self._sock.close()
                raise StoreConnectionError(
                    f"lost the connection to the store at {self.addr}:{self.port}: {exc}"
                ) from exc
        if status == ERROR:
            raise RuntimeError(answer[0].decode(errors="replace"))
        return status, answer

    def _timeout_ms(self, timeout: timedelta | None) -> int:
        seconds = self._timeout_s if timeout is None else timeout.total_seconds()
        return max(1, int(seconds * 1000))

    def _waited(self, op: int, keys: Sequence[str], timeout: timedelta | None) -> list[bytes]:
        ms = self._timeout_ms(timeout)
        status, values = self._call(op, _int(ms), *(k.encode() for k in keys), wait_s=ms / 1000)
        if status == TIMEOUT:
            raise StoreTimeout(
                f"timed out after {ms / 1000:g} s waiting for store keys {list(keys)[:4]}"
            )
        return values

    # torch.distributed.Store

    def set(self, key: str, value: str | bytes) -> None:
        self._call(SET, key.encode(), _as_bytes(value))

    def get(self, key: str) -> bytes:
        return self._waited(GET, [key], None)[0]

    def get_within(self, key: str, timeout: timedelta) -> bytes:
        """``get``, waiting at most ``timeout`` for the key (``StoreTimeout`` after that)."""
        return self._waited(GET, [key], timeout)[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._waited(MULTI_GET, keys, None)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        fields = [f for k, v in zip(keys, values) for f in (k.encode(), _as_bytes(v))]
        self._call(MULTI_SET, *fields)

    def add(self, key: str, value: int) -> int:
        return _as_int(self._call(ADD, key.encode(), _int(value))[1][0])

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        answer = self._call(COMPARE_SET, key.encode(), _as_bytes(expected), _as_bytes(desired))
        return answer[1][0]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._waited(WAIT, keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return bool(_as_int(self._call(CHECK, *(k.encode() for k in keys))[1][0]))

    def delete_key(self, key: str) -> bool:
        return bool(_as_int(self._call(DELETE, key.encode())[1][0]))

    def num_keys(self) -> int:
        return _as_int(self._call(NUM_KEYS)[1][0])

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout_s = timeout.total_seconds()

    def close(self) -> None:
        self._sock.close()

    def __getstate__(self) -> Any:
        raise TypeError("a store connection cannot be pickled; connect again in the new process")
