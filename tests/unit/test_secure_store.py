"""hora's store service: what a holder of the secret can do, and what nobody else can.

Every test talks to a real server over loopback sockets; the attacks are what another local
user can do: connect, guess, replay what it captured, or hold connections open. Clients are
the torch-free ``StoreConnection`` (what the launcher uses) and, for Gloo and torch's errors,
the ``TorchStore`` over one (what a worker's process groups use).
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from hora.common.job import store_protocol, store_service
from hora.common.job.store import new_secret, start_store_server
from hora.common.job.store_connection import StoreConnection
from hora.common.job.store_protocol import (
    StoreAuthenticationError,
    StoreConnectionError,
    StoreTimeout,
    StoreWaitEnded,
)
from hora.common.job.store_service import StoreServer
from hora.common.job.torch_store import TorchStore

SECRET = "a" * 64


@pytest.fixture
def server() -> Iterator[StoreServer]:
    running = StoreServer("127.0.0.1", 0, SECRET)
    yield running
    running.close()


def _client(server: StoreServer, secret: str = SECRET, timeout_s: float = 5.0) -> StoreConnection:
    return StoreConnection("127.0.0.1", server.port, secret, timeout_s)


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
        # The Python object must outlive its use from C++ (see TorchStore).
        client = TorchStore(_client(server))
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
def test_torch_gets_its_own_store_errors_and_the_launcher_plain_ones(server: StoreServer) -> None:
    """Through a TorchStore a timeout is torch's DistStoreError and a lost connection its
    DistNetworkError; the connection itself raises hora's torch-free errors, same messages."""
    connection = _client(server)
    store = TorchStore(connection)
    store.set("k", b"v")
    assert store.get("k") == b"v" and store.get_within("k", timedelta(seconds=1)) == b"v"
    with pytest.raises(dist.DistStoreError, match=r"timed out after 0.2 s .*'never'") as torch_:
        store.wait(["never"], timedelta(seconds=0.2))
    assert isinstance(torch_.value, StoreTimeout)
    with pytest.raises(StoreTimeout, match=r"timed out after 0.2 s .*'never'") as plain:
        connection.wait(["never"], timedelta(seconds=0.2))
    assert not isinstance(plain.value, dist.DistError)
    with pytest.raises(StoreTimeout):
        store.get_within("never", timedelta(seconds=0.1))
    server.close()
    with pytest.raises(dist.DistNetworkError, match="lost the connection to the store") as lost:
        store.get("k")
    assert isinstance(lost.value, StoreConnectionError)
    assert isinstance(lost.value.__cause__, OSError)


@pytest.mark.timeout(30)
def test_blocked_reads_end_early_once_their_check_gives_a_reason(server: StoreServer) -> None:
    reader, writer = _client(server), _client(server)
    lost = threading.Event()
    reader.end_waits_when(lambda: "round 3 was lost" if lost.is_set() else "")
    # Until the check says so, reads behave as without it: values come, timeouts are kept.
    threading.Timer(0.5, lambda: writer.set("late", b"v")).start()
    assert reader.get("late") == b"v"
    started = time.monotonic()
    with pytest.raises(StoreTimeout, match=r"timed out after 0.5 s"):
        reader.wait(["never"], timedelta(seconds=0.5))
    assert 0.45 < time.monotonic() - started < 1.5
    # Then a read that would wait 20 s ends at the next slice, carrying the reason, through
    # the TorchStore too (Gloo's rendezvous reads through one).
    threading.Timer(0.3, lost.set).start()
    started = time.monotonic()
    with pytest.raises(StoreWaitEnded, match=r"^round 3 was lost$"):
        reader.get_within("never", timedelta(seconds=20))
    assert time.monotonic() - started < 2.0
    with pytest.raises(StoreWaitEnded):
        TorchStore(reader).wait(["never"], timedelta(seconds=20))
    reader.end_waits_when(None)
    with pytest.raises(StoreTimeout):
        reader.wait(["never"], timedelta(seconds=0.3))


@pytest.mark.timeout(30)
def test_a_gloo_group_stops_connecting_when_told_to_give_up() -> None:
    """A member that never comes (a dead peer, as far as Gloo knows) keeps Gloo waiting in C++
    for its whole timeout; the communicator stops waiting once ``give_up`` gives a reason."""
    from hora.common.transport import TransportError
    from hora.common.transport.gloo import GlooCommunicator, make_device

    asked = time.monotonic() + 0.5
    started = time.monotonic()
    with pytest.raises(TransportError, match=r"gave up connecting: member 1 died"):
        GlooCommunicator(
            dist.HashStore(),  # a store of torch's own: nothing in it ends its waits
            0,
            2,
            5.0,  # the thread left behind ends then (the test process waits for it at exit)
            make_device("127.0.0.1", ""),
            give_up=lambda: "member 1 died" if time.monotonic() > asked else "",
        )
    assert time.monotonic() - started < 3.0


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
    greeting = sock.recv(len(store_protocol.GREETING) + store_protocol.NONCE_BYTES)
    assert greeting.startswith(store_protocol.GREETING)
    sock.sendall(bytes(64))  # a nonce and a guessed proof
    # Refused, and closed: the refusal tells the guesser only what it knew.
    assert sock.recv(100) == store_protocol.REFUSED
    assert sock.recv(100) == b""
    # What TCPStore's protocol would send (a "list keys" query) gets no more.
    sock = _raw(server)
    sock.recv(100)
    sock.sendall(b"\x0b" * 64)
    assert sock.recv(100) == store_protocol.REFUSED
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
    monkeypatch.setattr(store_service, "HANDSHAKE_S", 0.5)
    strays = [_raw(server) for _ in range(store_service.MAX_UNPROVEN * 2)]
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


