"""Starting worker processes, forwarding their output, and stopping them all on failure.

This module owns the worker processes of a job: their ``[rank]<stdout>:`` prefixed output and
their fate. Every worker runs under a watchdog (:mod:`hora.runner.watchdog`): a local child
process, or the far end of an ``ssh`` child for another host. Closing the watchdog's standard
input stops the worker and everything it started; the launcher dying closes it too. A heartbeat
thread writes to every watchdog once a second, so that a launcher that is stopped or hung (which
closes nothing) is noticed too: each watchdog stops its worker after
``HORA_LAUNCHER_TIMEOUT_SECONDS`` of silence. When one rank fails the supervisor records how in
the store (so survivors report the lost rank at once), gives the others a grace period to report
their own errors, then stops them: TERM, and KILL after a second grace period. A worker that its
watchdog found stopped (``SIGSTOP``) at that point is named as the cause.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

import psutil

from hora.common.vocabulary import safe_files
from hora.common.vocabulary.settings_table import LAUNCHER_TIMEOUT_SECONDS
from hora.runner.hosts import Slot
from hora.runner.options import env_seconds
from hora.runner.remote import LOADER, SshSettings, remote_command, stdin_payload
from hora.runner.watchdog import CONTROL, die_with_parent, parse_control

if TYPE_CHECKING:
    from hora.runner.fork_server import ForkServer

STDERR_TAIL_LINES = 20
# After the first failure, how long the other ranks get to notice and exit on their own.
FAILURE_GRACE_S = 5.0
# After TERM, how long before KILL (the watchdogs apply it to their workers).
TERMINATE_GRACE_S = 5.0
# How much longer a watchdog (or its ssh) gets to report and exit before it is killed itself.
WATCHDOG_SLACK_S = 3.0
# Text redrawn with a carriage return (a progress bar) is shown at most this often per stream.
REDRAW_INTERVAL_S = 1.0
# ssh's exit status when the connection failed (or the remote command itself returned 255).
SSH_FAILED = 255
# How often the launcher tells every watchdog it is alive (HORA_LAUNCHER_TIMEOUT_SECONDS is the
# silence after which a watchdog stops its worker).
HEARTBEAT_INTERVAL_S = 1.0


@dataclass
class Worker:
    """One worker: its watchdog process (or the ssh to it) and what it has said.

    Attributes:
        slot: where the rank runs.
        process: the local watchdog, or the ssh child for a remote worker.
        remote: whether it runs on another host.
        pid: the worker's own process id, once its watchdog reported it.
        status: the worker's exit status as its watchdog saw it (negative: killed by a signal).
        suspended: its watchdog found it stopped (``SIGSTOP``, Ctrl-Z, a debugger) when asked
            to stop it.
    """

    slot: Slot
    process: subprocess.Popen[bytes]
    remote: bool = False
    pid: int | None = None
    status: int | None = None
    suspended: bool = False
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=STDERR_TAIL_LINES))
    threads: list[threading.Thread] = field(default_factory=list)
    exit_time: float = float("inf")
    done: threading.Event = field(default_factory=threading.Event)
    stdin_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def rank(self) -> int:
        return self.slot.rank

    @property
    def exit_code(self) -> int | None:
        """The worker's exit status; ``None`` while it runs."""
        if not self.done.is_set():
            return None
        if self.status is not None:
            return self.status
        return self.process.returncode

    def where(self) -> str:
        """``rank 1 (host node2, pid 4242)``."""
        how = f"pid {self.pid}" if self.pid is not None else "not started"
        return f"rank {self.rank} (host {self.slot.hostname}, {how})"

    def describe_exit(self, code: int) -> str:
        if self.suspended:
            return (
                "was suspended (stopped by SIGSTOP, Ctrl-Z or a debugger) while the other ranks "
                f"waited for it, and {describe_exit(code)} when the job was stopped"
            )
        if self.remote and self.status is None and code != 0:
            return self._describe_link(code)
        return describe_exit(code)

    def _describe_link(self, code: int) -> str:
        """How a remote worker's ssh ended before the worker's exit status came back."""
        host = self.slot.hostname
        if self.pid is None:
            how = "ssh exit status 255" if code == SSH_FAILED else f"ssh {describe_exit(code)}"
            return (
                f"could not be started: ssh to host {host} failed ({how}) before the worker "
                "started; ssh's own message is in the worker's stderr"
            )
        if code == SSH_FAILED:
            return (
                "lost its ssh connection (ssh exit status 255: the connection failed or broke "
                "before the worker's exit status came back)"
            )
        return (
            f"lost its ssh connection (the ssh process {describe_exit(code)} before the worker's "
            f"exit status came back; the watchdog on {host} stops the worker when the "
            "connection closes)"
        )

    def release_stdin(self) -> None:
        """Close the pipe to the worker's watchdog, which then stops the worker."""
        with self.stdin_lock:
            if self.process.stdin is not None and not self.process.stdin.closed:
                try:
                    self.process.stdin.close()
                except OSError:
                    pass

    def heartbeat(self) -> None:
        """Tell the watchdog the launcher is alive (a newline; never blocks)."""
        with self.stdin_lock:
            stdin = self.process.stdin
            if stdin is None or stdin.closed:
                return
            try:
                os.write(stdin.fileno(), b"\n")
            except OSError:  # full (a slow ssh link: the next one will do) or closed
                pass


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def describe_exit(code: int) -> str:
    """How a process ended, in words (negative ``code``: killed by that signal)."""
    if code < 0:
        return f"was killed by {_signal_name(-code)}"
    return f"exited with code {code}"


