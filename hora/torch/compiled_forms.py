"""hora's public collectives as ``torch.compile`` traces them: the same signatures, written with
the operators of :mod:`hora.torch.compiled_ops`. :mod:`hora.torch.ops` and
:mod:`hora.torch.handle_ops` call these instead of the eager forms while Dynamo traces
(``torch.compiler.is_compiling()``), so that a call becomes one node of the graph.

What differs from eager mode, by necessity:

* allgather's and alltoall's first dimension is known only when the call runs (it depends on
  the other ranks): in a graph it is a data-dependent size, which Dynamo keeps in the graph only
  with ``torch._dynamo.config.capture_dynamic_output_shape_ops = True`` (otherwise it breaks
  the graph there, saying so, and runs the call eagerly);
* a graph cannot hold an integer handle: a form with a handle (``allreduce_async``, ...) breaks
  the graph, with a message naming the functional form; an in-place form (``allreduce_``,
  ``grouped_allreduce_``, ``broadcast_``) is the functional operator, its result copied into its
  tensors;
* a compressor of the user's (not ``Compression.none``, ``.fp16`` or ``.bf16``) is traced
  around the operator, as PyTorch code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hora.common.process_sets import ProcessSet, global_process_set
from hora.common.vocabulary.message import ReduceOp
from hora.torch.compiled_ops import COMPRESSIONS, hora_op
from hora.torch.compression import Compression

# ---------------------------------------------------------------- the public forms, traced


def _op(op: Any) -> int | None:
    """A reduction as an operator takes it: the number of a ``ReduceOp`` (checked when the
    operator runs), or ``None`` for the default."""
    return None if op is None else int(op)


def _set_id(process_set: ProcessSet) -> int:
    set_id = process_set.process_set_id
    return -1 if set_id is None else set_id


def _compressed(compression: Any, tensors: Sequence[torch.Tensor], run: Any) -> list[torch.Tensor]:
    """``run(tensors, name)`` with the compression named, for hora's compressors; a compressor
    of the user's is applied around the call, as in eager mode."""
    for name, known in COMPRESSIONS.items():
        if compression is known:
            return list(run(list(tensors), name))
    sent = [compression.compress(t) for t in tensors]
    results = run([t.contiguous() for t, _ in sent], "none")
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(results, sent)]


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
    args = (_op(op), average, float(prescale_factor), float(postscale_factor), _set_id(process_set))
    (result,) = _compressed(
        compression, [tensor], lambda ts, how: [hora_op("allreduce")(ts[0], name, *args, how)]
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
    args = (_op(op), average, float(prescale_factor), float(postscale_factor), _set_id(process_set))
    return _compressed(
        compression, tensors, lambda ts, how: hora_op("grouped_allreduce")(ts, name, *args, how)
    )


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    set_id = _set_id(process_set)
    return hora_op("allgather")(tensor, name, set_id)  # type: ignore[no-any-return]


def grouped_allgather(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    set_id = _set_id(process_set)
    return list(hora_op("grouped_allgather")(list(tensors), name, set_id))


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    set_id = _set_id(process_set)
    return hora_op("broadcast")(tensor, int(root_rank), name, set_id)  # type: ignore[no-any-return]


def _exchange(
    tensor: torch.Tensor, splits: Any, name: str | None, process_set: ProcessSet
) -> tuple[torch.Tensor, torch.Tensor]:
    sent = splits
    if splits is not None and not isinstance(splits, torch.Tensor):
        sent = torch.tensor([int(s) for s in splits], dtype=torch.int32)
    output, received = hora_op("alltoall")(tensor, sent, name, _set_id(process_set), None)
    return output, received


def alltoall(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    output, received = _exchange(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = ReduceOp.AVERAGE,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    args = (_op(op), float(prescale_factor), float(postscale_factor), _set_id(process_set))
    (result,) = _compressed(
        compression, [tensor], lambda ts, how: [hora_op("reducescatter")(ts[0], name, *args, how)]
    )
    return result


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = ReduceOp.AVERAGE,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    args = (_op(op), float(prescale_factor), float(postscale_factor), _set_id(process_set))
    return _compressed(
        compression,
        tensors,
        lambda ts, how: hora_op("grouped_reducescatter")(ts, name, *args, how),
    )


# ---------------------------------------------------------------- the forms with handles


def no_handle(form: str, functional: str) -> None:
    """Break the graph where a form with a handle is called, saying what to call instead: a
    graph cannot hold an integer handle (the call then runs eagerly)."""
    torch._dynamo.graph_break(
        msg=f"hora: hvd.{form} returns a handle, which a compiled graph cannot hold; inside "
        f"torch.compile, call hvd.{functional}(...), which is one operator of the graph"
    )


def _written(tensors: Sequence[torch.Tensor], results: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for tensor, result in zip(tensors, results):
            tensor.copy_(result)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None,
    name: str | None,
    op: Any,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
) -> torch.Tensor:
    scales = (prescale_factor, postscale_factor)
    none = Compression.none
    _written([tensor], [allreduce(tensor, average, name, none, op, *scales, process_set)])
    return tensor


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None,
    name: str | None,
    op: Any,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
) -> list[torch.Tensor]:
    scales = (prescale_factor, postscale_factor)
    none = Compression.none
    _written(tensors, grouped_allreduce(tensors, average, name, none, op, *scales, process_set))
    return list(tensors)


def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str | None, process_set: ProcessSet
) -> torch.Tensor:
    _written([tensor], [broadcast(tensor, root_rank, name, process_set)])
    return tensor
