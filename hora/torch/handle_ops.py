"""Horovod's collectives in their forms with handles: ``*_async`` (a new tensor) and ``*_async_``
(in place) return an integer handle for :func:`poll` and :func:`synchronize`; ``allreduce_`` and
the other in-place forms wait for it. :mod:`hora.torch.ops` re-exports them all.

Each is a thin wrapper around :mod:`hora.common.ops.collectives`' ``*_async`` functions. While
``torch.compile`` traces, a graph cannot hold an integer handle: a form with a handle breaks the
graph there, with a message that names the functional form to use, and runs eagerly; an in-place
form traces as the functional operator (:mod:`hora.torch.compiled_forms`) whose result is copied
into its tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch

from hora.common.ops import collectives, submission
from hora.common.ops import direct as _direct
from hora.common.ops.collectives import poll as poll
from hora.common.ops.collectives import synchronize as synchronize
from hora.common.process_sets import ProcessSet
from hora.common.process_sets import global_process_set as global_process_set
from hora.common.vocabulary.errors import HoraValueError
from hora.common.vocabulary.message import ReduceOp, RequestType
from hora.torch import compiled_forms as compiled
from hora.torch.compiled_ops import tracing
from hora.torch.compression import Compression

_allreduce = collectives.allreduce_async
_reducescatter = collectives.reducescatter_async
Average = ReduceOp.AVERAGE
# What an in-place form reduces with while traced (it has no compression of its own).
_UNCOMPRESSED = Compression.none


# ---------------------------------------------------------------- allreduce


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start reducing ``tensor`` across ranks; the result is a new tensor.

    Returns:
        A handle for :func:`poll` and :func:`synchronize`.
    """
    scales = (prescale_factor, postscale_factor)
    if tracing():
        compiled.no_handle("allreduce_async", "allreduce")
    ahead = _direct.allreduce_async(tensor, False, name, op, average, *scales, process_set)
    if ahead is not None:
        return ahead
    return _allreduce([tensor], False, name, op, average, *scales, process_set, False)


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start reducing ``tensor`` in place."""
    scales = (prescale_factor, postscale_factor)
    if tracing():
        compiled.no_handle("allreduce_async_", "allreduce_")
    ahead = _direct.allreduce_async(tensor, True, name, op, average, *scales, process_set)
    if ahead is not None:
        return ahead
    return _allreduce([tensor], True, name, op, average, *scales, process_set, False)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduce ``tensor`` in place and return it."""
    scales = (prescale_factor, postscale_factor)
    if tracing():
        traced = compiled.allreduce(
            [tensor], False, average, name, _UNCOMPRESSED, op, scales, process_set
        )
        return compiled.written([tensor], traced)[0]
    direct = _direct.allreduce(tensor, True, name, op, average, *scales, process_set)
    if direct is not None:
        return direct
    handle = _allreduce([tensor], True, name, op, average, *scales, process_set, False, True)
    return cast(torch.Tensor, synchronize(handle))


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start reducing a list of tensors as one negotiated, fused operation."""
    scales = (prescale_factor, postscale_factor)
    if tracing():
        compiled.no_handle("grouped_allreduce_async", "grouped_allreduce")
    return _allreduce(tensors, False, name, op, average, *scales, process_set, True)


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """In-place form of :func:`grouped_allreduce_async`."""
    scales = (prescale_factor, postscale_factor)
    if tracing():
        compiled.no_handle("grouped_allreduce_async_", "grouped_allreduce_")
    return _allreduce(tensors, True, name, op, average, *scales, process_set, True)


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Reduce a list of tensors in place."""
    scales = (prescale_factor, postscale_factor)
    if tracing():
        traced = compiled.allreduce(
            tensors, True, average, name, _UNCOMPRESSED, op, scales, process_set
        )
        return compiled.written(tensors, traced)
    handle = _allreduce(tensors, True, name, op, average, *scales, process_set, True, True)
    return cast(list[torch.Tensor], synchronize(handle))


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str, op: Any, process_set: ProcessSet = global_process_set
) -> Any:
    """Reduce a sparse COO tensor by gathering indices and values; returns a callable.

    Calling the returned function waits and gives the reduced sparse tensor (duplicates are
    not coalesced, as in Horovod).
    """
    reduce_op = submission.resolve_op(op, None, RequestType.ALLREDUCE)
    if reduce_op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise HoraValueError("sparse_allreduce_async supports only hvd.Average and hvd.Sum.")
    tensor = tensor.coalesce() if not tensor.is_coalesced() else tensor
    indices = tensor._indices().t().contiguous()
    values = tensor._values().contiguous()
    h_indices = allgather_async(indices, name=f"{name}.indices", process_set=process_set)
    h_values = allgather_async(values, name=f"{name}.values", process_set=process_set)
    set_size = submission.set_size(process_set)

    def finish() -> torch.Tensor:
        all_values = synchronize(h_values)
        all_indices = synchronize(h_indices)
        if reduce_op == ReduceOp.AVERAGE:
            all_values = all_values / set_size
        return torch.sparse_coo_tensor(all_indices.t(), all_values, size=tensor.size())

    return finish


# ---------------------------------------------------------------- allgather


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Start gathering ``tensor`` from every rank, concatenated along dimension 0."""
    if tracing():
        compiled.no_handle("allgather_async", "allgather")
    return collectives.allgather_async([tensor], name, process_set, False)


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start gathering a list of tensors as one negotiated operation."""
    if tracing():
        compiled.no_handle("grouped_allgather_async", "grouped_allgather")
    return collectives.allgather_async(list(tensors), name, process_set, True)


# ---------------------------------------------------------------- broadcast


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start copying ``root_rank``'s tensor to every rank (into a new tensor)."""
    if tracing():
        compiled.no_handle("broadcast_async", "broadcast")
    return collectives.broadcast_async(tensor, root_rank, name, process_set, in_place=False)


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start broadcasting into ``tensor`` in place."""
    if tracing():
        compiled.no_handle("broadcast_async_", "broadcast_")
    return collectives.broadcast_async(tensor, root_rank, name, process_set, in_place=True)


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Broadcast into ``tensor`` in place and return it."""
    if tracing():
        received = compiled.broadcast(tensor, root_rank, name, process_set)
        return compiled.written([tensor], [received])[0]
    handle = collectives.broadcast_async(tensor, root_rank, name, process_set, True, True)
    return cast(torch.Tensor, synchronize(handle))


# ---------------------------------------------------------------- alltoall


def alltoall_async(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start an alltoall; ``synchronize`` gives ``(output, received_splits)``."""
    if tracing():
        compiled.no_handle("alltoall_async", "alltoall")
    return collectives.alltoall_async(tensor, splits, name, process_set)


# ---------------------------------------------------------------- reducescatter


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: Any = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Start a reducescatter: reduce across ranks, then give each rank its slice of dim 0."""
    scales = (prescale_factor, postscale_factor)
    if tracing():
        compiled.no_handle("reducescatter_async", "reducescatter")
    return _reducescatter([tensor], name, op, process_set, *scales, False)


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: Any = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Start reducescatters of a list of tensors, negotiated together."""
    scales = (prescale_factor, postscale_factor)
    if tracing():
        compiled.no_handle("grouped_reducescatter_async", "grouped_reducescatter")
    return _reducescatter(list(tensors), name, op, process_set, *scales, True)
