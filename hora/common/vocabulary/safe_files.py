"""Files hora creates: never written through a link someone planted, private unless asked.

hora writes files in directories it did not make: a timeline in ``/tmp``, ``--output-filename``
logs, metrics, autotune logs, the store's port file beside the secret file, the outputs of
``hora timeline`` and ``hora bench``. Opening such a path by name writes to whatever is there:
in a directory another user can write, that user can plant a symbolic link at the name and make
the job's user overwrite a file of the attacker's choosing. So every file is created under a
fresh, unguessable name in the target directory (``mkstemp``: ``O_CREAT | O_EXCL``, which never
follows a link), given its mode, and renamed onto the name asked for. The rename replaces
whatever was planted there instead of writing through it; in a directory with the sticky bit
(``/tmp``) the kernel refuses to replace another user's file, and :class:`UnsafePathError` says
so. The directory itself must not be another user's, nor reached through another user's link.

Files are created with mode ``0600`` whatever the umask, since they hold the job's data;
``HORA_FILE_MODE`` chooses another mode. Directories hora creates get ``0700``.

This module knows paths, modes and owners; not what the files hold.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Literal, overload

from hora.common.vocabulary import settings_table as table
from hora.common.vocabulary.config import read

# Directories hora creates for its files.
DIRECTORY_MODE = 0o700


class UnsafePathError(OSError):
    """hora refused to write a file because another user controls its name or its directory."""


def file_mode() -> int:
    """The mode of the files hora creates: ``HORA_FILE_MODE`` (octal), ``0600`` by default.

    Raises:
        SettingError: ``HORA_FILE_MODE`` is not an octal mode.
    """
    return read(table.FILE_MODE)


def _trusted_owner(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def check_directory(directory: str | os.PathLike[str]) -> None:
    """Refuse a directory that another user owns, or that is reached through another user's
    symbolic link: files created in it could be moved or replaced by that user.

    Raises:
        UnsafePathError: the directory or a link on the way belongs to another user.
        OSError: it does not exist or cannot be examined.
    """
    path = Path(os.path.abspath(directory))
    for part in [*reversed(path.parents), path]:
        info = os.lstat(part)
        if stat.S_ISLNK(info.st_mode) and not _trusted_owner(info.st_uid):
            raise UnsafePathError(
                f"{part} is a symbolic link that belongs to uid {info.st_uid}, not to this user "
                f"(uid {os.geteuid()}): hora does not write through it. Choose a path in a "
                "directory of your own."
            )
    info = os.stat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))
    if not _trusted_owner(info.st_uid):
        raise UnsafePathError(
            f"the directory {path} belongs to uid {info.st_uid}, not to this user (uid "
            f"{os.geteuid()}), who can move or replace what hora writes there. Choose a "
            "directory of your own."
        )


def make_directories(directory: str | os.PathLike[str]) -> Path:
    """Create ``directory`` and its missing parents (the new ones mode ``0700``), and check it
    with :func:`check_directory`.

    Raises:
        UnsafePathError: it, or a link on the way, belongs to another user.
        OSError: it cannot be created.
    """
    path = Path(os.path.abspath(os.path.expanduser(directory)))
    chain = [*reversed(path.parents), path]
    missing = [p for p in chain if not os.path.lexists(p)]
    if len(missing) < len(chain):
        check_directory(chain[len(chain) - len(missing) - 1])  # the deepest that exists
    for part in missing:
        # Checked one level at a time: a link planted meanwhile is refused before anything
        # is created through it.
        with contextlib.suppress(FileExistsError):
            os.mkdir(part, DIRECTORY_MODE)
        check_directory(part)
    return path


@overload
def create(
    path: str | os.PathLike[str],
    *,
    binary: Literal[False] = False,
    mode: int | None = None,
    buffering: int = -1,
) -> IO[str]: ...
@overload
def create(
    path: str | os.PathLike[str],
    *,
    binary: Literal[True],
    mode: int | None = None,
    buffering: int = -1,
) -> IO[bytes]: ...
def create(
    path: str | os.PathLike[str],
    *,
    binary: bool = False,
    mode: int | None = None,
    buffering: int = -1,
) -> IO[str] | IO[bytes]:
    """A new, empty file at ``path``, open for writing, that replaced whatever had the name.

    For files written while the job runs (timelines, logs, event files): the name points at the
    new file at once, so readers can follow it as it grows. Missing directories are created.

    Args:
        path: where the file goes.
        binary: open it in binary mode (text, UTF-8, otherwise).
        mode: its permission bits (default :func:`file_mode`).
        buffering: as for :func:`open`.

    Raises:
        UnsafePathError: another user's file holds the name in a sticky directory, or the
            directory is another user's.
        OSError: the file cannot be created.
    """
    descriptor, temporary = _temporary_beside(path, mode)
    try:
        _rename_onto(temporary, path)
    except BaseException:
        os.close(descriptor)
        raise
    if binary:
        return os.fdopen(descriptor, "wb", buffering=buffering)
    return os.fdopen(descriptor, "w", encoding="utf-8", buffering=buffering)


def write(
    path: str | os.PathLike[str],
    data: str | bytes,
    *,
    mode: int | None = None,
    durable: bool = False,
) -> None:
    """Write ``data`` to ``path`` atomically: readers see the old file or the whole new one.

    Args:
        path: where the file goes (missing directories are created).
        data: its content (text is written as UTF-8).
        mode: its permission bits (default :func:`file_mode`).
        durable: ``fsync`` the data before the rename.

    Raises:
        UnsafePathError: as for :func:`create`.
        OSError: the file cannot be written; nothing at ``path`` changed.
    """
    with replacing(path, mode=mode, durable=durable) as out:
        out.write(data.encode() if isinstance(data, str) else data)


@contextlib.contextmanager
def replacing(
    path: str | os.PathLike[str], *, mode: int | None = None, durable: bool = False
) -> Iterator[IO[bytes]]:
    """A binary file to fill; on a normal exit it atomically replaces ``path``, on an exception
    it is removed and ``path`` is left as it was (:func:`write`, for content built in pieces).

    Raises:
        UnsafePathError: as for :func:`create`.
    """
    descriptor, temporary = _temporary_beside(path, mode)
    try:
        with os.fdopen(descriptor, "wb") as out:
            yield out
            out.flush()
            if durable:
                os.fsync(out.fileno())
        _rename_onto(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _temporary_beside(path: str | os.PathLike[str], mode: int | None) -> tuple[int, str]:
    """A new file with an unguessable name in ``path``'s directory, mode set, and its name."""
    target = Path(os.path.expanduser(path))
    try:
        directory = make_directories(target.parent)
        descriptor, temporary = tempfile.mkstemp(
            dir=directory, prefix=f".{target.name}.", suffix=".tmp"
        )
    except UnsafePathError:
        raise
    except OSError as exc:
        # Named for the file asked for, not for the temporary one or a directory on the way.
        raise type(exc)(exc.errno, exc.strerror or str(exc), str(target)) from exc
    try:
        os.fchmod(descriptor, file_mode() if mode is None else mode)
    except BaseException:
        os.close(descriptor)
        os.unlink(temporary)
        raise
    return descriptor, temporary


def _rename_onto(temporary: str, path: str | os.PathLike[str]) -> None:
    target = os.path.expanduser(path)
    try:
        os.replace(temporary, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise _rename_refused(target, exc) from exc


def _rename_refused(target: str, exc: OSError) -> OSError:
    """Why a new file could not take its name, in the user's terms."""
    try:
        owner = os.lstat(target).st_uid
    except OSError:
        return exc
    if isinstance(exc, PermissionError) and not _trusted_owner(owner):
        return UnsafePathError(
            f"cannot write {target}: a file of that name that belongs to uid {owner} is already "
            "there, in a directory where only its owner may replace it (such as /tmp). Someone "
            "may have planted it: write to a directory only you can write, e.g. under your home "
            "directory."
        )
    return exc


def owned_by_this_user(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a regular file (not a link) of this user: for files hora reads back
    from a directory others may write (a timeline's rank files)."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()
