"""Process-wide state: ``init``, ``shutdown``, topology queries and build information.

Exactly one engine runs per process. This module creates it from the environment, answers
topology questions, and tears it down. It does not know the framework's tensors.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

from hora.common import metrics
from hora.common.config import Settings, flag, lookup, start_timeout_s
from hora.common.engine import Engine
from hora.common.errors import NOT_INITIALIZED
from hora.common.job import joining
from hora.common.job import rounds as elastic
from hora.common.job.launchers import mpi_identity
from hora.common.job.store import StoreClient
from hora.common.job.store_keys import GenerationKeys
from hora.common.job.topology import Topology, detect
from hora.common.process_sets import ProcessSet, mpi_comm_ranks
from hora.common.timeline_writer import Timeline, merge, rank_path
from hora.common.transport import Communicator, TransportError, prove_peers

logger = logging.getLogger("hora")

global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.engine: Engine | None = None
        self.topology: Topology | None = None
        self.store: StoreClient | None = None
        self.generation = 0
        # The generation the running engine was started with (its store scopes' number).
        self.engine_generation = 0
        self.process_sets: dict[int, ProcessSet] = {}
        self.atexit_registered = False
        self.exit_cause: str | None = None
        # The timeline path this process wrote last (rank 0 merges the ranks' files at exit).
        self.timeline_path: str | None = None
        # The running job's MPI communicator (mpi4py) when it uses MPI, else ``None``.
        self.mpi_comm: Any = None
        # The library of the running job's data path: "gloo" or "mpi".
        self.cpu_operations = ""
        # Whether this process froze its objects (``gc.freeze()``) at its first ``init``.
        self.gc_frozen = False


_state = _State()


class _RankFilter(logging.Filter):
    """Puts this process's current rank into log records (it changes in elastic jobs)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "hora_rank"):  # a record made while joining names its rank
            topology = _state.topology
            record.hora_rank = topology.rank if topology is not None else "?"
        return True


def _configure_logging(level: str) -> None:
    if getattr(_configure_logging, "done", False):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RankFilter())
    hide_time = flag("LOG_HIDE_TIME")
    fmt = "[%(levelname)s hora rank %(hora_rank)s] %(message)s"
    if not hide_time:
        fmt = "[%(asctime)s " + fmt[1:]
    handler.setFormatter(logging.Formatter(fmt))
    logger.addHandler(handler)
    logger.setLevel("DEBUG" if level == "TRACE" else ("CRITICAL" if level == "FATAL" else level))
    logger.propagate = False
    _configure_logging.done = True  # type: ignore[attr-defined]


def _communicator_factory(
    topology: Topology, settings: Settings, store: StoreClient, mpi_comm: Any = None
) -> Any:
    """Builds the communicators of the job's process sets and of its control plane.

    With ``HORA_CPU_OPERATIONS=mpi`` every one of them is an MPI communicator of its own, made
    from ``mpi_comm`` (the job's); otherwise a Gloo group built on the store. The negotiation
    moves to MPI with the data: every rank is in the job's communicator anyway, its small
    messages then take the MPI library's fastest path (shared memory, the fabric), and the job
    opens no Gloo connections at all. Its own communicator keeps it apart from the data.
    """
    if settings.cpu_operations == "mpi":
        return _mpi_factory(topology, settings, store, mpi_comm)
    from hora.common.transport.gloo import GlooCommunicator, make_device, raise_open_file_limit

    old, new = raise_open_file_limit()
    if new != old:
        logger.debug("rank %d raised its open-file limit from %d to %d", topology.rank, old, new)
    interface = lookup("GLOO_IFACE") or os.environ.get("GLOO_SOCKET_IFNAME", "")
    bind = "127.0.0.1" if topology.all_local and not interface else ""
    device = make_device(bind, interface)

    def factory(scope: str, rank: int, size: int) -> Communicator:
        comm = GlooCommunicator(store.scoped(scope), rank, size, settings.gloo_timeout_s, device)
        return _proved(comm, store, scope)

    return factory


