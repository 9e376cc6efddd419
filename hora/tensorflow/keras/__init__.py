"""hora for Keras on TensorFlow: ``import hora.tensorflow.keras as hvd`` in place of
``import horovod.tensorflow.keras as hvd``.

It works with the Keras that ``tf.keras`` resolves to: Keras 3 by default, tf_keras (Keras 2)
when ``TF_USE_LEGACY_KERAS=1`` is set before TensorFlow is imported. ``DistributedOptimizer``
accepts optimizers of either.

Example:
    >>> import tensorflow as tf
    >>> import hora.tensorflow.keras as hvd
    >>> hvd.init()
    >>> model.compile(
    ...     optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01 * hvd.size())),
    ...     loss="mse",
    ... )
    >>> model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

import hora.tensorflow as _hvd
from hora.common.process_sets import ProcessSet
from hora.tensorflow import (
    Adasum,
    Average,
    Compression,
    HoraInternalError,
    HoraTensorFlowError,
    HoraTensorFlowValueError,
    HoraValueError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    Max,
    Min,
    Product,
    Sum,
    add_process_set,
    allgather_object,
    broadcast_object,
    broadcast_variables,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from hora.tensorflow.gradients import GradientReducer, passed_on
from hora.tensorflow.keras import _optimizer, callbacks

_OPS = {Average: "Average", Sum: "Sum", Adasum: "Adasum"}
# How the gradient collectives of a DistributedOptimizer without a name= are named.
_UNNAMED_PREFIX = "hora.keras.grads"


def _reducer_options(
    op: Any, num_groups: int, groups: Any, backward_passes_per_step: int
) -> tuple[int, Sequence[Sequence[Any]] | None]:
    """Check the options; returns ``(num_groups, groups)`` for :class:`GradientReducer`."""
    if op not in _OPS:
        raise ValueError(
            f"DistributedOptimizer reduces gradients with hvd.Average, hvd.Sum or hvd.Adasum; "
            f"got op={op!r}."
        )
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(
            "backward_passes_per_step must be an integer of 1 or more; got "
            f"{backward_passes_per_step!r}."
        )
    if isinstance(groups, int) and not isinstance(groups, bool):
        if groups < 0:
            raise ValueError(f"groups must be 0 or more, or a list of lists; got {groups}.")
        if num_groups:
            raise ValueError("Give num_groups or groups, not both (groups replaces num_groups).")
        return groups, None
    if groups is not None and not isinstance(groups, (list, tuple)):
        raise ValueError(
            "groups must be a number of groups or a list of lists of variables; got "
            f"{type(groups).__name__}."
        )
    return num_groups, groups


def DistributedOptimizer(  # Horovod's name
    optimizer: Any,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: Any = Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> Any:
    """A copy of a Keras optimizer that averages gradients across ranks before applying them.

    The copy is made from ``optimizer.get_config()`` (so wrap a fresh optimizer, before
    training) and is an instance of a subclass with the optimizer's class name: a model saved
    with it loads without hora. Keras 3 and tf_keras optimizers (new and legacy) are accepted.

    Args:
        optimizer: a Keras optimizer (``tf.keras.optimizers.SGD(...)``, ``Adam(...)``, ...).
        name: the wrapped optimizer's Keras name (``optimizer.name``), as Horovod's wrapper
            names it; it also prefixes the names of the gradient collectives (every rank must
            give the same). ``None``: the optimizer keeps its own name (Horovod's renames it
            ``"Distributed" + class name``).
        device_dense, device_sparse: accepted for compatibility; hora reduces where the
            gradients are.
        compression: ``hvd.Compression.none`` (default), ``.fp16`` or ``.bf16``.
        sparse_as_dense: reduce ``tf.IndexedSlices`` gradients (embeddings) as dense tensors.
        gradient_predivide_factor: with Average, divide by this before the sum and by
            ``size / factor`` after it.
        op: ``hvd.Average`` (default), ``hvd.Sum`` or ``hvd.Adasum``.
        backward_passes_per_step: sum the gradients of this many calls locally; only every
            ``backward_passes_per_step``-th call averages across ranks and updates the
            weights. ``optimizer.iterations`` counts the updates under Keras 3 (as its
            ``gradient_accumulation_steps`` does) and every call under tf_keras (as Horovod).
        average_aggregated_gradients: divide the local sum by ``backward_passes_per_step``.
        num_groups: split the gradients into this many collectives (0: one for all).
        groups: a number of groups, or lists of variables that travel together.
        process_set: the ranks that average (default: all).
        scale_local_gradients: see :func:`PartialDistributedOptimizer`.

    Returns:
        The distributed optimizer.

    Raises:
        NotImplementedError: ``optimizer`` is a ``tf.compat.v1.train.Optimizer``.
        TypeError: ``optimizer`` is not a Keras optimizer.
        ValueError: an option is out of range.

    Example:
        >>> opt = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.001 * hvd.size()))
        >>> model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    """
    del device_dense, device_sparse
    _optimizer.flavor(optimizer)
    if _optimizer.is_distributed(optimizer):
        raise ValueError(
            "This optimizer is already a hora DistributedOptimizer; wrap the original Keras "
            "optimizer once."
        )
    num_groups, groups = _reducer_options(op, num_groups, groups, backward_passes_per_step)
    reducer = GradientReducer.of(locals(), f"hora.keras.{name}" if name else _UNNAMED_PREFIX)
    accumulator = None
    if backward_passes_per_step > 1:
        accumulator = _optimizer.GradientAccumulator(
            backward_passes_per_step, average_aggregated_gradients
        )
    return _optimizer.wrap(optimizer, _optimizer.HoraState(reducer, accumulator), name)


def _local_variables(local_layers: Any) -> list[Any]:
    if local_layers is None:
        return []
    layers = list(local_layers) if isinstance(local_layers, (list, tuple, set)) else [local_layers]
    variables: list[Any] = []
    for layer in layers:
        weights = getattr(layer, "trainable_weights", None)
        if weights is None:
            raise ValueError(
                "local_layers takes Keras layers (their trainable weights stay local); got "
                f"{type(layer).__name__}."
            )
        variables.extend(weights)
    return variables


def PartialDistributedOptimizer(  # Horovod's name
    optimizer: Any,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: Any = Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> Any:
    """A :func:`DistributedOptimizer` that keeps the gradients of ``local_layers`` on each rank.

    The gradients of the local layers' trainable weights are not averaged: each rank updates
    those weights with its own gradients (divided by the number of ranks when
    ``scale_local_gradients``, like the averaged ones). The other options are
    :func:`DistributedOptimizer`'s.

    Args:
        optimizer: a Keras optimizer.
        local_layers: a Keras layer or a list of them; ``None``: none (then this is
            :func:`DistributedOptimizer`).
        scale_local_gradients: divide local gradients by the process set's size.

    Example:
        >>> opt = hvd.PartialDistributedOptimizer(
        ...     tf.keras.optimizers.SGD(0.1), local_layers=[model.get_layer("head")]
        ... )
    """
    arguments = passed_on(locals(), "local_layers")
    local = _local_variables(local_layers)
    wrapped = DistributedOptimizer(**arguments)
    for variable in local:
        wrapped.register_local_var(variable)
    return wrapped


def broadcast_global_variables(root_rank: int) -> Any:
    """Give every global variable of a ``tf.compat.v1`` graph ``root_rank``'s value: the op to
    run (as :func:`hora.tensorflow.broadcast_global_variables`).

    Raises:
        RuntimeError: eagerly or inside ``tf.function``, where there is no global variable
            collection; it names what to use instead.
    """
    from hora.tensorflow._bridge import session_graph
    from hora.tensorflow.functions import broadcast_global_variables as in_graph

    if session_graph() is not None:
        return in_graph(root_rank)
    raise RuntimeError(
        "broadcast_global_variables() needs TensorFlow 1's global variable collection, which "
        "exists only in a tf.compat.v1 graph. With model.fit, pass "
        "hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) in callbacks; in a custom "
        f"loop, call hvd.broadcast_variables(model.variables, root_rank={root_rank}) after the "
        "model is built (and the optimizer's variables after its first step)."
    )


def _numpy(value: Any) -> Any:
    return value.numpy()


def allreduce(
    value: Any,
    name: str | None = None,
    average: bool | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    op: Any = None,
    compression: Any = Compression.none,
) -> Any:
    """Reduce a value (number, list, array or tensor) across ranks; returns a NumPy value.

    Args:
        value: the same shape on every rank.
        name: the collective's name (every rank must give the same one).
        average: deprecated; use ``op``.
        prescale_factor, postscale_factor: multiply before and after reducing.
        op: ``hvd.Average`` (default), ``hvd.Sum``, ``hvd.Min``, ``hvd.Max``, ``hvd.Product``.
        compression: ``hvd.Compression.none`` (default), ``.fp16`` or ``.bf16``.

    Example:
        >>> hvd.allreduce(float(hvd.rank()), op=hvd.Sum)  # 0 + 1 on two ranks
        1.0
    """
    return _numpy(
        _hvd.allreduce(
            tf.convert_to_tensor(value),
            average=average,
            compression=compression,
            op=op,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            name=name,
        )
    )


def allgather(value: Any, name: str | None = None) -> Any:
    """Concatenate every rank's value along its first dimension; returns a NumPy array.

    Example:
        >>> hvd.allgather([hvd.rank()])  # on two ranks
        array([0, 1], dtype=int32)
    """
    return _numpy(_hvd.allgather(tf.convert_to_tensor(value), name=name))


def broadcast(value: Any, root_rank: int, name: str | None = None) -> Any:
    """``root_rank``'s value, on every rank, as a NumPy value.

    Example:
        >>> seed = hvd.broadcast(np.random.randint(1 << 30), root_rank=0)
    """
    return _numpy(_hvd.broadcast(tf.convert_to_tensor(value), root_rank, name=name))


def reducescatter(value: Any, name: str | None = None, op: Any = Average) -> Any:
    """Reduce across ranks and return this rank's rows of the first dimension (NumPy).

    Example:
        >>> hvd.reducescatter(np.ones((4, 2)), op=hvd.Sum)  # rank 0 of two: rows 0-1
    """
    return _numpy(_hvd.reducescatter(tf.convert_to_tensor(value), op=op, name=name))


def _keras() -> Any:
    """The Keras that ``tf.keras`` resolves to (Keras 3, or tf_keras with
    ``TF_USE_LEGACY_KERAS=1``)."""
    return tf.keras


def load_model(
    filepath: Any,
    custom_optimizers: Sequence[type] | None = None,
    custom_objects: dict[str, Any] | None = None,
    compression: Any = Compression.none,
    legacy_opts: bool = False,
) -> Any:
    """Load a saved Keras model and make its optimizer a :func:`DistributedOptimizer`.

    The optimizer keeps the state it was saved with (its step count, slots and learning rate),
    so training resumes where it stopped. Keras 3 loads ``.keras`` (and ``.h5``) files; tf_keras
    also loads SavedModel directories.

    Args:
        filepath: the saved model.
        custom_optimizers: optimizer classes of your own that the model may use.
        custom_objects: other custom classes and functions, by name, as Keras takes them.
        compression: the wrapped optimizer's compression.
        legacy_opts: accepted for compatibility; hora wraps whichever optimizer the model was
            saved with.

    Returns:
        The model; ``model.optimizer`` averages gradients (a model saved without an optimizer
        comes back without one).

    Example:
        >>> model = hvd.load_model("checkpoint.keras")
        >>> model.fit(x, y, initial_epoch=5, epochs=10)
    """
    del legacy_opts
    objects: dict[str, Any] = {cls.__name__: cls for cls in custom_optimizers or []}
    objects.update(custom_objects or {})
    model = _keras().models.load_model(filepath, custom_objects=objects or None)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not _optimizer.is_distributed(optimizer):
        # DistributedOptimizer's defaults, with this compression.
        reducer = GradientReducer(compression=compression, prefix=_UNNAMED_PREFIX)
        _optimizer.wrap_in_place(optimizer, _optimizer.HoraState(reducer, None))
    return model


__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "HoraInternalError",
    "HoraTensorFlowError",
    "HoraTensorFlowValueError",
    "HoraValueError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "PartialDistributedOptimizer",
    "ProcessSet",
    "Product",
    "Sum",
    "add_process_set",
    "allgather",
    "allgather_object",
    "allreduce",
    "broadcast",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_variables",
    "callbacks",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "gloo_built",
    "gloo_enabled",
    "global_process_set",
    "init",
    "is_homogeneous",
    "is_initialized",
    "load_model",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "reducescatter",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
]


def __getattr__(name: str) -> Any:
    # hvd.elastic loads on first use.
    if name == "elastic":
        import importlib

        return importlib.import_module("hora.tensorflow.keras.elastic")
    raise AttributeError(f"module 'hora.tensorflow.keras' has no attribute {name!r}")
