"""Where an elastic job's hosts come from: ``-H``/``--hostfile``, or a discovery script run every
second by a thread.

A discovery script prints one ``host`` or ``host:slots`` per line (:func:`parse_discovery_output`);
a host with ``n`` slots gives the worker ids ``host:0 .. host:(n-1)``. The :class:`HostWatcher`
keeps the last good answer: a failed run after the first is reported and otherwise ignored.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from hora.runner.hosts import Host, slot_count, split_entry

# How often the discovery script runs, and how long one run may take.
DISCOVERY_INTERVAL_S = 1.0
DISCOVERY_TIMEOUT_S = 60.0

_HOST_NAME = re.compile(r"^[\w.@-]+$")


class DiscoveryError(RuntimeError):
    """The host discovery script failed, or printed a line that is not ``host[:slots]``."""


def parse_discovery_output(text: str, default_slots: int = 1) -> list[Host]:
    """The hosts a discovery script printed: one ``host`` or ``host:slots`` per line.

    Blank lines and ``#`` comments are skipped; no line at all means no host is available.

    Raises:
        DiscoveryError: a line is not ``host[:slots]``, its slots are not a positive integer, or
            a host is listed twice.
    """
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, count = split_entry(line)
        if not name or name.startswith("-") or not _HOST_NAME.match(name):
            raise DiscoveryError(
                f"line {number}: {raw.strip()!r} is not `host` or `host:slots` (host names hold "
                "letters, digits, '.', '-', '_' and '@')."
            )
        slots = default_slots
        if count:
            try:
                slots = slot_count(count)
            except ValueError as exc:
                raise DiscoveryError(f"line {number}: {raw.strip()!r}: {exc}.") from None
        if name in hosts:
            raise DiscoveryError(f"line {number}: host {name!r} is listed twice.")
        hosts[name] = slots
    return [Host(name, slots) for name, slots in hosts.items()]


class Discovery(Protocol):
    def find(self) -> list[Host]:
        """The hosts available now.

        Raises:
            DiscoveryError: they cannot be found this time.
        """
        ...


class StaticDiscovery:
    """The hosts of ``-H``/``--hostfile``: always the same."""

    def __init__(self, hosts: Sequence[Host]) -> None:
        self._hosts = list(hosts)

    def find(self) -> list[Host]:
        return list(self._hosts)


class ScriptDiscovery:
    """Runs ``--host-discovery-script`` and reads its standard output.

    Args:
        path: the executable.
        default_slots: slots of a host printed without ``:slots`` (``--slots-per-host``).
        timeout_s: how long one run may take.
    """

    def __init__(
        self, path: str, default_slots: int = 1, timeout_s: float = DISCOVERY_TIMEOUT_S
    ) -> None:
        self.path = os.path.abspath(path)
        self.shown = path
        self.default_slots = default_slots
        self.timeout_s = timeout_s

    def find(self) -> list[Host]:
        try:
            result = subprocess.run(
                [self.path],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=self.timeout_s,
            )
        except subprocess.TimeoutExpired:
            raise DiscoveryError(
                f"the host discovery script {self.shown} did not finish within {self.timeout_s:g} s"
            ) from None
        except OSError as exc:
            raise DiscoveryError(
                f"cannot run the host discovery script {self.shown}: {exc.strerror}"
            ) from None
        stdout = result.stdout.decode(errors="replace")
        stderr = result.stderr.decode(errors="replace").strip()
        if result.returncode != 0:
            how = (
                f"was killed by signal {-result.returncode}"
                if result.returncode < 0
                else f"failed with exit status {result.returncode}"
            )
            detail = f": {stderr}" if stderr else " (it wrote nothing to stderr)"
            raise DiscoveryError(f"the host discovery script {self.shown} {how}{detail}")
        try:
            return parse_discovery_output(stdout, self.default_slots)
        except DiscoveryError as exc:
            raise DiscoveryError(
                f"the host discovery script {self.shown} printed something unreadable, {exc}"
            ) from None


class HostWatcher:
    """Asks a :class:`Discovery` for the hosts every ``interval_s`` in a thread, and keeps the
    last good answer.

    Args:
        discovery: where hosts come from.
        interval_s: time between two runs.
        report: prints a line for the user.
        verbose: report every failed run; otherwise only the first.
    """

    def __init__(
        self,
        discovery: Discovery,
        interval_s: float = DISCOVERY_INTERVAL_S,
        report: Callable[[str], None] | None = None,
        verbose: bool = False,
    ) -> None:
        self.discovery = discovery
        self.interval_s = interval_s
        self.report = report or (lambda message: None)
        self.verbose = verbose
        self.failures = 0
        self._hosts: list[Host] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def first(self) -> list[Host]:
        """Run discovery once, now.

        Raises:
            DiscoveryError: it failed; the job cannot start.
        """
        hosts = self.discovery.find()
        with self._lock:
            self._hosts = hosts
        return hosts

    def poll(self) -> None:
        """Run discovery once more; on failure, report it and keep the last good answer."""
        try:
            hosts = self.discovery.find()
        except DiscoveryError as exc:
            self.failures += 1
            if self.verbose:
                self.report(f"{exc}; keeping the hosts it found last.")
            elif self.failures == 1:
                self.report(
                    f"{exc}; keeping the hosts it found last (further failures are shown with "
                    "--verbose)."
                )
            return
        with self._lock:
            self._hosts = hosts

    def hosts(self) -> list[Host]:
        with self._lock:
            return list(self._hosts)

    def start(self) -> None:
        if isinstance(self.discovery, StaticDiscovery):
            return  # nothing will change
        self._thread = threading.Thread(target=self._run, name="hora-discovery", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
