"""hora's collectives as PyTorch custom operators, so that ``torch.compile`` puts them in a graph.

Dynamo cannot trace the engine (locks, threads, integer handles), but it can record a call of a
custom operator: a functional one (new tensors out, its inputs untouched) with a fake kernel,
which says what comes out without communicating, and an autograd formula. Each operator here
(``torch.ops.hora.allreduce``, ...) submits through the same path as the eager call
(:mod:`hora.common.ops.collectives`) and waits: its calls are named, negotiated and checked as
eager calls are, and a mismatch between ranks raises the same error, where the operator runs.

Every operator has an ordered effect: ``torch.compile`` keeps each call, even one whose result
is unused, and keeps them in the order the program made them (every rank must submit its
collectives in the same order). An unnamed call is numbered when it runs, per process set, as an
eager one is.

:mod:`hora.torch.compiled_forms` writes the public functions with them; :mod:`hora.torch.ops` and
:mod:`hora.torch.handle_ops` call those instead of the eager forms while Dynamo traces.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from typing import Any

import torch

from hora.common import api
from hora.common.ops import collectives, submission
from hora.common.process_sets import ProcessSet, global_process_set
from hora.common.vocabulary.errors import HoraInternalError, HoraValueError
from hora.common.vocabulary.message import ReduceOp, RequestType
from hora.torch.compression import Compression, compressed

try:
    from torch._library.effects import EffectType
except ImportError:  # a PyTorch without ordered effects for custom operators
    EffectType = None  # type: ignore[assignment,misc]


def _available() -> bool:
    """Whether this PyTorch has what the operators need: custom operators with autograd
    formulas and ordered effects."""
    return EffectType is not None and hasattr(torch.library, "register_autograd")


# Without the operators, hora's calls stay opaque to Dynamo and break the graph.
AVAILABLE = _available()
# The effect every operator of hora's has: calls stay, in the order the program made them.
ORDERED = EffectType.ORDERED if AVAILABLE else None

# The compressions an operator takes by name; any other compressor is applied around it.
COMPRESSIONS = {"none": Compression.none, "fp16": Compression.fp16, "bf16": Compression.bf16}

SCHEMAS = {
    # op and average as the call gave them (op: the number of a ReduceOp); the operator
    # resolves them when it runs, as an eager call does.
    "allreduce": "(Tensor tensor, str? name, int? op, bool? average, float prescale, "
    "float postscale, int process_set, str compression) -> Tensor",
    "grouped_allreduce": "(Tensor[] tensors, str? name, int? op, bool? average, float prescale, "
    "float postscale, int process_set, str compression) -> Tensor[]",
    # How many rows come back depends on the other ranks: a data-dependent size.
    "allgather": "(Tensor tensor, str? name, int process_set) -> Tensor",
    "grouped_allgather": "(Tensor[] tensors, str? name, int process_set) -> Tensor[]",
    "broadcast": "(Tensor tensor, int root_rank, str? name, int process_set) -> Tensor",
    # rows: how many rows this rank receives, when known before the call runs (the gradient's
    # way back); else a data-dependent size. A list of the tensor received and the splits received (a tuple with a data-dependent size is lost in
    # Inductor when the operator has an effect).
    "alltoall": "(Tensor tensor, Tensor? splits, str? name, int process_set, SymInt? rows) "
    "-> Tensor[]",
    "reducescatter": "(Tensor tensor, str? name, int? op, float prescale, float postscale, "
    "int process_set, str compression) -> Tensor",
    "grouped_reducescatter": "(Tensor[] tensors, str? name, int? op, float prescale, "
    "float postscale, int process_set, str compression) -> Tensor[]",
    # The gradients of allgather and reducescatter: rows this rank gave, or gets back.
    "allgather_backward": "(Tensor[] grads, SymInt[] rows, int process_set, bool grouped) "
    "-> Tensor[]",
    "reducescatter_backward": "(Tensor[] grads, float factor, SymInt[] rows, int process_set, "
    "str compression) -> Tensor[]",
}


def is_tracing() -> bool:
    """Never: the stand-in for ``torch.compiler.is_compiling`` where the operators are missing."""
    return False


# What hora.torch's public functions ask before taking their traced form.
tracing = torch.compiler.is_compiling if AVAILABLE else is_tracing


# ---------------------------------------------------------------- what the operators run


def _process_set(set_id: int) -> ProcessSet:
    """The process set an operator names by id (-1: one that was not registered)."""
    if set_id == 0:
        return global_process_set
    process_set = ProcessSet([])
    process_set.process_set_id = set_id if set_id >= 0 else None
    return process_set


def _own(results: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The results as an operator gives them: each in memory of its own, none sharing it with
    an input, and starting where its memory starts (Inductor takes an operator's outputs to be
    aligned as fresh tensors are, not views into a larger one)."""
    taken = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    return [
        r.clone()
        if r.numel() and (r.storage_offset() or r.untyped_storage().data_ptr() in taken)
        else r
        for r in results
    ]


