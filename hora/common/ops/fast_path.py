"""Collectives run on the caller's thread, straight on shared memory: the fast path.

When every member of a process set shares this host, its communicator has a
:class:`~hora.common.transport.shm_lane.Lane`, and every call on the set takes a number there
(the engine's :meth:`~hora.common.engine.Engine.enqueue` takes one for the calls it is handed
directly). A synchronous allreduce (grouped or not) or broadcast of CPU tensors, or a barrier,
also signs its number with its signature (its kind, name, each tensor's dtype, shape and
device, its reduction, scale factors and root). When every member signed the same signature
for that number, each member runs the call on its own thread: no queue, no engine thread, no
negotiation round, and the result is in before the call returns (its handle is done). Live
metrics count such a call as one collective, as the engine counts a batch; a timeline being
written shows it on its tensors' rows (:func:`_trace`).
Otherwise, one decision for all members sends every member's call to the engine, whose
negotiation runs it, or finds the mismatch and reports it as it always does.

``hvd.join()`` tells the lanes: while a member has joined, the others' calls go to the engine,
where a joined rank takes part; once every member's ``join`` returned, the numbers restart
together. ``HORA_FAST_PATH=0`` gives every set no lane.

This module knows calls, tensors and the lane; the engine only through the handles it makes and
the failure it reports.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Mapping, Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from hora.common.engine import Engine, Handle
from hora.common.engine.buffers import postscale
from hora.common.engine.steady.waits import stalled
from hora.common.transport import CallerLane, TransportError
from hora.common.transport.shm_lane import Lane, Signature
from hora.common.vocabulary.errors import HoraInternalError
from hora.common.vocabulary.message import ReduceOp, RequestType, key_label, make_key
from hora.common.vocabulary.timeline_writer import Timeline

# Reductions the lane runs (Average is a sum, divided afterwards; Adasum is the engine's).
_REDUCTIONS = (ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)
_KINDS = (RequestType.ALLREDUCE, RequestType.BROADCAST, RequestType.BARRIER)


def header(
    kind: RequestType, name: str, tensors: Sequence[torch.Tensor], fields: Mapping[str, object]
) -> Signature | None:
    """A call's signature: a digest of everything the members must agree on (its kind, name,
    each tensor's dtype and shape, and the fields of its request); ``None`` when the lane
    cannot run it (a tensor off the CPU, a reduction the lane lacks, mixed dtypes)."""
    if kind not in _KINDS:
        return None
    described = []
    dtypes = set()
    for tensor in tensors:
        if not tensor.is_cpu:
            return None
        dtypes.add(tensor.dtype)
        described.append(_tensor_text(tensor.dtype, tensor.shape))
    if kind == RequestType.ALLREDUCE and (
        fields.get("reduce_op") not in _REDUCTIONS or len(dtypes) > 1
    ):
        return None
    return digest(kind, name, ";".join(described), _fields_text(fields))


def digest(kind: RequestType, name: str, tensors_text: str, fields_text: str) -> Signature:
    """The signature of a call from its parts' texts, as :func:`header` writes them."""
    text = f"{kind.value}|{name}|{tensors_text}|{fields_text}"
    return _WORDS.unpack(hashlib.blake2b(text.encode(), digest_size=24).digest())


_WORDS = struct.Struct("<3q")


# What header() writes for a tensor (by dtype and shape) and for a call's fields: the same few
# recur in a settled job, and formatting them anew costs more than the rest of a small call.
# Each text depends on its key alone, so the caches change nothing but the cost.
@functools.lru_cache(maxsize=4096)
def _tensor_text(dtype: torch.dtype, shape: torch.Size) -> str:
    return f"{dtype}{tuple(shape)}cpu"


@functools.lru_cache(maxsize=4096)
def _items_text(items: tuple[tuple[str, type, object], ...]) -> str:
    return repr({name: value for name, _, value in items})


def _fields_text(fields: Mapping[str, object]) -> str:
    # Keyed with each value's type: 1 and 1.0 are equal keys but print differently.
    items = tuple((name, type(value), value) for name, value in fields.items())
    try:
        return _items_text(items)
    except TypeError:  # a value that cannot be hashed: formatted every time
        return repr(dict(fields))


