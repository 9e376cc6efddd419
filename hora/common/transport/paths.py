"""Which data path a process set takes, chosen once when its communicator is made.

- Every member on one host (and ``/dev/shm`` works there): shared memory
  (:class:`~hora.common.transport.shm.ShmCommunicator`) for data and negotiation alike.
- Members on several hosts, the same number on each: the hierarchical allreduce
  (:class:`~hora.common.transport.hierarchical.HierarchicalCommunicator`: shared memory within
  each host, Gloo across), unless ``HORA_HIERARCHICAL_ALLREDUCE=0``; other collectives over one
  Gloo group.
- Otherwise (one member per host, uneven hosts, shared memory unusable or turned off): one Gloo
  group, as before. Why shared memory was not used is logged once, by the set's first member.

Every member of a set takes the same path: they agree through the job's store
(:mod:`.local_groups`). Negotiation's control communicator takes a smaller slot. Slot and arena
sizes are rounded up to whole pages here, as the segment lays them out page by page.

This module decides and builds; it knows communicators, settings and the store.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from hora.common.job.store import StoreClient
from hora.common.job.store_keys import ScopeKeys
from hora.common.job.topology import Topology
from hora.common.transport import Communicator, shm_lane
from hora.common.transport.hierarchical import HierarchicalCommunicator
from hora.common.transport.local_groups import Grouping, group_members, map_segment
from hora.common.transport.shm import ShmCommunicator
from hora.common.transport.shm_lane import Lane
from hora.common.transport.shm_segment import PAGE
from hora.common.vocabulary import settings_table as table
from hora.common.vocabulary.config import Settings
from hora.common.vocabulary.settings_table import Variable

logger = logging.getLogger("hora")

# Negotiation's messages are small: its communicator's slot.
CONTROL_SLOT_BYTES = 1 << 20


class PathChooser:
    """Makes each process set's communicator on the path that suits its members.

    Args:
        topology: where this process sits in the job.
        settings: the engine's settings (shared memory on or off, slot size, hierarchical).
        store: the job's store, through which members agree.
        gloo: makes a Gloo communicator for ``(scope, rank, size)``.
    """

    def __init__(
        self,
        topology: Topology,
        settings: Settings,
        store: StoreClient,
        gloo: Callable[[str, int, int], Communicator],
    ) -> None:
        self._topology = topology
        self._settings = settings
        self._store = store
        self._gloo = gloo
        self._told = False
        self._slot_bytes = whole_pages(settings.shm_slot_bytes, table.SHM_SLOT_BYTES)
        self._arena_bytes = whole_pages(settings.shm_arena_bytes, table.SHM_ARENA_BYTES)

    def communicator(self, scope: str, rank: int, size: int) -> Communicator:
        """The communicator of the set ``scope`` for this member (``rank`` of ``size``)."""
        if size == 1:
            return self._gloo(scope, rank, size)
        timeout_s = self._settings.gloo_timeout_s
        grouping = group_members(self._store, scope, rank, size, timeout_s)
        if not grouping.shared:
            return self._gloo(scope, rank, size)
        several_hosts = len(grouping.groups) > 1
        if several_hosts and not self._hierarchical(rank, grouping):
            return self._gloo(scope, rank, size)
        slot = self._slot_bytes
        # Buffers kept for repeated collectives (see ShmCommunicator.arena_buffer): for the
        # data of a set whose members all share this host.
        arena = 0 if several_hosts else self._arena_bytes
        control = scope.endswith("/control") or scope == "control"
        if control:
            slot, arena = min(slot, CONTROL_SLOT_BYTES), 0
        segment, why = map_segment(self._store, scope, grouping, rank, slot, arena, timeout_s)
        if segment is None:
            if why:
                self._tell(rank, f"shared memory is not used ({why}); the ranks exchange over Gloo")
            return self._gloo(scope, rank, size)
        wait_s, limit = self._wait_limit()
        local = ShmCommunicator(segment, wait_s, limit=limit)
        if not several_hosts:
            if not control and self._settings.fast_path:
                local.lane = self._lane(scope, grouping, rank)
            return local
        flat = self._gloo(scope, rank, size)
        group = grouping.group_of[rank]
        local_rank = grouping.groups[group].index(rank)
        peers = [members[local_rank] for members in grouping.groups]
        cross = self._gloo(ScopeKeys(scope).cross(local_rank), peers.index(rank), len(peers))
        return HierarchicalCommunicator(flat, local, cross)

    def _lane(self, scope: str, grouping: Grouping, rank: int) -> Lane | None:
        """The set's lane (hora.common.ops.fast_path), on a segment of its own; ``None`` when
        it cannot be mapped (every member then goes without)."""
        timeout_s = self._settings.gloo_timeout_s
        why = shm_lane.supported()
        if why is not None:
            self._tell(rank, f"the shared-memory fast path is off ({why})")
            return None
        segment, why = map_segment(
            self._store, ScopeKeys(scope).lane(), grouping, rank, shm_lane.SLOT_BYTES, 0, timeout_s
        )
        if segment is None:
            if why:
                self._tell(rank, f"the shared-memory fast path is off ({why})")
            return None
        stall_s = self._settings.stall_check_time_s if self._settings.stall_check_enabled else 0.0
        timeout_s, limit = self._wait_limit()
        return Lane(segment, timeout_s, stall_s, limit)

    def _wait_limit(self) -> tuple[float, str]:
        """How long a shared-memory collective waits for a member, and the setting that says
        so: ``HORA_STALL_SHUTDOWN_TIME_SECONDS`` when it is set (a stopped member then ends the
        job at that limit, on every path: the lane, negotiation, a batch), else the Gloo
        timeout."""
        stall_s = self._settings.stall_limit_s
        if stall_s > 0:
            return stall_s, table.STALL_SHUTDOWN_TIME_SECONDS.env
        return self._settings.gloo_timeout_s, ""

    def _hierarchical(self, rank: int, grouping: Grouping) -> bool:
        """Whether a set spread over several hosts reduces hierarchically: by default and when
        asked, if every host runs as many of its members; else over one Gloo group."""
        wanted = self._settings.hierarchical_allreduce
        if wanted is False:
            return False
        if not grouping.uniform:
            if wanted:
                self._tell(
                    rank,
                    "HORA_HIERARCHICAL_ALLREDUCE=1, but the process set's hosts run different "
                    "numbers of its ranks; it reduces over one Gloo group",
                )
            return False
        return True

    def _tell(self, rank: int, message: str) -> None:
        if rank == 0 and not self._told:
            logger.warning("rank %d: %s.", self._topology.rank, message)
            self._told = True


def whole_pages(nbytes: int, variable: Variable[int]) -> int:
    """``nbytes`` rounded up to a multiple of the page: slots and arenas start on page
    boundaries, and the communicator views slots and half-slots as any dtype (up to 16 bytes
    wide), which a size such as 65538 would not divide into."""
    rounded = -(-nbytes // PAGE) * PAGE
    if rounded != nbytes:
        logger.debug(
            "%s=%d is rounded up to %d, a multiple of %d", variable.env, nbytes, rounded, PAGE
        )
    return rounded
