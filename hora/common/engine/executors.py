"""The collectives: one executor per kind of operation, behind one signature.

As Horovod's operation manager does, the engine asks each executor in :data:`EXECUTORS`, in
order, whether it runs a batch (``enabled``), and lets the first that does ``execute`` it. A
batch is one or more agreed responses fused into one operation (see
:mod:`hora.common.engine.fusion`). Executors move data through the communicator that the engine picked for
the batch (the set's own, or its NCCL group for CUDA tensors), in buffers on that communicator's
device, and finish the entries' handles; the allreduce hands its completion to the finisher thread so that the engine
can start the next batch while this one is on the wire.

This module knows entries, responses, buffers and communicators; it holds no engine state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from hora.common.engine import adasum
from hora.common.engine.buffers import (
    as_bytes,
    compute_dtype,
    copy_out_pieces,
    postscale,
    scale,
    torch_dtype,
    writing_to_inference,
)
from hora.common.engine.context import EngineContext
from hora.common.engine.handles import Entry, finish
from hora.common.transport import FINISHED, Communicator
from hora.common.vocabulary.message import ReduceOp, RequestType, Response


@dataclass
class Run:
    """One batch as it runs on this rank.

    Attributes:
        batch: the fused responses, in agreed order.
        entries: this rank's entry for each response (``None``: a joined rank's part, which
            contributes zeros to an allreduce).
        comm: the communicator that moves the batch's data: the process set's, or its GPU
            communicator (NCCL) for CUDA tensors. Buffers go to it on ``comm.device``.
        host_comm: the process set's own communicator, for what runs in host memory whatever
            the tensors' device (Adasum).
        members: the set's global ranks, in order.
        number: the batch's number (the same collective on every rank).
        context: the engine's shared parts: this process's global rank, the tracer (the
            timeline, if one is written), the finisher (completes asynchronous collectives),
            the counters (allreduces count themselves when they complete).
    """

    batch: list[Response]
    entries: list[Entry | None]
    comm: Communicator
    host_comm: Communicator
    members: tuple[int, ...]
    number: int
    context: EngineContext

    @property
    def head(self) -> Response:
        return self.batch[0]

    @property
    def entry(self) -> Entry | None:
        """The entry of a batch of one response."""
        return self.entries[0]


class Executor(Protocol):
    """Runs one kind of batch."""

    # Whether it writes its own collective span into the timeline (asynchronous ones do, once
    # the result is in); the engine writes it for the others.
    traces_itself: bool

    def enabled(self, response: Response) -> bool:
        """Whether this executor runs batches headed by ``response``."""

    def execute(self, run: Run) -> None:
        """Run the batch and finish its entries' handles."""


def _inputs(run: Run) -> list[torch.Tensor]:
    """Each entry's tensor; zeros of the agreed shape for a joined rank's part (on the device
    of this rank's other tensors, else where the communicator's buffers live)."""
    held = [e.tensor for e in run.entries if e is not None and e.tensor is not None]
    device = held[0].device if held else run.comm.device
    inputs = []
    for response, entry in zip(run.batch, run.entries):
        if entry is None or entry.tensor is None:
            template = response.template()
            shape, dtype = template.shape, torch_dtype(template.dtype)
            inputs.append(torch.zeros(shape, dtype=dtype, device=device))
        else:
            inputs.append(entry.tensor)
    return inputs


