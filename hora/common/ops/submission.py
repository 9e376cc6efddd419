"""Submitting collectives to the engine: the part of every collective no framework changes.

A framework adapter (``hora.torch`` today) turns its tensors into torch tensors on the engine's
data plane (views where it can) and calls :func:`submit`: this module checks the process set,
the tensors and the reduction, names the call as every rank will name it, builds one
``Request`` per tensor and hands the entries to the engine atomically. The adapter gets an
integer handle back (:func:`register`) and waits with :func:`wait` or asks :func:`poll`.

What stays in an adapter: its own tensor type, autograd (or its framework's gradients),
compression, and its public signatures.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

import torch

from hora.common import basics
from hora.common.engine import Entry, Handle, adasum, dtype_name
from hora.common.ops import fast_path
from hora.common.process_sets import ProcessSet
from hora.common.runtime import GROUPED_CALLS_KEPT, GroupedEntry, HandleEntry, runtime, session
from hora.common.vocabulary.errors import HoraInternalError, HoraValueError
from hora.common.vocabulary.message import ReduceOp, Request, RequestType

if TYPE_CHECKING:
    from typing_extensions import Unpack

# What a call may name its reduction with: a ``ReduceOp`` (``hvd.Sum``), its number, or
# ``None`` for the default (see :func:`resolve_op`).
Op = ReduceOp | int | None


class RequestFields(TypedDict, total=False):
    """What a collective tells the engine besides its tensors (the rest of a
    :class:`~hora.common.vocabulary.message.Request`'s fields)."""

    reduce_op: ReduceOp
    prescale: float
    postscale: float
    root_rank: int
    splits: tuple[int, ...] | None


# ---------------------------------------------------------------- holders


class GradientHolder(Protocol):
    """Something that holds tensors back before submitting them (``DistributedOptimizer``
    holds a steady-state batch's small gradients until the batch is complete)."""

    def release_held(self) -> None:
        """Submit what this thread holds: it is about to wait for a result, which might be
        in a batch that also waits for what it holds."""


def hold(holder: GradientHolder) -> None:
    """Register ``holder`` while it holds tensors back: any wait for a result (:func:`wait`)
    first asks every registered holder to release what it holds."""
    runtime().holders.add(holder)


def stop_holding(holder: GradientHolder) -> None:
    runtime().holders.discard(holder)


def sharded_optimizer_number() -> int:
    """The number of a new sharded (ZeRO) optimizer among the process's, from 0 in the order
    they are made (the same on every rank): the names of its collectives."""
    return next(runtime().sharded_optimizers)


# ---------------------------------------------------------------- checks


def op_label(kind: RequestType) -> str:
    """How error messages name a collective: ``Allreduce``, ``Broadcast``, ..."""
    return kind.name.capitalize()


def check_process_set(process_set: ProcessSet, kind: RequestType) -> int:
    """The id of ``process_set``, which must be registered and include this rank."""
    engine = basics.engine()
    set_id = process_set.process_set_id
    if set_id is None or not engine.process_sets.contains(set_id):
        raise HoraValueError(
            f"{op_label(kind)}: {process_set} is not registered. Pass it to "
            "hvd.init(process_sets=[...]) or hvd.add_process_set(...) on every rank first."
        )
    if engine.rank not in engine.process_sets.members(set_id):
        raise HoraValueError(
            f"{op_label(kind)}: Rank {engine.rank} is not a member of the provided process set."
        )
    return set_id


def set_size(process_set: ProcessSet) -> int:
    """How many ranks ``process_set`` has (a registered set)."""
    return len(basics.engine().process_sets.members(process_set.process_set_id or 0))


def set_rank(process_set: ProcessSet) -> int:
    """This rank's place in ``process_set`` (a registered set that includes it)."""
    engine = basics.engine()
    return engine.process_sets.members(process_set.process_set_id or 0).index(engine.rank)


def resolve_op(op: Op, average: bool | None, kind: RequestType) -> ReduceOp:
    """The reduction a call asks for: ``op``, or the deprecated ``average``; Average by default."""
    if op is not None and average is not None:
        raise HoraValueError(
            "The op parameter supersedes average. Please provide only one of them."
        )
    if average is not None:
        warnings.warn(
            "Parameter `average` has been replaced with `op` and will be removed.",
            DeprecationWarning,
            stacklevel=4,
        )
        return ReduceOp.AVERAGE if average else ReduceOp.SUM
    if op is None:
        return ReduceOp.AVERAGE
    try:
        return ReduceOp(int(op))
    except (TypeError, ValueError):
        raise HoraValueError(
            f"{op_label(kind)}: unknown reduction op {op!r}; use hvd.Average, hvd.Sum, hvd.Min, "
            "hvd.Max or hvd.Product."
        ) from None


def handle_average_backwards_compatibility(op: Op, average: bool | None) -> int:
    """Horovod's helper for the deprecated ``average`` argument: the op a call should use.

    ``op`` wins when given alone (returned as it is); ``average=True`` or ``False`` gives
    ``Average`` or ``Sum`` (with a ``DeprecationWarning``); neither gives ``Average``.

    Raises:
        HoraValueError: both ``op`` and ``average`` were given (a ``ValueError``).

    Example:
        >>> hvd.mpi_ops.handle_average_backwards_compatibility(None, False) == hvd.Sum
        True
    """
    if op is not None and average is None:
        return op
    return resolve_op(op, average, RequestType.ALLREDUCE)


def check_reduction(
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
            f"{op_label(kind)}: Average is not defined for bool tensors; use op=hvd.Sum or "
            "hvd.Max (logical or) or hvd.Min or hvd.Product (logical and)."
        )


def check_adasum(
    kind: RequestType, tensors: Sequence[torch.Tensor], process_set: ProcessSet | None
) -> None:
    """Adasum's constraints, as Horovod states them (NotImplementedError is a RuntimeError)."""
    if kind != RequestType.ALLREDUCE:
        raise HoraValueError(
            f"{op_label(kind)} currently only supports AVERAGE and SUM; op=hvd.Adasum is for "
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


def _check_tensor(tensor: object, kind: RequestType) -> str:
    """The engine's name of the tensor's dtype, once the tensor is one the engine can take."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op_label(kind)} expects a torch.Tensor, got {type(tensor).__name__}.")
    if tensor.is_sparse:
        raise HoraValueError(
            f"{op_label(kind)} does not take sparse tensors; use sparse_allreduce_async or "
            "convert with tensor.to_dense()."
        )
    if not tensor.is_contiguous():
        raise HoraValueError("Tensor is required to be contiguous.")
    name = dtype_name(tensor.dtype)
    if name is None:
        raise HoraValueError(f"Tensor type {tensor.dtype} is not supported.")
    return name


# ---------------------------------------------------------------- requests


_PREFIXES = {kind: kind.name.lower() for kind in RequestType}


def op_prefix(kind: RequestType) -> str:
    """How the names of ``kind``'s calls start (``allreduce``, ``broadcast``, ...)."""
    return _PREFIXES[kind]


def device_of(tensor: torch.Tensor) -> str:
    return "cpu" if tensor.is_cpu else tensor.device.type


def describe(
    kind: RequestType,
    name: str,
    tensor: torch.Tensor,
    set_id: int,
    group: tuple[str, int] | None,
    fields: RequestFields,
) -> Request:
    """Check one tensor and describe it to the engine."""
    dtype = _check_tensor(tensor, kind)
    return Request(
        name=name,
        kind=kind,
        dtype=dtype,
        shape=tuple(tensor.shape),
        process_set_id=set_id,
        device=device_of(tensor),
        group=group,
        **fields,
    )


def submit(
    kind: RequestType,
    tensors: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor | None],
    name: str | None,
    process_set: ProcessSet,
    grouped: bool = False,
    synchronous: bool = False,
    **fields: Unpack[RequestFields],
) -> Handle:
    """Build one entry per tensor and hand them to the engine atomically; or, for a
    ``synchronous`` call on a set with a lane, run it on this thread if every member makes the
    same call (:mod:`hora.common.ops.fast_path`; the handle is then done).

    The call is named ``<kind>.<name>`` (``grouped_<kind>.<name>_<i>of<n>`` for each tensor of
    a grouped call), or ``<kind>.noname.<n>`` without a name, for the process set's n-th unnamed
    call (see :class:`_UnnamedCalls`): every rank derives the same names, which is how the
    engine matches calls across ranks. ``outputs`` holds, per tensor, where its result goes (the
    tensor itself, in place; ``None``: a new tensor).
    """
    set_id = check_process_set(process_set, kind)
    current = session()
    engine = current.engine
    prefix = f"grouped_{_PREFIXES[kind]}" if grouped else _PREFIXES[kind]
    if name is None:
        base = f"{prefix}.noname.{current.unnamed_call_number(set_id)}"
    else:
        base = f"{prefix}.{name}"
    lane = engine.lane(set_id) if synchronous else None
    if lane is not None:
        for tensor in tensors:
            _check_tensor(tensor, kind)
        done = fast_path.run(engine, lane, kind, base, tensors, outputs, grouped, fields, set_id)
        if done is not None:
            return done
    named = grouped and name is not None
    return to_engine(kind, base, tensors, outputs, set_id, grouped, named, lane is not None, fields)


def to_engine(
    kind: RequestType,
    base: str,
    tensors: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor | None],
    set_id: int,
    grouped: bool,
    named: bool,
    posted: bool,
    fields: RequestFields,
    handle: Handle | None = None,
) -> Handle:
    """Hand a call named ``base`` to the engine; ``posted`` when its number was taken on the
    set's lane (which decided it goes to the engine). ``named``: a grouped call the caller
    named, whose requests the session keeps. The result goes to ``handle`` (by default a new
    one)."""
    current = session()
    engine = current.engine
    if handle is None:
        handle = engine.handle(len(tensors), kind, grouped)
    if named:
        requests = _grouped_requests(current.grouped_calls, kind, base, tensors, set_id, fields)
    else:
        requests = _describe_all(kind, base, tensors, set_id, grouped, fields)
    for tensor in tensors:
        if tensor.is_cuda:
            engine_stream_waits_for_caller(tensor.device)
    entries = [
        Entry(request, tensor, output, handle, index)
        for index, (request, tensor, output) in enumerate(zip(requests, tensors, outputs))
    ]
    engine.enqueue(entries, posted=posted)
    return handle


