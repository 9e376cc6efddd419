"""Faults injected into running ``horarun`` jobs: a rank or the launcher killed or stopped.

Each job is started as users start one (``horarun -np N python job.py``); the worker script,
written into the test's temporary directory, allreduces in a loop and checks every result. The
test injects a signal from outside, at a point the script marks with a file holding its pid:

* ``init``: the victim rank has started but not called ``hvd.init()``; the others are inside it;
* ``mid``: after 20 steps the victim stops calling collectives; the others block in the allreduce;
* ``loop``: every rank keeps allreducing (the victim is stopped wherever it is).

Every case asserts that ``horarun`` ends non-zero within a bound, with a message naming the rank
that was killed or stopped, that no wrong result was printed, and that no process of the job
(workers, their watchdogs and ssh links, found by the temporary directory in their command
lines) is left. The ssh cases run on the network-namespace hosts of ``tests/multihost`` and skip
where those cannot be built (not root, no sshd).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psutil
import pytest

from tests.multihost.conftest import Cluster
from tests.multihost.conftest import cluster as cluster  # the fixture, shared
from tests.multiproc.test_launchers import base_env
from tests.processes import job_processes, kill_all, survivors

HORARUN = [sys.executable, "-m", "hora.runner.launch"]
# The longest a job may take to end after a fault (the slowest case, a stopped rank, needs the
# stall limit below, the launcher's 5 s grace for the others and a few seconds to stop them).
ENDS_WITHIN_S = 30.0
# Stall and Gloo limits short enough to catch a stopped rank in seconds.
SHORT_LIMITS = {
    "HORA_STALL_CHECK_TIME_SECONDS": "1",
    "HORA_STALL_SHUTDOWN_TIME_SECONDS": "2",
    "HORA_GLOO_TIMEOUT_SECONDS": "5",
}
WRONG = "WRONG RESULT"

WORKER = """
import os, sys, time

phase, victim, token = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rank = int(os.environ["HORA_RANK"])


def mark(name):
    path = os.path.join(token, f"{name}.{rank}")
    with open(path + ".tmp", "w") as handle:
        handle.write(str(os.getpid()))
    os.rename(path + ".tmp", path)


if phase == "init" and rank == victim:
    mark("init")
    time.sleep(120)
import torch
import hora.torch as hvd

hvd.init()
size = hvd.size()
expected = float(sum(range(1, size + 1)))
for step in range(100_000):
    if step == 20:
        mark("loop")
        if phase == "mid" and rank == victim:
            mark("mid")
            time.sleep(120)
    total = hvd.allreduce(torch.tensor([rank + 1.0]), op=hvd.Sum, name="total").item()
    if total != expected:
        print(f"WRONG RESULT at step {step}: {total} != {expected}", flush=True)
print("finished all steps", flush=True)
"""


@dataclass
class Job:
    """A running ``horarun`` job and what the test knows of it."""

    launcher: subprocess.Popen[str]
    token: Path
    np: int

    def wait_for(self, name: str, rank: int, timeout_s: float = 60) -> int:
        """The pid that rank ``rank`` wrote when it reached mark ``name``."""
        path = self.token / f"{name}.{rank}"
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if self.launcher.poll() is not None:
                out, err = self.launcher.communicate()
                pytest.fail(f"the job ended before rank {rank} reached {name!r}:\n{out}\n{err}")
            assert time.monotonic() < deadline, f"rank {rank} did not reach {name!r}"
            time.sleep(0.05)
        return int(path.read_text())

    def processes(self) -> list[psutil.Process]:
        """The job's workers and watchdogs (and ssh links) running now."""
        procs = {p.pid: p for p in job_processes(str(self.token), self.launcher.pid)}
        try:
            for child in psutil.Process(self.launcher.pid).children(recursive=True):
                procs.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            pass
        return list(procs.values())

    def end(self, started: float) -> tuple[str, str, float]:
        """Wait for horarun to exit; its stdout, stderr and the time since ``started``."""
        try:
            out, err = self.launcher.communicate(timeout=ENDS_WITHIN_S + 30)
        except subprocess.TimeoutExpired:
            self.launcher.kill()
            out, err = self.launcher.communicate()
            pytest.fail(f"horarun did not end after the fault:\n{out}\n{err}")
        return out, err, time.monotonic() - started


