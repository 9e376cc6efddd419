"""The training state of an elastic job: what is committed, rolled back and synchronized.

:class:`State` is the protocol ``hvd.elastic.run`` drives: ``commit()`` (save, then look for host
changes), ``restore()`` (back to the last commit), ``sync()`` (everyone takes rank 0's state),
``on_reset()`` (after the job re-formed). :class:`ObjectState` keeps plain Python attributes;
:class:`TorchState` adds models, optimizers and :class:`ElasticSampler` objects through
*handlers* chosen by type from a registry (:func:`get_handler_registry`).

A commit of an ``ObjectState`` or ``TorchState`` is all-or-nothing: every handler's snapshot and
the values are copied first, and only when all of them (and, with a ``commit_dir``, rank 0's
durable write, :mod:`.durable`) succeeded do they replace the previous commit, together. A
commit that raises leaves the previous one whole. ``restore()`` checks every snapshot before it
changes any object.

Names of the collectives: every collective here has a fixed name, so that a worker that joined
the job a moment ago and workers that have been training for hours issue identical requests.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hora.common import basics, config
from hora.common.errors import HostsUpdatedInterrupt
from hora.common.job import rounds as _elastic
from hora.common.job.store import StoreClient
from hora.common.settings_table import ELASTIC_COMMIT_DIR
from hora.torch import ops
from hora.torch.elastic.durable import CommitDirectory, DurableCommitError, make_record
from hora.torch.elastic.sampler import ElasticSampler
from hora.torch.functions import (
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)

logger = logging.getLogger("hora")

# The allreduce every rank takes part in at each check_host_updates() of an elastic job.
HOST_UPDATES_NAME = "hora.elastic.host_updates"

_base_store: StoreClient | None = None


def _read_host_update() -> tuple[int, int]:
    """Rank 0's look at the driver's latest host-change notice, ``(number, flags)``.

    The store client is made once per process. A store that cannot be read counts as "no
    notice" (the engine notices a lost store on its own).
    """
    global _base_store
    try:
        if _base_store is None:
            _base_store = _elastic.base_store()
        return _elastic.read_host_update(_base_store)
    except Exception as exc:  # noqa: BLE001 - a missed notice is seen at the next check
        logger.warning("hora elastic: could not read the host-change notice: %s", exc)
        return 0, 0


def _broadcast_from_root(obj: Any, name: str) -> Any:
    return broadcast_object(obj, root_rank=0, name=name)


def _default_bcast_object(obj: Any) -> Any:
    return _broadcast_from_root(obj, "hora.elastic.object_state")


def _default_bcast_status(obj: Any) -> Any:
    return _broadcast_from_root(obj, "hora.elastic.commit_dir")


class _Snapshot:
    """What elastic state and each of ``TorchState``'s handlers implement."""

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


