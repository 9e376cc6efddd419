"""``TorchState``: an elastic state that keeps PyTorch models, optimizers and
:class:`ElasticSampler` objects, through *handlers* chosen by type from a registry
(:func:`get_handler_registry`), on top of :class:`~hora.common.elastic.state.ObjectState`.

``restore()`` checks every handler's snapshot before it changes any object; a commit is
all-or-nothing, as :mod:`hora.common.elastic.state` describes.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import torch

from hora.common.elastic.state import (
    Commit,
    ObjectState,
    Snapshot,
    check_names,
    handler_registry,
    replace_handler_registry,
)
from hora.common.ops.objects import broadcast_object
from hora.torch import zero_state
from hora.torch.deterministic_sampler import DeterministicSampler
from hora.torch.elastic.sampler import ElasticSampler
from hora.torch.functions import broadcast_optimizer_state, broadcast_parameters
from hora.torch.zero_optimizer import ShardedOptimizer

# ---------------------------------------------------------------- TorchState's handlers


class StateHandler(Snapshot):
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


class _StateDictHandler(StateHandler):
    """An object with ``state_dict()``: a snapshot is a deep copy of it, the first one taken as
    the handler is made. (Each subclass keeps Horovod's name for its constructor's argument.)"""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self.save()

    def capture(self) -> Any:
        return copy.deepcopy(self.value.state_dict())


class ModelStateHandler(_StateDictHandler):
    """``torch.nn.Module``: a deep copy of ``state_dict()``; checked (keys and shapes) and
    restored with ``load_state_dict``; synchronized with ``broadcast_parameters(state_dict(),
    0)``."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)

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


class OptimizerStateHandler(_StateDictHandler):
    """``torch.optim.Optimizer``: a deep copy of ``state_dict()``; checked (parameter groups)
    and restored with ``load_state_dict`` (of a fresh copy, so later steps cannot change the
    snapshot); synchronized with ``broadcast_optimizer_state(optimizer, 0)``, which also gives an
    optimizer that never stepped (a worker that just joined) the state rank 0 has."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)

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


class ShardedOptimizerStateHandler(OptimizerStateHandler):
    """A sharded ``DistributedOptimizer`` (``shard_optimizer_state=True``): a snapshot is the
    consolidated state (every rank's shard, gathered at commit), so the ranks that survive a
    failure still hold every shard; restoring and synchronizing slice it for the ranks there
    are then (see :mod:`hora.torch.zero_state`)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        StateHandler.__init__(self, optimizer)
        self.committed = zero_state.initial_snapshot(optimizer)  # type: ignore[arg-type]

    def capture(self) -> Any:
        return self.value.state_dict()  # new tensors: nothing to copy

    def apply(self, snapshot: Any) -> None:
        self.value.load_state_dict(snapshot)  # keeps copies of this rank's slices

    def sync(self) -> None:
        zero_state.sync_from_root(self.value, self.committed, root_rank=0)


class SamplerStateHandler(_StateDictHandler):
    """:class:`ElasticSampler` (or deterministic mode's ``DeterministicSampler``): a copy of
    ``state_dict()`` (epoch, processed samples or steps); synchronized by broadcasting rank 0's
    ``state_dict()``; ``reset`` re-shards for the new job size."""

    def __init__(self, sampler: ElasticSampler | DeterministicSampler) -> None:
        super().__init__(sampler)

    def check(self, snapshot: Any) -> None:
        if not isinstance(snapshot, dict) or set(snapshot) != set(self.value.state_dict()):
            raise ValueError(f"sampler '{self.name}': not an ElasticSampler state: {snapshot!r}")

    def apply(self, snapshot: Any) -> None:
        self.value.load_state_dict(copy.deepcopy(snapshot))

    def sync(self) -> None:
        state_dict = broadcast_object(
            self.value.state_dict(), root_rank=0, name=f"hora.elastic.sampler.{self.name}"
        )
        self.value.load_state_dict(state_dict)

    def reset(self) -> None:
        self.value.reset()


# The registry until the user replaces it (the process's runtime keeps the one in use).
_DEFAULT_HANDLERS: tuple[tuple[type, type[StateHandler]], ...] = (
    (torch.nn.Module, ModelStateHandler),
    (ShardedOptimizer, ShardedOptimizerStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
    (DeterministicSampler, SamplerStateHandler),
)


def get_handler_registry() -> list[tuple[type, type[StateHandler]]]:
    """The ``(type, handler class)`` pairs ``TorchState`` consults, first match wins."""
    return handler_registry(_DEFAULT_HANDLERS)


def set_handler_registry(registry: list[tuple[type, type[StateHandler]]]) -> None:
    """Replace the registry (for ``TorchState`` objects created afterwards).

    Example:
        >>> hvd.elastic.set_handler_registry(
        ...     [(MyScheduler, MySchedulerHandler)] + hvd.elastic.get_handler_registry())
    """
    replace_handler_registry(registry)


def _handler_for(value: Any) -> StateHandler | None:
    for kind, handler_cls in get_handler_registry():
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
        check_names(type(self), kwargs)
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

    def _build_commit(self) -> Commit:
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

    def _install(self, commit: Commit) -> None:
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
