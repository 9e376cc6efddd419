"""hora's public collectives as ``torch.compile`` traces them, written with the operators of
:mod:`hora.torch.compiled_ops`. :mod:`hora.torch.ops` and :mod:`hora.torch.handle_ops` call these
instead of the eager forms while Dynamo traces (``torch.compiler.is_compiling()``), so that a
call becomes one node of the graph. Each takes its public form's arguments, positionally; one
function serves a collective and its grouped form (``grouped``: a list of tensors, one operator
call), and an in-place form is the functional one whose results are :func:`written` into its
tensors.

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

from hora.common.process_sets import ProcessSet
from hora.torch.compiled_ops import COMPRESSIONS, hora_op
from hora.torch.compression import compressed

# ---------------------------------------------------------------- the public forms, traced


def _op(op: Any) -> int | None:
    """A reduction as an operator takes it: the number of a ``ReduceOp`` (checked when the
    operator runs), or ``None`` for the default."""
    return None if op is None else int(op)


def _set_id(process_set: ProcessSet) -> int:
    set_id = process_set.process_set_id
    return -1 if set_id is None else set_id


def _reduced(
    kind: str,
    tensors: Sequence[torch.Tensor],
    grouped: bool,
    name: str | None,
    compression: Any,
    args: tuple[Any, ...],
) -> list[torch.Tensor]:
    """Operator ``kind`` (``grouped_kind`` when ``grouped``) on the tensors, with the compression
    named, for hora's compressors; a compressor of the user's is applied around the call, as in
    eager mode. ``args``: the operator's arguments between the name and the compression."""
    operator = hora_op(f"grouped_{kind}" if grouped else kind)

    def run(sent: list[torch.Tensor], how: str) -> list[torch.Tensor]:
        if grouped:
            return list(operator(sent, name, *args, how))
        return [operator(sent[0], name, *args, how)]

    for how, known in COMPRESSIONS.items():
        if compression is known:
            return run(list(tensors), how)
    return compressed(compression, tensors, lambda sent: run(sent, "none"))


def allreduce(
    tensors: Sequence[torch.Tensor],
    grouped: bool,
    average: bool | None,
    name: str | None,
    compression: Any,
    op: Any,
    scales: tuple[float, float],
    process_set: ProcessSet,
) -> list[torch.Tensor]:
    """``allreduce`` (one tensor) or ``grouped_allreduce``, traced."""
    args = (_op(op), average, float(scales[0]), float(scales[1]), _set_id(process_set))
    return _reduced("allreduce", tensors, grouped, name, compression, args)


def allgather(
    tensors: Sequence[torch.Tensor], grouped: bool, name: str | None, process_set: ProcessSet
) -> list[torch.Tensor]:
    """``allgather`` (one tensor) or ``grouped_allgather``, traced."""
    set_id = _set_id(process_set)
    if grouped:
        return list(hora_op("grouped_allgather")(list(tensors), name, set_id))
    return [hora_op("allgather")(tensors[0], name, set_id)]


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None, process_set: ProcessSet
) -> torch.Tensor:
    set_id = _set_id(process_set)
    return hora_op("broadcast")(tensor, int(root_rank), name, set_id)  # type: ignore[no-any-return]


def alltoall(tensor: torch.Tensor, splits: Any, name: str | None, process_set: ProcessSet) -> Any:
    sent = splits
    if splits is not None and not isinstance(splits, torch.Tensor):
        sent = torch.tensor([int(s) for s in splits], dtype=torch.int32)
    output, received = hora_op("alltoall")(tensor, sent, name, _set_id(process_set), None)
    return output if splits is None else (output, received)


def reducescatter(
    tensors: Sequence[torch.Tensor],
    grouped: bool,
    name: str | None,
    compression: Any,
    op: Any,
    process_set: ProcessSet,
    scales: tuple[float, float],
) -> list[torch.Tensor]:
    """``reducescatter`` (one tensor) or ``grouped_reducescatter``, traced."""
    args = (_op(op), float(scales[0]), float(scales[1]), _set_id(process_set))
    return _reduced("reducescatter", tensors, grouped, name, compression, args)


# ---------------------------------------------------------------- the forms with handles


def no_handle(form: str, functional: str) -> None:
    """Break the graph where a form with a handle is called, saying what to call instead: a
    graph cannot hold an integer handle (the call then runs eagerly)."""
    torch._dynamo.graph_break(
        msg=f"hora: hvd.{form} returns a handle, which a compiled graph cannot hold; inside "
        f"torch.compile, call hvd.{functional}(...), which is one operator of the graph"
    )


def written(tensors: Sequence[torch.Tensor], results: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """An in-place form (``allreduce_``, ...): the functional form's ``results`` copied into
    ``tensors``, which it returns."""
    with torch.no_grad():
        for tensor, result in zip(tensors, results):
            tensor.copy_(result)
    return list(tensors)
