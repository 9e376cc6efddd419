"""Horovod's collective operations on TensorFlow tensors, eager and inside ``tf.function``.

Each collective hands torch views of its inputs to the engine through
:mod:`hora.common.ops.collectives` (the same checks, names and process sets as PyTorch users get)
and returns TensorFlow tensors (:mod:`hora.tensorflow._bridge`). The differentiable ones carry
their gradient with ``tf.custom_gradient``:

- allreduce: the gradient is allreduced the same way (same op and scale factors);
- allgather: the gradient is averaged over the ranks, and each rank keeps its own rows;
- broadcast: the gradient is averaged over the ranks and reaches the root only;
- alltoall: the gradient travels back with the splits each rank received;
- reducescatter: the gradient is allgathered (scaled as the forward pass scaled).

``join``, ``barrier`` and the ``*_op`` ops, which move no tensor of the caller's, are
:mod:`hora.tensorflow.runtime_ops`'s, re-exported here where Horovod has them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import tensorflow as tf
import torch

from hora.common import api
from hora.common.ops import collectives
from hora.common.ops.collectives import Adasum as Adasum
from hora.common.ops.collectives import Average as Average
from hora.common.ops.collectives import Sum as Sum
from hora.common.process_sets import ProcessSet
from hora.common.process_sets import global_process_set as global_process_set
from hora.common.vocabulary.errors import HoraValueError
from hora.common.vocabulary.message import RequestType
from hora.tensorflow._bridge import as_wire, from_wire, graph_name, run, session_graph
from hora.tensorflow.compression import Compression
from hora.tensorflow.runtime_ops import PROCESS_SET_ERROR_INIT as PROCESS_SET_ERROR_INIT
from hora.tensorflow.runtime_ops import (
    PROCESS_SET_ERROR_UNKNOWN_SET as PROCESS_SET_ERROR_UNKNOWN_SET,
)
from hora.tensorflow.runtime_ops import barrier as barrier
from hora.tensorflow.runtime_ops import join as join
from hora.tensorflow.runtime_ops import local_rank_op as local_rank_op
from hora.tensorflow.runtime_ops import local_size_op as local_size_op
from hora.tensorflow.runtime_ops import process_set_included_op as process_set_included_op
from hora.tensorflow.runtime_ops import rank_op as rank_op
from hora.tensorflow.runtime_ops import size_op as size_op

# Unsigned types the engine does not reduce; they are reduced as int64.
_WIDENED = (tf.uint16, tf.uint32)


def _tensors(values: Sequence[Any]) -> list[tf.Tensor]:
    return [v if isinstance(v, tf.Tensor) else tf.convert_to_tensor(v) for v in values]


def _grad_name(name: str | None) -> str | None:
    return None if name is None else f"{name}.grad"


def _differentiable(
    forward: Callable[[list[tf.Tensor]], list[tf.Tensor]],
    backward: Callable[[list[tf.Tensor], list[tf.Tensor]], list[tf.Tensor]],
    tensors: list[tf.Tensor],
) -> list[tf.Tensor]:
    """``forward(tensors)``, whose gradient is ``backward(inputs, upstream gradients)``."""

    @tf.custom_gradient  # type: ignore[untyped-decorator]
    def call(*inputs: tf.Tensor) -> Any:
        def grad(*upstream: tf.Tensor) -> list[tf.Tensor]:
            return backward(list(inputs), _tensors(upstream))

        return forward(list(inputs)), grad

    results = call(*tensors)
    return list(results) if isinstance(results, (list, tuple)) else [results]


@dataclass(slots=True)
class _Reduction:
    """How an allreduce or a reducescatter reduces: what its differentiable form, its gradient
    and the collective itself all take. Never changed once made (``replace`` makes another)."""

    op: Any
    prescale_factor: float = 1.0
    postscale_factor: float = 1.0
    name: str | None = None
    process_set: ProcessSet = global_process_set
    grouped: bool = False


# ---------------------------------------------------------------- allreduce


def _reduce(tensors: list[tf.Tensor], how: _Reduction) -> list[tf.Tensor]:
    grouped, process_set = how.grouped, how.process_set
    name = graph_name(how.name, "grouped_allreduce" if grouped else "allreduce", process_set)
    dtypes = [t.dtype for t in tensors]
    # Unsigned types the engine does not carry are reduced as int64 (exact), then cast back.
    tensors = [tf.cast(t, tf.int64) if t.dtype in _WIDENED else t for t in tensors]

    def reduce(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        scales = (how.prescale_factor, how.postscale_factor)
        handle = collectives.allreduce_async(
            inputs, False, name, how.op, None, *scales, process_set, grouped
        )
        return collectives.results(handle, grouped)

    outputs = run(
        reduce, tensors, [t.dtype for t in tensors], [t.shape for t in tensors], "allreduce"
    )
    return [o if o.dtype == d else tf.cast(o, d) for o, d in zip(outputs, dtypes)]


def _allreduce(tensors: list[tf.Tensor], how: _Reduction) -> list[tf.Tensor]:
    """Allreduce with its gradient (the gradient is reduced the same way)."""
    return _differentiable(
        lambda inputs: _reduce(inputs, how),
        lambda _inputs, upstream: _allreduce(upstream, replace(how, name=_grad_name(how.name))),
        tensors,
    )


def _check_sparse_op(how: _Reduction) -> None:
    if how.op == Adasum:
        raise NotImplementedError(
            "Adasum does not reduce tf.IndexedSlices (sparse gradients); pass "
            "sparse_as_dense=True to DistributedOptimizer or DistributedGradientTape."
        )
    if how.op not in (Sum, Average):
        raise NotImplementedError("Only Sum and Average reduce tf.IndexedSlices.")
    if how.prescale_factor != 1.0 or how.postscale_factor != 1.0:
        raise NotImplementedError("Pre- and postscale factors do not apply to tf.IndexedSlices.")


def _sparse_allreduce(slices: tf.IndexedSlices, how: _Reduction) -> tf.IndexedSlices:
    """Reduce sparse rows by gathering every rank's values and indices (rows that several ranks
    hold are summed when the slices are applied)."""
    _check_sparse_op(how)
    name, process_set = how.name, how.process_set
    values = allgather(slices.values, name=None if name is None else f"{name}.values",
                       process_set=process_set)  # fmt: skip
    indices = allgather(slices.indices, name=None if name is None else f"{name}.indices",
                        process_set=process_set)  # fmt: skip
    if how.op == Average:
        values = values / tf.cast(process_set.size(), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def allreduce(
    tensor: Any,
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
) -> Any:
    """Reduce a tensor (or ``tf.IndexedSlices``) across the ranks of ``process_set``.

    The result is ``postscale_factor * op(prescale_factor * tensor on each rank)``. A
    ``tf.IndexedSlices`` is gathered instead (values and indices from every rank; Average
    divides the values by the number of ranks). Differentiable.

    Args:
        tensor: a ``tf.Tensor``, ``tf.Variable``, Keras variable or ``tf.IndexedSlices``.
        average: deprecated; use ``op``.
        device_dense, device_sparse: accepted for compatibility; hora reduces where the
            tensor is.
        compression: ``hvd.Compression.none`` (default), ``.fp16`` or ``.bf16``.
        op: ``hvd.Average`` (default), ``hvd.Sum``, ``hvd.Min``, ``hvd.Max``, ``hvd.Product``,
            ``hvd.Adasum``.
        prescale_factor, postscale_factor: multiply before and after reducing.
        name: shared by all ranks; collectives are matched across ranks by name.
        process_set: the ranks taking part (default: all).
        ignore_name_scope: accepted for compatibility (hora names do not use name scopes).

    Example:
        >>> total = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum)
    """
    del device_dense, device_sparse, ignore_name_scope
    from hora.common.ops import submission

    reduce_op = submission.resolve_op(op, average, RequestType.ALLREDUCE)
    how = _Reduction(reduce_op, prescale_factor, postscale_factor, name, process_set)
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse_allreduce(tensor, how)
    compression = compression or Compression.none
    compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
    (result,) = _allreduce([compressed], how)
    return compression.decompress(result, ctx)


def grouped_allreduce(
    tensors: Sequence[Any],
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
    name: str | None = None,
) -> list[Any]:
    """Reduce a list of tensors as one negotiated, fused operation (see :func:`allreduce`).

    ``tf.IndexedSlices`` in the list are gathered one by one; the dense ones travel together.
    """
    del device_dense, device_sparse, ignore_name_scope
    from hora.common.ops import submission

    reduce_op = submission.resolve_op(op, average, RequestType.ALLREDUCE)
    how = _Reduction(reduce_op, prescale_factor, postscale_factor, name, process_set, True)
    compression = compression or Compression.none
    results: list[Any] = list(tensors)
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            sub = None if name is None else f"{name}.{i}"
            results[i] = _sparse_allreduce(t, replace(how, name=sub))
    if not dense:
        return results
    compressed = [compression.compress(tf.convert_to_tensor(tensors[i])) for i in dense]
    reduced = _allreduce([c for c, _ in compressed], how)
    for i, value, (_, ctx) in zip(dense, reduced, compressed):
        results[i] = compression.decompress(value, ctx)
    return results


# ---------------------------------------------------------------- allgather


def _gather(tensors: list[tf.Tensor], name: str | None, process_set: ProcessSet, grouped: bool):  # type: ignore[no-untyped-def]
    for t in tensors:
        if t.shape.rank == 0:
            raise HoraValueError("Allgather needs a tensor with at least one dimension.")

    name = graph_name(name, "grouped_allgather" if grouped else "allgather", process_set)
    dtypes = [t.dtype for t in tensors]
    tensors = [as_wire(t) for t in tensors]

    def gather(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        handle = collectives.allgather_async(inputs, name, process_set, grouped)
        return collectives.results(handle, grouped)

    shapes = [tf.TensorShape([None]).concatenate(t.shape[1:]) for t in tensors]
    outputs = run(gather, tensors, [t.dtype for t in tensors], shapes, "allgather")
    return [from_wire(o, d) for o, d in zip(outputs, dtypes)]


def _own_rows(grad: tf.Tensor, rows: tf.Tensor, process_set: ProcessSet) -> tf.Tensor:
    counts = allgather(tf.reshape(tf.cast(rows, tf.int64), [1]), process_set=process_set)
    counts = tf.reshape(counts, [process_set.size()])
    return tf.split(grad, num_or_size_splits=counts, axis=0)[process_set.rank()]


def _allgather(
    tensors: list[tf.Tensor], name: str | None, process_set: ProcessSet, grouped: bool
) -> list[tf.Tensor]:
    def backward(inputs: list[tf.Tensor], upstream: list[tf.Tensor]) -> list[tf.Tensor]:
        averaged = _allreduce(
            upstream, _Reduction(Average, process_set=process_set, grouped=grouped)
        )
        return [_own_rows(g, tf.shape(x)[0], process_set) for g, x in zip(averaged, inputs)]

    return _differentiable(
        lambda inputs: _gather(inputs, name, process_set, grouped), backward, tensors
    )


def allgather(
    tensor: Any,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> tf.Tensor:
    """Concatenate every rank's tensor along dimension 0, in rank order.

    The first dimension may differ between ranks; the others must match. Differentiable.
    """
    del ignore_name_scope
    (result,) = _allgather([tf.convert_to_tensor(tensor)], name, process_set, False)
    return result


def grouped_allgather(
    tensors: Sequence[Any],
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> list[tf.Tensor]:
    """Allgather each tensor of a list, negotiated together."""
    del ignore_name_scope
    return _allgather(_tensors(tensors), name, process_set, True)


# ---------------------------------------------------------------- broadcast


def _send(tensor: tf.Tensor, root_rank: int, name: str | None, process_set: ProcessSet) -> Any:
    name = graph_name(name, "broadcast", process_set)
    dtype, tensor = tensor.dtype, as_wire(tensor)

    def send(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        handle = collectives.broadcast_async(inputs[0], root_rank, name, process_set, False)
        return [collectives.synchronize(handle)]

    return from_wire(run(send, [tensor], [tensor.dtype], [tensor.shape], "broadcast")[0], dtype)


def broadcast(
    tensor: Any,
    root_rank: int,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> tf.Tensor:
    """``root_rank``'s tensor, on every rank (a new tensor). Differentiable: the gradient is
    averaged over the ranks and reaches the root only."""
    del ignore_name_scope

    @tf.custom_gradient  # type: ignore[untyped-decorator]
    def send(value: tf.Tensor) -> Any:
        def grad(upstream: tf.Tensor) -> tf.Tensor:
            (averaged,) = _allreduce(
                [tf.convert_to_tensor(upstream)], _Reduction(Average, process_set=process_set)
            )
            return averaged if api.rank() == root_rank else averaged * 0

        return _send(value, int(root_rank), name, process_set), grad

    return send(tf.convert_to_tensor(tensor))


def broadcast_(
    variables: Sequence[Any],
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> list[Any]:
    """Overwrite each variable with ``root_rank``'s value, in place; returns the new values.

    Every variable is sent in one negotiated batch.
    """
    variables = list(variables)
    if not variables:
        return []
    name = graph_name(name, "broadcast_", process_set)

    def send(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        handles = [
            collectives.broadcast_async(
                x, int(root_rank), None if name is None else f"{name}.{i}", process_set, False
            )
            for i, x in enumerate(inputs)
        ]
        return [collectives.synchronize(h) for h in handles]

    values = [as_wire(tf.convert_to_tensor(v)) for v in variables]
    received = run(send, values, [v.dtype for v in values], [v.shape for v in values], "broadcast")
    assigned = [variable.assign(from_wire(value, variable.dtype))
                for variable, value in zip(variables, received)]  # fmt: skip
    if session_graph() is not None:
        # A session runs only what the values it is asked for depend on: the assignments.
        return [tf.identity(a) for a in assigned]
    return [tf.convert_to_tensor(v) for v in variables]


# ---------------------------------------------------------------- alltoall


def _exchange(
    tensor: tf.Tensor, splits: tf.Tensor | None, name: str | None, process_set: ProcessSet
) -> list[tf.Tensor]:
    name = graph_name(name, "alltoall", process_set)
    dtype, tensor = tensor.dtype, as_wire(tensor)
    inputs = [tensor] if splits is None else [tensor, splits]

    def exchange(values: list[torch.Tensor]) -> list[torch.Tensor]:
        given = None if splits is None else values[1].to(torch.int64).tolist()
        handle = collectives.alltoall_async(values[0], given, name, process_set)
        output, received = collectives.synchronize(handle)
        return [output, received.to(torch.int32)]

    shape = tf.TensorShape([None]).concatenate(tensor.shape[1:])
    output, received = run(exchange, inputs, [tensor.dtype, tf.int32], [shape, [None]], "alltoall")
    return [from_wire(output, dtype), received]


def alltoall(
    tensor: Any,
    splits: Any = None,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Send ``splits[i]`` rows of ``tensor`` to rank ``i`` and gather what every rank sends.

    Returns:
        The gathered rows; with ``splits`` given, ``(rows, received_splits)``. Differentiable.
    """
    del ignore_name_scope
    given = None if splits is None else tf.convert_to_tensor(splits)

    @tf.custom_gradient  # type: ignore[untyped-decorator]
    def exchange(value: tf.Tensor) -> Any:
        output, received = _exchange(value, given, name, process_set)

        def grad(upstream: tf.Tensor, _received: Any = None) -> tf.Tensor:
            back, _ = _exchange(tf.convert_to_tensor(upstream), received, None, process_set)
            return back

        return (output, received), grad

    output, received = exchange(tf.convert_to_tensor(tensor))
    return (output, received) if splits is not None else output


