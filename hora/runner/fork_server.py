"""Workers forked from a process that imported their modules once: :class:`ForkServer`.

A fresh worker of ``hora.run`` is a new interpreter that imports PyTorch and hora, about 1.5 s of
CPU each time. A :class:`ForkServer` starts one process that imports the given modules once
(``hora.torch``, say) and then forks a worker for each request: its workers start in a few
milliseconds, which counts where a program calls ``hora.run`` many times (a notebook, a sweep, a
test suite).

Supervision does not change. Each worker still has its watchdog (:mod:`hora.runner.watchdog`),
started as for any worker; the watchdog sends its request over a socket of its own, with its
standard output and error, and the fork server forks the worker into its own session:

* the worker's standard input is ``/dev/null``, its output goes to the watchdog's descriptors
  (so to the launcher), its environment, working directory and arguments are the job's;
* it writes the watchdog's ``pid`` control line itself, runs ``python -m MODULE ARGS`` as a fresh
  interpreter would (``runpy``), waits for its non-daemon threads, runs its ``atexit`` functions
  and exits with the module's status;
* it applies what the interpreter reads at start-up and PyTorch at import: the working
  directory and ``PYTHONPATH`` on ``sys.path``, ``OMP_NUM_THREADS`` (``torch.set_num_threads``),
  ``PYTHONUNBUFFERED``; numpy's global random state is seeded afresh (Python's ``random`` is by
  the fork itself), so workers do not share a random stream;
* the fork server reports its exit status to the watchdog, and kills the worker's process group
  when the watchdog's socket closes (the watchdog died): what ``PR_SET_PDEATHSIG`` does for a
  worker the watchdog started itself.

The fork server listens on nothing: the launcher reaches it over a socket pair made when it
started, and each watchdog over a socket the launcher hands it at its start, so no other
process (no other user) can ask it for anything. It runs no thread of its own and serves
requests one at a time. Only commands of
the form ``PYTHON -m MODULE ...`` with the server's own ``PYTHON`` are forked; anything else
starts as a new process, as without a server. Remote workers (over SSH) always do.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from hora.runner.watchdog import CONTROL, FORK_REQUEST_BYTES, become_subreaper, die_with_parent

# What a PyTorch worker imports anyway: hora and PyTorch, and PyTorch's compiler, which PyTorch
# imports when the first optimizer is made (0.8 s of CPU).
PRELOAD = ("hora.torch", "torch._dynamo")
# How long the server may take to import its modules before it counts as failed.
START_TIMEOUT_S = 300.0
# The requests' descriptors: the worker's standard output and error.
_FDS = 2


class ForkServer:
    """A process that imports ``preload`` once and forks ``hora.run``'s workers from it.

    Use it as a context manager (or call :meth:`close`), and pass it to every
    :func:`hora.run` that should use it::

        with hora.ForkServer() as server:
            for lr in (0.1, 0.01):
                hora.run(train, args=(lr,), np=2, fork_server=server)

    Args:
        preload: modules to import in the server, in order; what the workers' function imports
            anyway (default: :data:`PRELOAD`, for PyTorch workers). A module that starts threads at import
            cannot be preloaded: the server refuses to start (a fork copies one thread only).
        executable: the Python the server runs, and the command's first word it forks for
            (default: this one, ``sys.executable``).

    Raises:
        RuntimeError: the server could not import ``preload``, or threads run in it.
    """

    def __init__(self, preload: Sequence[str] = PRELOAD, executable: str | None = None):
        self.preload = tuple(preload)
        self.executable = executable or sys.executable
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._control = ours
        self._lock = threading.Lock()
        with theirs:
            self._process = subprocess.Popen(
                [self.executable, "-m", __name__, str(theirs.fileno()), *self.preload],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        ours.settimeout(START_TIMEOUT_S)
        try:
            ready = ours.recv(4096)
        except TimeoutError:
            ready = f"its imports took more than {START_TIMEOUT_S:g} s".encode()
            self._process.kill()
        ours.settimeout(None)
        if not ready.startswith(b"ready"):
            ours.close()
            assert self._process.stderr is not None
            said = self._process.stderr.read().decode(errors="replace").strip().splitlines()
            self.close()
            said = said[-1:] if said else [ready.decode(errors="replace") or "it exited"]
            raise RuntimeError(f"hora.ForkServer({list(self.preload)!r}) did not start: {said[0]}")

    @property
    def pid(self) -> int:
        return self._process.pid

    def takes(self, command: Sequence[str]) -> bool:
        """Whether a worker running ``command`` is forked here (``PYTHON -m MODULE ...``)."""
        return (
            self._process.poll() is None
            and len(command) >= 3
            and command[0] == self.executable
            and command[1] == "-m"
        )

    def channel(self) -> socket.socket:
        """A new socket to the server, for one watchdog (it inherits it and sends its one
        request on it); the caller closes its copy once the watchdog has started."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with ours, self._lock:
            socket.send_fds(self._control, [b"c"], [ours.fileno()])
        return theirs

    def close(self) -> None:
        """Stop the server (workers it forked run on under their watchdogs)."""
        self._control.close()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        if self._process.stderr is not None:
            self._process.stderr.close()

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()


