"""Averaging gradients across ranks: what ``DistributedGradientTape`` and the Keras
``DistributedOptimizer`` share.

By default every dense gradient of a step travels in one grouped allreduce (one call into the
engine per step, one ``tf.py_function`` inside ``tf.function``), named after the variables so
that every rank, and every step, uses the same name. ``num_groups`` or ``groups`` split them.
Sparse gradients (``tf.IndexedSlices``) are gathered, unless ``sparse_as_dense``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import tensorflow as tf

from hora.common import api
from hora.common.ops import compression as compression_policy
from hora.common.process_sets import ProcessSet
from hora.tensorflow import ops
from hora.tensorflow.compression import Compression

# GradientReducer's options that DistributedGradientTape and DistributedOptimizer take, under
# the names of their (Horovod's) parameters.
_CALL_OPTIONS = (
    "compression",
    "sparse_as_dense",
    "op",
    "gradient_predivide_factor",
    "num_groups",
    "groups",
    "process_set",
    "scale_local_gradients",
)


def passed_on(arguments: Mapping[str, Any], *leave_out: str) -> dict[str, Any]:
    """``arguments`` less the names in ``leave_out``: what a function with Horovod's signature
    passes on, by name, to the one it wraps. ``arguments`` is its ``locals()``, taken before it
    binds a name of its own: its parameters, by name."""
    return {name: value for name, value in arguments.items() if name not in leave_out}


def variable_name(variable: Any) -> str:
    """A variable's name as every rank sees it (Keras 3's path, else TensorFlow's name)."""
    return str(getattr(variable, "path", None) or getattr(variable, "name", "") or "")


