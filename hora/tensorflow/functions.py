"""Broadcasting variables and Python objects, for TensorFlow users."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hora.common.objects import allgather_object, broadcast_object
from hora.common.process_sets import ProcessSet
from hora.tensorflow import ops

__all__ = ["allgather_object", "broadcast_object", "broadcast_object_fn", "broadcast_variables"]


def broadcast_variables(
    variables: Sequence[Any],
    root_rank: int,
    process_set: ProcessSet = ops.global_process_set,
    inplace: bool = True,
) -> list[Any]:
    """Give every variable ``root_rank``'s value (one negotiated batch); returns the values.

    Call it once after the model and optimizer are built, so every rank starts from the same
    weights.

    Example:
        >>> hvd.broadcast_variables(model.variables, root_rank=0)
    """
    del inplace
    return ops.broadcast_(
        list(variables), root_rank, name="hora.broadcast_variables", process_set=process_set
    )


def broadcast_object_fn(
    root_rank: int = 0,
    session: Any = None,
    name: str | None = None,
    process_set: ProcessSet = ops.global_process_set,
) -> Callable[[Any], Any]:
    """A function that broadcasts an object from ``root_rank`` (TensorFlow 1 sessions are not
    supported: ``session`` must be ``None``)."""
    if session is not None:
        raise NotImplementedError(
            "hora.tensorflow runs TensorFlow 2 (eager and tf.function); TensorFlow 1 sessions "
            "are not supported."
        )

    def send(obj: Any) -> Any:
        return broadcast_object(obj, root_rank, name=name, process_set=process_set)

    return send
