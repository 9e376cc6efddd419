"""Horovod's collective operations on PyTorch tensors.

Each collective is written once, framework-neutral, in :mod:`hora.common.ops.collectives` (an
``*_async`` function: checks, names, requests, an integer handle); the public forms are thin
wrappers around it: the differentiable ones here (one autograd ``Function`` for all), those
with handles and the in-place ones in :mod:`hora.torch.handle_ops` (re-exported here). This
module knows PyTorch's autograd and compression; the rest is the engine's.

While ``torch.compile`` traces (``torch.compiler.is_compiling()``), each public function takes
its form of :mod:`hora.torch.compiled_forms` instead: a custom operator, one node of the graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from hora.common import api
from hora.common.ops import collectives, submission
from hora.common.ops import direct as _direct
from hora.common.ops.collectives import Adasum as Adasum
from hora.common.ops.collectives import Average as Average
from hora.common.ops.collectives import Max as Max
from hora.common.ops.collectives import Min as Min
from hora.common.ops.collectives import Product as Product
from hora.common.ops.collectives import Sum as Sum
from hora.common.ops.collectives import join as _join
from hora.common.ops.collectives import results as _results
from hora.common.ops.collectives import synchronize as _synchronize
from hora.common.process_sets import ProcessSet
from hora.common.process_sets import global_process_set as global_process_set
from hora.torch import compiled_forms as _compiled
from hora.torch.compiled_ops import tracing as _tracing
from hora.torch.compression import Compression
from hora.torch.compression import compressed as _compressed
from hora.torch.handle_ops import allgather_async as allgather_async
from hora.torch.handle_ops import allreduce_ as allreduce_
from hora.torch.handle_ops import allreduce_async as allreduce_async
from hora.torch.handle_ops import allreduce_async_ as allreduce_async_
from hora.torch.handle_ops import alltoall_async as alltoall_async
from hora.torch.handle_ops import broadcast_ as broadcast_
from hora.torch.handle_ops import broadcast_async as broadcast_async
from hora.torch.handle_ops import broadcast_async_ as broadcast_async_
from hora.torch.handle_ops import grouped_allgather_async as grouped_allgather_async
from hora.torch.handle_ops import grouped_allreduce_ as grouped_allreduce_
from hora.torch.handle_ops import grouped_allreduce_async as grouped_allreduce_async
from hora.torch.handle_ops import grouped_allreduce_async_ as grouped_allreduce_async_
from hora.torch.handle_ops import grouped_reducescatter_async as grouped_reducescatter_async
from hora.torch.handle_ops import poll as poll
from hora.torch.handle_ops import reducescatter_async as reducescatter_async
from hora.torch.handle_ops import sparse_allreduce_async as sparse_allreduce_async
from hora.torch.handle_ops import synchronize as synchronize

_allreduce = collectives.allreduce_async


# ---------------------------------------------------------------- autograd

# A differentiable collective's two halves: each takes the tensors (the inputs, or the
# gradients of the outputs) and gives the results, one per input.
_Half = Callable[[Any, Sequence[torch.Tensor]], Sequence[torch.Tensor | None]]


class _Differentiable(torch.autograd.Function):
    """Every differentiable collective: ``forward`` and ``backward`` are the call's own
    functions (closures over its non-tensor arguments)."""

    @staticmethod
    def forward(ctx: Any, forward: _Half, backward: _Half, *tensors: torch.Tensor) -> Any:
        ctx.backward_half = backward
        return tuple(forward(ctx, tensors))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        return (None, None, *ctx.backward_half(ctx, grads))


class _NoGradient:
    """What a collective's forward half gets as ``ctx`` when no gradient will flow back."""

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        pass


def _differentiable(forward: _Half, backward: _Half, tensors: Sequence[torch.Tensor]) -> Any:
    # autograd's Function.apply costs tens of microseconds a call; a call whose result cannot
    # carry a gradient (none of its inputs requires one, or gradients are off) skips it, and
    # its result is what apply would have given.
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _Differentiable.apply(forward, backward, *tensors)
    return tuple(forward(_NoGradient(), tensors))


def _contiguous(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.contiguous() for t in tensors]


# ---------------------------------------------------------------- allreduce


