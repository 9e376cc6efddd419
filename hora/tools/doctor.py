"""``hora doctor``: the ``--check-build`` table (:mod:`hora.common.build_info`), versions, the
details behind each box, and a two-process allreduce on this machine through ``hora.run``.
Nothing here starts a job of its own beyond that check.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from hora.common.build_info import check_build_text, frameworks, torch_version, transports


def _ssh() -> str:
    if shutil.which("ssh") is None:
        return "not found: horarun needs an OpenSSH client for hosts other than this one"
    try:
        result = subprocess.run(["ssh", "-V"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run ssh -V ({exc})"
    return (result.stderr or result.stdout).strip().splitlines()[0]


def _shared_memory() -> str:
    """Whether ranks on this machine can exchange through shared memory, and the room for it."""
    import os

    from hora.common.job.shm_names import SHM_DIR
    from hora.common.transport.shm_segment import supported

    why_not = supported()
    if why_not is not None:
        return f"not usable ({why_not}): ranks on this machine exchange over Gloo"
    room = os.statvfs(SHM_DIR)
    free = room.f_bavail * room.f_frsize / 2**30
    return f"usable ({SHM_DIR}, {free:.1f} GiB free): ranks on one host exchange through it"


def _loopback_allreduce() -> tuple[float, str]:
    """Runs on each of the check's workers: one summed allreduce, and the data path it took."""
    import importlib

    import torch

    from hora.common import basics

    hvd: Any = importlib.import_module("hora.torch")
    hvd.init()
    try:
        total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum, name="hora.doctor")
        return float(total.item()), basics.data_path()
    finally:
        hvd.shutdown()


@dataclass(frozen=True)
class CheckResult:
    passed: bool
    seconds: float
    detail: str


def loopback_check(np: int = 2, timeout_s: float = 120.0) -> CheckResult:
    """Run a summed allreduce on ``np`` processes of this machine through ``hora.run``."""
    import hora

    expected = float(np * (np + 1) // 2)
    start = time.monotonic()
    try:
        results = hora.run(_loopback_allreduce, np=np, timeout_s=timeout_s)
    except Exception as exc:  # reported to the user as a failed check
        return CheckResult(False, time.monotonic() - start, f"{type(exc).__name__}: {exc}")
    seconds = time.monotonic() - start
    totals = [total for total, _ in results]
    if totals != [expected] * np:
        return CheckResult(False, seconds, f"expected {[expected] * np}, got {totals}")
    paths = sorted({path for _, path in results})
    return CheckResult(True, seconds, f"every rank got {expected:g}, data path {'/'.join(paths)}")


def doctor(np: int = 2, run_check: bool = True, timeout_s: float = 120.0) -> int:
    """Print the report; returns the exit status (1 when the loopback check fails)."""
    from hora import __version__

    print(check_build_text())
    print("\nVersions:")
    print(f"    hora      {__version__}")
    print(f"    torch     {torch_version() or 'cannot be imported'}")
    print(f"    python    {platform.python_version()} ({sys.executable})")
    print(f"    platform  {platform.platform()}")
    print("\nDetails:")
    for capability in [*frameworks()[1:2], *transports()]:
        print(f"    {capability.name + ':':<9} {capability.detail}")
    print(f"    {'shm:':<9} {_shared_memory()}")
    print(f"    {'ssh:':<9} {_ssh()}")
    if not run_check:
        return 0
    print(
        f"\nLoopback check: allreduce on {np} processes of this machine (hora.run) ...", flush=True
    )
    result = loopback_check(np, timeout_s)
    verdict = "PASS" if result.passed else "FAIL"
    print(f"    {verdict} in {result.seconds:.1f} s: {result.detail}")
    if not result.passed:
        print(
            "    hora cannot run a job on this machine. Run `horarun -np 2 --verbose python -c "
            '"import hora.torch as hvd; hvd.init()"` to see each worker\'s output.',
        )
    return 0 if result.passed else 1
