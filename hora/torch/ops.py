"""Horovod's collective operations on PyTorch tensors.

Each collective is written once as an ``*_async`` function that turns tensors into engine
requests and returns an integer handle; the synchronous, in-place and differentiable forms are
thin wrappers around it. This module knows tensors and autograd; the engine does the rest.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch

from hora.common import adasum, basics
from hora.common.engine import Entry, Handle, dtype_name
from hora.common.errors import HoraInternalError, HoraValueError
from hora.common.message import ReduceOp, Request, RequestType
from hora.common.process_sets import ProcessSet
from hora.torch.compression import Compression

global_process_set = basics.global_process_set

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

_handles: dict[int, tuple[Handle, Any]] = {}


class GradientHolder(Protocol):
    """Something that holds tensors back before submitting them (``DistributedOptimizer``
    holds a steady-state batch's small gradients until the batch is complete)."""

    def release_held(self) -> None:
        """Submit what this thread holds: it is about to wait for a result, which might be
        in a batch that also waits for what it holds."""


# Holders holding something now (see hold()). Weak: a holder that is gone holds nothing.
_holders: weakref.WeakSet[Any] = weakref.WeakSet()


def hold(holder: GradientHolder) -> None:
    """Register ``holder`` while it holds tensors back: any wait for a result (``synchronize``)
    first asks every registered holder to release what it holds."""
    _holders.add(holder)


def stop_holding(holder: GradientHolder) -> None:
    _holders.discard(holder)


_REDUCE_OP_NAMES = {op: op.label for op in ReduceOp}
_PREFIXES = {kind: kind.name.lower() for kind in RequestType}


def _op_label(kind: RequestType) -> str:
    return kind.name.capitalize()


def _check_process_set(process_set: ProcessSet, kind: RequestType) -> int:
    engine = basics.engine()
    set_id = process_set.process_set_id
    if set_id is None or not engine.process_sets.contains(set_id):
        raise HoraValueError(
            f"{_op_label(kind)}: {process_set} is not registered. Pass it to "
            "hvd.init(process_sets=[...]) or hvd.add_process_set(...) on every rank first."
        )
    if engine.rank not in engine.process_sets.members(set_id):
        raise HoraValueError(
            f"{_op_label(kind)}: Rank {engine.rank} is not a member of the provided process set."
        )
    return set_id


def _check_tensor(tensor: Any, kind: RequestType) -> str:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{_op_label(kind)} expects a torch.Tensor, got {type(tensor).__name__}.")
    if not tensor.is_contiguous():
        raise HoraValueError("Tensor is required to be contiguous.")
    if tensor.is_sparse:
        raise HoraValueError(
            f"{_op_label(kind)} does not take sparse tensors; use sparse_allreduce_async or "
            "convert with tensor.to_dense()."
        )
    name = dtype_name(tensor.dtype)
    if name is None:
        raise HoraValueError(f"Tensor type {tensor.dtype} is not supported.")
    return name


def _resolve_op(op: Any, average: bool | None, kind: RequestType) -> ReduceOp:
    if op is not None and average is not None:
        raise HoraValueError(
            "The op parameter supersedes average. Please provide only one of them."
        )
    if average is not None:
        warnings.warn(
            "Parameter `average` has been replaced with `op` and will be removed.",
            DeprecationWarning,
            stacklevel=3,
        )
        return ReduceOp.AVERAGE if average else ReduceOp.SUM
    if op is None:
        return ReduceOp.AVERAGE
    try:
        return ReduceOp(int(op))
    except (TypeError, ValueError):
        raise HoraValueError(
            f"{_op_label(kind)}: unknown reduction op {op!r}; use hvd.Average, hvd.Sum, hvd.Min, "
            "hvd.Max or hvd.Product."
        ) from None


def _submit_reduction(
    kind: RequestType,
    tensors: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor | None],
    name: str | None,
    reduce_op: ReduceOp,
    process_set: ProcessSet,
    prescale_factor: float,
    postscale_factor: float,
    grouped: bool,
) -> Handle:
    """Check the reduction against every tensor's dtype and submit (allreduce, reducescatter)."""
    _check_reduction(kind, tensors, reduce_op, process_set)
    prefix = _PREFIXES[kind]
    return _submit(
        kind,
        f"grouped_{prefix}" if grouped else prefix,
        tensors,
        outputs,
        name,
        process_set,
        grouped=grouped,
        reduce_op=reduce_op,
        prescale=float(prescale_factor),
        postscale=float(postscale_factor),
    )


