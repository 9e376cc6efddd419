"""The training state of an elastic job: what is committed, rolled back and synchronized.

:class:`State` is the protocol ``hvd.elastic.run`` drives: ``commit()`` (save, then look for host
changes), ``restore()`` (back to the last commit), ``sync()`` (everyone takes rank 0's state),
``on_reset()`` (after the job re-formed). :class:`ObjectState` keeps plain Python attributes;
:class:`TorchState` adds models, optimizers and :class:`ElasticSampler` objects through
*handlers* chosen by type from a registry (:func:`get_handler_registry`).

Names of the collectives: every collective here has a fixed name, so that a worker that joined
the job a moment ago and workers that have been training for hours issue identical requests.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import torch

from hora.common import basics
from hora.common.errors import HostsUpdatedInterrupt
from hora.common.job import rounds as _elastic
from hora.common.job.store import StoreClient
from hora.torch import ops
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
        copies the whole state) and call :meth:`check_host_updates` in between.
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


class ObjectState(State):
    """Plain Python attributes as elastic state: ``ObjectState(epoch=0, batch=0)``.

    Every keyword becomes an attribute. ``save`` keeps a deep copy of the attributes' values,
    ``restore`` assigns (a copy of) that snapshot back, ``sync`` sends rank 0's *saved* values
    to every rank and assigns them. The constructor saves once. Attributes added later (not
    passed to the constructor) are not part of the state. Values must be deep-copyable and
    picklable (cloudpickle).

    Args:
        bcast_object, get_rank: see :class:`State`.
        **kwargs: the attributes and their initial values.

    Example:
        >>> state = hvd.elastic.ObjectState(epoch=0, batch=0)
        >>> state.epoch += 1
        >>> state.commit()
    """

    def __init__(
        self,
        bcast_object: Callable[[Any], Any] | None = None,
        get_rank: Callable[[], int] | None = None,
        **kwargs: Any,
    ) -> None:
        _check_names(type(self), kwargs)
        State.__init__(self, bcast_object=bcast_object, get_rank=get_rank)
        self._saved_state: dict[str, Any] = copy.deepcopy(kwargs)
        for attr, value in kwargs.items():
            setattr(self, attr, value)

    def save(self) -> None:
        self._saved_state = {attr: copy.deepcopy(getattr(self, attr)) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, copy.deepcopy(value))


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

    Args:
        value: the object (a model, an optimizer, ...).

    Attributes:
        value: the object.
        name: the attribute's name in the state (set by ``TorchState``); used to name the
            collectives of :meth:`sync`.
    """

    def __init__(self, value: Any) -> None:
        self.value = value
        self.name = type(value).__name__

    def set_value(self, value: Any) -> None:
        """Replace the object (the state's attribute was assigned) and save it."""
        self.value = value
        self.save()


class ModelStateHandler(StateHandler):
    """``torch.nn.Module``: a deep copy of ``state_dict()``; restored with
    ``load_state_dict``; synchronized with ``broadcast_parameters(state_dict(), 0)``."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self._saved_model_state = copy.deepcopy(model.state_dict())

    def save(self) -> None:
        self._saved_model_state = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved_model_state)

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(StateHandler):
    """``torch.optim.Optimizer``: a deep copy of ``state_dict()``; restored with
    ``load_state_dict`` (of a fresh copy, so later steps cannot change the snapshot);
    synchronized with ``broadcast_optimizer_state(optimizer, 0)``, which also gives an
    optimizer that never stepped (a worker that just joined) the state rank 0 has."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        self._saved_optimizer_state = copy.deepcopy(optimizer.state_dict())

    def save(self) -> None:
        self._saved_optimizer_state = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        # load_state_dict keeps the tensors it is given (when dtype and device already fit),
        # and steps update them in place: hand it a copy.
        self.value.load_state_dict(copy.deepcopy(self._saved_optimizer_state))

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class SamplerStateHandler(StateHandler):
    """:class:`ElasticSampler`: a copy of ``state_dict()`` (epoch, processed samples); synchronized
    by broadcasting rank 0's ``state_dict()``; ``reset`` re-shards for the new job size."""

    def __init__(self, sampler: ElasticSampler) -> None:
        super().__init__(sampler)
        self._saved_sampler_state = copy.deepcopy(sampler.state_dict())

    def save(self) -> None:
        self._saved_sampler_state = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self._saved_sampler_state))

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
            return handler_cls(value)
    return None


class TorchState(ObjectState):
    """Elastic state for PyTorch training: a model, an optimizer, samplers and plain values.

    Each keyword whose value has a handler in the registry (``nn.Module``, ``Optimizer``,
    :class:`ElasticSampler` by default) is kept by that handler; every other keyword is an
    :class:`ObjectState` attribute (``epoch``, ``batch``, ...). Assigning a new object to a
    handled attribute (``state.model = other_model``) hands it to the handler and saves it.
    The constructor saves once.

    ``sync()`` broadcasts, in this order, each handled object from rank 0 (the model's
    ``state_dict``, the optimizer's state and hyper-parameters, the sampler's progress), then
    the plain attributes' saved values. ``reset()`` lets the handlers adapt to the new job (the
    sampler re-shards).

    Args:
        model: a ``torch.nn.Module`` (or ``None``).
        optimizer: a ``torch.optim.Optimizer``, possibly a ``hvd.DistributedOptimizer``.
        **kwargs: further objects and values.

    Example:
        >>> state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)
    """

    _handlers: dict[str, StateHandler]

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
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
        super().__init__(bcast_object=None, get_rank=None, **plain)

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].set_value(value)
        object.__setattr__(self, name, value)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def reset(self) -> None:
        for handler in self._handlers.values():
            handler.reset()