class Starter(Protocol):
    def __call__(
        self,
        np: int,
        phase: str,
        victim: int,
        env: dict[str, str] | None = None,
        extra: list[str] | None = None,
    ) -> Job: ...


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Starter]:
    """``start(np, phase, victim, env=..., extra=[...])`` starts a job; whatever is left of it
    at the end of the test is killed."""
    script = tmp_path / "job.py"
    script.write_text(WORKER)
    jobs: list[Job] = []

    def _start(
        np: int,
        phase: str,
        victim: int,
        env: dict[str, str] | None = None,
        extra: list[str] | None = None,
    ) -> Job:
        command = [*HORARUN, "-np", str(np), *(extra or []), sys.executable, str(script)]
        launcher = subprocess.Popen(
            [*command, phase, str(victim), str(tmp_path)],
            env=base_env(**(env or {})),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        jobs.append(Job(launcher, tmp_path, np))
        return jobs[-1]

    yield _start
    for job in jobs:
        if job.launcher.poll() is None:
            job.launcher.kill()
            job.launcher.wait()
    kill_all(str(tmp_path))


def _check_ended(job: Job, procs: list[psutil.Process], out: str, err: str, took: float) -> None:
    """The common assertions: non-zero, in time, no wrong result, nothing left behind."""
    shown = f"exit status {job.launcher.returncode} after {took:.1f} s\n{out}\n{err}"
    assert job.launcher.returncode == 1, shown
    assert took < ENDS_WITHIN_S, shown
    assert WRONG not in out, shown
    assert "finished all steps" not in out, shown
    assert survivors(procs, timeout_s=5) == [], shown
    assert survivors(job_processes(str(job.token)), timeout_s=0) == [], shown


def _report_names(err: str, rank: int, pid: int, how: str, host: str = "localhost") -> None:
    """horarun's report names the rank first, with its host, pid and how it ended."""
    assert f"horarun: the job failed.\nrank {rank} (host {host}, pid {pid}) {how}" in err, err


# ---------------------------------------------------------------- a rank killed


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("np", "victim"), [(2, 1), (3, 0)])
def test_a_rank_killed_before_init_ends_the_job_naming_it(
    start: Starter, np: int, victim: int
) -> None:
    job = start(np, "init", victim)
    pid = job.wait_for("init", victim)
    procs = job.processes()
    started = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    out, err, took = job.end(started)
    _check_ended(job, procs, out, err, took)
    _report_names(err, victim, pid, "was killed by SIGKILL.")


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("np", "victim"), [(2, 1), (3, 0)])
def test_a_rank_killed_while_the_others_wait_in_allreduce_is_named_by_all(
    start: Starter, np: int, victim: int
) -> None:
    job = start(np, "mid", victim)
    pid = job.wait_for("mid", victim)
    procs = job.processes()
    started = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    out, err, took = job.end(started)
    _check_ended(job, procs, out, err, took)
    _report_names(err, victim, pid, "was killed by SIGKILL.")
    lost = (
        f"hora lost rank {victim}: rank {victim} (host localhost, pid {pid}) was killed by SIGKILL"
    )
    for survivor in set(range(np)) - {victim}:
        assert f"[{survivor}]<stderr>:" in err and lost in err, err
    # The survivors learn it from the launcher at once, not from a timeout.
    assert took < 15, err


# ---------------------------------------------------------------- a rank stopped


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("np", "victim"), [(2, 1), (3, 0)])
def test_a_stopped_rank_is_caught_by_the_stall_limit_and_named(
    start: Starter, np: int, victim: int
) -> None:
    job = start(np, "loop", victim, env=SHORT_LIMITS)
    pid = job.wait_for("loop", victim)
    for rank in range(np):
        job.wait_for("loop", rank)
    procs = job.processes()
    started = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    out, err, took = job.end(started)
    _check_ended(job, procs, out, err, took)
    _report_names(
        err,
        victim,
        pid,
        "was suspended (stopped by SIGSTOP, Ctrl-Z or a debugger) while the other ranks waited "
        "for it, and was killed by SIGTERM when the job was stopped.",
    )
    assert f"hora lost rank {victim}: it stopped responding" in err, err
    assert "HORA_STALL_SHUTDOWN_TIME_SECONDS (2 s)" in err, err