def _check_reduction(
    kind: RequestType,
    tensors: Sequence[torch.Tensor],
    reduce_op: ReduceOp,
    process_set: ProcessSet | None = None,
) -> None:
    """Raise if hora cannot run ``reduce_op`` on these tensors (in ``process_set``, if given)."""
    if reduce_op == ReduceOp.ADASUM:
        check_adasum(kind, tensors, process_set)
    if reduce_op == ReduceOp.AVERAGE and any(
        isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in tensors
    ):
        raise HoraValueError(
            f"{_op_label(kind)}: Average is not defined for bool tensors; use op=hvd.Sum or "
            "hvd.Max (logical or) or hvd.Min or hvd.Product (logical and)."
        )


def check_adasum(
    kind: RequestType, tensors: Sequence[torch.Tensor], process_set: ProcessSet | None
) -> None:
    """Adasum's constraints, as Horovod states them (NotImplementedError is a RuntimeError)."""
    if kind != RequestType.ALLREDUCE:
        raise HoraValueError(
            f"{_op_label(kind)} currently only supports AVERAGE and SUM; op=hvd.Adasum is for "
            "allreduce, grouped_allreduce and DistributedOptimizer."
        )
    if process_set is not None and process_set.process_set_id not in (None, 0):
        raise NotImplementedError(
            "Adasum does not support non-global process sets yet: use op=hvd.Adasum on the "
            "global process set, or op=hvd.Average within a process set."
        )
    size = basics.size()
    if not adasum.is_power_of_two(size):
        raise NotImplementedError(
            f"Running Adasum with non-power of 2 ranks is not supported yet: this job has {size} "
            "ranks. Run 1, 2, 4, 8, ... ranks, or use op=hvd.Average."
        )
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and not tensor.is_floating_point():
            raise HoraValueError(
                f"Adasum combines floating-point tensors only (float16, bfloat16, float32, "
                f"float64), not {tensor.dtype}; use op=hvd.Sum or hvd.Average for it."
            )


def _full_name(prefix: str, name: str | None, handle: Handle) -> str:
    return f"{prefix}.{name}" if name is not None else f"{prefix}.noname.{handle.id}"


def _register(handle: Handle, post: Any = None) -> int:
    _handles[handle.id] = (handle, post)
    return handle.id


def _submit(
    kind: RequestType,
    prefix: str,
    tensors: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor | None],
    name: str | None,
    process_set: ProcessSet,
    grouped: bool = False,
    **fields: Any,
) -> Handle:
    """Build one entry per tensor and hand them to the engine atomically."""
    set_id = _check_process_set(process_set, kind)
    engine = basics.engine()
    handle = engine.handle(len(tensors), kind, grouped)
    base = _full_name(prefix, name, handle)
    count = len(tensors)
    if grouped and len({t.device for t in tensors}) > 1:
        raise HoraValueError("Tensors in list must be on same device.")
    entries = []
    for index, (tensor, output) in enumerate(zip(tensors, outputs)):
        full = f"{base}_{index + 1}of{count}" if grouped else base
        group = (base, count) if grouped else None
        request = _request(kind, full, tensor, set_id, group, fields)
        if tensor.is_cuda:
            _engine_stream_waits_for_caller(tensor.device)
        entries.append(Entry(request, tensor, output, handle, index))
    engine.enqueue(entries)
    return handle


def _request(
    kind: RequestType,
    name: str,
    tensor: torch.Tensor,
    set_id: int,
    group: tuple[str, int] | None,
    fields: dict[str, Any],
) -> Request:
    """Check one tensor and describe it to the engine."""
    dtype = _check_tensor(tensor, kind)
    return Request(
        name=name,
        kind=kind,
        dtype=dtype,
        shape=tuple(tensor.shape),
        process_set_id=set_id,
        device="cpu" if tensor.is_cpu else tensor.device.type,
        group=group,
        **fields,
    )


