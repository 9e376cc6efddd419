"""Between TensorFlow and the engine: tensors through DLPack, eager calls and ``tf.function``.

The engine works on torch tensors. A TensorFlow tensor becomes a torch tensor through DLPack
without a copy (the same memory, on the CPU or the same GPU), and a result goes back the same
way. Only results that hora made itself are handed back: a torch view of a TensorFlow input is
never written to.

Inside ``tf.function`` a collective becomes one ``tf.py_function``: TensorFlow runs stateful
ops of a function in program order, so every rank submits its collectives in the same order.
XLA cannot compile a ``py_function``; a collective inside ``jit_compile=True`` code is refused
with an error that says so.

In a ``tf.compat.v1`` graph run by a session nothing orders independent ops: each rank may run
a step's collectives in another order, and a collective waiting for its peers must not hold one
of the session's few threads (the others could then never start theirs). There a collective is
named after its place in the graph when it is built, and runs in two halves: a ``py_function``
that hands the inputs over and returns at once, and a ``tf.data`` iterator's ``get_next``, which
TensorFlow runs on a thread of its own, where hora submits and waits.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

# The first import of TensorFlow in hora.tensorflow (and so hora.keras): where it is missing,
# one line that says what to install.
try:
    import tensorflow as tf
except ModuleNotFoundError as exc:
    if exc.name != "tensorflow":
        raise  # TensorFlow is there but does not import: its own traceback says why
    raise ModuleNotFoundError(
        "hora.tensorflow and hora.keras need TensorFlow 2.16 or later, which is not installed: "
        "pip install 'hora[tensorflow]' (or pip install tensorflow-cpu).",
        name="tensorflow",
    ) from None
import torch
from torch.utils import dlpack as _torch_dlpack

from hora.common import api
from hora.common.ops import engine_facts
from hora.common.process_sets import ProcessSet
from hora.common.vocabulary.errors import HoraInternalError, HoraValueError

# torch's stubs do not export to_dlpack.
torch_dlpack: Any = _torch_dlpack


class HoraTensorFlowError(tf.errors.FailedPreconditionError, HoraInternalError):  # type: ignore[misc]
    """A collective failed (ranks disagreed, a peer was lost, hora shut down).

    It is TensorFlow's ``FailedPreconditionError``, as Horovod's TensorFlow ops raise, and hora's
    :class:`~hora.common.vocabulary.errors.HoraInternalError` (``HorovodInternalError``), which elastic
    training catches.
    """

    def __init__(self, message: str) -> None:
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message,))


class HoraTensorFlowValueError(tf.errors.InvalidArgumentError, HoraValueError):  # type: ignore[misc]
    """hora refused a call before it ran (an argument it cannot take).

    It is TensorFlow's ``InvalidArgumentError``, as Horovod's TensorFlow ops raise, and hora's
    :class:`~hora.common.vocabulary.errors.HoraValueError` (a ``ValueError``).
    """

    def __init__(self, message: str) -> None:
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message,))


# Types the engine does not carry, and the same-width type their bits travel as.
_BITS_AS = {tf.uint16: tf.int16, tf.uint32: tf.int32, tf.uint64: tf.int64}


# The base of an unnamed collective's name in a tf.compat.v1 graph, by kind.
_GRAPH_NAMES = {
    "allreduce": "HoraAllreduce",
    "grouped_allreduce": "HoraGroupedAllreduce",
    "allgather": "HoraAllgather",
    "grouped_allgather": "HoraGroupedAllgather",
    "broadcast": "HoraBroadcast",
    "broadcast_": "HoraBroadcastInplace",
    "alltoall": "HoraAlltoall",
    "reducescatter": "HoraReducescatter",
    "grouped_reducescatter": "HoraGroupedReducescatter",
}


def enclosing_graph() -> tf.Graph:
    """The graph being built: a ``tf.compat.v1`` graph or a ``tf.function``'s.

    A ``tf.cond`` branch or ``tf.while_loop`` body (control flow v2) is a function graph of its
    own, run as part of the graph around it: inside one, the answer is the graph around it.
    """
    graph = tf.compat.v1.get_default_graph()
    while getattr(graph, "is_control_flow_graph", False):
        graph = graph.outer_graph
    return graph


def session_graph() -> tf.Graph | None:
    """The ``tf.compat.v1`` graph being built for a session; ``None`` eagerly and while a
    ``tf.function`` is traced."""
    if tf.executing_eagerly():
        return None
    graph = enclosing_graph()
    return None if graph.building_function else graph


def graph_name(name: str | None, kind: str, process_set: ProcessSet) -> str | None:
    """The name of a collective, fixed now: eagerly ``name``; in a graph (a ``tf.function``
    being traced, or a ``tf.compat.v1`` graph), ``name`` or its place in the graph.

    In a ``tf.compat.v1`` graph built after ``hvd.init()``, ``process_set`` must be registered
    when the op is built (its id is part of the op, as in Horovod); otherwise this raises
    :class:`HoraTensorFlowValueError` now, not when a session runs the op.

    Eagerly an unnamed collective is numbered when it runs (as in PyTorch). In a graph an op
    runs once per step, so its name is fixed when it is built, and, as in Horovod, an unnamed
    collective is named like an op of the graph: ``Hora<Kind>`` under the current name scope,
    made unique in the graph (``tower_1/HoraAllreduce_2``), which every rank that builds the
    same graph derives alike. A ``tf.function``'s names are those of its own graph, after the
    function's name (``train_step/HoraAllreduce_1``): a rank that traces the function again (for
    an input of another shape, say) gives its collectives the same names as before, so they
    still meet the other ranks'.
    """
    if tf.executing_eagerly():
        return name
    graph = session_graph()
    if graph is None:
        if name is not None:
            return name
        function = enclosing_graph()
        # TensorFlow names the graphs it makes for gradients after a process-wide count
        # ("__backward_train_step_123"), which may differ between ranks: not that count.
        prefix = re.sub(r"_\d+$", "", function.name)
        return f"{prefix}/{function.unique_name(_GRAPH_NAMES[kind])}"
    set_id = process_set.process_set_id
    if api.is_initialized() and not engine_facts.set_registered(set_id):
        raise HoraTensorFlowValueError(
            f"{kind.rstrip('_')}: {process_set} is not registered. Pass it to "
            "hvd.init(process_sets=[...]) or hvd.add_process_set(...) on every rank before "
            "building the graph."
        )
    # The outermost graph's names: unique across cond branches and loop bodies too.
    unique: str = graph.unique_name(name if name is not None else _GRAPH_NAMES[kind])
    return unique


def as_wire(tensor: tf.Tensor) -> tf.Tensor:
    """``tensor``, or its bits as a signed type when the engine cannot carry its type."""
    wire = _BITS_AS.get(tensor.dtype)
    return tensor if wire is None else tf.bitcast(tensor, wire)


def from_wire(tensor: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """The inverse of :func:`as_wire` (``dtype`` may be a reference variable's ``float32_ref``)."""
    dtype = tf.as_dtype(dtype).base_dtype
    return tensor if tensor.dtype == dtype else tf.bitcast(tensor, dtype)


def to_torch(value: Any) -> torch.Tensor:
    """A torch view of a TensorFlow tensor or variable (no copy)."""
    tensor = tf.convert_to_tensor(value)
    if tensor.dtype == tf.string or tensor.dtype == tf.resource or tensor.dtype == tf.variant:
        raise HoraValueError(f"hora cannot send tensors of type {tensor.dtype.name}.")
    view: torch.Tensor = torch_dlpack.from_dlpack(tf.experimental.dlpack.to_dlpack(tensor))
    return view


def to_tf(tensor: torch.Tensor) -> tf.Tensor:
    """A TensorFlow tensor over a torch result's memory (no copy)."""
    return tf.experimental.dlpack.from_dlpack(torch_dlpack.to_dlpack(tensor.contiguous()))


def in_xla_context() -> bool:
    """Whether the graph being built is compiled by XLA (``jit_compile=True``)."""
    try:
        from tensorflow.python.framework import ops as tf_ops
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - private modules moved
        return False
    graph = tf_ops.get_default_graph()
    return bool(control_flow_util.GraphOrParentsInXlaContext(graph))


def _refuse_xla(what: str) -> None:
    if in_xla_context():
        raise HoraTensorFlowValueError(
            f"hora's {what} cannot run inside XLA-compiled code (jit_compile=True): XLA cannot "
            "call out to hora's engine. Compile without XLA: model.compile(..., "
            "jit_compile=False), or @tf.function(jit_compile=False)."
        )


def _eager(fn: Callable[[list[torch.Tensor]], Sequence[Any]], inputs: Sequence[Any]) -> list[Any]:
    try:
        results = fn([to_torch(value) for value in inputs])
    except HoraValueError as exc:
        if isinstance(exc, tf.errors.OpError):
            raise
        raise HoraTensorFlowValueError(str(exc)) from exc
    except HoraInternalError as exc:
        raise HoraTensorFlowError(str(exc)) from exc
    return [to_tf(r) if isinstance(r, torch.Tensor) else r for r in results]


class _Inbox:
    """Where a collective's inputs wait, in a session's step, between its two halves.

    It holds one step's inputs: a step that failed after handing them over leaves them behind,
    and the next step's replace them.
    """

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._inputs: list[Any] | None = None

    def put(self, inputs: list[Any]) -> None:
        with self._ready:
            self._inputs = inputs
            self._ready.notify_all()

    def take(self) -> list[Any]:
        with self._ready:
            self._ready.wait_for(lambda: self._inputs is not None)
            inputs: list[Any] = self._inputs or []
            self._inputs = None
            return inputs


def _iterator_options() -> tf.data.Options:
    # Elements are made only when get_next asks: nothing runs ahead of the step.
    options = tf.data.Options()
    options.experimental_optimization.apply_default_optimizations = False
    options.experimental_optimization.inject_prefetch = False
    options.autotune.enabled = False
    return options


def _in_session_step(
    fn: Callable[[list[torch.Tensor]], Sequence[Any]],
    tensors: list[tf.Tensor],
    out_dtypes: Sequence[tf.DType],
) -> list[tf.Tensor]:
    """``fn`` as ops of a ``tf.compat.v1`` graph that never hold a thread of the session.

    A session runs a kernel on a thread of a small pool (one per core by default) until it
    returns. A collective that waited there for its peers could take every thread while a peer
    waits for a collective this rank has not started, and the job would hang. So the op that
    receives the inputs only hands them over; the outputs come from a ``tf.data`` iterator,
    whose ``get_next`` TensorFlow runs on a thread of its own: there hora submits the
    collective and waits for it.
    """
    from tensorflow.python.framework import ops as tf_ops

    inbox = _Inbox()
    dtypes = list(out_dtypes)

    def hand_over(*values: tf.Tensor) -> bool:
        inbox.put(list(values))
        return True

    def collect() -> list[Any]:
        try:
            return _eager(fn, inbox.take())
        except (StopIteration, IndexError) as exc:
            # TensorFlow would read these as the end of the iterator and close it for good.
            raise HoraTensorFlowError(f"{type(exc).__name__}: {exc}") from exc

    def element(_: tf.Tensor) -> tuple[tf.Tensor, ...]:
        return tuple(tf.py_function(func=collect, inp=[], Tout=dtypes))

    # The iterator belongs to the outermost graph, outside any control flow or dependencies:
    # a cond branch or a loop body uses it from there. tf.data runs on the CPU (a result on a
    # GPU is copied there, and on to the ops that use it).
    with tf_ops.init_scope(), tf.device("/device:CPU:0"):
        results = tf.data.Dataset.from_tensors(0).repeat().map(element)
        iterator = tf.compat.v1.data.make_one_shot_iterator(
            results.with_options(_iterator_options())
        )
    handed_over = tf.py_function(func=hand_over, inp=tensors, Tout=tf.bool)
    with tf.control_dependencies([handed_over]), tf.device("/device:CPU:0"):
        return list(iterator.get_next())


def _refuse_overlapping_iterations(what: str) -> None:
    """Refuse a collective in a loop of a ``tf.compat.v1`` graph whose iterations may overlap.

    Every iteration runs the same op under the same name: two iterations at once would hand
    over two sets of inputs for one name.
    """
    try:
        from tensorflow.python.ops import control_flow_v2_func_graphs as cf_graphs
    except ImportError:  # pragma: no cover - private modules moved
        return
    advice = (
        " Every iteration runs the same collective under the same name, so iterations that "
        "overlap would submit it twice at once. Build the loop with parallel_iterations=1 "
        "under tf.compat.v1.disable_control_flow_v2(), or run the loop in a tf.function."
    )
    graph = tf.compat.v1.get_default_graph()
    while getattr(graph, "is_control_flow_graph", False):
        if isinstance(graph, (cf_graphs.WhileBodyFuncGraph, cf_graphs.WhileCondFuncGraph)):
            raise HoraTensorFlowValueError(
                f"hora's {what} cannot run inside this tf.while_loop of a tf.compat.v1 graph: "
                "with control flow v2, hora cannot tell whether its iterations run one at a "
                "time." + advice
            )
        graph = graph.outer_graph
    context = graph._get_control_flow_context()
    while context is not None:
        if context.IsWhileContext() and context.parallel_iterations != 1:
            raise HoraTensorFlowValueError(
                f"hora's {what} cannot run inside a tf.while_loop of a tf.compat.v1 graph with "
                f"parallel_iterations={context.parallel_iterations}." + advice
            )
        context = context.outer_context


def run(
    fn: Callable[[list[torch.Tensor]], Sequence[Any]],
    inputs: Sequence[Any],
    out_dtypes: Sequence[tf.DType],
    out_shapes: Sequence[Any] | None,
    what: str,
) -> list[tf.Tensor]:
    """Run ``fn`` (torch tensors in, torch tensors out) on TensorFlow tensors.

    Eagerly, it runs now. While a ``tf.function`` is traced, it becomes one ``tf.py_function``;
    in a ``tf.compat.v1`` graph, ops that never hold a thread of the session while they wait
    (see :func:`_in_session_step`). Their outputs get ``out_shapes`` (``None`` entries: unknown).

    Args:
        fn: takes one torch tensor per input and returns one result per output.
        inputs: TensorFlow tensors or variables.
        out_dtypes: the outputs' TensorFlow types.
        out_shapes: the outputs' static shapes, where known.
        what: names the collective in errors.

    Raises:
        HoraTensorFlowValueError: in XLA-compiled code, or in a ``tf.compat.v1`` loop whose
            iterations may overlap.
    """
    if tf.executing_eagerly():
        return _eager(fn, inputs)
    _refuse_xla(what)
    tensors = [tf.convert_to_tensor(value) for value in inputs]
    if session_graph() is None:
        outputs = tf.py_function(
            func=lambda *xs: _eager(fn, xs), inp=tensors, Tout=list(out_dtypes)
        )
    else:
        _refuse_overlapping_iterations(what)
        outputs = _in_session_step(fn, tensors, out_dtypes)
    if not isinstance(outputs, (list, tuple)):
        outputs = [outputs]
    outputs = list(outputs)
    for output, shape in zip(outputs, out_shapes or [None] * len(outputs)):
        if shape is not None:
            output.set_shape(shape)
    return outputs


def run_python(
    fn: Callable[[], Any], out_dtype: tf.DType, what: str, waits: bool = False
) -> tf.Tensor:
    """A value computed by Python at run time (``rank_op``, ``join``): now, or in the graph.

    ``waits``: ``fn`` waits for the other ranks (``join``, ``barrier``); in a ``tf.compat.v1``
    graph it then runs as a collective does (see :func:`run`).
    """
    if tf.executing_eagerly():
        return tf.constant(fn(), dtype=out_dtype)
    _refuse_xla(what)
    if waits and session_graph() is not None:
        (output,) = run(lambda _: [fn()], [], [out_dtype], [[]], what)
        return output
    output = tf.py_function(func=lambda: tf.constant(fn(), dtype=out_dtype), inp=[], Tout=out_dtype)
    output.set_shape([])
    return output