def _flood(port: int, held: int, stop: threading.Event, opened: list[int]) -> None:
    """Keep ``held`` connections open that never prove anything, replacing each one the server
    closes, as fast as the server lets them in, until ``stop``."""
    socks: list[socket.socket] = []
    try:
        while not stop.is_set():
            socks = [s for s in socks if _still_open(s)]
            while len(socks) < held and not stop.is_set():
                try:
                    sock = socket.create_connection(("127.0.0.1", port), timeout=2)
                except OSError:
                    break
                sock.setblocking(False)
                socks.append(sock)
                opened[0] += 1
            time.sleep(0.005)
    finally:
        for sock in socks:
            sock.close()


def _still_open(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("held", [100, 300])
def test_a_flood_of_connections_delays_workers_but_never_fails_them(
    server: StoreServer, held: int
) -> None:
    stop = threading.Event()
    opened = [0]
    flooders = [
        threading.Thread(target=_flood, args=(server.port, held // 2, stop, opened), daemon=True)
        for _ in range(2)
    ]
    for flooder in flooders:
        flooder.start()
    while opened[0] < held // 2:
        time.sleep(0.01)
    errors: list[BaseException] = []
    finished: list[float] = []

    def worker(index: int) -> None:
        started = time.monotonic()
        try:
            store = _client(server, timeout_s=60.0)
            store.set(f"worker/{index}", b"here")
            finished.append(time.monotonic() - started)
        except BaseException as exc:  # reported below
            errors.append(exc)

    try:
        for _round in range(3):
            workers = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
            for thread in workers:
                thread.start()
            for thread in workers:
                thread.join(timeout=90)
    finally:
        stop.set()
        for flooder in flooders:
            flooder.join(timeout=10)
    assert not errors, errors
    assert len(finished) == 24
    # The flood really competed: the server pushed out connections to let workers in.
    assert opened[0] > store_service.MAX_UNPROVEN and server.rejected > 0
    assert _client(server).num_keys() >= 8


@pytest.mark.timeout(60)
def test_a_client_whose_connections_are_all_closed_early_names_a_possible_flood() -> None:
    """A "store" that closes every connection before taking the proof: the client retries until
    its timeout, then says what may be going on; it does not claim a wrong secret."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    stop = threading.Event()
    accepted = [0]

    def close_everything() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            sock.sendall(store_protocol.GREETING + bytes(store_protocol.NONCE_BYTES))
            sock.recv(100)
            sock.close()
            accepted[0] += 1

    thread = threading.Thread(target=close_everything, daemon=True)
    thread.start()
    try:
        with pytest.raises(StoreTimeout, match="flooding its port with connections") as info:
            StoreConnection("127.0.0.1", listener.getsockname()[1], SECRET, 2.0)
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()
    assert "secret differs" not in str(info.value)
    assert accepted[0] > 1  # it tried again


@pytest.mark.timeout(30)
def test_a_store_connection_does_not_pickle(server: StoreServer) -> None:
    import pickle

    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(_client(server))
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(TorchStore(_client(server)))


@pytest.mark.timeout(30)
def test_a_worker_that_vanishes_is_not_reported_as_a_store_problem(
    server: StoreServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker killed by a signal resets its connection: its own end reports the death; the
    store does not add a warning about the reset."""
    import struct

    store = _client(server)
    store.set("before", b"1")
    # Close with a reset (what the kernel sends for a process killed mid-request).
    store._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    store._sock.sendall(b"\x00\x00\x01")  # half a message: the store waits for the rest
    import logging

    hora_logger = logging.getLogger("hora")
    hora_logger.addHandler(caplog.handler)  # hora's logger does not propagate once configured
    try:
        with caplog.at_level("DEBUG", logger="hora"):
            store._sock.close()
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not any(
                "lost a connection" in r.message for r in caplog.records
            ):
                time.sleep(0.02)
    finally:
        hora_logger.removeHandler(caplog.handler)
    lost = [r for r in caplog.records if "lost a connection" in r.message]
    assert lost and all(r.levelname == "DEBUG" for r in lost)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert _client(server).get("before") == b"1"


@pytest.mark.timeout(30)
def test_a_named_port_held_for_a_moment_is_tried_again() -> None:
    """A port every rank derives from the job id can be the local port of someone's outgoing
    connection for a moment; the store waits it out instead of failing the job."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))  # bound without SO_REUSEADDR: a bind to it fails meanwhile
    port = holder.getsockname()[1]
    threading.Timer(0.5, holder.close).start()
    started = time.monotonic()
    server, bound = start_store_server("127.0.0.1", port, new_secret(), busy_wait_s=10)
    try:
        assert bound == port
        assert 0.4 < time.monotonic() - started < 10
    finally:
        server.close()


@pytest.mark.timeout(30)
def test_a_named_port_another_server_keeps_is_reported_after_the_wait() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    try:
        started = time.monotonic()
        with pytest.raises(OSError) as caught:
            start_store_server(
                "127.0.0.1", listener.getsockname()[1], new_secret(), busy_wait_s=0.5
            )
        assert caught.value.errno == errno.EADDRINUSE
        assert 0.5 <= time.monotonic() - started < 5
    finally:
        listener.close()
