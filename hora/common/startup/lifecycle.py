"""``init`` and ``shutdown``: where a process joins its job and leaves it.

``init`` reads the settings, joins the job (its launcher's variables, the store, an elastic
round), builds the engine with the communicators :mod:`hora.common.startup.wiring` makes,
opens the timeline and live metrics, registers the process sets and starts a new
:class:`~hora.common.runtime.Session`. ``shutdown`` stops the engine, merges the timeline and
drops the session. Every framework adapter's ``init`` and ``shutdown`` are these two.

This module composes the parts; it holds no state of its own (:mod:`hora.common.runtime`
does) and knows no framework.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import sys
from collections.abc import Iterator
from dataclasses import replace
from types import TracebackType
from typing import TYPE_CHECKING

from hora.common import metrics
from hora.common.engine import Engine
from hora.common.job import joining
from hora.common.job import rounds as elastic
from hora.common.job.joining import keep_hosted as keep_hosted
from hora.common.job.joining import receiving_key as receiving_key
from hora.common.job.joining import release_hosted as release_hosted
from hora.common.job.store import StoreClient
from hora.common.job.store_keys import GenerationKeys
from hora.common.job.topology import Topology, detect
from hora.common.process_sets import ProcessSet
from hora.common.runtime import Runtime, Session, runtime
from hora.common.startup.registration import (
    bind_initial,
    registered_lists,
    translate_mpi_sets,
    unbind_all,
)
from hora.common.startup.timeline import finish_timeline, open_timeline
from hora.common.startup.wiring import (
    agree_on_settings,
    cpu_communicators,
    gpu_communicators,
    mpi_job_comm,
    mpi_library,
    sub_job,
)
from hora.common.vocabulary import settings_table as table
from hora.common.vocabulary.config import (
    Settings,
    name_unheeded,
    read,
    start_timeout_s,
    timeline_path,
)

if TYPE_CHECKING:
    from mpi4py import MPI

    from hora.common.startup.wiring import JobComm

logger = logging.getLogger("hora")

# keep_hosted, release_hosted and receiving_key are a Ray worker's (hora.ray._worker), whose
# process hosts its job's store and receives its sealed secret between the Ray driver's calls:
# the runtime keeps both, as it keeps every store a process hosts.


class _RankFilter(logging.Filter):
    """Puts this process's current rank into log records (it changes in elastic jobs)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "hora_rank"):  # a record made while joining names its rank
            rank = runtime().log_rank
            record.hora_rank = rank if rank is not None else "?"
        return True


def _configure_logging(level: str) -> None:
    state = runtime()
    if state.logging_configured:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RankFilter())
    fmt = "[%(levelname)s hora rank %(hora_rank)s] %(message)s"
    if not read(table.LOG_HIDE_TIME):
        fmt = "[%(asctime)s " + fmt[1:]
    handler.setFormatter(logging.Formatter(fmt))
    logger.addHandler(handler)
    logger.setLevel("DEBUG" if level == "TRACE" else ("CRITICAL" if level == "FATAL" else level))
    logger.propagate = False
    state.logging_configured = True


@contextlib.contextmanager
def _collector_paused(state: Runtime) -> Iterator[None]:
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
        if not state.gc_frozen and state.session is not None and read(table.GC_FREEZE):
            gc.freeze()
            state.gc_frozen = True
    finally:
        if enabled:
            gc.enable()


def init(comm: JobComm | None = None, process_sets: list[ProcessSet] | str | None = None) -> None:
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
    state = runtime()
    with state.lock, _collector_paused(state):
        if state.session is not None:
            engine = state.session.engine
            if engine.running or engine.ended_orderly:
                # Running; or ended because another rank called hvd.shutdown() or exited: as
                # in Horovod, init does nothing until this rank calls hvd.shutdown() too (the
                # other ranks would not join a new start), and calls raise that cause.
                return
            # The engine stopped on its own (the job was shut down after a failure, a stall or
            # a deadlock): release it, then start again, as after hvd.shutdown().
            _end_session(state, None)
        _start_session(state, comm, process_sets)


def _start_session(
    state: Runtime, comm: JobComm | None, process_sets: list[ProcessSet] | str | None
) -> None:
    """Join the job and start a session; in an elastic job, again in the next round for as long
    as the round joined is lost while its workers connect (one of them died, say)."""
    dynamic = process_sets == "dynamic"
    sets: list[ProcessSet] = [] if dynamic or process_sets is None else list(process_sets)  # type: ignore[arg-type]
    settings = Settings.from_env()
    if dynamic:
        settings = replace(settings, dynamic_process_sets=True)
    while True:
        joined_before = state.rounds.plan
        try:
            _open_session(state, settings, comm, sets)
            return
        except RuntimeError as exc:
            if not _round_lost_while_joining(state, joined_before, exc):
                raise
        finally:
            elastic.formed()


