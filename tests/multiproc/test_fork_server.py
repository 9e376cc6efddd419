"""``hora.run(..., fork_server=...)``: workers forked from a process that imported hora once, on
real processes. They run as fresh workers would (environment, working directory, rank, output,
thread count, a random state of their own), fail and time out as fresh workers do, and leave
nothing behind; a server that cannot serve says so, and a command it does not take starts fresh.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

import hora
from hora.runner.api import HoraRunError
from hora.runner.fork_server import ForkServer

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server() -> Any:
    with ForkServer() as started:
        yield started


def _open_sockets() -> int:
    """How many sockets this process holds open."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass  # the listing's own descriptor, closed by now
    return count


def _observe(tag: str) -> dict[str, Any]:
    import numpy
    import torch

    import hora.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    print(f"{tag} from rank {hvd.rank()}", flush=True)
    seen = {
        "rank": hvd.rank(),
        "total": total,
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "sid": os.getsid(0),
        "cwd": os.getcwd(),
        "mark": os.environ.get("FORK_TEST_MARK"),
        "threads": torch.get_num_threads(),
        "draw": float(numpy.random.rand()),
        "stdin": os.read(0, 10),
        "sockets": _open_sockets(),
    }
    hvd.shutdown()
    return seen


@pytest.mark.parametrize("np", [2, 3])
def test_forked_workers_run_as_fresh_ones(
    server: ForkServer, np: int, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    env = {"FORK_TEST_MARK": "seen", "OMP_NUM_THREADS": "1"}
    fresh = hora.run(_observe, args=("fresh",), np=np, env=env, timeout_s=120)
    os.chdir(tmp_path)
    try:
        forked = hora.run(
            _observe, args=("forked",), np=np, env=env, timeout_s=120, fork_server=server
        )
    finally:
        os.chdir(Path(__file__).parents[2])
    total = float(sum(range(1, np + 1)))
    for rank, (a, b) in enumerate(zip(fresh, forked)):
        assert a["rank"] == b["rank"] == rank
        assert a["total"] == b["total"] == total
        assert a["mark"] == b["mark"] == "seen"
        assert a["threads"] == b["threads"] == 1
        assert a["stdin"] == b["stdin"] == b""
        assert b["cwd"] == str(tmp_path)
        assert b["ppid"] == server.pid  # forked there, not started by the watchdog
        assert b["sid"] == b["pid"]  # in a session of its own
        # None of the server's sockets (other workers' channels) stays open in a worker.
        assert b["sockets"] <= a["sockets"], (a["sockets"], b["sockets"])
    assert len({r["draw"] for r in forked}) == np  # no shared random stream
    out = capfd.readouterr().out
    for rank in range(np):
        assert f"[{rank}]<stdout>:forked from rank {rank}" in out
    time.sleep(0.5)
    assert not [p for p in (r["pid"] for r in forked) if psutil.pid_exists(p)]


def _raise_on_one(rank_to_fail: int) -> int:
    import hora.torch as hvd

    hvd.init()
    if hvd.rank() == rank_to_fail:
        raise ValueError(f"rank {hvd.rank()} refuses")
    rank = hvd.rank()
    hvd.shutdown()
    return rank


def test_a_failing_forked_worker_is_reported_as_a_fresh_one(server: ForkServer) -> None:
    with pytest.raises(HoraRunError) as info:
        hora.run(_raise_on_one, args=(1,), np=2, timeout_s=120, fork_server=server)
    assert "rank 1 refuses" in str(info.value)
    assert "ValueError" in info.value.errors[1]


def _exit_with(code: int) -> None:
    import sys

    sys.exit(code)


def test_the_exit_status_of_a_forked_worker_reaches_the_launcher(server: ForkServer) -> None:
    with pytest.raises(HoraRunError) as info:
        hora.run(_exit_with, args=(3,), np=2, timeout_s=60, fork_server=server)
    assert "exit" in str(info.value) and "3" in str(info.value)


def _hang(path: str) -> None:
    import subprocess
    import time

    helper = subprocess.Popen(["sleep", "300"])
    with open(f"{path}.{os.getpid()}", "w") as handle:
        handle.write(f"{os.getpid()} {helper.pid}")
    time.sleep(300)


def test_a_timed_out_job_leaves_no_forked_worker_nor_its_children(
    server: ForkServer, tmp_path: Path
) -> None:
    mark = str(tmp_path / "pids")
    with pytest.raises(TimeoutError):
        hora.run(_hang, args=(mark,), np=2, timeout_s=8, fork_server=server)
    pids = [int(p) for f in tmp_path.glob("pids.*") for p in f.read_text().split()]
    assert len(pids) == 4, pids
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and [p for p in pids if _alive(p)]:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)]
    assert psutil.Process(server.pid).is_running()  # the server serves on


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _report_pid(path: str) -> None:
    import time

    with open(path, "w") as handle:
        handle.write(str(os.getpid()))
    time.sleep(300)


