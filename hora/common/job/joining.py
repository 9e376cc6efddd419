"""Joining the job's store when a launcher other than ``horarun`` started this process.

:func:`join` takes the :class:`~hora.common.job.topology.Topology` that
:func:`~hora.common.job.topology.detect` read and returns a connected
:class:`~hora.common.job.store.StoreClient` and the finished topology. On the way it:

* starts the store in the process that hosts it (MPI's rank 0, the first task of a SLURM step,
  rank 0 under ``env://``), listening only on the job's address;
* under MPI with ``mpi4py``, has rank 0 pick a free port and a fresh job secret and send both,
  with its address, to the other ranks over MPI (``bcast``);
* in torchrun's agent store, which outlives a round of workers, agrees with the other ranks on a
  fresh key prefix for this round, so nothing a previous round left there is read again;
* works out local and cross ranks by exchanging host names where the launcher does not export
  them (MPI);
* keeps a store it started alive at exit until the other ranks have detached.

It knows stores, sockets and launchers' plans, not the engine.
"""

from __future__ import annotations

import atexit
import errno
import ipaddress
import json
import logging
import secrets
import socket
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from hora.common.job import port_file, store_keys
from hora.common.job.launchers import StorePlan, import_mpi
from hora.common.job.store import (
    AuthenticationError,
    StoreClient,
    has_mark,
    new_secret,
    put_mark,
    sign,
    start_store_server,
    tampering,
    verify,
)
from hora.common.job.store_keys import GenerationKeys
from hora.common.job.topology import Topology, TopologyError
from hora.common.runtime import HostedStore, runtime
from hora.common.vocabulary import settings_table as table
from hora.common.vocabulary.config import gloo_interface, raw, read

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from mpi4py import MPI

logger = logging.getLogger("hora")

# How often rank 0 looks for the others' greetings while agreeing on a round's prefix.
ROUND_POLL_S = 0.02
# How long a process that hosts the store waits at exit for the other ranks to detach.
LINGER_S = 10.0

# Stores started by this process live until it exits: hora.common.runtime.HostedStores.


# ---------------------------------------------------------------- mpi4py


def _mpi_world(topology: Topology, comm: MPI.Intracomm | None = None) -> MPI.Intracomm:
    """MPI_COMM_WORLD, checked against the launcher's variables; or ``comm``, the communicator
    the user made the job of (``hvd.init(comm=...)``)."""
    mpi = import_mpi()
    if not mpi.Is_initialized():
        mpi.Init_thread(mpi.THREAD_MULTIPLE)
    if comm is not None:
        return comm
    world: MPI.Intracomm = mpi.COMM_WORLD
    if (world.Get_rank(), world.Get_size()) != (topology.rank, topology.size):
        raise TopologyError(
            f"{topology.source} says this is rank {topology.rank} of {topology.size}, but "
            f"mpi4py's MPI_COMM_WORLD says rank {world.Get_rank()} of {world.Get_size()}: "
            "mpi4py is probably built for another MPI than the one that launched the job. "
            "Set HORA_MPI4PY=0 to rendezvous without it, or install mpi4py for this MPI."
        )
    return world


# ---------------------------------------------------------------- addresses


def _resolve(addr: str) -> str:
    """An IP address for ``addr`` (a host name or an address), preferring IPv4."""
    try:
        return str(ipaddress.ip_address(addr))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise TopologyError(f"cannot resolve the rendezvous host {addr!r}: {exc}") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return str(infos[0][4][0])


def _own_address(topology: Topology) -> str:
    """The address rank 0 offers the other ranks when no variable names one (MPI with mpi4py)."""
    if _all_local(topology):
        return "127.0.0.1"
    interface = gloo_interface()
    if interface:
        import psutil

        for entry in psutil.net_if_addrs().get(interface, []):
            if entry.family == socket.AF_INET:
                return str(entry.address)
        raise TopologyError(f"network interface {interface!r} has no IPv4 address on this host.")
    try:
        address = _resolve(socket.getfqdn())
    except TopologyError:
        address = ""
    if address and not ipaddress.ip_address(address).is_loopback:
        return address
    # The host name resolves to loopback (common on Debian): use the address of the interface
    # that routes outwards. Connecting a UDP socket sends nothing.
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1, never routed to a real host
        return str(probe.getsockname()[0])
    except OSError:
        raise TopologyError(
            "cannot tell which address of this host the other hosts reach: set "
            "HORA_GLOO_IFACE to the network interface, or MASTER_ADDR to this host's address."
        ) from None
    finally:
        probe.close()