class State(_Snapshot):
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
        bcast_object: Callable[[Any], Any] | None = None,
        get_rank: Callable[[], int] | None = None,
    ) -> None:
        self._bcast_object = bcast_object or _default_bcast_object
        self._rank = get_rank or basics.rank
        self._reset_callbacks: list[Callable[[], Any]] = []
        # The newest host-change notice the current round accounts for, and that round.
        self._updates_seen = 0
        self._updates_round: int | None = None

    def register_reset_callbacks(self, callbacks: list[Callable[[], Any]]) -> None:
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

    def on_hosts_updated(self, timestamp: Any = None, update_res: Any = None) -> None:
        """Horovod's notification hook; a no-op in hora.

        hora's workers learn of host changes by reading the job's store in
        :meth:`check_host_updates`, not by notifications pushed to them.
        """
        del timestamp, update_res

    def commit(self) -> None:
        """:meth:`save` the state, then :meth:`check_host_updates`.

        A commit is the point a failure rolls back to; commit every few batches (a commit
        copies the whole state) and call :meth:`check_host_updates` in between. For
        :class:`ObjectState` and :class:`TorchState` a commit is all-or-nothing: when
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
        if not _elastic.active():
            return
        plan = _elastic.progress.plan
        if plan is not None and plan.number != self._updates_round:
            # A new round reflects the notices up to its plan's number.
            self._updates_round = plan.number
            self._updates_seen = plan.updates
        values = torch.zeros(2, dtype=torch.float64)
        if self._rank() == 0:
            number, flags = _read_host_update()
            values[0] = float(number)
            values[1] = float(flags)
        result = ops.allreduce(values, op=ops.Sum, name=HOST_UPDATES_NAME)
        number, flags = int(result[0].item()), int(result[1].item())
        if number > self._updates_seen:
            self._updates_seen = number
            raise HostsUpdatedInterrupt(skip_sync=flags == _elastic.HOSTS_REMOVED)


@dataclass
class _Commit:
    """A commit built in full before it replaces the saved one.

    Attributes:
        number: the commit's number (the previous one's plus one).
        values: deep copies of the plain attributes.
        handlers: each handler's new snapshot, by attribute name (handlers with ``capture``).
        undo: how to put back handlers that saved in place (handlers with their own ``save``).
    """

    number: int
    values: dict[str, Any]
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
        bcast_object: Callable[[Any], Any] | None = None,
        get_rank: Callable[[], int] | None = None,
        commit_dir: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> None:
        _check_names(type(self), kwargs)
        State.__init__(self, bcast_object=bcast_object, get_rank=get_rank)
        self._saved_state: dict[str, Any] = copy.deepcopy(kwargs)
        for attr, value in kwargs.items():
            setattr(self, attr, value)
        # How many commits the job has made (carried by the durable commit across restarts).
        self._commits = 0
        self._durable = _commit_directory(commit_dir)
        self._durable_ready = False
        self._bcast_status = bcast_object or _default_bcast_status
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

    def _build_commit(self) -> _Commit:
        """The new commit; nothing of the state changes here."""
        return _Commit(number=self._commits + 1, values=self._copy_values(self._current()))

    def _current(self) -> dict[str, Any]:
        return {attr: getattr(self, attr) for attr in self._saved_state}

    def _install(self, commit: _Commit) -> None:
        """Make ``commit`` the saved state (assignments only: this cannot fail half-way)."""
        self._saved_state = commit.values
        self._commits = commit.number

    def _write_durable(self, commit: _Commit) -> None:
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
    def _copy_values(values: dict[str, Any]) -> dict[str, Any]:
        return {attr: copy.deepcopy(value) for attr, value in values.items()}

    def _assign(self, values: dict[str, Any]) -> None:
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
        status: dict[str, Any] | None = None
        failure: Exception | None = None
        if self._rank() == 0:
            try:
                if first:
                    self._resume(self._durable)
            except Exception as exc:  # noqa: BLE001 - every rank must hear of it, then raise
                failure = exc
            status = {"commits": self._commits, "error": None if failure is None else str(failure)}
        status = self._bcast_status(status)
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

    def _load_record(self, record: dict[str, Any], directory: CommitDirectory) -> None:
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
        commit = _Commit(number=int(record.get("commit", 0)), values=values, handlers=handlers)
        self._install(commit)
        self.restore()

    def _check_layout(
        self, handlers: dict[str, Any], values: dict[str, Any], directory: CommitDirectory
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
        """Raise ValueError when a handler's snapshot cannot be applied (:class:`TorchState`)."""


def _check_names(cls: type, names: dict[str, Any]) -> None:
    for name in names:
        if name.startswith("_") or hasattr(cls, name):
            raise ValueError(
                f"{cls.__name__}: {name!r} cannot be a state attribute (it is private or a "
                f"method of {cls.__name__}); choose another name."
            )


# ---------------------------------------------------------------- TorchState's handlers


