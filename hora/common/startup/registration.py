"""Registering process sets: the lists every rank registers at ``init``, and the sets added or
removed while the job runs (``hvd.add_process_set``, ``hvd.remove_process_set``).

Registration is collective: every rank registers the same member lists in the same order, so
that a set has the same id everywhere. Sets made from mpi4py communicators may differ from rank
to rank (each rank passes its own part of a ``Split``, as Horovod allows): the ranks gather each
other's lists first. This module binds :class:`~hora.common.process_sets.ProcessSet` objects to
their ids in the running session; the engine keeps the table the collectives use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hora.common import process_sets as horovod_process_sets
from hora.common.job.topology import Topology
from hora.common.process_sets import ProcessSet, global_process_set, mpi_comm_ranks
from hora.common.runtime import Session, session

if TYPE_CHECKING:
    from mpi4py import MPI


def translate_mpi_sets(sets: list[ProcessSet], job_comm: MPI.Comm | None) -> list[ProcessSet]:
    """Process sets made from mpi4py communicators get the ranks they have in ``job_comm``."""
    if job_comm is not None:
        for process_set in sets:
            if isinstance(process_set, ProcessSet) and process_set.mpi_comm is not None:
                process_set.ranks = mpi_comm_ranks(process_set.mpi_comm, job_comm)
    return sets


def _member_lists(sets: list[ProcessSet], size: int) -> list[tuple[int, ...]]:
    """The ranks of each process set passed to ``init``, checked."""
    member_lists: list[tuple[int, ...]] = []
    for process_set in sets:
        if not isinstance(process_set, ProcessSet):
            raise ValueError(
                f"process_sets must hold hvd.ProcessSet objects, got {type(process_set)}."
            )
        bad = [r for r in process_set.ranks if r >= size]
        if bad:
            raise ValueError(
                f"{process_set} names ranks {bad}, but the job has only {size} "
                f"processes (ranks 0..{size - 1})."
            )
        ranks = tuple(process_set.ranks)
        if ranks in member_lists or ranks == tuple(range(size)):
            raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
        member_lists.append(ranks)
    return member_lists


def _distinct(gathered: list[list[tuple[int, ...]]]) -> list[tuple[int, ...]]:
    """Every member list of every rank's lists, once each, in rank order."""
    found: list[tuple[int, ...]] = []
    for lists in gathered:
        for ranks in lists:
            if tuple(ranks) not in found:
                found.append(tuple(ranks))
    return found


def registered_lists(
    sets: list[ProcessSet], size: int, job_comm: MPI.Comm | None
) -> tuple[list[tuple[int, ...]], list[int]]:
    """The member lists every rank registers at ``init``, and where each of ``sets`` is
    among them."""
    lists = _member_lists(sets, size)
    if job_comm is None or not any(s.mpi_comm is not None for s in sets):
        return lists, list(range(len(lists)))
    registered = _distinct(job_comm.allgather(lists))
    return registered, [registered.index(ranks) for ranks in lists]


def bind_initial(
    current: Session, sets: list[ProcessSet], topology: Topology, positions: list[int]
) -> None:
    """Give the global set and the sets passed to ``init`` their ids: 1 + their ``positions``
    among the registered lists."""
    global_process_set.ranks = list(range(topology.size))
    global_process_set._bind(0, topology.rank)
    current.process_sets = {0: global_process_set}
    for position, process_set in zip(positions, sets):
        set_id = position + 1
        process_set._bind(set_id, topology.rank)
        current.process_sets[set_id] = process_set


def unbind_all(current: Session) -> None:
    """The session ends: the sets it registered lose their ids; the global set keeps its, and
    its queries raise until the next ``init``, as Horovod's do."""
    for process_set in current.process_sets.values():
        if process_set is not global_process_set:
            process_set._unbind()
    global_process_set._suspend()
    current.process_sets = {}


def _dynamic_sets_required(action: str) -> ValueError:
    return ValueError(
        "Set HORA_DYNAMIC_PROCESS_SETS=1 (or HOROVOD_DYNAMIC_PROCESS_SETS=1, or "
        f"hvd.init(process_sets='dynamic')) to allow {action} process sets after initialization."
    )


def register_process_set(process_set: ProcessSet | list[int]) -> ProcessSet:
    """Add a process set on every rank (collective: all ranks call it in the same order).

    Args:
        process_set: a ``ProcessSet`` or a list of global ranks.

    Raises:
        ValueError: dynamic process sets are off, the set is there already, or it names ranks
            outside the job.
    """
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    current = session()
    translate_mpi_sets([process_set], current.mpi_comm)
    engine = current.engine
    if not engine.settings.dynamic_process_sets:
        raise _dynamic_sets_required("adding")
    ranks = tuple(process_set.ranks)
    if engine.process_sets.find(ranks) is not None:
        raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
    bad = [r for r in ranks if r >= engine.size]
    if bad:
        raise ValueError(f"{process_set} names ranks {bad} outside 0..{engine.size - 1}.")
    if process_set.mpi_comm is not None and current.mpi_comm is not None:
        # Each rank may pass its own part of a split communicator: every part is added, in
        # the same order on every rank (those already registered are left as they are).
        for other in _distinct(current.mpi_comm.allgather([ranks])):
            if other != ranks and engine.process_sets.find(other) is None:
                engine.register_process_set(other).wait()
    set_id = engine.register_process_set(ranks).wait()[0]
    process_set._bind(set_id, engine.rank)
    current.process_sets[set_id] = process_set
    return process_set


def unregister_process_set(process_set: ProcessSet) -> bool:
    """Remove a process set on every rank (collective). Returns whether it was registered.

    Raises:
        ValueError: dynamic process sets are off, or ``process_set`` is the global set.
    """
    current = session()
    engine = current.engine
    if not engine.settings.dynamic_process_sets:
        raise _dynamic_sets_required("removing")
    if process_set.process_set_id == 0:
        raise ValueError("The global process set cannot be removed.")
    if (
        process_set.process_set_id is None
        or engine.process_sets.find(tuple(process_set.ranks)) is None
    ):
        return False
    engine.register_process_set(tuple(process_set.ranks), remove=True).wait()
    current.process_sets.pop(process_set.process_set_id, None)
    process_set._unbind()
    return True


# Horovod's horovod.common.process_sets holds these two under its own names: hora's module of
# that path calls them once this module is loaded, where the session they need is known.
horovod_process_sets._registration = (register_process_set, unregister_process_set)
