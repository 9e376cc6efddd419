"""Process sets: named subsets of ranks that run collectives among themselves.

This module owns the :class:`ProcessSet` object users hold and the table that maps ids to member
ranks. It does not create communicators; the engine asks the transport for one per set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from hora.common.vocabulary.errors import NOT_INITIALIZED

if TYPE_CHECKING:
    from mpi4py import MPI
    from typing_extensions import TypeIs


def is_mpi_communicator(value: object) -> TypeIs[MPI.Intracomm]:
    """Whether ``value`` is an mpi4py communicator, as ``hvd.init(comm=...)`` and
    :class:`ProcessSet` take (told by what it offers: hora imports mpi4py only where MPI plays
    a part)."""
    return hasattr(value, "Get_rank") and hasattr(value, "Get_group") and hasattr(value, "Dup")


class ProcessSet:
    """A subset of the job's ranks, usable as ``process_set=`` on every collective.

    Until the set is registered (``hvd.init(process_sets=[...])`` or ``hvd.add_process_set``),
    :meth:`size` and :meth:`rank` return ``None``, as Horovod's do.

    Args:
        ranks_or_comm: the global ranks of the members (any order; duplicates are an error),
            or an mpi4py communicator whose processes are the members.

    Example:
        >>> evens = hvd.ProcessSet([0, 2])
        >>> evens.size() is None  # not registered yet
        True
        >>> hvd.init(process_sets=[evens])
        >>> if evens.included():
        ...     hvd.allreduce(x, process_set=evens)
    """

    def __init__(self, ranks_or_comm: Iterable[int] | MPI.Intracomm) -> None:
        self.mpi_comm: MPI.Intracomm | None = None
        if is_mpi_communicator(ranks_or_comm):
            # An mpi4py communicator: its members are the global ranks it contains.
            self.mpi_comm = ranks_or_comm
            ranks: Iterable[int] = mpi_comm_ranks(ranks_or_comm)
        else:
            ranks = ranks_or_comm
        members = [int(r) for r in ranks]
        if len(set(members)) != len(members):
            raise ValueError(f"ProcessSet ranks must be distinct, got {members}.")
        if any(r < 0 for r in members):
            raise ValueError(f"ProcessSet ranks must be >= 0, got {members}.")
        self.ranks: list[int] = sorted(members)
        self.process_set_id: int | None = None
        self._my_rank: int | None = None

    def _bind(self, process_set_id: int, my_global_rank: int) -> None:
        self.process_set_id = process_set_id
        self._my_rank = my_global_rank

    def _unbind(self) -> None:
        self.process_set_id = None

    def _suspend(self) -> None:
        """The session ended: the set keeps its id, and its queries raise until the next bind
        (the global set's, after ``hvd.shutdown()``)."""
        self._my_rank = None

    def _bound_rank(self) -> int | None:
        """This process's global rank, once the set is registered; ``None`` before."""
        if self.process_set_id is None:
            return None
        if self._my_rank is None:  # the global set, before hvd.init() or after shutdown()
            raise ValueError(NOT_INITIALIZED)
        return self._my_rank

    def size(self) -> int | None:
        """Number of ranks in the set; ``None`` while the set is not registered."""
        if self._bound_rank() is None:
            return None
        return len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set; ``None`` while the set is not registered.

        Raises:
            ValueError: this process is not a member (as Horovod's), or hora is not initialized.
        """
        my_rank = self._bound_rank()
        if my_rank is None:
            return None
        if my_rank not in self.ranks:
            raise ValueError(
                f"Rank {my_rank} is not a member of process set {self.process_set_id} (ranks "
                f"{self.ranks}), so it has no rank in it; check process_set.included() first."
            )
        return self.ranks.index(my_rank)

    def included(self) -> bool | None:
        """Whether this process is a member.

        Before the set is registered: ``None`` for a set made from an MPI communicator (its
        members are known once it is registered), else whether this process's global rank is
        one of ``ranks`` (which needs ``hvd.init()``), as Horovod answers.
        """
        my_rank = self._bound_rank()
        if my_rank is None:
            if self.mpi_comm is not None:
                return None
            # Every hvd.init() binds the global set to this process's rank.
            my_rank = global_process_set._bound_rank()
        return my_rank in self.ranks

    def __repr__(self) -> str:
        return (
            f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
            f"mpi_comm={self.mpi_comm})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ProcessSet):
            return NotImplemented
        return self.ranks == other.ranks and self.process_set_id == other.process_set_id

    def __hash__(self) -> int:
        return hash((tuple(self.ranks), self.process_set_id))


# Every rank of the job: id 0, bound to the running session at each ``init``. One object for the
# life of the process, as Horovod's ``hvd.global_process_set``.
global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def mpi_comm_ranks(comm: MPI.Comm, reference: MPI.Comm | None = None) -> list[int]:
    """The ranks that the processes of the mpi4py communicator ``comm`` have in ``reference``
    (the job's communicator; ``MPI_COMM_WORLD`` when ``None``).

    Raises:
        ValueError: a process of ``comm`` is not in ``reference``.
    """
    from mpi4py import MPI

    reference_group = (reference if reference is not None else MPI.COMM_WORLD).Get_group()
    group = comm.Get_group()
    ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), reference_group)
    if any(r == MPI.UNDEFINED for r in ranks):
        raise ValueError(
            "a process set's MPI communicator holds processes outside the job's communicator "
            "(the one given to hvd.init(comm=...))."
        )
    return sorted(int(r) for r in ranks)


class ProcessSetTable:
    """Registered process sets of this job: id -> sorted global member ranks.

    Id 0 is the global set. Every rank holds an identical table because sets are only added or
    removed through negotiated, identically ordered operations.
    """

    def __init__(self, world_size: int) -> None:
        self._members: dict[int, tuple[int, ...]] = {0: tuple(range(world_size))}
        self._next_id = 1

    def members(self, process_set_id: int) -> tuple[int, ...]:
        """Member ranks of a set.

        Raises:
            ValueError: no set has this id.
        """
        try:
            return self._members[process_set_id]
        except KeyError:
            raise ValueError(
                f"process set {process_set_id} is not registered on this rank (known ids: "
                f"{sorted(self._members)})."
            ) from None

    def contains(self, process_set_id: int) -> bool:
        return process_set_id in self._members

    def find(self, ranks: tuple[int, ...]) -> int | None:
        """Id of a registered set with exactly these members, if any."""
        for set_id, members in self._members.items():
            if members == ranks:
                return set_id
        return None

    def reserve_id(self) -> int:
        set_id = self._next_id
        self._next_id += 1
        return set_id

    def add(self, process_set_id: int, ranks: tuple[int, ...]) -> None:
        self._members[process_set_id] = ranks
        self._next_id = max(self._next_id, process_set_id + 1)

    def remove(self, process_set_id: int) -> None:
        self._members.pop(process_set_id, None)

    def ids(self) -> list[int]:
        return sorted(self._members)


# Horovod's horovod.common.process_sets also holds add_process_set and remove_process_set. They
# register sets through the running session, which stands on this module, so the work is
# hora.common.startup.registration's: that module hands its two functions to this one when it
# loads (every framework adapter and hvd.init load it), and this module imports nothing of it.
# Until then (a script that imports this module first, as Horovod's scripts may), a call has no
# session to register in.
_registration: (
    tuple[Callable[[ProcessSet | list[int]], ProcessSet], Callable[[ProcessSet], bool]] | None
) = None


def add_process_set(process_set: ProcessSet | list[int]) -> ProcessSet:
    """Add a process set on every rank (collective: all ranks call it in the same order);
    Horovod's ``add_process_set``.

    Args:
        process_set: a ``ProcessSet`` or a list of global ranks.

    Raises:
        ValueError: hora is not initialized, dynamic process sets are off, the set is there
            already, or it names ranks outside the job.
    """
    if _registration is None:
        raise ValueError(NOT_INITIALIZED)
    return _registration[0](process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Remove a process set on every rank (collective); whether it was registered. Horovod's
    ``remove_process_set``.

    Raises:
        ValueError: hora is not initialized, dynamic process sets are off, or ``process_set``
            is the global set.
    """
    if _registration is None:
        raise ValueError(NOT_INITIALIZED)
    return _registration[1](process_set)
