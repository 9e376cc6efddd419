"""A segment's file: where its creator makes it, and the proof that another member opened that
very file.

The creator makes the file with no name (``O_TMPFILE``), sizes it, reserves its slots, writes its
header (with the nonce of its name and the creator's pid), and only then gives it its name, a
fresh random one (:func:`hora.common.job.shm_names.new_segment_name`), with ``link``, which
never replaces a file already there. A creator killed at any point leaves either nothing or a
file whose header names it, which the next sweep removes. Where ``O_TMPFILE`` is missing, the
file is made under a temporary name of the same job and linked to its name in the same way.

The creator publishes, through the job's authenticated store, a :class:`SegmentFile`: the name,
and the device and inode of the file it made. Before an attacher maps a byte it opens that name
(never through a link, never waiting on a FIFO) and checks, with ``fstat``, that it is a regular
file of this user, open to nobody else, with the published device, inode and size; the header
and its nonce are checked once mapped. Anything else is refused, naming the file and its owner.

Where other users may rename files in ``/dev/shm`` (no sticky bit: a Kubernetes ``emptyDir``),
the creator first makes a private directory (``0700``) there and the file inside it; the
directory's inode is published and checked too.

This module knows files, names and owners; not what the bytes mean.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pwd
import re
import stat
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from hora.common.job.shm_names import (
    SHM_DIR,
    new_directory_name,
    unsafe_directory,
)
from hora.common.runtime import runtime

logger = logging.getLogger("hora")

# Opening a published file: never through a link, never blocking on a FIFO or a device.
_OPEN = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
_NAME = re.compile(r"hora-[0-9a-f-]+(?:d[0-9a-f]+)?")


class SegmentError(OSError):
    """The segment cannot be made or used here (no ``/dev/shm``, too little space, another
    user's file, a platform without the guarantees the path needs)."""


@dataclass(frozen=True)
class SegmentFile:
    """What a creator publishes of the file it made.

    Attributes:
        directory: the private directory in ``/dev/shm`` that holds the file, or ``""``.
        name: the file's name (in ``directory``, else in ``/dev/shm``).
        device, inode: the file's, as ``fstat`` gave them to its creator.
        directory_inode: the private directory's inode (0 without one).
    """

    directory: str
    name: str
    device: int
    inode: int
    directory_inode: int = 0

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.directory, self.name)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> SegmentFile:
        """Parse what a creator published (the store has checked its signature).

        Raises:
            SegmentError: it is not a segment file's description.
        """
        try:
            fields = json.loads(text)
            found = cls(
                str(fields["directory"]),
                str(fields["name"]),
                int(fields["device"]),
                int(fields["inode"]),
                int(fields["directory_inode"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise SegmentError(f"the published segment is not readable ({exc})") from None
        for part in (found.name, found.directory):
            if part and not _NAME.fullmatch(part):
                raise SegmentError(f"the published segment name {part!r} is not hora's")
        return found


def create(
    secret: str, name: str, total: int, reserved: int, header: bytes
) -> tuple[int, SegmentFile]:
    """Make a segment's file of ``total`` bytes, its first ``reserved`` bytes allocated and
    ``header`` written at its start, then name it ``name`` (of the job with ``secret``).
    Returns its descriptor and description.

    Raises:
        SegmentError: it cannot be made; nothing of it is left behind.
    """
    try:
        problem = unsafe_directory(SHM_DIR)
        folder = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise SegmentError(f"cannot use {SHM_DIR}: {exc.strerror or exc}") from None
    directory, directory_inode, inner = "", 0, -1
    try:
        if problem:
            _tell_private(problem)
            directory = new_directory_name(secret)
            inner, directory_inode = _private_directory(folder, directory)
        try:
            fd = _named_file(inner if inner >= 0 else folder, name, total, reserved, header)
        except BaseException:
            if directory:
                _remove_directory(directory)
            raise
    finally:
        os.close(folder)
        if inner >= 0:
            os.close(inner)
    info = os.fstat(fd)
    return fd, SegmentFile(directory, name, info.st_dev, info.st_ino, directory_inode)


def _tell_private(problem: str) -> None:
    """Say once per process (the runtime remembers) why segments go to private directories."""
    state = runtime()
    if not state.shm_private_told:
        logger.warning(
            "%s; hora keeps its shared-memory segments in private directories (0700) there.",
            problem,
        )
        state.shm_private_told = True


def _private_directory(folder: int, directory: str) -> tuple[int, int]:
    """Make ``directory`` (``0700``) in ``folder`` and open it. Returns the new directory's
    descriptor and inode."""
    try:
        os.mkdir(directory, 0o700, dir_fd=folder)
        inner = os.open(directory, _DIRECTORY, dir_fd=folder)
    except OSError as exc:
        raise SegmentError(
            f"cannot make a private directory in {SHM_DIR}: {exc.strerror or exc}"
        ) from None
    info = os.fstat(inner)
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        os.close(inner)
        raise SegmentError(f"{os.path.join(SHM_DIR, directory)} is {_describe(info)}")
    return inner, info.st_ino


def _named_file(folder: int, name: str, total: int, reserved: int, header: bytes) -> int:
    """A new file in ``folder``, sized, reserved and with its header, then linked to ``name``."""
    temporary = ""
    try:
        fd = os.open(".", os.O_TMPFILE | os.O_RDWR, 0o600, dir_fd=folder)
    except (OSError, AttributeError):
        temporary = name + "-new"
        fd = _exclusive(folder, temporary)
    try:
        _fill(fd, total, reserved, header)
        if temporary:
            os.link(temporary, name, src_dir_fd=folder, dst_dir_fd=folder, follow_symlinks=False)
        else:
            _link_anonymous(fd, folder, name)
    except BaseException as exc:
        os.close(fd)
        if isinstance(exc, OSError) and exc.errno == errno.EEXIST:
            raise SegmentError(f"{os.path.join(SHM_DIR, name)} exists already") from None
        raise
    finally:
        if temporary:
            _unlink_quietly(folder, temporary)
    return fd


def _exclusive(folder: int, name: str) -> int:
    try:
        return os.open(
            name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=folder
        )
    except OSError as exc:
        raise SegmentError(f"cannot create {os.path.join(SHM_DIR, name)}: {exc.strerror}") from None


def _link_anonymous(fd: int, folder: int, name: str) -> None:
    try:
        os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=folder, follow_symlinks=True)
    except FileNotFoundError:
        raise SegmentError("cannot name a segment: /proc is not mounted") from None


def _fill(fd: int, total: int, reserved: int, header: bytes) -> None:
    """Size the new file, reserve its first ``reserved`` bytes, write ``header``."""
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, total)
        os.posix_fallocate(fd, 0, reserved)
        os.pwrite(fd, header, 0)
    except OverflowError:
        raise SegmentError(f"{total} bytes is more than a file can hold") from None
    except OSError as exc:
        raise SegmentError(_space_problem(reserved, exc)) from None


def room_problem(reserved: int) -> str | None:
    """Why ``/dev/shm`` cannot hold ``reserved`` bytes whatever else is in it, or ``None``."""
    try:
        stats = os.statvfs(SHM_DIR)
    except OSError:
        return None
    whole = stats.f_blocks * stats.f_frsize
    if reserved <= whole:
        return None
    return (
        f"{SHM_DIR} has no room for {reserved / 2**20:.1f} MiB: it holds "
        f"{whole / 2**20:.0f} MiB in all. Lower HORA_SHM_SLOT_BYTES (a host's ranks of a process "
        "set map it times their number) or make /dev/shm larger (docker run --shm-size, a tmpfs "
        "size= option)"
    )


def _space_problem(reserved: int, exc: OSError) -> str:
    if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
        free = ""
        try:
            stats = os.statvfs(SHM_DIR)
            free = f" ({stats.f_bavail * stats.f_frsize / 2**20:.0f} MiB free)"
        except OSError:
            pass
        return (
            f"{SHM_DIR} has no room for {reserved / 2**20:.1f} MiB{free}: make /dev/shm larger "
            "(docker run --shm-size, a tmpfs size= option) or lower HORA_SHM_SLOT_BYTES"
        )
    return f"cannot reserve {reserved} bytes in {SHM_DIR}: {exc.strerror or exc}"


def open_published(found: SegmentFile, total: int) -> int:
    """Open the file ``found`` describes, read and write, after proving it is the one its
    creator made and ``total`` bytes long.

    Raises:
        SegmentError: it is missing (another host, another ``/dev/shm``), or it is another file
            (another user's, renamed into place, a link, a FIFO): the message names it and its
            owner.
    """
    with _folder_of(found) as where:
        try:
            fd = os.open(found.name, _OPEN, dir_fd=where)
        except OSError as exc:
            raise SegmentError(_refusal(where, found, exc)) from None
    info = os.fstat(fd)
    expected = (found.device, found.inode)
    why = ""
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        why = f"it is {_describe(info)}"
    elif (info.st_dev, info.st_ino) != expected:
        why = f"it is another file (inode {info.st_ino}, not {found.inode})"
    elif info.st_size != total:
        why = f"it has {info.st_size} bytes, not the {total} of the expected layout"
    if why:
        os.close(fd)
        raise SegmentError(f"{found.path} is not the segment its creator made: {why}{_TAMPERED}")
    return fd


@contextlib.contextmanager
def _folder_of(found: SegmentFile) -> Iterator[int]:
    """The open directory that holds ``found``'s name: ``/dev/shm``, or the private directory
    in it, proven to be its creator's.

    Raises:
        SegmentError: it cannot be opened, or the private directory is another.
    """
    try:
        folder = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise SegmentError(f"cannot open {SHM_DIR}: {exc.strerror or exc}") from None
    inner = -1
    try:
        if found.directory:
            inner = _open_directory(folder, found)
        yield inner if inner >= 0 else folder
    finally:
        os.close(folder)
        if inner >= 0:
            os.close(inner)


_TAMPERED = ". Another user may be renaming files in /dev/shm (give it the sticky bit: chmod +t)"


def _open_directory(folder: int, found: SegmentFile) -> int:
    """Open ``found``'s private directory in ``folder`` and prove it is its creator's."""
    where = os.path.join(SHM_DIR, found.directory)
    try:
        inner = os.open(found.directory, _DIRECTORY, dir_fd=folder)
    except OSError as exc:
        raise SegmentError(f"cannot open {where}: {exc.strerror or exc}") from None
    info = os.fstat(inner)
    if info.st_uid != os.geteuid() or info.st_mode & 0o077 or info.st_ino != found.directory_inode:
        os.close(inner)
        raise SegmentError(
            f"{where} is not the directory its creator made: it is {_describe(info)}{_TAMPERED}"
        )
    return inner


def _refusal(folder: int, found: SegmentFile, exc: OSError) -> str:
    """Why ``found`` could not be opened, naming what is there instead."""
    try:
        info = os.stat(found.name, dir_fd=folder, follow_symlinks=False)
    except OSError:
        return f"cannot open {found.path}: {exc.strerror or exc}"
    return f"{found.path} is not the segment its creator made: it is {_describe(info)}{_TAMPERED}"


def _describe(info: os.stat_result) -> str:
    """``a FIFO of nobody (uid 65534), mode 644``."""
    kinds = {
        stat.S_IFREG: "a file",
        stat.S_IFDIR: "a directory",
        stat.S_IFLNK: "a symbolic link",
        stat.S_IFIFO: "a FIFO",
        stat.S_IFSOCK: "a socket",
    }
    kind = kinds.get(stat.S_IFMT(info.st_mode), "a device")
    return f"{kind} of {owner(info.st_uid)}, mode {stat.S_IMODE(info.st_mode):o}"


def owner(uid: int) -> str:
    """``nobody (uid 65534)``, or ``uid 1234`` for a uid without a name."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def remove(found: SegmentFile) -> None:
    """Remove ``found``'s name (and its private directory), if that name is still its file."""
    try:
        with _folder_of(found) as where:
            try:
                info = os.stat(found.name, dir_fd=where, follow_symlinks=False)
            except OSError:
                info = None
            if info is not None and (info.st_dev, info.st_ino) == (found.device, found.inode):
                _unlink_quietly(where, found.name)
    except SegmentError:
        return  # /dev/shm or the private directory is not there, or not its creator's
    if found.directory:
        _remove_directory(found.directory)


def _remove_directory(directory: str) -> None:
    try:
        os.rmdir(os.path.join(SHM_DIR, directory))
    except OSError:
        pass


def _unlink_quietly(folder: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=folder)
    except OSError:
        pass
