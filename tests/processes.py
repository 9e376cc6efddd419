"""Finding a job's processes by a token in their command line, and proving none outlive it;
running a process as another user, to attack a job.

A test puts a unique token (its temporary directory) in the command line of every process it
starts; :func:`job_processes` finds them, and their watchdogs, so that :func:`survivors` can check
that each one of those very processes (not a later one with a reused pid) is gone.

The attack tests act as uid ``nobody`` (:data:`NOBODY`), which needs root (:data:`needs_root`):
:func:`as_nobody` and :func:`run_as_nobody` start a command as that user, with nothing of the
test's environment, and :func:`nobody_python` finds a Python that user can run.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from typing import Any

import psutil
import pytest

WATCHDOG_MARK = "hora-watchdog"


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


def job_processes(token: str, launcher: int | None = None) -> list[psutil.Process]:
    """Live processes whose command line holds ``token``, plus the watchdogs above them; the
    ``launcher`` (a pid) is left out."""
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter():
        if proc.pid != launcher and token in _cmdline(proc):
            found[proc.pid] = proc
            try:
                parents = proc.parents()
            except psutil.NoSuchProcess:
                continue
            for parent in parents:
                if WATCHDOG_MARK in _cmdline(parent):
                    found[parent.pid] = parent
    return list(found.values())


def survivors(procs: list[psutil.Process], timeout_s: float) -> list[str]:
    """Wait up to ``timeout_s`` for ``procs`` to end; describes those still alive (not zombies)."""
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    described = []
    for proc in alive:
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                described.append(f"pid {proc.pid}: {_cmdline(proc)}")
        except psutil.NoSuchProcess:
            pass
    return described


def kill_tree(pid: int) -> list[psutil.Process]:
    """SIGKILL the process ``pid`` (a launcher) and every process under it (workers, watchdogs),
    all at once; the processes, for :func:`survivors`."""
    root = psutil.Process(pid)
    procs = [*root.children(recursive=True), root]
    for proc in procs:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    return procs


def kill_all(token: str) -> None:
    """Cleanup after a failed test: SIGKILL whatever still carries ``token``."""
    for proc in job_processes(token):
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


# ---------------------------------------------------------------- another user

# The unprivileged user the attack tests act as.
NOBODY = 65534

# Acting as another user needs root (CI runs as root).
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")

# How a process runs as uid nobody: in /, with only PATH set, without root's groups.
_NOBODY = {
    "cwd": "/",
    "env": {"PATH": "/usr/bin:/bin"},
    "user": NOBODY,
    "group": NOBODY,
    "extra_groups": [],
}


def nobody_python() -> str:
    """The system's python3, which uid nobody can run (this test's own interpreter may lie where
    nobody cannot read it); skips the test without one."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("no system python3 for the attacking user")
    return python


def as_nobody(command: Sequence[str], **options: Any) -> subprocess.Popen[str]:
    """Start ``command`` as uid nobody, its streams as text; ``options`` are Popen's
    (``stdout=subprocess.PIPE``, ...)."""
    return subprocess.Popen(command, text=True, **_NOBODY, **options)


def run_as_nobody(command: Sequence[str], **options: Any) -> subprocess.CompletedProcess[str]:
    """Run ``command`` as uid nobody to its end, its streams as text; ``options`` are
    ``subprocess.run``'s (``check=True``, ``timeout=30``, ...)."""
    return subprocess.run(command, text=True, **_NOBODY, **options)
