"""An emulated CPU cluster on one Linux machine: N network namespaces ("hosts") on a bridge, each
host's link shaped with ``tc``, each host running ``sshd`` so that ``horarun -H`` (and ``mpirun``)
reach it as they would a real node.

Each host is a namespace ``hora-<pid>-c<n><letter>`` with one interface, ``eth0``, a veth pair
whose other end is on the bridge ``hbr<pid>-c<n>`` (this machine's address there is
``10.78.X.1``, the hosts' ``10.78.X.2`` onwards). A rate shapes both directions of every host's
link with a token bucket (``tbf``): ``eth0``'s egress is what the host sends, the bridge-side
end's egress what it receives, so each host has a full-duplex link of that rate to a switch that
does not block. Namespaces share this machine's file system, processes and ``/dev/shm``; hora
still treats them as separate hosts (its host identity includes the network namespace).

Teardown kills every process in the namespaces, deletes them (their interfaces and qdiscs go with
them), the bridge, and hora's shared-memory leftovers; leftovers of a run that was killed (names
carry the creating pid) are removed when the next cluster starts, or by
``python -m hora.tools.cluster clean``. Needs root, ``ip`` and ``tc`` (iproute2), ``sshd`` and
``ssh-keygen``. This module knows namespaces and links; it does not run jobs.

Example::

    with Cluster.start(hosts=2, rate="1gbit") as cluster:
        subprocess.run([*cluster.horarun("-np", "4", slots=2), "python", "train.py"])
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import psutil

from hora.common.job.shm_names import sweep

NETNS_DIR = "/etc/netns"
SSHD = "/usr/sbin/sshd"
NAMESPACE = re.compile(r"(hora-(\d+)-\w+)")
BRIDGE = re.compile(r": (hbr(\d+)(?:-\w+)?)[:@]")
MAX_HOSTS = 26
# tc rates as the study names them; None is an unshaped link.
RATES = {"1gbit": 1e9, "10gbit": 1e10, "unlimited": None}


class ClusterError(RuntimeError):
    """The emulated cluster cannot be made here; the message says why and what to do."""


def _run(command: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(command), capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise ClusterError(f"`{' '.join(command)}` failed: {done.stderr.strip()}")
    return done


def unavailable() -> str | None:
    """Why an emulated cluster cannot be made here, or ``None``."""
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces, tc)"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("ssh", "openssh-client")):
        if shutil.which(tool) is None:
            return f"the emulated cluster needs `{tool}` (apt-get install {package})"
    for path in (SSHD, "/usr/bin/ssh-keygen"):
        if not os.access(path, os.X_OK):
            return f"the emulated cluster needs {path} (apt-get install openssh-server)"
    return None


def tbf_arguments(rate_bits: float) -> list[str]:
    """``tc qdisc ... tbf`` arguments for ``rate_bits`` per second.

    The bucket holds 2 ms of traffic (at least 64 KiB, so that one TSO/GSO packet fits): a
    smaller one caps the rate below what is asked once timers are coarser than a packet's
    time on the wire; the queue holds 20 ms more, as a switch's buffer would.
    """
    burst = max(64 * 1024, int(rate_bits / 8 * 0.002))
    return ["tbf", "rate", f"{int(rate_bits)}bit", "burst", str(burst), "latency", "20ms"]


def _delete_namespace(name: str) -> None:
    for pid in _run(["ip", "netns", "pids", name], check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _run(["ip", "netns", "del", name], check=False)
    shutil.rmtree(Path(NETNS_DIR, name), ignore_errors=True)


def remove_stale() -> list[str]:
    """Remove the namespaces, bridges and SSH key folders of clusters whose creating process is
    gone, and hora's shared-memory segments whose creator is gone; returns what it removed."""
    removed = []
    for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines():
        match = NAMESPACE.match(line)
        if match and not psutil.pid_exists(int(match.group(2))):
            _delete_namespace(match.group(1))
            removed.append(match.group(1))
    bridges = _run(["ip", "-o", "link", "show", "type", "bridge"], check=False).stdout
    for line in bridges.splitlines():
        match = BRIDGE.search(line)
        if match and not psutil.pid_exists(int(match.group(2))):
            _run(["ip", "link", "del", match.group(1)], check=False)
            removed.append(match.group(1))
    for folder in Path(tempfile.gettempdir()).glob("hora-cluster-*-*"):
        match = re.fullmatch(r"hora-cluster-(\d+)-\w+", folder.name)
        if match and not psutil.pid_exists(int(match.group(1))):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(str(folder))
    return removed + sweep()