class ControlFilter:
    """Takes the watchdog's control lines out of a worker's standard output.

    A control line may arrive split across reads; its start is held back until its end comes.
    """

    def __init__(self) -> None:
        self._held = ""

    def feed(self, text: str) -> tuple[str, list[tuple[str, int]]]:
        """The text to forward, and the ``(word, value)`` controls found in it."""
        text, self._held = self._held + text, ""
        kept: list[str] = []
        controls: list[tuple[str, int]] = []
        while True:
            start = text.find(CONTROL[0])
            if start < 0:
                kept.append(text)
                break
            kept.append(text[:start])
            end = text.find("\n", start)
            if end < 0:
                if CONTROL.startswith(text[start:]) or text[start:].startswith(CONTROL):
                    self._held = text[start:]
                else:
                    kept.append(text[start:])
                break
            control = parse_control(text[start:end])
            if control is None:
                kept.append(text[start : end + 1])
            else:
                controls.append(control)
            text = text[end + 1 :]
        return "".join(kept), controls

    def close(self) -> str:
        held, self._held = self._held, ""
        return held


_TERMINATOR = re.compile(r"(\r\n|\r|\n)")


class LineSplitter:
    """Cuts a stream's text into the lines to show.

    Lines ended by ``\n`` are shown whole. Text redrawn in place with ``\r`` (a progress bar)
    cannot be redrawn once it is mixed with other ranks' lines, so only its newest state is shown,
    at most once per ``interval_s``; a state still unshown when the stream goes quiet is shown
    once the interval has passed (see :meth:`due`), and a finished line drops it.
    """

    def __init__(self, interval_s: float = REDRAW_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._tail = ""
        self._redrawing = False  # the tail follows a \r: it is a redraw in progress
        self._state: str | None = None  # newest redrawn state not shown yet
        self._shown: str | None = None
        self._next_redraw = 0.0

    def feed(self, text: str, now: float) -> list[str]:
        """The lines to show after ``text`` arrived at time ``now``."""
        text = self._tail + text
        # A \r at the very end may be the first half of \r\n: wait for the next chunk.
        held = "\r" if text.endswith("\r") else ""
        parts = _TERMINATOR.split(text[: len(text) - len(held)])
        self._tail = parts.pop() + held
        out: list[str] = []
        for segment, terminator in zip(parts[0::2], parts[1::2]):
            if terminator == "\r":
                self._redrawing = True
                if segment:
                    self._state = segment
            else:
                self._redrawing = False
                self._state = None
                self._shown = None
                out.append(segment)
        if self._redrawing and self._tail.rstrip("\r"):
            self._state = self._tail.rstrip("\r")
        if self._state is not None and now >= self._next_redraw:
            out += self.redraw(now)
        return out

    def due(self) -> float | None:
        """When an unshown redrawn state should be shown, or ``None``."""
        return None if self._state is None else self._next_redraw

    def redraw(self, now: float) -> list[str]:
        """The newest redrawn state, if it has not been shown."""
        state, self._state = self._state, None
        if state is None or state == self._shown:
            return []
        self._shown = state
        self._next_redraw = now + self.interval_s
        return [state]

    def close(self) -> list[str]:
        """What is left when the stream ends."""
        tail = self._tail.rstrip("\r")
        if tail and not self._redrawing:
            return [tail]
        state = tail or self._state
        return [state] if state and state != self._shown else []


def _take_controls(controls: ControlFilter, text: str, worker: Worker, final: bool) -> str:
    """``text`` without the task runner's control lines; what they say (the worker's pid, its
    exit status) is recorded on ``worker``."""
    text, found = controls.feed(text)
    if final:
        text += controls.close()
    for word, value in found:
        if word == "pid":
            worker.pid = value
        elif word == "exit":
            worker.status = value
        elif word == "stopped":
            worker.suspended = bool(value)
    return text


class OutputForwarder:
    """Copies a worker's stream to ours, line by line, with a rank prefix.

    Args:
        prefix: whether to prefix lines with ``[rank]<stdout>:``.
        timestamp: whether to add the time to each prefix.
        log_dir: when set, also write each rank's output to ``<log_dir>/rank.<N>/<stream>``.
    """

    def __init__(
        self, prefix: bool = True, timestamp: bool = False, log_dir: str | None = None
    ) -> None:
        self.prefix = prefix
        self.timestamp = timestamp
        self.log_dir = log_dir
        self._lock = threading.Lock()

    def start(self, worker: Worker, stream: IO[bytes], name: str, sink: IO[str]) -> None:
        thread = threading.Thread(target=self._pump, args=(worker, stream, name, sink), daemon=True)
        thread.start()
        worker.threads.append(thread)

    def _log_file(self, worker: Worker, name: str) -> IO[str] | None:
        """The file that keeps a copy of a worker's ``name`` stream (``--output-filename``)."""
        if not self.log_dir:
            return None
        # Horovod's layout: rank numbers padded to the width of the largest one.
        width = len(str(max(worker.slot.size - 1, 0)))
        directory = os.path.join(self.log_dir, f"rank.{worker.rank:0{width}d}")
        return safe_files.create(os.path.join(directory, name))

    def _pump(self, worker: Worker, stream: IO[bytes], name: str, sink: IO[str]) -> None:
        try:
            log = self._log_file(worker, name)
        except OSError as exc:
            log = None
            with self._lock:
                sink.write(f"horarun: rank {worker.rank}'s {name} is not kept in a file: {exc}\n")
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        splitter = LineSplitter()
        controls = ControlFilter() if name == "stdout" else None
        fd = stream.fileno()
        try:
            while True:
                due = splitter.due()
                timeout = None if due is None else max(0.0, due - time.monotonic())
                readable, _, _ = select.select([fd], [], [], timeout)
                if not readable:
                    self._show(worker, name, sink, splitter.redraw(time.monotonic()))
                    continue
                chunk = os.read(fd, 65536)
                text = decoder.decode(chunk, final=not chunk)
                if controls is not None:
                    text = _take_controls(controls, text, worker, final=not chunk)
                if log is not None and text:
                    log.write(text)
                    log.flush()
                lines = splitter.feed(text, time.monotonic())
                if not chunk:
                    self._show(worker, name, sink, lines + splitter.close())
                    break
                self._show(worker, name, sink, lines)
        finally:
            if log is not None:
                log.close()

    def _show(self, worker: Worker, name: str, sink: IO[str], lines: list[str]) -> None:
        if not lines:
            return
        if name == "stderr":
            worker.stderr_tail.extend(lines)
        text = "".join(self._decorate(worker.rank, name, line) + "\n" for line in lines)
        with self._lock:
            sink.write(text)
            sink.flush()

    def _decorate(self, rank: int, name: str, line: str) -> str:
        if not self.prefix:
            return line
        stamp = time.strftime("%a %b %d %H:%M:%S %Y") + ":" if self.timestamp else ""
        return f"{stamp}[{rank}]<{name}>:{line}"


class Supervisor:
    """Runs the workers of one job until they all end.

    Args:
        on_exit: called as ``on_exit(rank, text)`` when a rank fails, before others are stopped.
        forwarder: how output is copied.
        launcher_timeout_s: how long each watchdog waits for a heartbeat of this launcher before
            it stops its worker; default ``HORA_LAUNCHER_TIMEOUT_SECONDS``.
        fork_server: where this host's workers are forked, for the commands it takes.
    """

    def __init__(
        self,
        on_exit: Callable[[int, str], None] | None = None,
        forwarder: OutputForwarder | None = None,
        launcher_timeout_s: float | None = None,
        fork_server: ForkServer | None = None,
    ) -> None:
        self.workers: list[Worker] = []
        self.on_exit = on_exit
        self.forwarder = forwarder or OutputForwarder()
        self.first_failure: Worker | None = None
        self._stopping = False
        if launcher_timeout_s is None:
            launcher_timeout_s = env_seconds(LAUNCHER_TIMEOUT_SECONDS)
        self.launcher_timeout_s = launcher_timeout_s
        self.fork_server = fork_server
        self._heart: threading.Thread | None = None
        self._heart_lock = threading.Lock()

    def spawn(
        self,
        slot: Slot,
        command: list[str],
        env: dict[str, str],
        cwd: str | None = None,
        ssh: SshSettings | None = None,
    ) -> Worker:
        """Start one worker under its watchdog: here, or on ``slot.hostname`` when ``ssh`` is
        given. The command, ``env`` and ``cwd`` (default: ours) go through the watchdog's
        standard input, never on a command line.
        """
        fork = self.fork_server
        channel = fork.channel() if ssh is None and fork and fork.takes(command) else None
        fds = () if channel is None else (channel.fileno(),)
        if ssh is None:
            # No PDEATHSIG here: when the launcher dies the watchdog must live on long enough
            # to stop the worker's whole tree (it sees its standard input close).
            argv, preexec = [sys.executable, "-c", LOADER], None
        else:
            # The kernel kills ssh with the launcher; its remote watchdog then sees the
            # connection close.
            argv, preexec = [*ssh.argv(slot.hostname), remote_command()], die_with_parent
        with contextlib.nullcontext() if channel is None else channel:  # the watchdog's copy
            process = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=preexec,
                pass_fds=fds,
            )
        payload = stdin_payload(
            command, env, cwd or os.getcwd(), slot.hostname, TERMINATE_GRACE_S,
            self.launcher_timeout_s, fds[0] if fds else None,
        )  # fmt: skip
        assert process.stdin is not None
        try:
            # The pipe stays open: closing it is how the worker is asked to stop, and the
            # heartbeats travel on it.
            process.stdin.write(payload)
            process.stdin.flush()
            os.set_blocking(process.stdin.fileno(), False)
        except BrokenPipeError:
            pass  # the watchdog (or ssh) already failed; its stderr and exit status say why
        worker = Worker(slot, process, remote=ssh is not None)
        assert process.stdout is not None and process.stderr is not None
        self.forwarder.start(worker, process.stdout, "stdout", sys.stdout)
        self.forwarder.start(worker, process.stderr, "stderr", sys.stderr)
        waiter = threading.Thread(target=self._note_exit, args=(worker,), daemon=True)
        waiter.start()
        with self._heart_lock:
            self.workers.append(worker)
            if self._heart is None:
                self._heart = threading.Thread(
                    target=self._beat, name="hora-heartbeat", daemon=True
                )
                self._heart.start()
        return worker

    def _beat(self) -> None:
        """Tell every running watchdog, once a second, that this launcher is alive (one that
        hears nothing for ``launcher_timeout_s`` stops its worker); ends when none runs."""
        while True:
            with self._heart_lock:
                running = [w for w in self.workers if not w.done.is_set()]
                if not running:
                    self._heart = None
                    return
            for worker in running:
                worker.heartbeat()
            time.sleep(HEARTBEAT_INTERVAL_S)

    @staticmethod
    def _note_exit(worker: Worker) -> None:
        worker.process.wait()
        # The worker's exit status arrives on standard output: read it to the end first.
        worker.threads[0].join(timeout=5)
        worker.exit_time = time.monotonic()
        worker.done.set()

    def wait(self, timeout_s: float | None = None) -> dict[int, int]:
        """Wait for every worker; returns exit codes by rank.

        Raises:
            TimeoutError: ``timeout_s`` passed first (the workers have then been stopped).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        failure_deadline: float | None = None
        reported: set[int] = set()
        while True:
            running = [w for w in self.workers if not w.done.is_set()]
            for worker in self.workers:
                code = worker.exit_code
                if code is not None and code != 0 and worker.rank not in reported:
                    reported.add(worker.rank)
                    if self.first_failure is None:
                        self.first_failure = worker
                        failure_deadline = time.monotonic() + FAILURE_GRACE_S
                    self._report_exit(worker, code)
            if not running:
                break
            now = time.monotonic()
            if failure_deadline is not None and now > failure_deadline:
                self.stop()
                break
            if deadline is not None and now > deadline:
                self.stop()
                raise TimeoutError(f"the job did not finish within {timeout_s:g} s")
            time.sleep(0.05)
        codes: dict[int, int] = {}
        for worker in self.workers:
            worker.done.wait()
            worker.release_stdin()
            for thread in worker.threads:
                thread.join(timeout=5)
            code = worker.exit_code
            codes[worker.rank] = code if code is not None else 0
        return codes

    def _report_exit(self, worker: Worker, code: int) -> None:
        """Tell ``on_exit`` (the job's failure record) that ``worker`` failed, unless stopping."""
        if self.on_exit is None or self._stopping:
            return
        text = f"{worker.where()} {worker.describe_exit(code)}"
        try:
            self.on_exit(worker.rank, text)
        except Exception:  # survivors will still time out
            pass

    def stop(self) -> None:
        """Stop every worker and what it started: each watchdog TERMs its worker's tree and
        KILLs it after :data:`TERMINATE_GRACE_S`; a watchdog (or ssh) still there
        :data:`WATCHDOG_SLACK_S` later is killed with its tree.
        """
        self._stopping = True
        victims: list[psutil.Process] = []
        for worker in self.workers:
            if worker.process.poll() is not None:
                continue
            worker.release_stdin()
            try:
                parent = psutil.Process(worker.process.pid)
                victims.extend([parent, *parent.children(recursive=True)])
            except psutil.NoSuchProcess:
                continue
        _, alive = psutil.wait_procs(victims, timeout=TERMINATE_GRACE_S + WATCHDOG_SLACK_S)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=TERMINATE_GRACE_S)

    def failure_report(self, codes: dict[int, int], cause_rank: int | None = None) -> str:
        """What went wrong, for the user: the causing rank and its last stderr lines.

        Args:
            codes: exit codes by rank.
            cause_rank: the rank that reported ending the job, when one did.
        """
        failed = [w for w in self.workers if codes.get(w.rank, 0) != 0]
        if not failed:
            return ""
        # A rank found suspended held the others up, whatever they then reported; else a rank
        # that reported ending the job (or was recorded first) is the cause; otherwise the rank
        # that ended first is the likeliest one, and the others followed it.
        named = [w for w in failed if w.suspended] or [w for w in failed if w.rank == cause_rank]
        worker = named[0] if named else min(failed, key=lambda w: (w.exit_time, w.rank))
        code = codes[worker.rank]
        lines = [f"{worker.where()} {worker.describe_exit(code)}."]
        if worker.stderr_tail:
            lines.append(f"Last lines of rank {worker.rank}'s stderr:")
            lines += [f"    {line}" for line in worker.stderr_tail]
        others = sorted(r for r, c in codes.items() if c != 0 and r != worker.rank)
        if others:
            lines.append(f"Ranks {others} also ended with an error (see their output above).")
        succeeded = sorted(r for r, c in codes.items() if c == 0)
        if succeeded:
            # Whether they left early cannot be told from exit times (a rank that leaves runs
            # hvd.shutdown() at exit, and the others may fail before its process is gone).
            lines.append(
                f"Ranks {succeeded} exited with code 0. If they left before the other ranks "
                "were done, the others waited for them in their next collective and failed "
                "because of it: give every rank the same number of steps (or use hvd.join()), "
                "and call every collective on every rank, also those inside a rank-0 branch "
                "(a sharded optimizer's state_dict(), broadcast_object)."
            )
        return "\n".join(lines)


def install_signal_handlers(supervisor: Supervisor) -> None:
    """Ctrl-C or TERM to the launcher stops every worker before the launcher exits."""

    def handler(signum: int, frame: Any) -> None:
        del frame
        supervisor.stop()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
