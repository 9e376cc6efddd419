"""Which communicator a batch goes on: each process set's own (CPU: Gloo or MPI) and, made the
first time the set moves CUDA tensors, its GPU one (NCCL); plus the control communicator that
negotiation and the steady state's agreements use.

It connects, hands out, aborts and closes communicators; it knows process sets' members and
devices, never requests, negotiation or what runs on the communicators it hands out.
"""

from __future__ import annotations

import torch

from hora.common.engine.buffers import local_gpu
from hora.common.job.store_keys import GenerationKeys
from hora.common.job.topology import Topology
from hora.common.process_sets import ProcessSetTable
from hora.common.transport import (
    CallerLane,
    Communicator,
    CommunicatorFactory,
    DeviceCommunicatorFactory,
    TransportError,
)
from hora.common.vocabulary.errors import HoraInternalError


class Communicators:
    """The communicators of one engine, by process set.

    Connects the control communicator and the global set's (``ps0``), in that order, when made.

    Args:
        topology: this process's place in the job (its rank, the job's size, and its local
            rank, which picks its GPU when no tensor says which).
        keys: the generation's store keys (scopes stay distinct across ``init`` calls).
        process_sets: the engine's table of process sets.
        make: builds a communicator for ``(scope, rank_in_set, set_size)``.
        make_device: builds a communicator whose buffers live on a GPU for
            ``(scope, rank_in_set, set_size, device)`` (NCCL), or returns ``None`` when the set
            cannot have one (its members share a GPU); ``None`` itself: CUDA tensors go
            through host memory on the set's communicator.

    Attributes:
        control: the communicator negotiation's exchanges run on.
        device: the GPU communicators made so far, by process set.
    """

    def __init__(
        self,
        topology: Topology,
        keys: GenerationKeys,
        process_sets: ProcessSetTable,
        make: CommunicatorFactory,
        make_device: DeviceCommunicatorFactory | None,
    ) -> None:
        rank, size = topology.rank, topology.size
        self._rank = rank
        self._local_rank = topology.local_rank
        self._keys = keys
        self._process_sets = process_sets
        self._make = make
        self._by_set: dict[int, Communicator] = {}
        # GPU data paths: per process set, made the first time the set moves CUDA tensors.
        self._make_device = make_device
        self.device: dict[int, Communicator] = {}
        # Sets whose CUDA tensors go through host memory after all (members share a GPU).
        self._host_only: set[int] = set()
        self._gpu: torch.device | None = None
        self.control = self._connect("control", 0, rank, size)
        try:
            self._by_set[0] = self._connect("ps0", 0, rank, size)
            self._name_lane(0, tuple(range(size)))
        except BaseException:
            # No engine will own the control communicator: release it (its shared memory, its
            # connections) now, not whenever the collector gets to it.
            self.control.abort()
            self.control.close()
            raise

    def _connect(self, scope: str, set_id: int, rank: int, size: int) -> Communicator:
        try:
            return self._make(self._keys.scope(scope), rank, size)
        except TransportError as exc:
            raise HoraInternalError(
                f"rank {self._rank}: could not connect to the other ranks of process set "
                f"{set_id} ({exc}). Check that every rank called hvd.init() and that the hosts "
                "can reach each other (HORA_GLOO_IFACE selects the network interface). Gloo "
                "accepts any connection to the workers' ports, so other processes connecting to "
                "them cause this too: keep the job's network private (docs/security.md)."
            ) from exc

    def of_set(self, set_id: int) -> Communicator:
        """The set's own communicator (CPU buffers)."""
        return self._by_set[set_id]

    def lane(self, set_id: int) -> CallerLane | None:
        """The set's lane, for calls its callers run themselves (``None``: the set has none,
        or this rank is not a member)."""
        lane: CallerLane | None = getattr(self._by_set.get(set_id), "lane", None)
        return lane

    def lanes(self) -> list[CallerLane]:
        """The lanes of every set this rank is a member of."""
        found = [getattr(c, "lane", None) for c in list(self._by_set.values())]
        return [lane for lane in found if lane is not None]

    def _name_lane(self, set_id: int, ranks: tuple[int, ...]) -> None:
        lane = self.lane(set_id)
        if lane is not None:
            lane.ranks = ranks

    def register(self, set_id: int, ranks: tuple[int, ...]) -> None:
        """Add a process set to the table and, where this rank is a member, connect its
        communicator (every member registers the same sets in the same order)."""
        self._process_sets.add(set_id, ranks)
        if self._rank in ranks:
            self._by_set[set_id] = self._connect(
                f"ps{set_id}", set_id, ranks.index(self._rank), len(ranks)
            )
            self._name_lane(set_id, ranks)

    def remove(self, set_id: int) -> None:
        """Remove a process set from the table and close its communicators."""
        self._process_sets.remove(set_id)
        self._host_only.discard(set_id)
        for table in (self._by_set, self.device):
            removed = table.pop(set_id, None)
            if removed is not None:
                removed.close()

    def for_batch(self, set_id: int, device: str, hint: torch.device | None) -> Communicator:
        """The communicator that moves a batch's data: the set's own for CPU tensors (and for
        CUDA tensors through host memory), else the set's GPU communicator, made now the first
        time (every member runs the same batches in the same order, so all make it together).

        ``hint`` is the device of this rank's tensors in the batch, if it holds any: the GPU
        communicator lives there (a joined rank, holding none, uses the GPU of its first
        tensors, or that of its local rank).
        """
        if device != "cuda" or self._make_device is None or set_id in self._host_only:
            return self._by_set[set_id]
        if hint is not None and hint.type == "cuda" and self._gpu is None:
            self._gpu = hint
        comm = self.device.get(set_id)
        if comm is None:
            gpu = self._gpu or local_gpu(self._local_rank)
            members = self._process_sets.members(set_id)
            try:
                comm = self._make_device(
                    self._keys.scope(f"gpu-ps{set_id}"),
                    members.index(self._rank),
                    len(members),
                    gpu,
                )
            except TransportError as exc:
                raise HoraInternalError(
                    f"rank {self._rank}: could not connect the NCCL group of process set "
                    f"{set_id} on {gpu} ({exc}). NCCL_DEBUG=INFO shows why; "
                    "HORA_GPU_OPERATIONS=host moves CUDA tensors through host memory instead."
                ) from exc
            if comm is None:
                self._host_only.add(set_id)
                return self._by_set[set_id]
            self.device[set_id] = comm
        return comm

    def of_global_set(self, device: str) -> Communicator:
        """The global set's communicator for tensors on a device type (``"cpu"``, ``"cuda"``):
        the steady state runs its batches there."""
        return self.for_batch(0, device, None)

    def all(self) -> list[Communicator]:
        """Every communicator: the control one, the sets' own, the GPU ones."""
        return [self.control, *self._by_set.values(), *self.device.values()]

    def abort(self) -> None:
        """Unblock every collective on every communicator (the job failed)."""
        for comm in self.all():
            comm.abort()