def _differentiable_allreduce(
    tensors: Sequence[torch.Tensor],
    grouped: bool,
    average: bool | None,
    name: str | None,
    op: Any,
    prescale: float,
    postscale: float,
    process_set: ProcessSet,
) -> Any:
    """Allreduce ``tensors``; the gradient is reduced the same way."""

    def reduce(tensors: Sequence[torch.Tensor], name: str | None) -> list[torch.Tensor]:
        handle = _allreduce(
            tensors, False, name, op, average, prescale, postscale, process_set, grouped, True
        )
        return _results(handle, grouped)

    return _differentiable(
        lambda ctx, inputs: reduce(inputs, name),
        lambda ctx, grads: reduce(_contiguous(grads), None),
        tensors,
    )


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduce ``tensor`` across the ranks of ``process_set`` and return the result.

    The result is ``postscale_factor * op(prescale_factor * tensor on each rank)``; Average
    divides the sum by the number of ranks. Differentiable: the gradient is reduced the same way.

    Args:
        tensor: the local tensor (CPU or CUDA).
        average: deprecated; use ``op``.
        name: a name shared by all ranks; ops are matched across ranks by name.
        compression: ``Compression.none``, ``Compression.fp16`` or ``Compression.bf16``.
        op: ``hvd.Average`` (default), ``hvd.Sum``, ``hvd.Min``, ``hvd.Max``, ``hvd.Product``.
        prescale_factor: multiply by this before reducing.
        postscale_factor: multiply by this after reducing.
        process_set: the ranks taking part (default: all).

    Example:
        >>> total = hvd.allreduce(torch.tensor([hvd.rank()]), op=hvd.Sum)
    """
    scales = (prescale_factor, postscale_factor)
    if _tracing():
        (traced,) = _compiled.allreduce(
            [tensor], False, average, name, compression, op, scales, process_set
        )
        return traced
    if compression is Compression.none:
        direct = _direct.allreduce(tensor, False, name, op, average, *scales, process_set)
        if direct is not None:
            return direct
    (result,) = _compressed(
        compression,
        [tensor],
        lambda inputs: _differentiable_allreduce(
            inputs, False, average, name, op, *scales, process_set
        ),
    )
    return result


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Reduce a list of tensors together (one negotiation, fused where possible)."""
    scales = (prescale_factor, postscale_factor)
    if _tracing():
        return _compiled.allreduce(
            tensors, True, average, name, compression, op, scales, process_set
        )
    return _compressed(
        compression,
        tensors,
        lambda inputs: _differentiable_allreduce(
            inputs, True, average, name, op, *scales, process_set
        ),
    )


# ---------------------------------------------------------------- allgather


def _allgather(
    tensors: Sequence[torch.Tensor], name: str | None, process_set: ProcessSet, grouped: bool
) -> int:
    return collectives.allgather_async(tensors, name, process_set, grouped)


def _own_rows(grad: torch.Tensor, rows: int, process_set: ProcessSet) -> torch.Tensor:
    return grad.narrow(0, collectives.own_rows_offset(rows, process_set), rows)


