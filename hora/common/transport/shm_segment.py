"""A shared-memory segment that the members of one communicator on one host map, and the waits
between them.

The segment is a file in ``/dev/shm``, mode ``0600`` (only the job's user can open it), under a
name derived from the job secret (nobody without it can guess it), created by member 0 with
``O_CREAT | O_EXCL | O_NOFOLLOW`` and its whole size reserved up front (``posix_fallocate``), so
that a full ``/dev/shm`` is an error at creation rather than a ``SIGBUS`` later. Once every
member has mapped it, member 0 unlinks the name: nothing is left behind, whatever ends the
processes (the memory goes with the last mapping).

Layout, in 64-byte lines so that no two writers share a cache line:

- line 0: a header (magic, version, size, slot bytes);
- one line per member: its *arrival* counter (the futex word a barrier waits on) and its pid;
- one line per ordered pair of members: the pair's *post* and *taken* counters (pairwise
  exchanges);
- then one slot of ``slot_bytes`` per member, 4 KiB-aligned: the data that member writes;
- then one *arena* of ``arena_bytes`` per member: buffers that a member keeps for collectives
  it runs again and again (the steady state's batches), reduced where they lie. The arenas are
  sparse: a member reserves the pages of a buffer when it takes it (:meth:`Segment.reserve`),
  so they cost only the memory those buffers would take anyway. A member publishes the place
  of the buffer it reduces in its line (:meth:`Segment.publish_block`).

Every counter has one writer, the member it belongs to. A member waits for another's counter to
reach a value by spinning briefly and then sleeping on it with ``futex(FUTEX_WAIT)``; the
writer stores the value and wakes the word. While it sleeps the waiter wakes every
:data:`SLICE_S` to check that the peers it waits for are alive (through pidfds), that the wait
has not run past its deadline and that the communicator was not aborted.

Memory ordering: a member stores data into its slot and then its counter; a reader loads the
counter and then the data. x86-64 keeps stores in order and loads in order, which is what this
relies on; other architectures do not, so the shared-memory path is offered on x86-64 only
(:func:`supported`).

This module knows bytes, counters and processes; not collectives, tensors' meaning or jobs.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import select
import struct
import time
from collections.abc import Sequence
from typing import Any

from hora.common.job.shm_names import LINE, MAGIC, SHM_DIR, VERSION

PAGE = 4096
# How long a sleeping waiter sleeps between its checks of peers, deadline and abort.
SLICE_S = 0.02
# Checks of a counter before a waiter sleeps on it (a few microseconds of spinning).
SPIN_CHECKS = 64

# The header: magic, version, members, slot bytes, arena bytes.
_HEADER = "<IIIQQ"
# Arena buffers start and end at multiples of a page.
_BLOCK_UNIT = PAGE

_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_SYS_FUTEX = {"x86_64": 202, "amd64": 202}
_WRAP = 1 << 31


class SegmentError(OSError):
    """The segment cannot be made or used here (no ``/dev/shm``, too little space, another
    user's file, a platform without the guarantees the path needs)."""


class PeerLost(RuntimeError):
    """A member the wait was for has exited."""


class Aborted(RuntimeError):
    """The communicator was aborted while the wait was in progress."""


class WaitTimeout(RuntimeError):
    """A wait ran past its deadline."""


def supported() -> str | None:
    """``None`` when this platform can run the shared-memory path, else why not."""
    machine = platform.machine().lower()
    if machine not in _SYS_FUTEX:
        return f"{platform.machine()} is not x86-64 (the path relies on its memory ordering)"
    if not os.path.isdir(SHM_DIR):
        return f"{SHM_DIR} does not exist"
    if not hasattr(os, "pidfd_open"):
        return "this Python has no os.pidfd_open (Linux 5.3 and Python 3.9 or newer)"
    return None


class _Futex:
    """``futex(2)`` through libc's ``syscall``: wait on and wake a shared 32-bit word."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._syscall = libc.syscall
        self._syscall.restype = ctypes.c_long
        self._syscall.argtypes = [
            ctypes.c_long,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int,
        ]
        self._number = _SYS_FUTEX[platform.machine().lower()]
        self._timeout = (ctypes.c_long * 2)()

    def wait(self, address: int, expected: int, timeout_s: float) -> None:
        """Sleep while the word at ``address`` holds ``expected``, ``timeout_s`` at most."""
        self._timeout[0] = int(timeout_s)
        self._timeout[1] = int((timeout_s % 1.0) * 1e9)
        self._syscall(
            self._number, address, _FUTEX_WAIT, expected, ctypes.addressof(self._timeout), None, 0
        )

    def wake(self, address: int) -> None:
        """Wake every thread sleeping on the word at ``address``."""
        self._syscall(self._number, address, _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


def reached(value: int, target: int) -> bool:
    """Whether counter ``value`` has reached ``target``, counting modulo 2**31."""
    return (value - target) % _WRAP < (_WRAP >> 1)


class Segment:
    """One communicator's mapped segment, as member ``rank`` of ``size`` sees it.

    Make it with :meth:`create` (member 0) or :meth:`attach` (the others).

    Attributes:
        rank, size: this member and the number of members.
        slot_bytes: the bytes of each member's slot.
        slots: every member's slot, as a writable ``memoryview``.
    """

    def __init__(
        self, path: str, fd: int, rank: int, size: int, slot_bytes: int, arena_bytes: int = 0
    ) -> None:
        self.path = path
        self.rank = rank
        self.size = size
        self.slot_bytes = slot_bytes
        self.arena_bytes = arena_bytes
        self._map = mmap.mmap(fd, total_bytes(size, slot_bytes, arena_bytes))
        self._fd = fd  # kept to reserve the arena's pages as they are taken
        view = memoryview(self._map)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        control = (ctypes.c_int32 * (_control_bytes(size) // 4)).from_buffer(self._map)
        self._words = control
        first_slot = _control_bytes(size)
        self.slots = [
            view[first_slot + j * slot_bytes : first_slot + (j + 1) * slot_bytes]
            for j in range(size)
        ]
        first_arena = first_slot + size * slot_bytes
        # Where each member's arena starts in the mapping.
        self.arena_starts = [first_arena + j * arena_bytes for j in range(size)]
        self._futex = _Futex()
        self._pidfds: dict[int, int] = {}
        self._poll: Any = None
        self.aborted = False

    # ------------------------------------------------------------- making and opening

    @classmethod
    def create(cls, name: str, size: int, slot_bytes: int, arena_bytes: int = 0) -> Segment:
        """Member 0: a new segment ``name`` in ``/dev/shm``, the space of its slots reserved
        (the arenas' is reserved as it is used).

        Raises:
            SegmentError: it cannot be created (exists, no space, no ``/dev/shm``).
        """
        path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise SegmentError(f"cannot create {path}: {exc.strerror or exc}") from None
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, total_bytes(size, slot_bytes, arena_bytes))
            os.posix_fallocate(fd, 0, total_bytes(size, slot_bytes))
        except OSError as exc:
            os.close(fd)
            _unlink(path)
            raise SegmentError(_space_problem(path, size, slot_bytes, exc)) from None
        segment = cls(path, fd, 0, size, slot_bytes, arena_bytes)
        struct.pack_into(_HEADER, segment._map, 0, MAGIC, VERSION, size, slot_bytes, arena_bytes)
        segment.register_pid()
        return segment

    @classmethod
    def attach(
        cls, name: str, rank: int, size: int, slot_bytes: int, arena_bytes: int = 0
    ) -> Segment:
        """Another member: open member 0's segment ``name`` and check it is the one expected.

        Raises:
            SegmentError: it is missing (another host, another ``/dev/shm``), not this user's,
                or not laid out as expected.
        """
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
            info = os.fstat(fd)
        except OSError as exc:
            raise SegmentError(f"cannot open {path}: {exc.strerror or exc}") from None
        if info.st_uid != os.geteuid() or info.st_mode & 0o077:
            os.close(fd)
            raise SegmentError(f"{path} belongs to uid {info.st_uid} or is open to others")
        if info.st_size != total_bytes(size, slot_bytes, arena_bytes):
            os.close(fd)
            raise SegmentError(f"{path} has {info.st_size} bytes, not the expected layout's")
        segment = cls(path, fd, rank, size, slot_bytes, arena_bytes)
        found = struct.unpack_from(_HEADER, segment._map, 0)
        if found != (MAGIC, VERSION, size, slot_bytes, arena_bytes):
            segment.close()
            raise SegmentError(f"{path} is not a hora segment of this layout")
        segment.register_pid()
        return segment

    def unlink(self) -> None:
        """Remove the segment's name (every member has mapped it; the memory stays)."""
        _unlink(self.path)

    def register_pid(self) -> None:
        self._words[_member_word(self.rank, 1)] = os.getpid()

    def watch_peers(self) -> None:
        """Open a pidfd on every other member (once all registered their pid), so that a wait
        notices when one exits."""
        self._poll = select.poll()
        for member in range(self.size):
            if member == self.rank:
                continue
            pid = self._words[_member_word(member, 1)]
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue  # another pid namespace: the engine's failure report covers it
            self._pidfds[fd] = member
            self._poll.register(fd, select.POLLIN)

    def reserve(self, offset: int, nbytes: int) -> bool:
        """Reserve the pages of bytes ``offset .. offset + nbytes`` of this member's arena;
        ``False`` when ``/dev/shm`` has no room for them (nothing may touch them then: a page
        that cannot be had would be a ``SIGBUS``)."""
        try:
            os.posix_fallocate(self._fd, self.arena_starts[self.rank] + offset, nbytes)
        except OSError:
            return False
        return True

    def arena_block(self, offset: int, nbytes: int) -> Any:
        """Bytes ``offset .. offset + nbytes`` of this member's arena, as a ctypes array (an
        object of its own, so that its owner learns when nothing refers to it any more)."""
        start = self.arena_starts[self.rank] + offset
        return (ctypes.c_char * nbytes).from_buffer(self._map, start)

    def arena(self, member: int) -> memoryview:
        """``member``'s whole arena, to read and write the buffer it published."""
        start = self.arena_starts[member]
        return memoryview(self._map)[start : start + self.arena_bytes]

    def announce(self, value: int) -> None:
        """Publish how many allreduces this member has started (see ``ShmCommunicator``)."""
        self._words[_member_word(self.rank, 4)] = value

    def announced(self, member: int) -> int:
        return int(self._words[_member_word(member, 4)])

    def publish_block(self, offset: int | None, nbytes: int) -> None:
        """Say where in this member's arena the buffer of its next reduction lies (``None``:
        not in its arena), before the barrier that starts it."""
        self._words[_member_word(self.rank, 2)] = -1 if offset is None else offset // _BLOCK_UNIT
        self._words[_member_word(self.rank, 3)] = -(-nbytes // _BLOCK_UNIT)

    def block_of(self, member: int) -> tuple[int, int]:
        """Where ``member``'s published buffer lies in its arena: ``(offset, bytes)``, its bytes
        rounded up to whole pages; the offset is negative when it is not in its arena."""
        offset = self._words[_member_word(member, 2)] * _BLOCK_UNIT
        return offset, self._words[_member_word(member, 3)] * _BLOCK_UNIT

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        for fd in self._pidfds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._pidfds.clear()
        self.slots = []
        self._words = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:
            pass  # tensors still view it: the mapping goes when they do

    # ------------------------------------------------------------- counters

    def arrival(self, member: int) -> int:
        return int(self._words[_member_word(member, 0)])

    def arrive(self, value: int) -> None:
        """Publish this member's arrival counter and wake whoever waits on it."""
        word = _member_word(self.rank, 0)
        self._words[word] = value
        self._futex.wake(self._base + word * 4)

    def post(self, peer: int, value: int, which: int) -> None:
        """Publish this member's pair counter ``which`` (0: posted, 1: taken) for ``peer``."""
        word = _pair_word(self.size, self.rank, peer, which)
        self._words[word] = value
        self._futex.wake(self._base + word * 4)

    def wait_arrivals(self, members: Sequence[int], target: int, deadline: float) -> None:
        """Return when every member of ``members`` has arrival counter ``target`` or later.

        Raises:
            PeerLost, Aborted, WaitTimeout: see :meth:`_wait_word`.
        """
        for member in members:
            self._wait_word(_member_word(member, 0), target, deadline, member)

    def wait_pair(self, peer: int, target: int, which: int, deadline: float) -> None:
        """Return when ``peer``'s pair counter ``which`` for this member reaches ``target``."""
        self._wait_word(_pair_word(self.size, peer, self.rank, which), target, deadline, peer)

    def _wait_word(self, word: int, target: int, deadline: float, member: int) -> None:
        """Spin briefly, then sleep on the word, until it reaches ``target``.

        Raises:
            PeerLost: ``member`` exited.
            Aborted: :attr:`aborted` was set.
            WaitTimeout: ``deadline`` (monotonic) passed.
        """
        words = self._words
        for _ in range(SPIN_CHECKS):
            if reached(words[word], target):
                return
        address = self._base + word * 4
        while True:
            value = words[word]
            if reached(value, target):
                return
            if self.aborted:
                raise Aborted("the communicator was aborted")
            now = time.monotonic()
            if now >= deadline:
                raise WaitTimeout(f"member {member}")
            self._futex.wait(address, value, min(SLICE_S, deadline - now))
            if not reached(words[word], target):
                self._check_peers()

    def wake_all(self) -> None:
        """Wake every waiter of this segment (an abort)."""
        for word in range(len(self._words)):
            self._futex.wake(self._base + word * 4)

    def _check_peers(self) -> None:
        if self._poll is None or not self._pidfds:
            return
        for fd, _events in self._poll.poll(0):
            member = self._pidfds.get(fd)
            if member is not None:
                raise PeerLost(f"member {member} (pid {self._words[_member_word(member, 1)]})")


def _member_word(member: int, index: int) -> int:
    """Word ``index`` of ``member``'s line (0: arrival counter, 1: pid, 2 and 3: the offset and
    size of its published arena buffer, in :data:`_BLOCK_UNIT`; 4: the allreduces it has
    started)."""
    return (1 + member) * (LINE // 4) + index


def _pair_word(size: int, writer: int, reader: int, which: int) -> int:
    return (1 + size + writer * size + reader) * (LINE // 4) + which


def _control_bytes(size: int) -> int:
    lines = 1 + size + size * size
    return -(-lines * LINE // PAGE) * PAGE


def total_bytes(size: int, slot_bytes: int, arena_bytes: int = 0) -> int:
    """The segment's size for ``size`` members with ``slot_bytes`` and ``arena_bytes`` each."""
    return _control_bytes(size) + size * (slot_bytes + arena_bytes)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _space_problem(path: str, size: int, slot_bytes: int, exc: OSError) -> str:
    wanted = total_bytes(size, slot_bytes)
    if exc.errno in (errno.ENOSPC, errno.ENOMEM):
        free = ""
        try:
            stats = os.statvfs(SHM_DIR)
            free = f" ({stats.f_bavail * stats.f_frsize / 2**20:.0f} MiB free)"
        except OSError:
            pass
        return (
            f"{SHM_DIR} has no room for {wanted / 2**20:.1f} MiB{free}: make /dev/shm larger "
            "(docker run --shm-size, a tmpfs size= option) or lower HORA_SHM_SLOT_BYTES"
        )
    return f"cannot reserve {wanted} bytes for {path}: {exc.strerror or exc}"
