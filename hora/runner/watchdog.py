"""The watchdog that runs each worker, on this machine or on a remote host over SSH.

The launcher starts ``python3 -c LOADER`` here, or ``ssh HOST python3 -c LOADER`` (see
:mod:`hora.runner.remote`). The short loader on the command line reads this module's source from
standard input and runs it; this module then reads the job (command, environment, working
directory) as length-prefixed JSON from the same stream. So the job's secret never appears on a
command line, where ``ps`` would show it; over SSH it travels inside the encrypted channel.

Then it starts the worker and watches it:

* the worker runs in its own session, with standard input from ``/dev/null`` and its output going
  straight to the launcher (through SSH for a remote host);
* when standard input reaches end-of-file (the launcher closed it to stop the worker, or the
  launcher or its SSH connection died, even by ``SIGKILL``), or this process gets ``SIGTERM``,
  ``SIGHUP`` or ``SIGINT``, it stops the worker and everything the worker started: ``SIGTERM``
  (with ``SIGCONT``, so that a stopped worker acts on it), then ``SIGKILL`` after a grace period;
* the launcher writes a newline to standard input every second (:class:`LauncherLink`); when
  nothing comes for the job's ``launcher_timeout_s`` (the launcher is stopped, hung, or cut off
  without the connection closing), it stops the worker the same way and says why on standard
  error;
* it is a child subreaper, so processes the worker started stay its descendants even when their
  parent exits (a shell wrapper, a daemonised helper) and none of them outlive the job; when the
  worker exits, what it left behind is stopped too;
* if this process itself is killed, the kernel kills the worker (``PR_SET_PDEATHSIG``).

It reports on the worker's standard output with control lines the launcher removes from the
output: :data:`CONTROL` + ``pid N`` (written by the worker process itself before it runs the
command, so it comes before any output), :data:`CONTROL` + ``stopped 1`` (the worker was found
stopped, by ``SIGSTOP``, Ctrl-Z or a debugger, when it was to be stopped) and :data:`CONTROL` +
``exit N`` (``subprocess``'s status: negative for a signal). Its own exit status is the
worker's, or 128 + N when the worker was killed by signal N.

This module uses the standard library only (psutil when it is there), because on a remote host it
may run under an interpreter that does not have hora installed. It knows nothing of hora's engine
or launcher.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import IO, Any

# Marks the watchdog's control lines on the worker's standard output.
CONTROL = "\0hora-watchdog "

# The largest request a watchdog sends a fork server (hora.runner.fork_server): the job as JSON.
FORK_REQUEST_BYTES = 1 << 20

# Variables that already choose Gloo's network interface; the watchdog then chooses none.

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_SIOCGIFADDR = 0x8915


def _prctl(option: int, value: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the stdin watch still stops the worker
        pass


def become_subreaper() -> None:
    """Linux: orphaned descendants of this process are reparented to it, not to init."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent() -> None:  # pragma: no cover - runs in a child before exec
    """Linux: have the kernel SIGKILL this process when its parent dies."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _prepare_worker() -> None:  # pragma: no cover - runs in the child before exec
    die_with_parent()
    os.write(1, f"{CONTROL}pid {os.getpid()}\n".encode())


def parse_control(line: str) -> tuple[str, int] | None:
    """``("pid", N)`` or ``("exit", N)`` for a control line, else ``None``."""
    if not line.startswith(CONTROL):
        return None
    word, _, value = line[len(CONTROL) :].partition(" ")
    try:
        return word, int(value)
    except ValueError:
        return None


def read_job(stream: IO[bytes]) -> dict[str, Any]:
    """The job the launcher sent: a line with the JSON's length in bytes, then the JSON."""
    header = stream.readline()
    size = int(header.strip())
    job: dict[str, Any] = json.loads(stream.read(size).decode())
    return job


def encode_job(job: dict[str, Any]) -> bytes:
    """The bytes :func:`read_job` reads back."""
    body = json.dumps(job).encode()
    return b"%d\n" % len(body) + body


def source_address_towards(address: str) -> str:
    """The local address this host would use to reach ``address`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))
        return str(probe.getsockname()[0])


def interface_with_address(address: str) -> str | None:
    """The name of the network interface that holds the IPv4 ``address``."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        for name, entries in psutil.net_if_addrs().items():
            if any(e.family == socket.AF_INET and e.address == address for e in entries):
                return str(name)
        return None
    import fcntl  # Linux without psutil: ask the kernel for each interface's primary address

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def interface_towards(address: str) -> str | None:
    """The interface this host reaches ``address`` through, or ``None`` (loopback, unknown)."""
    try:
        source = source_address_towards(address)
    except OSError:
        return None
    if source.startswith("127."):
        return None
    return interface_with_address(source)


