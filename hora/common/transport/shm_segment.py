"""A shared-memory segment that the members of one communicator on one host map, and the waits
between them.

The segment is a file in ``/dev/shm``, mode ``0600`` (only the job's user can open it), made by
member 0 under a fresh random name, with its slots reserved up front (``posix_fallocate``), so
that a full ``/dev/shm`` is an error at creation rather than a ``SIGBUS`` later; the other
members prove they opened that very file before they map it (:mod:`.shm_files`). Once every
member has mapped it, member 0 unlinks the name: nothing is left behind, whatever ends the
processes (the memory goes with the last mapping).

Layout, in 64-byte lines so that no two writers share a cache line:

- line 0: a header (magic, version, members, slot bytes, arena bytes, the nonce of its name);
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
import functools
import mmap
import os
import platform
import select
import struct
import time
from collections.abc import Callable, Sequence

from hora.common.job.shm_names import (
    CREATOR_OFFSET,
    HEADER_FORMAT,
    LINE,
    MAGIC,
    SHM_DIR,
    VERSION,
    new_segment_name,
    nonce_of,
)
from hora.common.transport import shm_files
from hora.common.transport.shm_files import SegmentError, SegmentFile

__all__ = ["Aborted", "PeerLost", "Segment", "SegmentError", "SegmentFile", "WaitTimeout"]

PAGE = 4096
# How long a sleeping waiter sleeps between its checks of peers, deadline and abort.
SLICE_S = 0.02
# Checks of a counter before a waiter sleeps on it (a few microseconds of spinning).
SPIN_CHECKS = 64

# Arena buffers start and end at multiples of a page.
_BLOCK_UNIT = PAGE

_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_SYS_FUTEX = {"x86_64": 202, "amd64": 202}
_WRAP = 1 << 31


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


@functools.cache
def _syscall() -> Callable[..., int]:
    """libc's ``syscall``, typed for ``futex(2)``; loaded once per process (loading it costs
    more than making a segment does)."""
    function = ctypes.CDLL(None, use_errno=True).syscall
    function.restype = ctypes.c_long
    function.argtypes = [
        ctypes.c_long,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    return function


class _Futex:
    """``futex(2)`` through libc's ``syscall``: wait on and wake a shared 32-bit word."""

    def __init__(self) -> None:
        self._syscall = _syscall()
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
        self,
        file: SegmentFile,
        fd: int,
        rank: int,
        size: int,
        slot_bytes: int,
        arena_bytes: int = 0,
    ) -> None:
        self.file = file
        self.path = file.path
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
        self._first_slot = first_slot
        self.slots = [
            view[first_slot + j * slot_bytes : first_slot + (j + 1) * slot_bytes]
            for j in range(size)
        ]
        first_arena = first_slot + size * slot_bytes
        # Where each member's arena starts in the mapping.
        self.arena_starts = [first_arena + j * arena_bytes for j in range(size)]
        self._futex = _Futex()
        self._pidfds: dict[int, int] = {}
        self._poll: select.poll | None = None
        self.aborted = False

    # ------------------------------------------------------------- making and opening

    @classmethod
    def create(cls, secret: str, size: int, slot_bytes: int, arena_bytes: int = 0) -> Segment:
        """Member 0: a new segment of the job with ``secret``, the space of its slots reserved
        (the arenas' is reserved as it is used). Its :attr:`file` is what the other members
        need to attach.

        Raises:
            SegmentError: it cannot be made (no room, no ``/dev/shm``); nothing is left behind.
        """
        total, reserved = total_bytes(size, slot_bytes, arena_bytes), total_bytes(size, slot_bytes)
        problem = shm_files.room_problem(reserved)
        if problem:
            raise SegmentError(problem)
        name = new_segment_name(secret)
        header = _header(size, slot_bytes, arena_bytes, nonce_of(name), os.getpid())
        fd, found = shm_files.create(secret, name, total, reserved, header)
        try:
            segment = cls(found, fd, 0, size, slot_bytes, arena_bytes)
        except (OSError, ValueError, OverflowError) as exc:
            os.close(fd)
            shm_files.remove(found)
            raise SegmentError(f"cannot map {found.path}: {exc}") from None
        segment.register_pid()
        return segment

    @classmethod
    def attach(
        cls, found: SegmentFile, rank: int, size: int, slot_bytes: int, arena_bytes: int = 0
    ) -> Segment:
        """Another member: open the segment member 0 published as ``found``, proving it is that
        file (:func:`.shm_files.open_published`) and laid out as expected.

        Raises:
            SegmentError: it is missing (another host, another ``/dev/shm``), another file than
                member 0 made (the message names it and its owner), or not of this layout.
        """
        fd = shm_files.open_published(found, total_bytes(size, slot_bytes, arena_bytes))
        try:
            segment = cls(found, fd, rank, size, slot_bytes, arena_bytes)
        except (OSError, ValueError) as exc:
            os.close(fd)
            raise SegmentError(f"cannot map {found.path}: {exc}") from None
        expected = (MAGIC, VERSION, size, slot_bytes, arena_bytes, nonce_of(found.name))
        if struct.unpack_from(HEADER_FORMAT, segment._map, 0) != expected:
            segment.close()
            raise SegmentError(
                f"{found.path} is not this job's segment of this layout (its header differs)"
            )
        segment.register_pid()
        return segment

    def unlink(self) -> None:
        """Remove the segment's name (every member has mapped it; the memory stays)."""
        shm_files.remove(self.file)

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

    def arena_block(self, offset: int, nbytes: int) -> ctypes.Array[ctypes.c_char]:
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

    def arrive_quietly(self, value: int) -> None:
        """Publish this member's arrival counter; wake its waiters only if a member sleeps
        (:meth:`wait_arrivals` with ``flagged``), so that an arrival costs no system call
        while the others spin."""
        self._publish(_member_word(self.rank, 0), value)

    def ring(self, value: int) -> None:
        """Publish this member's *bell* counter (it posted on a lane: :mod:`.shm_lane`); wake
        its waiters only if a member sleeps."""
        self._publish(_member_word(self.rank, _BELL), value)

    def _publish(self, word: int, value: int) -> None:
        """Write one of this member's counters; wake the waiters on it only if another member
        sleeps."""
        words = self._words
        words[word] = value
        for member in range(self.size):
            if member != self.rank and words[_member_word(member, _SLEEPING)]:
                self._futex.wake(self._base + word * 4)
                return

    def bell(self, member: int) -> int:
        return int(self._words[_member_word(member, _BELL)])

    def wait_bell(self, member: int, target: int, until: float) -> None:
        """Return when ``member``'s bell reaches ``target`` or at ``until`` (monotonic),
        whichever comes first.

        Raises:
            PeerLost, Aborted: see :meth:`_wait_word`.
        """
        try:
            self._wait_word(_member_word(member, _BELL), target, until, member, True)
        except WaitTimeout:
            pass

    def address(self, member: int) -> int:
        """Where ``member``'s slot starts in this process's memory."""
        return self._base + self._first_slot + member * self.slot_bytes

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

    def wait_arrivals(
        self, members: Sequence[int], target: int, deadline: float, flagged: bool = False
    ) -> None:
        """Return when every member of ``members`` has arrival counter ``target`` or later.
        With ``flagged``, this member's line says while it sleeps, for members that arrive
        with :meth:`arrive_quietly`.

        Raises:
            PeerLost, Aborted, WaitTimeout: see :meth:`_wait_word`.
        """
        for member in members:
            self._wait_word(_member_word(member, 0), target, deadline, member, flagged)

    def wait_pair(self, peer: int, target: int, which: int, deadline: float) -> None:
        """Return when ``peer``'s pair counter ``which`` for this member reaches ``target``."""
        self._wait_word(_pair_word(self.size, peer, self.rank, which), target, deadline, peer)

    def _wait_word(
        self, word: int, target: int, deadline: float, member: int, flagged: bool = False
    ) -> None:
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
            if flagged:
                words[_member_word(self.rank, _SLEEPING)] = 1
                try:
                    self._futex.wait(address, value, min(SLICE_S, deadline - now))
                finally:
                    words[_member_word(self.rank, _SLEEPING)] = 0
            else:
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


