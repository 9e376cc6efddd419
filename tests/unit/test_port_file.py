"""The random store port rank 0 publishes beside the job's secret file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hora.common.job import port_file
from hora.common.job.store import AuthenticationError, new_secret, sign


def test_a_published_port_is_read_back_and_private(tmp_path: Path) -> None:
    secret = new_secret()
    path = port_file.path_for(str(tmp_path / "secret"), "slurm-42.0")
    assert path.name == "secret.slurm-42.0.port"
    port_file.publish(path, "slurm-42.0", secret, 41234)
    assert path.stat().st_mode & 0o777 == 0o600
    assert port_file.wait(path, "slurm-42.0", secret, 1.0, started=time.time()) == 41234
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left


def test_job_ids_become_safe_file_names(tmp_path: Path) -> None:
    path = port_file.path_for(str(tmp_path / "s"), "../x y/1")
    assert path.parent == tmp_path and "/" not in path.name[2:]


def test_a_port_written_without_the_secret_is_tampering(tmp_path: Path) -> None:
    path = tmp_path / "s.job.port"
    body = json.dumps({"job_id": "job", "port": 1, "written": time.time()}).encode()
    path.write_bytes(sign(new_secret(), body, key="port-file/job"))
    with pytest.raises(AuthenticationError):
        port_file.wait(path, "job", new_secret(), 1.0, started=time.time())


def test_another_jobs_or_a_stale_file_is_not_taken(tmp_path: Path) -> None:
    secret = new_secret()
    path = tmp_path / "s.job.port"
    # Signed for another job id: the signature binds the id.
    port_file.publish(path, "other", secret, 1111)
    with pytest.raises(AuthenticationError):
        port_file.read(path, "job", secret, started=time.time())
    # This job's id, but written long before this process started (an earlier run crashed).
    port_file.publish(path, "job", secret, 2222)
    later = time.time() + port_file.STALE_S + 5
    assert port_file.read(path, "job", secret, started=later) is None
    with pytest.raises(TimeoutError, match="no store port was published"):
        port_file.wait(path, "job", secret, 0.2, started=later)


# ---------------------------------------------------------------- a secret reached through a link

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory like /tmp (mode 1777) that uid nobody can reach and write; its parent is
    this user's (pytest's own directories are its user's alone)."""
    base = Path(tempfile.mkdtemp(prefix="hora-port-file-"))
    base.chmod(0o755)
    directory = base / "shared"
    directory.mkdir()
    directory.chmod(0o1777)
    yield directory
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def linked_secret(shared: Path) -> tuple[Path, Path]:
    """A secret file in a directory of this user's alone, and a link to it in ``shared``:
    ``(link, secret file)``."""
    private = shared.parent / "private"
    private.mkdir(mode=0o700)
    secret_file = private / "secret"
    secret_file.write_text(new_secret() + "\n")
    secret_file.chmod(0o600)
    link = shared / "hora_secret"
    link.symlink_to(secret_file)
    return link, secret_file


def _plant(what: str, path: Path) -> None:
    """uid nobody plants a symbolic link (to a file that is no port file) or a FIFO at ``path``."""
    command = f"ln -s /etc/hostname {path}" if what == "link" else f"mkfifo -m 666 {path}"
    subprocess.run(
        ["/bin/sh", "-c", command],
        check=True,
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        timeout=30,
    )
    assert os.lstat(path).st_uid == NOBODY


def _in_thread(call: Callable[[], object], timeout_s: float) -> object:
    """``call()``'s result, failing the test if it takes longer than ``timeout_s``."""
    outcome: list[object] = []
    thread = threading.Thread(target=lambda: outcome.append(call()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"still blocked after {timeout_s:g} s"
    assert outcome, "the call raised (see the thread's traceback above)"
    return outcome[0]


def test_the_port_file_goes_beside_the_secret_a_link_names(
    linked_secret: tuple[Path, Path],
) -> None:
    link, secret_file = linked_secret
    path = port_file.path_for(str(link), "slurm-42.0")
    assert path == secret_file.parent / "secret.slurm-42.0.port"


@as_root
@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", ["link", "FIFO"])
def test_what_another_user_plants_beside_a_linked_secret_is_not_read(
    linked_secret: tuple[Path, Path], what: str
) -> None:
    """uid nobody plants a link or a FIFO where the port file of a secret reached through a
    link in /tmp used to go, before rank 0 publishes (rank 0 is late): a waiting rank neither
    blocks on it nor takes it for tampering, and gets the port rank 0 publishes."""
    link, secret_file = linked_secret
    secret = secret_file.read_text().strip()
    planted = link.parent / "hora_secret.job.port"
    _plant(what, planted)
    path = port_file.path_for(str(link), "job")
    started = time.time()

    def publish_late() -> None:
        time.sleep(0.5)
        port_file.publish(path, "job", secret, 41234)

    late = threading.Thread(target=publish_late, daemon=True)
    late.start()
    assert _in_thread(lambda: port_file.wait(path, "job", secret, 20.0, started), 20.0) == 41234
    late.join()
    assert os.lstat(planted).st_uid == NOBODY  # left alone
    assert sorted(p.name for p in secret_file.parent.iterdir()) == ["secret", path.name]


@as_root
@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", ["link", "FIFO"])
def test_a_planted_link_or_fifo_is_not_published_and_named_at_the_timeout(
    shared: Path, what: str
) -> None:
    """Read at its own name, a planted link or FIFO is neither followed nor waited on: it
    counts as nothing published, and the timeout names it and its owner."""
    planted = shared / "s.job.port"
    _plant(what, planted)
    secret = new_secret()
    assert _in_thread(lambda: port_file.read(planted, "job", secret, time.time()), 5.0) is None
    kind = "a symbolic link" if what == "link" else "a FIFO"
    with pytest.raises(TimeoutError, match=f"{kind}.*owned by uid {NOBODY}, not by this user"):
        port_file.wait(planted, "job", secret, 0.3, started=time.time())


def test_a_file_others_can_write_or_not_this_users_is_not_published(tmp_path: Path) -> None:
    secret = new_secret()
    path = tmp_path / "s.job.port"
    port_file.publish(path, "job", secret, 1234)
    path.chmod(0o662)
    assert port_file.read(path, "job", secret, time.time()) is None
    with pytest.raises(TimeoutError, match=r"writable by other users \(mode 0662\)"):
        port_file.wait(path, "job", secret, 0.2, started=time.time())
    path.chmod(0o644)  # readable by others does no harm: the port is no secret once it listens
    assert port_file.read(path, "job", secret, time.time()) == 1234
    if os.geteuid() == 0:
        os.chown(path, NOBODY, NOBODY)
        with pytest.raises(TimeoutError, match=f"another user's file .owned by uid {NOBODY}"):
            port_file.wait(path, "job", secret, 0.2, started=time.time())