class RepeatedAllreduce:
    """An in-place allreduce submitted again and again under one name: a gradient's, every step.

    ``submit(tensor)`` is ``allreduce_async_(tensor, name=name, ...)``, but the checks and the
    request are made only when the tensor's dtype, shape or device (or the engine, after an
    elastic reset) changes; otherwise a call only queues the tensor. ``DistributedOptimizer``'s
    gradient hooks use it: they run on backward's critical path, once per parameter per step.

    With ``lend=True`` the result may instead be a view of the engine's steady-state buffer,
    with ``tensor`` left as it was: the caller adopts it (``tensor.set_(result)``), which saves
    copying the result into ``tensor``. The engine writes that buffer again only once no
    tensor refers to it.
    """

    __slots__ = ("_dtype", "_engine", "_fields", "_lend", "_name", "_process_set", "_request")

    def __init__(
        self,
        name: str,
        op: ReduceOp,
        prescale_factor: float,
        postscale_factor: float,
        process_set: ProcessSet,
        lend: bool = False,
    ) -> None:
        _check_reduction(RequestType.ALLREDUCE, [], op, process_set)
        self._name = f"{_PREFIXES[RequestType.ALLREDUCE]}.{name}"
        self._lend = lend
        self._process_set = process_set
        self._fields: dict[str, Any] = {
            "reduce_op": op,
            "prescale": float(prescale_factor),
            "postscale": float(postscale_factor),
        }
        self._request: Request | None = None
        self._engine: Any = None
        self._dtype: torch.dtype | None = None

    @property
    def name(self) -> str:
        """The request's full name (as the engine and its schedule know it)."""
        return self._name

    def submit(self, tensor: torch.Tensor) -> int:
        """Start reducing ``tensor`` in place; returns a handle, as ``allreduce_async_`` does."""
        kind = RequestType.ALLREDUCE
        engine = basics.engine()
        request = self._request
        if request is not None and request.process_set_id == 0 and engine is self._engine:
            # The global set is there as long as its engine is; another set may have been
            # removed, or removed and added again under another id, since the last call.
            set_id = 0
        else:
            set_id = _check_process_set(self._process_set, kind)
        if (
            request is None
            or engine is not self._engine
            or tensor.dtype is not self._dtype
            or request.process_set_id != set_id
            or request.shape != tensor.shape
            or request.device != ("cpu" if tensor.is_cpu else tensor.device.type)
            or not tensor.is_contiguous()
        ):
            _check_reduction(kind, [tensor], self._fields["reduce_op"], self._process_set)
            request = _request(kind, self._name, tensor, set_id, None, self._fields)
            self._request, self._engine, self._dtype = request, engine, tensor.dtype
        if tensor.is_cuda:
            _engine_stream_waits_for_caller(tensor.device)
        handle = engine.handle(1, kind)
        engine.enqueue([Entry(request, tensor, tensor, handle, lend=self._lend)])
        return _register(handle)


def _engine_stream_waits_for_caller(device: torch.device) -> None:
    """Order the engine's reads of a CUDA tensor after the work queued to produce it.

    The engine's threads copy CUDA tensors to host memory on the device's default stream. A
    caller that queued the tensor's kernels on another stream (``torch.cuda.stream(s)``, as
    some training loops and libraries do) would race with that copy, so the default stream
    waits for the caller's stream here; the host does not wait.
    """
    current = torch.cuda.current_stream(device)
    default = torch.cuda.default_stream(device)
    if current != default:
        default.wait_stream(current)


def _caller_waits_for_engine_stream(results: Sequence[Any]) -> None:
    """Order the caller's later work on a CUDA result after the engine's copy into it.

    ``results`` holds one result per entry: a tensor, or a tuple of tensors (alltoall).
    """
    first = results[0] if results else None
    if isinstance(first, tuple):
        first = first[0]
    if isinstance(first, torch.Tensor) and first.is_cuda:
        current = torch.cuda.current_stream(first.device)
        default = torch.cuda.default_stream(first.device)
        if current != default:
            current.wait_stream(default)