def _proved(comm: Communicator, store: StoreClient, scope: str) -> Communicator:
    """``comm`` once its members proved to each other that they hold the job secret (see
    :func:`hora.common.transport.prove_peers`); aborted, and the error raised, if not."""
    try:
        prove_peers(comm, store.secret, scope)
    except TransportError:
        comm.abort()
        raise
    return comm


def _gpu_communicator_factory(settings: Settings, store: StoreClient) -> Any:
    """Builds the NCCL communicators that move CUDA tensors (``HORA_GPU_OPERATIONS=nccl``), or
    ``None`` where CUDA tensors go through host memory (``host``, or a torch without NCCL).

    The factory returns ``None`` for a set whose members share a GPU (NCCL needs one per
    member): that set's CUDA tensors go through host memory, as every member learns from the
    same exchange. Each group proves the job secret over its own connections once it is made,
    as Gloo's do.
    """
    from hora.common.transport.nccl import (
        NCCLCommunicator,
        gpu_identity,
        nccl_compiled,
        shared_gpus,
    )

    if settings.gpu_operations != "nccl" or not nccl_compiled():
        return None
    from hora.common.engine.replay import steady_batch_timeout_s

    longest_s = steady_batch_timeout_s(settings)

    def factory(scope: str, rank: int, size: int, device: Any) -> Communicator | None:
        name = f"{scope}/gpu-of/"
        store.set_signed(name + str(rank), gpu_identity(device).encode())
        try:
            identities = [store.get_signed(name + str(r)).decode() for r in range(size)]
        except RuntimeError as exc:
            raise TransportError(f"the members of {scope} did not all arrive: {exc}") from exc
        shared = shared_gpus(identities)
        if shared:
            if rank == 0:
                logger.warning(
                    "members %s of a process set share a GPU; NCCL needs one GPU per process, "
                    "so that set's CUDA tensors go through host memory. Pin each process to its "
                    "own GPU (torch.cuda.set_device(hvd.local_rank())) to use NCCL.",
                    "; ".join(str(group) for group in shared),
                )
            return None
        comm = NCCLCommunicator(
            store.scoped(scope), rank, size, settings.gloo_timeout_s, device, longest_s
        )
        return _proved(comm, store, scope)

    return factory


def _mpi_factory(topology: Topology, settings: Settings, store: StoreClient, job_comm: Any) -> Any:
    """MPI communicators: a duplicate of the job's for a set of every rank (the control plane
    and the global set), else a group of it made by the members alone.

    The members of a smaller set learn each other's ranks through the store (the factory is
    given only this process's place in the set), then call ``MPI_Comm_create_group``. Nothing is
    proved with the job secret here, unlike over Gloo: MPI's connections are made by the MPI
    library among the processes its launcher started, and no port of hora's is open to them.
    """
    from hora.common.transport.mpi import MPICommunicator, import_mpi

    mpi = import_mpi()

    def factory(scope: str, rank: int, size: int) -> Communicator:
        members = None
        if size != topology.size:
            name = f"{scope}/mpi-member/"
            store.set_signed(name + str(rank), str(topology.rank).encode())
            try:
                members = [int(store.get_signed(name + str(r))) for r in range(size)]
            except RuntimeError as exc:
                raise TransportError(f"the members of {scope} did not all arrive: {exc}") from exc
        return MPICommunicator.of(job_comm, members, settings.gloo_timeout_s, mpi)

    return factory


