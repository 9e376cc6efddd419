"""How ``DistributedOptimizer`` hooks into Keras optimizers.

A wrapped optimizer is an instance of a subclass made on the fly from the optimizer's own class,
with the base class's ``__name__``, ``__qualname__`` and ``__module__``: Keras serializes it as the
base class, so a saved model loads without hora. The subclass overrides the one method through
which every update passes:

- Keras 3 (``keras.optimizers.*``): ``apply(grads, trainable_variables)``; ``apply_gradients``
  and ``model.fit`` both call it.
- tf_keras / Keras 2 (``tf_keras.optimizers.*`` and ``tf_keras.optimizers.legacy.*``):
  ``apply_gradients(grads_and_vars, ...)``; ``minimize`` and ``model.fit`` call it.

With ``backward_passes_per_step=N`` the gradients are summed locally, in variables that live
outside the optimizer's state (a saved model carries none of them), and only every Nth call
averages and applies them. The choice is a ``tf.cond``, so it works eagerly and in ``tf.function``;
the optimizer is built and the accumulators exist before the ``tf.cond``, never inside a branch.
``optimizer.iterations`` follows each Keras's own convention: under Keras 3 it counts the updates
applied (as ``gradient_accumulation_steps`` does), under tf_keras every call (as Horovod did).

Two more methods keep custom loops written for Horovod's tf_keras wrapper working:
``_compute_gradients(loss, var_list, grad_loss=None, tape=None)`` returns the gradients already
averaged (the next ``apply_gradients`` of exactly those tensors does not average them again), and
``_agg_helper`` is the accumulator (its ``counter`` is the calls since the last update), or
``None`` without ``backward_passes_per_step``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import tensorflow as tf

from hora.common.vocabulary.errors import HoraValueError
from hora.tensorflow._bridge import in_xla_context
from hora.tensorflow.gradients import GradientReducer

KERAS3 = "Keras 3"
TF_KERAS = "tf_keras"

_XLA = (
    "hora's DistributedOptimizer cannot average gradients inside XLA-compiled code "
    "(jit_compile=True): XLA cannot call out to hora's engine. Compile the model with "
    "model.compile(..., jit_compile=False) (Keras 3 turns XLA on by default when a GPU is "
    "present), or decorate a custom training step with @tf.function(jit_compile=False)."
)

_COMPAT_V1 = (
    "hora.tensorflow.keras.DistributedOptimizer wraps Keras optimizers. For a tf.compat.v1.train "
    "optimizer in a TensorFlow 1 graph run by a session, use hora.tensorflow's "
    "DistributedOptimizer (import hora.tensorflow as hvd); with Keras, use a Keras optimizer "
    "(tf.keras.optimizers.SGD, Adam, ...)."
)


def flavor(optimizer: Any) -> str:
    """Which Keras ``optimizer`` belongs to: :data:`KERAS3` or :data:`TF_KERAS`.

    Raises:
        NotImplementedError: a ``tf.compat.v1.train.Optimizer``.
        TypeError: not a Keras optimizer.
    """
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise NotImplementedError(_COMPAT_V1)
    if callable(getattr(optimizer, "stateless_apply", None)) and callable(
        getattr(optimizer, "apply", None)
    ):
        return KERAS3
    if callable(getattr(optimizer, "apply_gradients", None)) and callable(
        getattr(optimizer, "get_config", None)
    ):
        return TF_KERAS
    raise TypeError(
        "DistributedOptimizer wraps a Keras optimizer (keras.optimizers.*, tf_keras.optimizers.* "
        f"or tf_keras.optimizers.legacy.*); got {type(optimizer).__qualname__}. In a custom "
        "training loop without a Keras optimizer, use hvd.DistributedGradientTape instead."
    )


def is_distributed(optimizer: Any) -> bool:
    """Whether ``optimizer`` is already a hora ``DistributedOptimizer``."""
    return isinstance(getattr(optimizer, "_hora", None), HoraState)


class GradientAccumulator:
    """Sums gradients over ``passes`` calls; every ``passes``-th call hands the sum on.

    Args:
        passes: ``backward_passes_per_step``.
        average: divide the sum by ``passes`` (``average_aggregated_gradients``).
    """

    def __init__(self, passes: int, average: bool) -> None:
        self.passes = passes
        self.average = average
        self.count: tf.Variable | None = None
        self.sums: dict[int, tf.Variable] = {}
        self._owners: list[Any] = []  # keeps the keys of ``sums`` (ids) from being reused

    def _ensure(self, variables: Sequence[Any]) -> None:
        # init_scope: created once, eagerly, even while a tf.function is traced.
        with tf.init_scope():
            if self.count is None:
                self.count = tf.Variable(0, dtype=tf.int64, trainable=False, name="hora_passes")
            for variable in variables:
                if id(variable) not in self.sums:
                    self._owners.append(variable)
                    self.sums[id(variable)] = tf.Variable(
                        tf.zeros(variable.shape, dtype=tf.as_dtype(variable.dtype)),
                        trainable=False,
                        name="hora_accumulated_gradient",
                    )

    @property
    def counter(self) -> tf.Tensor:
        """The calls since the last update (``0`` before the first call)."""
        if self.count is None:
            return tf.constant(0, dtype=tf.int64)
        return self.count % self.passes

    @staticmethod
    def _read(total: tf.Variable, scale: float) -> tf.Tensor:
        value = total.read_value()
        return value * tf.cast(scale, value.dtype) if scale != 1.0 else value

    def step(
        self,
        grads: Sequence[Any],
        variables: Sequence[Any],
        apply: Callable[[list[Any]], Any],
        skipped: Callable[[], Any] | None = None,
    ) -> tf.Tensor:
        """Add ``grads`` to the sums; on every ``passes``-th call, ``apply(sums)`` and reset;
        on the other calls, ``skipped()`` if given.

        Returns:
            A boolean tensor: whether this call applied.
        """
        self._ensure(variables)
        assert self.count is not None
        count = self.count.assign_add(1)
        live = [(g, self.sums[id(v)]) for g, v in zip(grads, variables) if g is not None]
        for grad, total in live:
            total.assign_add(tf.cast(tf.convert_to_tensor(grad), total.dtype))

        def flush() -> tf.Tensor:
            scale = 1.0 / self.passes if self.average else 1.0
            apply(
                [
                    None if g is None else self._read(self.sums[id(v)], scale)
                    for g, v in zip(grads, variables)
                ]
            )
            for _, total in live:
                total.assign(tf.zeros_like(total))
            return tf.constant(True)

        def wait() -> tf.Tensor:
            if skipped is not None:
                skipped()
            return tf.constant(False)

        return tf.cond(tf.equal(count % self.passes, 0), flush, wait, name="hora_apply")


@dataclass
class HoraState:
    """What a wrapped optimizer carries besides its own state (never saved with the model)."""

    reducer: GradientReducer
    accumulator: GradientAccumulator | None
    # What the last ``_compute_gradients`` returned, already averaged.
    averaged: list[Any] = field(default_factory=list)

    def reduce(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        """``grads`` averaged across ranks, unless they are exactly what ``_compute_gradients``
        returned (averaged already)."""
        # Both lists' tensors are alive here, so an equal id means the same tensor.
        averaged = {id(a) for a in self.averaged}
        self.averaged = []
        live = [g for g in grads if g is not None]
        if live and all(id(g) in averaged for g in live):
            return grads
        return self.reducer.reduce(grads, variables)


def _refuse_xla() -> None:
    if not tf.executing_eagerly() and in_xla_context():
        raise HoraValueError(_XLA)


def _known_variables(optimizer: Any) -> list[Any]:
    """The variables a built Keras 3 optimizer was built on."""
    variables = getattr(optimizer, "_trainable_variables", None)
    inner = getattr(optimizer, "inner_optimizer", None)
    if variables is None and inner is not None:
        return _known_variables(inner)
    if variables is None:
        raise ValueError(
            "apply() got gradients without variables, but the optimizer is not built yet: pass "
            "the variables, optimizer.apply(grads, model.trainable_variables), or call "
            "optimizer.build(model.trainable_variables) first."
        )
    return list(variables)


def _keras3_methods(base: type[Any]) -> dict[str, Any]:
    base_apply = base.apply

    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        grads = list(grads)
        if not grads:
            return base_apply(self, grads, trainable_variables)
        _refuse_xla()
        state: HoraState = self._hora
        if trainable_variables is None:
            variables = _known_variables(self)
        else:
            variables = list(trainable_variables)
        if state.accumulator is None:
            return base_apply(self, state.reduce(grads, variables), trainable_variables)
        if not self.built:
            self.build(variables)

        def update(total: list[Any]) -> None:
            base_apply(self, state.reduce(total, variables), variables)

        state.accumulator.step(grads, variables, update)
        return None

    return {"apply": apply}


def _build_tf_keras(optimizer: Any, variables: Sequence[Any]) -> None:
    with tf.init_scope():
        if callable(getattr(optimizer, "_create_all_weights", None)):  # legacy optimizers
            optimizer._create_all_weights(list(variables))
        else:
            optimizer.build(list(variables))


def _tf_keras_methods(base: type[Any]) -> dict[str, Any]:
    base_apply_gradients = base.apply_gradients

    def apply_gradients(self: Any, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        pairs = list(grads_and_vars)
        if not pairs:
            return base_apply_gradients(self, pairs, *args, **kwargs)
        _refuse_xla()
        state: HoraState = self._hora
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]
        if state.accumulator is None:
            reduced = state.reduce(grads, variables)
            return base_apply_gradients(self, list(zip(reduced, variables)), *args, **kwargs)
        _build_tf_keras(self, variables)

        def update(total: list[Any]) -> None:
            reduced = state.reduce(total, variables)
            base_apply_gradients(self, list(zip(reduced, variables)), *args, **kwargs)

        # tf_keras counts every call in ``iterations``, as Horovod's wrapper did.
        state.accumulator.step(grads, variables, update, lambda: self.iterations.assign_add(1))
        return self.iterations

    return {"apply_gradients": apply_gradients}


def _compute_gradients(
    self: Any, loss: Any, var_list: Any, grad_loss: Any = None, tape: Any = None
) -> list[tuple[Any, Any]]:
    """The gradients of ``loss`` (a tensor recorded on ``tape``, or a callable) for
    ``var_list``, as ``(gradient, variable)`` pairs, averaged across ranks.

    With ``backward_passes_per_step`` they are this rank's own: the average is taken on the call
    of ``apply_gradients`` that updates the weights.
    """
    variables = list(var_list() if callable(var_list) else var_list)
    tape = tf.GradientTape() if tape is None else tape
    if callable(loss):
        with tape:
            # Keras 3's variables are not tf.Variables; the tape records them when they are read.
            tape.watch([v for v in variables if isinstance(v, tf.Variable)])
            loss = loss()
    grads = list(tape.gradient(loss, variables, grad_loss))
    state: HoraState = self._hora
    if state.accumulator is None:
        _refuse_xla()
        grads = state.reducer.reduce(grads, variables)
        state.averaged = [g for g in grads if g is not None]
    return list(zip(grads, variables))


def _agg_helper(self: Any) -> GradientAccumulator | None:
    """The gradient accumulator (``None`` without ``backward_passes_per_step``)."""
    accumulator: GradientAccumulator | None = self._hora.accumulator
    return accumulator


def _register_local_var(self: Any, var: Any) -> None:
    """Keep ``var``'s gradient on this rank: it is not averaged (see
    ``PartialDistributedOptimizer``)."""
    self._hora.reducer.local_variables.add(id(var))


def distributed_class(base: type[Any], kind: str) -> type[Any]:
    """A subclass of the optimizer class ``base`` whose updates average gradients first.

    It keeps ``base``'s name, qualified name and module, so Keras saves it as ``base``.
    """
    methods = _keras3_methods(base) if kind == KERAS3 else _tf_keras_methods(base)
    methods["register_local_var"] = _register_local_var
    methods["_compute_gradients"] = _compute_gradients
    methods["_agg_helper"] = property(_agg_helper)
    methods["__module__"] = base.__module__
    methods["__qualname__"] = base.__qualname__
    methods["__doc__"] = base.__doc__
    return type(base.__name__, (base,), methods)


def attach(optimizer: Any, state: HoraState) -> None:
    """Give a wrapped optimizer its hora state without Keras tracking it (it is never saved)."""
    object.__setattr__(optimizer, "_hora", state)


def wrap(optimizer: Any, state: HoraState, name: str | None = None) -> Any:
    """A new optimizer, of the distributed subclass, made from ``optimizer``'s config; named
    ``name`` when given (Keras's ``name`` option: it also prefixes the optimizer's variables)."""
    cls = distributed_class(type(optimizer), flavor(optimizer))
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    wrapped = cls.from_config(config)
    attach(wrapped, state)
    return wrapped


def wrap_in_place(optimizer: Any, state: HoraState) -> Any:
    """Turn ``optimizer`` itself into a distributed one, keeping its variables and state."""
    cls = distributed_class(type(optimizer), flavor(optimizer))
    object.__setattr__(optimizer, "__class__", cls)
    attach(optimizer, state)
    return optimizer
