"""The random store port rank 0 publishes beside the job's secret file."""

from __future__ import annotations

import json
import time
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