class StateHandler(_Snapshot):
    """Saves, restores and synchronizes one object of a :class:`TorchState`.

    A handler implements :meth:`capture` (a new snapshot of the object, independent of it),
    :meth:`apply` (put a snapshot into the object) and :meth:`sync`, and may implement
    :meth:`check`; the base class builds ``save`` and ``restore`` from them and keeps the last
    commit's snapshot in :attr:`committed`. Such a handler takes part in all-or-nothing commits
    and in durable commits (its snapshot must then be picklable, ideally tensors and plain
    containers, so that it loads with ``torch.load(weights_only=True)``).

    A handler written for Horovod's protocol, overriding ``save`` and ``restore`` instead,
    still works: a failed commit puts its attributes back as they were before its ``save``.
    It cannot be written to a ``commit_dir``.

    Args:
        value: the object (a model, an optimizer, ...).

    Attributes:
        value: the object.
        name: the attribute's name in the state (set by ``TorchState``); used to name the
            collectives of :meth:`sync`.
        committed: the snapshot of the last commit (``None`` before the first).
    """

    def __init__(self, value: Any) -> None:
        self.value = value
        self.name = type(value).__name__
        self.committed: Any = None

    def capture(self) -> Any:
        """A new snapshot of :attr:`value` that later changes of the object cannot alter."""
        raise NotImplementedError(f"{type(self).__name__} must implement capture()")

    def apply(self, snapshot: Any) -> None:
        """Put ``snapshot`` into :attr:`value` (without keeping references into it)."""
        raise NotImplementedError(f"{type(self).__name__} must implement apply()")

    def check(self, snapshot: Any) -> None:
        """Raise ValueError, saying why, when :meth:`apply` could not take ``snapshot`` whole.

        Called for every handler before any is applied. By default accepts everything.
        """
        del snapshot

    def save(self) -> None:
        self.committed = self.capture()

    def restore(self) -> None:
        self.apply(self.committed)

    def set_value(self, value: Any) -> None:
        """Replace the object (the state's attribute was assigned) and save it."""
        self.value = value
        self.save()


def _own_protocol(handler: StateHandler) -> bool:
    """Whether ``handler`` overrides ``save``/``restore`` (Horovod's protocol) instead of
    implementing ``capture``/``apply``."""
    kind = type(handler)
    return kind.save is not StateHandler.save or kind.restore is not StateHandler.restore


def _shape(value: Any) -> tuple[int, ...] | None:
    shape = getattr(value, "shape", None)
    return tuple(shape) if shape is not None else None


