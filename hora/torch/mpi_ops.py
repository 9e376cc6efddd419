"""Compatibility path for scripts that import ``horovod.torch.mpi_ops``: hora's PyTorch names,
plus the autograd ``Function`` classes Horovod defines there, under Horovod's names and with its
``apply`` argument order.

Nothing here depends on MPI. The collectives are :mod:`hora.torch.ops`'s; each ``Function``'s
forward pass calls one of them and its backward pass calls the collective that carries the
gradient back, so a script that calls ``HorovodAllreduce.apply(...)`` gets what
``hvd.allreduce(...)`` gives. The public functions (``hvd.allreduce`` and the others) do not go
through these classes: they use :mod:`hora.torch.ops`'s own autograd path.

Example:
    >>> from hora.torch.mpi_ops import HorovodAllreduce
    >>> x = torch.ones(3, requires_grad=True)
    >>> y = HorovodAllreduce.apply(x, None, "y", hvd.Sum, 1.0, 1.0, hvd.global_process_set)
    >>> y.sum().backward()      # x.grad: hvd.size() in every element, on every rank
"""

from __future__ import annotations

from typing import Any

import torch

from hora.common import api
from hora.common.ops import collectives, submission
from hora.common.ops.engine_facts import is_power_of_two as num_rank_is_power_2
from hora.common.ops.submission import handle_average_backwards_compatibility
from hora.common.process_sets import ProcessSet
from hora.torch import *  # noqa: F403 - Horovod's mpi_ops holds the package's collectives
from hora.torch import __all__ as _package_names
from hora.torch import ops

__all__ = [
    *_package_names,
    "HorovodAllgather",
    "HorovodAllreduce",
    "HorovodAlltoall",
    "HorovodBroadcast",
    "HorovodGroupedAllgather",
    "HorovodGroupedAllreduce",
    "HorovodGroupedReducescatter",
    "HorovodReducescatter",
    "handle_average_backwards_compatibility",
    "num_rank_is_power_2",
]


def _own_rows(grad: torch.Tensor, rows: int, process_set: ProcessSet) -> torch.Tensor:
    """This rank's rows of an allgather's averaged gradient."""
    return grad.narrow(0, collectives.own_rows_offset(rows, process_set), rows)


def _reduction(
    op: Any, prescale_factor: float, postscale_factor: float, process_set: ProcessSet
) -> dict[str, Any]:
    """How a forward pass reduces, as keyword arguments of its collective: the backward pass
    keeps them (``ctx.reduction``) to reduce or scale the gradients the same way."""
    return {
        "op": op,
        "prescale_factor": prescale_factor,
        "postscale_factor": postscale_factor,
        "process_set": process_set,
    }


def _reducescatter_gradients(ctx: Any, grads: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """A reducescatter's output gradients, scaled as the forward pass scaled its inputs."""
    reduction = ctx.reduction
    size = submission.set_size(reduction["process_set"])
    factor = collectives.reducescatter_gradient_factor(
        reduction["op"], reduction["prescale_factor"], reduction["postscale_factor"], size
    )
    return [g * factor if factor != 1.0 else g for g in grads]


class HorovodAllreduce(torch.autograd.Function):
    """``allreduce`` as an autograd ``Function``; the gradient is reduced the same way.

    ``HorovodAllreduce.apply(tensor, average, name, op, prescale_factor, postscale_factor,
    process_set)``; every argument is positional, as ``Function.apply`` takes them.
    """

    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        average: bool | None,
        name: str | None,
        op: Any,
        prescale_factor: float,
        postscale_factor: float,
        process_set: ProcessSet,
    ) -> torch.Tensor:
        ctx.average = average
        ctx.reduction = _reduction(op, prescale_factor, postscale_factor, process_set)
        return ops.allreduce(tensor, average, name, **ctx.reduction)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad = ops.allreduce(grad_output.contiguous(), ctx.average, **ctx.reduction)
        return (grad, None, None, None, None, None, None)