def run(
    engine: Engine,
    lane: CallerLane,
    kind: RequestType,
    name: str,
    tensors: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor | None],
    grouped: bool,
    fields: Mapping[str, object],
    set_id: int,
) -> Handle | None:
    """Take the call's number on the lane and run it there if every member signed the same
    call; its handle (done), or ``None`` when it goes to the engine (its number taken: the
    caller queues it with ``posted=True``).

    Raises:
        HoraInternalError: a member was lost, or the wait timed out (the engine fails the
            job as it would for a failed collective).
    """
    engine.settle_ahead()
    members = engine.process_sets.members(set_id)
    signature = _signature(engine, kind, name, tensors, fields, members)
    issued = engine.counters.now()
    timeline = engine.timeline
    times = _Times(timeline) if timeline is not None else None
    # As the engine runs the transport: in inference mode, so that an inference tensor's
    # in-place call may write it here too.
    with lane.lock, torch.inference_mode():
        if signature is None or not isinstance(lane, Lane):
            lane.post()
            return None
        try:
            ran = _run_signed(lane, signature, kind, tensors, outputs, fields, members, times)
        except TransportError as exc:
            raise failure(engine, lane, name, exc) from None
        number = lane.number
    if not ran:
        return None
    # The lane's calls have one dtype: their bytes are their elements' count times its size.
    reduced = sum(map(torch.Tensor.numel, tensors)) * tensors[0].element_size() if tensors else 0
    engine.counters.collective(
        issued,
        engine.counters.now(),
        reduced if kind == RequestType.ALLREDUCE else 0,
        len(tensors),
    )
    if times is not None:
        times.done = times.timeline.now()
        names = [f"{name}_{i + 1}of{len(tensors)}" for i in range(len(tensors))]
        labels = [key_label(make_key(set_id, n)) for n in (names if grouped else [name])]
        _trace(times, kind, labels, number, (len(tensors), reduced))
    handle = engine.handle(max(len(tensors), 1), kind, grouped)
    if tensors:
        handle.deliver_all([t if output is None else output for t, output in zip(tensors, outputs)])
    else:
        handle.deliver(0, None)
    return handle


def failure(engine: Engine, lane: Lane, name: str, exc: TransportError) -> HoraInternalError:
    """The error of a call the lane could not finish (a lost peer, a timeout), once the engine
    failed the job for it as for a failed collective."""
    error = stalled(engine.settings.stall_limit_s, [name], lane.ranks[lane.rank], exc)
    return HoraInternalError(engine.caller_failed(str(error)))


def accepting(engine: Engine) -> bool:
    """Whether the engine takes calls (an ended job's calls go to it, to raise why it ended)."""
    intake = engine.intake
    return intake.running and intake.shutdown_reason is None and intake.failure is None


def _signature(
    engine: Engine,
    kind: RequestType,
    name: str,
    tensors: Sequence[torch.Tensor],
    fields: Mapping[str, object],
    members: Sequence[int],
) -> Signature | None:
    """The call's :func:`header`, or ``None`` when it goes to the engine in any case."""
    if kind == RequestType.BROADCAST and fields.get("root_rank") not in members:
        return None  # the engine's checks name the error
    if not accepting(engine):
        return None
    return header(kind, name, tensors, fields)


def _run_signed(
    lane: Lane,
    signature: Signature,
    kind: RequestType,
    tensors: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor | None],
    fields: Mapping[str, object],
    members: Sequence[int],
    times: _Times | None,
) -> bool:
    """Sign the call and, if every member signed the same, run it here."""
    if kind == RequestType.BARRIER:
        ran = lane.sign(signature)
        _settled(times)
        if ran:
            lane.finish()
        return ran
    if kind == RequestType.BROADCAST:
        root_rank = fields["root_rank"]
        assert isinstance(root_rank, int)
        root = members.index(root_rank)
        flat = tensors[0].view(-1)
        target = outputs[0] if outputs[0] is not None else tensors[0]
        ran = lane.sign(signature, flat if lane.rank == root else None)
        _settled(times)
        if ran:
            lane.broadcast(flat, target.view(-1), root)
        return ran
    return _allreduce(lane, signature, tensors, outputs, fields, times)


