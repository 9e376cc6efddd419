"""Horovod's local gradient aggregation helpers: sum a rank's gradients over
``backward_passes_per_step`` calls, and communicate only on every such call.

These are the classes Horovod scripts import from ``horovod.tensorflow.gradient_aggregation``
(:class:`LocalGradientAggregationHelper`) and ``horovod.tensorflow.gradient_aggregation_eager``
(:class:`LocalGradientAggregationHelperEager`, which that module of hora re-exports), for code
that drives the aggregation itself: a custom optimizer or training step. hora's Keras
``DistributedOptimizer`` accumulates with its own accumulator (``backward_passes_per_step=``),
not with these.

Both work eagerly, inside ``tf.function`` and in ``tf.compat.v1`` graphs run by a session (the
latter is how hora's ``DistributedOptimizer`` aggregates for a ``tf.compat.v1.train``
optimizer). The sums live in ``tf.Variable`` objects made once, outside any function being
traced (``tf.init_scope``), one per gradient position; the call that reaches
``backward_passes_per_step`` hands the sums to ``allreduce_func`` and zeroes them, and the
choice is a ``tf.cond``, so every rank runs the same collectives in the same order. They differ as Horovod's do in what the other calls return:
the helper gives back the gradients it was given, the eager helper the sums so far.

Each call of ``compute_gradients`` must pass the gradients in the same positions (the same
variables in the same order), as a training step does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from hora.common.process_sets import ProcessSet
from hora.tensorflow import ops
from hora.tensorflow.gradients import GradientReducer

__all__ = ["LocalGradientAggregationHelper", "LocalGradientAggregationHelperEager"]

# allreduce_func(gradients, variables) -> the gradients reduced across ranks, in order.
AllreduceFunc = Callable[[list[Any], list[Any]], Sequence[Any]]

_SPARSE = (
    "IndexedSlices are not supported when `backward_passes_per_step` > 1 and "
    "`sparse_as_dense` is False: pass sparse_as_dense=True to sum them as dense tensors."
)


class _LocalAggregation:
    """What both helpers share: the sums, the counter, the reduction and the update's skip.

    Its constructor is :class:`LocalGradientAggregationHelperEager`'s (Horovod's signature).
    """

    # Starts the names of the helper's variables: a subclass sets it before calling __init__.
    name = ""

    def __init__(
        self,
        backward_passes_per_step: int,
        allreduce_func: AllreduceFunc | None,
        sparse_as_dense: bool,
        average_aggregated_gradients: bool,
        process_set: ProcessSet = ops.global_process_set,
        scale_local_gradients: bool = True,
    ) -> None:
        if isinstance(backward_passes_per_step, bool) or not isinstance(
            backward_passes_per_step, int
        ):
            raise ValueError(
                "backward_passes_per_step must be an integer > 0; got "
                f"{backward_passes_per_step!r}."
            )
        if backward_passes_per_step <= 0:
            raise ValueError(
                f"backward_passes_per_step must be > 0; got {backward_passes_per_step}."
            )
        self.backward_passes_per_step = backward_passes_per_step
        self.allreduce_grads = allreduce_func or self._average
        self.sparse_as_dense = sparse_as_dense
        self.average_aggregated_gradients = average_aggregated_gradients
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        # The sums, by position in the gradient list (positions whose gradient is None have
        # none). ``counter``: calls since the last reduction; 0 right after it.
        self.locally_aggregated_grads: dict[int, tf.Variable] = {}
        with tf.init_scope():
            self.counter = tf.Variable(
                0, dtype=tf.int32, trainable=False, name=f"{self.name}aggregation_counter"
            )
        # Variables whose gradients stay on this rank, by id (the objects kept alive here).
        self._local_vars: dict[int, Any] = {}
        self._reducer = GradientReducer(
            sparse_as_dense=sparse_as_dense, process_set=process_set, prefix="hora.aggregated"
        )

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient on this rank: it is summed but not reduced across ranks
        (divided by the process set's size when ``scale_local_gradients``)."""
        self._local_vars[id(var)] = var

    # ------------------------------------------------------------ summing

    def _dense(self, grad: Any) -> Any:
        if isinstance(grad, tf.IndexedSlices):
            if not self.sparse_as_dense:
                raise ValueError(_SPARSE)
            return tf.convert_to_tensor(grad)
        return grad

    def _make_sums(self, grads: list[Any], variables: Sequence[Any]) -> None:
        with tf.init_scope():  # made once, eagerly, even while a tf.function is traced
            for index, grad in enumerate(grads):
                if grad is None or index in self.locally_aggregated_grads:
                    continue
                shape = grad.shape if grad.shape.is_fully_defined() else variables[index].shape
                self.locally_aggregated_grads[index] = tf.Variable(
                    tf.zeros(shape, dtype=grad.dtype),
                    trainable=False,
                    name=f"{self.name}aggregated_gradient_{index}",
                )

    def compute_gradients(self, grads: Sequence[Any], vars: Sequence[Any]) -> list[Any]:
        """Add ``grads`` to this rank's sums; on every ``backward_passes_per_step``-th call,
        reduce the sums across ranks and start the sums again.

        Args:
            grads: one gradient (a tensor, ``tf.IndexedSlices`` or ``None``) per variable.
            vars: the variables, in the same order.

        Returns:
            On a reducing call, the reduced sums (divided by ``backward_passes_per_step`` when
            ``average_aggregated_gradients``); on the other calls, what the class gives (see
            its description). ``None`` where the gradient was ``None``.

        Raises:
            ValueError: a ``tf.IndexedSlices`` gradient without ``sparse_as_dense``.
        """
        grads = [None if g is None else self._dense(g) for g in grads]
        variables = list(vars)
        self._make_sums(grads, variables)
        live = [i for i, g in enumerate(grads) if g is not None]
        added = [self.locally_aggregated_grads[i].assign_add(grads[i]) for i in live]
        # Explicit orderings here and below: in a tf.compat.v1 graph run by a session, nothing
        # else orders these assignments (eagerly and in tf.function, program order does).
        with tf.control_dependencies(_ops(added)):
            count = self.counter.assign_add(1)

        def reduce() -> list[Any]:
            sums = [self.locally_aggregated_grads[i].read_value() for i in live]
            reduced = self._reduce_sums(sums, [variables[i] for i in live])
            with tf.control_dependencies(_ops(reduced)):
                resets = [self.counter.assign(0)] + [
                    self.locally_aggregated_grads[i].assign(
                        tf.zeros_like(self.locally_aggregated_grads[i])
                    )
                    for i in live
                ]
            with tf.control_dependencies(_ops(resets)):
                return [tf.identity(r) for r in reduced]

        def hold() -> list[Any]:
            return self._between_reductions([grads[i] for i in live], live)

        results = tf.cond(tf.equal(count, self.backward_passes_per_step), reduce, hold)
        by_index = dict(zip(live, tf.nest.flatten(results)))
        return [by_index.get(i) for i in range(len(grads))]

    def _between_reductions(self, grads: list[Any], live: list[int]) -> list[Any]:
        """What a call that does not reduce returns: the gradients it was given."""
        return [tf.identity(g) for g in grads]

    # ------------------------------------------------------------ reducing

    def _average(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        """The default ``allreduce_func``: hora's average across ``process_set``."""
        return self._reducer.reduce(grads, variables)

    def _set_size(self, dtype: tf.DType) -> Any:
        size = self.process_set.size()
        if size is None:
            raise ValueError(
                f"{self.process_set} is not registered: pass it to hvd.init(process_sets=[...]) "
                "or hvd.add_process_set(...) on every rank first."
            )
        if tf.executing_eagerly():
            return tf.cast(size, dtype)
        # Read when the step runs: an elastic job's size changes between rounds.
        return tf.cast(ops.size_op(self.process_set.process_set_id or 0), dtype)

    def _reduce_sums(self, sums: list[Any], variables: list[Any]) -> list[Any]:
        shared = [k for k, v in enumerate(variables) if id(v) not in self._local_vars]
        out = list(sums)
        reduced = self.allreduce_grads([sums[k] for k in shared], [variables[k] for k in shared])
        for k, value in zip(shared, reduced):
            out[k] = value
        if self.scale_local_gradients:
            for k, v in enumerate(variables):
                if id(v) in self._local_vars:
                    out[k] = out[k] / self._set_size(out[k].dtype)
        if self.average_aggregated_gradients:
            passes = self.backward_passes_per_step
            out = [g / tf.cast(passes, g.dtype) for g in out]
        return out

    # ------------------------------------------------------------ updating

    def apply_gradients(
        self, apply_grads_closure: Callable[[], Any], optimizer: Any, *args: Any, **kwargs: Any
    ) -> tf.Tensor:
        """Call ``apply_grads_closure()`` on the calls where :meth:`compute_gradients` reduced;
        on the others, count the step in ``optimizer.iterations`` instead (when it has one), and
        in ``kwargs["global_step"]`` when given.

        Args:
            apply_grads_closure: applies the gradients (e.g. the optimizer's own
                ``apply_gradients``).
            optimizer: the optimizer whose ``iterations`` counts every step.
            *args, **kwargs: the update's arguments (Horovod's signature).

        Returns:
            A boolean tensor: whether this call applied the gradients.
        """
        del args
        global_step = kwargs.get("global_step")

        def apply() -> tf.Tensor:
            with tf.control_dependencies(_ops([apply_grads_closure()])):
                return tf.constant(True)

        def skip() -> tf.Tensor:
            counted = []
            iterations = getattr(optimizer, "iterations", None)
            if iterations is not None:
                counted.append(iterations.assign_add(1))
            if global_step is not None:
                counted.append(global_step.assign_add(tf.cast(1, global_step.dtype)))
            with tf.control_dependencies(_ops(counted)):
                return tf.constant(False)

        return tf.cond(tf.equal(self.counter, 0), apply, skip)


class LocalGradientAggregationHelper(_LocalAggregation):
    """Sums gradients over ``backward_passes_per_step`` calls and reduces every such call;
    the calls in between return the gradients they were given.

    Args:
        backward_passes_per_step: calls per reduction (an integer > 0).
        allreduce_func: ``f(gradients, variables) -> gradients``, the reduction across ranks
            (``None``: hora's average over ``process_set``).
        sparse_as_dense: sum ``tf.IndexedSlices`` gradients as dense tensors (without it they
            raise ``ValueError``).
        average_aggregated_gradients: divide the reduced sums by ``backward_passes_per_step``.
        rank: this process's rank (Horovod named its variables with it; kept as ``self.rank``).
        optimizer_type: ``_OPTIMIZER_TYPE_KERAS`` or ``_OPTIMIZER_TYPE_LEGACY`` (Horovod's
            TensorFlow 1 session handling; kept as ``self.optimizer_type``, used for nothing).
        process_set: the ranks ``allreduce_func`` reduces over; sizes the local gradients.
        scale_local_gradients: divide the sums of registered local variables by the process
            set's size.
        name: starts the names of the helper's variables.

    Raises:
        ValueError: ``backward_passes_per_step`` is not an integer > 0.

    Example:
        >>> helper = LocalGradientAggregationHelper(
        ...     4, None, sparse_as_dense=True, average_aggregated_gradients=True,
        ...     rank=hvd.rank(), optimizer_type=LocalGradientAggregationHelper._OPTIMIZER_TYPE_KERAS)
        >>> grads = helper.compute_gradients(tape.gradient(loss, variables), variables)
        >>> helper.apply_gradients(lambda: opt.apply_gradients(zip(grads, variables)), opt)
    """

    _OPTIMIZER_TYPE_KERAS = "optimizer_type_keras"
    _OPTIMIZER_TYPE_LEGACY = "optimizer_type_legacy"

    def __init__(
        self,
        backward_passes_per_step: int,
        allreduce_func: AllreduceFunc | None,
        sparse_as_dense: bool,
        average_aggregated_gradients: bool,
        rank: int,
        optimizer_type: str,
        process_set: ProcessSet = ops.global_process_set,
        scale_local_gradients: bool = True,
        name: str = "",
    ) -> None:
        self.name = f"{name}{rank}_" if name else ""
        super().__init__(
            backward_passes_per_step,
            allreduce_func,
            sparse_as_dense,
            average_aggregated_gradients,
            process_set,
            scale_local_gradients,
        )
        self.rank = rank
        self.optimizer_type = optimizer_type


class LocalGradientAggregationHelperEager(_LocalAggregation):
    """Sums gradients over ``backward_passes_per_step`` calls and reduces every such call;
    the calls in between return this rank's sums so far (not divided).

    Args:
        backward_passes_per_step: calls per reduction (an integer > 0).
        allreduce_func: ``f(gradients, variables) -> gradients`` (``None``: hora's average
            over ``process_set``).
        sparse_as_dense: sum ``tf.IndexedSlices`` gradients as dense tensors.
        average_aggregated_gradients: divide the reduced sums by ``backward_passes_per_step``.
        process_set: the ranks ``allreduce_func`` reduces over; sizes the local gradients.
        scale_local_gradients: divide the sums of registered local variables by the process
            set's size.

    Raises:
        ValueError: ``backward_passes_per_step`` is not an integer > 0.

    Example:
        >>> helper = LocalGradientAggregationHelperEager(
        ...     2, None, sparse_as_dense=False, average_aggregated_gradients=True)
        >>> for x, y in batches:
        ...     with tf.GradientTape() as tape:
        ...         loss = loss_fn(model(x), y)
        ...     grads = helper.compute_gradients(
        ...         tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        ...     helper.apply_gradients(
        ...         lambda: opt.apply_gradients(zip(grads, model.trainable_variables)), opt)
    """

    def _between_reductions(self, grads: list[Any], live: list[int]) -> list[Any]:
        """What a call that does not reduce returns: this rank's sums so far."""
        return [self.locally_aggregated_grads[i].read_value() for i in live]


def _ops(values: Sequence[Any]) -> list[Any]:
    """What ``tf.control_dependencies`` can wait for among ``values``: eagerly nothing (it
    orders nothing there), in a graph the tensors and operations (not ``None``)."""
    if tf.executing_eagerly():
        return []
    return [v for v in values if isinstance(v, (tf.Tensor, tf.Operation, tf.Variable))]