# ------------------------------------------------------------------ the server's side


def serve(control: socket.socket, preload: Sequence[str]) -> int:
    """The server's loop: a channel arrives on ``control``, a request on a channel; ends when
    ``control`` closes."""
    import importlib

    for module in preload:
        importlib.import_module(module)
    become_subreaper()  # a worker's orphans come here, not to init
    if threading.active_count() > 1:
        names = ", ".join(t.name for t in threading.enumerate() if t is not threading.main_thread())
        control.sendall(f"threads run after importing {list(preload)!r}: {names}".encode())
        return 1
    wake_r, wake_w = socket.socketpair()
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno())
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ, "control")
    selector.register(wake_r, selectors.EVENT_READ, "wake")
    workers: dict[int, socket.socket] = {}  # pid -> its watchdog's channel
    control.sendall(b"ready")
    open_ = True
    while open_ or workers:
        for key, _ in selector.select():
            if key.data == "control":
                open_ = _accept(control, selector)
            elif key.data == "wake":
                wake_r.recv(4096)
                _reap(workers)
            else:
                _request(key.fileobj, selector, workers, (control, wake_r, wake_w))  # type: ignore[arg-type]
    return 0


def _accept(control: socket.socket, selector: selectors.BaseSelector) -> bool:
    """A new channel from the launcher; ``False`` once the launcher closed the server."""
    try:
        _, fds, _, _ = socket.recv_fds(control, 1, 1)
    except OSError:
        fds = []
    if not fds:
        selector.unregister(control)
        return False
    selector.register(socket.socket(fileno=fds[0]), selectors.EVENT_READ, "channel")
    return True


def _reap(workers: dict[int, socket.socket]) -> None:
    """Tell each watchdog whose worker ended its status (``subprocess``'s: negative for a
    signal)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        channel = workers.pop(pid, None)
        if channel is not None:
            try:  # what the worker left behind in its group goes with it
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                channel.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass


def _request(
    channel: socket.socket,
    selector: selectors.BaseSelector,
    workers: dict[int, socket.socket],
    ours: Sequence[socket.socket],
) -> None:
    """A watchdog's request (fork the worker), or its channel closing (kill the worker)."""
    try:
        data, fds, _, _ = socket.recv_fds(channel, FORK_REQUEST_BYTES, _FDS)
    except OSError:
        data, fds = b"", []
    if not data:
        selector.unregister(channel)
        for pid, held in list(workers.items()):
            if held is channel:  # its watchdog is gone: so goes the worker
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        channel.close()
        return
    job = json.loads(data)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the worker; its status is what the tests check
        # None of the server's sockets stays open in the worker (other watchdogs' channels
        # among them).
        registered = [key.fileobj for key in selector.get_map().values()]
        sockets = [s for s in registered if isinstance(s, socket.socket)]
        selector.close()
        os._exit(_worker(job, fds, [*sockets, *ours]))
    for fd in fds:
        os.close(fd)
    workers[pid] = channel
    channel.sendall(f"pid {pid}\n".encode())


def _worker(job: dict[str, Any], fds: Sequence[int], inherited: Sequence[socket.socket]) -> int:
    """In the forked child: become the job's worker, run its module, and return its status."""
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sock in inherited:
            sock.close()
        null = os.open(os.devnull, os.O_RDONLY)
        for target, fd in zip((0, 1, 2), (null, *fds)):
            os.dup2(fd, target)
            os.close(fd)
        os.write(1, f"{CONTROL}pid {os.getpid()}\n".encode())
        os.chdir(job["cwd"])
        os.environ.clear()
        os.environ.update(job["env"])
        _as_started_fresh()
    except BaseException:
        traceback.print_exc()
        return 127
    argv = [str(a) for a in job["argv"]]
    sys.argv = [argv[2], *argv[3:]]
    return _run_module(argv[2])


def _as_started_fresh() -> None:
    """What a new interpreter (and PyTorch, at import) would have taken from the job's
    environment and working directory, and a random state of its own."""
    # ``python -m`` puts the working directory first on the path, then PYTHONPATH's entries.
    entries = [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]
    sys.path[:1] = [os.getcwd(), *(e for e in entries if e not in sys.path)]
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(write_through=unbuffered or stream is sys.stderr)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _run_module(module: str) -> int:
    """``python -m module``'s exit status, with its threads joined and ``atexit`` run."""
    import runpy

    code: int
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = _status(exc.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


def _status(code: object) -> int:
    """The exit status of ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def main() -> int:
    control = socket.socket(fileno=int(sys.argv[1]))
    return serve(control, sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