def _mpi_job_comm(comm: Any, topology: Topology, settings: Settings) -> Any:
    """The job's MPI communicator: ``comm`` (an mpi4py communicator, or world ranks), or
    ``MPI_COMM_WORLD`` when MPI carries the data; ``None`` when MPI plays no part.

    Raises:
        ValueError: MPI is asked for but is not available, or ``comm`` does not fit the job.
    """
    if comm is None and settings.cpu_operations != "mpi":
        return None
    why = "hvd.init(comm=...)" if comm is not None else "HORA_CPU_OPERATIONS=mpi"
    launched_by_mpi = mpi_identity(os.environ) is not None
    if not launched_by_mpi and (topology.size > 1 or comm is not None):
        raise ValueError(
            f"{why} needs a job started by MPI's launcher, but {topology.source} started this "
            f"one. Start it with `mpirun -np N python train.py` or `horarun --mpi -np N python "
            "train.py`, or use Gloo (HORA_CPU_OPERATIONS=gloo, horarun --gloo)."
        )
    from hora.common.transport.mpi import import_mpi

    try:
        mpi = import_mpi()
    except TransportError as exc:
        raise ValueError(f"{why}: {exc}") from exc
    world = mpi.COMM_WORLD
    if launched_by_mpi and world.Get_size() != topology.size:
        raise ValueError(
            f"{why}: {topology.source} started {topology.size} processes, but mpi4py's "
            f"MPI_COMM_WORLD has {world.Get_size()}: mpi4py is built for another MPI than the "
            "one that launched the job. Install mpi4py for this MPI (pip install mpi4py builds "
            "it against the mpicc on PATH), or set HORA_CPU_OPERATIONS=gloo."
        )
    if comm is None:
        return world.Dup()
    if hasattr(comm, "Get_group") and hasattr(comm, "Dup"):
        return comm.Dup()
    ranks = [int(r) for r in comm]
    if world.Get_rank() not in ranks:
        raise ValueError(
            f"hvd.init(comm={ranks}): this process (MPI_COMM_WORLD rank {world.Get_rank()}) is "
            "not one of the listed ranks; only they call hvd.init with this list."
        )
    group = world.Get_group().Incl(ranks)
    made = world.Create_group(group)
    group.Free()
    return made


def _sub_job(topology: Topology, job_comm: Any) -> Topology:
    """The topology of a job that is ``job_comm``'s processes, a part of the MPI job: ranks
    are the communicator's; local ranks come from the exchange of host names; the store is
    hosted by its rank 0 and handed out over it (joining with mpi4py)."""
    from dataclasses import replace

    launch = topology.launch
    if launch is None or not launch.plan.mpi4py:
        raise ValueError(
            "hvd.init(comm=...) hands out the job's store over that communicator with mpi4py: "
            "unset HORA_MPI4PY=0 and start the job with mpirun/mpiexec."
        )
    rank, size = job_comm.Get_rank(), job_comm.Get_size()
    if size == topology.size:
        return topology
    plan = replace(launch.plan, host=rank == 0, port=0, job_id=f"{launch.plan.job_id}/comm")
    # Every process of the MPI job on this host: so is every process of this part of it.
    all_local = launch.local_size is not None and launch.local_size == launch.size
    reading = replace(
        launch,
        rank=rank,
        size=size,
        local_rank=None,
        local_size=size if all_local else None,
        cross_rank=None,
        cross_size=None,
        plan=plan,
    )
    return replace(topology, rank=rank, size=size, launch=reading)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Keep Python's cyclic garbage collector from walking torch's objects during ``init``, and,
    with ``HORA_GC_FREEZE`` (the default), for the rest of the run.

    Right after ``import torch`` the collector is due a full collection: it walks every object
    torch made (several hundred thousand; about 0.1 s) and finds next to nothing. Joining the
    job allocates enough to set it off, and later full collections walk them all again, on one
    rank at a time, while the others wait in the next collective. The collector is paused while
    hora joins. At the process's first ``init`` that starts an engine, ``gc.freeze()`` then moves
    every object alive at that point (modules, torch's state, hora's engine) out of its reach.
    Reference counting still frees them; only reference cycles among them would stay. Later
    ``init`` calls (after ``shutdown``, in elastic rounds) freeze nothing: what earlier rounds
    left behind stays collectable.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        if not _state.gc_frozen and is_initialized() and flag("GC_FREEZE", True):
            gc.freeze()
            _state.gc_frozen = True
    finally:
        if enabled:
            gc.enable()


