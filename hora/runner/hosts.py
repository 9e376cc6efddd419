"""Hosts and slots: parsing ``-H host:slots,...`` and hostfiles, and assigning ranks to slots.

This module knows host names and counts; it does not start processes.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from pathlib import Path

LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


class HostError(ValueError):
    """A host list or hostfile that hora cannot use."""


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


@dataclass(frozen=True)
class Slot:
    """Where one rank runs and its place in the topology."""

    hostname: str
    rank: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    size: int

    def env(self) -> dict[str, str]:
        """The topology variables a worker reads, under hora's and Horovod's names."""
        values = {
            "RANK": self.rank,
            "SIZE": self.size,
            "LOCAL_RANK": self.local_rank,
            "LOCAL_SIZE": self.local_size,
            "CROSS_RANK": self.cross_rank,
            "CROSS_SIZE": self.cross_size,
            "HOSTNAME": self.hostname,
        }
        env: dict[str, str] = {}
        for key, value in values.items():
            env[f"HORA_{key}"] = str(value)
            env[f"HOROVOD_{key}"] = str(value)
        return env


def parse_hosts(text: str) -> list[Host]:
    """Parse ``"a:4,b:4"`` (a bare name means one slot).

    Raises:
        HostError: an entry is empty or its slot count is not a positive integer.
    """
    hosts: list[Host] = []
    seen: set[str] = set()
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            raise HostError(f"empty entry in host list {text!r}; use host:slots,host:slots.")
        name, count = split_entry(item)
        if count is None:
            count = "1"
        if not name:
            raise HostError(f"host list entry {item!r} has no host name.")
        _check_name(name, item)
        try:
            slots = slot_count(count)
        except ValueError as exc:
            raise HostError(f"host list entry {item!r}: {exc}.") from None
        if name in seen:
            raise HostError(f"host {name!r} appears twice in {text!r}.")
        seen.add(name)
        hosts.append(Host(name, slots))
    return hosts


def split_entry(text: str) -> tuple[str, str | None]:
    """``host:slots`` as ``(host, slots)``; ``host`` alone as ``(host, None)``."""
    name, sep, count = text.rpartition(":")
    return (name, count) if sep else (text, None)


def slot_count(text: str) -> int:
    """The ``slots`` of ``host:slots``.

    Raises:
        ValueError: it is not a positive integer; the message says which way, for the user.
    """
    try:
        slots = int(text)
    except ValueError:
        raise ValueError("slots must be an integer (host:slots)") from None
    if slots < 1:
        raise ValueError("slots must be >= 1")
    return slots


_NAME = re.compile(r"^[\w.@-]+$")


def _check_name(name: str, item: str) -> None:
    if name.startswith("-") or not _NAME.match(name):
        raise HostError(
            f"host entry {item!r}: {name!r} is not a host name or address "
            "(letters, digits, '.', '-', '_' and '@' only)."
        )


def _hostfile_text(path: str) -> str:
    """A hostfile's text.

    Raises:
        HostError: it cannot be read, or it is not UTF-8 text (the message names the line).
    """
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise HostError(f"cannot read hostfile {path!r}: {exc.strerror}.") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise HostError(
            f"{path}, line {line}: byte 0x{data[exc.start]:02x} is not UTF-8 text. A hostfile "
            "lists host names, one per line (`node1 slots=4`); is this the right file?"
        ) from None


def parse_hostfile(path: str) -> list[Host]:
    """Read a hostfile: one host per line, as ``host slots=N`` (Horovod's and Open MPI's form)
    or ``host:N``; a bare host means one slot. ``#`` starts a comment; blank lines are skipped.

    Raises:
        HostError: the file cannot be read, or a line is malformed (the message gives its number).
    """
    text = _hostfile_text(path)
    entries: list[str] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        name, slots = words[0], "1"
        if len(words) == 1 and ":" in name:
            name, _, slots = name.rpartition(":")
        for word in words[1:]:
            key, sep, value = word.partition("=")
            if key == "slots" and sep:
                slots = value
            elif key != "max_slots" or not sep:
                raise HostError(
                    f"{path}, line {number}: cannot read {raw.strip()!r}; write `host slots=N` "
                    "or `host:N`."
                )
        entries.append(f"{name}:{slots}")
    if not entries:
        raise HostError(f"hostfile {path!r} lists no hosts.")
    try:
        return parse_hosts(",".join(entries))
    except HostError as exc:
        raise HostError(f"{path}: {exc}") from None


def assign_slots(hosts: list[Host], np: int) -> list[Slot]:
    """Fill hosts in order, as Horovod does: ranks 0.. go to the first host's slots first.

    Raises:
        HostError: the hosts have fewer slots than ``np``.
    """
    total = sum(h.slots for h in hosts)
    if np < 1:
        raise HostError(f"-np must be >= 1, got {np}.")
    if np > total:
        listing = ", ".join(f"{h.name}:{h.slots}" for h in hosts)
        raise HostError(
            f"-np {np} needs {np} slots but the hosts provide {total} ({listing}). "
            "Lower -np or add slots with -H host:slots."
        )
    placed: list[tuple[str, int]] = []  # (hostname, local_rank) per rank
    per_host: dict[str, int] = {}
    for host in hosts:
        for local in range(host.slots):
            if len(placed) == np:
                break
            placed.append((host.name, local))
            per_host[host.name] = local + 1
    slots: list[Slot] = []
    for rank, (name, local) in enumerate(placed):
        peers = [h for h, lr in placed if lr == local]
        hosts_with_local = list(dict.fromkeys(peers))
        slots.append(
            Slot(
                hostname=name,
                rank=rank,
                local_rank=local,
                local_size=per_host[name],
                cross_rank=hosts_with_local.index(name),
                cross_size=len(hosts_with_local),
                size=np,
            )
        )
    return slots


def local_addresses() -> set[str]:
    """Every IP address held by an interface of this machine."""
    import psutil

    return {
        entry.address.split("%", 1)[0]
        for entries in psutil.net_if_addrs().values()
        for entry in entries
        if entry.family in (socket.AF_INET, socket.AF_INET6)
    }


def is_local(name: str) -> bool:
    """Whether ``name`` is this machine: a loopback name, its host name, or one of its addresses.

    Workers on this machine are started directly; every other host is reached over SSH.
    """
    if name in LOCAL_NAMES or name == socket.gethostname():
        return True
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(name, None)}
    except (OSError, UnicodeError):
        return False
    mine = local_addresses()
    return any(str(a).startswith("127.") or a in mine for a in resolved)