def _reduce(
    kind: RequestType,
    tensors: torch.Tensor | list[torch.Tensor],
    name: str | None,
    ops: tuple[int | None, bool | None],
    prescale: float,
    postscale: float,
    set_id: int,
    compression: str,
) -> Any:
    """An allreduce or reducescatter as the eager call runs it: compressed, contiguous. A list
    of tensors is the grouped operator's call, and gives a list."""
    grouped = isinstance(tensors, list)
    inputs = tensors if isinstance(tensors, list) else [tensors]
    process_set = _process_set(set_id)
    op, average = ops
    scales = (prescale, postscale)

    def reduce(wire: list[torch.Tensor]) -> list[torch.Tensor]:
        if kind == RequestType.ALLREDUCE:
            handle = collectives.allreduce_async(
                wire, False, name, op, average, *scales, process_set, grouped
            )
        else:
            handle = collectives.reducescatter_async(wire, name, op, process_set, *scales, grouped)
        return collectives.results(handle, grouped)

    mine = _own(compressed(COMPRESSIONS[compression], inputs, reduce), inputs)
    return mine if grouped else mine[0]


# What operators allreduce and grouped_allreduce (reducescatter and grouped_reducescatter) run:
# their schema's arguments, the rest as _reduce takes them.


def _allreduce(
    tensors: Any, name: str | None, op: int | None, average: bool | None, *rest: Any
) -> Any:
    return _reduce(RequestType.ALLREDUCE, tensors, name, (op, average), *rest)


def _reducescatter(tensors: Any, name: str | None, op: int | None, *rest: Any) -> Any:
    return _reduce(RequestType.REDUCESCATTER, tensors, name, (op, None), *rest)


def _check_rows(kind: str, got: int, expected: int | None) -> None:
    """The rows a graph was compiled for (an alltoall's gradient goes back with the splits of the
    forward call): anything else would be read out of bounds."""
    if expected is not None and got != expected:
        raise HoraInternalError(
            f"hora: {kind} received {got} rows in a compiled graph that expects {expected}; "
            "please report this."
        )


def _gather(
    tensors: Sequence[torch.Tensor], name: str | None, set_id: int, grouped: bool
) -> list[torch.Tensor]:
    handle = collectives.allgather_async(tensors, name, _process_set(set_id), grouped)
    return _own(collectives.results(handle, grouped), tensors)


def _allgather(tensor: torch.Tensor, name: str | None, set_id: int) -> torch.Tensor:
    return _gather([tensor], name, set_id, False)[0]


def _grouped_allgather(
    tensors: list[torch.Tensor], name: str | None, set_id: int
) -> list[torch.Tensor]:
    return _gather(tensors, name, set_id, True)


def _broadcast(tensor: torch.Tensor, root_rank: int, name: str | None, set_id: int) -> torch.Tensor:
    process_set = _process_set(set_id)
    handle = collectives.broadcast_async(tensor, root_rank, name, process_set, in_place=False)
    return _own([collectives.synchronize(handle)], [tensor])[0]


def _alltoall(
    tensor: torch.Tensor,
    splits: torch.Tensor | None,
    name: str | None,
    set_id: int,
    rows: int | None,
) -> list[torch.Tensor]:
    handle = collectives.alltoall_async(tensor, splits, name, _process_set(set_id))
    output, received = collectives.synchronize(handle)
    _check_rows("alltoall", output.shape[0], rows)
    return [_own([output], [tensor])[0], received]


def _allgather_backward(
    grads: list[torch.Tensor], rows: list[int], set_id: int, grouped: bool
) -> list[torch.Tensor]:
    """As eager: the gradients averaged over the ranks, each rank keeping the rows it gave."""
    process_set = _process_set(set_id)
    average = ReduceOp.AVERAGE
    handle = collectives.allreduce_async(
        grads, False, None, average, None, 1.0, 1.0, process_set, grouped
    )
    reduced = collectives.results(handle, grouped)
    mine = [
        g.narrow(0, collectives.own_rows_offset(n, process_set), n) for g, n in zip(reduced, rows)
    ]
    return _own(mine, grads)


def _reducescatter_backward(
    grads: list[torch.Tensor], factor: float, rows: list[int], set_id: int, compression: str
) -> list[torch.Tensor]:
    """As eager: each gradient scaled as the forward call was and gathered back, in turn."""
    compressor = COMPRESSIONS[compression]
    process_set = _process_set(set_id)
    results = []
    for grad in grads:
        sent, ctx = compressor.compress(grad)
        handle = collectives.allgather_async(
            [(sent * factor).contiguous()], None, process_set, False
        )
        results.append(compressor.decompress(collectives.synchronize(handle), ctx))
    return _own(results, grads)


