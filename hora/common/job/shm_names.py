"""The names of a job's shared-memory segments, and the removal of those a killed process left.

A segment (see :mod:`hora.common.transport.shm_segment`) has a name in ``/dev/shm`` only between
its creation and the moment every member of its group has mapped it; a process killed in that
window leaves the name behind. Names start with a prefix derived from the job secret, so that
nobody without it can guess them, and the launcher, which holds the secret, removes what its
job left when the job ends (:func:`sweep_job`); the next segment made on the host removes any
name whose creator is gone (:func:`sweep`).

This module uses the standard library only: ``horarun`` imports it without torch.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

SHM_DIR = "/dev/shm"
# The segment's layout, as far as this module reads it: a header line (magic, version), then
# one line per member whose second 32-bit word is its pid; member 0 made the segment.
LINE = 64
MAGIC = 0x686F7261  # "hora"
VERSION = 2
CREATOR_OFFSET = LINE + 4


def job_prefix(secret: str) -> str:
    """The start of the names of every segment of the job with ``secret``."""
    return "hora-" + hmac.new(secret.encode(), b"shm", hashlib.sha256).hexdigest()[:16] + "-"


def segment_name(secret: str, scope: str, group: int) -> str:
    """The name of a local group's segment in ``/dev/shm``: unguessable without the secret."""
    digest = hmac.new(secret.encode(), f"shm:{scope}:{group}".encode(), hashlib.sha256)
    return job_prefix(secret) + digest.hexdigest()[:32]


def stale(path: str) -> bool:
    """Whether ``path`` is this user's hora segment and the member that made it is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid() or info.st_size < LINE * 2:
            return False
        header = os.pread(fd, LINE * 2, 0)
    except OSError:
        return False
    finally:
        os.close(fd)
    magic, version = struct.unpack_from("<II", header, 0)
    if (magic, version) != (MAGIC, VERSION):
        return False
    (creator,) = struct.unpack_from("<i", header, CREATOR_OFFSET)
    if creator <= 0:
        return True  # killed before it wrote its pid
    try:
        os.kill(creator, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def sweep(prefix: str = "hora-") -> list[str]:
    """Remove this user's segments under ``prefix`` whose creator has exited. Returns the paths
    removed."""
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(SHM_DIR, name)
        if stale(path):
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            removed.append(path)
    return removed


def sweep_job(secret: str) -> list[str]:
    """Remove what the job with ``secret`` left in this machine's ``/dev/shm`` (its processes
    have exited)."""
    return sweep(job_prefix(secret))
