"""Reaching other hosts over SSH: the ``ssh`` command line, the reachability check before a job
starts, and what a remote worker is sent.

hora uses the system ``ssh`` client, so the user's SSH configuration (keys, agent, ``~/.ssh/config``
aliases, ``ProxyJump``) applies. Every call passes ``-o BatchMode=yes`` so that ssh never stops to
ask for a password or a passphrase; a host that needs one fails the check with a message saying
so. A remote worker is started as ``ssh HOST python3 -c LOADER`` and everything else, the job's
secret included, is written to ssh's standard input (see :mod:`hora.runner.watchdog`).

This module knows ssh and hosts; it does not supervise processes.
"""

from __future__ import annotations

import math
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hora.common.vocabulary import settings_table as table
from hora.runner import watchdog
from hora.runner.hosts import HostError

# Default of ssh's ConnectTimeout in the reachability check and for the workers' connections.
CONNECT_TIMEOUT_S = 10.0
# How long `ssh HOST true` may take beyond connecting (key exchange, login, the shell).
LOGIN_SLACK_S = 20.0

# Reads the bootstrap's source from stdin and runs it; what follows on stdin is the job.
LOADER = (
    "import sys;f=sys.stdin.buffer;n=int(f.readline());"
    "exec(compile(f.read(n),'hora-watchdog','exec'),{'__name__':'__main__'})"
)


@dataclass(frozen=True)
class SshSettings:
    """How to reach remote hosts.

    Attributes:
        port: ``-p``; ``None`` leaves ssh's own default (its configuration, else 22).
        identity_file: ``-i``.
        options: extra ``-o`` options, e.g. ``UserKnownHostsFile=/path``; given before hora's own
            defaults, so they win over them (ssh keeps the first value it is given).
        connect_timeout_s: ssh's ``ConnectTimeout``.
    """

    port: int | None = None
    identity_file: str | None = None
    options: tuple[str, ...] = ()
    connect_timeout_s: float = CONNECT_TIMEOUT_S

    def argv(self, host: str) -> list[str]:
        """``ssh`` and its options, up to and including the destination host."""
        args = ["ssh", "-o", "BatchMode=yes"]
        for option in self.options:
            args += ["-o", option]
        args += [
            # Trust a host key seen for the first time, refuse one that changed; an option
            # StrictHostKeyChecking=yes given with --ssh-option comes first and wins.
            "-o",
            "StrictHostKeyChecking=accept-new",
            "-o",
            f"ConnectTimeout={max(1, math.ceil(self.connect_timeout_s))}",
            # Notice a dead connection (a host that vanished) within about a minute.
            "-o",
            "ServerAliveInterval=15",
            "-o",
            "ServerAliveCountMax=4",
        ]
        if self.port is not None:
            args += ["-p", str(self.port)]
        if self.identity_file is not None:
            args += ["-i", self.identity_file]
        args.append(host)
        return args

    def display(self, host: str) -> str:
        """The ``ssh`` command a user can paste to try the connection themselves."""
        extra = []
        if self.port is not None:
            extra += ["-p", str(self.port)]
        if self.identity_file is not None:
            extra += ["-i", self.identity_file]
        for option in self.options:
            extra += ["-o", option]
        return shlex.join(["ssh", *extra, host, "true"])


def require_ssh() -> None:
    """Check that an ``ssh`` client is on the PATH.

    Raises:
        HostError: it is not.
    """
    if shutil.which("ssh") is None:
        raise HostError(
            "horarun starts workers on other hosts with the `ssh` command, which is not on "
            "this machine's PATH. Install an OpenSSH client (e.g. `apt-get install "
            "openssh-client`) or run on this machine only (-H localhost:N)."
        )


def _hint(host: str, settings: SshSettings, stderr: str) -> str:
    text = stderr.lower()
    if "permission denied" in text:
        return (
            f"The host refused every key. Check that `{settings.display(host)}` works without a "
            "password (BatchMode), that your public key is in the host's authorized_keys, or "
            "pass --ssh-identity-file."
        )
    if "host key verification failed" in text or "host identification has changed" in text:
        return (
            f"The host's key does not match the one in known_hosts (it changed, or strict "
            f"checking is on). If the host was reinstalled, run `ssh-keygen -R {host}` and "
            f"connect once with `ssh {host} true`."
        )
    if "could not resolve" in text or "name or service not known" in text:
        return f"The name {host!r} does not resolve. Check its spelling, DNS or /etc/hosts."
    if "connection refused" in text:
        port = settings.port if settings.port is not None else 22
        return (
            f"Nothing accepts connections on port {port}. Is sshd running there? "
            "Pass -p/--ssh-port if it listens on another port."
        )
    return (
        f"Check that `{settings.display(host)}` works without a password, or pass "
        "--ssh-identity-file."
    )