def _all_local(topology: Topology) -> bool:
    launch = topology.launch
    return launch is not None and launch.local_size == topology.size


def _host_store(topology: Topology, addr: str, port: int, secret: str) -> tuple[int, str]:
    """Start the job's store on ``addr:port`` in this process (once per process).

    Returns:
        Its port and the secret it was started with (a store this process already hosts keeps
        the secret it was started with).
    """
    bind = _resolve(addr)
    hosted = runtime().hosted_stores
    with hosted.lock:
        for (bound, bound_port), (_server, its_secret) in hosted.servers.items():
            if bound == bind and port in (0, bound_port):
                return bound_port, its_secret
        try:
            server, bound_port = start_store_server(bind, port, secret)
        except OSError as exc:
            hint = (
                f"{addr} ({bind}) is not an address of this host ({socket.gethostname()}): "
                "set MASTER_ADDR or HORA_RENDEZVOUS_ADDR to the host where this rank runs"
                if exc.errno == errno.EADDRNOTAVAIL
                else "Another job may be using the port: set HORA_RENDEZVOUS_PORT (or "
                "MASTER_PORT) to a free port"
            )
            raise TopologyError(
                f"rank {topology.rank} ({topology.source}) cannot start the job's rendezvous "
                f"store on {bind}:{port}: {exc.strerror or exc}. {hint}."
            ) from None
        hosted.servers[(bind, bound_port)] = (server, secret)
    logger.debug("rank %d hosts the job's store on %s:%d", topology.rank, bind, bound_port)
    return bound_port, secret


def keep_hosted(name: str, server: HostedStore) -> None:
    """Keep ``server``, a job's store this process serves, under ``name`` until
    :func:`release_hosted` (the process's runtime holds it: a Ray worker hosts its job's store
    between the Ray driver's calls)."""
    hosted = runtime().hosted_stores
    with hosted.lock:
        hosted.named[name] = server


def release_hosted(name: str) -> HostedStore | None:
    """The store kept under ``name``, no longer kept (``None``: none, or it was released
    already); closing it is the caller's."""
    hosted = runtime().hosted_stores
    with hosted.lock:
        return hosted.named.pop(name, None)


def receiving_key() -> X25519PrivateKey:
    """This process's X25519 private key, which a job secret sealed to it is opened with (made
    at first use; the process's runtime keeps it)."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    hosted = runtime().hosted_stores
    with hosted.lock:
        if hosted.receiving_key is None:
            hosted.receiving_key = X25519PrivateKey.generate()
        return hosted.receiving_key


# ---------------------------------------------------------------- torchrun rounds


class _AgentStore(Protocol):
    """What the round agreement uses of torchrun's agent store (a ``torch.distributed.Store``)."""

    def set(self, key: str, value: bytes) -> None:
        """Write ``value`` under ``key``."""

    def get(self, key: str) -> bytes:
        """The value under ``key`` (waits for it)."""

    def check(self, keys: list[str]) -> bool:
        """Whether every one of ``keys`` is there."""

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        """Wait until every one of ``keys`` is there (``RuntimeError`` after ``timeout``)."""


def _agree_round(
    store: _AgentStore, prefix: str, secret: str, rank: int, size: int, timeout_s: float
) -> str:
    """A token that every rank of this round of a torchrun job agrees on.

    torchrun's agent store lives across restarts and resizes, so what an earlier round wrote is
    still there, and ``TORCHELASTIC_RESTART_COUNT`` differs between nodes after a resize. Each
    rank greets rank 0 with a fresh nonce; rank 0 answers every greeting it sees with its fresh
    token under a key named by the nonce (so no rank can read a previous round's answer), until
    every rank has acknowledged under a key named by the token. torchrun's store admits anyone
    who can reach it, so greetings, answers and acknowledgements are all signed with the job
    secret and bound to their keys; a forged one fails the job with an error naming tampering.
    """
    try:
        return _agree_round_checked(store, prefix, secret, rank, size, timeout_s)
    except AuthenticationError as exc:
        raise TopologyError(tampering(exc, rank)) from None


