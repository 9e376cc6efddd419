"""Durable commits: an elastic state's last commit, kept in one file that survives every worker.

A :class:`CommitDirectory` holds at most one commit, ``commit.pt``: a ``torch.save`` of a
record with the format's name and version, the commit's number, each handler's snapshot
(``state_dict``s) and the plain values. Rank 0 writes it at every commit, atomically: into a
temporary file of the same directory, ``flush`` and ``os.fsync``, ``os.replace`` onto
``commit.pt``, then ``os.fsync`` of the directory. A crash at any point leaves the previous
``commit.pt`` or the new one, whole; a temporary file it leaves behind is never read.

Reading verifies the zip archive's checksums first, then loads with
``torch.load(weights_only=True)``, and only when the record holds other Python objects (an
``ObjectState`` value of the user's own class) with full unpickling. Both read and write refuse a
directory (or file) that another user could have written: a pickle can run code when loaded.

This module knows files and records, not states, handlers or ranks (:mod:`.state` decides who
writes and what).
"""

from __future__ import annotations

import errno
import logging
import os
import pickle
import stat
import tempfile
import zipfile
from pathlib import Path
from typing import Any, TypedDict, cast

import torch

from hora.common.vocabulary import safe_files

logger = logging.getLogger("hora")

FILE_NAME = "commit.pt"
TEMP_PREFIX = ".commit.pt."
TEMP_SUFFIX = ".tmp"
FORMAT = "hora.elastic.commit"
VERSION = 1

# Directory fsync is not supported everywhere (some network file systems): these errors mean
# "not supported", not "failed".
_UNSUPPORTED = {errno.EINVAL, errno.ENOTSUP, errno.EBADF}

_WHAT_TO_DO_DAMAGED = (
    "Move the file away (or put back a good copy) and start the job again; without it the job "
    "starts from scratch."
)


class DurableCommitError(RuntimeError):
    """A durable commit could not be written or read; the message says which file and why."""


class CommitRecord(TypedDict):
    """What a durable commit's file holds (:func:`make_record` makes one).

    Attributes:
        format: ``"hora.elastic.commit"``.
        version: the format's version (1).
        commit: how many commits the job had made.
        handlers: each model's, optimizer's and sampler's snapshot (a ``state_dict``), by
            attribute name.
        values: the plain attributes, such as ``epoch`` and ``batch``.
    """

    format: str
    version: int
    commit: int
    handlers: dict[str, Any]
    values: dict[str, Any]


def _check_owned(path: Path, st: os.stat_result, what: str) -> None:
    """Raise unless ``path`` belongs to this process's user and no one else may write it."""
    problem = ""
    if st.st_uid != os.getuid():
        problem = f"is owned by uid {st.st_uid}, not by this job's user (uid {os.getuid()})"
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = f"is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    if problem:
        raise DurableCommitError(
            f"the elastic commit {what} {path} {problem}. A durable commit is loaded with "
            "pickle, which can run code, so only this job's user may be able to write there: "
            f"`chmod go-w {path}` if it is yours, or choose a directory of your own."
        )