# ---------------------------------------------------------------- the launcher killed or stopped


@pytest.mark.timeout(90)
@pytest.mark.parametrize("np", [2, 3])
def test_workers_of_a_killed_launcher_are_stopped(start: Starter, np: int) -> None:
    job = start(np, "loop", 0)
    for rank in range(np):
        job.wait_for("loop", rank)
    procs = job.processes()
    assert len(procs) == 2 * np, [p.cmdline() for p in procs]  # a worker and its watchdog each
    job.launcher.kill()
    job.launcher.wait()
    # The watchdogs see their standard input close: TERM, then KILL after 5 s.
    assert survivors(procs, timeout_s=15) == []


@pytest.mark.timeout(90)
@pytest.mark.parametrize("np", [2, 3])
def test_workers_of_a_stopped_launcher_are_stopped_and_say_why(start: Starter, np: int) -> None:
    job = start(np, "loop", 0, env={"HORA_LAUNCHER_TIMEOUT_SECONDS": "2"})
    pids = [job.wait_for("loop", rank) for rank in range(np)]
    procs = job.processes()
    started = time.monotonic()
    job.launcher.send_signal(signal.SIGSTOP)
    try:
        # Nothing of the job may run on: the watchdogs hear no heartbeat for 2 s and stop their
        # workers. (They stay zombies until the launcher runs again and reaps them.)
        assert _running_after(procs, timeout_s=15) == []
        assert time.monotonic() - started < 10
    finally:
        job.launcher.send_signal(signal.SIGCONT)
    out, err, took = job.end(started)
    _check_ended(job, procs, out, err, took)
    for rank, pid in enumerate(pids):
        assert (
            f"[{rank}]<stderr>:hora: the launcher (horarun) sent nothing for 2 s: it is stopped, "
            f"hung, or unreachable from host localhost. Stopped rank {rank} (pid {pid}) there, "
            "as HORA_LAUNCHER_TIMEOUT_SECONDS (2) asks." in err
        ), err


def _running_after(procs: list[psutil.Process], timeout_s: float) -> list[str]:
    """Wait up to ``timeout_s`` for ``procs`` to end or become zombies (whose parent cannot
    reap them yet); describes those still running."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = []
        for proc in procs:
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    running.append(f"pid {proc.pid}: {' '.join(proc.cmdline())}")
            except psutil.NoSuchProcess:
                pass
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.1)


# ---------------------------------------------------------------- the ssh link killed


def _ssh_link(job: Job, host: str) -> psutil.Process:
    """The launcher's ssh child that carries the worker on ``host``."""
    for child in psutil.Process(job.launcher.pid).children():
        try:
            if child.name() == "ssh" and host in child.cmdline():
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no ssh child for {host}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("phase", ["init", "mid"])
def test_a_killed_ssh_link_ends_the_job_naming_the_remote_rank(
    cluster: Cluster,  # the shared fixture
    start: Starter,
    phase: str,
) -> None:
    a, b = cluster.hosts
    job = start(2, phase, 1, extra=[*cluster.ssh_flags, "-H", f"{a}:1,{b}:1"])
    pid = job.wait_for(phase, 1)
    procs = job.processes()
    link = _ssh_link(job, b)
    started = time.monotonic()
    link.kill()
    out, err, took = job.end(started)
    _check_ended(job, procs, out, err, took)
    _report_names(
        err,
        1,
        pid,
        "lost its ssh connection (the ssh process was killed by SIGKILL before the worker's exit "
        f"status came back; the watchdog on {b} stops the worker when the connection closes).",
        host=b,
    )
    if phase == "mid":  # rank 0, blocked in the allreduce, names the lost rank at once
        assert f"hora lost rank 1: rank 1 (host {b}, pid {pid}) lost its ssh connection" in err
    # The remote watchdog saw the connection close and stopped the worker there.
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
