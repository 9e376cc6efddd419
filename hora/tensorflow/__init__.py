"""hora's TensorFlow API: ``import hora.tensorflow as hvd`` in place of
``import horovod.tensorflow as hvd``.

TensorFlow 2, eager and inside ``tf.function``. Keras users import :mod:`hora.tensorflow.keras`
(``DistributedOptimizer`` and the callbacks). TensorFlow 1 sessions, hooks and
``tf.compat.v1`` optimizers are not supported, and collectives cannot run in XLA-compiled code;
each says so when used (docs/tensorflow.md).

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

from hora.common import metrics
from hora.common.basics import (
    cross_rank,
    cross_size,
    gloo_enabled,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_enabled,
    mpi_threads_supported,
    rank,
    size,
)
from hora.common.build_info import (
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    mpi_built,
    nccl_built,
    rocm_built,
)
from hora.common.collectives import Adasum, Average, Max, Min, Product, Sum
from hora.common.errors import (
    HoraInternalError,
    HoraValueError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
)
from hora.common.lifecycle import init, shutdown
from hora.common.process_sets import ProcessSet
from hora.common.registration import register_process_set as add_process_set
from hora.common.registration import unregister_process_set as remove_process_set
from hora.common.timeline_control import start_timeline, stop_timeline
from hora.tensorflow._bridge import HoraTensorFlowError, HoraTensorFlowValueError
from hora.tensorflow.compression import Compression
from hora.tensorflow.functions import (
    allgather_object,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)
from hora.tensorflow.gradients import GradientReducer, distributed_tape
from hora.tensorflow.ops import (
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    global_process_set,
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

_TF1 = (
    "hora.tensorflow runs TensorFlow 2 (eager and tf.function); TensorFlow 1 graphs, sessions "
    "and hooks are not supported. "
)


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
    reducer = GradientReducer(
        compression=compression,
        sparse_as_dense=sparse_as_dense,
        op=op,
        gradient_predivide_factor=gradient_predivide_factor,
        num_groups=num_groups,
        groups=groups,
        process_set=process_set,
        scale_local_gradients=scale_local_gradients,
        prefix="hora.tape",
    )
    return distributed_tape(gradtape, reducer)


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
    tape = DistributedGradientTape(
        gradtape,
        device_dense,
        device_sparse,
        compression,
        sparse_as_dense,
        op,
        gradient_predivide_factor,
        num_groups,
        groups,
        process_set,
        scale_local_gradients,
    )
    for item in _as_list(local_layers):
        for variable in getattr(item, "trainable_weights", None) or [item]:
            tape.register_local_source(variable)
    return tape


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def DistributedOptimizer(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
    """A Keras optimizer that averages gradients (see
    :func:`hora.tensorflow.keras.DistributedOptimizer`); ``tf.compat.v1`` optimizers are not
    supported."""
    if isinstance(optimizer, _tf().compat.v1.train.Optimizer):
        raise NotImplementedError(
            _TF1 + "Use a Keras optimizer with hora.tensorflow.keras.DistributedOptimizer, or "
            "hvd.DistributedGradientTape in a custom training loop."
        )
    from hora.tensorflow.keras import DistributedOptimizer as KerasDistributedOptimizer

    return KerasDistributedOptimizer(optimizer, *args, **kwargs)


def broadcast_global_variables(root_rank: int) -> None:
    """Not in TensorFlow 2: use ``hvd.broadcast_variables(model.variables, root_rank)``."""
    raise RuntimeError(
        _TF1 + "broadcast_global_variables() needs TensorFlow 1's global variable collection: "
        "call hvd.broadcast_variables(model.variables, root_rank=0) (and the optimizer's "
        "variables) instead."
    )


def BroadcastGlobalVariablesHook(*args: Any, **kwargs: Any) -> Any:
    """Not in TensorFlow 2: sessions and hooks are TensorFlow 1 only."""
    raise NotImplementedError(
        _TF1 + "Use hvd.broadcast_variables after building the model, or, with Keras, "
        "hora.tensorflow.keras.callbacks.BroadcastGlobalVariablesCallback(0)."
    )


def __getattr__(name: str) -> Any:
    # Keras-backed names load on first use: `import hora.tensorflow` does not import Keras.
    if name == "SyncBatchNormalization":
        from hora.tensorflow.sync_batch_norm import SyncBatchNormalization

        return SyncBatchNormalization
    if name in ("elastic", "keras"):
        import importlib

        return importlib.import_module(f"hora.tensorflow.{name}")
    raise AttributeError(f"module 'hora.tensorflow' has no attribute {name!r}")


def _tf() -> Any:
    import tensorflow as tf

    return tf


__all__ = [
    "Adasum",
    "Average",
    "BroadcastGlobalVariablesHook",
    "Compression",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "HoraInternalError",
    "HoraTensorFlowError",
    "HoraTensorFlowValueError",
    "HoraValueError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "PartialDistributedGradientTape",
    "ProcessSet",
    "Product",
    "Sum",
    "SyncBatchNormalization",
    "add_process_set",
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
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "gloo_built",
    "gloo_enabled",
    "global_process_set",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_rank_op",
    "local_size",
    "local_size_op",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "process_set_included_op",
    "rank",
    "rank_op",
    "reducescatter",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "size_op",
    "start_timeline",
    "stop_timeline",
    "metrics",
]