class ModelStateHandler(StateHandler):
    """``torch.nn.Module``: a deep copy of ``state_dict()``; checked (keys and shapes) and
    restored with ``load_state_dict``; synchronized with ``broadcast_parameters(state_dict(),
    0)``."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.save()

    def capture(self) -> Any:
        return copy.deepcopy(self.value.state_dict())

    def check(self, snapshot: Any) -> None:
        current = self.value.state_dict()
        if not isinstance(snapshot, dict):
            raise ValueError(f"'{self.name}': a state_dict is a dict, got {type(snapshot)}")
        problems = []
        missing, unexpected = current.keys() - snapshot.keys(), snapshot.keys() - current.keys()
        if missing:
            problems.append(f"missing keys {sorted(missing)}")
        if unexpected:
            problems.append(f"unexpected keys {sorted(unexpected)}")
        for key in sorted(current.keys() & snapshot.keys()):
            have, want = _shape(snapshot[key]), _shape(current[key])
            if have != want:
                problems.append(f"{key!r} has shape {have} in the snapshot, {want} in the model")
        if problems:
            raise ValueError(f"model '{self.name}': " + "; ".join(problems))

    def apply(self, snapshot: Any) -> None:
        self.value.load_state_dict(snapshot)

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(StateHandler):
    """``torch.optim.Optimizer``: a deep copy of ``state_dict()``; checked (parameter groups)
    and restored with ``load_state_dict`` (of a fresh copy, so later steps cannot change the
    snapshot); synchronized with ``broadcast_optimizer_state(optimizer, 0)``, which also gives an
    optimizer that never stepped (a worker that just joined) the state rank 0 has."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        self.save()

    def capture(self) -> Any:
        return copy.deepcopy(self.value.state_dict())

    def check(self, snapshot: Any) -> None:
        groups = snapshot.get("param_groups") if isinstance(snapshot, dict) else None
        if not isinstance(groups, list):
            raise ValueError(f"optimizer '{self.name}': the snapshot has no 'param_groups'")
        have = [len(group.get("params", ())) for group in groups]
        want = [len(group["params"]) for group in self.value.param_groups]
        if have != want:
            raise ValueError(
                f"optimizer '{self.name}': parameters per group are {have} in the snapshot, "
                f"{want} in the optimizer"
            )

    def apply(self, snapshot: Any) -> None:
        # load_state_dict keeps the tensors it is given (when dtype and device already fit),
        # and steps update them in place: hand it a copy.
        self.value.load_state_dict(copy.deepcopy(snapshot))

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class SamplerStateHandler(StateHandler):
    """:class:`ElasticSampler`: a copy of ``state_dict()`` (epoch, processed samples); synchronized
    by broadcasting rank 0's ``state_dict()``; ``reset`` re-shards for the new job size."""

    def __init__(self, sampler: ElasticSampler) -> None:
        super().__init__(sampler)
        self.save()

    def capture(self) -> Any:
        return copy.deepcopy(self.value.state_dict())

    def check(self, snapshot: Any) -> None:
        if not isinstance(snapshot, dict) or set(snapshot) != set(self.value.state_dict()):
            raise ValueError(f"sampler '{self.name}': not an ElasticSampler state: {snapshot!r}")

    def apply(self, snapshot: Any) -> None:
        self.value.load_state_dict(copy.deepcopy(snapshot))

    def sync(self) -> None:
        state_dict = _broadcast_from_root(
            self.value.state_dict(), f"hora.elastic.sampler.{self.name}"
        )
        self.value.load_state_dict(state_dict)

    def reset(self) -> None:
        self.value.reset()


_handler_registry: list[tuple[type, type[StateHandler]]] = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> list[tuple[type, type[StateHandler]]]:
    """The ``(type, handler class)`` pairs ``TorchState`` consults, first match wins."""
    return _handler_registry


def set_handler_registry(registry: list[tuple[type, type[StateHandler]]]) -> None:
    """Replace the registry (for ``TorchState`` objects created afterwards).

    Example:
        >>> hvd.elastic.set_handler_registry(
        ...     [(MyScheduler, MySchedulerHandler)] + hvd.elastic.get_handler_registry())
    """
    global _handler_registry
    _handler_registry = list(registry)


def _handler_for(value: Any) -> StateHandler | None:
    for kind, handler_cls in _handler_registry:
        if isinstance(value, kind):
            handler = handler_cls(value)
            if not _own_protocol(handler) and getattr(handler, "committed", None) is None:
                handler.save()
            return handler
    return None


def _put_back(handler: StateHandler) -> Callable[[], None]:
    """Undo for a handler with its own ``save``: its attributes as they are now."""
    before = dict(vars(handler))

    def undo() -> None:
        vars(handler).clear()
        vars(handler).update(before)

    return undo


