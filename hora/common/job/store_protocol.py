"""The wire protocol of hora's store service, shared by its server and its clients.

``torch.distributed.TCPStore`` lets anyone who can connect list, read, write and delete every
key. hora's store service (:mod:`hora.common.job.store_service` serves it,
:mod:`hora.common.job.store_connection` speaks to it) lets only holders of the job secret in.
On one TCP connection:

1. The server sends :data:`GREETING` and a fresh 32-byte nonce; the client answers with its own
   nonce and a proof, an HMAC of both nonces under a key derived from the secret; the server
   checks it and sends its own proof, which the client checks (so neither side talks to an
   impostor, such as a process that took the port first). A wrong proof is answered with
   :data:`REFUSED` before the connection closes.
2. Both derive a session key from the secret and both nonces. Every message after that is
   sealed with ChaCha20-Poly1305 under that key (:class:`Seal`), with a nonce made of its
   direction and a sequence number that counts up from zero. A message that was changed,
   replayed, reordered, dropped, or taken from another connection fails to open, and the
   connection is closed. An observer on the network sees neither keys nor values.
3. A sealed message is an operation (or an answer's status) and its fields (:func:`pack`).

This module knows bytes and keys; it does not know sockets, torch, the engine or the launchers.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from enum import IntEnum

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

GREETING = b"hora-store/1\n"
NONCE_BYTES = 32
PROOF_BYTES = 32
# The server's answer to a wrong proof, before it closes the connection.
REFUSED = b"hora-store/refused\n"
# The largest message (a hora.run payload travels through the store).
MAX_MESSAGE = 1 << 30
# The longest sealed message either side takes: the largest message, its tag, and a margin.
MAX_SEALED = MAX_MESSAGE + 64
# A sealed message's length, in front of it.
LENGTH = struct.Struct("<I")
TO_SERVER, TO_CLIENT = b"c2s\0", b"s2c\0"


class Op(IntEnum):
    """A request's operation (the first byte of its message)."""

    SET = 0
    GET = 1
    ADD = 2
    COMPARE_SET = 3
    CHECK = 4
    WAIT = 5
    DELETE = 6
    NUM_KEYS = 7
    MULTI_GET = 8
    MULTI_SET = 9


class Status(IntEnum):
    """An answer's status (the first byte of its message)."""

    OK = 0
    TIMEOUT = 1
    ERROR = 2


class StoreAuthenticationError(RuntimeError):
    """The other end of a store connection did not prove that it holds the job secret, or a
    message on the connection did not open (changed, replayed, or from another connection)."""


class StoreConnectionError(RuntimeError):
    """The store closed the connection or stopped answering."""


class StoreTimeout(RuntimeError):
    """A ``get`` or ``wait`` timed out, or the store could not be reached in time (a
    ``RuntimeError``, as ``TCPStore``'s timeouts are)."""


class StoreWaitEnded(RuntimeError):
    """A ``get`` or ``wait`` was ended early: what it waited for will not come (the check given
    to ``StoreConnection.end_waits_when`` said why, and the message is that reason)."""


def auth_key(secret: str) -> bytes:
    """The key both ends prove the secret with."""
    return hashlib.sha256(b"hora-store-auth:" + secret.encode()).digest()


def proof_for(key: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    """A side's proof (``role`` is ``b"client"`` or ``b"server"``) over both nonces."""
    return hmac.new(key, role + first + second, hashlib.sha256).digest()


def session_key(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """The key one connection's messages are sealed with."""
    return hmac.new(key, b"session" + server_nonce + client_nonce, hashlib.sha256).digest()


def session_seals(
    key: bytes, server_nonce: bytes, client_nonce: bytes, *, server: bool
) -> tuple[Seal, Seal]:
    """One side's (opener, sealer) of a connection whose handshake exchanged these nonces: each
    side opens what the other sealed."""
    session = session_key(key, server_nonce, client_nonce)
    incoming, outgoing = (TO_SERVER, TO_CLIENT) if server else (TO_CLIENT, TO_SERVER)
    return Seal(session, incoming), Seal(session, outgoing)


class Seal:
    """One direction's sealing or opening of messages, with its sequence number."""

    def __init__(self, session: bytes, direction: bytes) -> None:
        self._aead = ChaCha20Poly1305(session)
        self._direction = direction
        self._sequence = 0

    def _nonce(self) -> bytes:
        nonce = self._direction + self._sequence.to_bytes(8, "little")
        self._sequence += 1
        return nonce

    def seal(self, message: bytes) -> bytes:
        """``message`` sealed, with its length in front."""
        sealed = self._aead.encrypt(self._nonce(), message, None)
        return LENGTH.pack(len(sealed)) + sealed

    def open(self, sealed: bytes) -> bytes:
        """The message inside ``sealed`` (without its length).

        Raises:
            StoreAuthenticationError: it was changed, replayed or injected.
        """
        try:
            return self._aead.decrypt(self._nonce(), sealed, None)
        except InvalidTag:
            raise StoreAuthenticationError(
                "a store message did not open with this connection's key: it was changed, "
                "replayed or injected"
            ) from None


def pack(op: int, *fields: bytes) -> bytes:
    """An operation (or an answer's status) and its fields, as one message."""
    parts = [struct.pack("<BH", op, len(fields))]
    for item in fields:
        parts.append(LENGTH.pack(len(item)))
        parts.append(item)
    return b"".join(parts)


def unpack(message: bytes) -> tuple[int, list[bytes]]:
    """What :func:`pack` packed.

    Raises:
        ValueError: the message is malformed.
    """
    if len(message) < 3:
        raise ValueError("a store message is too short")
    op, count = struct.unpack_from("<BH", message)
    offset = 3
    fields = []
    for _ in range(count):
        (length,) = LENGTH.unpack_from(message, offset)
        offset += LENGTH.size
        if offset + length > len(message):
            raise ValueError("a store message field runs past its end")
        fields.append(message[offset : offset + length])
        offset += length
    return op, fields


def int_field(value: int) -> bytes:
    return struct.pack("<q", value)


def int_of(data: bytes) -> int:
    return int(struct.unpack("<q", data)[0])


def bytes_field(value: str | bytes | Sequence[int]) -> bytes:
    """A key's or a value's bytes (text is UTF-8)."""
    if isinstance(value, str):
        return value.encode()
    return bytes(value)