def _agree_round_checked(
    store: _AgentStore, prefix: str, secret: str, rank: int, size: int, timeout_s: float
) -> str:
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        token = secrets.token_hex(16)
        answered: dict[int, bytes] = {}
        pending = set(range(1, size))
        while pending:
            for peer in sorted(pending):
                greeting = store_keys.torchrun_hello(prefix, peer)
                if store.check([greeting]):
                    nonce = verify(secret, bytes(store.get(greeting)), "greeting", greeting)
                    if answered.get(peer) != nonce:
                        answered[peer] = nonce
                        key = store_keys.torchrun_welcome(prefix, nonce)
                        store.set(key, sign(secret, token.encode(), key=key))
                if has_mark(store, store_keys.torchrun_ready(prefix, token, peer), secret):
                    pending.discard(peer)
            if pending and time.monotonic() > deadline:
                raise TopologyError(_missing_ranks(sorted(pending), timeout_s))
            if pending:
                time.sleep(ROUND_POLL_S)
        return token
    nonce = secrets.token_bytes(16)
    hello = store_keys.torchrun_hello(prefix, rank)
    store.set(hello, sign(secret, nonce, key=hello))
    key = store_keys.torchrun_welcome(prefix, nonce)
    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except RuntimeError:
        raise TopologyError(
            f"rank {rank} waited {timeout_s:g} s for rank 0 in torchrun's store; is rank 0 "
            "running and calling hvd.init()? Raise HORA_START_TIMEOUT if start-up is slow."
        ) from None
    token = verify(secret, bytes(store.get(key)), what="round token", key=key).decode()
    put_mark(store, store_keys.torchrun_ready(prefix, token, rank), secret)
    return token


def _missing_ranks(ranks: list[int], timeout_s: float) -> str:
    shown = ", ".join(map(str, ranks[:16])) + (" ..." if len(ranks) > 16 else "")
    return (
        f"rank 0 waited {timeout_s:g} s for ranks {shown} to call hvd.init(). Check their "
        "output; raise HORA_START_TIMEOUT if start-up is slow."
    )


# ---------------------------------------------------------------- local and cross ranks


def _exchange(store: StoreClient, topology: Topology, generation: int) -> Topology:
    """Local and cross ranks from every rank's host name (and local rank, where known).

    Horovod's definitions: local ranks number the processes of one host in global-rank order;
    the cross rank is the position among the processes with the same local rank.
    """
    launch = topology.launch
    if launch is None:
        return topology
    mine = {"host": topology.hostname, "local_rank": launch.local_rank}
    generation_keys = GenerationKeys(generation)
    store.set_signed(generation_keys.topology(topology.rank), json.dumps(mine).encode())
    names = [generation_keys.topology(r) for r in range(topology.size)]
    keys = [store.key(name) for name in names]
    try:
        store.store.wait(keys, timedelta(seconds=store.timeout_s))
    except RuntimeError:
        missing = [r for r, name in enumerate(names) if not store.check(name)]
        raise TopologyError(_missing_ranks(missing, store.timeout_s)) from None
    blobs = store.store.multi_get(keys)
    try:
        peers = [json.loads(store.verified(name, bytes(blob))) for name, blob in zip(names, blobs)]
    except AuthenticationError as exc:
        raise TopologyError(tampering(exc, topology.rank)) from None
    if any(p["local_rank"] is None for p in peers):
        seen: dict[str, int] = {}
        for peer in peers:
            peer["local_rank"] = seen.get(peer["host"], 0)
            seen[peer["host"]] = peer["local_rank"] + 1
    local_rank = peers[topology.rank]["local_rank"]
    local_size = launch.local_size
    if local_size is None:
        local_size = sum(1 for p in peers if p["host"] == topology.hostname)
    same_local = [r for r, p in enumerate(peers) if p["local_rank"] == local_rank]
    return replace(
        topology,
        local_rank=local_rank,
        local_size=local_size,
        cross_rank=same_local.index(topology.rank),
        cross_size=len(same_local),
    )


# ---------------------------------------------------------------- join