def _differentiable_allgather(
    tensors: Sequence[torch.Tensor], grouped: bool, name: str | None, process_set: ProcessSet
) -> Any:
    """Allgather ``tensors``; each gradient is averaged and this rank's rows are its own."""
    collectives.check_not_scalar(tensors)
    rows = [t.shape[0] for t in tensors]

    def gather(ctx: Any, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return _results(_allgather(inputs, name, process_set, grouped), grouped)

    def scatter_back(ctx: Any, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        grads = _contiguous(grads)
        handle = _allreduce(grads, False, None, Average, None, 1.0, 1.0, process_set, grouped)
        reduced = _results(handle, grouped)
        return [_own_rows(g, n, process_set) for g, n in zip(reduced, rows)]

    return _differentiable(gather, scatter_back, tensors)


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0, in rank order.

    The first dimension may differ between ranks; the others must match. Differentiable.

    Example:
        >>> hvd.allgather(torch.full((hvd.rank() + 1, 2), hvd.rank()))
    """
    if _tracing():
        return _compiled.allgather([tensor], False, name, process_set)[0]
    (result,) = _differentiable_allgather([tensor], False, name, process_set)
    return cast(torch.Tensor, result)


def grouped_allgather(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Allgather each tensor of a list, negotiated together."""
    if _tracing():
        return _compiled.allgather(tensors, True, name, process_set)
    return list(_differentiable_allgather(list(tensors), True, name, process_set))


# ---------------------------------------------------------------- broadcast


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank. ``root_rank`` is a global rank.

    Differentiable: the root gets the average of every rank's gradient, the others zeros.

    Example:
        >>> weights = hvd.broadcast(weights, root_rank=0)
    """
    if _tracing():
        return _compiled.broadcast(tensor, root_rank, name, process_set)

    def send(ctx: Any, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        handle = collectives.broadcast_async(inputs[0], root_rank, name, process_set, False, True)
        return [_synchronize(handle)]

    def gather_to_root(ctx: Any, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        (reduced,) = _results(
            _allreduce(
                _contiguous(grads), False, None, Average, None, 1.0, 1.0, process_set, False
            ),
            False,
        )
        return [reduced if api.rank() == root_rank else reduced * 0]

    (result,) = _differentiable(send, gather_to_root, [tensor])
    return cast(torch.Tensor, result)


# ---------------------------------------------------------------- alltoall


def alltoall(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Scatter slices of ``tensor`` to every rank and gather what they send back.

    Differentiable: the gradient goes back with the splits each rank received.

    Args:
        tensor: rows to send, grouped by destination.
        splits: rows for each rank (default: equal parts).

    Returns:
        The received tensor; ``(received, received_splits)`` when ``splits`` is given.
    """
    if _tracing():
        return _compiled.alltoall(tensor, splits, name, process_set)

    def exchange(ctx: Any, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        handle = collectives.alltoall_async(inputs[0], splits, name, process_set)
        output, received = _synchronize(handle)
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return [output, received]

    def send_back(ctx: Any, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        grad = grads[0]
        assert grad is not None
        handle = collectives.alltoall_async(grad.contiguous(), ctx.received, None, process_set)
        output, _ = _synchronize(handle)
        return [output]

    output, received = _differentiable(exchange, send_back, [tensor])
    return output if splits is None else (output, received)


# ---------------------------------------------------------------- reducescatter


_reducescatter = collectives.reducescatter_async


def _differentiable_reducescatter(
    tensors: Sequence[torch.Tensor],
    grouped: bool,
    name: str | None,
    op: Any,
    process_set: ProcessSet,
    prescale: float,
    postscale: float,
) -> Any:
    """Reducescatter ``tensors``; each gradient is gathered back, scaled as the forward was."""

    def scatter(ctx: Any, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        handle = _reducescatter(inputs, name, op, process_set, prescale, postscale, grouped)
        return _results(handle, grouped)

    def gather(ctx: Any, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        size = submission.set_size(process_set)
        factor = collectives.reducescatter_gradient_factor(op, prescale, postscale, size)
        return [
            _synchronize(_allgather([(g * factor).contiguous()], None, process_set, False))
            for g in grads
        ]

    return _differentiable(scatter, gather, tensors)


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Reduce ``tensor`` across ranks and return this rank's slice of dimension 0.

    When dimension 0 does not divide evenly, the first ``dim0 % size`` ranks get one extra row.
    """
    scales = (prescale_factor, postscale_factor)
    if _tracing():
        (traced,) = _compiled.reducescatter(
            [tensor], False, name, compression, op, process_set, scales
        )
        return traced
    (result,) = _compressed(
        compression,
        [tensor],
        lambda inputs: _differentiable_reducescatter(inputs, False, name, op, process_set, *scales),
    )
    return result


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """Reducescatter each tensor of a list, negotiated together."""
    scales = (prescale_factor, postscale_factor)
    if _tracing():
        return _compiled.reducescatter(tensors, True, name, compression, op, process_set, scales)
    return _compressed(
        compression,
        tensors,
        lambda inputs: _differentiable_reducescatter(inputs, True, name, op, process_set, *scales),
    )


# ---------------------------------------------------------------- synchronization


def join(device: int = -1) -> int:
    """Tell the other ranks this rank has no more data; wait until every rank has joined.

    Until then this rank keeps taking part in other ranks' allreduces with zeros. Returns the
    global rank that joined last (the same on every rank).
    """
    del device
    return _join()


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of ``process_set`` has called ``barrier``."""
    collectives.barrier(process_set)
