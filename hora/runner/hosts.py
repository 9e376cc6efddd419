"""Hosts and slots: parsing ``-H host:slots,...`` and hostfiles, and assigning ranks to slots.

This module knows host names and counts; it does not start processes.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from hora.common.vocabulary import settings_table as table

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
        values = (
            (table.RANK, self.rank),
            (table.SIZE, self.size),
            (table.LOCAL_RANK, self.local_rank),
            (table.LOCAL_SIZE, self.local_size),
            (table.CROSS_RANK, self.cross_rank),
            (table.CROSS_SIZE, self.cross_size),
            (table.HOSTNAME, self.hostname),
        )
        env: dict[str, str] = {}
        for variable, value in values:
            env.update(dict.fromkeys(variable.environ_names, str(value)))
        return env


def parse_hosts(text: str) -> list[Host]:
    """Parse ``"a:4,b:4"`` (a bare name means one slot; an IPv6 address goes in brackets,
    ``[::1]:2``).

    Raises:
        HostError: an entry is empty, its host is not a name or an address, its slot count is
            not a positive integer, or a host is listed twice.
    """
    hosts: list[Host] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            raise HostError(f"empty entry in host list {text!r}; use host:slots,host:slots.")
        try:
            name, count = split_entry(item)
        except ValueError as exc:
            raise HostError(f"host list: {exc}.") from None
        try:
            slots = 1 if count is None else slot_count(count)
        except ValueError as exc:
            raise HostError(f"host list entry {item!r}: {exc}.") from None
        first = _find(hosts, name)
        if first is not None:
            raise HostError(
                f"host {name!r} appears twice in host list {text!r}. List each host once, with "
                f"all its slots ({_entry(first.name, first.slots + slots)})."
            )
        hosts.append(Host(name, slots))
    return hosts


def _find(hosts: list[Host], name: str) -> Host | None:
    """The host of ``hosts`` named ``name`` (host names are not case-sensitive)."""
    return next((host for host in hosts if host.name.lower() == name.lower()), None)


def _entry(name: str, slots: int) -> str:
    """``name:slots`` as ``-H`` takes it (``[::1]:2`` for an IPv6 address)."""
    return f"[{name}]:{slots}" if ":" in name else f"{name}:{slots}"


def split_entry(text: str) -> tuple[str, str | None]:
    """``host:slots`` as ``(host, slots)``; ``host`` alone as ``(host, None)``; an IPv6 address
    in brackets, ``[::1]:2`` or ``[::1]``, as ``("::1", "2")`` or ``("::1", None)``.

    Raises:
        ValueError: the host is not a host name or an address; the message says why, for the
            user.
    """
    if text.startswith("["):
        address, closed, rest = text[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            raise ValueError(
                f"{text!r}: write an IPv6 address in brackets, then the slots: [::1]:2"
            )
        return ipv6_address(address), (rest[1:] if rest else None)
    if text.count(":") > 1:
        raise ValueError(
            f"{text!r}: an IPv6 address goes in brackets, as in [::1]:2 (without them, the "
            "address and the slot count cannot be told apart)"
        )
    name, sep, count = text.partition(":")
    if not name:
        raise ValueError(f"{text!r} has no host name")
    check_name(name)
    return name, (count if sep else None)


def ipv6_address(text: str) -> str:
    """The IPv6 address ``text`` in its short form (``::1``).

    Raises:
        ValueError: it is not one.
    """
    try:
        return str(ipaddress.IPv6Address(text))
    except ValueError:
        raise ValueError(f"{text!r} is not an IPv6 address") from None


def slot_count(text: str) -> int:
    """The ``slots`` of ``host:slots``.

    Raises:
        ValueError: it is not a positive integer; the message says which way, for the user.
    """
    try:
        slots = int(text)
    except ValueError:
        raise ValueError(
            f"slots must be an integer (host:slots), got {text!r}"
            if text
            else "no slot count after ':' (host:slots)"
        ) from None
    if slots < 1:
        raise ValueError(f"slots must be >= 1 (the number of workers on the host), got {slots}")
    return slots


_NAME = re.compile(r"^[\w.@-]+$")


def check_name(name: str) -> None:
    """Refuse what is not a host name or an IPv4 address (an ssh option, a shell word).

    Raises:
        ValueError: the message says why, for the user.
    """
    if name.startswith("-") or not _NAME.match(name):
        raise ValueError(
            f"{name!r} is not a host name or address (letters, digits, '.', '-', '_' and '@' "
            "only; an IPv6 address goes in brackets: [::1]:2)"
        )


def utf8_text(data: bytes, error: type[Exception], where: str, advice: str) -> str:
    """``data``, a list of hosts, as text.

    Raises:
        error: it is not UTF-8 text; the message is ``where``, the line and the byte, and
            ``advice``.
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise error(
            f"{where}line {line}: byte 0x{data[exc.start]:02x} is not UTF-8 text. {advice}"
        ) from None


