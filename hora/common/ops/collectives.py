"""Each collective written once, for every framework adapter.

An adapter hands torch tensors (the engine's data plane: PyTorch's own, or views of
TensorFlow's) to one of the ``*_async`` functions here and gets an integer handle back;
:func:`synchronize` waits for the result. These functions check what only the collective knows
(a reduction it cannot do, splits that do not add up, a scalar to gather) and hand the rest to
:mod:`hora.common.ops.submission` (process sets, names, requests, handles). What stays in an
adapter: its tensor type, its gradients (autograd, ``tf.custom_gradient``), compression, and
its public signatures.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, SupportsInt

import torch

from hora.common.ops import submission
from hora.common.ops.submission import Op
from hora.common.process_sets import ProcessSet
from hora.common.vocabulary.errors import HoraValueError
from hora.common.vocabulary.message import ReduceOp, RequestType

# Horovod's reduction ops, shared by every adapter (``hvd.Average``, ...).
Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

poll = submission.poll

# The rows an alltoall sends to each rank: a 1-D integer tensor, integers, or ``None`` (equal
# parts).
Splits = torch.Tensor | Iterable[SupportsInt] | None


def synchronize(handle: int) -> Any:
    """Wait for the operation behind ``handle`` and return its output.

    Returns:
        A tensor; a list for grouped ops; ``(output, received_splits)`` for alltoall.

    Raises:
        HoraInternalError: the operation failed (mismatch between ranks, lost peer, shutdown).
    """
    return submission.wait(handle)


def results(handle: int, grouped: bool) -> list[torch.Tensor]:
    """Wait for ``handle``; its results as a list, one per tensor of the call."""
    result = synchronize(handle)
    return list(result) if grouped else [result]


def allreduce_async(
    tensors: Sequence[torch.Tensor],
    in_place: bool,
    name: str | None,
    op: Op,
    average: bool | None,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    grouped: bool,
    synchronous: bool = False,
) -> int:
    """Start reducing ``tensors`` (one call, or a grouped call of several), in place or into
    new tensors. A ``synchronous`` caller waits for the result at once: the call may run on
    its thread (:mod:`hora.common.ops.fast_path`)."""
    kind = RequestType.ALLREDUCE
    reduce_op = submission.resolve_op(op, average, kind)
    tensors = list(tensors)
    outputs = tensors if in_place else [torch.empty_like(t) for t in tensors]
    fields = submission.reduction(
        kind, tensors, reduce_op, process_set, prescale_factor, postscale_factor
    )
    handle = submission.submit(
        kind, tensors, outputs, name, process_set, grouped, synchronous, **fields
    )
    return submission.register(handle)


def check_not_scalar(tensors: Sequence[torch.Tensor]) -> None:
    """Allgather needs at least one dimension to concatenate along."""
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.dim() == 0:
            raise HoraValueError(
                "Process-set rank zero tried to ALLGATHER a rank-zero tensor: allgather needs at "
                "least one dimension (use tensor.reshape(1))."
            )


def allgather_async(
    tensors: Sequence[torch.Tensor], name: str | None, process_set: ProcessSet, grouped: bool
) -> int:
    """Start gathering each tensor from every rank, concatenated along dimension 0."""
    check_not_scalar(tensors)
    return submission.register(
        submission.submit(
            RequestType.ALLGATHER,
            list(tensors),
            [None] * len(tensors),
            name,
            process_set,
            grouped=grouped,
        )
    )


def own_rows_offset(rows: int, process_set: ProcessSet) -> int:
    """Where this rank's ``rows`` start in an allgather of every rank's rows (the gradient of an
    allgather goes back to the rows each rank gave)."""
    sizes = synchronize(
        allgather_async([torch.tensor([rows], dtype=torch.int64)], None, process_set, False)
    )
    return int(sizes[: submission.set_rank(process_set)].sum())


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None,
    process_set: ProcessSet,
    in_place: bool,
    synchronous: bool = False,
) -> int:
    """Start copying ``root_rank``'s tensor to every rank, into ``tensor`` or a new one (see
    :func:`allreduce_async` for ``synchronous``)."""
    output = tensor if in_place else torch.empty_like(tensor)
    return submission.register(
        submission.submit(
            RequestType.BROADCAST,
            [tensor],
            [output],
            name,
            process_set,
            synchronous=synchronous,
            root_rank=int(root_rank),
        )
    )


def _splits(tensor: torch.Tensor, splits: Splits, set_size: int) -> tuple[int, ...] | None:
    """The rows for each rank, checked against the tensor (``None``: equal parts)."""
    if splits is None:
        if tensor.dim() == 0 or tensor.shape[0] % set_size != 0:
            raise HoraValueError(
                "splits not provided, but first dimension of tensor is not an even multiple of "
                f"the number of workers ({set_size})."
            )
        return None
    if isinstance(splits, torch.Tensor):
        if splits.dim() != 1:
            raise HoraValueError("alltoall expects a 1D splits tensor")
        if splits.dtype not in (torch.int32, torch.int64):
            raise HoraValueError("alltoall expects splits to contain 32-bit integer elements.")
        values = tuple(int(v) for v in splits.cpu().tolist())
    else:
        values = tuple(int(v) for v in splits)
    if len(values) != set_size:
        raise HoraValueError(
            f"Number of entries in splits ({len(values)}) does not equal number of workers "
            f"({set_size})."
        )
    if any(v < 0 for v in values):
        raise HoraValueError(f"alltoall splits must be >= 0, got {list(values)}.")
    if tensor.dim() == 0 or sum(values) > tensor.shape[0]:
        raise HoraValueError("Sum of splits entries is greater than the first dimension of tensor.")
    return values


def alltoall_async(
    tensor: torch.Tensor, splits: Splits, name: str | None, process_set: ProcessSet
) -> int:
    """Start an alltoall; :func:`synchronize` gives ``(output, received_splits)``."""
    submission.check_process_set(process_set, RequestType.ALLTOALL)
    values = _splits(tensor, splits, submission.set_size(process_set))
    return submission.register(
        submission.submit(RequestType.ALLTOALL, [tensor], [None], name, process_set, splits=values)
    )


def reducescatter_op(op: Op) -> ReduceOp:
    """The reduction of a reducescatter: Average (the default) or Sum."""
    reduce_op = submission.resolve_op(op, None, RequestType.REDUCESCATTER)
    if reduce_op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise HoraValueError("Reducescatter currently only supports AVERAGE and SUM.")
    return reduce_op


def reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None,
    op: Op,
    process_set: ProcessSet,
    prescale_factor: float,
    postscale_factor: float,
    grouped: bool,
) -> int:
    """Start reducing each tensor across ranks, each rank keeping its slice of dimension 0."""
    reduce_op = reducescatter_op(op)
    if any(isinstance(t, torch.Tensor) and t.dim() == 0 for t in tensors):
        raise HoraValueError("Reducescatter needs a tensor with at least one dimension.")
    kind, tensors = RequestType.REDUCESCATTER, list(tensors)
    fields = submission.reduction(
        kind, tensors, reduce_op, process_set, prescale_factor, postscale_factor
    )
    outputs = [None] * len(tensors)
    handle = submission.submit(kind, tensors, outputs, name, process_set, grouped, **fields)
    return submission.register(handle)


def reducescatter_gradient_factor(op: Op, prescale: float, postscale: float, size: int) -> float:
    """What a reducescatter's gradient is multiplied by before it is gathered back: the scale
    factors, and the number of ranks when the reduction was a sum."""
    return prescale * postscale * (size if reducescatter_op(op) == ReduceOp.SUM else 1)


def join() -> int:
    """Tell the other ranks this rank has no more data; wait until every rank has joined.
    Returns the global rank that joined last (the same on every rank)."""
    return submission.join()


def barrier(process_set: ProcessSet) -> None:
    """Block until every rank of ``process_set`` has called ``barrier``."""
    submission.barrier(process_set)