class CommitDirectory:
    """The directory of one state's durable commit.

    Args:
        path: the directory; created (mode ``0o700``) when it does not exist. On a multi-host
            job it must be on a file system every host shares.

    Attributes:
        path: the directory.
        file: the commit's file, ``path / "commit.pt"``.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).expanduser().absolute()
        self.file = self.path / FILE_NAME

    def prepare(self) -> None:
        """Create the directory if needed, and check that only this user can write it.

        Raises:
            DurableCommitError: it cannot be created, is not a directory, or is not trusted.
        """
        try:
            # Missing directories are made mode 0700, never through another user's link.
            safe_files.make_directories(self.path)
            st = os.stat(self.path)
        except safe_files.UnsafePathError as exc:
            raise DurableCommitError(
                f"{exc} A durable commit is loaded with pickle, which can run code, so only this "
                "job's user may be able to write where it lies."
            ) from exc
        except OSError as exc:
            raise DurableCommitError(
                f"cannot create the elastic commit directory {self.path}: {exc}. Check the "
                "path and its permissions."
            ) from exc
        if not stat.S_ISDIR(st.st_mode):
            raise DurableCommitError(
                f"the elastic commit directory {self.path} is not a directory; give the path "
                "of a directory (it is created if missing)."
            )
        _check_owned(self.path, st, "directory")

    def write(self, record: CommitRecord) -> None:
        """Replace the commit with ``record``, atomically and durably.

        Raises:
            DurableCommitError: writing failed; the previous commit is unchanged.
        """
        try:
            temp = self._write_temp(record)
        except OSError as exc:
            raise self._write_error(exc) from exc
        try:
            self._publish(temp)
        except BaseException as exc:
            Path(temp).unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise self._write_error(exc) from exc
            raise
        try:
            self._sync_directory()
        except OSError as exc:
            raise self._write_error(exc) from exc

    def _write_temp(self, record: CommitRecord) -> str:
        """``record`` in a new temporary file of the directory, flushed and fsynced."""
        fd, temp = tempfile.mkstemp(dir=self.path, prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(record, f)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise
        return temp

    def _publish(self, temp: str) -> None:
        """Make ``temp`` the commit: one atomic rename (a seam for tests that crash here)."""
        os.replace(temp, self.file)

    def _sync_directory(self) -> None:
        """fsync the directory, so that the rename itself survives a power loss."""
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        except OSError as exc:
            if exc.errno not in _UNSUPPORTED:
                raise
        finally:
            os.close(fd)

    def _write_error(self, exc: OSError) -> DurableCommitError:
        return DurableCommitError(
            f"rank 0 could not write the durable commit {self.file}: {exc}. The commit was not "
            "made: the previous one stays, in memory and on disk. Check that the directory is "
            "writable and has free space."
        )

    def read(self) -> CommitRecord | None:
        """The commit's record, or ``None`` when the directory holds none.

        Raises:
            DurableCommitError: the directory or file is not trusted, or the file is damaged or
                not a commit of this format.
        """
        try:
            st = os.stat(self.file)
        except FileNotFoundError:
            return None
        _check_owned(self.file, st, "file")
        self._check_archive()
        record = self._load()
        self._check_format(record)
        return record

    def _check_archive(self) -> None:
        """A truncated file has no zip directory; a damaged one fails a CRC check."""
        try:
            with zipfile.ZipFile(self.file) as archive:
                bad = archive.testzip()
        except (OSError, zipfile.BadZipFile) as exc:
            raise self._damaged(f"it is not a whole torch.save archive ({exc})") from exc
        if bad is not None:
            raise self._damaged(f"its entry {bad!r} fails its checksum")

    def _load(self) -> CommitRecord:
        try:
            try:
                loaded = torch.load(self.file, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError:
                # Objects beyond tensors and plain containers (a value of the user's own
                # class): the directory and file passed the ownership checks, so the pickle
                # is the job's own.
                logger.debug("hora elastic: %s needs full unpickling", self.file)
                loaded = torch.load(self.file, map_location="cpu", weights_only=False)
        except Exception as exc:  # any failure to load means the same to the user
            raise self._damaged(f"loading it failed: {type(exc).__name__}: {exc}") from exc
        if not isinstance(loaded, dict):
            raise self._damaged(f"it holds a {type(loaded).__name__}, not a hora commit")
        # Its fields are checked before they are used: the format here, the tables by the state.
        return cast(CommitRecord, loaded)

    def _check_format(self, record: CommitRecord) -> None:
        if record.get("format") != FORMAT:
            raise self._damaged("it is not a hora elastic commit (no 'format' field of hora's)")
        version = record.get("version")
        if version != VERSION:
            raise DurableCommitError(
                f"the durable commit {self.file} has format version {version!r}; this hora "
                f"reads version {VERSION}. Resume with the hora version that wrote it, or move "
                "the file away to start from scratch."
            )

    def _damaged(self, why: str) -> DurableCommitError:
        return DurableCommitError(
            f"rank 0 cannot read the durable commit {self.file}: {why}. {_WHAT_TO_DO_DAMAGED}"
        )

    def remove_leftovers(self) -> list[Path]:
        """Delete temporary files that interrupted writes left behind; returns them."""
        removed = []
        for path in self.path.glob(f"{TEMP_PREFIX}*{TEMP_SUFFIX}"):
            try:
                path.unlink()
            except OSError:
                continue
            removed.append(path)
        return removed


def make_record(
    number: int, handlers: dict[str, object], values: dict[str, object]
) -> CommitRecord:
    """The record of commit ``number``: what :meth:`CommitDirectory.write` stores."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "commit": number,
        "handlers": handlers,
        "values": values,
    }


def read_commit(commit_dir: str | os.PathLike[str]) -> CommitRecord | None:
    """Read the durable commit of ``commit_dir``, or ``None`` when it holds none.

    The record is a dict: ``format`` (``"hora.elastic.commit"``), ``version`` (1), ``commit``
    (how many commits the job had made), ``handlers`` (the ``state_dict`` of each model,
    optimizer and sampler, by attribute name) and ``values`` (the plain attributes, such as
    ``epoch`` and ``batch``).

    Args:
        commit_dir: the directory given to ``TorchState(commit_dir=...)``.

    Raises:
        DurableCommitError: the file is damaged, or the directory is not trusted.

    Example:
        >>> record = hvd.elastic.read_commit("/shared/ckpt/run-7")
        >>> record["commit"], record["values"]["epoch"]
        (42, 3)
    """
    directory = CommitDirectory(commit_dir)
    if directory.path.exists():
        _check_owned(directory.path, os.stat(directory.path), "directory")
    return directory.read()
