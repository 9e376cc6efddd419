"""The training state of an elastic job, for every framework: what is committed, rolled back
and synchronized.

:class:`State` is the protocol ``hvd.elastic.run`` drives: ``commit()`` (save, then look for host
changes), ``restore()`` (back to the last commit), ``sync()`` (everyone takes rank 0's state),
``on_reset()`` (after the job re-formed). :class:`ObjectState` keeps plain Python attributes;
the adapters' states (``TorchState``, TensorFlow's and Keras's) add their framework's objects on
top of it.

A commit of an ``ObjectState`` is all-or-nothing: its values and the adapter's snapshots are
copied first (a :class:`Commit`), and only when all of them (and, with a ``commit_dir``, rank
0's durable write, :mod:`.durable`) succeeded do they replace the previous commit, together. A
commit that raises leaves the previous one whole.

Names of the collectives: every collective here has a fixed name, so that a worker that joined
the job a moment ago and workers that have been training for hours issue identical requests.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypedDict, TypeVar, cast

import torch

from hora.common import basics
from hora.common.elastic.durable import (
    CommitDirectory,
    CommitRecord,
    DurableCommitError,
    make_record,
)
from hora.common.elastic.job import job
from hora.common.job.rounds import HOSTS_REMOVED
from hora.common.ops import collectives
from hora.common.ops.objects import broadcast_object
from hora.common.process_sets import global_process_set
from hora.common.runtime import runtime
from hora.common.vocabulary import config
from hora.common.vocabulary.errors import HostsUpdatedInterrupt
from hora.common.vocabulary.settings_table import ELASTIC_COMMIT_DIR

logger = logging.getLogger("hora")

# The allreduce every rank takes part in at each check_host_updates() of an elastic job.
HOST_UPDATES_NAME = "hora.elastic.host_updates"

T = TypeVar("T")
H = TypeVar("H", bound=type)


class Broadcast(Protocol):
    """``f(obj) -> obj``: sends an object from rank 0 to every rank (a collective)."""

    def __call__(self, obj: T, /) -> T:
        """Rank 0's ``obj``, on every rank."""


def _broadcast_from_root(obj: T, name: str) -> T:
    received: T = broadcast_object(obj, root_rank=0, name=name)
    return received


def _default_bcast_object(obj: T) -> T:
    return _broadcast_from_root(obj, "hora.elastic.object_state")


def _default_bcast_status(obj: T) -> T:
    return _broadcast_from_root(obj, "hora.elastic.commit_dir")


class _Status(TypedDict):
    """What rank 0 tells every rank at each sync of a state with a durable commit."""

    commits: int
    error: str | None


def handler_registry(defaults: Iterable[tuple[type, H]]) -> list[tuple[type, H]]:
    """The ``(type, handler class)`` pairs a framework's elastic state consults, first match
    wins: the process's list (``Runtime.state_handlers``), made from ``defaults`` when first
    asked for. Changes to the list are the process's."""
    state = runtime()
    if state.state_handlers is None:
        state.state_handlers = list(defaults)
    return cast(list[tuple[type, H]], state.state_handlers)


def replace_handler_registry(registry: Iterable[tuple[type, type]]) -> None:
    """Make a copy of ``registry`` the pairs :func:`handler_registry` answers with."""
    runtime().state_handlers = list(registry)


class Snapshot:
    """What elastic state and each of an adapter's state handlers implement."""

    def save(self) -> None:
        """Keep a copy of the current state in memory (what :meth:`restore` goes back to)."""
        raise NotImplementedError(f"{type(self).__name__} must implement save()")

    def restore(self) -> None:
        """Go back to the state of the last :meth:`save` (the last commit)."""
        raise NotImplementedError(f"{type(self).__name__} must implement restore()")

    def sync(self) -> None:
        """Make every rank's state rank 0's (a collective: every rank calls it)."""
        raise NotImplementedError(f"{type(self).__name__} must implement sync()")

    def reset(self) -> None:
        """Hook called after the job re-formed (for a state: before the reset callbacks)."""


