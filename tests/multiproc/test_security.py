"""The job's store rejects what was not signed for it: a forged value, or a signed value moved to
another key, is refused with a clear error by a real worker, and is never unpickled."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hora.common.job.store import new_secret, sign
from hora.runner.api import FUNCTION_KEY, result_key
from hora.runner.store_server import RendezvousServer


class _Trap:
    """Unpickling this creates a file: proof that a payload was loaded."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def _run_task(server: RendezvousServer) -> subprocess.CompletedProcess[str]:
    """Start hora.run's worker program, as hora.run would, against ``server``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env.update(server.env())
    env.update({"HORA_RANK": "0", "HORA_SIZE": "1", "HORA_START_TIMEOUT": "20"})
    return subprocess.run(
        [sys.executable, "-m", "hora.runner.task"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.timeout(90)
@pytest.mark.parametrize("forgery", ["unsigned", "wrong secret"])
def test_a_forged_function_is_rejected_and_never_unpickled(tmp_path: Path, forgery: str) -> None:
    trap = tmp_path / "unpickled"
    evil = pickle.dumps(_Trap(str(trap)))
    server = RendezvousServer("127.0.0.1")
    try:
        # A client without the job's secret writes straight to the store (here it even knows
        # the key's namespaced name, which the secret normally hides).
        blob = evil if forgery == "unsigned" else sign(new_secret(), evil, key=FUNCTION_KEY)
        server.client.store.set(server.client.key(FUNCTION_KEY), blob)
        result = _run_task(server)
    finally:
        server.close()
    assert result.returncode == 1, result.stderr
    assert "rejected a store value 'run/function'" in result.stderr
    assert "The function was not loaded." in result.stderr
    assert not trap.exists()


@pytest.mark.timeout(90)
def test_a_signed_value_moved_to_another_key_is_rejected(tmp_path: Path) -> None:
    trap = tmp_path / "unpickled"
    server = RendezvousServer("127.0.0.1")
    try:
        # A genuine, signed value of this job (a rank's result) is copied to the function's key.
        server.client.set_signed(result_key(0), pickle.dumps(_Trap(str(trap))))
        store, key = server.client.store, server.client.key
        store.set(key(FUNCTION_KEY), store.get(key(result_key(0))))
        result = _run_task(server)
    finally:
        server.close()
    assert result.returncode == 1, result.stderr
    assert "for key 'run/function' (it may have been copied from another key)" in result.stderr
    assert not trap.exists()


def test_the_trap_fires_when_unpickled(tmp_path: Path) -> None:
    """The control: the payloads above would have left a file had anything loaded them."""
    trap = tmp_path / "unpickled"
    pickle.loads(pickle.dumps(_Trap(str(trap)))).close()
    assert trap.exists()


OPEN_FILES = (
    "import resource, hora.torch as hvd; hvd.init(); "
    "print('LIMIT', resource.getrlimit(resource.RLIMIT_NOFILE)[0], flush=True); hvd.shutdown()"
)


@pytest.mark.timeout(120)
def test_workers_raise_a_low_open_file_limit() -> None:
    """Gloo keeps every stray connection to its ports; a worker started with a soft limit of
    256 files raises it (within the hard limit) so that its own pairs still fit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"the hard limit on open files is only {hard}")

    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    done = subprocess.run(
        [sys.executable, "-m", "hora.runner.launch", "-np", "2", sys.executable, "-c", OPEN_FILES],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        preexec_fn=lower,
    )
    assert done.returncode == 0, done.stderr
    limits = [int(line.split("LIMIT ")[1]) for line in done.stdout.splitlines() if "LIMIT " in line]
    wanted = 65536 if hard == resource.RLIM_INFINITY else min(65536, hard)
    assert limits == [wanted, wanted], done.stdout
