"""Process-wide state: ``init``, ``shutdown``, topology queries and build information.

Exactly one engine runs per process. This module creates it from the environment, answers
topology questions, and tears it down. It does not know the framework's tensors.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from typing import Any

from hora.common.config import Settings, flag, lookup, start_timeout_s
from hora.common.engine import Engine
from hora.common.errors import NOT_INITIALIZED
from hora.common.job import joining
from hora.common.job import rounds as elastic
from hora.common.job.store import StoreClient
from hora.common.job.store_keys import GenerationKeys
from hora.common.job.topology import Topology, detect
from hora.common.process_sets import ProcessSet
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


_state = _State()


class _RankFilter(logging.Filter):
    """Puts this process's current rank into log records (it changes in elastic jobs)."""

    def filter(self, record: logging.LogRecord) -> bool:
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


def _communicator_factory(topology: Topology, settings: Settings, store: StoreClient) -> Any:
    from hora.common.transport.gloo import GlooCommunicator, make_device, raise_open_file_limit

    old, new = raise_open_file_limit()
    if new != old:
        logger.debug("rank %d raised its open-file limit from %d to %d", topology.rank, old, new)
    interface = lookup("GLOO_IFACE") or os.environ.get("GLOO_SOCKET_IFNAME", "")
    bind = "127.0.0.1" if topology.all_local and not interface else ""
    device = make_device(bind, interface)

    def factory(scope: str, rank: int, size: int) -> Communicator:
        comm = GlooCommunicator(store.scoped(scope), rank, size, settings.gloo_timeout_s, device)
        try:
            prove_peers(comm, store.secret, scope)
        except TransportError:
            comm.abort()
            raise
        return comm

    return factory


def init(comm: Any = None, process_sets: list[ProcessSet] | str | None = None) -> None:
    """Start hora in this process: join the job's other processes and start the engine.

    Args:
        comm: accepted for Horovod compatibility; must be ``None`` (the whole job).
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
    with _state.lock:
        if _state.engine is not None:
            if _state.engine.running:
                return
            # The engine stopped on its own (the job was shut down after a failure, a stall or
            # a deadlock): release it, then start again, as after hvd.shutdown().
            _stop_engine(None)
        if comm is not None:
            raise ValueError(
                "hvd.init(comm=...) is not supported by hora: every process of the job takes "
                "part. Use process sets (hvd.ProcessSet) to run collectives on a subset of ranks."
            )
        dynamic = process_sets == "dynamic"
        sets: list[ProcessSet] = [] if dynamic or process_sets is None else list(process_sets)  # type: ignore[arg-type]
        settings = Settings.from_env()
        if dynamic:
            settings = _replace(settings, dynamic_process_sets=True)
        topology, store, generation = _join_job(settings)
        # From here log lines name this rank (in an elastic job it changes from round to round).
        _state.topology = topology
        engine = Engine(
            topology,
            settings,
            store,
            _communicator_factory(topology, settings, store),
            generation=generation,
            process_sets=_member_lists(sets, topology.size),
        )
        path = lookup("TIMELINE")
        if path:
            _open_timeline(engine, path, flag("TIMELINE_MARK_CYCLES"))
        _state.generation += 1
        _state.engine_generation = generation
        engine.start()
        _state.engine = engine
        _state.topology = topology
        _state.store = store
        _bind_process_sets(sets, topology)
        _install_exit_hooks()
        logger.debug("initialized: %s", topology)


def _join_job(settings: Settings) -> tuple[Topology, StoreClient, int]:
    """Where this process runs, the job's store, and the generation of its keys."""
    if elastic.active():
        # An elastic horarun: the driver assigns ranks round by round, and each round
        # keeps its keys under its own prefix, so every round's scopes start at 0.
        _configure_logging(settings.log_level)
        topology, store = elastic.join()
        return topology, store, 0
    topology = detect()
    _configure_logging(settings.log_level)
    # Under horarun the store is the launcher's; under other launchers rank 0 (or the
    # launcher) hosts it and local/cross ranks may still need an exchange.
    generation = _state.generation
    topology, store = joining.join(topology, start_timeout_s(), generation)
    return topology, store, generation


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


def _bind_process_sets(sets: list[ProcessSet], topology: Topology) -> None:
    """Give the global set and the sets passed to ``init`` their ids (in order, from 1)."""
    global_process_set.ranks = list(range(topology.size))
    global_process_set._bind(0, topology.rank)
    _state.process_sets = {0: global_process_set}
    for set_id, process_set in enumerate(sets, start=1):
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
        engine.shutdown(reason)
        _finish_timeline(engine, _state.store)
        launched_elsewhere = _state.topology is not None and _state.topology.launch is not None
        if _state.store is not None and launched_elsewhere and engine.size > 1:
            # A rank may host the store (srun, mpirun): it waits at exit for this.
            joining.detach(_state.store, engine.rank, _state.engine_generation)
        _state.engine = None
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
    set_id = current.register_process_set(ranks).wait()[0]
    process_set._bind(set_id, current.rank)
    _state.process_sets[set_id] = process_set
    return process_set


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
    """Whether the running job moves data over Gloo (always, once initialized)."""
    return is_initialized() and gloo_built()


def mpi_built() -> bool:
    """hora has no MPI transport yet."""
    return False


def mpi_enabled() -> bool:
    return False


def mpi_threads_supported() -> bool:
    raise ValueError("MPI is not enabled in hora; jobs use the Gloo transport.")


def nccl_built() -> int:
    """0: hora runs GPU tensors through host memory over Gloo; it does not use NCCL yet."""
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    """Whether CUDA tensors are accepted (they are staged through host memory)."""
    import torch

    return bool(torch.backends.cuda.is_built())


def rocm_built() -> bool:
    import torch

    return getattr(torch.version, "hip", None) is not None
