"""Which members of a set share a host, and the shared-memory segments they map together.

Every member publishes its host's identity in the job's store: the boot id of its kernel and
the device of its ``/dev/shm`` (two containers on one machine, each with its own ``/dev/shm``,
do not share memory). Members with the same identity form a *local group*. In each group of two
or more, the lowest member creates a segment and the others attach to it; each member then
reports whether that worked, and every member reads every report, so that all of them choose
the same path for the set: shared memory only where every group's segment works, and the
reason otherwise. A group's creator unlinks the segment's name once its group has attached.

Segment names are fresh random ones under the job's prefix, published with the file's device
and inode through the store (signed with the job secret): another user can neither know a name
in advance nor slip another file under it (:mod:`.shm_files`), and could not open the segment
(mode ``0600``).

This module knows the store, hosts and segments; not collectives.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import dataclass

from hora.common.job.shm_names import sweep
from hora.common.job.store import StoreClient
from hora.common.job.store_keys import ScopeKeys
from hora.common.transport import TransportError
from hora.common.transport.shm_segment import Segment, SegmentError, SegmentFile, supported

logger = logging.getLogger("hora")


def host_identity() -> str:
    """What members that share memory have in common: this kernel's boot, this ``/dev/shm``
    and this network namespace (processes in different network namespaces of one machine are
    treated as different hosts, as containers with their own network are)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            boot = handle.read().strip()
    except OSError:
        boot = socket.gethostname()
    return f"{boot}:{_inode('/dev/shm', 'st_dev')}:{_inode('/proc/self/ns/net', 'st_ino')}"


def _inode(path: str, field: str) -> int:
    try:
        return int(getattr(os.stat(path), field))
    except OSError:
        return -1


@dataclass(frozen=True)
class Grouping:
    """The local groups of a set: for each member, the index of its group; and the groups, each
    a list of members in order.

    Attributes:
        group_of: the group of each member.
        groups: the members of each group, by group, in member order.
        hosts: each member's host name (for messages).
    """

    group_of: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]
    hosts: tuple[str, ...]

    @property
    def uniform(self) -> bool:
        """Whether every group has the same number of members."""
        return len({len(g) for g in self.groups}) == 1

    @property
    def shared(self) -> bool:
        """Whether some group has two or more members (shared memory would be used)."""
        return any(len(g) > 1 for g in self.groups)


def group_members(
    store: StoreClient, scope: str, rank: int, size: int, timeout_s: float
) -> Grouping:
    """Learn every member's host identity through the store, and group the members.

    Raises:
        TransportError: some member did not publish its identity in time.
    """
    mine = json.dumps({"id": host_identity(), "host": socket.gethostname()})
    keys = ScopeKeys(scope)
    store.set_signed(keys.host_of(rank), mine.encode())
    found = []
    for member in range(size):
        if not store.wait(keys.host_of(member), timeout_s):
            raise TransportError(
                f"member {member} of {scope} did not arrive within {timeout_s:g} s"
            )
        found.append(json.loads(store.get_signed(keys.host_of(member))))
    order: dict[str, int] = {}
    group_of = []
    for entry in found:
        group_of.append(order.setdefault(entry["id"], len(order)))
    groups = tuple(tuple(m for m in range(size) if group_of[m] == g) for g in range(len(order)))
    return Grouping(tuple(group_of), groups, tuple(e["host"] for e in found))


def map_segment(
    store: StoreClient,
    scope: str,
    grouping: Grouping,
    rank: int,
    slot_bytes: int,
    arena_bytes: int,
    timeout_s: float,
) -> tuple[Segment | None, str]:
    """Make or attach this member's group segment, and agree with every member whether shared
    memory works for the whole set.

    Returns:
        ``(segment, "")`` when every group's segment works (``segment`` is ``None`` for a
        member alone on its host); else ``(None, why not)``, the same answer on every member.
    """
    group = grouping.group_of[rank]
    members = grouping.groups[group]
    segment: Segment | None = None
    problem = supported() or ""
    if len(members) > 1 and not problem:
        segment, problem = _join_group(
            store, scope, group, members, rank, (slot_bytes, arena_bytes), timeout_s
        )
    try:
        problems = _reports(store, scope, grouping, rank, problem, timeout_s)
    except BaseException:
        # The wait ended early (an elastic round was lost) or the store failed: nobody will
        # use the segment; its name and mapping must not outlive this call.
        if segment is not None:
            if members[0] == rank:
                segment.unlink()
            segment.close()
        raise
    if segment is not None and members[0] == rank:
        segment.unlink()  # every member of the group has reported, so has mapped it
    if problems:
        if segment is not None:
            segment.close()
        return None, "; ".join(problems)
    if segment is not None:
        segment.watch_peers()
    return segment, ""


def _reports(
    store: StoreClient, scope: str, grouping: Grouping, rank: int, problem: str, timeout_s: float
) -> list[str]:
    """Publish whether shared memory works for this member (``problem``: why not), and read
    every member's answer: the problems, one per member that has one."""
    keys = ScopeKeys(scope)
    store.set_signed(keys.shm_ok(rank), problem.encode())
    problems = []
    for member in range(len(grouping.group_of)):
        if not store.wait(keys.shm_ok(member), timeout_s):
            problems.append(f"member {member} did not report")
            continue
        said = store.get_signed(keys.shm_ok(member)).decode()
        if said:
            problems.append(f"member {member} on {grouping.hosts[member]}: {said}")
    return problems


def _join_group(
    store: StoreClient,
    scope: str,
    group: int,
    members: tuple[int, ...],
    rank: int,
    space: tuple[int, int],
    timeout_s: float,
) -> tuple[Segment | None, str]:
    """Member 0 of the group makes the segment and publishes its file (or why it could not);
    the others attach to exactly that file."""
    local_rank, local_size = members.index(rank), len(members)
    created_key = ScopeKeys(scope).shm_created(group)
    if local_rank == 0:
        for path in sweep():
            logger.info("removed %s, left by a process that was killed while making it", path)
        try:
            segment = Segment.create(store.secret, local_size, *space)
        except SegmentError as exc:
            store.set_signed(created_key, json.dumps({"error": str(exc) or "failed"}).encode())
            return None, str(exc)
        store.set_signed(created_key, json.dumps({"file": segment.file.to_json()}).encode())
        return segment, ""
    if not store.wait(created_key, timeout_s):
        return None, f"the segment of this host's group was not made within {timeout_s:g} s"
    said = json.loads(store.get_signed(created_key))
    if "error" in said:
        return None, f"its group's segment could not be made ({said['error']})"
    try:
        found = SegmentFile.from_json(said["file"])
        return Segment.attach(found, local_rank, local_size, *space), ""
    except SegmentError as exc:
        return None, str(exc)
