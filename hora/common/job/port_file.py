"""A random store port, published next to the job's secret file.

Under launchers that hand hora no channel of their own (``srun``, ``mpirun`` without
``mpi4py``), the other ranks must find rank 0's store without being told. Without help, hora
derives the port from the job id; anyone can compute it and take it first. When the job has a
secret file (``HORA_SECRET_FILE``, on a file system every rank sees), rank 0 instead listens on a
port the OS picks and writes it beside the secret file, signed with the secret and bound to the
job id; the other ranks wait for that file. Nobody without the secret can write a port the ranks
accept, and nobody can know the port before the store listens on it.

The file is ``<secret file>.<job id>.port``, written atomically (a new file under an unguessable
name, renamed over it: :mod:`hora.common.safe_files`, so a link planted at either name is
replaced, never written through), readable by its owner only, and removed when rank 0's process
exits. The secret file's directory is one only its owner can write
(:func:`hora.common.job.topology.job_secret` checks), so nobody else can plant files there.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import time
from pathlib import Path

from hora.common import safe_files
from hora.common.job.store import TAG_BYTES, sign, verify

# How often a waiting rank looks for the file.
POLL_S = 0.05
# A file written this long before the reading process started belongs to an earlier job with
# the same id (its rank 0 crashed before removing it).
STALE_S = 60.0


def path_for(secret_file: str, job_id: str) -> Path:
    """Where the port of job ``job_id`` is published, beside ``secret_file``."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", job_id)
    return Path(os.path.expanduser(secret_file + f".{safe}.port"))


def _key(job_id: str) -> str:
    return f"port-file/{job_id}"


def publish(path: Path, job_id: str, secret: str, port: int) -> None:
    """Write ``port`` for ``job_id`` to ``path`` (atomically, mode 0600); removed at exit."""
    body = json.dumps({"job_id": job_id, "port": port, "written": time.time()}).encode()
    safe_files.write(path, sign(secret, body, key=_key(job_id)), mode=0o600, durable=True)
    atexit.register(_remove, path, port)


def _remove(path: Path, port: int) -> None:
    """Remove the file at exit if it still names this process's port."""
    try:
        if json.loads(path.read_bytes()[TAG_BYTES:]).get("port") == port:
            path.unlink()
    except (OSError, ValueError):
        pass


def read(path: Path, job_id: str, secret: str, started: float) -> int | None:
    """The port published for ``job_id``, or ``None`` while there is none (or only a stale one).

    Args:
        started: when the reading process started (``time.time()`` scale).

    Raises:
        AuthenticationError: the file was not written with this job's secret for this job.
    """
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        return None
    body = json.loads(verify(secret, blob, f"port file {str(path)!r}", _key(job_id)))
    if body.get("job_id") != job_id or float(body["written"]) < started - STALE_S:
        return None
    return int(body["port"])


def wait(path: Path, job_id: str, secret: str, timeout_s: float, started: float) -> int:
    """Wait up to ``timeout_s`` for rank 0 to publish the port.

    Raises:
        TimeoutError: nothing was published in time.
        AuthenticationError: the file was not written with this job's secret.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            port = read(path, job_id, secret, started)
        except ValueError:  # a file caught half-copied by a file system that is not atomic
            port = None
        if port is not None:
            return port
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"no store port was published in {path} within {timeout_s:g} s: has rank 0 "
                "started, and do all ranks see the same HORA_SECRET_FILE on a shared file "
                "system? Raise HORA_START_TIMEOUT if start-up is slow."
            )
        time.sleep(POLL_S)
