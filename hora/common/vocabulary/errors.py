"""Exception types raised by hora and the user-facing texts that go with them.

The engine raises these; the framework layers re-export them. Nothing here knows about tensors.
"""

from __future__ import annotations


class HoraInternalError(RuntimeError):
    """A collective failed on this rank: a peer was lost, the job was shut down, or ranks disagreed.

    Horovod scripts catch ``HorovodInternalError``; it is the same class.
    """


HorovodInternalError = HoraInternalError


class HoraValueError(ValueError, RuntimeError):
    """A call hora refuses before it runs: an argument it cannot take, or an unsupported operation.

    It is both a ``ValueError`` and a ``RuntimeError``: for such calls Horovod raises one or the
    other depending on where it checks (Python or its C++ core), and scripts catch either.
    It is not a :class:`HoraInternalError`, so an elastic job does not reset for it.
    """


class HostsUpdatedInterrupt(RuntimeError):
    """Raised in elastic jobs when the set of hosts changed and the workers must re-form."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("The set of hosts changed.")
        self.skip_sync = skip_sync


NOT_INITIALIZED = "hora has not been initialized; use hvd.init()."

DUPLICATE_NAME = (
    "Requested to allreduce, allgather, or broadcast a tensor with the same name as another "
    "tensor that is currently being processed.  If you want to request another tensor, use a "
    "different tensor name. (name: {name!r})"
)

SHUT_DOWN = (
    "hora has been shut down. This was caused by an exception on one of the ranks or an attempt "
    "to allreduce, allgather or broadcast a tensor after one of the ranks finished execution. "
    "If the shutdown was caused by an exception, you should see the exception in the log before "
    "the first shutdown message."
)


def shut_down_message(reason: str | None) -> str:
    """The shutdown error text, with the cause first when hora knows it."""
    if not reason:
        return SHUT_DOWN
    return f"{reason}\n{SHUT_DOWN}"
