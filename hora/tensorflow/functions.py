"""Broadcasting variables and Python objects, for TensorFlow users.

The object helpers take Horovod's ``session`` argument, which its TensorFlow 1 graph mode needs
to run the broadcast ops. hora's object collectives are not graph ops: they run when called, in
Python, eagerly and in TensorFlow 1 graph mode alike, so a session is accepted and not needed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from hora.common.ops import objects
from hora.common.process_sets import ProcessSet
from hora.tensorflow import ops
from hora.tensorflow._bridge import session_graph

__all__ = [
    "allgather_object",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_object_fn",
    "broadcast_variables",
]


def broadcast_variables(
    variables: Sequence[Any],
    root_rank: int,
    process_set: ProcessSet = ops.global_process_set,
    inplace: bool = False,
) -> list[Any]:
    """Give every variable ``root_rank``'s value (one negotiated batch); returns the values.

    Call it once after the model and optimizer are built, so every rank starts from the same
    weights.

    Args:
        variables: the variables to overwrite with ``root_rank``'s values.
        root_rank: the rank whose values everyone gets.
        process_set: the ranks taking part (default: all).
        inplace: Horovod's choice between broadcasting into the variables' own memory and
            through temporaries (``False``, its default). hora always receives the values into
            new buffers and assigns them to the variables, so both give the same result.

    Example:
        >>> hvd.broadcast_variables(model.variables, root_rank=0)
    """
    del inplace  # the same path either way (see Args)
    return ops.broadcast_(
        list(variables), root_rank, name="hora.broadcast_variables", process_set=process_set
    )


def broadcast_global_variables(root_rank: int) -> Any:
    """Give every global variable of the ``tf.compat.v1`` graph ``root_rank``'s value.

    TensorFlow 1 graph mode only: it returns the op to run (``session.run(op)``), which
    broadcasts ``tf.compat.v1.global_variables()`` in one negotiated batch.

    Raises:
        RuntimeError: eagerly or inside ``tf.function``, where there is no global variable
            collection; it names what to call instead.

    Example:
        >>> sync = hvd.broadcast_global_variables(0)
        >>> session.run(sync)
    """
    if session_graph() is None:
        raise RuntimeError(
            "broadcast_global_variables() needs TensorFlow 1's global variable collection, "
            "which exists only in a tf.compat.v1 graph; eagerly and in tf.function call "
            "hvd.broadcast_variables(model.variables, root_rank=0) (and the optimizer's "
            "variables) instead."
        )
    return tf.group(*broadcast_variables(tf.compat.v1.global_variables(), root_rank))


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    session: Any = None,
    name: str | None = None,
    process_set: ProcessSet = ops.global_process_set,
) -> Any:
    """Send a picklable object from ``root_rank`` to every rank and return it everywhere.

    Args:
        obj: the object (on ranks other than ``root_rank``, any placeholder such as ``None``).
        root_rank: the rank whose object everyone gets.
        session: Horovod's TensorFlow 1 session; accepted and not needed (see the module).
        name: shared by all ranks (default: a per-call number, the same on every rank).
        process_set: the ranks taking part (default: all).

    Example:
        >>> config = hvd.broadcast_object(config if hvd.rank() == 0 else None, root_rank=0)
    """
    del session
    return objects.broadcast_object(obj, root_rank, name=name, process_set=process_set)


def allgather_object(
    obj: Any,
    session: Any = None,
    name: str | None = None,
    process_set: ProcessSet = ops.global_process_set,
) -> list[Any]:
    """Gather a picklable object from every rank; returns the list in rank order.

    Args:
        obj: this rank's object.
        session: Horovod's TensorFlow 1 session; accepted and not needed (see the module).
        name: shared by all ranks (default: a per-call number, the same on every rank).
        process_set: the ranks taking part (default: all).

    Example:
        >>> counts = hvd.allgather_object(len(my_shard))
    """
    del session
    return objects.allgather_object(obj, name=name, process_set=process_set)


def broadcast_object_fn(
    root_rank: int = 0,
    session: Any = None,
    name: str | None = None,
    process_set: ProcessSet = ops.global_process_set,
) -> Callable[[Any], Any]:
    """A function that broadcasts an object from ``root_rank`` each time it is called.

    ``session`` is Horovod's TensorFlow 1 session; accepted and not needed (see the module).

    Example:
        >>> send = hvd.broadcast_object_fn(root_rank=0)
        >>> state = send(state)
    """
    del session

    def send(obj: Any) -> Any:
        return objects.broadcast_object(obj, root_rank, name=name, process_set=process_set)

    return send
