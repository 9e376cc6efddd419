"""Horovod's ops that move no tensor of the caller's: ``join``, ``barrier``, and the topology as
tensors (``size_op``, ``rank_op``, ``local_size_op``, ``local_rank_op``,
``process_set_included_op``).

Each runs a Python call when the op runs (:func:`hora.tensorflow._bridge.run_python`), eagerly,
inside ``tf.function`` and in ``tf.compat.v1`` graphs, and returns an int32 scalar (``barrier``
returns the op to run in a graph). :mod:`hora.tensorflow.ops` re-exports them beside the
collectives, where Horovod has them.
"""

from __future__ import annotations

import tensorflow as tf

from hora.common import api
from hora.common.ops import collectives, engine_facts
from hora.common.process_sets import ProcessSet, global_process_set
from hora.tensorflow._bridge import run_python, session_graph

# process_set_included_op's answers when it cannot say 0 or 1 (Horovod's codes).
PROCESS_SET_ERROR_INIT = -1
PROCESS_SET_ERROR_UNKNOWN_SET = -3


def join() -> tf.Tensor:
    """Tell the other ranks this rank has no more data; wait until every rank has joined.

    Returns the last rank to join (an int32 scalar tensor, the same on every rank).
    """
    return run_python(collectives.join, tf.int32, "join", waits=True)


def barrier(process_set: ProcessSet = global_process_set) -> tf.Operation | None:
    """Block until every rank of ``process_set`` has called ``barrier``.

    In a ``tf.compat.v1`` graph it returns the op to run (``session.run(hvd.barrier())``);
    eagerly and inside ``tf.function`` it returns ``None`` (a ``tf.function`` runs it in
    program order).
    """
    if tf.executing_eagerly():
        collectives.barrier(process_set)
        return None

    def wait() -> int:
        collectives.barrier(process_set)
        return 0

    done = run_python(wait, tf.int32, "barrier", waits=True)
    return done.op if session_graph() is not None else None


def _set_size(process_set_id: int) -> int:
    return len(engine_facts.set_members(process_set_id))


def _included(process_set_id: int) -> int:
    if not api.is_initialized():
        return PROCESS_SET_ERROR_INIT
    if not engine_facts.set_registered(process_set_id):
        return PROCESS_SET_ERROR_UNKNOWN_SET
    return int(api.rank() in engine_facts.set_members(process_set_id))


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """The number of ranks (of a process set), as an int32 tensor computed when it runs."""
    del name
    return run_python(lambda: _set_size(process_set_id), tf.int32, "size_op")


def local_size_op(name: str | None = None) -> tf.Tensor:
    """The number of ranks on this host, as an int32 tensor computed when it runs."""
    del name
    return run_python(api.local_size, tf.int32, "local_size_op")


def rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank, as an int32 tensor computed when it runs."""
    del name
    return run_python(api.rank, tf.int32, "rank_op")


def local_rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank on its host, as an int32 tensor computed when it runs."""
    del name
    return run_python(api.local_rank, tf.int32, "local_rank_op")


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """1 if this rank belongs to the process set, 0 if not, -1 before ``init``, -3 for an
    unknown set (Horovod's codes); an int32 tensor computed when it runs."""
    del name
    return run_python(lambda: _included(process_set_id), tf.int32, "process_set_included_op")
