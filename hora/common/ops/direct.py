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

``hvd.allreduce_async`` and ``hvd.allreduce_async_`` of such a tensor sign the call *ahead*
(:meth:`~hora.common.transport.shm_lane.Lane.sign_ahead`): its signature and data go on the
lane at once, and the decision is taken later (see :class:`_Ahead`). Waited for at once, such a
call costs what the synchronous one costs, instead of a round through the engine's thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hora.common.engine import Engine, Handle
from hora.common.engine.buffers import dtype_name
from hora.common.ops import fast_path, submission
from hora.common.process_sets import ProcessSet
from hora.common.runtime import runtime
from hora.common.transport import TransportError
from hora.common.transport.shm_lane import FORCE, LOOK, PEEK, SETTLE, WAIT, Lane, Signature
from hora.common.vocabulary.errors import HoraInternalError
from hora.common.vocabulary.message import ReduceOp, RequestType, make_key

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


@dataclass(slots=True)
class _Call:
    """One small allreduce bound for the lane, as every member will sign it."""

    engine: Engine
    lane: Lane
    set_id: int
    name: str
    reduce_op: ReduceOp
    prescale: float
    postscale: float
    tensor: torch.Tensor
    out: torch.Tensor
    signature: Signature
    nbytes: int
    issued: float

    @property
    def flat(self) -> torch.Tensor:
        return self.tensor.view(-1)

    def reduce(self) -> None:
        """The data phase, once every member signed alike (under the lane's lock)."""
        fast_path.reduce_signed(
            self.lane, self.flat, self.out.view(-1), self.reduce_op, self.prescale, self.postscale
        )
        counters = self.engine.counters
        counters.collective(self.issued, counters.now(), self.nbytes, 1)

    def failure(self, exc: TransportError) -> HoraInternalError:
        return fast_path.failure(self.engine, self.lane, self.name, exc)

    def to_engine(self, handle: Handle | None = None, posted: bool = True) -> Handle:
        """Queue the call on the engine (its number taken on the lane, unless not ``posted``),
        with its result for ``handle``."""
        fields: submission.RequestFields = {
            "reduce_op": self.reduce_op,
            "prescale": self.prescale,
            "postscale": self.postscale,
        }
        return submission.to_engine(
            _KIND, self.name, [self.tensor], [self.out], self.set_id, False, False, posted, fields,
            handle,
        )  # fmt: skip


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
    call = _prepare(
        tensor, in_place, name, op, average, prescale_factor, postscale_factor, process_set
    )
    if call is None:
        return None
    lane = call.lane
    with lane.lock:
        try:
            ran = lane.sign(call.signature, call.flat, call.prescale)
            if ran:
                call.reduce()
        except TransportError as exc:
            raise call.failure(exc) from None
    if not ran:
        result: torch.Tensor = submission.wait(submission.register(call.to_engine()))
        return result
    return call.out


def allreduce_async(
    tensor: torch.Tensor,
    in_place: bool,
    name: str | None,
    op: object,
    average: bool | None,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
) -> int | None:
    """Start an allreduce of ``tensor`` (into it when ``in_place``) by signing it ahead on the
    lane; its integer handle, or ``None`` when the call takes the general path (nothing done
    yet). See :class:`_Ahead` for when the call is settled."""
    current = runtime().session
    if current is None or not current.engine.signs_ahead:
        return None  # many calls in flight before any is waited for: the engine's batches
    call = _prepare(
        tensor, in_place, name, op, average, prescale_factor, postscale_factor, process_set
    )
    if call is None:
        return None
    engine = call.engine
    handle = engine.handle(1, _KIND)
    if name is not None:  # held until its result is taken, as the engine holds a name
        engine.intake.claim(make_key(call.set_id, call.name), call.name, handle)
    ahead = _Ahead(call, handle)
    lane = call.lane
    with lane.lock:
        # One call signed ahead at a time per process, by a process that waits for its calls
        # one by one: where many are started before any is waited for, the engine batches them
        # (and its steady state replays them), which a lane cannot.
        if engine.signed_ahead is None and engine.signs_ahead and not engine.intake.busy():
            lane.sign_ahead(call.signature, call.flat, call.prescale, ahead.forced)
            handle.settle = ahead.settle
            engine.signed_ahead = ahead
            return submission.register(handle)
    return submission.register(call.to_engine(handle, posted=False))