def _rows_like(tensor: torch.Tensor, rows: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """An empty tensor of ``rows`` rows, each shaped as a row of ``tensor`` and of its dtype, on
    ``device``; and how many bytes a row holds."""
    rest = tuple(tensor.shape[1:])
    output = torch.empty((rows, *rest), dtype=tensor.dtype, device=device)
    return output, math.prod(rest) * tensor.element_size()


class _OneKind:
    """An executor of every batch of one kind of request (``kind``)."""

    kind: RequestType
    # See Executor.traces_itself.
    traces_itself = False

    def enabled(self, response: Response) -> bool:
        return response.kind == self.kind


class _OneTensor(_OneKind):
    """An executor of batches of one response, run on this rank's tensor (a rank that joined
    has none and takes no part)."""

    def execute(self, run: Run) -> None:
        entry = run.entry
        if entry is not None and entry.tensor is not None:
            self.execute_one(run, entry, entry.tensor)

    def execute_one(self, run: Run, entry: Entry, tensor: torch.Tensor) -> None:
        """Run the batch on ``tensor`` (``entry``'s) and finish ``entry``'s handle."""
        raise NotImplementedError


class Allreduce(_OneKind):
    """A fused allreduce (Sum, Average, Min, Max, Product), completed on the finisher thread.

    The engine goes on negotiating (and starting) the next batches while this one is on the
    wire, as gradients of earlier layers arrive during backward.
    """

    kind = RequestType.ALLREDUCE
    traces_itself = True

    def execute(self, run: Run) -> None:
        context = run.context
        tracer = context.tracer
        started = tracer.now()
        entries = run.entries
        head = run.head.template()
        inputs = _inputs(run)
        target = run.comm.device
        tracer.open("MEMCPY_IN_FUSION_BUFFER")
        if len(inputs) == 1:
            flat = inputs[0].reshape(-1)
            entry = entries[0]
            if entry is not None and entry.output is not None and entry.output is not inputs[0]:
                entry.output.copy_(inputs[0])
                flat = entry.output.reshape(-1)
        else:
            flat = torch.cat([t.reshape(-1) for t in inputs])
        divisor = len(run.members) if head.reduce_op == ReduceOp.AVERAGE else 1
        op = ReduceOp.SUM if head.reduce_op == ReduceOp.AVERAGE else head.reduce_op
        work_dtype, work_op = compute_dtype(flat.dtype, op)
        work = flat
        if work_dtype != flat.dtype or flat.device != target:
            work = flat.to(device=target, dtype=work_dtype)
        work = scale(work, head.prescale)
        tracer.close()
        issued = tracer.now()
        counters = context.counters
        issued_s = counters.now()
        on_the_wire = tracer.begin("ALLREDUCE")
        pending = run.comm.allreduce_async(work, work_op)
        number = run.number
        path = run.comm.path

        def complete() -> None:
            done = tracer.now()
            tracer.finish(on_the_wire)
            tracer.open("MEMCPY_OUT_FUSION_BUFFER")
            counters.collective(issued_s, counters.now(), flat.numel() * flat.itemsize, len(inputs))
            # On the finisher thread: a single tensor is reduced in its own storage, which
            # may be an inference tensor (as when the allreduce scaled it before the wire).
            with writing_to_inference(entries):
                result = postscale(work, divisor, head.postscale)
                if result is not flat:
                    flat.copy_(result)
                copy_out_pieces(entries, flat, [t.numel() for t in inputs])
            tracer.close()
            if tracer.timeline is not None:
                times = (started, issued, done, tracer.now())
                nbytes = flat.numel() * flat.itemsize
                tracer.collective(entries, "ALLREDUCE", number, times, nbytes, path)

        finisher = context.finisher
        if pending is FINISHED and not finisher.busy:
            complete()  # done already, and nothing earlier is still completing
            return
        finisher.add(pending, complete, [e for e in entries if e is not None])


class AdasumAllreduce:
    """A fused Adasum allreduce (see :mod:`hora.common.engine.adasum`), run on the engine thread.

    Adasum is a sequence of exchanges with partners, not one collective; allreduces still
    completing on the finisher use the same communicator, so they finish first.
    """

    traces_itself = True

    def enabled(self, response: Response) -> bool:
        return (
            response.kind == RequestType.ALLREDUCE
            and response.template().reduce_op == ReduceOp.ADASUM
        )

    def execute(self, run: Run) -> None:
        context = run.context
        context.finisher.drain()
        tracer = context.tracer
        counters = context.counters
        started = tracer.now()
        head = run.head.template()
        dtype = torch_dtype(head.dtype)
        inputs = [t.reshape(-1) for t in _inputs(run)]
        counts = [t.numel() for t in inputs]
        # Halves are combined in float32 (their products and sums would lose too much).
        work_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        work = torch.cat([t.to(device="cpu", dtype=work_dtype) for t in inputs])
        work = scale(work, head.prescale)
        issued = tracer.now()
        issued_s = counters.now()
        tracer.open("ADASUM")
        adasum.allreduce(work, counts, run.host_comm)
        tracer.close()
        done = tracer.now()
        nbytes = work.numel() * inputs[0].element_size()
        counters.collective(issued_s, counters.now(), nbytes, len(counts))
        work = scale(work, head.postscale)
        copy_out_pieces(run.entries, work.to(device=inputs[0].device, dtype=dtype), counts)
        if tracer.timeline is not None:
            times = (started, issued, done, tracer.now())
            nbytes = work.numel() * work.itemsize
            tracer.collective(run.entries, "ADASUM", run.number, times, nbytes, run.host_comm.path)


class Allgather(_OneTensor):
    """Concatenates every member's tensor along dimension 0 (first dimensions may differ)."""

    kind = RequestType.ALLGATHER

    def execute_one(self, run: Run, entry: Entry, tensor: torch.Tensor) -> None:
        requests = run.head.requests[0]
        rows = [requests[r].shape[0] for r in run.members]
        target = run.comm.device
        output, row_bytes = _rows_like(tensor, sum(rows), target)
        source = as_bytes(tensor.to(target))
        chunks = list(as_bytes(output).split([n * row_bytes for n in rows]))
        if len(set(rows)) == 1:
            run.comm.allgather(chunks, source)
        else:
            longest = max(rows) * row_bytes
            padded = torch.zeros(longest, dtype=torch.uint8, device=target)
            padded[: source.numel()] = source
            gathered = [torch.empty(longest, dtype=torch.uint8, device=target) for _ in run.members]
            run.comm.allgather(gathered, padded)
            torch._foreach_copy_(chunks, [g[: c.numel()] for g, c in zip(gathered, chunks)])
        finish(entry, output.to(tensor.device))


class Broadcast(_OneTensor):
    """Copies the root member's tensor to every member (``root_rank`` is a global rank)."""

    kind = RequestType.BROADCAST

    def execute_one(self, run: Run, entry: Entry, tensor: torch.Tensor) -> None:
        output = entry.output if entry.output is not None else tensor
        if output is not tensor:
            output.copy_(tensor)
        target = run.comm.device
        work = output if output.device == target else output.to(target)
        run.comm.broadcast(as_bytes(work), run.members.index(run.head.template().root_rank))
        if work is not output:
            output.copy_(work)
        finish(entry, output)


class Alltoall(_OneTensor):
    """Sends each member its rows (``splits``, or equal parts) and gathers what they send."""

    kind = RequestType.ALLTOALL

    def execute_one(self, run: Run, entry: Entry, tensor: torch.Tensor) -> None:
        requests = run.head.requests[0]
        members = run.members
        rank = run.context.rank
        me = members.index(rank)

        def splits_of(rank: int) -> Sequence[int]:
            req = requests[rank]
            if req.splits is not None:
                return req.splits
            return [req.shape[0] // len(members)] * len(members)

        send = splits_of(rank)
        receive = [splits_of(r)[me] for r in members]
        target = run.comm.device
        output, row_bytes = _rows_like(tensor, sum(receive), target)
        source = as_bytes(tensor.to(target)[: sum(send)])
        run.comm.alltoall(
            as_bytes(output),
            source,
            [n * row_bytes for n in receive],
            [n * row_bytes for n in send],
        )
        received = torch.tensor(receive, dtype=torch.int32)
        finish(entry, (output.to(tensor.device), received))


class Reducescatter(_OneTensor):
    """Reduces across members, then gives each its rows of dimension 0 (the first
    ``rows % members`` members get one more)."""

    kind = RequestType.REDUCESCATTER

    def execute_one(self, run: Run, entry: Entry, tensor: torch.Tensor) -> None:
        request = run.head.template()
        count = len(run.members)
        first = tensor.shape[0]
        rows = [first // count + (1 if i < first % count else 0) for i in range(count)]
        me = run.members.index(run.context.rank)
        rest = tuple(tensor.shape[1:])
        op = ReduceOp.SUM if request.reduce_op == ReduceOp.AVERAGE else request.reduce_op
        work_dtype, work_op = compute_dtype(tensor.dtype, op)
        target = run.comm.device
        work = tensor.to(device=target, dtype=work_dtype)
        if work is tensor:
            work = tensor.clone()
        work = scale(work, request.prescale)
        row = math.prod(rest)
        chunks = list(work.reshape(-1).split([n * row for n in rows]))
        output = torch.empty(rows[me] * row, dtype=work_dtype, device=target)
        run.comm.reducescatter(output, chunks, work_op)
        divisor = count if request.reduce_op == ReduceOp.AVERAGE else 1
        output = postscale(output, divisor, request.postscale)
        result = output.reshape((rows[me], *rest)).to(device=tensor.device, dtype=tensor.dtype)
        finish(entry, result)


class Barrier(_OneKind):
    """Every member submitted it, so negotiation itself was the barrier: finish the handle."""

    kind = RequestType.BARRIER
    traces_itself = True  # no collective to show

    def execute(self, run: Run) -> None:
        if run.entry is not None:
            finish(run.entry, None)


class Join(_OneKind):
    """Every rank joined: finish the handle with the rank that joined last."""

    kind = RequestType.JOIN
    traces_itself = True  # no collective to show

    def execute(self, run: Run) -> None:
        if run.entry is not None:
            finish(run.entry, run.head.last_joined_rank)


# Asked in this order; the first enabled one runs the batch.
EXECUTORS: tuple[Executor, ...] = (
    AdasumAllreduce(),
    Allreduce(),
    Allgather(),
    Broadcast(),
    Alltoall(),
    Reducescatter(),
    Barrier(),
    Join(),
)


def executor_for(response: Response) -> Executor:
    """The first executor of :data:`EXECUTORS` that runs batches headed by ``response``.

    Raises:
        LookupError: no executor runs this kind of response.
    """
    for executor in EXECUTORS:
        if executor.enabled(response):
            return executor
    raise LookupError(f"no executor runs {response.kind.name} responses")