def init(comm: Any = None, process_sets: list[ProcessSet] | str | None = None) -> None:
    """Start hora in this process: join the job's other processes and start the engine.

    Args:
        comm: the processes of the job, as an mpi4py communicator or a list of
            ``MPI_COMM_WORLD`` ranks (only they call ``init``); ``None``: every process the
            launcher started. Needs a job started by ``mpirun``/``mpiexec`` and mpi4py; ranks
            are then the communicator's. Data moves over MPI when ``HORA_CPU_OPERATIONS=mpi``.
        process_sets: ``ProcessSet`` objects to register on every rank (all ranks pass the same
            list), or ``"dynamic"`` to allow ``add_process_set`` later.

    Raises:
        ValueError: the arguments or the launcher's variables are invalid.
        HoraInternalError: the other ranks could not be reached.

    Example:
        >>> import hora.torch as hvd
        >>> hvd.init()
        >>> print(hvd.rank(), hvd.size())
    """
    with _state.lock, _collector_paused():
        if _state.engine is not None:
            if _state.engine.running:
                return
            # The engine stopped on its own (the job was shut down after a failure, a stall or
            # a deadlock): release it, then start again, as after hvd.shutdown().
            _stop_engine(None)
        dynamic = process_sets == "dynamic"
        sets: list[ProcessSet] = [] if dynamic or process_sets is None else list(process_sets)  # type: ignore[arg-type]
        settings = Settings.from_env()
        if dynamic:
            settings = _replace(settings, dynamic_process_sets=True)
        topology, store, generation, mpi_comm = _join_job(settings, comm)
        _state.mpi_comm = mpi_comm
        _state.cpu_operations = settings.cpu_operations
        sets = _translate_mpi_sets(sets, mpi_comm)
        registered, positions = _registered_lists(sets, topology.size, mpi_comm)
        # From here log lines name this rank (in an elastic job it changes from round to round).
        _state.topology = topology
        engine = Engine(
            topology,
            settings,
            store,
            _communicator_factory(
                topology, settings, store, mpi_comm.Dup() if mpi_comm is not None else None
            ),
            generation=generation,
            process_sets=registered,
            device_communicator_factory=_gpu_communicator_factory(settings, store),
        )
        path = lookup("TIMELINE")
        if path:
            _open_timeline(engine, path, flag("TIMELINE_MARK_CYCLES"))
        metrics.attach(engine.counters, topology.rank, topology.local_rank)
        _state.generation += 1
        _state.engine_generation = generation
        engine.start()
        _state.engine = engine
        _state.topology = topology
        _state.store = store
        _bind_process_sets(sets, topology, positions)
        _install_exit_hooks()
        logger.debug("initialized: %s", topology)


def _join_job(settings: Settings, comm: Any) -> tuple[Topology, StoreClient, int, Any]:
    """Where this process runs, the job's store, the generation of its keys, and the job's MPI
    communicator (``None`` when MPI plays no part)."""
    if elastic.active():
        if comm is not None or settings.cpu_operations == "mpi":
            raise ValueError(
                "an elastic job runs over Gloo: MPI cannot add or remove processes of a running "
                "job. Drop hvd.init(comm=...) and HORA_CPU_OPERATIONS=mpi."
            )
        # An elastic horarun: the driver assigns ranks round by round, and each round
        # keeps its keys under its own prefix, so every round's scopes start at 0.
        _configure_logging(settings.log_level)
        topology, store = elastic.join()
        return topology, store, 0, None
    topology = detect()
    _configure_logging(settings.log_level)
    mpi_comm = _mpi_job_comm(comm, topology, settings)
    if comm is not None:
        topology = _sub_job(topology, mpi_comm)
    # Under horarun the store is the launcher's; under other launchers rank 0 (or the
    # launcher) hosts it and local/cross ranks may still need an exchange.
    generation = _state.generation
    topology, store = joining.join(
        topology, start_timeout_s(), generation, mpi_comm if comm is not None else None
    )
    return topology, store, generation, mpi_comm


def _translate_mpi_sets(sets: list[ProcessSet], job_comm: Any) -> list[ProcessSet]:
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


