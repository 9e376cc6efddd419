"""The allreduce an optimizer submits for each gradient, again and again under one name:
:class:`RepeatedAllreduce` makes its checks and its request only when the tensor changes.
"""

from __future__ import annotations

import torch

from hora.common import basics
from hora.common.engine import Engine, Entry
from hora.common.ops import submission
from hora.common.process_sets import ProcessSet
from hora.common.vocabulary.message import ReduceOp, Request, RequestType


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
        self._name = f"{submission.op_prefix(RequestType.ALLREDUCE)}.{name}"
        self._lend = lend
        self._process_set = process_set
        self._fields = submission.reduction(
            RequestType.ALLREDUCE, [], op, process_set, prescale_factor, postscale_factor
        )
        self._request: Request | None = None
        self._engine: Engine | None = None
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
            set_id = submission.check_process_set(self._process_set, kind)
        if (
            request is None
            or engine is not self._engine
            or tensor.dtype is not self._dtype
            or request.process_set_id != set_id
            or request.shape != tensor.shape
            or request.device != submission.device_of(tensor)
            or not tensor.is_contiguous()
        ):
            submission.check_reduction(kind, [tensor], self._fields["reduce_op"], self._process_set)
            request = submission.describe(kind, self._name, tensor, set_id, None, self._fields)
            self._request, self._engine, self._dtype = request, engine, tensor.dtype
        if tensor.is_cuda:
            submission.engine_stream_waits_for_caller(tensor.device)
        handle = engine.handle(1, kind)
        engine.enqueue([Entry(request, tensor, tensor, handle, lend=self._lend)])
        return submission.register(handle)