def free_subnet(first_two: str = "10.78") -> str:
    """A ``first_two.X`` /24 prefix that no interface of this machine (or of a network
    namespace that shares its view) has an address in, e.g. ``"10.78.17"``; tried from a point
    that depends on this process, so that two runs at once start apart.

    Raises:
        ClusterError: every such subnet is taken.
    """
    used = {line.split()[3] for line in _run(["ip", "-o", "-4", "addr"]).stdout.splitlines()}
    for offset in range(250):
        third = (os.getpid() + offset) % 250 + 1
        if not any(address.startswith(f"{first_two}.{third}.") for address in used):
            return f"{first_two}.{third}"
    raise ClusterError(f"no free {first_two}.X.0/24 subnet for the emulated hosts")


def wait_for_port(address: str, port: int, timeout_s: float) -> None:
    """Return once ``address:port`` accepts a TCP connection (an sshd that started).

    Raises:
        ClusterError: it did not within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((address, port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"nothing listens on {address}:{port} after {timeout_s:g} s"
                ) from None
            time.sleep(0.02)


@dataclass
class Cluster:
    """A running emulated cluster; :meth:`start` makes one, :meth:`close` removes it.

    Attributes:
        rate: the tc rate of every host's link (``None``: unshaped), e.g. ``"1gbit"``.
        bridge: this machine's interface on the hosts' network.
        launcher: this machine's address there.
        addresses: the hosts' addresses, one per host.
        namespaces: the hosts' network namespaces, one per host.
        keys: the folder of the throwaway SSH keys and sshd logs.
    """

    rate: str | None
    bridge: str
    launcher: str
    addresses: list[str] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)
    keys: Path = Path()
    daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _owned_keys: bool = False

    @classmethod
    def start(cls, hosts: int, rate: str | None = None, keys: Path | None = None) -> Cluster:
        """Make ``hosts`` hosts on a bridge, every link shaped to ``rate`` (a tc rate such as
        ``"1gbit"``; ``None``: unshaped), each running sshd.

        Raises:
            ClusterError: not root, a tool is missing, or the kernel refuses.
        """
        reason = unavailable()
        if reason:
            raise ClusterError(reason)
        if not 1 <= hosts <= MAX_HOSTS:
            raise ClusterError(f"hosts must be 1 to {MAX_HOSTS}, not {hosts}")
        remove_stale()
        number = _next_number()
        pid = os.getpid()
        owned = keys is None
        cluster = cls(
            rate=rate,
            bridge=f"hbr{pid}-c{number}",
            launcher="",
            keys=Path(tempfile.mkdtemp(prefix=f"hora-cluster-{pid}-")) if keys is None else keys,
            _owned_keys=owned,
        )
        try:
            cluster._build(hosts, number)
        except BaseException:
            cluster.close()
            raise
        return cluster

    def _build(self, hosts: int, number: int) -> None:
        prefix = free_subnet()
        self.launcher = f"{prefix}.1"
        self.addresses = [f"{prefix}.{2 + i}" for i in range(hosts)]
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.launcher}/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        self._make_keys()
        for index, address in enumerate(self.addresses):
            self._add_host(index, address, number)
        for address in self.addresses:
            wait_for_port(address, 22, timeout_s=10)

    def _make_keys(self) -> None:
        self.keys.mkdir(parents=True, exist_ok=True)
        for name in ("host_key", "client_key"):
            if not (self.keys / name).exists():
                _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.keys / name)])
        (self.keys / "authorized_keys").write_text((self.keys / "client_key.pub").read_text())
        host_key = " ".join((self.keys / "host_key.pub").read_text().split()[:2])
        (self.keys / "known_hosts").write_text("".join(f"{a} {host_key}\n" for a in self.addresses))
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory

    def _add_host(self, index: int, address: str, number: int) -> None:
        letter = chr(ord("a") + index)
        namespace = f"hora-{os.getpid()}-c{number}{letter}"
        self.namespaces.append(namespace)
        # `ip netns exec` mounts these over /etc/hosts and /etc/resolv.conf: names resolve
        # from the file, and no DNS query waits for a timeout.
        folder = Path(NETNS_DIR, namespace)
        folder.mkdir(parents=True, exist_ok=True)
        names = "".join(f"{a} host-{chr(ord('a') + i)}\n" for i, a in enumerate(self.addresses))
        (folder / "hosts").write_text(f"127.0.0.1 localhost\n{self.launcher} launcher\n{names}")
        (folder / "resolv.conf").write_text("")
        _run(["ip", "netns", "add", namespace])
        veth = f"hv{os.getpid()}{letter}{number}"
        _run(
            ["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", namespace]
        )
        _run(["ip", "link", "set", veth, "master", self.bridge, "up"])
        _run(["ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0"])
        _run(["ip", "-n", namespace, "link", "set", "eth0", "up"])
        _run(["ip", "-n", namespace, "link", "set", "lo", "up"])
        if self.rate is not None:
            shaping = tbf_arguments(_rate_bits(self.rate))
            _run(["tc", "qdisc", "replace", "dev", veth, "root", *shaping])
            _run(["tc", "-n", namespace, "qdisc", "replace", "dev", "eth0", "root", *shaping])
        self.daemons.append(self._sshd(letter, namespace, address))

    def _sshd(self, letter: str, namespace: str, address: str) -> subprocess.Popen[bytes]:
        config = self.keys / f"sshd_{letter}.conf"
        config.write_text(
            f"ListenAddress {address}\nPort 22\nHostKey {self.keys / 'host_key'}\n"
            f"AuthorizedKeysFile {self.keys / 'authorized_keys'}\n"
            "StrictModes no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "PermitRootLogin prohibit-password\nUsePAM no\nUseDNS no\nPrintMotd no\n"
            "PidFile none\nMaxStartups 100\nAcceptEnv *\n"
        )
        log = self.keys / f"sshd_{letter}.log"
        # sshd, and so every process started over SSH, runs in a UTS namespace of its own named
        # host-<letter>: each host has its own name, which resolves to its address everywhere
        # (a worker that hands out socket.getfqdn() as its address is reached there).
        sshd = f"hostname host-{letter} && exec {SSHD} -D -f {config} -E {log}"
        command = ["ip", "netns", "exec", namespace, "unshare", "--uts", "sh", "-c", sshd]
        return subprocess.Popen(command)

    @property
    def ssh_flags(self) -> list[str]:
        """The ``horarun`` flags that log in to the hosts."""
        return [
            *("--ssh-identity-file", str(self.keys / "client_key")),
            *("--ssh-option", f"UserKnownHostsFile={self.keys / 'known_hosts'}"),
            *("--ssh-option", "StrictHostKeyChecking=yes"),
        ]

    @property
    def ssh_command(self) -> str:
        """An ``ssh`` command line that logs in to the hosts (for ``mpirun``'s agent)."""
        return (
            f"ssh -i {self.keys / 'client_key'} -o UserKnownHostsFile={self.keys / 'known_hosts'}"
            " -o StrictHostKeyChecking=yes -o BatchMode=yes"
        )

    def host_list(self, slots: int, hosts: int | None = None) -> str:
        """``horarun -H``'s value: the first ``hosts`` hosts (all by default), ``slots`` each."""
        chosen = self.addresses[: hosts or len(self.addresses)]
        return ",".join(f"{address}:{slots}" for address in chosen)

    def horarun(self, slots: int, hosts: int | None = None) -> list[str]:
        """``horarun`` (under this Python) on the first ``hosts`` hosts with ``slots`` ranks
        each; append the worker's command."""
        count = (hosts or len(self.addresses)) * slots
        return [
            *(sys.executable, "-m", "hora.runner.launch", "-np", str(count)),
            *("-H", self.host_list(slots, hosts), *self.ssh_flags),
        ]

    def exec(self, host: int, command: Sequence[str]) -> list[str]:
        """``command`` run in host ``host``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[host], *command]

    def qdiscs(self) -> list[str]:
        """The qdisc lines of every host's ``eth0`` (``tc qdisc show``)."""
        lines = []
        for namespace in self.namespaces:
            shown = _run(["tc", "-n", namespace, "qdisc", "show", "dev", "eth0"], check=False)
            lines += shown.stdout.splitlines()
        return lines

    def close(self) -> None:
        """Stop sshd and everything else in the hosts, delete them and the bridge, and sweep
        hora's shared-memory leftovers. Safe to call twice."""
        for daemon in self.daemons:
            daemon.terminate()
        for daemon in self.daemons:
            try:
                daemon.wait(timeout=5)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        self.daemons.clear()
        for namespace in self.namespaces:
            _delete_namespace(namespace)
        if self.bridge:
            _run(["ip", "link", "del", self.bridge], check=False)
        try:
            os.rmdir(NETNS_DIR)  # only when no other namespace uses it
        except OSError:
            pass
        if self._owned_keys:
            shutil.rmtree(self.keys, ignore_errors=True)
        sweep()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _rate_bits(rate: str) -> float:
    """``"1gbit"`` -> ``1e9``: a tc rate in bits per second (k, m, g: powers of 1000)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if match is None:
        raise ClusterError(f"{rate!r} is not a rate such as 1gbit, 10gbit or 500mbit")
    scale = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]
    return float(match.group(1)) * scale


def _next_number() -> int:
    """A number for this process's next cluster, unused by its earlier ones: the kernel removes
    a deleted namespace's interfaces in the background, so a new cluster must not reuse the
    names of one whose interfaces are still there."""
    taken = _run(["ip", "netns", "list"], check=False).stdout + _run(["ip", "-o", "link"]).stdout
    pid = os.getpid()
    for number in range(1000):
        names = (f"hora-{pid}-c{number}", f"hbr{pid}-c{number}:", f"hv{pid}a{number}@")
        if not any(name in taken for name in names):
            return number
    raise ClusterError("this process has made 1000 clusters whose names are still in use")


# ---------------------------------------------------------------- measuring a link

_SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
print("ready", flush=True)
c, _ = s.accept(); total = 0; start = None
while True:
    data = c.recv(1 << 20)
    if not data:
        break
    if start is None:
        start = time.perf_counter()
    total += len(data)
print(total / (time.perf_counter() - start), flush=True)
"""


def measure_rate(cluster: Cluster, sender: int, receiver: int, seconds: float = 2.0) -> float:
    """TCP goodput in bytes per second from host ``sender`` to host ``receiver`` (one stream,
    ``seconds`` long), as the receiver counts it."""
    address, port = cluster.addresses[receiver], 5201
    sink = subprocess.Popen(
        cluster.exec(receiver, [sys.executable, "-c", _SINK, address, str(port)]),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        if sink.stdout is None or sink.stdout.readline().strip() != "ready":
            raise ClusterError("the measuring sink did not start")
        source = (
            "import socket, sys, time\n"
            "s = socket.create_connection((sys.argv[1], int(sys.argv[2])))\n"
            "block = bytes(1 << 20); end = time.perf_counter() + float(sys.argv[3])\n"
            "while time.perf_counter() < end:\n    s.sendall(block)\ns.close()\n"
        )
        command = [sys.executable, "-c", source, address, str(port), str(seconds)]
        subprocess.run(cluster.exec(sender, command), check=True, timeout=seconds + 30)
        out, _ = sink.communicate(timeout=30)
        return float(out.strip())
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait()


# ---------------------------------------------------------------- command line


@contextmanager
def _signals_end() -> Iterator[threading.Event]:
    ended = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: ended.set())
    try:
        yield ended
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hora.tools.cluster up|measure|clean``."""
    parser = argparse.ArgumentParser(prog="python -m hora.tools.cluster", description=__doc__)
    parser.add_argument("action", choices=("up", "measure", "clean"))
    parser.add_argument("--hosts", type=int, default=2, help="hosts to make (default 2)")
    parser.add_argument("--rate", default="1gbit", help="tc rate, or 'unlimited' (default 1gbit)")
    args = parser.parse_args(argv)
    if args.action == "clean":
        for name in remove_stale():
            print(f"removed {name}")
        return 0
    rate = None if args.rate == "unlimited" else args.rate
    try:
        cluster = Cluster.start(max(args.hosts, 2 if args.action == "measure" else 1), rate)
    except ClusterError as exc:
        print(f"hora.tools.cluster: {exc}", file=sys.stderr)
        return 2
    with cluster, _signals_end() as ended:
        if args.action == "measure":
            goodput = measure_rate(cluster, 0, 1)
            print(f"{args.rate}: {goodput * 8 / 1e9:.3f} Gbit/s of TCP payload host a -> b")
            return 0
        print(f"hosts {cluster.addresses} on {cluster.bridge}, links {args.rate}")
        print(" ".join(cluster.horarun(slots=1)) + " COMMAND  (Ctrl-C ends the cluster)")
        try:
            ended.wait()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