# The word of a member's line that is 1 while it sleeps on a peer's counter.
_SLEEPING = 5
# The word of a member's line that counts its posts on a lane.
_BELL = 6


def _member_word(member: int, index: int) -> int:
    """Word ``index`` of ``member``'s line (0: arrival counter, 1: pid, 2 and 3: the offset and
    size of its published arena buffer, in :data:`_BLOCK_UNIT`; 4: the allreduces it has
    started; 5: whether it sleeps on a peer's counter; 6: its bell, posts on a lane)."""
    return (1 + member) * (LINE // 4) + index


def _pair_word(size: int, writer: int, reader: int, which: int) -> int:
    return (1 + size + writer * size + reader) * (LINE // 4) + which


def _control_bytes(size: int) -> int:
    lines = 1 + size + size * size
    return -(-lines * LINE // PAGE) * PAGE


def total_bytes(size: int, slot_bytes: int, arena_bytes: int = 0) -> int:
    """The segment's size for ``size`` members with ``slot_bytes`` and ``arena_bytes`` each."""
    return _control_bytes(size) + size * (slot_bytes + arena_bytes)


def _header(size: int, slot_bytes: int, arena_bytes: int, nonce: bytes, creator: int) -> bytes:
    """The first two lines of a new segment: its header, and member 0's pid in its line."""
    header = bytearray(LINE * 2)
    struct.pack_into(HEADER_FORMAT, header, 0, MAGIC, VERSION, size, slot_bytes, arena_bytes, nonce)
    struct.pack_into("<i", header, CREATOR_OFFSET, creator)
    return bytes(header)
