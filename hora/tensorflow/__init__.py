"""hora's TensorFlow API: ``import hora.tensorflow as hvd`` in place of
``import horovod.tensorflow as hvd``.

TensorFlow 2, eager and inside ``tf.function``, and TensorFlow 1's ``tf.compat.v1`` graphs run
by a session (collectives, ``DistributedOptimizer`` over a ``tf.compat.v1.train`` optimizer,
``BroadcastGlobalVariablesHook``). Keras users import :mod:`hora.tensorflow.keras`
(``DistributedOptimizer`` and the callbacks). Collectives cannot run in XLA-compiled code; they
say so when used (docs/tensorflow.md).

Example:
    >>> import hora.tensorflow as hvd
    >>> hvd.init()
    >>> with tf.GradientTape() as tape:
    ...     loss = loss_fn(model(x), y)
    >>> tape = hvd.DistributedGradientTape(tape)
    >>> grads = tape.gradient(loss, model.trainable_variables)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hora.common import api
from hora.common.api import *  # noqa: F403  (the framework-neutral names, listed once)
from hora.common.api import Average, ProcessSet, global_process_set
from hora.common.ops.engine_facts import is_power_of_two as check_num_rank_power_of_2
from hora.common.ops.submission import handle_average_backwards_compatibility
from hora.tensorflow._bridge import HoraTensorFlowError, HoraTensorFlowValueError
from hora.tensorflow.compression import Compression
from hora.tensorflow.functions import (
    allgather_object,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)
from hora.tensorflow.gradient_aggregation import LocalGradientAggregationHelper
from hora.tensorflow.gradients import GradientReducer, distributed_tape, passed_on
from hora.tensorflow.legacy import BroadcastGlobalVariablesHook, DistributedLegacyOptimizer
from hora.tensorflow.ops import (
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    join,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    reducescatter,
    size_op,
)
from hora.tensorflow.util import _cache as _cache  # horovod.tensorflow has these three too
from hora.tensorflow.util import _executing_eagerly as _executing_eagerly
from hora.tensorflow.util import _make_subgraph as _make_subgraph
from hora.tensorflow.util import refs_to_vars, vars_to_refs


def DistributedGradientTape(  # Horovod's name
    gradtape: Any,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Sequence[Sequence[Any]] | None = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> Any:
    """Wrap a ``tf.GradientTape`` so that ``gradient()`` returns gradients averaged across ranks.

    Args:
        gradtape: the tape that recorded the forward pass.
        device_dense, device_sparse: accepted for compatibility.
        compression: ``hvd.Compression.none`` (default), ``.fp16`` or ``.bf16``.
        sparse_as_dense: reduce ``tf.IndexedSlices`` gradients as dense tensors.
        op: ``hvd.Average`` (default), ``hvd.Sum`` or ``hvd.Adasum``.
        gradient_predivide_factor: with Average, divide by this before summing and by
            ``size / factor`` after.
        num_groups: split the gradients into this many fused groups (0: all in one).
        groups: explicit groups, as lists of variables.
        process_set: the ranks that average (default: all).
        scale_local_gradients: see :func:`PartialDistributedGradientTape`.

    Example:
        >>> tape = hvd.DistributedGradientTape(tape)
        >>> grads = tape.gradient(loss, model.trainable_variables)
    """
    del device_dense, device_sparse
    return distributed_tape(gradtape, GradientReducer.of(locals(), prefix="hora.tape"))


def PartialDistributedGradientTape(  # Horovod's name
    gradtape: Any,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Sequence[Sequence[Any]] | None = None,
    process_set: ProcessSet = global_process_set,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> Any:
    """A :func:`DistributedGradientTape` that keeps the gradients of ``local_layers`` (layers or
    variables) on each rank; with ``scale_local_gradients`` they are divided by the number of
    ranks, like the averaged ones."""
    tape = DistributedGradientTape(**passed_on(locals(), "local_layers"))
    for item in _as_list(local_layers):
        for variable in getattr(item, "trainable_weights", None) or [item]:
            tape.register_local_source(variable)
    return tape


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def DistributedOptimizer(  # Horovod's name
    optimizer: Any,
    name: str | None = None,
    use_locking: bool = False,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    backward_passes_per_step: int = 1,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> Any:
    """An optimizer that averages gradients across ranks: for a Keras optimizer, a Keras one
    (see :func:`hora.tensorflow.keras.DistributedOptimizer`, whose options these are); for a
    ``tf.compat.v1.train.Optimizer``, a ``tf.compat.v1.train.Optimizer`` for graphs run by a
    session (:class:`hora.tensorflow.legacy.DistributedLegacyOptimizer`).

    The parameters are Horovod's ``horovod.tensorflow.DistributedOptimizer``'s, in its order.
    ``use_locking`` is passed to a ``tf.compat.v1`` optimizer (Keras optimizers have none).

    Example:
        >>> opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01 * hvd.size()))
    """
    if isinstance(optimizer, _tf().compat.v1.train.Optimizer):
        reducer = GradientReducer.of(locals(), prefix="hora.grads")
        return DistributedLegacyOptimizer(
            optimizer,
            name,
            use_locking,
            reducer,
            backward_passes_per_step,
            average_aggregated_gradients,
        )
    keras_arguments = passed_on(locals(), "use_locking")
    from hora.tensorflow.keras import DistributedOptimizer as KerasDistributedOptimizer

    return KerasDistributedOptimizer(**keras_arguments)


def __getattr__(name: str) -> Any:
    # Keras-backed names load on first use: `import hora.tensorflow` does not import Keras.
    # (``mpi_ops`` re-exports every name here, SyncBatchNormalization included.)
    if name == "SyncBatchNormalization":
        from hora.tensorflow.sync_batch_norm import SyncBatchNormalization

        return SyncBatchNormalization
    if name in ("elastic", "keras", "mpi_ops"):
        import importlib

        return importlib.import_module(f"hora.tensorflow.{name}")
    raise AttributeError(f"module 'hora.tensorflow' has no attribute {name!r}")


def _tf() -> Any:
    import tensorflow as tf

    return tf


__all__ = [
    "BroadcastGlobalVariablesHook",
    "Compression",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "HoraTensorFlowError",
    "HoraTensorFlowValueError",
    "LocalGradientAggregationHelper",
    "PartialDistributedGradientTape",
    "SyncBatchNormalization",  # noqa: F405  (loaded on first use, by __getattr__)
    "allgather",
    "allgather_object",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_object_fn",
    "broadcast_variables",
    "check_num_rank_power_of_2",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "handle_average_backwards_compatibility",
    "join",
    "local_rank_op",
    "local_size_op",
    "process_set_included_op",
    "rank_op",
    "reducescatter",
    "refs_to_vars",
    "size_op",
    "vars_to_refs",
]
__all__ += api.__all__