def _round_lost_while_joining(
    state: Runtime, joined_before: elastic.RoundPlan | None, exc: RuntimeError
) -> bool:
    """Whether ``exc``, raised while this process joined an elastic round, came from losing that
    round (a worker died, or a newer round replaced it); if so, it logs why and leaves what was
    started of the session, and the caller joins the next round.

    The first ``hvd.init()`` of a script runs outside ``hvd.elastic.run``: a lost round must not
    end it, any more than a failure after it ends the survivors of ``hvd.elastic.run``. Nothing
    is rolled back: no state was synchronized in a round that never formed.
    """
    if not elastic.active():
        return False
    plan = state.rounds.plan
    if plan is None or plan is joined_before:
        return False  # it failed before it joined a round: nothing to do with one
    why = elastic.round_lost()
    if not why:
        return False
    if state.session is not None:
        _end_session(state, why)
    logger.info(
        "round %d was lost while its workers connected (%s); joining the next round",
        plan.number,
        why,
    )
    logger.debug("what ended the connecting: %s", exc)
    return True


def _open_session(
    state: Runtime, settings: Settings, comm: JobComm | None, sets: list[ProcessSet]
) -> None:
    topology, store, generation, mpi_comm = _join_job(state, settings, comm)
    sets = translate_mpi_sets(sets, mpi_comm)
    registered, positions = registered_lists(sets, topology.size, mpi_comm)
    # From here log lines name this rank (in an elastic job it changes from round to round).
    state.log_rank = topology.rank
    if state.starts == 0 and topology.local_rank == 0:
        name_unheeded()  # once per process, one warning per host (docs/environment.md)
    engine = Engine(
        topology,
        settings,
        store,
        cpu_communicators(
            topology, settings, store, mpi_comm.Dup() if mpi_comm is not None else None
        ),
        generation=generation,
        process_sets=registered,
        device_communicator_factory=gpu_communicators(settings, store),
    )
    current = Session(engine, topology, store, generation, mpi_comm, settings.cpu_operations)
    path = timeline_path()
    if path:
        open_timeline(current, path, read(table.TIMELINE_MARK_CYCLES))
    metrics.attach(engine.counters, topology.rank, topology.local_rank)
    state.starts += 1
    engine.start()
    state.session = current
    bind_initial(current, sets, topology, positions)
    _install_exit_hooks(state)
    logger.debug("initialized: %s", topology)


def _join_job(
    state: Runtime, settings: Settings, comm: JobComm | None
) -> tuple[Topology, StoreClient, int, MPI.Intracomm | None]:
    """Where this process runs, the job's store, the generation of its keys, and the job's MPI
    communicator (``None`` when MPI plays no part), once every rank is known to hold the same
    settings where they must (:func:`agree_on_settings`)."""
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
        _agree(topology, settings, store, 0)
        return topology, store, 0, None
    topology = detect()
    _configure_logging(settings.log_level)
    mpi = mpi_library(comm, topology, settings)
    mpi_comm = None
    if comm is not None:
        mpi_comm = mpi_job_comm(comm, mpi)
        assert mpi_comm is not None  # mpi_library gave MPI (or raised) for the comm given
        topology = sub_job(topology, mpi_comm)
    # Under horarun the store is the launcher's; under other launchers rank 0 (or the
    # launcher) hosts it and local/cross ranks may still need an exchange.
    generation = state.starts
    topology, store = joining.join(topology, start_timeout_s(), generation, mpi_comm)
    _agree(topology, settings, store, generation)
    if comm is None:
        # Only now: MPI_Comm_dup waits for every rank, and a rank set to Gloo would never come.
        mpi_comm = mpi_job_comm(None, mpi)
    return topology, store, generation, mpi_comm


def _agree(topology: Topology, settings: Settings, store: StoreClient, generation: int) -> None:
    """Compare the settings every rank must share, waiting for the other ranks as long as
    either joining (``HORA_START_TIMEOUT``) or connecting (``HORA_GLOO_TIMEOUT_SECONDS``) may."""
    timeout_s = max(start_timeout_s(), settings.gloo_timeout_s)
    agree_on_settings(topology, settings, store, GenerationKeys(generation), timeout_s)


def _install_exit_hooks(state: Runtime) -> None:
    """Once per process: shut down at exit, and remember an uncaught exception as the cause."""
    if state.exit_hooks_installed:
        return
    atexit.register(_shutdown_at_exit)
    previous_hook = sys.excepthook

    def _record_uncaught(
        kind: type[BaseException], value: BaseException, tb: TracebackType | None
    ) -> None:
        state.exit_cause = f"{kind.__name__}: {value}"
        previous_hook(kind, value, tb)

    sys.excepthook = _record_uncaught
    state.exit_hooks_installed = True


def _shutdown_at_exit() -> None:
    state = runtime()
    current = state.session
    if current is None:
        return
    rank = current.engine.rank
    reason = f"rank {rank} is exiting (hvd.shutdown() ran at process exit)"
    if state.exit_cause:
        reason = f"rank {rank} is exiting after an uncaught {state.exit_cause}"
    current.engine.report_cause(reason)
    shutdown(reason)


def shutdown(reason: str | None = None) -> None:
    """Stop the engine. Pending operations on every rank fail; ``init`` may be called again."""
    state = runtime()
    with state.lock:
        _end_session(state, reason)


def _end_session(state: Runtime, reason: str | None) -> None:
    """Stop the session's engine and drop the session (the caller holds the runtime's lock)."""
    current = state.session
    if current is None:
        return
    engine = current.engine
    metrics.detach()
    engine.shutdown(reason)
    finish_timeline(current)
    if current.topology.launch is not None and engine.size > 1:
        # A rank may host the store (srun, mpirun): it waits at exit for this.
        joining.detach(current.store, engine.rank, current.generation)
    state.session = None
    unbind_all(current)
