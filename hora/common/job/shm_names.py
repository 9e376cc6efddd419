"""The names of a job's shared-memory segments, and the removal of what a killed process left.

A segment (see :mod:`hora.common.transport.shm_segment`) has a name in ``/dev/shm`` only between
its creation and the moment every member of its group has mapped it; a process killed in that
window leaves the name behind. Every name starts with a prefix derived from the job secret
(:func:`job_prefix`), so that the launcher, which holds the secret, can remove what its job left
when the job ends (:func:`sweep_job`); the rest of the name is a fresh random nonce
(:func:`new_segment_name`), so that nobody can know a name before the segment exists, not even
for a job that reuses its secret (``HORA_SECRET_FILE`` under ``srun`` or ``mpirun``). The next
segment made on the host removes any of this user's names whose creator is gone (:func:`sweep`).

Where ``/dev/shm`` can be written by other users and lacks the sticky bit (a Kubernetes
``emptyDir`` mounted there), anyone may rename or replace any file in it; segments then live in
a private directory (``0700``) of their own, under the same prefix (see
:func:`unsafe_directory`).

Sweeps are written for a directory that others can write: they look at an entry with ``lstat``
first, skip anything that is not this user's regular file or directory (a FIFO, a link, a
socket: never opened), open files with ``O_NONBLOCK | O_NOFOLLOW`` and check that the file
opened is the one looked at. A file whose header says hora's is removed once its creator has
exited; a file of this user without a header (made by a version that wrote the header after
naming the file, and killed in between) once it is :data:`GRACE_S` old.

This module uses the standard library only: ``horarun`` imports it without torch.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import struct
import time

SHM_DIR = "/dev/shm"
# The segment's layout, as far as this module reads it: a header line (magic, version, members,
# slot bytes, arena bytes, then the nonce of its name), then one line per member whose second
# 32-bit word is its pid; member 0 made the segment.
LINE = 64
MAGIC = 0x686F7261  # "hora"
VERSION = 3
CREATOR_OFFSET = LINE + 4
HEADER_FORMAT = "<IIIQQ16s"
NONCE_BYTES = 16
# How old a headerless file of this user under a hora name must be before a sweep removes it: a
# creator never leaves one for longer than it takes to write 64 bytes.
GRACE_S = 60.0
# Opening an entry for a look: never through a link, never waiting for a FIFO's writer.
_LOOK = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_NOCTTY", 0)


def job_prefix(secret: str) -> str:
    """The start of the names of every segment of the job with ``secret``."""
    return "hora-" + hmac.new(secret.encode(), b"shm", hashlib.sha256).hexdigest()[:16] + "-"


def new_segment_name(secret: str) -> str:
    """A name for a new segment of the job with ``secret``: its prefix and a random nonce, so
    that no two segments, in this job or another with the same secret, ever share a name."""
    return job_prefix(secret) + secrets.token_hex(NONCE_BYTES)


def nonce_of(name: str) -> bytes:
    """The nonce a segment named ``name`` holds in its header."""
    return bytes.fromhex(name[-2 * NONCE_BYTES :])


def new_directory_name(secret: str) -> str:
    """A name for a private directory of the job with ``secret`` (see :func:`unsafe_directory`)."""
    return job_prefix(secret) + "d" + secrets.token_hex(8)


def unsafe_directory(path: str = SHM_DIR) -> str | None:
    """Why segments must not be named directly in ``path``, or ``None`` when they may.

    A directory that users other than this one may write, without the sticky bit, lets any of
    them rename, replace or remove every file in it.
    """
    info = os.stat(path)
    mode = info.st_mode
    others_write = mode & 0o022 or (info.st_uid != os.geteuid() and mode & 0o200)
    if mode & stat.S_ISVTX or not others_write:
        return None
    return (
        f"{path} (mode {stat.S_IMODE(mode):o}) can be written by other users and lacks the "
        "sticky bit, so any of them could rename or replace a file in it"
    )


def sweep(prefix: str = "hora-", directory: str = SHM_DIR) -> list[str]:
    """Remove this user's leftovers under ``prefix`` in ``directory``: segments whose creator has
    exited, headerless files past :data:`GRACE_S`, and private directories left empty. Returns
    the paths removed."""
    try:
        folder = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return []
    try:
        removed: list[str] = []
        for name in _names(folder):
            if name.startswith(prefix):
                removed += _sweep_entry(folder, name, os.path.join(directory, name))
        return removed
    finally:
        os.close(folder)


def sweep_job(secret: str) -> list[str]:
    """Remove what the job with ``secret`` left in this machine's ``/dev/shm`` (its processes
    have exited)."""
    return sweep(job_prefix(secret))


def _names(folder: int) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _sweep_entry(folder: int, name: str, shown: str) -> list[str]:
    """Remove ``name`` in ``folder`` if it is a leftover of this user's (a private directory:
    its leftovers, then itself once empty and old)."""
    try:
        info = os.stat(name, dir_fd=folder, follow_symlinks=False)
    except OSError:
        return []
    if info.st_uid != os.geteuid():
        return []
    if stat.S_ISDIR(info.st_mode):
        return _sweep_directory(folder, name, shown, info)
    if stat.S_ISREG(info.st_mode) and _leftover(folder, name, info):
        try:
            os.unlink(name, dir_fd=folder)
        except OSError:
            return []
        return [shown]
    return []


def _sweep_directory(folder: int, name: str, shown: str, info: os.stat_result) -> list[str]:
    try:
        inner = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=folder)
    except OSError:
        return []
    try:
        found = os.fstat(inner)
        if (found.st_dev, found.st_ino) != (info.st_dev, info.st_ino) or found.st_mode & 0o077:
            return []
        removed: list[str] = []
        for entry in _names(inner):
            removed += _sweep_entry(inner, entry, os.path.join(shown, entry))
    finally:
        os.close(inner)
    if time.time() - info.st_mtime > GRACE_S or removed:
        try:
            os.rmdir(name, dir_fd=folder)
        except OSError:
            return removed  # not empty: a job still makes or uses it
        removed.append(shown)
    return removed


def _leftover(folder: int, name: str, info: os.stat_result) -> bool:
    """Whether this user's regular file ``name`` is a segment whose creator is gone, or a
    headerless file past the grace period."""
    try:
        fd = os.open(name, _LOOK, dir_fd=folder)
    except OSError:
        return False
    try:
        found = os.fstat(fd)
        if (found.st_dev, found.st_ino) != (info.st_dev, info.st_ino):
            return False  # replaced since it was looked at
        header = os.pread(fd, LINE * 2, 0)
    except OSError:
        return False
    finally:
        os.close(fd)
    if len(header) < LINE * 2 or struct.unpack_from("<I", header, 0)[0] != MAGIC:
        return time.time() - info.st_mtime > GRACE_S
    (creator,) = struct.unpack_from("<i", header, CREATOR_OFFSET)
    return creator <= 0 or not _alive(creator)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def leftover(path: str) -> bool:
    """Whether the file at ``path`` is this user's and would be removed by a sweep now."""
    folder_path, name = os.path.split(path)
    try:
        folder = os.open(folder_path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        info = os.stat(name, dir_fd=folder, follow_symlinks=False)
        if info.st_uid != os.geteuid() or not stat.S_ISREG(info.st_mode):
            return False
        return _leftover(folder, name, info)
    except OSError:
        return False
    finally:
        os.close(folder)
