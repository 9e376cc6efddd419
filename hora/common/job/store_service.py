"""hora's store service: the server of a key-value store that only holders of the job secret can
use (the protocol is :mod:`hora.common.job.store_protocol`'s).

``horarun``, ``hora.run``, the elastic driver, Ray and the launchers whose rank 0 hosts the store
run a :class:`StoreServer`; processes connect to it through
:class:`~hora.common.job.store_connection.StoreConnection`.

The server keeps at most :data:`MAX_UNPROVEN` connections that have not proved the secret yet,
each for at most :data:`HANDSHAKE_S` seconds, so stray connections cannot use up its file
descriptors. Every connection it accepts gets :data:`GRACE_S` to prove itself before a newer one
may push it out; while all of them are that young, the server stops accepting and new
connections wait in the kernel's queue. A flood of connections can therefore delay a worker's
handshake, never cut it short. A wrong proof is answered with
:data:`~hora.common.job.store_protocol.REFUSED` before the connection closes, so a client tells a
wrong secret (fail at once) from a connection closed under load (try again).

This module knows sockets and bytes; it does not know torch, the engine or the launchers.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

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
    auth_key,
    int_field,
    int_of,
    pack,
    proof_for,
    session_seals,
    unpack,
)

logger = logging.getLogger("hora")

# How long a new connection may take to prove the secret.
HANDSHAKE_S = 5.0
# Connections that have not proved the secret yet. Beyond this, a new one pushes out the oldest
# that has had GRACE_S to prove itself; when none has, the server stops accepting for a while.
MAX_UNPROVEN = 64
# What every accepted connection is given to prove itself: a worker answers the greeting within
# a round trip, far less than this even on a loaded machine.
GRACE_S = 1.0


@dataclass(eq=False)
class _Peer:
    """One client's connection, as the server holds it."""

    sock: socket.socket
    peer: str
    server_nonce: bytes
    accepted: float
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytearray = field(default_factory=bytearray)
    opener: Seal | None = None
    sealer: Seal | None = None
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
        self._key = auth_key(secret)
        self._listener = listener
        self._data: dict[bytes, bytes] = {}
        self._connections: dict[socket.socket, _Peer] = {}
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
        except Exception:  # the store must not die silently
            logger.exception("hora's store server stopped")
        finally:
            for connection in list(self._connections.values()):
                self._drop(connection)
            self._selector.close()
            self._listener.close()
            self._wake_r.close()
            self._wake_w.close()

    def _unproven(self) -> list[_Peer]:
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
            connection = _Peer(sock, f"{address[0]}:{address[1]}", nonce, time.monotonic())
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

    def _service(self, connection: _Peer, events: int) -> None:
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

    def _take_messages(self, connection: _Peer) -> None:
        if connection.opener is None:
            if len(connection.inbox) < NONCE_BYTES + PROOF_BYTES:
                return
            client_nonce = bytes(connection.inbox[:NONCE_BYTES])
            proof = bytes(connection.inbox[NONCE_BYTES : NONCE_BYTES + PROOF_BYTES])
            del connection.inbox[: NONCE_BYTES + PROOF_BYTES]
            expected = proof_for(self._key, b"client", connection.server_nonce, client_nonce)
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
            connection.opener, connection.sealer = session_seals(
                self._key, connection.server_nonce, client_nonce, server=True
            )
            connection.outbox += proof_for(
                self._key, b"server", client_nonce, connection.server_nonce
            )
        while connection.waiting is None and len(connection.inbox) >= LENGTH.size:
            (length,) = LENGTH.unpack_from(connection.inbox)
            if length > MAX_SEALED:
                raise ValueError(f"a store message of {length} bytes is too large")
            if len(connection.inbox) < LENGTH.size + length:
                return
            sealed = bytes(connection.inbox[LENGTH.size : LENGTH.size + length])
            del connection.inbox[: LENGTH.size + length]
            op, fields = unpack(connection.opener.open(sealed))
            self._handle(connection, op, fields)

    def _handle(self, connection: _Peer, op: int, fields: list[bytes]) -> None:
        if op in (Op.GET, Op.WAIT, Op.MULTI_GET):
            timeout_ms = int_of(fields[0])
            deadline = time.monotonic() + timeout_ms / 1000 if timeout_ms > 0 else float("inf")
            connection.waiting = (op, fields[1:], deadline)
            self._answer_waiting(connection)
            return
        operation = self._OPERATIONS.get(op)
        if operation is None:
            self._reply(connection, Status.ERROR, f"unknown store operation {op}".encode())
            return
        changed, answer = operation(self, fields)
        self._reply(connection, Status.OK, *answer)
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
        value = int(self._data.get(fields[0], b"0")) + int_of(fields[1])
        self._data[fields[0]] = str(value).encode()
        return True, [int_field(value)]

    def _compare_set(self, fields: list[bytes]) -> tuple[bool, list[bytes]]:
        key, expected, desired = fields
        current = self._data.get(key)
        if (current is None and expected == b"") or current == expected:
            self._data[key] = desired
            return True, [desired]
        return False, [expected if current is None else current]

    def _check(self, fields: list[bytes]) -> tuple[bool, list[bytes]]:
        return False, [int_field(all(k in self._data for k in fields))]

    def _delete(self, fields: list[bytes]) -> tuple[bool, list[bytes]]:
        return False, [int_field(self._data.pop(fields[0], None) is not None)]

    def _num_keys(self, fields: list[bytes]) -> tuple[bool, list[bytes]]:
        return False, [int_field(len(self._data))]

    _OPERATIONS: dict[int, Callable[[StoreServer, list[bytes]], tuple[bool, list[bytes]]]] = {
        Op.SET: _set,
        Op.MULTI_SET: _multi_set,
        Op.ADD: _add,
        Op.COMPARE_SET: _compare_set,
        Op.CHECK: _check,
        Op.DELETE: _delete,
        Op.NUM_KEYS: _num_keys,
    }

    def _answer_waiting(self, connection: _Peer) -> bool:
        assert connection.waiting is not None
        op, keys, deadline = connection.waiting
        if all(k in self._data for k in keys):
            connection.waiting = None
            values = [self._data[k] for k in keys] if op != Op.WAIT else []
            self._reply(connection, Status.OK, *values)
            return True
        if time.monotonic() >= deadline:
            connection.waiting = None
            self._reply(connection, Status.TIMEOUT)
            return True
        return False

    def _keys_changed(self) -> None:
        for other in list(self._connections.values()):
            if other.waiting is not None and self._answer_waiting(other):
                self._resume(other)

    def _resume(self, connection: _Peer) -> None:
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

    def _reply(self, connection: _Peer, status: int, *fields: bytes) -> None:
        assert connection.sealer is not None
        connection.outbox += connection.sealer.seal(pack(status, *fields))

    def _flush(self, connection: _Peer) -> None:
        if connection.outbox:
            try:
                sent = connection.sock.send(connection.outbox)
            except BlockingIOError:
                sent = 0
            del connection.outbox[:sent]
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if connection.outbox else 0)
        self._selector.modify(connection.sock, events)

    def _drop(self, connection: _Peer) -> None:
        self._connections.pop(connection.sock, None)
        try:
            self._selector.unregister(connection.sock)
        except (KeyError, ValueError):
            pass
        connection.sock.close()