def _descendants(root: int) -> list[int]:
    """Live (not zombie) descendants of ``root``, read from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        # The command name (in parentheses) may hold spaces; the fields after it do not.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if fields[0] != b"Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found: list[int] = []
    todo = [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            found.append(pid)
            todo.append(pid)
    return found


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _reap_orphans() -> None:
    """Collect reparented orphans that have exited (this process is their subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def suspended(pid: int) -> bool:
    """Whether process ``pid`` is stopped (``SIGSTOP``, Ctrl-Z, or a debugger), from ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return False
    fields = stat[stat.rfind(b")") + 2 :].split()
    return bool(fields) and fields[0] in (b"T", b"t")


class ForkedWorker:
    """A worker that a fork server forked (:mod:`hora.runner.fork_server`), as the watchdog
    uses a ``subprocess.Popen``: ``pid``, ``poll``, ``wait``, ``returncode``. Its status comes on
    ``channel``; should the server die first, the worker counts as killed once it is gone."""

    def __init__(self, channel: socket.socket, pid: int) -> None:
        self.channel = channel
        self.pid = pid
        self.returncode: int | None = None
        self._server_gone = False

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
            self._read(0.1 if left is None else min(left, 0.1))
        return self.returncode

    def _read(self, timeout: float) -> None:
        if self._server_gone:
            if not os.path.exists(f"/proc/{self.pid}"):
                self.returncode = -signal.SIGKILL
            else:
                time.sleep(timeout)
            return
        if not select.select([self.channel], [], [], timeout)[0]:
            return
        message = self.channel.recv(64).decode()
        if message.startswith("exit "):
            self.returncode = int(message.split()[1])
        elif not message:
            self._server_gone = True


def fork_worker(fd: int, argv: list[str], env: dict[str, str]) -> ForkedWorker:
    """Ask the fork server on socket ``fd`` for the worker (``argv``: ``PYTHON -m MODULE ...``);
    it writes to this process's standard output and error.

    Raises:
        OSError: the server did not fork it (it is gone, or refused).
    """
    channel = socket.socket(fileno=fd)
    request = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd()}).encode()
    socket.send_fds(channel, [request], [1, 2])
    reply = channel.recv(64).decode()
    if not reply.startswith("pid "):
        raise OSError(0, reply.strip() or "the fork server is gone")
    return ForkedWorker(channel, int(reply.split()[1]))


def _tree(worker: subprocess.Popen[bytes] | ForkedWorker) -> list[int]:
    """The processes to signal to stop ``worker``: this process's descendants, and a forked
    worker's own (it is no child of this process)."""
    found = _descendants(os.getpid())
    if isinstance(worker, ForkedWorker) and worker.poll() is None:
        found += [worker.pid, *_descendants(worker.pid)]
    return found


def stop_tree(worker: subprocess.Popen[bytes] | ForkedWorker, grace_s: float) -> None:
    """``SIGTERM`` the worker and every descendant, then ``SIGKILL`` what is left after
    ``grace_s`` seconds."""
    me = os.getpid()
    # SIGCONT after SIGTERM: a stopped process acts on its TERM only once it runs again.
    for sig in (signal.SIGTERM, signal.SIGCONT):
        try:
            os.killpg(worker.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        _signal_all(_tree(worker), sig)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if worker.poll() is not None and not [p for p in _descendants(me) if p != worker.pid]:
            return
        time.sleep(0.05)
    _signal_all(_tree(worker), signal.SIGKILL)
    worker.wait()


class LauncherLink:
    """What the watchdog hears from the launcher on standard input after the job: a heartbeat
    (a newline) every second, and end-of-file when it wants the worker stopped or it died.

    Args:
        fd: standard input.
        timeout_s: silence that counts as a lost launcher (stopped, hung, or unreachable);
            ``None`` or ``0``: none does.
    """

    def __init__(self, fd: int, timeout_s: float | None) -> None:
        self.fd = fd
        self.timeout_s = timeout_s or None
        self.closed = threading.Event()
        self.heard = time.monotonic()

    def watch(self) -> None:
        """Read until end-of-file (in a thread of its own)."""
        # Reads the descriptor itself: a thread blocked inside sys.stdin's buffered reader would
        # hold its lock when the interpreter exits, which Python treats as a fatal error.
        try:
            while os.read(self.fd, 65536):
                self.heard = time.monotonic()
        except OSError:
            pass
        self.closed.set()

    def silent_s(self) -> float | None:
        """How long the launcher has been silent, once that is longer than the timeout."""
        silent = time.monotonic() - self.heard
        if self.timeout_s is None or silent <= self.timeout_s:
            return None
        return silent


def _control(word: str, value: int) -> None:
    """Write a control line for the launcher; a launcher (or ssh link) already gone is no
    reason to stop watching."""
    try:
        os.write(1, f"{CONTROL}{word} {value}\n".encode())
    except OSError:
        pass


def _say(text: str) -> None:
    """Tell the launcher (through our standard error) without ever blocking on it."""
    _send(2, f"hora: {text}\n".encode())


def _send(fd: int, data: bytes) -> None:
    """Write ``data`` to ``fd`` without blocking: the launcher that reads it may be stopped.

    Only once the worker is gone, since it shares these descriptors.
    """
    try:
        os.set_blocking(fd, False)
        os.write(fd, data)
    except OSError:
        pass


def _supervise(
    worker: subprocess.Popen[bytes] | ForkedWorker,
    link: LauncherLink,
    stop: threading.Event,
    grace_s: float,
) -> float | None:
    """Wait for the worker to end; stop it when the launcher asks (or a signal does), or when
    the launcher has gone silent. Returns how long it was silent in that last case."""
    while worker.poll() is None:
        if stop.wait(0.1) or link.closed.is_set():
            if suspended(worker.pid):
                # The launcher names a stopped rank as the one that held the others up.
                _control("stopped", 1)
            stop_tree(worker, grace_s)
            return None
        silent = link.silent_s()
        if silent is not None:
            stop_tree(worker, grace_s)
            return silent
    return None


def _choose_interface(env: dict[str, str], rule: dict[str, Any]) -> None:
    """Unless one of ``rule["unless"]`` is set in ``env``, set ``rule["set"]`` to the interface
    this host reaches ``rule["towards"]`` (the job's store) with."""
    towards = str(rule.get("towards", ""))
    if not towards or any(env.get(str(name)) for name in rule.get("unless", [])):
        return
    interface = interface_towards(towards)
    if interface is not None:
        env[str(rule["set"])] = interface


def _share_cores(env: dict[str, str], rule: dict[str, Any]) -> None:
    """Unless ``rule["set"]`` (``OMP_NUM_THREADS``) is in ``env``, set it to this host's cores
    (those this process may run on) shared among the host's ``rule["local_size"]`` workers,
    at least one each (``local_size`` 0: unknown, nothing set)."""
    name = str(rule.get("set", ""))
    local_size = int(rule.get("local_size", 0))
    if not name or local_size < 1 or env.get(name):
        return
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    env[name] = str(max(1, cores // local_size))


def run(job: dict[str, Any], stdin_fd: int) -> int:
    """Start the job's worker and watch it; returns the exit status for SSH to report."""
    host = str(job.get("host", socket.gethostname()))
    env = {str(k): str(v) for k, v in job["env"].items()}
    argv = [str(a) for a in job["argv"]]
    grace_s = float(job.get("grace_s", 5.0))
    try:
        os.chdir(job["cwd"])
    except OSError as exc:
        print(
            f"hora: cannot enter the working directory {job['cwd']!r} on host {host} "
            f"({exc.strerror}). horarun starts remote workers in the directory it was run "
            "from; create it on every host (e.g. a shared file system) or run horarun from a "
            "directory that exists everywhere.",
            file=sys.stderr,
            flush=True,
        )
        return 126
    _choose_interface(env, job.get("interface") or {})
    _share_cores(env, job.get("threads") or {})
    become_subreaper()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    worker: subprocess.Popen[bytes] | ForkedWorker
    try:
        if job.get("fork_fd") is not None:
            worker = fork_worker(int(job["fork_fd"]), argv, env)
        else:
            worker = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_prepare_worker,
            )
    except OSError as exc:
        print(
            f"hora: cannot start {argv[0]!r} on host {host} ({exc.strerror}). Check that the "
            "command exists there, at the same path or on the PATH horarun passes on.",
            file=sys.stderr,
            flush=True,
        )
        return 127
    link = LauncherLink(stdin_fd, job.get("launcher_timeout_s"))
    threading.Thread(target=link.watch, daemon=True).start()
    silent = _supervise(worker, link, stop, grace_s)
    # Whatever the worker left behind would hold the SSH session open: stop it too.
    if _descendants(os.getpid()):
        stop_tree(worker, min(grace_s, 1.0))
    _reap_orphans()
    code = worker.wait()  # ended: its status
    sys.stdout.flush()
    if silent is None:
        _control("exit", code)
    else:
        _say(
            f"the launcher (horarun) sent nothing for {silent:.0f} s: it is stopped, hung, or "
            f"unreachable from host {host}. Stopped {job.get('label', 'the worker')} (pid {worker.pid}) there, as "
            f"HORA_LAUNCHER_TIMEOUT_SECONDS ({link.timeout_s:g}) asks."
        )
        _send(1, f"{CONTROL}exit {code}\n".encode())
    return 128 - code if code < 0 else code


def main() -> int:
    # The launcher sends only heartbeats after the job, so the stdin watch can read the
    # descriptor directly: a heartbeat the buffered reader took along is not missed (the next
    # one comes a second later).
    return run(read_job(sys.stdin.buffer), sys.stdin.fileno())


if __name__ == "__main__":
    sys.exit(main())