class _Ahead:
    """An asynchronous call signed ahead on its lane: its data and signature are there from the
    call on, so members that sign it later may run it at once; this member takes the decision
    when its handle is polled (without waiting) or waited for, before this process makes any
    other call (:meth:`Engine.settle_ahead`, which decides ``engine`` if no decision can be
    taken yet), at ``hvd.join()`` and at shutdown; and the engine's thread hands it to the
    engine between cycles once the lane decided so, since the peers then wait for it there.
    """

    __slots__ = ("call", "handle", "open")

    def __init__(self, call: _Call, handle: Handle) -> None:
        self.call = call
        self.handle = handle
        self.open = True

    def settle(self, wait: bool) -> None:
        """From the handle's wait (``True``) or poll (``False``: never blocks; a thread on the
        lane settles it first)."""
        lock = self.call.lane.lock
        if not lock.acquire(blocking=wait):
            return
        try:
            if self.open:
                self.take(WAIT if wait else PEEK)
        finally:
            lock.release()

    def force(self, ending: bool) -> None:
        with self.call.lane.lock:
            if not ending:
                self.forced()
            elif self.open:
                self.take(SETTLE)  # runs where every member signed it, for all of them

    def forced(self) -> None:
        """Before another call (from the lane under its lock, or the engine): settle now."""
        if self.open:
            self.call.engine.signs_ahead = False
            self.take(FORCE)

    def flush(self) -> None:
        lock = self.call.lane.lock
        if not lock.acquire(blocking=False):
            return  # a caller's thread is on the lane, and settles it first
        try:
            if self.open:
                self.take(LOOK)  # acts on a decision taken; takes none itself
        finally:
            lock.release()

    def take(self, mode: int) -> None:
        """Take the decision (under the lane's lock) and act on it."""
        call, handle = self.call, self.handle
        # Live metrics time the collective from here, not from the call: the caller may
        # compute for a long while before it waits.
        call.issued = call.engine.counters.now()
        try:
            decided = call.lane.settle(mode)
            if decided is None:
                return
            self._close()
            if decided:
                call.reduce()
                handle.deliver(0, call.out)
                return
        except TransportError as exc:
            self._close()
            handle.fail(str(call.failure(exc)))
            return
        try:
            call.to_engine(handle)
        except (HoraInternalError, RuntimeError, ValueError) as exc:  # the job has ended
            handle.fail(str(exc))

    def _close(self) -> None:
        self.open = False
        self.handle.settle = None
        engine = self.call.engine
        if engine.signed_ahead is self:
            engine.signed_ahead = None


def _prepare(
    tensor: torch.Tensor,
    in_place: bool,
    name: str | None,
    op: object,
    average: bool | None,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
) -> _Call | None:
    """The call, if the lane may take it straight from the caller (see the module's
    docstring); ``None`` otherwise, with nothing done. Settles this process's call signed
    ahead, if any, first."""
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
    engine.settle_ahead()
    if name is None:
        base = f"allreduce.noname.{current.unnamed_call_number(set_id)}"
    else:
        base = f"allreduce.{name}"
    prescale, postscale = float(prescale_factor), float(postscale_factor)
    return _Call(
        engine,
        lane,
        set_id,
        base,
        reduce_op,
        prescale,
        postscale,
        tensor,
        tensor if in_place else torch.empty_like(tensor),
        sign(base, tensor, reduce_op, prescale, postscale),
        nbytes,
        engine.counters.now(),
    )


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
