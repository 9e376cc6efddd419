"""Elastic training for TensorFlow: ``hvd.elastic.run`` with ``TensorFlowKerasState`` or
``TensorFlowState``.

The protocol is :mod:`hora.common.elastic`'s, as in PyTorch: ``commit()`` saves, a failed collective
rolls back to the last commit, and every reset starts with a ``sync()`` from rank 0. The states
here keep TensorFlow variables (a Keras model's and its optimizer's, or a list) besides plain
values; a commit copies them all before replacing the previous one, and with ``commit_dir`` it is
written to disk too (docs/elastic.md, "Durable commits").

Inside ``tf.function`` a failed collective reaches Python as a TensorFlow error (TensorFlow
turns errors raised in its ``py_function`` into ``UnknownError``); :func:`run` treats any
TensorFlow error raised while hora's engine reports a failure as the failed collective it is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import tensorflow as tf
import torch

from hora.common import api
from hora.common.api import init, rank, shutdown
from hora.common.elastic import loop as _loop
from hora.common.elastic.loop import run_fn
from hora.common.elastic.state import Commit, ObjectState
from hora.common.ops import engine_facts
from hora.common.vocabulary.errors import (
    HoraInternalError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
)
from hora.tensorflow import ops
from hora.tensorflow.functions import (  # horovod.tensorflow.elastic has these four too
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)

F = TypeVar("F", bound=Callable[..., Any])

__all__ = [
    "HoraInternalError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "TensorFlowKerasState",
    "TensorFlowState",
    "broadcast_object",
    "broadcast_object_fn",
    "broadcast_variables",
    "init",
    "rank",
    "run",
    "run_fn",
    "shutdown",
]


def run(func: F) -> F:
    """Decorator: run ``func(state, ...)`` until it returns, surviving resets (see
    :func:`hora.common.elastic.loop.run`); also inside ``tf.function`` steps."""

    @functools.wraps(func)
    def translated(state: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as exc:
            if isinstance(exc, HoraInternalError) or not engine_facts.engine_stopped():
                raise
            raise HoraInternalError(
                f"a collective failed inside TensorFlow: {exc.message}"
            ) from exc

    return _loop.run(translated)  # type: ignore[return-value]


class _VariablesState(ObjectState):
    """An :class:`ObjectState` that also keeps a list of TensorFlow variables."""

    _NAME = "variables"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._saved_variables: list[np.ndarray[Any, Any]] = self._capture()

    def _variables(self) -> list[Any]:
        raise NotImplementedError

    def _capture(self) -> list[np.ndarray[Any, Any]]:
        return [np.array(v.numpy(), copy=True) for v in self._variables()]

    def _build_commit(self) -> Commit:
        commit = super()._build_commit()
        commit.handlers[self._NAME] = [torch.from_numpy(a) for a in self._capture()]
        return commit

    def _install(self, commit: Commit) -> None:
        snapshot = commit.handlers.get(self._NAME)
        super()._install(commit)
        if snapshot is not None:
            self._saved_variables = [np.asarray(t.numpy()) for t in snapshot]

    def _handler_names(self) -> list[str]:
        return [self._NAME]

    def _check_snapshots(self, handlers: dict[str, Any]) -> None:
        snapshot = handlers[self._NAME]
        shapes = [tuple(v.shape) for v in self._variables()]
        theirs = [tuple(t.shape) for t in snapshot]
        if shapes != theirs:
            raise ValueError(f"the variables' shapes are {theirs}, this state's are {shapes}")

    def restore(self) -> None:
        variables = self._variables()
        if len(variables) != len(self._saved_variables):
            raise ValueError(
                f"the state holds {len(self._saved_variables)} saved variables but the model "
                f"now has {len(variables)}; build the model and optimizer before the state."
            )
        for variable, value in zip(variables, self._saved_variables):
            variable.assign(value)
        super().restore()

    def sync(self) -> None:
        # Rank 0 first resumes from the durable commit (when there is one and this process has
        # not synced yet); then everyone takes rank 0's variables and values.
        self._sync_commit_dir()
        variables = self._variables()
        if variables and api.size() > 1:
            ops.broadcast_(variables, 0, name="hora.elastic.tf_variables")
        self._sync_values()
        self._synced_once = True
        # What every rank holds now is the commit to roll back to.
        self._saved_variables = self._capture()


class TensorFlowKerasState(_VariablesState):
    """Elastic state for Keras: the model's and the optimizer's variables, and plain values.

    Build the optimizer's variables before the state (``model.compile`` then one step, or
    ``optimizer.build(model.trainable_variables)``) so that every commit covers them.

    Args:
        model: a Keras model.
        optimizer: its optimizer (default: ``model.optimizer``).
        backend: accepted for compatibility.
        **kwargs: plain values (``epoch=0, batch=0``) and ``commit_dir``.
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any):
        del backend
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        super().__init__(**kwargs)

    def _variables(self) -> list[Any]:
        variables = list(self.model.variables)
        if self.optimizer is not None:
            variables += list(getattr(self.optimizer, "variables", []) or [])
        return variables


class TensorFlowState(_VariablesState):
    """Elastic state for a list of ``tf.Variable`` objects and plain values (TensorFlow 1
    sessions are not supported: ``session`` must be ``None``)."""

    def __init__(self, variables: Any = None, session: Any = None, **kwargs: Any):
        if session is not None:
            raise NotImplementedError(
                "hora.tensorflow runs TensorFlow 2; elastic state with a TensorFlow 1 session "
                "is not supported."
            )
        self.variables = list(variables or [])
        super().__init__(**kwargs)

    def _variables(self) -> list[Any]:
        return self.variables