def join(
    topology: Topology,
    timeout_s: float,
    generation: int = 0,
    mpi_comm: MPI.Intracomm | None = None,
) -> tuple[Topology, StoreClient]:
    """Connect to the job's store (starting it first where this process hosts it).

    Args:
        topology: what :func:`~hora.common.job.topology.detect` returned.
        timeout_s: how long to wait for the store and for the other ranks.
        generation: how many times ``hvd.init`` ran before in this process (keeps keys apart).
        mpi_comm: the mpi4py communicator whose processes are the job, when it is not
            ``MPI_COMM_WORLD``: its rank 0 hands out the store over it.

    Returns:
        The finished topology (address, port, secret and all ranks filled in) and the store.

    Raises:
        TopologyError: the store cannot be started or reached, or the ranks disagree.
    """
    plan = topology.plan
    if plan is None:
        store = StoreClient(
            topology.rendezvous_addr, topology.rendezvous_port, topology.secret, timeout_s
        )
        return topology, store
    addr, port, secret, authenticated = _secret_and_store(topology, plan, mpi_comm)
    published = _port_file(plan, authenticated)
    if plan.host and not plan.mpi4py:
        port, secret = _host_store(topology, addr, 0 if published else port, secret)
        if published:
            port_file.publish(published, plan.job_id, secret, port)
    elif published:
        port = _published_port(topology, published, secret, timeout_s)
    try:
        store = StoreClient(addr, port, secret, timeout_s, prefix=plan.prefix, foreign=plan.shared)
    except RuntimeError as exc:
        raise TopologyError(
            f"rank {topology.rank} ({topology.source}) cannot reach the job's store at "
            f"{addr}:{port} ({plan.how}) within {timeout_s:g} s: {exc.__cause__ or exc}. Check "
            "that the rank hosting it started (its output says why not). If the address "
            "resolves to a loopback address on its own host, set HORA_RENDEZVOUS_ADDR (or "
            "MASTER_ADDR) to one the other hosts reach; raise HORA_START_TIMEOUT if start-up is "
            "slow."
        ) from exc
    prefix = plan.prefix
    if plan.shared:
        token = _agree_round(store.store, prefix, secret, topology.rank, topology.size, timeout_s)
        prefix = f"{prefix}{token}/"
        store = StoreClient(addr, port, secret, timeout_s, prefix=prefix, foreign=True)
    topology = replace(
        topology,
        rendezvous_addr=addr,
        rendezvous_port=port,
        secret=secret,
        authenticated=authenticated,
        store_prefix=prefix,
    )
    if plan.exchange:
        topology = _exchange(store, topology, generation)
    topology.validate()
    if plan.host or (plan.mpi4py and topology.rank == 0):
        _linger_at_exit(store, topology, generation)
    if not authenticated and topology.rank == 0:
        logger.warning(
            "%s hands out no job secret and HORA_SECRET_KEY is not set: the job's store at "
            "%s:%d is not authenticated (HORA_ALLOW_UNAUTHENTICATED=1), so any process that can "
            "reach it and knows the job id can read and write the job's keys. Set "
            "HORA_SECRET_FILE or HORA_SECRET_KEY to authenticate it; see docs/security.md.",
            topology.source,
            addr,
            port,
            extra={"hora_rank": topology.rank},
        )
    logger.debug("joined %s: %s", plan.how, topology, extra={"hora_rank": topology.rank})
    return topology, store


def _port_file(plan: StorePlan, authenticated: bool) -> Path | None:
    """Where rank 0 publishes its random port, when the port would otherwise be derived from
    the job id and the job has a secret file every rank sees (:mod:`port_file`)."""
    secret_file = raw(table.SECRET_FILE) or ""
    if not (plan.derived and authenticated and secret_file) or plan.mpi4py or plan.shared:
        return None
    if raw(table.SECRET_KEY):
        return None  # the secret came from the environment; the file may not be shared
    return port_file.path_for(secret_file, plan.job_id)


def _published_port(topology: Topology, path: Path, secret: str, timeout_s: float) -> int:
    """The port rank 0 published in ``path`` (see :mod:`hora.common.job.port_file`)."""
    import psutil

    assert topology.plan is not None
    started = psutil.Process().create_time()
    try:
        return port_file.wait(path, topology.plan.job_id, secret, timeout_s, started)
    except TimeoutError as exc:
        raise TopologyError(f"rank {topology.rank} ({topology.source}): {exc}") from None
    except AuthenticationError as exc:
        raise TopologyError(tampering(exc, topology.rank)) from None