def _describe_all(
    kind: RequestType,
    base: str,
    tensors: Sequence[torch.Tensor],
    set_id: int,
    grouped: bool,
    fields: RequestFields,
) -> list[Request]:
    """Check and describe each tensor of a call named ``base``."""
    count = len(tensors)
    group = (base, count) if grouped else None
    requests = [
        describe(
            kind, f"{base}_{index + 1}of{count}" if grouped else base, t, set_id, group, fields
        )
        for index, t in enumerate(tensors)
    ]
    if grouped and len({t.device for t in tensors}) > 1:
        raise HoraValueError("Tensors in list must be on same device.")
    return requests


def _grouped_requests(
    known_calls: dict[tuple[object, ...], GroupedEntry],
    kind: RequestType,
    base: str,
    tensors: Sequence[torch.Tensor],
    set_id: int,
    fields: RequestFields,
) -> list[Request]:
    """The requests of a named grouped call, reused from ``known_calls`` (the session's) while
    the tensors stay alike.

    A training loop makes the same grouped call every step (``DistributedOptimizer(groups=)``,
    or a user's ``grouped_allreduce`` of a model's gradients): checking and describing each of
    its tensors again cost about as much as the collective itself for many small tensors.
    A call is recognised by its name, process set and fields, and each tensor's dtype, shape,
    device, layout and contiguity, which are everything its checks and requests depend on.
    """
    signature = tuple(
        (t.dtype, t.shape, t.device, t.layout, t.is_contiguous())
        if isinstance(t, torch.Tensor)
        else None
        for t in tensors
    )
    try:
        key = (kind, base, set_id, tuple(sorted(fields.items())))
        known = known_calls.get(key)
    except TypeError:  # a field that cannot be a key: describe every time
        known = key = None
    if known is not None and known[0] == signature:
        return known[1]
    requests = _describe_all(kind, base, tensors, set_id, True, fields)
    if key is not None:
        if len(known_calls) >= GROUPED_CALLS_KEPT and key not in known_calls:
            del known_calls[next(iter(known_calls))]
        known_calls[key] = (signature, requests)
    return requests


