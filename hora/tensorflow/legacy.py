"""TensorFlow 1's training API in ``tf.compat.v1`` graphs run by a session: a
``tf.compat.v1.train.Optimizer`` whose gradients are averaged across ranks, and the session hook
that broadcasts the initial variables.

``hvd.DistributedOptimizer`` gives these for a ``tf.compat.v1.train`` optimizer and
``hvd.BroadcastGlobalVariablesHook`` the hook, so that a Horovod TensorFlow 1 script
(``MonitoredTrainingSession`` with hooks, or ``minimize`` and ``session.run``) runs unchanged.
The gradients are averaged by the same :class:`~hora.tensorflow.gradients.GradientReducer` as
``DistributedGradientTape``'s; with ``backward_passes_per_step`` > 1 they are summed locally by
:class:`~hora.tensorflow.gradient_aggregation.LocalGradientAggregationHelper` and reduced every
that many steps (the steps between count ``global_step`` without applying anything).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hora.common import api
from hora.tensorflow.gradient_aggregation import LocalGradientAggregationHelper
from hora.tensorflow.gradients import GradientReducer


class DistributedLegacyOptimizer(tf.compat.v1.train.Optimizer):  # type: ignore[misc]
    """A ``tf.compat.v1.train.Optimizer`` that averages the gradients of the optimizer it
    wraps across ranks in :meth:`compute_gradients`, then lets it apply them.

    Args:
        optimizer: the ``tf.compat.v1.train.Optimizer`` to wrap (kept as ``_optimizer``).
        name: this optimizer's name (default ``Distributed`` + the wrapped one's class name).
        use_locking: passed to ``tf.compat.v1.train.Optimizer``.
        reducer: how the gradients are averaged (compression, op, groups, process set...).
        backward_passes_per_step: sum this many steps' gradients locally before reducing.
        average_aggregated_gradients: divide those sums by ``backward_passes_per_step``.
    """

    def __init__(
        self,
        optimizer: Any,
        name: str | None,
        use_locking: bool,
        reducer: GradientReducer,
        backward_passes_per_step: int,
        average_aggregated_gradients: bool,
    ) -> None:
        super().__init__(
            name=name or f"Distributed{type(optimizer).__name__}", use_locking=use_locking
        )
        self._optimizer = optimizer
        self._reducer = reducer
        self._aggregation: LocalGradientAggregationHelper | None = None
        if backward_passes_per_step != 1:
            self._aggregation = LocalGradientAggregationHelper(
                backward_passes_per_step,
                reducer.reduce,
                reducer.sparse_as_dense,
                average_aggregated_gradients,
                api.rank(),
                LocalGradientAggregationHelper._OPTIMIZER_TYPE_LEGACY,
                reducer.process_set,
                reducer.scale_local_gradients,
                name="hora_legacy_",
            )

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        """The wrapped optimizer's ``(gradient, variable)`` pairs, the gradients averaged
        across ranks (on every ``backward_passes_per_step``-th step, of the local sums)."""
        pairs = list(self._optimizer.compute_gradients(*args, **kwargs))
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]
        if self._aggregation is not None:
            reduced = self._aggregation.compute_gradients(grads, variables)
        else:
            reduced = self._reducer.reduce(grads, variables)
        return list(zip(reduced, variables))

    def apply_gradients(
        self, grads_and_vars: Any, global_step: Any = None, name: str | None = None
    ) -> Any:
        """The wrapped optimizer's update; with ``backward_passes_per_step`` > 1 only on the
        steps that reduced (the others add one to ``global_step``)."""
        pairs = list(grads_and_vars)
        if self._aggregation is None:
            return self._optimizer.apply_gradients(pairs, global_step=global_step, name=name)
        # The choice reads the aggregation's counter: after compute_gradients has counted
        # this step, which the gradients depend on.
        with tf.control_dependencies([g for g, _ in pairs if g is not None]):
            applied = self._aggregation.apply_gradients(
                lambda: self._optimizer.apply_gradients(pairs, global_step=global_step, name=name),
                self._optimizer,
                global_step=global_step,
            )
        return applied

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.variables(*args, **kwargs)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):  # type: ignore[misc]
    """Broadcast every global variable from ``root_rank`` once the session is created (and its
    variables initialized or restored), so that all ranks start from the same state.

    Args:
        root_rank: the rank whose values every rank takes.
        device: accepted for compatibility with Horovod (hora places its ops itself).

    Example:
        >>> hooks = [hvd.BroadcastGlobalVariablesHook(0)]
        >>> with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as session: ...
    """

    def __init__(self, root_rank: int, device: str = "") -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.bcast_op: Any = None

    def begin(self) -> None:
        from hora.tensorflow.functions import broadcast_global_variables

        if self.bcast_op is None or self.bcast_op.graph is not tf.compat.v1.get_default_graph():
            self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session: Any, coord: Any) -> None:
        session.run(self.bcast_op)