# ---------------------------------------------------------------- allreduce


def _allreduce_submit(
    tensors: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor | None],
    name: str | None,
    op: Any,
    average: bool | None,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    grouped: bool,
) -> Handle:
    reduce_op = _resolve_op(op, average, RequestType.ALLREDUCE)
    return _submit_reduction(
        RequestType.ALLREDUCE,
        tensors,
        outputs,
        name,
        reduce_op,
        process_set,
        prescale_factor,
        postscale_factor,
        grouped,
    )


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
    output = torch.empty_like(tensor)
    handle = _allreduce_submit(
        [tensor], [output], name, op, average, prescale_factor, postscale_factor, process_set, False
    )
    return _register(handle)


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
    handle = _allreduce_submit(
        [tensor], [tensor], name, op, average, prescale_factor, postscale_factor, process_set, False
    )
    return _register(handle)


class _AllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        average: Any,
        name: Any,
        op: Any,
        prescale: float,
        postscale: float,
        process_set: ProcessSet,
    ) -> torch.Tensor:
        ctx.args = (average, op, prescale, postscale, process_set)
        return cast(
            torch.Tensor,
            synchronize(
                allreduce_async(tensor, average, name, op, prescale, postscale, process_set)
            ),
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        average, op, prescale, postscale, process_set = ctx.args
        reduced = synchronize(
            allreduce_async(grad.contiguous(), average, None, op, prescale, postscale, process_set)
        )
        return reduced, None, None, None, None, None, None


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
    compressed, ctx = compression.compress(tensor)
    result = _AllreduceFunction.apply(
        compressed.contiguous(), average, name, op, prescale_factor, postscale_factor, process_set
    )
    return cast(torch.Tensor, compression.decompress(result, ctx))


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
    return cast(
        torch.Tensor,
        synchronize(
            allreduce_async_(
                tensor, average, name, op, prescale_factor, postscale_factor, process_set
            )
        ),
    )


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
    outputs = [torch.empty_like(t) for t in tensors]
    handle = _allreduce_submit(
        list(tensors),
        outputs,
        name,
        op,
        average,
        prescale_factor,
        postscale_factor,
        process_set,
        True,
    )
    return _register(handle)


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
    handle = _allreduce_submit(
        list(tensors),
        list(tensors),
        name,
        op,
        average,
        prescale_factor,
        postscale_factor,
        process_set,
        True,
    )
    return _register(handle)


class _GroupedAllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        average: Any,
        name: Any,
        op: Any,
        prescale: float,
        postscale: float,
        process_set: ProcessSet,
        *tensors: torch.Tensor,
    ) -> Any:
        ctx.args = (average, op, prescale, postscale, process_set)
        return tuple(
            synchronize(
                grouped_allreduce_async(
                    list(tensors), average, name, op, prescale, postscale, process_set
                )
            )
        )

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        average, op, prescale, postscale, process_set = ctx.args
        reduced = synchronize(
            grouped_allreduce_async(
                [g.contiguous() for g in grads], average, None, op, prescale, postscale, process_set
            )
        )
        return (None, None, None, None, None, None, *reduced)


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
    compressed = [compression.compress(t) for t in tensors]
    results = _GroupedAllreduceFunction.apply(
        average,
        name,
        op,
        prescale_factor,
        postscale_factor,
        process_set,
        *[c.contiguous() for c, _ in compressed],
    )
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(results, compressed)]


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
    return cast(
        list[torch.Tensor],
        synchronize(
            grouped_allreduce_async_(
                tensors, average, name, op, prescale_factor, postscale_factor, process_set
            )
        ),
    )


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str, op: Any, process_set: ProcessSet = global_process_set
) -> Any:
    """Reduce a sparse COO tensor by gathering indices and values; returns a callable.

    Calling the returned function waits and gives the reduced sparse tensor (duplicates are
    not coalesced, as in Horovod).
    """
    reduce_op = _resolve_op(op, None, RequestType.ALLREDUCE)
    if reduce_op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise HoraValueError("sparse_allreduce_async supports only hvd.Average and hvd.Sum.")
    tensor = tensor.coalesce() if not tensor.is_coalesced() else tensor
    indices = tensor._indices().t().contiguous()
    values = tensor._values().contiguous()
    h_indices = allgather_async(indices, name=f"{name}.indices", process_set=process_set)
    h_values = allgather_async(values, name=f"{name}.values", process_set=process_set)
    set_size = len(process_set.ranks) if process_set.process_set_id else basics.size()

    def finish() -> torch.Tensor:
        all_values = synchronize(h_values)
        all_indices = synchronize(h_indices)
        if reduce_op == ReduceOp.AVERAGE:
            all_values = all_values / set_size
        return torch.sparse_coo_tensor(all_indices.t(), all_values, size=tensor.size())

    return finish


