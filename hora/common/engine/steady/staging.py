"""The steady state's batch buffers: tensors staged in as they are submitted, results delivered
out, and a second buffer while results lent from the first are still in use.

Each batch of a schedule has one flat buffer on its communicator's device, reused every period:
its tensors' data, then one slot per rank for its code. :func:`allocate` makes them;
:func:`stage` copies submitted tensors into their pieces (scaled where the batch scales tensors
one by one); :func:`fill` completes a batch's buffer before its allreduce; :func:`deliver` hands
a landed batch's pieces to its entries (a copy, or a view of the buffer where the caller allows
it); :func:`claim` turns to a spare buffer before one whose results are still referenced would
be written again. This module knows schedules and tensors; when batches run, and under which
lock, is :mod:`.replay`'s business.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from hora.common.engine.buffers import (
    destination,
    on_default_stream,
    referenced_beyond,
    scale,
    storage_references,
    torch_dtype,
)
from hora.common.engine.handles import Entry, finish
from hora.common.engine.steady.schedule import FOLLOWING, BatchBuffer, Schedule
from hora.common.transport import Communicator, repeated_buffer
from hora.common.vocabulary.message import ReduceOp, Request


def allocate(schedule: Schedule, comm_for: Callable[[str], Communicator], ranks: int) -> None:
    """Give each of the schedule's batches its buffer, on the device of the communicator it runs
    on (``comm_for`` its tensors' device type), and its scale factors."""
    # One buffer per batch, reused every period (no allocation, no page faults per step);
    # after the data, one slot per rank for its code (see hora.common.engine.steady.schedule).
    for batch, counts in zip(schedule.batches, schedule.sizes):
        comm = comm_for(batch[0].device)
        batch_buffer = _batch_buffer(batch, counts, ranks, comm)
        schedule.comms.append(comm)
        schedule.batch_buffers.append(batch_buffer)
        schedule.pieces.update(batch_buffer.pieces)
        factor = batch[0].prescale
        if batch[0].reduce_op == ReduceOp.AVERAGE:
            factor /= ranks
        schedule.factors.append(factor)
        schedule.scale_each.append(factor != 1.0 and sum(counts) >= _SCALE_EACH_FROM * len(counts))


def claim(schedule: Schedule, number: int, ranks: int) -> bool:
    """Before batch ``number``'s buffer is written again after its results were lent: if a
    lent view is still in use (a gradient that was not reset, or a reference the caller
    kept), turn to the batch's spare buffer, or a new one, so that nothing lent ever changes
    under its holder. Returns whether a new buffer was allocated. Called where no thread
    submits meanwhile (see ``Intake.between_submissions``).

    A training loop that resets its gradients to ``None`` (``zero_grad()``'s default) before
    the next backward frees every lent view, so one buffer serves every step; gradients kept
    across steps stay views of the buffer they adopted first (DistributedOptimizer then
    copies into them), and the batch stages into a second one.
    """
    schedule.lent.discard(number)
    current = schedule.batch_buffers[number]
    if not _in_use(current):
        return False
    spare = schedule.spares.get(number)
    allocated = False
    if spare is None or _in_use(spare):
        spare = _batch_buffer(
            schedule.batches[number], schedule.sizes[number], ranks, schedule.comms[number]
        )
        allocated = True
    schedule.batch_buffers[number] = spare
    schedule.pieces.update(spare.pieces)
    # The buffer still in use is kept as the spare: it is free again once its holder lets go.
    schedule.spares[number] = current
    return allocated


def fill(
    schedule: Schedule, position: int, entries: list[Entry | None], code: int, rank: int
) -> torch.Tensor:
    """Fill batch ``position``'s buffer for its allreduce and return it: the entries' tensors,
    scaled, where this rank follows the schedule (``code`` is FOLLOWING), else zeros and
    ``code`` in this rank's slot."""
    batch_buffer: BatchBuffer = schedule.batch_buffers[position]
    buffer, data, codes = batch_buffer.buffer, batch_buffer.data, batch_buffer.codes
    if code == FOLLOWING:
        # Tensors are staged as they are submitted (see Replay.admit), except those submitted
        # while this buffer was still on the wire.
        stage(
            schedule,
            [
                (position, entry.request.name, entry.tensor)
                for entry in entries
                if entry is not None and entry.tensor is not None and entry.staged is not schedule
            ],
        )
        if not schedule.scale_each[position]:
            scaled = scale(data, schedule.factors[position])
            if scaled is not data:
                data.copy_(scaled)
    else:
        data.zero_()
    codes.zero_()
    if code != FOLLOWING:
        codes[rank] = code
    return buffer


def deliver(
    entries: list[Entry], data: torch.Tensor, pieces: dict[str, torch.Tensor], factor: float
) -> bool:
    """Deliver a steady-state batch: scale by ``factor``, hand each entry its piece (a view of
    ``data`` shaped as its tensor), and finish the entries. Returns whether a piece was lent.

    An entry that allows it (``Entry.lend``) gets a view of its piece as its result, which
    saves a pass over the data; the buffer is then only written again once no tensor refers
    to it (see :func:`claim`). Other entries get a copy: large tensors are scaled straight into
    their destinations (one pass over the data); many small ones are cheaper scaled in the
    buffer by one operation, then copied by another.
    """
    # One pass over the entries (a grouped call has hundreds): results, copies, and whether a
    # destination was made in inference mode (see writing_to_inference).
    results: list[torch.Tensor | None] = []
    targets: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    lent = False
    inference = False
    for entry in entries:
        dest = destination(entry)
        if dest is None:
            results.append(None)
            continue
        piece = pieces[entry.request.name]
        if dest.is_inference():
            inference = True
        elif entry.lend and dest.is_cpu and dest.dtype == piece.dtype:
            # A view of its own (outside inference mode), so that the buffer's references
            # count whoever keeps it.
            results.append(piece.detach())
            lent = True
            continue
        results.append(dest)
        targets.append(dest)
        sources.append(piece)
    each = (
        factor != 1.0
        and not lent
        and data.dtype not in (torch.float16, torch.bfloat16)
        and data.numel() >= _SCALE_EACH_FROM * max(len(entries), 1)
    )
    with torch.inference_mode() if inference else contextlib.nullcontext():
        _write_copies(targets, sources, data, factor, each)
    for entry, result in zip(entries, results):
        finish(entry, result)
    return lent


# The mean elements per tensor from which tensors are scaled one by one rather than in their
# buffer by one operation (measured: 29 tensors of 2.7k elements on average took half the time
# scaled in the buffer first; 6 of 310k took a fifth more).
_SCALE_EACH_FROM = 1 << 16


def _write_copies(
    targets: list[torch.Tensor],
    sources: list[torch.Tensor],
    data: torch.Tensor,
    factor: float,
    each: bool,
) -> None:
    """Write a delivered batch's pieces (``sources``, views of ``data``) into ``targets``,
    scaled by ``factor``: one by one (``each``), or the buffer at once and then the copies."""
    if each:
        for dest, piece in zip(targets, sources):
            if dest.device == piece.device and dest.dtype == piece.dtype:
                torch.mul(piece, factor, out=dest)
            else:
                dest.copy_(piece.mul(factor))
        return
    scaled = scale(data, factor)
    if scaled is not data:
        data.copy_(scaled)
    if targets:
        torch._foreach_copy_(targets, sources)


def stage(schedule: Schedule, staged: list[tuple[int, str, torch.Tensor]]) -> None:
    """Copy each ``(batch number, name, tensor)`` into its piece of the batch's buffer, scaled
    when the batch's tensors are scaled one by one (see ``Schedule.scale_each``). The plain
    copies are made together, by one operation: a grouped call stages hundreds."""
    targets: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    for number, name, tensor in staged:
        # detach(), not no_grad(): a gradient needs neither, and the mode switch costs more
        # than the copy of a small tensor.
        source = tensor.detach() if tensor.requires_grad else tensor
        piece = schedule.pieces[name]
        if not schedule.scale_each[number]:
            targets.append(piece)
            sources.append(source)
        else:
            with on_default_stream(piece):
                if source.device == piece.device:
                    torch.mul(source, schedule.factors[number], out=piece)
                else:
                    piece.copy_(source).mul_(schedule.factors[number])
    if targets:
        # CUDA buffers are filled on the default stream, which the submitting call made wait
        # for the caller's stream, and after which NCCL runs the batch.
        with on_default_stream(targets[0]):
            torch._foreach_copy_(targets, sources)


def _batch_buffer(
    batch: list[Request], counts: list[int], ranks: int, comm: Communicator
) -> BatchBuffer:
    """Allocate a batch's buffer where ``comm`` reduces it best (in shared memory, where the
    ranks share a host; see ``repeated_buffer``): its tensors' data, then one slot per rank for
    its code."""
    total = sum(counts)
    buffer = repeated_buffer(comm, total + ranks, torch_dtype(batch[0].dtype))
    pieces = {}
    offset = 0
    for request, count in zip(batch, counts):
        # Shaped as the tensor: staging copies it without a reshape.
        pieces[request.name] = buffer[offset : offset + count].view(request.shape)
        offset += count
    data, codes = buffer[:total], buffer[total:]
    return BatchBuffer(buffer, data, codes, pieces, storage_references(buffer))


def _in_use(batch_buffer: BatchBuffer) -> bool:
    """Whether anything but the engine's own views still refers to a batch's buffer."""
    return referenced_beyond(batch_buffer.buffer, batch_buffer.baseline)
