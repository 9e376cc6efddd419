"""What one process holds while it takes part in a job, in one place.

:class:`Runtime` is the process's own. It is made once and outlives ``init`` and ``shutdown``,
holding what must: the lock that orders them, how many times hora was started here, whether
the garbage collector was frozen, the exit hooks, the gradient holders, the elastic loop's
count of resets, live metrics' step count, and the stores this process hosts for its job.

:class:`Session` is one ``init``'s: the engine, where this process sits in the job, the store,
the registered process sets, the integer handles callers hold, and how unnamed calls are
numbered. ``init`` makes a new session and ``shutdown`` drops it, so nothing of one job (or of
one elastic round) leaks into the next: a new session numbers its calls from the start, as the
new workers of an elastic round do.

Every module reaches the state through :func:`runtime` (and :func:`session`); none keeps
process state of its own. This module holds state and starts nothing:
:mod:`hora.common.startup.lifecycle` makes and tears down sessions.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hora.common.vocabulary.errors import NOT_INITIALIZED

if TYPE_CHECKING:
    from hora.common.engine import Engine, Handle
    from hora.common.job.store import StoreClient
    from hora.common.job.topology import Topology
    from hora.common.process_sets import ProcessSet
    from hora.common.vocabulary.message import Request

# The integer handle a caller holds: the engine's handle, and what turns its per-tensor results
# into the call's result (``None``: the usual shapes).
HandleEntry = tuple["Handle", Callable[[list[Any]], Any] | None]
# A recent named grouped call's tensors' signature and its requests (see
# ``hora.common.ops.submission``): recognised by kind, name, process set and fields.
GroupedEntry = tuple[tuple[Any, ...], list["Request"]]


@dataclass(eq=False)
class Session:
    """One ``init`` to its ``shutdown``.

    Attributes:
        engine: the running engine.
        topology: where this process sits in the job.
        store: the job's store.
        generation: the number of this start among the process's starts (its store scopes').
        mpi_comm: the job's MPI communicator when MPI plays a part, else ``None``.
        cpu_operations: the library of the job's CPU data path, ``gloo`` or ``mpi``.
        process_sets: the registered process sets by id.
        timeline_path: the timeline this rank writes, if any (rank 0 merges at shutdown).
        handles: the integer handles callers hold, by number.
        unnamed_calls: how many unnamed calls each process set has made (they are named after
            the count, which every member of the set keeps alike).
        grouped_calls: recent named grouped calls' requests, reused while their tensors stay
            alike (at most :data:`GROUPED_CALLS_KEPT`).
        object_calls: numbers the object collectives called without a name.
    """

    engine: Engine
    topology: Topology
    store: StoreClient
    generation: int
    mpi_comm: Any = None
    cpu_operations: str = "gloo"
    process_sets: dict[int, ProcessSet] = field(default_factory=dict)
    timeline_path: str | None = None
    handles: dict[int, HandleEntry] = field(default_factory=dict)
    unnamed_calls: dict[int, int] = field(default_factory=dict)
    grouped_calls: dict[tuple[Any, ...], GroupedEntry] = field(default_factory=dict)
    object_calls: itertools.count[int] = field(default_factory=itertools.count)
    _naming: threading.Lock = field(default_factory=threading.Lock)

    def unnamed_call_number(self, set_id: int) -> int:
        """The number of this call among ``set_id``'s unnamed calls in this session (from 1)."""
        with self._naming:
            count = self.unnamed_calls.get(set_id, 0) + 1
            self.unnamed_calls[set_id] = count
            return count


# Named grouped calls whose requests a session keeps.
GROUPED_CALLS_KEPT = 64


@dataclass(eq=False)
class LiveMetrics:
    """Live metrics' state (see :mod:`hora.common.metrics`).

    Attributes:
        publisher: what publishes this rank's steps now (``None``: nothing).
        context: the engine's counters and this rank's place, while a session runs.
        steps_done: steps published before the current publisher (numbering goes on across
            ``stop``/``start`` and elastic rounds).
        lock: orders starting and stopping.
    """

    publisher: Any = None
    context: Any = None
    steps_done: int = 0
    lock: threading.RLock = field(default_factory=threading.RLock)


@dataclass(eq=False)
class HostedStores:
    """The store servers this process hosts for its job (rank 0 under ``srun``, ``mpirun``),
    by address; they outlive ``shutdown`` so that a later ``init`` of the same job finds them,
    and the process lingers at exit until every rank has detached.

    Attributes:
        servers: the servers by ``(address, port)``.
        linger: what the exit hook needs to wait for the other ranks.
        lock: orders starting servers.
    """

    servers: dict[tuple[str, int], Any] = field(default_factory=dict)
    linger: dict[str, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Runtime:
    """The process's state (see the module docstring).

    Attributes:
        lock: orders ``init``, ``shutdown`` and the changes of the session.
        session: the running session, or ``None`` outside ``init``/``shutdown``.
        starts: how many sessions this process has started (the next one's generation).
        exit_hooks_installed: whether the exit hooks are in place (once per process).
        exit_cause: an uncaught exception that is ending the process, for the job's report.
        log_rank: the rank hora's log lines name (the last session's; ``None`` before the
            first).
        logging_configured: whether hora's log handler is in place (once per process).
        gc_frozen: whether the process froze its objects (``gc.freeze()``) at its first start.
        holders: the gradient holders holding tensors back now (weak: one that is gone holds
            nothing).
        elastic_resets: how many times ``hvd.elastic.run`` re-formed the job here.
        elastic_entered: whether this process entered an elastic function yet.
        elastic_store: the connection rank 0 reads the driver's host-change notices through
            (made at its first check).
        metrics: live metrics' state.
        hosted_stores: the store servers this process hosts for its job.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.session: Session | None = None
        self.starts = 0
        self.exit_hooks_installed = False
        self.exit_cause: str | None = None
        self.log_rank: int | None = None
        self.logging_configured = False
        self.gc_frozen = False
        self.holders: weakref.WeakSet[Any] = weakref.WeakSet()
        self.elastic_resets = 0
        self.elastic_entered = False
        self.elastic_store: Any = None
        self.metrics = LiveMetrics()
        self.hosted_stores = HostedStores()


_RUNTIME = Runtime()


def runtime() -> Runtime:
    """This process's runtime."""
    return _RUNTIME


def session() -> Session:
    """The running session.

    Raises:
        ValueError: ``init`` has not been called (or ``shutdown`` has).
    """
    current = _RUNTIME.session
    if current is None:
        raise ValueError(NOT_INITIALIZED)
    return current