class TorchState(ObjectState):
    """Elastic state for PyTorch training: a model, an optimizer, samplers and plain values.

    Each keyword whose value has a handler in the registry (``nn.Module``, ``Optimizer``,
    :class:`ElasticSampler` by default) is kept by that handler; every other keyword is an
    :class:`ObjectState` attribute (``epoch``, ``batch``, ...). Assigning a new object to a
    handled attribute (``state.model = other_model``) hands it to the handler and saves it.
    The constructor saves once.

    ``save()`` (and so ``commit()``) is all-or-nothing: every handler's snapshot and the values
    are copied first and replace the last commit together, only when all copies (and rank 0's
    durable write) succeeded. ``restore()`` checks every snapshot against its object (keys and
    shapes of a model, parameter groups of an optimizer) before it changes any.

    ``sync()`` broadcasts, in this order, each handled object from rank 0 (the model's
    ``state_dict``, the optimizer's state and hyper-parameters, the sampler's progress), then
    the plain attributes' saved values, and makes what every rank now holds its last commit.
    ``reset()`` lets the handlers adapt to the new job (the sampler re-shards).

    Args:
        model: a ``torch.nn.Module`` (or ``None``).
        optimizer: a ``torch.optim.Optimizer``, possibly a ``hvd.DistributedOptimizer``.
        commit_dir: the durable commit's directory, see :class:`ObjectState`.
        **kwargs: further objects and values.

    Raises:
        TypeError: ``commit_dir`` with a handler that has no ``capture``/``apply``.

    Example:
        >>> state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)
        >>> durable = hvd.elastic.TorchState(model, optimizer, commit_dir="/shared/run-7", epoch=0)
    """

    _handlers: dict[str, StateHandler]

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        commit_dir: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        _check_names(type(self), kwargs)
        handlers: dict[str, StateHandler] = {}
        plain: dict[str, Any] = {}
        for name, value in kwargs.items():
            handler = _handler_for(value)
            if handler is None:
                plain[name] = value
            else:
                handler.name = name
                handlers[name] = handler
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(bcast_object=None, get_rank=None, commit_dir=commit_dir, **plain)
        self._refuse_own_protocol_handlers()

    def _refuse_own_protocol_handlers(self) -> None:
        if self._durable is None:
            return
        own = [f"{n} ({type(h).__name__})" for n, h in self._handlers.items() if _own_protocol(h)]
        if own:
            raise TypeError(
                f"TorchState(commit_dir={str(self._durable.path)!r}): the handlers of "
                f"{', '.join(own)} override save()/restore(), so their snapshots cannot be "
                "written to disk. Implement capture() and apply() instead (see StateHandler)."
            )

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].set_value(value)
        object.__setattr__(self, name, value)

    def _build_commit(self) -> _Commit:
        snapshots, undo = self._capture_handlers()
        try:
            commit = super()._build_commit()
        except BaseException:
            for step in reversed(undo):
                step()
            raise
        commit.handlers, commit.undo = snapshots, undo
        return commit

    def _capture_handlers(self) -> tuple[dict[str, Any], list[Callable[[], None]]]:
        """Every handler's new snapshot; handlers with their own ``save`` save in place (and
        are put back if a later one fails)."""
        snapshots: dict[str, Any] = {}
        undo: list[Callable[[], None]] = []
        try:
            for name, handler in self._handlers.items():
                if _own_protocol(handler):
                    undo.append(_put_back(handler))
                    handler.save()
                else:
                    snapshots[name] = handler.capture()
        except BaseException:
            for step in reversed(undo):
                step()
            raise
        return snapshots, undo

    def _install(self, commit: _Commit) -> None:
        for name, snapshot in commit.handlers.items():
            self._handlers[name].committed = snapshot
        super()._install(commit)

    def restore(self) -> None:
        values = self._copy_values(self._saved_state)
        self._check_snapshots(
            {n: h.committed for n, h in self._handlers.items() if not _own_protocol(h)}
        )
        for handler in self._handlers.values():
            handler.restore()
        self._assign(values)

    def sync(self) -> None:
        self._sync_commit_dir()
        for handler in self._handlers.values():
            handler.sync()
        self._sync_values()
        # What every rank holds now is rank 0's state: make it each rank's last commit, so that
        # a rank that becomes rank 0 after a later failure does not restore older objects.
        snapshots, _ = self._capture_handlers()
        for name, snapshot in snapshots.items():
            self._handlers[name].committed = snapshot
        self._synced_once = True

    def reset(self) -> None:
        for handler in self._handlers.values():
            handler.reset()

    def _handler_names(self) -> list[str]:
        return list(self._handlers)

    def _check_snapshots(self, handlers: dict[str, Any]) -> None:
        for name, snapshot in handlers.items():
            self._handlers[name].check(snapshot)