def reduction(
    kind: RequestType,
    tensors: Sequence[torch.Tensor],
    reduce_op: ReduceOp,
    process_set: ProcessSet,
    prescale_factor: float,
    postscale_factor: float,
) -> RequestFields:
    """A reduction's fields for :func:`submit` (allreduce, reducescatter), checked against every
    tensor's dtype."""
    check_reduction(kind, tensors, reduce_op, process_set)
    return {
        "reduce_op": reduce_op,
        "prescale": float(prescale_factor),
        "postscale": float(postscale_factor),
    }


# ---------------------------------------------------------------- handles

# The integer handles callers hold are the session's (hora.common.runtime.Session.handles): the
# engine's handle and what turns its results into the call's result (None: the usual shapes,
# see wait()). A new session starts with none, so a handle of an earlier one is unknown.


def _handles() -> dict[int, HandleEntry]:
    current = runtime().session
    return current.handles if current is not None else {}


def register(handle: Handle, post: Callable[[list[Any]], Any] | None = None) -> int:
    """The integer handle a caller keeps for ``handle`` (Horovod's handles are integers)."""
    current = session()
    handles = current.handles
    # A handle made while no other is held, waited for before the next one (see wait()).
    current.engine.lone_handle = 0 if handles else handle.id
    handles[handle.id] = (handle, post)
    return handle.id