class State(Snapshot):
    """The base of elastic training state; ``hvd.elastic.run`` drives it.

    Subclasses implement :meth:`save`, :meth:`restore` and :meth:`sync`, and may override the
    :meth:`reset` hook.

    Args:
        bcast_object: ``f(obj) -> obj`` sending an object from rank 0 to every rank (default:
            ``hvd.broadcast_object`` under a fixed name).
        get_rank: ``f() -> int``, this process's rank (default: ``hvd.rank``).
    """

    def __init__(
        self,
        bcast_object: Broadcast | None = None,
        get_rank: Callable[[], int] | None = None,
    ) -> None:
        self._bcast_object: Broadcast = bcast_object or _default_bcast_object
        self._rank = get_rank or basics.rank
        self._reset_callbacks: list[Callable[[], object]] = []
        # The newest host-change notice the current round accounts for, and that round.
        self._updates_seen = 0
        self._updates_round: int | None = None

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], object]]) -> None:
        """Call each of ``callbacks`` (no arguments) after every reset, after :meth:`reset`.

        Typical use: rescale the learning rate to the new ``hvd.size()``. Callbacks run before
        the state is synchronized, so they must not use collectives. Workers that join the job
        in the new round do not run them: their ``sync()`` gives them rank 0's values (the
        optimizer's ``lr`` included).
        """
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Called by ``hvd.elastic.run`` once the job has re-formed: :meth:`reset`, then the
        registered callbacks in order."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: object = None, update_res: object = None) -> None:
        """Horovod's notification hook; a no-op in hora.

        hora's workers learn of host changes by reading the job's store in
        :meth:`check_host_updates`, not by notifications pushed to them.
        """
        del timestamp, update_res

    def commit(self) -> None:
        """:meth:`save` the state, then :meth:`check_host_updates`.

        A commit is the point a failure rolls back to; commit every few batches (a commit
        copies the whole state) and call :meth:`check_host_updates` in between. For
        :class:`ObjectState` and the adapters' states a commit is all-or-nothing: when
        :meth:`save` raises, the previous commit is kept whole and the error propagates.
        """
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank if hosts were added or removed.

        Outside an elastic job this does nothing. In one, every rank must call it at the same
        point (it is one collective): rank 0 reads the driver's latest host-change notice and
        all ranks take part in one float64 Sum allreduce of ``[number, flags]`` (named
        ``hora.elastic.host_updates``; rank 0 contributes the values, the others zeros), so
        every rank decides the same. An allreduce, unlike a broadcast, keeps a training loop
        that checks every batch in the engine's steady state, and still works while other
        ranks wait in ``hvd.join()``. Cheap enough to call every batch.

        Raises:
            HostsUpdatedInterrupt: a notice newer than the current round's; ``skip_sync`` is
                ``True`` when hosts were only removed (hora synchronizes anyway).
        """
        elastic_job = job()
        if not elastic_job.active():
            return
        plan = elastic_job.current_round()
        if plan is not None and plan.number != self._updates_round:
            # A new round reflects the notices up to its plan's number.
            self._updates_round = plan.number
            self._updates_seen = plan.updates
        values = torch.zeros(2, dtype=torch.float64)
        if self._rank() == 0:
            number, flags = elastic_job.host_update()
            values[0] = float(number)
            values[1] = float(flags)
        handle = collectives.allreduce_async(
            [values], False, HOST_UPDATES_NAME, collectives.Sum, None, 1.0, 1.0,
            global_process_set, False,
        )  # fmt: skip
        result = collectives.synchronize(handle)
        number, flags = int(result[0].item()), int(result[1].item())
        if number > self._updates_seen:
            self._updates_seen = number
            raise HostsUpdatedInterrupt(skip_sync=flags == HOSTS_REMOVED)


@dataclass
class Commit:
    """A commit built in full before it replaces the saved one.

    Attributes:
        number: the commit's number (the previous one's plus one).
        values: deep copies of the plain attributes.
        handlers: each handler's new snapshot, by attribute name (handlers with ``capture``).
        undo: how to put back handlers that saved in place (handlers with their own ``save``).
    """

    number: int
    values: dict[str, object]
    handlers: dict[str, Any] = field(default_factory=dict)
    undo: list[Callable[[], None]] = field(default_factory=list)

    def roll_back(self) -> None:
        for step in reversed(self.undo):
            step()


def _commit_directory(commit_dir: str | os.PathLike[str] | None) -> CommitDirectory | None:
    """``commit_dir``, or ``HORA_ELASTIC_COMMIT_DIR`` when it is ``None``; ``None``: no durable
    commits."""
    path = commit_dir if commit_dir is not None else config.read(ELASTIC_COMMIT_DIR)
    return CommitDirectory(path) if path else None


class ObjectState(State):
    """Plain Python attributes as elastic state: ``ObjectState(epoch=0, batch=0)``.

    Every keyword becomes an attribute. ``save`` keeps a deep copy of the attributes' values,
    ``restore`` assigns (a copy of) that snapshot back, ``sync`` sends rank 0's *saved* values
    to every rank and assigns them. The constructor saves once. Attributes added later (not
    passed to the constructor) are not part of the state. Values must be deep-copyable and
    picklable (cloudpickle).

    With ``commit_dir`` (or ``HORA_ELASTIC_COMMIT_DIR``), every ``save`` is also written by
    rank 0 to ``<commit_dir>/commit.pt``, atomically, and the first ``sync`` of a process
    resumes from that file when it exists (rank 0 loads it, the sync gives it to every rank):
    a job restarted after losing every worker goes on from its last commit. See
    docs/elastic.md, "Durable commits".

    Args:
        bcast_object, get_rank: see :class:`State`.
        commit_dir: directory of the durable commit (``None``: ``HORA_ELASTIC_COMMIT_DIR``,
            and no durable commit when that is unset). Only this job's user may be able to
            write it; shared by every host of a multi-host job. One state per directory.
        **kwargs: the attributes and their initial values.

    Raises:
        DurableCommitError: (from ``save`` and ``sync``) the commit file cannot be written or
            read, or the directory is not trusted.

    Example:
        >>> state = hvd.elastic.ObjectState(epoch=0, batch=0)
        >>> state.epoch += 1
        >>> state.commit()
    """

    def __init__(
        self,
        bcast_object: Broadcast | None = None,
        get_rank: Callable[[], int] | None = None,
        commit_dir: str | os.PathLike[str] | None = None,
        **kwargs: object,
    ) -> None:
        check_names(type(self), kwargs)
        State.__init__(self, bcast_object=bcast_object, get_rank=get_rank)
        self._saved_state: dict[str, object] = copy.deepcopy(kwargs)
        for attr, value in kwargs.items():
            setattr(self, attr, value)
        # How many commits the job has made (carried by the durable commit across restarts).
        self._commits = 0
        self._durable = _commit_directory(commit_dir)
        self._durable_ready = False
        self._bcast_status: Broadcast = bcast_object or _default_bcast_status
        self._synced_once = False

    # ------------------------------------------------------------ commit: build, write, install

    def save(self) -> None:
        """Commit the current state: copy everything, write it (rank 0, with a ``commit_dir``),
        then replace the previous commit with it in one step.

        Raises:
            Exception: whatever a copy raised, or :class:`DurableCommitError`; the previous
                commit is kept whole, in memory and on disk.
        """
        commit = self._build_commit()
        try:
            self._write_durable(commit)
        except BaseException:
            commit.roll_back()
            raise
        self._install(commit)

    def _build_commit(self) -> Commit:
        """The new commit; nothing of the state changes here."""
        return Commit(number=self._commits + 1, values=self._copy_values(self._current()))

    def _current(self) -> dict[str, object]:
        return {attr: getattr(self, attr) for attr in self._saved_state}

    def _install(self, commit: Commit) -> None:
        """Make ``commit`` the saved state (assignments only: this cannot fail half-way)."""
        self._saved_state = commit.values
        self._commits = commit.number

    def _write_durable(self, commit: Commit) -> None:
        if self._durable is None or self._rank() != 0:
            return
        if not self._durable_ready:
            self._durable.prepare()
            self._durable_ready = True
        self._durable.write(make_record(commit.number, commit.handlers, commit.values))

    # ------------------------------------------------------------ restore and sync

    def restore(self) -> None:
        self._assign(self._copy_values(self._saved_state))

    def sync(self) -> None:
        self._sync_commit_dir()
        self._sync_values()
        self._synced_once = True

    def _sync_values(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._assign(self._copy_values(self._saved_state))

    @staticmethod
    def _copy_values(values: dict[str, object]) -> dict[str, object]:
        return {attr: copy.deepcopy(value) for attr, value in values.items()}

    def _assign(self, values: dict[str, object]) -> None:
        for attr, value in values.items():
            setattr(self, attr, value)

    # ------------------------------------------------------------ the durable commit

    def _sync_commit_dir(self) -> None:
        """Until a sync of this process succeeded, rank 0 resumes from the durable commit (a
        first sync that failed, because a peer was lost, may leave another rank 0 for the
        retry); at every sync all ranks learn rank 0's commit number, and whether resuming
        failed (then all raise)."""
        if self._durable is None:
            return
        first = not self._synced_once
        status: _Status | None = None
        failure: Exception | None = None
        if self._rank() == 0:
            try:
                if first:
                    self._resume(self._durable)
            except Exception as exc:  # every rank must hear of it, then raise
                failure = exc
            status = {"commits": self._commits, "error": None if failure is None else str(failure)}
        # Rank 0 always sends its status: what every rank receives is one.
        status = cast(_Status, self._bcast_status(status))
        if failure is not None:
            raise failure
        if status["error"] is not None:
            raise DurableCommitError(
                f"rank {self._rank()}: rank 0 could not resume from the durable commit, so no "
                f"rank starts: {status['error']}"
            )
        self._commits = int(status["commits"])

    def _resume(self, directory: CommitDirectory) -> None:
        """Rank 0: load the directory's commit, if there is one, into the state."""
        directory.prepare()
        self._durable_ready = True
        for path in directory.remove_leftovers():
            logger.info("hora elastic: removed %s, left by an interrupted commit", path)
        record = directory.read()
        if record is None:
            logger.info("hora elastic: no durable commit in %s: starting afresh", directory.path)
            return
        self._load_record(record, directory)
        logger.info(
            "hora elastic: resumed from durable commit %d in %s", self._commits, directory.file
        )

    def _load_record(self, record: CommitRecord, directory: CommitDirectory) -> None:
        """Install ``record`` as the last commit and restore it (checked first, then applied)."""
        handlers, values = record.get("handlers"), record.get("values")
        if not isinstance(handlers, dict) or not isinstance(values, dict):
            raise DurableCommitError(
                f"the durable commit {directory.file} has no 'handlers' or 'values' table. "
                "Move the file away to start from scratch."
            )
        self._check_layout(handlers, values, directory)
        try:
            self._check_snapshots(handlers)
        except ValueError as exc:
            raise DurableCommitError(
                f"the durable commit {directory.file} does not fit this state: {exc}. Resume "
                "with the same model and optimizer, or move the file away to start from "
                "scratch."
            ) from exc
        commit = Commit(number=int(record.get("commit", 0)), values=values, handlers=handlers)
        self._install(commit)
        self.restore()

    def _check_layout(
        self, handlers: dict[str, object], values: dict[str, object], directory: CommitDirectory
    ) -> None:
        want_handlers, want_values = sorted(self._handler_names()), sorted(self._saved_state)
        if sorted(handlers) == want_handlers and sorted(values) == want_values:
            return
        raise DurableCommitError(
            f"the durable commit {directory.file} holds objects {sorted(handlers)} and values "
            f"{sorted(values)}; this state has objects {want_handlers} and values "
            f"{want_values}. Resume with the same state arguments, or use another commit_dir "
            "(or move the file away) to start from scratch."
        )

    def _handler_names(self) -> list[str]:
        return []

    def _check_snapshots(self, handlers: dict[str, Any]) -> None:
        """Raise ValueError when a handler's snapshot cannot be applied (an adapter's state)."""


def check_names(cls: type, names: Iterable[str]) -> None:
    for name in names:
        if name.startswith("_") or hasattr(cls, name):
            raise ValueError(
                f"{cls.__name__}: {name!r} cannot be a state attribute (it is private or a "
                f"method of {cls.__name__}); choose another name."
            )
