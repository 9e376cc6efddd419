"""A small synchronous allreduce, run from the public call straight on its set's lane.

``hvd.allreduce(tensor)`` and ``hvd.allreduce_(tensor)`` of one CPU tensor whose data fits in a
lane's head (:data:`~hora.common.transport.shm_lane.HEAD_BYTES`) make the same call as the
general path of :func:`hora.common.ops.submission.submit` and
:func:`hora.common.ops.fast_path.run`: the same name, the same signature, the same number on
the lane, the same result bits. What they skip is what such a call does not need: autograd's
function, compression, the request's field dictionary, a handle and its registration. That
general machinery is most of a small call's cost once the call runs on the caller's thread.

:func:`allreduce` takes the call only when nothing about it needs the general path: a plain
CPU tensor that does not require a gradient, contiguous and of a dtype the engine takes; a
reduction the lane runs; a set with a lane; no timeline being written (a timeline shows each
call, which the general path records); an engine that takes calls. Otherwise it returns
``None`` before doing anything, and the call takes the general path, which raises the errors
of bad calls. Once the call has its number, every member decides its path together (see
:mod:`hora.common.transport.shm_lane`); a call the lane leaves to the engine is queued there
as the general path queues it, and waited for.
"""

from __future__ import annotations

import torch

from hora.common.engine.buffers import dtype_name
from hora.common.ops import fast_path, submission
from hora.common.process_sets import ProcessSet
from hora.common.runtime import runtime
from hora.common.transport import TransportError
from hora.common.transport.shm_lane import Lane, Signature
from hora.common.vocabulary.message import ReduceOp, RequestType

_KIND = RequestType.ALLREDUCE
# The reduction each ``op`` argument asks for (None: Average, Horovod's default); ops the lane
# lacks (Adasum) and anything else take the general path.
_OPS = {
    None: ReduceOp.AVERAGE,
    ReduceOp.AVERAGE: ReduceOp.AVERAGE,
    ReduceOp.SUM: ReduceOp.SUM,
    ReduceOp.MIN: ReduceOp.MIN,
    ReduceOp.MAX: ReduceOp.MAX,
    ReduceOp.PRODUCT: ReduceOp.PRODUCT,
}


def allreduce(
    tensor: torch.Tensor,
    in_place: bool,
    name: str | None,
    op: object,
    average: bool | None,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
) -> torch.Tensor | None:
    """The result of a synchronous allreduce of ``tensor`` (written into it when
    ``in_place``), or ``None`` when the call takes the general path (nothing done yet).

    Raises:
        HoraInternalError: a member was lost, or the wait timed out (the job fails as for a
            failed collective); or the engine's path, taken after the lane's decision, failed.
    """
    reduce_op = _reduction(tensor, op, average)
    current = runtime().session
    if reduce_op is None or current is None:
        return None
    engine = current.engine
    set_id = process_set.process_set_id
    if set_id is None or not engine.process_sets.contains(set_id):
        return None
    lane = engine.lane(set_id)
    if type(lane) is not Lane or engine.timeline is not None or not fast_path.accepting(engine):
        return None
    dtype = tensor.dtype
    nbytes = tensor.numel() * tensor.element_size()
    if not 0 < nbytes <= lane.room or not _takes(dtype, reduce_op):
        return None
    if in_place and tensor.is_inference() and not torch.is_inference_mode_enabled():
        return None  # only inference mode may write it: the general path enters it
    if name is None:
        base = f"allreduce.noname.{current.unnamed_call_number(set_id)}"
    else:
        base = f"allreduce.{name}"
    prescale, postscale = float(prescale_factor), float(postscale_factor)
    signature = sign(base, tensor, reduce_op, prescale, postscale)
    out = tensor if in_place else torch.empty_like(tensor)
    counters = engine.counters
    issued = counters.now()
    flat = tensor.view(-1)
    with lane.lock:
        try:
            ran = lane.sign(signature, flat, prescale)
            if ran:
                fast_path.reduce_signed(lane, flat, out.view(-1), reduce_op, prescale, postscale)
        except TransportError as exc:
            raise fast_path.failure(engine, lane, base, exc) from None
    if not ran:
        fields: submission.RequestFields = {
            "reduce_op": reduce_op,
            "prescale": prescale,
            "postscale": postscale,
        }
        handle = submission.to_engine(
            _KIND, base, [tensor], [out], set_id, False, False, True, fields
        )
        result: torch.Tensor = submission.wait(submission.register(handle))
        return result
    counters.collective(issued, counters.now(), nbytes, 1)
    return out


def sign(
    name: str, tensor: torch.Tensor, reduce_op: ReduceOp, prescale: float, postscale: float
) -> Signature:
    """The signature of an allreduce of ``tensor`` named ``name`` (in full): the one
    :func:`hora.common.ops.fast_path.header` gives the general path's call."""
    return fast_path.digest(
        _KIND,
        name,
        fast_path.tensor_text(tensor.dtype, tensor.shape),
        fast_path.reduction_text(reduce_op, prescale, postscale),
    )


def _reduction(tensor: torch.Tensor, op: object, average: bool | None) -> ReduceOp | None:
    """The reduction a call for the lane asks for; ``None`` when the call is not one."""
    if (
        type(tensor) is not torch.Tensor
        or average is not None
        or tensor.requires_grad
        or tensor.layout is not torch.strided
        or not tensor.is_cpu
        or not tensor.is_contiguous()
        or not (op is None or type(op) is ReduceOp)
    ):
        return None
    return _OPS.get(op)


def _takes(dtype: torch.dtype, reduce_op: ReduceOp) -> bool:
    """Whether the engine takes ``dtype`` with ``reduce_op`` (else the general path raises)."""
    if reduce_op == ReduceOp.AVERAGE and dtype == torch.bool:
        return False
    return dtype_name(dtype) is not None