def _bind_process_sets(sets: list[ProcessSet], topology: Topology, positions: list[int]) -> None:
    """Give the global set and the sets passed to ``init`` their ids: 1 + their ``positions``
    among the registered lists."""
    global_process_set.ranks = list(range(topology.size))
    global_process_set._bind(0, topology.rank)
    _state.process_sets = {0: global_process_set}
    for position, process_set in zip(positions, sets):
        set_id = position + 1
        process_set._bind(set_id, topology.rank)
        _state.process_sets[set_id] = process_set


def _install_exit_hooks() -> None:
    """Once per process: shut down at exit, and remember an uncaught exception as the cause."""
    if _state.atexit_registered:
        return
    atexit.register(_shutdown_at_exit)
    previous_hook = sys.excepthook

    def _record_uncaught(kind: Any, value: Any, tb: Any) -> None:
        _state.exit_cause = f"{kind.__name__}: {value}"
        previous_hook(kind, value, tb)

    sys.excepthook = _record_uncaught
    _state.atexit_registered = True


def _replace(settings: Settings, **changes: Any) -> Settings:
    from dataclasses import replace

    return replace(settings, **changes)


def _shutdown_at_exit() -> None:
    engine = _state.engine
    if engine is None:
        return
    reason = f"rank {engine.rank} is exiting (hvd.shutdown() ran at process exit)"
    if _state.exit_cause:
        reason = f"rank {engine.rank} is exiting after an uncaught {_state.exit_cause}"
    engine.report_cause(reason)
    shutdown(reason)


def _open_timeline(engine: Engine, path: str, mark_cycles: bool) -> None:
    """Start writing ``path``'s file for this rank (closing any timeline before it).

    Raises:
        ValueError: the file cannot be created; the message names the rank and the file.
    """
    previous = engine.timeline
    try:
        engine.timeline = Timeline(path, engine.rank, mark_cycles)
    except OSError as exc:
        raise ValueError(
            f"rank {engine.rank}: cannot write the timeline file "
            f"{rank_path(path, engine.rank)} ({exc.strerror or exc}). Point HORA_TIMELINE "
            "(or hvd.start_timeline, or horarun --timeline-filename) at a directory this "
            "rank can write to."
        ) from exc
    if previous is not None:
        previous.close()
    _state.timeline_path = path


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a timeline (every rank calls it; rank r > 0 writes ``FILE.rank<r>``).

    See docs/profiling.md. A timeline already running is closed first.

    Raises:
        ValueError: ``init`` has not been called.
    """
    with _state.lock:
        _open_timeline(engine(), os.fspath(file_path), mark_cycles)


def stop_timeline() -> None:
    """Stop writing the timeline and close this rank's file (valid JSON from then on)."""
    with _state.lock:
        current = _state.engine
        if current is not None and current.timeline is not None:
            timeline, current.timeline = current.timeline, None
            timeline.close()


# How long rank 0 waits at shutdown for the other ranks' timeline files to be closed.
TIMELINE_MERGE_WAIT_S = 5.0


def _finish_timeline(engine: Engine, store: StoreClient | None) -> None:
    """Close this rank's timeline; rank 0 merges the ranks' files if the job ended well."""
    if engine.timeline is not None:
        engine.timeline.close()
        engine.timeline = None
    path, _state.timeline_path = _state.timeline_path, None
    if path is None or engine.failure is not None:
        return
    key = GenerationKeys(_state.engine_generation).timeline_closed()
    try:
        if engine.size > 1 and store is not None:
            if engine.rank != 0:
                store.set_signed(key + str(engine.rank), b"")
                return
            closed = [
                store.wait(key + str(r), TIMELINE_MERGE_WAIT_S) for r in range(1, engine.size)
            ]
            if not all(closed):
                why = f"not every rank closed its file within {TIMELINE_MERGE_WAIT_S:.0f} s"
                _timeline_left_unmerged(path, why)
                return
        if not merge(path, range(engine.size)):
            _timeline_left_unmerged(path, "some rank's file was not found")
    except Exception as exc:  # noqa: BLE001 - never fail a shutdown over the timeline
        _timeline_left_unmerged(path, f"merging failed: {exc}")