# ---------------------------------------------------------------- what they give back when traced


def _set_size_and_rank(set_id: int) -> tuple[int, int]:
    """The set's size and this rank's place in it; (1, 0) for a set this rank cannot use (the
    operator raises the eager error when it runs)."""
    process_set = _process_set(set_id)
    try:
        return submission.set_size(process_set), submission.set_rank(process_set)
    except (ValueError, AttributeError):
        return 1, 0


def _like(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.new_empty(t.shape) for t in tensors]


def _received(tensor: torch.Tensor, rows: Any) -> torch.Tensor:
    """Rows received from other ranks: ``rows``, or a size known only when the call runs."""
    if rows is None:
        rows = torch.library.get_ctx().new_dynamic_size()
    return tensor.new_empty((rows, *tensor.shape[1:]))


def _gathered(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank's rows: a data-dependent number."""
    return [_received(t, None) for t in tensors]


def _scattered(tensors: Sequence[torch.Tensor], set_id: int) -> list[torch.Tensor]:
    """This rank's rows of dimension 0: the first ``rows % size`` ranks get one more."""
    size, rank = _set_size_and_rank(set_id)
    return [
        t.new_empty(((t.shape[0] + size - 1 - rank) // size, *t.shape[1:]))
        if t.dim()
        else t.new_empty(())
        for t in tensors
    ]


def _fake(name: str) -> Any:
    """The fake kernel of operator ``name``."""
    fakes: dict[str, Any] = {
        "allreduce": lambda t, *rest: _like([t])[0],
        "grouped_allreduce": lambda ts, *rest: _like(ts),
        "allgather": lambda t, name, set_id: _gathered([t])[0],
        "grouped_allgather": lambda ts, name, set_id: _gathered(ts),
        "broadcast": lambda t, *rest: _like([t])[0],
        "alltoall": lambda t, splits, name, set_id, rows: [
            _received(t, rows),
            torch.empty((_set_size_and_rank(set_id)[0],), dtype=torch.int32),
        ],
        "reducescatter": lambda t, n, o, a, b, set_id, c: _scattered([t], set_id)[0],
        "grouped_reducescatter": lambda ts, n, o, a, b, set_id, c: _scattered(ts, set_id),
        "allgather_backward": lambda gs, rows, *rest: [
            g.new_empty((n, *g.shape[1:])) for g, n in zip(gs, rows)
        ],
        "reducescatter_backward": lambda gs, factor, rows, *rest: [
            g.new_empty((n, *g.shape[1:])) for g, n in zip(gs, rows)
        ],
    }
    return fakes[name]


# ---------------------------------------------------------------- autograd formulas


def _save_inputs(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    first = inputs[0]
    outputs = list(output) if isinstance(output, (list, tuple)) else [output]
    ctx.inputs = inputs
    ctx.rows = [t.shape[0] for t in (first if isinstance(first, (list, tuple)) else [first])]
    ctx.outputs = [(o.shape, o.dtype, o.device) for o in outputs]


def _save_alltoall(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    _save_inputs(ctx, inputs, output[:1])
    ctx.save_for_backward(output[1])  # the splits each rank received


def _grads(ctx: Any, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """The gradients, contiguous; zeros for an output that got none (as autograd gives eager
    calls)."""
    return [
        torch.zeros(shape, dtype=dtype, device=device) if g is None else g.contiguous()
        for g, (shape, dtype, device) in zip(grads, ctx.outputs)
    ]


def _rest(ctx: Any) -> tuple[None, ...]:
    return (None,) * (len(ctx.inputs) - 1)


def _allreduce_grad(ctx: Any, grad: torch.Tensor | None) -> tuple[Any, ...]:
    """The gradient is reduced the same way (unnamed), compressed as the call was."""
    (grad,) = _grads(ctx, [grad])
    reduced = hora_op("allreduce")(grad, None, *ctx.inputs[2:])
    return (reduced, *_rest(ctx))


def _grouped_allreduce_grad(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[Any, ...]:
    reduced = hora_op("grouped_allreduce")(_grads(ctx, grads), None, *ctx.inputs[2:])
    return (reduced, *_rest(ctx))


def _gathered_grads(ctx: Any, grads: Sequence[torch.Tensor | None], grouped: bool) -> Any:
    set_id = ctx.inputs[2]
    return hora_op("allgather_backward")(_grads(ctx, grads), ctx.rows, set_id, grouped)


def _allgather_grad(ctx: Any, grad: torch.Tensor | None) -> tuple[Any, ...]:
    return (_gathered_grads(ctx, [grad], False)[0], *_rest(ctx))


def _grouped_allgather_grad(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[Any, ...]:
    return (_gathered_grads(ctx, grads, True), *_rest(ctx))


def _broadcast_grad(ctx: Any, grad: torch.Tensor | None) -> tuple[Any, ...]:
    """The root gets the average of every rank's gradient, the others zeros (as eager)."""
    _, root_rank, _, set_id = ctx.inputs
    (grad,) = _grads(ctx, [grad])
    average = int(ReduceOp.AVERAGE)
    reduced = hora_op("allreduce")(grad, None, average, None, 1.0, 1.0, set_id, "none")
    return (reduced if api.rank() == root_rank else reduced * 0, *_rest(ctx))


def _alltoall_grad(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[Any, ...]:
    """The gradient goes back with the splits each rank received."""
    (received,) = ctx.saved_tensors
    (grad,) = _grads(ctx, grads[:1])
    output, _ = hora_op("alltoall")(grad, received, None, ctx.inputs[3], ctx.rows[0])
    return (output, *_rest(ctx))


def _scattered_grads(ctx: Any, grads: Sequence[torch.Tensor | None]) -> Any:
    """Each gradient scaled as the call was and gathered back, compressed as it was."""
    _, _, op, prescale, postscale, set_id, compression = ctx.inputs
    size = _set_size_and_rank(set_id)[0]
    try:
        factor = collectives.reducescatter_gradient_factor(op, prescale, postscale, size)
    except HoraValueError:  # an op it cannot do: the forward call raises when it runs
        factor = 1.0
    return hora_op("reducescatter_backward")(
        _grads(ctx, grads), factor, ctx.rows, set_id, compression
    )


def _reducescatter_grad(ctx: Any, grad: torch.Tensor | None) -> tuple[Any, ...]:
    return (_scattered_grads(ctx, [grad])[0], *_rest(ctx))


def _grouped_reducescatter_grad(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[Any, ...]:
    return (_scattered_grads(ctx, grads), *_rest(ctx))


# ---------------------------------------------------------------- the operators


IMPLEMENTATIONS: dict[str, tuple[Any, Any]] = {
    "allreduce": (_allreduce, _allreduce_grad),
    "grouped_allreduce": (_allreduce, _grouped_allreduce_grad),
    "allgather": (_allgather, _allgather_grad),
    "grouped_allgather": (_grouped_allgather, _grouped_allgather_grad),
    "broadcast": (_broadcast, _broadcast_grad),
    "alltoall": (_alltoall, _alltoall_grad),
    "reducescatter": (_reducescatter, _reducescatter_grad),
    "grouped_reducescatter": (_reducescatter, _grouped_reducescatter_grad),
    "allgather_backward": (_allgather_backward, None),
    "reducescatter_backward": (_reducescatter_backward, None),
}


def define_operators() -> None:
    """Register every operator of the ``hora`` namespace with PyTorch (once, at import)."""
    for name, (implementation, gradient) in IMPLEMENTATIONS.items():
        operator = torch.library.custom_op(
            f"hora::{name}", implementation, mutates_args=(), schema=SCHEMAS[name]
        )
        operator.register_fake(_fake(name))
        if gradient is not None:
            save = _save_alltoall if name == "alltoall" else _save_inputs
            operator.register_autograd(gradient, setup_context=save)
        operator.register_effect(ORDERED)


def hora_op(name: str) -> Any:
    """The operator ``hora::name`` (its default overload)."""
    meet_dynamo()
    return getattr(torch.ops.hora, name).default


def meet_dynamo() -> bool:
    """Tell Dynamo, once it traces hora, never to trace the engine's machinery (threads, locks,
    shared memory, the job's store): no graph can hold it, and Dynamo would otherwise try to
    compile each of its functions that runs while a compiled function runs eagerly (after a
    graph break). Dynamo calls this function for real while it traces (see below); returns
    ``True``."""
    from torch._dynamo import trace_rules

    for package in UNTRACED:
        spec = importlib.util.find_spec(package)
        where = os.path.dirname(spec.origin) if spec and spec.origin else None
        if where and not any(d.rstrip("/") == where for d in trace_rules.SKIP_DIRS):
            trace_rules.add(package)
    return True


# What torch._dynamo.assume_constant_result marks (without importing Dynamo here): Dynamo calls
# the function while it traces and takes its result as a constant.
meet_dynamo._dynamo_marked_constant = True  # type: ignore[attr-defined]

# The packages of hora that Dynamo never traces.
UNTRACED = (
    "hora.common.engine",
    "hora.common.transport",
    "hora.common.job",
    "hora.common.metrics",
)


if AVAILABLE:
    define_operators()
