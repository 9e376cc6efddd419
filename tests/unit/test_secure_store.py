"""hora's store service: what a holder of the secret can do, and what nobody else can.

Every test talks to a real server over loopback sockets; the attacks are what another local
user can do: connect, guess, replay what it captured, or hold connections open.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from hora.common.job import secure_store
from hora.common.job.secure_store import (
    SecureStore,
    StoreAuthenticationError,
    StoreServer,
    StoreTimeout,
)

SECRET = "a" * 64


@pytest.fixture
def server() -> Iterator[StoreServer]:
    running = StoreServer("127.0.0.1", 0, SECRET)
    yield running
    running.close()


def _client(server: StoreServer, secret: str = SECRET, timeout_s: float = 5.0) -> SecureStore:
    return SecureStore("127.0.0.1", server.port, secret, timeout_s)


@pytest.mark.timeout(30)
def test_a_holder_of_the_secret_gets_tcpstore_semantics(server: StoreServer) -> None:
    store = _client(server)
    store.set("a", b"1")
    store.set("text", "hello")
    assert store.get("a") == b"1" and store.get("text") == b"hello"
    assert store.check(["a", "text"]) and not store.check(["a", "missing"])
    assert store.add("counter", 2) == 2 and store.add("counter", 3) == 5
    assert store.get("counter") == b"5"
    # compare_set: an absent key is set when "" is expected; otherwise the current value wins.
    assert store.compare_set("cas", "", b"first") == b"first"
    assert store.compare_set("cas", "", b"second") == b"first"
    assert store.compare_set("cas", b"first", b"third") == b"third"
    assert store.compare_set("absent", b"x", b"y") == b"x"
    store.multi_set(["m1", "m2"], [b"x", "y"])
    assert store.multi_get(["m1", "m2"]) == [b"x", b"y"]
    assert store.num_keys() == 6
    assert store.delete_key("a") and not store.delete_key("a")
    store.close()


@pytest.mark.timeout(30)
def test_get_and_wait_block_until_another_connection_writes(server: StoreServer) -> None:
    reader, writer = _client(server), _client(server)
    threading.Timer(0.2, lambda: writer.set("late", b"v")).start()
    started = time.monotonic()
    assert reader.get("late") == b"v"
    assert time.monotonic() - started >= 0.15
    threading.Timer(0.1, lambda: writer.set("later", b"w")).start()
    reader.wait(["later"], timedelta(seconds=5))
    with pytest.raises(StoreTimeout, match="timed out"):
        reader.wait(["never"], timedelta(seconds=0.2))
    # A timeout is a RuntimeError, as TCPStore's is, and the connection goes on working.
    assert issubclass(StoreTimeout, RuntimeError)
    assert reader.get("later") == b"w"


@pytest.mark.timeout(60)
def test_gloo_rendezvous_goes_through_it(server: StoreServer) -> None:
    results: list[torch.Tensor] = []

    def rank(r: int) -> None:
        # The Python object must outlive its use from C++ (see SecureStore).
        client = _client(server)
        store = dist.PrefixStore("group/", client)
        group = dist.ProcessGroupGloo(store, r, 2, timedelta(seconds=20))
        tensor = torch.full((3,), float(r + 1))
        group.allreduce([tensor]).wait()
        results.append(tensor)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=40)
    assert len(results) == 2 and all(torch.equal(t, torch.full((3,), 3.0)) for t in results)


@pytest.mark.timeout(30)
def test_a_wrong_secret_is_refused_and_learns_nothing(server: StoreServer) -> None:
    _client(server).set("job/payload", b"secret argument")
    with pytest.raises(StoreAuthenticationError, match="secret differs"):
        _client(server, secret="b" * 64)
    assert server.rejected >= 1


@pytest.mark.timeout(30)
def test_a_fake_server_on_the_port_is_detected() -> None:
    # Another user took the port first and greets like a store, but cannot prove the secret.
    impostor = StoreServer("127.0.0.1", 0, "c" * 64)
    try:
        with pytest.raises(StoreAuthenticationError):
            _client(impostor)
    finally:
        impostor.close()


def _raw(server: StoreServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    return sock


@pytest.mark.timeout(30)
def test_guessed_proofs_and_plain_requests_are_refused(server: StoreServer) -> None:
    sock = _raw(server)
    greeting = sock.recv(len(secure_store.GREETING) + secure_store.NONCE_BYTES)
    assert greeting.startswith(secure_store.GREETING)
    sock.sendall(bytes(64))  # a nonce and a guessed proof
    assert sock.recv(100) == b""  # closed without an answer
    # What TCPStore's protocol would send (a "list keys" query) gets nothing either.
    sock = _raw(server)
    sock.recv(100)
    sock.sendall(b"\x0b" * 64)
    assert sock.recv(100) == b""


@pytest.mark.timeout(30)
def test_captured_messages_cannot_be_replayed(server: StoreServer) -> None:
    """A sealed request copied from one connection does nothing on another, or again on its own."""
    store = _client(server)
    sealer = store._sealer
    captured: list[bytes] = []
    original = sealer.seal

    def capture(message: bytes) -> bytes:
        sealed = original(message)
        captured.append(sealed)
        return sealed

    sealer.seal = capture  # type: ignore[method-assign]
    store.set("k", b"v1")
    store.set("k", b"v2")
    other = _client(server)
    # Replaying the first "set" on another connection: it does not open there; closed.
    other._sock.sendall(captured[0])
    assert other._sock.recv(100) == b""
    # Replaying it on its own connection: its sequence number is spent; closed.
    store._sock.sendall(captured[0])
    assert store._sock.recv(100) == b""
    assert _client(server).get("k") == b"v2"


@pytest.mark.timeout(60)
def test_stray_connections_cannot_use_up_the_server(
    server: StoreServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(secure_store, "HANDSHAKE_S", 0.5)
    strays = [_raw(server) for _ in range(secure_store.MAX_UNPROVEN * 2)]
    # Each one over the limit pushed out the oldest; the rest are closed when their time is up,
    # and a holder of the secret connects all along.
    store = _client(server)
    store.set("ok", b"1")
    deadline = time.monotonic() + 10
    while server.rejected < len(strays) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.rejected >= len(strays)
    assert _client(server).get("ok") == b"1"
    for sock in strays:
        sock.close()


@pytest.mark.timeout(30)
def test_a_store_connection_does_not_pickle(server: StoreServer) -> None:
    import pickle

    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(_client(server))