def _probe(host: str, settings: SshSettings) -> str | None:
    """``None`` when ``ssh host true`` works, otherwise why not."""
    try:
        result = subprocess.run(
            [*settings.argv(host), "true"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=settings.connect_timeout_s + LOGIN_SLACK_S,
        )
    except subprocess.TimeoutExpired:
        return (
            f"cannot reach host {host!r} over SSH: `ssh {host} true` did not finish within "
            f"{settings.connect_timeout_s + LOGIN_SLACK_S:g} s. {_hint(host, settings, '')}"
        )
    if result.returncode == 0:
        return None
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    detail = lines[-1] if lines else "no message"
    return (
        f"cannot reach host {host!r} over SSH (exit {result.returncode}: {detail}).\n"
        f"{_hint(host, settings, result.stderr)}"
    )


def check_hosts(hosts: Sequence[str], settings: SshSettings) -> None:
    """Run ``ssh HOST true`` on every host at once.

    Raises:
        HostError: one or more hosts cannot be reached; the message names each of them.
    """
    if not hosts:
        return
    require_ssh()
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        problems = [p for p in pool.map(lambda h: _probe(h, settings), hosts) if p]
    if problems:
        raise HostError("\n".join(problems))


def ssh_hostname(host: str, settings: SshSettings) -> str:
    """The address ssh connects to for ``host`` (``ssh -G`` applies ``~/.ssh/config`` aliases)."""
    try:
        result = subprocess.run(
            [*settings.argv(host)[:-1], "-G", host],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return host
    for line in result.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key == "hostname" and value:
            return value.strip()
    return host


def remote_command() -> str:
    """The command ssh runs on the remote host: the bootstrap's loader under Python 3.

    The launcher's own interpreter is used when the same path exists there (the usual case with a
    shared file system or identical images), else ``python3`` from the remote PATH.
    """
    python = shlex.quote(sys.executable)
    return f'PY={python}; [ -x "$PY" ] || PY=python3; exec "$PY" -c {shlex.quote(LOADER)}'


def stdin_payload(
    argv: Sequence[str],
    env: dict[str, str],
    cwd: str,
    host: str,
    grace_s: float,
    launcher_timeout_s: float | None = None,
    fork_fd: int | None = None,
) -> bytes:
    """What the launcher writes to a worker's watchdog (here, or through ssh): the bootstrap,
    then the job. ``launcher_timeout_s``: the heartbeats' silence after which the watchdog
    stops the worker (``None``: never). ``fork_fd``: the watchdog's socket to a fork server
    (:mod:`hora.runner.fork_server`), inherited at this number; ``None``: the watchdog starts
    the worker itself."""
    source = Path(watchdog.__file__).read_bytes()
    job: dict[str, Any] = {
        "argv": list(argv),
        "env": env,
        "cwd": cwd,
        "host": host,
        "grace_s": grace_s,
        "label": _worker_label(env),
        "interface": _interface_rule(env),
        "threads": _threads_rule(env),
    }
    if launcher_timeout_s is not None:
        job["launcher_timeout_s"] = launcher_timeout_s
    if fork_fd is not None:
        job["fork_fd"] = fork_fd
    return b"%d\n" % len(source) + source + watchdog.encode_job(job)


def _worker_label(env: dict[str, str]) -> str:
    """How the watchdog names its worker: ``rank 2``, ``worker node1:0`` (an elastic one), or
    ``the worker``."""
    if env.get(table.RANK.env):
        return f"rank {env[table.RANK.env]}"
    if env.get(table.ELASTIC_ID.env):
        return f"worker {env[table.ELASTIC_ID.env]}"
    return "the worker"


def _interface_rule(env: dict[str, str]) -> dict[str, Any]:
    """What the watchdog does about Gloo's network interface: unless one of ``unless`` is set,
    put the interface its host reaches ``towards`` with in ``set`` (``towards`` empty: nothing).
    The watchdog runs without hora, so the names travel with the job."""
    return {
        "towards": env.get(table.RENDEZVOUS_ADDR.env, ""),
        "set": table.GLOO_IFACE.env,
        "unless": [*table.GLOO_IFACE.environ_names, "GLOO_SOCKET_IFNAME"],
    }


def _threads_rule(env: dict[str, str]) -> dict[str, Any]:
    """How many threads each worker's OpenMP (PyTorch's intra-op pool) starts: unless ``set``
    is in the worker's environment, the cores its host lets it run on, shared among the
    ``local_size`` workers there (at least one each), as torchrun does. Without it, each of N
    workers on N cores starts N threads, and they crowd each other out: a 1 MiB tensor copy
    took 7 ms instead of 43 us at 2 workers on 2 cores."""
    local_size = env.get(table.LOCAL_SIZE.env, "")
    return {
        "set": "OMP_NUM_THREADS",
        "local_size": int(local_size) if local_size.isdigit() else 0,
    }


def interface_address(name: str) -> str:
    """The IPv4 address of this machine's interface ``name``.

    Raises:
        HostError: there is no such interface, or it has no IPv4 address.
    """
    import socket

    import psutil

    interfaces = psutil.net_if_addrs()
    if name not in interfaces:
        known = ", ".join(sorted(interfaces))
        raise HostError(
            f"--network-interface {name!r}: this machine has no such interface ({known})."
        )
    for entry in interfaces[name]:
        if entry.family == socket.AF_INET:
            return str(entry.address)
    raise HostError(f"--network-interface {name!r} has no IPv4 address on this machine.")


def rendezvous_address(
    remote_hosts: Sequence[str], settings: SshSettings, interfaces: Sequence[str]
) -> str:
    """The address the job's store listens on: the one every worker can reach, and no other.

    * a job on this machine only: ``127.0.0.1``;
    * with ``--network-interface``: that interface's address;
    * otherwise: the address this machine uses to reach the remote hosts (from the routing
      table); they must all be reached through the same one.

    Raises:
        HostError: a host's name does not resolve, or the hosts are reached through different
            local addresses.
    """
    if not remote_hosts:
        return "127.0.0.1"
    if interfaces:
        return interface_address(interfaces[0])
    by_source: dict[str, list[str]] = {}
    for host in remote_hosts:
        source = _source_towards(host, ssh_hostname(host, settings))
        by_source.setdefault(source, []).append(host)
    if len(by_source) > 1:
        routes = "; ".join(f"{', '.join(h)} through {a}" for a, h in by_source.items())
        raise HostError(
            f"this machine reaches the hosts through different addresses ({routes}), and the "
            "job's rendezvous store listens on one. Pass --network-interface IFACE with the "
            "interface every host can reach."
        )
    return next(iter(by_source))


def _source_towards(host: str, target: str) -> str:
    """The local IPv4 address through which this machine reaches ``host`` (ssh's ``target``).

    Raises:
        HostError: its name does not resolve to an IPv4 address, or no route leads there.
    """
    import ipaddress
    import socket

    try:
        ipaddress.IPv6Address(target.split("%", 1)[0])
    except ValueError:
        pass
    else:
        raise HostError(
            f"host {host!r} is an IPv6 address, but a job spanning hosts reaches them over "
            "IPv4 (the rendezvous store and Gloo listen on an IPv4 address). Name the host by "
            "its IPv4 address or by a name that resolves to one."
        )
    try:
        address = str(socket.getaddrinfo(target, None, socket.AF_INET)[0][4][0])
    except (OSError, UnicodeError) as exc:
        alias = f" (ssh connects to {target})" if target != host else ""
        raise HostError(
            f"host {host!r}{alias} does not resolve to an IPv4 address "
            f"({getattr(exc, 'strerror', None) or exc}). Check its spelling, DNS or /etc/hosts."
        ) from None
    try:
        return watchdog.source_address_towards(address)
    except OSError as exc:
        raise HostError(
            f"cannot find how this machine reaches host {host!r} ({address}): "
            f"{exc.strerror or exc}. Name an interface with --network-interface."
        ) from None