def _hostfile_text(path: str) -> str:
    """A hostfile's text.

    Raises:
        HostError: it cannot be read, or it is not UTF-8 text (the message names the line).
    """
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise HostError(f"cannot read hostfile {path!r}: {exc.strerror}.") from None
    advice = "A hostfile lists host names, one per line (`node1 slots=4`); is this the right file?"
    return utf8_text(data, HostError, f"{path}, ", advice)


def parse_hostfile(path: str) -> list[Host]:
    """Read a hostfile: one host per line, as ``host slots=N`` (Horovod's and Open MPI's form)
    or ``host:N``; a bare host means one slot. ``#`` starts a comment; blank lines are skipped.
    An IPv6 address is written ``[::1]:2``, ``[::1] slots=2`` or ``::1 slots=2``.

    Raises:
        HostError: the file cannot be read, a line is malformed, or a host is listed twice (the
            message gives the line's number).
    """
    text = _hostfile_text(path)
    hosts: list[Host] = []
    lines: dict[str, int] = {}  # where each host was first listed
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host = _hostfile_line(path, number, line)
        first = _find(hosts, host.name)
        if first is not None:
            shown = f"[{first.name}]" if ":" in first.name else first.name
            raise HostError(
                f"{path}, line {number}: host {host.name!r} appears twice (first on line "
                f"{lines[first.name]}). List each host once, with all its slots "
                f"(`{shown} slots={first.slots + host.slots}`)."
            )
        lines[host.name] = number
        hosts.append(host)
    if not hosts:
        raise HostError(f"hostfile {path!r} lists no hosts.")
    return hosts


def _hostfile_line(path: str, number: int, line: str) -> Host:
    """The host on one line of a hostfile (comment already removed).

    Raises:
        HostError: the line is malformed; the message gives its number.
    """
    words = line.split()
    slots: str | None = None
    for word in words[1:]:
        key, sep, value = word.partition("=")
        if key == "slots" and sep:
            slots = value
        elif key != "max_slots" or not sep:
            raise HostError(
                f"{path}, line {number}: cannot read {line!r}; write `host slots=N` or `host:N`."
            )
    try:
        name, count = _hostfile_name(words[0], with_words=len(words) > 1)
    except ValueError as exc:
        raise HostError(f"{path}, line {number}: {exc}.") from None
    try:
        if count is not None and slots is not None:
            raise ValueError("it gives the slots twice; write `host slots=N` or `host:N`")
        return Host(name, slot_count(count or slots or "1"))
    except ValueError as exc:
        raise HostError(f"{path}, line {number}: {line!r}: {exc}.") from None


def _hostfile_name(word: str, with_words: bool) -> tuple[str, str | None]:
    """The host (and ``:slots``) of a hostfile line's first word. Followed by ``slots=N``, an
    IPv6 address needs no brackets: ``::1 slots=2`` cannot be misread."""
    if with_words and word.count(":") > 1 and not word.startswith("["):
        return ipv6_address(word), None
    return split_entry(word)


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