@dataclass
class GradientReducer:
    """How gradients are averaged: the options of ``DistributedGradientTape`` and
    ``DistributedOptimizer``.

    Attributes:
        compression: ``Compression.none``, ``.fp16`` or ``.bf16`` (with ``Compression.none``,
            ``HORA_GRADIENT_COMPRESSION`` may choose one).
        sparse_as_dense: turn ``tf.IndexedSlices`` into dense tensors before reducing.
        op: ``Average`` (default), ``Sum`` or ``Adasum``.
        gradient_predivide_factor: with Average, divide by this before the sum and by
            ``size / factor`` after it.
        num_groups: split the gradients into this many groups (0: one group).
        groups: explicit groups, as lists of variables (overrides ``num_groups``).
        process_set: the ranks that average; the other ranks keep their own gradients.
        local_variables: variables whose gradients stay local (``PartialDistributed*``).
        scale_local_gradients: divide local gradients by the process set's size.
        prefix: starts the collectives' names.
    """

    compression: Any = Compression.none
    sparse_as_dense: bool = False
    op: Any = ops.Average
    gradient_predivide_factor: float = 1.0
    num_groups: int = 0
    groups: Sequence[Sequence[Any]] | None = None
    process_set: ProcessSet = ops.global_process_set
    local_variables: set[int] = field(default_factory=set)
    scale_local_gradients: bool = True
    prefix: str = "hora.grads"

    @classmethod
    def of(cls, arguments: Mapping[str, Any], prefix: str) -> GradientReducer:
        """The reducer a ``DistributedGradientTape`` or ``DistributedOptimizer`` call asks for.

        Args:
            arguments: the call's ``locals()``: its options by their parameter names, which are
                this class's attribute names (other names in it are not read).
            prefix: starts the collectives' names.
        """
        return cls(**{name: arguments[name] for name in _CALL_OPTIONS}, prefix=prefix)

    def __post_init__(self) -> None:
        self.compression = compression_policy.for_gradients(
            self.compression, Compression.fp16, Compression.bf16
        )
        if self.gradient_predivide_factor != 1.0 and self.op != ops.Average:
            raise ValueError("gradient_predivide_factor needs op=hvd.Average.")
        if self.num_groups < 0:
            raise ValueError(f"num_groups must be 0 or more, got {self.num_groups}.")
        if self.groups is not None and self.num_groups:
            raise ValueError("Give num_groups or groups, not both.")

    def _scales(self) -> tuple[float, float]:
        factor = self.gradient_predivide_factor
        return (1.0 / factor, factor) if factor != 1.0 else (1.0, 1.0)

    def _partition(self, indices: list[int], variables: Sequence[Any]) -> list[list[int]]:
        if self.groups is not None:
            where = {id(v): g for g, group in enumerate(self.groups) for v in group}
            parts: dict[int, list[int]] = {}
            for i in indices:
                parts.setdefault(where.get(id(variables[i]), len(self.groups)), []).append(i)
            return [parts[k] for k in sorted(parts)]
        count = min(self.num_groups, len(indices)) if self.num_groups else 1
        size, extra = divmod(len(indices), max(count, 1))
        parts_list, start = [], 0
        for g in range(count):
            end = start + size + (1 if g < extra else 0)
            parts_list.append(indices[start:end])
            start = end
        return [p for p in parts_list if p]

    def reduce(self, grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
        """The averaged gradients, in order (``None`` stays ``None``)."""
        grads = list(grads)
        out: list[Any] = list(grads)
        if api.size() == 1 and self.process_set is ops.global_process_set:
            return out
        if self.process_set is not ops.global_process_set and not self.process_set.included():
            return out  # a rank outside the process set keeps its own gradients
        shared: list[int] = []
        for i, (grad, var) in enumerate(zip(grads, variables)):
            if grad is None:
                continue
            if id(var) in self.local_variables:
                if self.scale_local_gradients:
                    out[i] = grad / tf.cast(self.process_set.size(), grad.dtype)
                continue
            if self.sparse_as_dense and isinstance(grad, tf.IndexedSlices):
                out[i] = tf.convert_to_tensor(grad)
            shared.append(i)
        names = [variable_name(variables[i]) for i in shared]
        digest = hashlib.sha1("\n".join(names).encode()).hexdigest()[:16]
        pre, post = self._scales()
        for g, part in enumerate(self._partition(shared, variables)):
            reduced = ops.grouped_allreduce(
                [out[i] for i in part],
                compression=self.compression,
                op=self.op,
                prescale_factor=pre,
                postscale_factor=post,
                process_set=self.process_set,
                name=f"{self.prefix}.{digest}.{g}",
            )
            for i, value in zip(part, reduced):
                out[i] = value
        return out


def make_tape_class(base: Any) -> Any:
    """A subclass of ``base`` (a ``tf.GradientTape`` class) whose ``gradient`` averages."""

    def gradient(
        self: Any,
        target: Any,
        sources: Any,
        output_gradients: Any = None,
        unconnected_gradients: Any = tf.UnconnectedGradients.NONE,
        use_generic_names: bool = False,
    ) -> Any:
        del use_generic_names  # Horovod's naming option; hora names by the variables
        grads = base.gradient(self, target, sources, output_gradients, unconnected_gradients)
        reduced = self._hora_reducer.reduce(tf.nest.flatten(grads), tf.nest.flatten(sources))
        return tf.nest.pack_sequence_as(grads, reduced)

    def register_local_source(self: Any, source: Any) -> None:
        """Keep ``source``'s gradient on this rank (not averaged)."""
        self._hora_reducer.local_variables.add(id(source))

    def get_local_and_global_gradients(
        self: Any,
        target: Any,
        sources: Any,
        output_gradients: Any = None,
        use_generic_names: bool = False,
    ) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
        """``gradient()``, split into ``[(source, gradient)]`` of the local sources and of the
        averaged ones, each in the order of ``sources``."""
        grads = gradient(
            self, target, sources, output_gradients, use_generic_names=use_generic_names
        )
        local = self._hora_reducer.local_variables
        pairs = list(zip(sources, grads))
        return (
            [(s, g) for s, g in pairs if id(s) in local],
            [(s, g) for s, g in pairs if id(s) not in local],
        )

    return type(
        base.__name__,
        (base,),
        {
            "gradient": gradient,
            "register_local_source": register_local_source,
            "get_local_and_global_gradients": get_local_and_global_gradients,
        },
    )


def distributed_tape(tape: Any, reducer: GradientReducer) -> Any:
    """``tape`` as an instance of its class's averaging subclass, sharing its recording."""
    cls: Any = make_tape_class(type(tape))
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(tape.__dict__)
    wrapped._hora_reducer = reducer
    return wrapped