def test_a_killed_watchdog_takes_its_forked_worker_along(
    server: ForkServer, tmp_path: Path
) -> None:
    """What PR_SET_PDEATHSIG does for a worker the watchdog starts itself."""
    import threading

    mark = tmp_path / "pid"
    errors: list[BaseException] = []

    def launch() -> None:
        try:
            hora.run(_report_pid, args=(str(mark),), np=1, timeout_s=30, fork_server=server)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=launch)
    thread.start()
    deadline = time.monotonic() + 30
    while not mark.exists() or not mark.read_text():
        assert time.monotonic() < deadline, "the worker never started"
        time.sleep(0.05)
    worker = int(mark.read_text())
    (watchdog,) = [
        p for p in psutil.Process().children() if "hora-watchdog" in " ".join(p.cmdline())
    ]
    os.kill(watchdog.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(worker):
        time.sleep(0.05)
    assert not _alive(worker)
    thread.join(60)
    assert errors and isinstance(errors[0], HoraRunError), errors


def test_a_command_the_server_does_not_take_starts_fresh(server: ForkServer) -> None:
    with pytest.raises(TypeError, match="fork_server must be a hora.ForkServer, got str"):
        hora.run(_exit_with, args=(0,), np=1, fork_server="yes")  # type: ignore[arg-type]
    assert server.takes([server.executable, "-m", "hora.runner.task"])
    assert not server.takes(["/usr/bin/python3", "-m", "hora.runner.task"])
    assert not server.takes([server.executable, "train.py"])


def test_a_module_that_starts_threads_cannot_be_preloaded(tmp_path: Path) -> None:
    (tmp_path / "threaded_at_import.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), name='busy', daemon=True).start()\n"
    )
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(tmp_path)
    try:
        with pytest.raises(RuntimeError, match="threads run after importing .*busy"):
            ForkServer(["threaded_at_import"])
        with pytest.raises(RuntimeError, match="No module named 'not_a_module'"):
            ForkServer(["not_a_module"])
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


def _parent() -> int:
    return os.getppid()


def test_a_closed_server_leaves_its_jobs_to_fresh_workers() -> None:
    closed = ForkServer()
    pid = closed.pid
    assert hora.run(_parent, np=1, fork_server=closed) == [pid]
    closed.close()
    assert not psutil.pid_exists(pid) or _alive(pid) is False
    (parent,) = hora.run(_parent, np=1, fork_server=closed, timeout_s=60)
    assert parent != pid  # started by its watchdog


def test_a_function_found_through_the_jobs_pythonpath_runs_forked(
    server: ForkServer, tmp_path: Path
) -> None:
    """As ``python -m`` would: the job's PYTHONPATH (and working directory) on ``sys.path``,
    whatever the server's was when it started."""
    import importlib
    import sys

    (tmp_path / "user_module_of_the_job.py").write_text(
        "import os\n\ndef where():\n    return __file__, os.getcwd()\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        where = importlib.import_module("user_module_of_the_job").where
        env = {"PYTHONPATH": str(tmp_path)}
        results = hora.run(where, np=2, env=env, timeout_s=60, fork_server=server)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("user_module_of_the_job", None)
    assert results == [(str(tmp_path / "user_module_of_the_job.py"), os.getcwd())] * 2
