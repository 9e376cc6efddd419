"""Starting worker processes, forwarding their output, and stopping them all on failure.

This module owns the worker processes of a job on this machine: their environment, their
``[rank]<stdout>:`` prefixed output, and their fate. When one rank fails it records how in the
store (so survivors report the lost rank at once), gives the others a grace period to report
their own errors, then stops them: TERM, and KILL after a second grace period.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

import psutil

from hora.runner.hosts import Slot

STDERR_TAIL_LINES = 20
# After the first failure, how long the other ranks get to notice and exit on their own.
FAILURE_GRACE_S = 5.0
# After TERM, how long before KILL.
TERMINATE_GRACE_S = 5.0

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: have the kernel send SIGKILL to the worker when the launcher dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


@dataclass
class Worker:
    """One worker process and what it has said."""

    slot: Slot
    process: subprocess.Popen[bytes]
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=STDERR_TAIL_LINES))
    threads: list[threading.Thread] = field(default_factory=list)
    exit_time: float = float("inf")

    @property
    def rank(self) -> int:
        return self.slot.rank


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


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

    def _pump(self, worker: Worker, stream: IO[bytes], name: str, sink: IO[str]) -> None:
        log: IO[str] | None = None
        if self.log_dir:
            directory = os.path.join(self.log_dir, f"rank.{worker.rank}")
            os.makedirs(directory, exist_ok=True)
            log = open(os.path.join(directory, name), "w", encoding="utf-8")  # noqa: SIM115
        try:
            for raw in iter(stream.readline, b""):
                text = raw.decode(errors="replace")
                if log is not None:
                    log.write(text)
                    log.flush()
                # A progress bar rewrites its line with \r: keep only what shows last.
                line = text.rstrip("\n").rsplit("\r", 1)[-1]
                if name == "stderr":
                    worker.stderr_tail.append(line)
                with self._lock:
                    sink.write(self._decorate(worker.rank, name, line) + "\n")
                    sink.flush()
        finally:
            if log is not None:
                log.close()

    def _decorate(self, rank: int, name: str, line: str) -> str:
        if not self.prefix:
            return line
        stamp = time.strftime("%a %b %d %H:%M:%S %Y") + ":" if self.timestamp else ""
        return f"{stamp}[{rank}]<{name}>:{line}"


class Supervisor:
    """Runs the workers of one job on this machine until they all end.

    Args:
        on_exit: called as ``on_exit(rank, text)`` when a rank fails, before others are stopped.
        forwarder: how output is copied.
    """

    def __init__(
        self,
        on_exit: Callable[[int, str], None] | None = None,
        forwarder: OutputForwarder | None = None,
    ) -> None:
        self.workers: list[Worker] = []
        self.on_exit = on_exit
        self.forwarder = forwarder or OutputForwarder()
        self.first_failure: Worker | None = None
        self._stopping = False

    def spawn(
        self, slot: Slot, command: list[str], env: dict[str, str], cwd: str | None = None
    ) -> Worker:
        process = subprocess.Popen(
            command,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        worker = Worker(slot, process)
        assert process.stdout is not None and process.stderr is not None
        self.forwarder.start(worker, process.stdout, "stdout", sys.stdout)
        self.forwarder.start(worker, process.stderr, "stderr", sys.stderr)
        waiter = threading.Thread(target=self._note_exit, args=(worker,), daemon=True)
        waiter.start()
        self.workers.append(worker)
        return worker

    @staticmethod
    def _note_exit(worker: Worker) -> None:
        worker.process.wait()
        worker.exit_time = time.monotonic()

    def wait(self, timeout_s: float | None = None) -> dict[int, int]:
        """Wait for every worker; returns exit codes by rank.

        Raises:
            TimeoutError: ``timeout_s`` passed first (the workers have then been stopped).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        failure_deadline: float | None = None
        reported: set[int] = set()
        while True:
            running = [w for w in self.workers if w.process.poll() is None]
            for worker in self.workers:
                code = worker.process.returncode
                if code is not None and code != 0 and worker.rank not in reported:
                    reported.add(worker.rank)
                    if self.first_failure is None:
                        self.first_failure = worker
                        failure_deadline = time.monotonic() + FAILURE_GRACE_S
                    if self.on_exit is not None and not self._stopping:
                        text = (
                            f"rank {worker.rank} (host {worker.slot.hostname}, pid "
                            f"{worker.process.pid}) {describe_exit(code)}"
                        )
                        try:
                            self.on_exit(worker.rank, text)
                        except Exception:  # noqa: BLE001 - survivors will still time out
                            pass
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
        for worker in self.workers:
            worker.process.wait()
            for thread in worker.threads:
                thread.join(timeout=5)
        return {w.rank: w.process.returncode for w in self.workers}

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop every worker and its children: ``sig``, then KILL after a grace period."""
        self._stopping = True
        victims: list[psutil.Process] = []
        for worker in self.workers:
            if worker.process.poll() is not None:
                continue
            try:
                parent = psutil.Process(worker.process.pid)
                victims.extend([parent, *parent.children(recursive=True)])
            except psutil.NoSuchProcess:
                continue
        for proc in victims:
            try:
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(victims, timeout=TERMINATE_GRACE_S)
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
        # A rank that reported ending the job is the cause; otherwise the rank that ended
        # first is the likeliest one, and the others followed it.
        named = [w for w in failed if w.rank == cause_rank]
        worker = named[0] if named else min(failed, key=lambda w: (w.exit_time, w.rank))
        code = codes[worker.rank]
        lines = [
            f"rank {worker.rank} (host {worker.slot.hostname}, pid {worker.process.pid}) "
            f"{describe_exit(code)}."
        ]
        if worker.stderr_tail:
            lines.append(f"Last lines of rank {worker.rank}'s stderr:")
            lines += [f"    {line}" for line in worker.stderr_tail]
        others = sorted(r for r, c in codes.items() if c != 0 and r != worker.rank)
        if others:
            lines.append(f"Ranks {others} also ended with an error (see their output above).")
        return "\n".join(lines)


def install_signal_handlers(supervisor: Supervisor) -> None:
    """Ctrl-C or TERM to the launcher stops every worker before the launcher exits."""

    def handler(signum: int, frame: Any) -> None:
        del frame
        supervisor.stop(signal.SIGTERM)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
