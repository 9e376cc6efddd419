"""What one process holds while it takes part in a job, in one place.

:class:`Runtime` is the process's own. It is made once and outlives ``init`` and ``shutdown``,
holding what must: the lock that orders them, how many times hora was started here, whether
the garbage collector was frozen, the exit hooks, the gradient holders, the elastic rounds this
process joined, live metrics' step count, the stores this process hosts for its job (a Ray
worker's included), and what the transports and the framework adapters keep for the whole
process.

:class:`Session` is one ``init``'s: the engine, where this process sits in the job, the store,
the registered process sets, the integer handles callers hold, and how unnamed calls are
numbered (what the engine keeps for itself is the engine's). ``init`` makes a new session and ``shutdown`` drops it, so nothing of one job (or of
one elastic round) leaks into the next: a new session numbers its calls from the start, as the
new workers of an elastic round do.

Every module reaches the state through :func:`runtime` (and :func:`session`); none keeps
process state of its own (``tests/unit/test_module_state.py`` checks every module of hora).
This module holds state and starts nothing: :mod:`hora.common.startup.lifecycle` makes and
tears down sessions. It imports the rest of hora for its annotations only, and only modules
that do not import it back (``tests/unit/test_guards.py`` finds cycles through annotations
too): the types of the parts that keep their state here are the small protocols below.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from hora.common.vocabulary.errors import NOT_INITIALIZED

if TYPE_CHECKING:
    import torch
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from mpi4py import MPI

    from hora.common.engine import Engine, Handle
    from hora.common.engine.counters import Counters
    from hora.common.job.round_plan import RoundPlan
    from hora.common.job.store import StoreClient
    from hora.common.job.store_service import StoreServer
    from hora.common.job.topology import Topology
    from hora.common.process_sets import ProcessSet
    from hora.common.vocabulary.message import ReduceOp, Request

# The integer handle a caller holds: the engine's handle, and what turns its per-tensor results
# into the call's result (``None``: the usual shapes).
HandleEntry = tuple["Handle", Callable[[list[Any]], Any] | None]
# A recent named grouped call's tensors' signature and its requests (see
# ``hora.common.ops.submission``): recognised by kind, name, process set and fields.
GroupedEntry = tuple[tuple[object, ...], list["Request"]]

# The parts of hora that keep their state here also read it from here, so this module names
# their types by what it needs of them (the classes themselves import this module).


class GradientHolder(Protocol):
    """Something that holds tensors back before submitting them (``DistributedOptimizer``; see
    ``hora.common.ops.submission.hold``)."""

    def release_held(self) -> None:
        """Submit what this thread holds."""


class StepPublisher(Protocol):
    """What publishes a rank's training steps as live metrics (``hora.common.metrics``'s
    ``Publisher``)."""

    @property
    def step(self) -> int:
        """The number of the step being timed (steps before this publisher included)."""

    def gradient_ready(self) -> None:
        """A gradient was handed to the engine (marks the step's backward pass)."""

    def optimizer_stepped(self) -> None:
        """The optimizer's step ended a training step."""

    def log_step(self, batch_size: int | None, scalars: Mapping[str, float]) -> None:
        """The user's values of the step (``hvd.metrics.log_step``)."""

    def close(self) -> None:
        """Stop publishing (close every sink)."""


class EngineFacts(Protocol):
    """What starting live metrics needs of the running engine (``hora.common.metrics``)."""

    @property
    def counters(self) -> Counters:
        """What the engine did."""

    @property
    def rank(self) -> int:
        """This process's rank."""

    @property
    def local_rank(self) -> int:
        """Its rank on its host."""


class MPIReductions(Protocol):
    """MPI's reduction ops by (dtype, op), the ones made for 16-bit floats included
    (``hora.common.transport.mpi.Reductions``)."""

    def get(self, dtype: torch.dtype, op: ReduceOp) -> MPI.Op:
        """The MPI op that reduces ``dtype`` buffers with ``op``."""


class ElasticJob(Protocol):
    """What ``hvd.elastic.run`` and the elastic states ask of the elastic job this process runs
    in (``hora.common.elastic.job``: ``DriverJob`` is ``horarun``'s)."""

    def active(self) -> bool:
        """Whether this process was started by an elastic ``horarun``."""

    def current_round(self) -> RoundPlan | None:
        """The plan of the round this process joined last (``None``: none yet)."""

    def host_update(self) -> tuple[int, int]:
        """Rank 0's look at the driver's latest host-change notice, ``(number, flags)``;
        ``(0, 0)`` when there is none."""

    def request_reset(self) -> None:
        """Ask the driver for a new round (this round's collectives failed). Best effort."""

    def rejoin(self) -> None:
        """Leave the current round and join the next one (``hvd.shutdown(); hvd.init()``).

        Raises:
            hora.common.job.rounds.WorkerRemoved: the next round leaves this worker out.
        """


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
    mpi_comm: MPI.Intracomm | None = None
    cpu_operations: str = "gloo"
    process_sets: dict[int, ProcessSet] = field(default_factory=dict)
    timeline_path: str | None = None
    handles: dict[int, HandleEntry] = field(default_factory=dict)
    unnamed_calls: dict[int, int] = field(default_factory=dict)
    grouped_calls: dict[tuple[object, ...], GroupedEntry] = field(default_factory=dict)
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

    publisher: StepPublisher | None = None
    context: EngineFacts | None = None
    steps_done: int = 0
    lock: threading.RLock = field(default_factory=threading.RLock)


@dataclass(eq=False)
class Linger:
    """What the exit hook of a process that hosts the job's store needs to wait until every
    other rank has detached (see :mod:`hora.common.job.joining`).

    Attributes:
        store: a connection to the hosted store (``None``: nothing to wait for).
        generation: the start whose detach marks the hook waits for.
        size: the job's size then.
        rank: this process's rank then.
        registered: whether the exit hook is in place (once per process).
    """

    store: StoreClient | None = None
    generation: int = 0
    size: int = 0
    rank: int = 0
    registered: bool = False


class HostedStore(Protocol):
    """A job's store that this process serves (a Ray worker's is
    ``hora.runner.store_server.RendezvousServer``)."""

    def close(self) -> None:
        """Stop serving the store."""


@dataclass(eq=False)
class HostedStores:
    """The store servers this process hosts for its job (rank 0 under ``srun``, ``mpirun``),
    by address; they outlive ``shutdown`` so that a later ``init`` of the same job finds them,
    and the process lingers at exit until every rank has detached. A Ray worker hosts its
    job's store between the Ray driver's calls, by name.

    Attributes:
        servers: each server and the secret it was started with, by ``(address, port)``.
        linger: what the exit hook needs to wait for the other ranks.
        named: the stores kept under a name of their host's choosing (a Ray worker's, by the
            token of the start that made them; see :func:`hora.common.job.store.keep_hosted`).
        receiving_key: this process's X25519 key, which a job secret sealed to it is opened
            with (a Ray worker's; made at first use).
        lock: orders starting servers, keeping them and making the key.
    """

    servers: dict[tuple[str, int], tuple[StoreServer, str]] = field(default_factory=dict)
    linger: Linger = field(default_factory=Linger)
    named: dict[str, HostedStore] = field(default_factory=dict)
    receiving_key: X25519PrivateKey | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(eq=False)
class RoundProgress:
    """The elastic rounds this process took part in, across ``init`` calls (see
    :mod:`hora.common.job.rounds`).

    Attributes:
        last_round: the newest round this process joined (or abandoned); -1 before any.
        plan: that round's plan (``None``: no round joined yet).
        forming: the round's store while ``hvd.init()`` connects to its workers (its waits end
            when the round is lost); ``None`` once the round formed.
    """

    last_round: int = -1
    plan: RoundPlan | None = None
    forming: StoreClient | None = None


@dataclass(eq=False)
class MPIProcess:
    """What the MPI transport keeps for the whole process (see
    :mod:`hora.common.transport.mpi`).

    Attributes:
        reductions: MPI's reduction ops, and the ones hora made for 16-bit floats (made at
            the first reduction; an op made with ``MPI_Op_create`` serves every communicator).
        abort_at_exit: whether an MPI call of this process is stuck for good, so that the
            process ends the MPI job with ``MPI_Abort`` at exit (the hook is in place).
        lock: orders putting that hook in place.
    """

    reductions: MPIReductions | None = None
    abort_at_exit: bool = False
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
        shm_private_told: whether the shared-memory transport said once that it keeps its
            segments in private directories.
        mpi: what the MPI transport keeps for the process.
        rounds: the elastic rounds this process took part in.
        elastic_job: what ``hvd.elastic.run`` and the elastic states ask of the elastic job
            (``None`` until first asked: then ``horarun``'s driver, through the job's store;
            tests put one of their own here).
        elastic_resets: how many times ``hvd.elastic.run`` re-formed the job here.
        elastic_entered: whether this process entered an elastic function yet.
        elastic_store: the connection rank 0 reads the driver's host-change notices through
            (made at its first check).
        state_handlers: the ``(type, handler class)`` pairs a framework's elastic state
            consults, first match wins (``None`` until the adapter's defaults are first read or
            the user sets them: ``hvd.elastic.get_handler_registry``).
        sharded_optimizers: numbers the sharded (ZeRO) optimizers of the process in the order
            they are made, the same on every rank: the names of their collectives.
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
        self.holders: weakref.WeakSet[GradientHolder] = weakref.WeakSet()
        self.shm_private_told = False
        self.mpi = MPIProcess()
        self.rounds = RoundProgress()
        self.elastic_job: ElasticJob | None = None
        self.elastic_resets = 0
        self.elastic_entered = False
        self.elastic_store: StoreClient | None = None
        self.state_handlers: list[tuple[type, type]] | None = None
        self.sharded_optimizers: itertools.count[int] = itertools.count()
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