# ---------------------------------------------------------------- allgather


def _check_not_scalar(tensors: Sequence[torch.Tensor]) -> None:
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.dim() == 0:
            raise HoraValueError(
                "Process-set rank zero tried to ALLGATHER a rank-zero tensor: allgather needs at "
                "least one dimension (use tensor.reshape(1))."
            )


def _allgather_submit(
    tensors: Sequence[torch.Tensor], name: str | None, process_set: ProcessSet, grouped: bool
) -> Handle:
    _check_not_scalar(tensors)
    prefix = "grouped_allgather" if grouped else "allgather"
    return _submit(
        RequestType.ALLGATHER,
        prefix,
        tensors,
        [None] * len(tensors),
        name,
        process_set,
        grouped=grouped,
    )


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Start gathering ``tensor`` from every rank, concatenated along dimension 0."""
    return _register(_allgather_submit([tensor], name, process_set, False))


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start gathering a list of tensors as one negotiated operation."""
    return _register(_allgather_submit(list(tensors), name, process_set, True))


def _own_rows(grad: torch.Tensor, rows: int, process_set: ProcessSet) -> torch.Tensor:
    sizes = synchronize(
        allgather_async(torch.tensor([rows], dtype=torch.int64), process_set=process_set)
    )
    engine = basics.engine()
    members = engine.process_sets.members(process_set.process_set_id or 0)
    me = members.index(engine.rank)
    offset = int(sizes[:me].sum())
    return grad.narrow(0, offset, rows)


class _AllgatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Any, process_set: ProcessSet) -> Any:
        _check_not_scalar([tensor])
        ctx.rows = tensor.shape[0]
        ctx.process_set = process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        reduced = synchronize(
            allreduce_async(grad.contiguous(), op=Average, process_set=ctx.process_set)
        )
        return _own_rows(reduced, ctx.rows, ctx.process_set), None, None


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0, in rank order.

    The first dimension may differ between ranks; the others must match. Differentiable.

    Example:
        >>> hvd.allgather(torch.full((hvd.rank() + 1, 2), hvd.rank()))
    """
    return cast(torch.Tensor, _AllgatherFunction.apply(tensor, name, process_set))


class _GroupedAllgatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: Any, process_set: ProcessSet, *tensors: torch.Tensor) -> Any:
        _check_not_scalar(tensors)
        ctx.rows = [t.shape[0] for t in tensors]
        ctx.process_set = process_set
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        reduced = synchronize(
            grouped_allreduce_async(
                [g.contiguous() for g in grads], op=Average, process_set=ctx.process_set
            )
        )
        return (None, None, *[_own_rows(g, n, ctx.process_set) for g, n in zip(reduced, ctx.rows)])


def grouped_allgather(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Allgather each tensor of a list, negotiated together."""
    return list(_GroupedAllgatherFunction.apply(name, process_set, *tensors))


# ---------------------------------------------------------------- broadcast