def _timeline_left_unmerged(path: str, why: str) -> None:
    logger.warning(
        "the timeline's rank files next to %s were left as they are (%s); "
        "hora timeline summarize reads them together.",
        path,
        why,
    )


def shutdown(reason: str | None = None) -> None:
    """Stop the engine. Pending operations on every rank fail; ``init`` may be called again."""
    with _state.lock:
        _stop_engine(reason)


def _stop_engine(reason: str | None) -> None:
    """Stop and release the engine (the caller holds ``_state.lock``)."""
    engine = _state.engine
    if engine is not None:
        metrics.detach()
        engine.shutdown(reason)
        _finish_timeline(engine, _state.store)
        launched_elsewhere = _state.topology is not None and _state.topology.launch is not None
        if _state.store is not None and launched_elsewhere and engine.size > 1:
            # A rank may host the store (srun, mpirun): it waits at exit for this.
            joining.detach(_state.store, engine.rank, _state.engine_generation)
        _state.engine = None
        _state.mpi_comm = None
        _state.cpu_operations = ""
        for process_set in _state.process_sets.values():
            if process_set is not global_process_set:
                process_set._unbind()
        _state.process_sets = {}


def current_timeline() -> Timeline | None:
    """The timeline being written, if any (cheap enough for a per-gradient hook)."""
    current = _state.engine
    return current.timeline if current is not None else None


def is_initialized() -> bool:
    """Whether ``init`` has run (and ``shutdown`` has not)."""
    return _state.engine is not None


def engine() -> Engine:
    """The running engine.

    Raises:
        ValueError: ``init`` has not been called.
    """
    current = _state.engine
    if current is None:
        raise ValueError(NOT_INITIALIZED)
    return current


def topology() -> Topology:
    if _state.engine is None or _state.topology is None:
        raise ValueError(NOT_INITIALIZED)
    return _state.topology


def size() -> int:
    """Number of processes in the job."""
    return topology().size


def rank() -> int:
    """This process's global rank."""
    return topology().rank


def local_size() -> int:
    """Number of processes on this host."""
    return topology().local_size


def local_rank() -> int:
    """This process's rank among the processes on this host (use it to pick the GPU)."""
    return topology().local_rank


def cross_size() -> int:
    """Number of hosts that have a process with this process's local rank."""
    return topology().cross_size


def cross_rank() -> int:
    """Index of this host among the hosts with a process of this local rank."""
    return topology().cross_rank


def is_homogeneous() -> bool:
    """Whether every host runs the same number of processes."""
    t = topology()
    return t.local_size * t.cross_size == t.size


def register_process_set(process_set: ProcessSet | list[int]) -> ProcessSet:
    """Add a process set on every rank (collective: all ranks call it in the same order).

    Args:
        process_set: a ``ProcessSet`` or a list of global ranks.
    """
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    _translate_mpi_sets([process_set], _state.mpi_comm)
    current = engine()
    if not current.settings.dynamic_process_sets:
        raise ValueError(
            "Set HORA_DYNAMIC_PROCESS_SETS=1 (or HOROVOD_DYNAMIC_PROCESS_SETS=1, or "
            "hvd.init(process_sets='dynamic')) to allow adding process sets after "
            "initialization."
        )
    ranks = tuple(process_set.ranks)
    if current.process_sets.find(ranks) is not None:
        raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
    bad = [r for r in ranks if r >= current.size]
    if bad:
        raise ValueError(f"{process_set} names ranks {bad} outside 0..{current.size - 1}.")
    if process_set.mpi_comm is not None and _state.mpi_comm is not None:
        # Each rank may pass its own part of a split communicator: every part is added, in
        # the same order on every rank (those already registered are left as they are).
        for other in _distinct(_state.mpi_comm.allgather([ranks])):
            if other != ranks and current.process_sets.find(other) is None:
                current.register_process_set(other).wait()
    set_id = current.register_process_set(ranks).wait()[0]
    process_set._bind(set_id, current.rank)
    _state.process_sets[set_id] = process_set
    return process_set


