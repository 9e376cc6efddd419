"""Finding a job's processes by a token in their command line, and proving none outlive it.

A test puts a unique token (its temporary directory) in the command line of every process it
starts; :func:`job_processes` finds them, and their watchdogs, so that :func:`survivors` can check
that each one of those very processes (not a later one with a reused pid) is gone.
"""

from __future__ import annotations

import psutil

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


def kill_all(token: str) -> None:
    """Cleanup after a failed test: SIGKILL whatever still carries ``token``."""
    for proc in job_processes(token):
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