def _secret_and_store(
    topology: Topology, plan: StorePlan, mpi_comm: MPI.Intracomm | None = None
) -> tuple[str, int, str, bool]:
    """The store's address and port, the job secret, and whether the secret is secret.

    Raises:
        TopologyError: no launcher hands out a secret, none was given, and the user did not
            allow an unauthenticated job.
    """
    if plan.mpi4py:
        addr, port, secret = _exchange_over_mpi(topology, plan, mpi_comm)
        return addr, port, secret, True
    if topology.secret:
        return plan.addr, plan.port, topology.secret, True
    if not read(table.ALLOW_UNAUTHENTICATED):
        raise TopologyError(_no_secret(topology))
    # Allowed by the user: keys are still kept apart per job, but anyone who can reach the
    # store and knows the job id could use it (docs/security.md).
    return plan.addr, plan.port, f"unauthenticated:{plan.job_id}", False


def _no_secret(topology: Topology) -> str:
    """Why a job without a secret does not start, and how to give it one."""
    return (
        f"rank {topology.rank}: {topology.source} hands out no job secret, and neither "
        "HORA_SECRET_KEY nor HORA_SECRET_FILE is set, so the job's store could not tell this "
        "job's processes from anyone else's. Give every rank the same secret: create a file "
        "readable only by you on a file system every rank sees, (umask 077; python3 -c 'import "
        "secrets; print(secrets.token_hex(32))' > ~/.hora_secret), and export "
        "HORA_SECRET_FILE=~/.hora_secret before srun, torchrun or mpirun (mpirun: add -x "
        "HORA_SECRET_FILE; with mpi4py installed, MPI hands out a secret by itself). To run "
        "without one on a network you trust, set HORA_ALLOW_UNAUTHENTICATED=1. See "
        "docs/security.md."
    )


def _exchange_over_mpi(
    topology: Topology, plan: StorePlan, mpi_comm: MPI.Intracomm | None = None
) -> tuple[str, int, str]:
    world = _mpi_world(topology, mpi_comm)
    offer: tuple[str, str, int, str] | None = None
    if topology.rank == 0:
        try:
            addr = plan.addr or _own_address(topology)
            port, secret = _host_store(topology, addr, plan.port, topology.secret or new_secret())
            offer = ("ok", addr, port, secret)
        except TopologyError as exc:
            offer = ("error", str(exc), 0, "")
    status, addr, port, secret = world.bcast(offer, root=0)
    if status != "ok":
        raise TopologyError(addr if topology.rank == 0 else f"rank 0 failed: {addr}")
    return addr, port, secret


# ---------------------------------------------------------------- leaving


def detach(store: StoreClient, rank: int, generation: int) -> None:
    """Tell the process that hosts the store that this rank no longer needs it."""
    try:
        store.mark(GenerationKeys(generation).detached(rank))
    except Exception:  # best effort while leaving
        pass


def _linger_at_exit(store: StoreClient, topology: Topology, generation: int) -> None:
    """At exit, keep this process (and the store it hosts) until the other ranks detached."""
    linger = runtime().hosted_stores.linger
    linger.generation = generation
    linger.store = store.reconnect()
    linger.size = topology.size
    linger.rank = topology.rank
    if not linger.registered:
        atexit.register(_wait_for_detach)
        linger.registered = True


def _wait_for_detach() -> None:
    linger = runtime().hosted_stores.linger
    store = linger.store
    if store is None:
        return
    others = [r for r in range(linger.size) if r != linger.rank]
    names = [GenerationKeys(linger.generation).detached(r) for r in others]
    try:
        store.store.wait([store.key(n) for n in names], timedelta(seconds=LINGER_S))
    except Exception:  # a rank that died never detaches; stop waiting
        logger.debug("stopped waiting for ranks to detach from the store after %g s", LINGER_S)
        return
    try:
        # A forged detach mark would let this process (and the store) go while ranks need it.
        store.all_marked(names)
    except AuthenticationError as exc:
        logger.error("%s", tampering(exc, linger.rank))
    except Exception:  # the store is going away: nothing left to protect
        pass