def _broadcast_submit(
    tensor: torch.Tensor,
    output: torch.Tensor,
    root_rank: int,
    name: str | None,
    process_set: ProcessSet,
) -> Handle:
    return _submit(
        RequestType.BROADCAST,
        "broadcast",
        [tensor],
        [output],
        name,
        process_set,
        root_rank=int(root_rank),
    )


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start copying ``root_rank``'s tensor to every rank (into a new tensor)."""
    output = torch.empty_like(tensor)
    return _register(_broadcast_submit(tensor, output, root_rank, name, process_set))


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start broadcasting into ``tensor`` in place."""
    return _register(_broadcast_submit(tensor, tensor, root_rank, name, process_set))


class _BroadcastFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, root_rank: int, name: Any, process_set: ProcessSet
    ) -> Any:
        ctx.root_rank = root_rank
        ctx.process_set = process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        reduced = synchronize(
            allreduce_async(grad.contiguous(), op=Average, process_set=ctx.process_set)
        )
        if basics.rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank. ``root_rank`` is a global rank.

    Example:
        >>> weights = hvd.broadcast(weights, root_rank=0)
    """
    return cast(torch.Tensor, _BroadcastFunction.apply(tensor, root_rank, name, process_set))


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Broadcast into ``tensor`` in place and return it."""
    return cast(torch.Tensor, synchronize(broadcast_async_(tensor, root_rank, name, process_set)))


# ---------------------------------------------------------------- alltoall


def _normalize_splits(tensor: torch.Tensor, splits: Any, set_size: int) -> tuple[int, ...] | None:
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
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start an alltoall; ``synchronize`` gives ``(output, received_splits)``."""
    _check_process_set(process_set, RequestType.ALLTOALL)
    set_size = len(basics.engine().process_sets.members(process_set.process_set_id or 0))
    values = _normalize_splits(tensor, splits, set_size)
    handle = _submit(
        RequestType.ALLTOALL, "alltoall", [tensor], [None], name, process_set, splits=values
    )
    return _register(handle)


class _AlltoallFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, splits: Any, name: Any, process_set: ProcessSet
    ) -> Any:
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received = received
        ctx.process_set = process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> Any:
        output, _ = synchronize(
            alltoall_async(grad.contiguous(), ctx.received, process_set=ctx.process_set)
        )
        return output, None, None, None