def poll(handle: int) -> bool:
    """Whether the operation behind ``handle`` has finished (never blocks)."""
    entry = _handles().get(handle)
    if entry is None:
        raise ValueError(f"Handle {handle} was not created or has been cleared.")
    # A steady-state batch done on the wire is only landed once someone asks for it: the
    # handle tells its engine.
    return bool(entry[0].poll())


def wait(handle: int) -> Any:
    """Wait for the operation behind ``handle`` and return its result (``None`` for a handle
    that was already waited for): a tensor, a list for grouped calls, ``(output,
    received_splits)`` for alltoall.

    Raises:
        HoraInternalError: the operation failed (mismatch between ranks, lost peer, shutdown).
    """
    current = runtime().session
    entry = None if current is None else current.handles.pop(handle, None)
    if entry is None or current is None:
        return None
    # Waiting for the only call it holds, made with no other held, this process waits for its
    # calls one by one: its next asynchronous calls may be signed ahead on a lane
    # (hora.common.ops.direct). One that started several first gets the engine's batches.
    engine = current.engine
    engine.signs_ahead = handle == engine.lone_handle == engine.handles_made
    op_handle, post = entry
    holders = runtime().holders
    if holders and not op_handle.done():
        for holder in list(holders):
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
    if op_handle.kind == RequestType.ALLTOALL or not op_handle.grouped:
        return results[0]
    return list(results)


# ---------------------------------------------------------------- calls without tensors


def _signal(kind: RequestType, name: str, set_id: int, posted: bool = False) -> Handle:
    """Queue a call that carries no tensor (join, barrier)."""
    engine = basics.engine()
    handle = engine.handle(1, kind)
    request = Request(name=name, kind=kind, dtype="uint8", process_set_id=set_id)
    engine.enqueue([Entry(request, None, None, handle)], posted=posted)
    return handle


def join() -> int:
    """Join; returns the global rank that joined last (see ``hvd.join``). On sets with a lane
    the others' calls go to the engine meanwhile, where a joined rank takes part; once every
    rank joined, the lanes' numbers restart together (:mod:`hora.common.ops.fast_path`)."""
    lanes = basics.engine().lanes()
    fast_path.join(lanes)
    try:
        return int(_signal(RequestType.JOIN, "join.noname", 0).wait()[0])
    finally:
        fast_path.rejoin(lanes)


def barrier(process_set: ProcessSet) -> None:
    """Block until every rank of ``process_set`` has called ``barrier``."""
    set_id = check_process_set(process_set, RequestType.BARRIER)
    name = f"barrier.noname.{set_id}"
    engine = basics.engine()
    lane = engine.lane(set_id)
    if lane is not None:
        kind = RequestType.BARRIER
        if fast_path.run(engine, lane, kind, name, [], [], False, {}, set_id) is not None:
            return
    _signal(RequestType.BARRIER, name, set_id, posted=lane is not None).wait()


# ---------------------------------------------------------------- CUDA streams


def engine_stream_waits_for_caller(device: torch.device) -> None:
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


def _caller_waits_for_engine_stream(results: Sequence[object]) -> None:
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