# ---------------------------------------------------------------- reducescatter


def _scatter(tensors: list[tf.Tensor], how: _Reduction) -> list[tf.Tensor]:
    grouped, process_set = how.grouped, how.process_set
    name = graph_name(
        how.name, "grouped_reducescatter" if grouped else "reducescatter", process_set
    )

    def scatter(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        scales = (how.prescale_factor, how.postscale_factor)
        handle = collectives.reducescatter_async(
            inputs, name, how.op, process_set, *scales, grouped
        )
        return collectives.results(handle, grouped)

    shapes = [tf.TensorShape([None]).concatenate(t.shape[1:]) for t in tensors]
    return run(scatter, tensors, [t.dtype for t in tensors], shapes, "reducescatter")


def _reducescatter(tensors: list[tf.Tensor], how: _Reduction) -> list[tf.Tensor]:
    def backward(_inputs: list[tf.Tensor], upstream: list[tf.Tensor]) -> list[tf.Tensor]:
        from hora.common.ops import submission

        scale = how.prescale_factor * how.postscale_factor
        if how.op == Sum:
            scale *= submission.set_size(how.process_set)
        scaled = [g * tf.cast(scale, g.dtype) if scale != 1.0 else g for g in upstream]
        return _allgather(scaled, None, how.process_set, how.grouped)

    return _differentiable(lambda inputs: _scatter(inputs, how), backward, tensors)


def _scatter_op(op: Any) -> Any:
    from hora.common.ops import submission

    reduce_op = submission.resolve_op(op, None, RequestType.REDUCESCATTER)
    if reduce_op not in (Average, Sum):
        raise NotImplementedError("Reducescatter supports Sum and Average only.")
    return reduce_op


def reducescatter(
    tensor: Any,
    device_dense: str = "",
    compression: Any = Compression.none,
    op: Any = Average,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> tf.Tensor:
    """Reduce across ranks and return this rank's slice of dimension 0 (the first
    ``dim0 % size`` ranks get one extra row). Differentiable."""
    del device_dense, ignore_name_scope
    compression = compression or Compression.none
    compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
    how = _Reduction(_scatter_op(op), prescale_factor, postscale_factor, name, process_set)
    (result,) = _reducescatter([compressed], how)
    return compression.decompress(result, ctx)


def grouped_reducescatter(
    tensors: Sequence[Any],
    device_dense: str = "",
    compression: Any = Compression.none,
    op: Any = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    *,
    name: str | None = None,
    ignore_name_scope: bool = False,
) -> list[tf.Tensor]:
    """Reducescatter each tensor of a list, negotiated together.

    The positional parameters are Horovod's, in its order; ``name`` (hora's) is keyword-only.
    """
    del device_dense, ignore_name_scope
    compression = compression or Compression.none
    compressed = [compression.compress(t) for t in _tensors(tensors)]
    how = _Reduction(_scatter_op(op), prescale_factor, postscale_factor, name, process_set, True)
    results = _reducescatter([c for c, _ in compressed], how)
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(results, compressed)]