def _distinct(gathered: list[list[tuple[int, ...]]]) -> list[tuple[int, ...]]:
    """Every member list of every rank's lists, once each, in rank order."""
    found: list[tuple[int, ...]] = []
    for lists in gathered:
        for ranks in lists:
            if tuple(ranks) not in found:
                found.append(tuple(ranks))
    return found


def _registered_lists(
    sets: list[ProcessSet], size: int, job_comm: Any
) -> tuple[list[tuple[int, ...]], list[int]]:
    """The member lists every rank registers at ``init``, and where each of ``sets`` is
    among them.

    A set made from an mpi4py communicator may differ from rank to rank (each rank passes its
    own part of a ``Split``, as Horovod allows): the ranks gather each other's lists so that
    every rank registers all of them, with the same ids.
    """
    lists = _member_lists(sets, size)
    if job_comm is None or not any(s.mpi_comm is not None for s in sets):
        return lists, list(range(len(lists)))
    registered = _distinct(job_comm.allgather(lists))
    return registered, [registered.index(ranks) for ranks in lists]


def unregister_process_set(process_set: ProcessSet) -> bool:
    """Remove a process set on every rank (collective). Returns whether it was registered."""
    current = engine()
    if not current.settings.dynamic_process_sets:
        raise ValueError(
            "Set HORA_DYNAMIC_PROCESS_SETS=1 to allow removing process sets after initialization."
        )
    if process_set.process_set_id == 0:
        raise ValueError("The global process set cannot be removed.")
    if (
        process_set.process_set_id is None
        or current.process_sets.find(tuple(process_set.ranks)) is None
    ):
        return False
    current.register_process_set(tuple(process_set.ranks), remove=True).wait()
    _state.process_sets.pop(process_set.process_set_id, None)
    process_set._unbind()
    return True


# ---------------------------------------------------------------- build and runtime information


def gloo_built() -> bool:
    """hora's CPU transport is Gloo, through ``torch.distributed``."""
    from hora.common.transport.gloo import gloo_available

    return gloo_available()


def gloo_enabled() -> bool:
    """Whether the running job moves data over Gloo (``HORA_CPU_OPERATIONS=gloo``, the
    default)."""
    return is_initialized() and _state.cpu_operations == "gloo" and gloo_built()


def mpi_built() -> bool:
    """Whether hora can use MPI: mpi4py imports and its MPI library loads (MPI is not
    initialized by asking)."""
    from hora.common.transport.mpi import mpi_loadable

    return mpi_loadable()


def mpi_enabled() -> bool:
    """Whether the running job moves data over MPI (``HORA_CPU_OPERATIONS=mpi``)."""
    return is_initialized() and _state.cpu_operations == "mpi"


def mpi_threads_supported() -> bool:
    """Whether the job's MPI library runs with ``MPI_THREAD_MULTIPLE``.

    Raises:
        ValueError: the running job does not use MPI (not initialized, or over Gloo).
    """
    if _state.mpi_comm is None or not is_initialized():
        raise ValueError(
            "MPI is not enabled: initialize hora in a job started by mpirun with "
            "HORA_CPU_OPERATIONS=mpi (or horarun --mpi), or with hvd.init(comm=...)."
        )
    from hora.common.transport.mpi import import_mpi

    mpi = import_mpi()
    return bool(mpi.Query_thread() == mpi.THREAD_MULTIPLE)


def nccl_built() -> int:
    """1 where this torch has NCCL, so that collectives on CUDA tensors run over NCCL
    (``HORA_GPU_OPERATIONS=nccl``, the default); 0 where CUDA tensors can only go through host
    memory."""
    from hora.common.transport.nccl import nccl_compiled

    return int(nccl_compiled())


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    """Whether this torch has CUDA, so that hora takes CUDA tensors (over NCCL where
    :func:`nccl_built`, else through host memory)."""
    import torch

    return bool(torch.backends.cuda.is_built())


def rocm_built() -> bool:
    import torch

    return getattr(torch.version, "hip", None) is not None
