"""A random store port, published next to the job's secret file.

Under launchers that hand hora no channel of their own (``srun``, ``mpirun`` without
``mpi4py``), the other ranks must find rank 0's store without being told. Without help, hora
derives the port from the job id; anyone can compute it and take it first. When the job has a
secret file (``HORA_SECRET_FILE``, on a file system every rank sees), rank 0 instead listens on a
port the OS picks and writes it beside the secret file, signed with the secret and bound to the
job id; the other ranks wait for that file. Nobody without the secret can write a port the ranks
accept, and nobody can know the port before the store listens on it.

The file is ``<secret file>.<job id>.port`` beside the secret file itself, with every symbolic
link on the way resolved: ``HORA_SECRET_FILE`` may be a link in a directory others can write
(``/tmp``), and the port file must not land there. The resolved secret file's directory is one
only its owner can write (:func:`hora.common.job.topology.job_secret` checks), so nobody else
can plant files there. It is written atomically (a new file under an unguessable name, renamed
over it: :mod:`hora.common.vocabulary.safe_files`, so a link planted at either name is replaced, never
written through), readable by its owner only, and removed when rank 0's process exits. Reading
it never follows a link nor waits on a FIFO: anything at the name but a regular file of this
user that no one else can write counts as "not published yet".
"""

from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import re
import stat
import time
from pathlib import Path

from hora.common.job.store import TAG_BYTES, sign, verify
from hora.common.vocabulary import safe_files

logger = logging.getLogger("hora")

# How often a waiting rank looks for the file.
POLL_S = 0.05
# A file written this long before the reading process started belongs to an earlier job with
# the same id (its rank 0 crashed before removing it).
STALE_S = 60.0
# More than a port file ever holds (a signature and a short JSON object).
MAX_BYTES = 4096


class _NotPublished(Exception):
    """Something other than a regular file of this user, that no one else can write, holds the
    port file's name."""


def path_for(secret_file: str, job_id: str) -> Path:
    """Where the port of job ``job_id`` is published: beside the file ``secret_file`` names,
    once every symbolic link is resolved (never beside a link in a directory others write)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", job_id)
    return Path(os.path.realpath(os.path.expanduser(secret_file)) + f".{safe}.port")


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
        if json.loads(_read_own(path)[TAG_BYTES:]).get("port") == port:
            path.unlink()
    except (OSError, ValueError, _NotPublished):
        pass


def _read_own(path: Path) -> bytes:
    """The content of ``path``, a regular file of this user that no one else can write (what
    others could have written cannot be trusted, even signed: they could replay it). Opened
    without following a link and without blocking (a FIFO planted at the name would otherwise
    hold the reader until someone writes to it); checked on the open file.

    Raises:
        FileNotFoundError: nothing has the name.
        _NotPublished: something else has it; the message says what, and whose.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        descriptor = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise _NotPublished(_what_is_at(path, exc)) from None
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
            raise _NotPublished(_what_is_at(path, None, info))
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_BYTES:
            chunk = os.read(descriptor, MAX_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(descriptor)


def _what_is_at(path: Path, error: OSError | None, info: os.stat_result | None = None) -> str:
    """Why the thing at ``path`` is not taken for a published port, naming its owner."""
    reason = error.strerror if error is not None else "gone"
    if info is None:
        try:
            info = os.lstat(path)
        except OSError:
            return f"{path} cannot be opened ({reason}); hora ignores it"
    owner = f"owned by uid {info.st_uid}"
    if info.st_uid != os.geteuid():
        owner += f", not by this user (uid {os.geteuid()})"
    if stat.S_ISLNK(info.st_mode) or (error is not None and error.errno == errno.ELOOP):
        kind = "a symbolic link, which hora does not follow"
    elif stat.S_ISFIFO(info.st_mode):
        kind = "a FIFO, not a regular file"
    elif not stat.S_ISREG(info.st_mode):
        kind = "not a regular file"
    elif info.st_uid != os.geteuid():
        kind = "another user's file"
    elif info.st_mode & 0o022:
        kind = f"writable by other users (mode {stat.S_IMODE(info.st_mode):04o})"
    else:
        kind = f"unreadable ({reason})"
    return f"{path} is {kind} ({owner}); hora ignores it"


def read(path: Path, job_id: str, secret: str, started: float) -> int | None:
    """The port published for ``job_id``, or ``None`` while there is none (or only a stale one).

    Anything at ``path`` but a regular file of this user that no one else can write (a link, a
    FIFO, another user's file) counts as nothing published; :func:`wait` names it if nothing else comes.

    Args:
        started: when the reading process started (``time.time()`` scale).

    Raises:
        AuthenticationError: the file was not written with this job's secret for this job.
    """
    try:
        return _port_in(path, job_id, secret, started)
    except _NotPublished as what:
        logger.debug("%s", what)
        return None


def _port_in(path: Path, job_id: str, secret: str, started: float) -> int | None:
    """:func:`read`, but :class:`_NotPublished` when something else holds the name."""
    try:
        blob = _read_own(path)
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
    ignored = ""  # what holds the name instead of a port file, as last seen
    while True:
        seen, ignored = ignored, ""
        try:
            port = _port_in(path, job_id, secret, started)
        except ValueError:  # a file caught half-copied by a file system that is not atomic
            port = None
        except _NotPublished as what:
            port, ignored = None, str(what)
            if ignored != seen:
                logger.debug("%s", ignored)
        if port is not None:
            return port
        if time.monotonic() > deadline:
            found = f" ({ignored})" if ignored else ""
            raise TimeoutError(
                f"no store port was published in {path} within {timeout_s:g} s{found}: has "
                "rank 0 started, and do all ranks see the same HORA_SECRET_FILE on a shared "
                "file system? Raise HORA_START_TIMEOUT if start-up is slow."
            )
        time.sleep(POLL_S)
