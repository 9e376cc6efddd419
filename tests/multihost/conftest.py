"""Hosts for multi-host tests: Linux network namespaces, each with its own address and sshd.

The ``cluster`` fixture builds, once per module, a bridge on this machine (the launcher's side,
``10.77.N.1``) and two namespaces ``a`` and ``b`` (``10.77.N.2`` and ``.3``) joined to it by veth
pairs. Each runs ``sshd`` with a throwaway host key, accepting a throwaway client key; the
launcher trusts the host keys through its own ``known_hosts`` file (``StrictHostKeyChecking=yes``).
The namespaces share this machine's file system and process table, so the repository, the virtual
environment and ``psutil`` see everything, while the network is really separate: Gloo and the
store must use the addresses on the bridge.

Everything is torn down by finalizers, and leftovers of a crashed run (names carry the creating
pid) are removed first. Tests skip, saying why, where they cannot run: not root, no ``sshd``, or
namespaces not allowed here.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from hora.tools.cluster import free_subnet, wait_for_port

NETNS_DIR = Path("/etc/netns")


_CLUSTERS = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _needs() -> str | None:
    """Why these tests cannot run here, or ``None``."""
    if os.geteuid() != 0:
        return "multi-host tests need root to create network namespaces"
    for tool, package in (("ip", "iproute2"), ("ssh", "openssh-client")):
        if shutil.which(tool) is None:
            return f"multi-host tests need `{tool}` (apt-get install {package}; .ci/run does)"
    for tool in ("/usr/sbin/sshd", "/usr/bin/ssh-keygen"):
        if not os.access(tool, os.X_OK):
            return f"multi-host tests need {tool} (apt-get install openssh-server; .ci/run does)"
    return None


def _remove_stale() -> None:
    """Namespaces and bridges left by runs whose process is gone."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        match = re.match(r"(hora-(\d+)-\w+)", line)
        if match and not psutil.pid_exists(int(match.group(2))):
            _delete_namespace(match.group(1))
    for line in _ip("-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        match = re.search(r": (hbr(\d+)(?:-\d+)?)[:@]", line)
        if match and not psutil.pid_exists(int(match.group(2))):
            _ip("link", "del", match.group(1), check=False)


def _delete_namespace(name: str) -> None:
    for pid in _ip("netns", "pids", name, check=False).stdout.split():
        try:
            os.kill(int(pid), 9)
        except (ProcessLookupError, ValueError):
            pass
    _ip("netns", "del", name, check=False)
    shutil.rmtree(NETNS_DIR / name, ignore_errors=True)


@dataclass
class Cluster:
    """Two SSH hosts and how to reach them.

    Attributes:
        bridge: this machine's interface on the hosts' network.
        launcher: its address there.
        hosts: the hosts' addresses (``a``, ``b``).
        unreachable: an address on that network where nothing answers.
        ssh_flags: the horarun flags that reach the hosts.
    """

    bridge: str
    launcher: str
    hosts: list[str]
    unreachable: str
    ssh_flags: list[str]
    namespaces: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = _needs()
    if reason:
        pytest.skip(reason)
    _remove_stale()
    pid = os.getpid()
    # Names carry the pid and a count of clusters made by this process: the kernel removes a
    # deleted namespace's interfaces in the background, so the next module's cluster must not
    # reuse the previous one's names.
    number = next(_CLUSTERS)
    bridge = f"hbr{pid}-{number}"
    probe = _ip("netns", "add", f"hora-{pid}-probe", check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot create network namespaces here: {probe.stderr.strip()}")
    _delete_namespace(f"hora-{pid}-probe")

    keys = tmp_path_factory.mktemp("ssh")
    for name in ("host_key", "client_key"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)],
            check=True,
            timeout=30,
        )
    (keys / "authorized_keys").write_text((keys / "client_key.pub").read_text())
    host_key = " ".join((keys / "host_key.pub").read_text().split()[:2])
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory

    prefix = free_subnet("10.77")
    cluster = Cluster(
        bridge=bridge,
        launcher=f"{prefix}.1",
        hosts=[f"{prefix}.2", f"{prefix}.3"],
        unreachable=f"{prefix}.99",
        ssh_flags=[
            "--ssh-identity-file",
            str(keys / "client_key"),
            "--ssh-option",
            f"UserKnownHostsFile={keys / 'known_hosts'}",
            "--ssh-option",
            "StrictHostKeyChecking=yes",
        ],
    )
    (keys / "known_hosts").write_text("".join(f"{h} {host_key}\n" for h in cluster.hosts))
    daemons: list[subprocess.Popen[bytes]] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{cluster.launcher}/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        names = "".join(f"{a} host-{c}\n" for a, c in zip(cluster.hosts, "ab"))
        for letter, address in zip("ab", cluster.hosts):
            namespace = f"hora-{pid}-{number}{letter}"
            cluster.namespaces.append(namespace)
            # `ip netns exec` mounts these over /etc/hosts and /etc/resolv.conf in the
            # namespace: names resolve from the file, and no DNS query waits for a timeout.
            (NETNS_DIR / namespace).mkdir(parents=True, exist_ok=True)
            (NETNS_DIR / namespace / "hosts").write_text(
                f"127.0.0.1 localhost\n{cluster.launcher} launcher\n{names}"
            )
            (NETNS_DIR / namespace / "resolv.conf").write_text("")
            _ip("netns", "add", namespace)
            veth = f"hv{pid}{letter}{number}"
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            _ip("link", "set", veth, "master", bridge, "up")
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            config = keys / f"sshd_{letter}.conf"
            config.write_text(
                f"ListenAddress {address}\nPort 22\nHostKey {keys / 'host_key'}\n"
                f"AuthorizedKeysFile {keys / 'authorized_keys'}\n"
                "StrictModes no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                "PermitRootLogin prohibit-password\nUsePAM no\nUseDNS no\nPrintMotd no\n"
                "PidFile none\nMaxStartups 100\n"
            )
            daemons.append(
                subprocess.Popen(
                    [
                        "ip",
                        "netns",
                        "exec",
                        namespace,
                        "/usr/sbin/sshd",
                        "-D",
                        "-f",
                        str(config),
                        "-E",
                        str(keys / f"sshd_{letter}.log"),
                    ],
                )  # fmt: skip
            )
        for address in cluster.hosts:
            wait_for_port(address, 22, timeout_s=15)
        yield cluster
    finally:
        for daemon in daemons:
            daemon.terminate()
        for daemon in daemons:
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                daemon.kill()
        for namespace in cluster.namespaces:
            _delete_namespace(namespace)
        _ip("link", "del", bridge, check=False)
        try:
            NETNS_DIR.rmdir()  # only when no other namespace uses it
        except OSError:
            pass