class HorovodGroupedAllreduce(torch.autograd.Function):
    """``grouped_allreduce`` as an autograd ``Function``: one negotiated reduction of a list.

    ``HorovodGroupedAllreduce.apply(average, name, op, prescale_factor, postscale_factor,
    process_set, *tensors)`` returns a tuple, one reduced tensor per input.
    """

    @staticmethod
    def forward(
        ctx: Any,
        average: bool | None,
        name: str | None,
        op: Any,
        prescale_factor: float,
        postscale_factor: float,
        process_set: ProcessSet,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.average = average
        ctx.reduction = _reduction(op, prescale_factor, postscale_factor, process_set)
        return tuple(ops.grouped_allreduce(list(tensors), average, name, **ctx.reduction))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        contiguous = [g.contiguous() for g in grad_outputs]
        grads = ops.grouped_allreduce(contiguous, ctx.average, **ctx.reduction)
        return (None, None, None, None, None, None, *grads)


class HorovodAllgather(torch.autograd.Function):
    """``allgather`` as an autograd ``Function``: ``HorovodAllgather.apply(tensor, name,
    process_set)``. The gradient is averaged over the ranks and each rank keeps the rows it
    gave."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, name: str | None, process_set: ProcessSet
    ) -> torch.Tensor:
        ctx.rows = tensor.shape[0] if tensor.dim() else 0
        ctx.process_set = process_set
        return ops.allgather(tensor, name, process_set)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        averaged = ops.allreduce(
            grad_output.contiguous(), op=ops.Average, process_set=ctx.process_set
        )
        return (_own_rows(averaged, ctx.rows, ctx.process_set), None, None)


class HorovodGroupedAllgather(torch.autograd.Function):
    """``grouped_allgather`` as an autograd ``Function``:
    ``HorovodGroupedAllgather.apply(name, process_set, *tensors)`` returns a tuple."""

    @staticmethod
    def forward(
        ctx: Any, name: str | None, process_set: ProcessSet, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.rows = [t.shape[0] if t.dim() else 0 for t in tensors]
        ctx.process_set = process_set
        return tuple(ops.grouped_allgather(list(tensors), name, process_set))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        averaged = ops.grouped_allreduce(
            [g.contiguous() for g in grad_outputs], op=ops.Average, process_set=ctx.process_set
        )
        own = [_own_rows(g, rows, ctx.process_set) for g, rows in zip(averaged, ctx.rows)]
        return (None, None, *own)


class HorovodBroadcast(torch.autograd.Function):
    """``broadcast`` as an autograd ``Function``: ``HorovodBroadcast.apply(tensor, root_rank,
    name, process_set)``. The root gets the gradient averaged over the ranks, the others
    zeros."""

    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        root_rank: int,
        name: str | None,
        process_set: ProcessSet,
    ) -> torch.Tensor:
        ctx.root_rank = root_rank
        ctx.process_set = process_set
        return ops.broadcast(tensor, root_rank, name, process_set)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        averaged = ops.allreduce(
            grad_output.contiguous(), op=ops.Average, process_set=ctx.process_set
        )
        grad = averaged if api.rank() == ctx.root_rank else averaged * 0
        return (grad, None, None, None)


class HorovodAlltoall(torch.autograd.Function):
    """``alltoall`` as an autograd ``Function``: ``HorovodAlltoall.apply(tensor, splits, name,
    process_set)`` gives the received tensor, and with ``splits`` also the splits received
    (not differentiable). The gradient travels back with the splits each rank received."""

    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        splits: Any,
        name: str | None,
        process_set: ProcessSet,
    ) -> Any:
        output, received = ops.synchronize(ops.alltoall_async(tensor, splits, name, process_set))
        ctx.received = received
        ctx.process_set = process_set
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:
        grad, _received = ops.alltoall(
            grad_output.contiguous(), ctx.received, process_set=ctx.process_set
        )
        return (grad, None, None, None)


class HorovodReducescatter(torch.autograd.Function):
    """``reducescatter`` as an autograd ``Function``: ``HorovodReducescatter.apply(tensor, name,
    op, process_set, prescale_factor, postscale_factor)``. The gradient is gathered back, scaled
    as the forward pass scaled."""

    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        name: str | None,
        op: Any,
        process_set: ProcessSet,
        prescale_factor: float,
        postscale_factor: float,
    ) -> torch.Tensor:
        ctx.reduction = _reduction(op, prescale_factor, postscale_factor, process_set)
        return ops.reducescatter(tensor, name, **ctx.reduction)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (scaled,) = _reducescatter_gradients(ctx, (grad_output,))
        grad = ops.allgather(scaled.contiguous(), process_set=ctx.reduction["process_set"])
        return (grad, None, None, None, None, None)


class HorovodGroupedReducescatter(torch.autograd.Function):
    """``grouped_reducescatter`` as an autograd ``Function``:
    ``HorovodGroupedReducescatter.apply(name, op, process_set, prescale_factor,
    postscale_factor, *tensors)`` returns a tuple."""

    @staticmethod
    def forward(
        ctx: Any,
        name: str | None,
        op: Any,
        process_set: ProcessSet,
        prescale_factor: float,
        postscale_factor: float,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.reduction = _reduction(op, prescale_factor, postscale_factor, process_set)
        return tuple(ops.grouped_reducescatter(list(tensors), name, **ctx.reduction))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        scaled = _reducescatter_gradients(ctx, grad_outputs)
        contiguous = [g.contiguous() for g in scaled]
        grads = ops.grouped_allgather(contiguous, process_set=ctx.reduction["process_set"])
        return (None, None, None, None, None, *grads)
