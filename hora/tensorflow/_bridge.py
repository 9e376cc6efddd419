"""Between TensorFlow and the engine: tensors through DLPack, eager calls and ``tf.function``.

The engine works on torch tensors. A TensorFlow tensor becomes a torch tensor through DLPack
without a copy (the same memory, on the CPU or the same GPU), and a result goes back the same
way. Only results that hora made itself are handed back: a torch view of a TensorFlow input is
never written to.

Inside ``tf.function`` a collective becomes one ``tf.py_function``: TensorFlow runs stateful
ops of a function in program order, so every rank submits its collectives in the same order.
XLA cannot compile a ``py_function``; a collective inside ``jit_compile=True`` code is refused
with an error that says so.
"""

from __future__ import annotations

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

from hora.common.errors import HoraInternalError, HoraValueError
from hora.common.runtime import session

# torch's stubs do not export to_dlpack.
torch_dlpack: Any = _torch_dlpack


class HoraTensorFlowError(tf.errors.FailedPreconditionError, HoraInternalError):  # type: ignore[misc]
    """A collective failed (ranks disagreed, a peer was lost, hora shut down).

    It is TensorFlow's ``FailedPreconditionError``, as Horovod's TensorFlow ops raise, and hora's
    :class:`~hora.common.errors.HoraInternalError` (``HorovodInternalError``), which elastic
    training catches.
    """

    def __init__(self, message: str) -> None:
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message,))


class HoraTensorFlowValueError(tf.errors.InvalidArgumentError, HoraValueError):  # type: ignore[misc]
    """hora refused a call before it ran (an argument it cannot take).

    It is TensorFlow's ``InvalidArgumentError``, as Horovod's TensorFlow ops raise, and hora's
    :class:`~hora.common.errors.HoraValueError` (a ``ValueError``).
    """

    def __init__(self, message: str) -> None:
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message,))


# Types the engine does not carry, and the same-width type their bits travel as.
_BITS_AS = {tf.uint16: tf.int16, tf.uint32: tf.int32, tf.uint64: tf.int64}


def graph_name(name: str | None, kind: str) -> str | None:
    """The name of a collective: ``name``; or, while a graph is traced, a name fixed now.

    Eagerly an unnamed collective is numbered when it runs (as in PyTorch). In a graph, ops
    without a data dependency may run in any order, and a traced op runs once per step: naming
    it once, while tracing (in program order on every rank), keeps the names equal across ranks
    and across steps.
    """
    if name is not None or tf.executing_eagerly():
        # The engine puts the kind in front: "allreduce.graph.1".
        return name
    return f"graph.{session().traced_call_number(kind)}"


def as_wire(tensor: tf.Tensor) -> tf.Tensor:
    """``tensor``, or its bits as a signed type when the engine cannot carry its type."""
    wire = _BITS_AS.get(tensor.dtype)
    return tensor if wire is None else tf.bitcast(tensor, wire)


def from_wire(tensor: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """The inverse of :func:`as_wire`."""
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


def run(
    fn: Callable[[list[torch.Tensor]], Sequence[Any]],
    inputs: Sequence[Any],
    out_dtypes: Sequence[tf.DType],
    out_shapes: Sequence[Any] | None,
    what: str,
) -> list[tf.Tensor]:
    """Run ``fn`` (torch tensors in, torch tensors out) on TensorFlow tensors.

    Eagerly, it runs now. While a ``tf.function`` is traced, it becomes one ``tf.py_function``
    whose outputs get ``out_shapes`` (``None`` entries: unknown).

    Args:
        fn: takes one torch tensor per input and returns one result per output.
        inputs: TensorFlow tensors or variables.
        out_dtypes: the outputs' TensorFlow types.
        out_shapes: the outputs' static shapes, where known.
        what: names the collective in errors.
    """
    if tf.executing_eagerly():
        return _eager(fn, inputs)
    _refuse_xla(what)
    tensors = [tf.convert_to_tensor(value) for value in inputs]
    outputs = tf.py_function(func=lambda *xs: _eager(fn, xs), inp=tensors, Tout=list(out_dtypes))
    if not isinstance(outputs, (list, tuple)):
        outputs = [outputs]
    outputs = list(outputs)
    for output, shape in zip(outputs, out_shapes or [None] * len(outputs)):
        if shape is not None:
            output.set_shape(shape)
    return outputs


def run_python(fn: Callable[[], Any], out_dtype: tf.DType, what: str) -> tf.Tensor:
    """A value computed by Python at run time (``rank_op``, ``join``): now, or in the graph."""
    if tf.executing_eagerly():
        return tf.constant(fn(), dtype=out_dtype)
    _refuse_xla(what)
    output = tf.py_function(func=lambda: tf.constant(fn(), dtype=out_dtype), inp=[], Tout=out_dtype)
    output.set_shape([])
    return output