def alltoall(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Scatter slices of ``tensor`` to every rank and gather what they send back.

    Args:
        tensor: rows to send, grouped by destination.
        splits: rows for each rank (default: equal parts).

    Returns:
        The received tensor; ``(received, received_splits)`` when ``splits`` is given.
    """
    output, received = _AlltoallFunction.apply(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


# ---------------------------------------------------------------- reducescatter


def _reducescatter_submit(
    tensors: Sequence[torch.Tensor],
    name: str | None,
    op: Any,
    process_set: ProcessSet,
    prescale_factor: float,
    postscale_factor: float,
    grouped: bool,
) -> Handle:
    reduce_op = _resolve_op(op, None, RequestType.REDUCESCATTER)
    if reduce_op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise HoraValueError("Reducescatter currently only supports AVERAGE and SUM.")
    if any(isinstance(t, torch.Tensor) and t.dim() == 0 for t in tensors):
        raise HoraValueError("Reducescatter needs a tensor with at least one dimension.")
    return _submit_reduction(
        RequestType.REDUCESCATTER,
        tensors,
        [None] * len(tensors),
        name,
        reduce_op,
        process_set,
        prescale_factor,
        postscale_factor,
        grouped,
    )


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: Any = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Start a reducescatter: reduce across ranks, then give each rank its slice of dim 0."""
    return _register(
        _reducescatter_submit(
            [tensor], name, op, process_set, prescale_factor, postscale_factor, False
        )
    )


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: Any = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Start reducescatters of a list of tensors, negotiated together."""
    return _register(
        _reducescatter_submit(
            list(tensors), name, op, process_set, prescale_factor, postscale_factor, True
        )
    )


def _reducescatter_grad(
    grad: torch.Tensor, op: ReduceOp, prescale: float, postscale: float, process_set: ProcessSet
) -> torch.Tensor:
    set_size = len(basics.engine().process_sets.members(process_set.process_set_id or 0))
    factor = prescale * postscale * (set_size if op == ReduceOp.SUM else 1)
    return cast(
        torch.Tensor,
        synchronize(allgather_async((grad * factor).contiguous(), process_set=process_set)),
    )


class _ReducescatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        name: Any,
        op: Any,
        process_set: ProcessSet,
        prescale: float,
        postscale: float,
    ) -> Any:
        ctx.args = (
            _resolve_op(op, None, RequestType.REDUCESCATTER),
            prescale,
            postscale,
            process_set,
        )
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale, postscale))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return _reducescatter_grad(grad, *ctx.args), None, None, None, None, None


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
    compressed, ctx = compression.compress(tensor)
    result = _ReducescatterFunction.apply(
        compressed.contiguous(), name, op, process_set, prescale_factor, postscale_factor
    )
    return cast(torch.Tensor, compression.decompress(result, ctx))


class _GroupedReducescatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        name: Any,
        op: Any,
        process_set: ProcessSet,
        prescale: float,
        postscale: float,
        *tensors: torch.Tensor,
    ) -> Any:
        ctx.args = (
            _resolve_op(op, None, RequestType.REDUCESCATTER),
            prescale,
            postscale,
            process_set,
        )
        return tuple(
            synchronize(
                grouped_reducescatter_async(
                    list(tensors), name, op, process_set, prescale, postscale
                )
            )
        )

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        return (None, None, None, None, None, *[_reducescatter_grad(g, *ctx.args) for g in grads])


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
    compressed = [compression.compress(t) for t in tensors]
    results = _GroupedReducescatterFunction.apply(
        name,
        op,
        process_set,
        prescale_factor,
        postscale_factor,
        *[c.contiguous() for c, _ in compressed],
    )
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(results, compressed)]


# ---------------------------------------------------------------- synchronization


def poll(handle: int) -> bool:
    """Whether the operation behind ``handle`` has finished (never blocks)."""
    entry = _handles.get(handle)
    if entry is None:
        raise ValueError(f"Handle {handle} was not created or has been cleared.")
    # A steady-state batch done on the wire is only landed once someone asks for it: the
    # handle tells its engine.
    return entry[0].poll()


def synchronize(handle: int) -> Any:
    """Wait for the operation behind ``handle`` and return its output.

    Returns:
        A tensor; a list for grouped ops; ``(output, received_splits)`` for alltoall.

    Raises:
        HoraInternalError: the operation failed (mismatch between ranks, lost peer, shutdown).
    """
    entry = _handles.pop(handle, None)
    if entry is None:
        return None
    op_handle, post = entry
    if _holders and not op_handle.done():
        for holder in list(_holders):
            holder.release_held()
    try:
        results = op_handle.wait()
    except HoraInternalError:
        raise
    except RuntimeError as exc:
        raise HoraInternalError(str(exc)) from exc
    _caller_waits_for_engine_stream(results)
    if post is not None:
        return post(results)
    if op_handle.kind == RequestType.ALLTOALL:
        return results[0]
    if op_handle.grouped:
        return list(results)
    return results[0]


def join(device: int = -1) -> int:
    """Tell the other ranks this rank has no more data; wait until every rank has joined.

    Until then this rank keeps taking part in other ranks' allreduces with zeros. Returns the
    global rank that joined last (the same on every rank).
    """
    del device
    engine = basics.engine()
    handle = engine.handle(1, RequestType.JOIN)
    engine.enqueue(
        [
            Entry(
                Request(name="join.noname", kind=RequestType.JOIN, dtype="uint8"),
                None,
                None,
                handle,
            )
        ]
    )
    return int(handle.wait()[0])


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of ``process_set`` has called ``barrier``."""
    set_id = _check_process_set(process_set, RequestType.BARRIER)
    engine = basics.engine()
    handle = engine.handle(1, RequestType.BARRIER)
    engine.enqueue(
        [
            Entry(
                Request(
                    name=f"barrier.noname.{set_id}",
                    kind=RequestType.BARRIER,
                    dtype="uint8",
                    process_set_id=set_id,
                ),
                None,
                None,
                handle,
            )
        ]
    )
    handle.wait()


def _clear_handles() -> None:
    _handles.clear()