class _Times:
    """When a call was made, when every member had signed it and when it was done, on the
    clock of the timeline being written."""

    __slots__ = ("timeline", "called", "settled", "done")

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self.called = self.settled = self.done = timeline.now()


def _settled(times: _Times | None) -> None:
    if times is not None:
        times.settled = times.timeline.now()


def _trace(
    times: _Times, kind: RequestType, labels: Sequence[str], number: int, size: tuple[int, int]
) -> None:
    """A call the lane ran, on the row of each of its tensors (of its name, for a barrier):
    ``NEGOTIATE_<OP>`` from the call to the moment every member had signed it, then the
    collective, with ``"path": "lane"`` and, instead of a batch, the call's number on the lane
    (the same call on every member)."""
    timeline = times.timeline
    op = kind.name
    args = f'{{"op":"{op}","path":"lane"}}'
    tensors, nbytes = size
    detail = f'{{"lane":{number},"tensors":{tensors},"bytes":{nbytes},"path":"lane"}}'
    for label in labels:
        row = timeline.row(label)
        timeline.complete(row, f"NEGOTIATE_{op}", times.called, times.settled, args)
        timeline.complete(row, op, times.settled, times.done, detail)


def join(lanes: Sequence[CallerLane]) -> None:
    """This member is about to join: the others' calls go to the engine meanwhile."""
    for lane in lanes:
        with lane.lock:
            lane.begin_join()


def rejoin(lanes: Sequence[CallerLane]) -> None:
    """This member's ``join`` returned, so every member's did: numbers restart together."""
    for lane in lanes:
        with lane.lock:
            lane.new_epoch()


def _allreduce(
    lane: Lane,
    signature: Signature,
    tensors: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor | None],
    fields: Mapping[str, object],
    times: _Times | None,
) -> bool:
    reduce_op, prescale, factor = (
        fields.get(k, 1.0) for k in ("reduce_op", "prescale", "postscale")
    )
    assert isinstance(reduce_op, ReduceOp)
    assert isinstance(prescale, float) and isinstance(factor, float)
    if len(tensors) == 1:
        flat = tensors[0].view(-1)
        target = outputs[0]
        out = flat if target is None else target.view(-1)
    else:
        flat = _flatten_dense_tensors(tensors)  # one C++ loop, not a view per tensor here
        out = flat
    ran = lane.sign(signature, flat, prescale)
    _settled(times)
    if not ran:
        return False
    reduce_signed(lane, flat, out, reduce_op, prescale, factor)
    if len(tensors) > 1:
        targets = [tensor if target is None else target for tensor, target in zip(tensors, outputs)]
        torch._foreach_copy_(targets, _unflatten_dense_tensors(out, targets))
    return True


def reduce_signed(
    lane: Lane,
    flat: torch.Tensor,
    out: torch.Tensor,
    reduce_op: ReduceOp,
    prescale: float,
    factor: float,
) -> None:
    """The data phase of an allreduce every member signed alike: ``flat`` (signed with its
    head scaled by ``prescale``) reduced into ``out``, averaged and scaled by ``factor`` as the
    engine does."""
    op = ReduceOp.SUM if reduce_op == ReduceOp.AVERAGE else reduce_op
    lane.allreduce(flat, out, op, prescale)
    divisor = lane.size if reduce_op == ReduceOp.AVERAGE else 1
    scaled = postscale(out, divisor, factor)
    if scaled is not out:  # integers and halves are scaled through a wider copy
        out.copy_(scaled)


@functools.lru_cache(maxsize=4096)
def reduction_text(reduce_op: ReduceOp, prescale: float, postscale: float) -> str:
    """What :func:`header` writes for the fields of an allreduce (as
    :func:`hora.common.ops.submission.reduction` makes them: the scale factors as floats)."""
    return _fields_text({"reduce_op": reduce_op, "prescale": prescale, "postscale": postscale})


def tensor_text(dtype: torch.dtype, shape: torch.Size) -> str:
    """What :func:`header` writes for a CPU tensor of ``dtype`` and ``shape``."""
    return _tensor_text(dtype, shape)
