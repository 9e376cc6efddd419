"""Where an elastic job's hosts come from: ``-H``/``--hostfile``, or a discovery script run every
second by a thread.

A discovery script prints one ``host`` or ``host:slots`` per line (:func:`parse_discovery_output`);
a host with ``n`` slots gives the worker ids ``host:0 .. host:(n-1)``. The :class:`HostWatcher`
keeps the last good answer: a failed run after the first is reported and otherwise ignored.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from collections.abc import Sequence
from typing import Protocol

from hora.common.vocabulary.settings_table import HOST_DISCOVERY_TIMEOUT
from hora.runner.hosts import Host, slot_count, split_entry, utf8_text

# How often the discovery script runs, and how long one run may take by default.
DISCOVERY_INTERVAL_S = 1.0
DISCOVERY_TIMEOUT_S = HOST_DISCOVERY_TIMEOUT.default

logger = logging.getLogger("hora.runner")


class DiscoveryError(RuntimeError):
    """The host discovery script failed, or printed a line that is not ``host[:slots]``."""


def parse_discovery_output(text: str, default_slots: int = 1) -> list[Host]:
    """The hosts a discovery script printed: one ``host`` or ``host:slots`` per line (an IPv6
    address in brackets: ``[::1]:2``).

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
        try:
            name, count = split_entry(line)
        except ValueError as exc:
            raise DiscoveryError(
                f"line {number}: {exc}; each line must be `host` or `host:slots`."
            ) from None
        slots = default_slots
        if count is not None:
            try:
                slots = slot_count(count)
            except ValueError as exc:
                raise DiscoveryError(f"line {number}: {raw.strip()!r}: {exc}.") from None
        if name.lower() in (known.lower() for known in hosts):
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

    Each run is its own session: a run that takes longer than ``timeout_s``, or is still going
    when the job ends (:meth:`cancel`), is killed with everything it started.

    Args:
        path: the executable.
        default_slots: slots of a host printed without ``:slots`` (``--slots-per-host``).
        timeout_s: how long one run may take (``HORA_HOST_DISCOVERY_TIMEOUT``).
    """

    def __init__(
        self, path: str, default_slots: int = 1, timeout_s: float = DISCOVERY_TIMEOUT_S
    ) -> None:
        self.path = os.path.abspath(path)
        self.shown = path
        self.default_slots = default_slots
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._running: subprocess.Popen[bytes] | None = None
        self._cancelled = False

    def find(self) -> list[Host]:
        stdout, stderr, status = self._run()
        if status != 0:
            how = (
                f"was killed by signal {-status}"
                if status < 0
                else f"failed with exit status {status}"
            )
            detail = f": {stderr}" if stderr else " (it wrote nothing to stderr)"
            raise DiscoveryError(f"the host discovery script {self.shown} {how}{detail}")
        try:
            return parse_discovery_output(_text(stdout), self.default_slots)
        except DiscoveryError as exc:
            raise DiscoveryError(
                f"the host discovery script {self.shown} printed something unreadable, {exc}"
            ) from None

    def _run(self) -> tuple[bytes, str, int]:
        """One run: its standard output, the end of its standard error, and its exit status.

        Raises:
            DiscoveryError: it cannot be started, or it did not finish in time.
        """
        try:
            process = subprocess.Popen(
                [self.path],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            raise DiscoveryError(
                f"cannot run the host discovery script {self.shown}: {exc.strerror}"
            ) from None
        with self._lock:
            self._running = process
            if self._cancelled:
                _kill_session(process)
        try:
            stdout, stderr = process.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            stderr = _stop(process)
            said = _tail(stderr)
            raise DiscoveryError(
                f"the host discovery script {self.shown} did not finish within "
                f"{self.timeout_s:g} s (HORA_HOST_DISCOVERY_TIMEOUT, at most --elastic-timeout) "
                "and was stopped" + (f"; its stderr: {said}" if said else "")
            ) from None
        finally:
            with self._lock:
                self._running = None
        _kill_session(process)  # helpers it left running in the background
        return stdout, _tail(stderr), process.returncode

    def cancel(self) -> None:
        """Kill the run in progress, if any, and any later one (the job is ending)."""
        with self._lock:
            self._cancelled = True
            if self._running is not None:
                _kill_session(self._running)


# After a run is stopped, how long its last output may take to arrive. A helper it started in a
# session of its own may keep the pipes open; hora does not wait for that one.
DRAIN_S = 1.0


def _stop(process: subprocess.Popen[bytes]) -> bytes:
    """Kill a run that took too long, and what it wrote to stderr, without waiting on helpers
    that left its session but hold its pipes."""
    _kill_session(process)
    try:
        _, stderr = process.communicate(timeout=DRAIN_S)
        return stderr
    except subprocess.TimeoutExpired:
        for pipe in (process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()
        process.wait()
        return b""


def _kill_session(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL every process of ``process``'s session (it leads its own process group)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# How much of a failed run's standard error is shown.
STDERR_TAIL_LINES = 10


def _tail(stderr: bytes) -> str:
    lines = stderr.decode(errors="replace").strip().splitlines()
    return "\n".join(lines[-STDERR_TAIL_LINES:])


def _text(stdout: bytes) -> str:
    """A run's standard output as text.

    Raises:
        DiscoveryError: it is not UTF-8 (the message names the line and the byte).
    """
    advice = (
        "A host discovery script prints host names, one `host` or `host:slots` a line: check "
        "that it prints nothing else (a banner, a progress bar, binary data)."
    )
    return utf8_text(stdout, DiscoveryError, "", advice)


class HostWatcher:
    """Asks a :class:`Discovery` for the hosts every ``interval_s`` in a thread, and keeps the
    last good answer.

    A failed run is logged as a warning: the first one always, the later ones too when the
    ``hora.runner`` logger shows debug lines (``--verbose``).

    Args:
        discovery: where hosts come from.
        interval_s: time between two runs.
    """

    def __init__(self, discovery: Discovery, interval_s: float = DISCOVERY_INTERVAL_S) -> None:
        self.discovery = discovery
        self.interval_s = interval_s
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
            if self._stop.is_set():
                return  # the job is ending; the run was cancelled
            self.failures += 1
            if logger.isEnabledFor(logging.DEBUG):
                logger.warning("%s; keeping the hosts it found last.", exc)
            elif self.failures == 1:
                logger.warning(
                    "%s; keeping the hosts it found last (further failures are shown with "
                    "--verbose).",
                    exc,
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
        """Stop asking, and kill a discovery run still in progress (nothing outlives the job)."""
        self._stop.set()
        cancel = getattr(self.discovery, "cancel", None)
        if cancel is not None:
            cancel()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
