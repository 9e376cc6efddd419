"""Keras callbacks for data-parallel training with hora.

They subclass the callbacks of the Keras that ``tf.keras`` resolves to (Keras 3, or tf_keras
with ``TF_USE_LEGACY_KERAS=1``) and work with the optimizers of both.

Example:
    >>> callbacks = [
    ...     hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    ...     hvd.callbacks.MetricAverageCallback(),
    ...     hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1 * hvd.size()),
    ... ]
    >>> model.fit(x, y, epochs=10, callbacks=callbacks)
"""

from __future__ import annotations

import hashlib
import numbers
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from hora.common import api
from hora.tensorflow import ops
from hora.tensorflow.functions import allgather_object, broadcast_variables

_keras: Any = tf.keras

__all__ = [
    "BestModelCheckpoint",
    "BroadcastGlobalVariablesCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
]


def _optimizer_variables(optimizer: Any) -> list[Any]:
    """An optimizer's variables (a property in Keras 3 and tf_keras, a method in legacy ones),
    with its learning rate variable, which tf_keras keeps out of that list."""
    if optimizer is None:
        return []
    found = optimizer.variables
    variables = list(found() if callable(found) else found)
    rate = getattr(optimizer, "_learning_rate", None)
    if callable(getattr(rate, "assign", None)) and all(v is not rate for v in variables):
        variables.append(rate)
    return variables


class BroadcastGlobalVariablesCallback(_keras.callbacks.Callback):  # type: ignore[misc]
    """Make every rank start from ``root_rank``'s weights and optimizer state.

    At the start of training, the model's variables are broadcast if the model is built, so
    the first batch already starts from the same weights everywhere; after the first batch, the
    model's and the optimizer's variables are broadcast (the optimizer's slots exist by then).
    This happens once per callback: give each ``fit`` a new callback to broadcast again.

    Args:
        root_rank: the rank whose values every rank takes.
        device: accepted for compatibility.
        local_variables: a variable or list of variables that keep each rank's value.

    Example:
        >>> model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    """

    def __init__(self, root_rank: int, device: str = "", local_variables: Any = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self._local_ids: set[int] = set()
        if local_variables is None:
            local_variables = []
        elif not isinstance(local_variables, (list, tuple, set)):
            local_variables = [local_variables]
        for variable in local_variables:
            self.register_local_var(variable)

    def register_local_var(self, var: Any) -> None:
        """Leave ``var`` out of the broadcast: each rank keeps its own value."""
        if not callable(getattr(var, "assign", None)):
            raise ValueError(
                "local_variables takes variables (tf.Variable or Keras variables, such as "
                f"layer.kernel); got {type(var).__name__}."
            )
        self._local_ids.add(id(var))

    def _broadcast(self, with_optimizer: bool) -> None:
        variables = [v for v in self.model.variables if id(v) not in self._local_ids]
        if with_optimizer:
            variables += _optimizer_variables(getattr(self.model, "optimizer", None))
        broadcast_variables(variables, root_rank=self.root_rank)

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        # The optimizer may not be built yet on every rank (tf_keras builds it at the first
        # step): its variables wait for the end of the first batch.
        if not self.broadcast_done and self.model.built:
            self._broadcast(with_optimizer=False)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self.broadcast_done:
            return
        self._broadcast(with_optimizer=True)
        self.broadcast_done = True


def _is_number(value: Any) -> bool:
    """Whether a ``logs`` entry is a real scalar (a number, a 0-d array or tensor)."""
    if isinstance(value, (bool, str, bytes)):
        return False
    try:
        array = np.asarray(value)
    except (TypeError, ValueError):
        return False
    return array.shape == () and array.dtype.kind in "fiu"


class MetricAverageCallback(_keras.callbacks.Callback):  # type: ignore[misc]
    """Average the epoch's metrics (everything numeric in ``logs``) over the ranks.

    Put it before the callbacks that read the metrics (``ReduceLROnPlateau``, ``TensorBoard``,
    ``EarlyStopping``, checkpoints) so that they see the averages and act alike on every rank.
    Metrics that some ranks do not report are left as they are, with a warning.

    Args:
        device: accepted for compatibility.

    Example:
        >>> model.fit(x, y, validation_data=(vx, vy),
        ...           callbacks=[hvd.callbacks.MetricAverageCallback()])
    """

    def __init__(self, device: str = "") -> None:
        super().__init__()
        self.device = device
        self._warned: set[str] = set()

    def _common_names(self, names: list[str]) -> list[str]:
        everyone = allgather_object(names)
        common = [n for n in names if all(n in theirs for theirs in everyone)]
        missing = sorted({n for theirs in everyone for n in theirs} - set(common) - self._warned)
        if missing:
            self._warned.update(missing)
            warnings.warn(
                f"MetricAverageCallback: {missing} are not reported by every rank, so they are "
                "not averaged (give every rank the same metrics and validation data).",
                stacklevel=3,
            )
        return common

    def _average(self, logs: dict[str, Any]) -> None:
        names = self._common_names(sorted(k for k, v in logs.items() if _is_number(v)))
        if not names:
            return
        values = tf.constant([float(np.asarray(logs[n])) for n in names], dtype=tf.float64)
        digest = hashlib.sha1("\n".join(names).encode()).hexdigest()[:16]
        averaged = ops.allreduce(values, op=ops.Average, name=f"hora.metrics.{digest}")
        for name, value in zip(names, averaged.numpy()):
            logs[name] = float(value)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            self._average(logs)


# ---------------------------------------------------------------- learning rate


def _learning_rate_source(optimizer: Any) -> Any:
    """The optimizer's learning rate as stored: a variable, a number or a schedule."""
    source = getattr(optimizer, "_learning_rate", None)  # Keras 3, tf_keras
    if source is None:
        source = getattr(optimizer, "_hyper", {}).get("learning_rate")  # tf_keras legacy
    if source is None:
        source = getattr(optimizer, "learning_rate", None)
    if source is None:
        raise ValueError(
            f"{type(optimizer).__name__} has no learning rate for hora's learning rate "
            "callbacks to set."
        )
    return source


def _schedule_error(optimizer: Any) -> TypeError:
    return TypeError(
        "hora's learning rate callbacks set the optimizer's learning rate, but "
        f"{type(optimizer).__name__}'s is a LearningRateSchedule (or a function). Create the "
        "optimizer with a float learning_rate, or drop the callback and put the warmup in "
        "the schedule."
    )


def get_learning_rate(optimizer: Any) -> float:
    """The optimizer's current learning rate, as a float."""
    source = _learning_rate_source(optimizer)
    if isinstance(source, numbers.Number):
        return float(source)  # type: ignore[arg-type]
    if callable(getattr(source, "assign", None)):
        return float(np.asarray(source.numpy()))
    raise _schedule_error(optimizer)


def set_learning_rate(optimizer: Any, value: float) -> None:
    """Set the optimizer's learning rate (assigned to its variable where it has one)."""
    source = _learning_rate_source(optimizer)
    if callable(getattr(source, "assign", None)):
        source.assign(value)
    elif isinstance(source, numbers.Number):
        optimizer.learning_rate = value
    else:
        raise _schedule_error(optimizer)


class _Momentum:
    """Scales an optimizer's momentum for one batch and puts it back afterwards.

    A momentum held in a variable (tf_keras legacy optimizers) is assigned. A Python number
    (Keras 3 and tf_keras optimizers) is read when the training step is traced: changing it
    only has an effect, and is only safe, when the model runs eagerly; otherwise the correction
    is skipped, with one warning.
    """

    def __init__(self) -> None:
        self._restore: Callable[[], None] | None = None
        self._warned = False

    def scale(self, model: Any, factor: float) -> None:
        optimizer = model.optimizer
        momentum = getattr(optimizer, "momentum", None)
        if momentum is None or factor == 1.0:
            return
        if callable(getattr(momentum, "assign", None)):
            old = float(np.asarray(momentum.numpy()))
            momentum.assign(old * factor)
            self._restore = lambda: momentum.assign(old)
        elif isinstance(momentum, numbers.Number) and getattr(model, "run_eagerly", False):
            number = float(momentum)  # type: ignore[arg-type]
            optimizer.momentum = number * factor
            self._restore = lambda: setattr(optimizer, "momentum", number)
        elif isinstance(momentum, numbers.Number) and momentum and not self._warned:
            self._warned = True
            warnings.warn(
                "Momentum correction skipped (the learning rate is still adjusted): "
                f"{type(optimizer).__name__}'s momentum is a Python number compiled into the "
                "training step, so it can only change when the model runs eagerly "
                "(model.compile(..., run_eagerly=True)). Pass momentum_correction=False to the "
                "learning rate callback to silence this warning.",
                stacklevel=4,
            )

    def restore(self) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = None


class LearningRateScheduleCallback(_keras.callbacks.Callback):  # type: ignore[misc]
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` up to
    (not including) ``end_epoch``.

    With ``staircase=True`` the learning rate changes at the first batch of each epoch, and
    ``multiplier`` gets the epoch number; otherwise it changes at every batch and gets
    ``epoch + batch / steps_per_epoch``. A number ``multiplier`` means
    ``multiplier ** (epoch - start_epoch)``. The learning rate is logged as ``lr``.

    Args:
        initial_lr: the learning rate the multiplier scales.
        multiplier: a number or a function of the (fractional) epoch.
        start_epoch: the first epoch adjusted.
        end_epoch: the first epoch no longer adjusted (``None``: never stops).
        staircase: adjust per epoch (``True``) or per batch.
        momentum_correction: scale the optimizer's momentum by ``new_lr / old_lr`` for the
            batch where the learning rate changes (where it can; see the docs).
        steps_per_epoch: batches per epoch; found from ``model.fit``'s parameters if omitted.

    Example:
        >>> # divide the learning rate by 10 at epochs 30, 60 and 80
        >>> hvd.callbacks.LearningRateScheduleCallback(0.1, 0.1, start_epoch=30, end_epoch=60)
    """

    def __init__(
        self,
        initial_lr: float,
        multiplier: float | Callable[[float], float],
        start_epoch: int = 0,
        end_epoch: int | None = None,
        staircase: bool = True,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
    ) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError(
                "initial_lr is required: the learning rate that the multiplier scales (usually "
                "the optimizer's learning rate, times hvd.size())."
            )
        self.initial_lr = float(initial_lr)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch: int | None = None
        if callable(multiplier):
            self.multiplier: Callable[[float], float] = multiplier
        else:
            factor = float(multiplier)
            self.multiplier = lambda epoch: factor ** (epoch - start_epoch)
        self._momentum = _Momentum()

    def _find_steps_per_epoch(self) -> int:
        params = self.params or {}
        if params.get("steps"):
            return int(params["steps"])
        if params.get("samples") and params.get("batch_size"):
            return int(params["samples"]) // int(params["batch_size"])
        raise ValueError(
            f"{type(self).__name__} could not tell how many batches an epoch has (the data has "
            "no known length): pass steps_per_epoch= to the callback."
        )

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._find_steps_per_epoch()

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.current_epoch = epoch

    def _in_range(self) -> bool:
        epoch = self.current_epoch if self.current_epoch is not None else 0
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _adjust(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old_lr = get_learning_rate(optimizer)
        new_lr = self.initial_lr * self.multiplier(epoch)
        set_learning_rate(optimizer, new_lr)
        if self.momentum_correction and old_lr:
            self._momentum.scale(self.model, new_lr / old_lr)

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if not self._in_range():
            return
        epoch = self.current_epoch if self.current_epoch is not None else 0
        if not self.staircase:
            assert self.steps_per_epoch
            self._adjust(epoch + float(batch) / self.steps_per_epoch)
        elif batch == 0:
            self._adjust(epoch)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._momentum.restore()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            logs["lr"] = get_learning_rate(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Raise the learning rate gradually, batch by batch, from ``initial_lr / hvd.size()`` to
    ``initial_lr`` over ``warmup_epochs`` epochs (Goyal et al., "Accurate, Large Minibatch SGD").

    At batch ``b`` of epoch ``e`` (``steps_per_epoch`` batches per epoch), with
    ``t = e + (b + 1) / steps_per_epoch`` and ``n = hvd.size()``::

        lr = initial_lr / n * (t * (n - 1) / warmup_epochs + 1)

    so the last batch of the warmup runs at ``initial_lr``, which then stays.

    Args:
        initial_lr: the learning rate reached at the end of the warmup (usually the
            single-process learning rate times ``hvd.size()``).
        warmup_epochs: the warmup's length in epochs.
        momentum_correction: see :class:`LearningRateScheduleCallback`.
        steps_per_epoch: batches per epoch; found from ``model.fit``'s parameters if omitted.
        verbose: 1: rank 0 prints a line when the warmup ends.

    Example:
        >>> hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1 * hvd.size(), warmup_epochs=3)
    """

    def __init__(
        self,
        initial_lr: float,
        warmup_epochs: int = 5,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ) -> None:
        def multiplier(epoch: float) -> float:
            assert self.steps_per_epoch
            reached = epoch + 1.0 / self.steps_per_epoch
            n = api.size()
            return 1.0 / n * (reached * (n - 1) / warmup_epochs + 1)

        super().__init__(
            initial_lr,
            multiplier,
            start_epoch=0,
            end_epoch=warmup_epochs,
            staircase=False,
            momentum_correction=momentum_correction,
            steps_per_epoch=steps_per_epoch,
        )
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose > 0 and api.rank() == 0:
            lr = get_learning_rate(self.model.optimizer)
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {lr:g}.")


# ---------------------------------------------------------------- checkpoints


class BestModelCheckpoint(_keras.callbacks.ModelCheckpoint):  # type: ignore[misc]
    """Keep the best model seen so far (``save_best_only``); only rank 0 writes it.

    The file is not given when the callback is made: set ``callback.filepath`` before
    training (tools that run the training for you, like an estimator, set it), or pass
    ``filepath=``. Keras 3 wants a ``.keras`` file (``.weights.h5`` with
    ``save_weights_only=True``).

    Args:
        monitor: the metric that decides which model is best.
        verbose: 1: say when a model is saved.
        save_weights_only: save the weights only.
        mode: ``"auto"``, ``"min"`` or ``"max"``: whether a lower or higher ``monitor`` is
            better (``"auto"``: higher for accuracies).
        save_freq: ``"epoch"``, or a number of batches.
        filepath: where to write; may be set later as ``callback.filepath``.

    Example:
        >>> best = hvd.callbacks.BestModelCheckpoint(monitor="val_loss")
        >>> best.filepath = "checkpoints/best.keras"
        >>> model.fit(x, y, validation_data=(vx, vy), callbacks=[best])
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq: str | int = "epoch",
        filepath: str | None = None,
    ) -> None:
        # Keras 3 checks the file's extension here: give it one that passes, then unset it.
        placeholder = "unset.weights.h5" if save_weights_only else "unset.keras"
        super().__init__(
            filepath=placeholder,
            monitor=monitor,
            verbose=verbose,
            save_best_only=True,
            save_weights_only=save_weights_only,
            mode=mode,
            save_freq=save_freq,
        )
        self.filepath = filepath

    def _save_model(self, epoch: int, batch: int | None, logs: dict[str, Any] | None) -> None:
        if api.rank() != 0:
            return
        if not self.filepath:
            raise ValueError(
                "BestModelCheckpoint has no file to write to: set callback.filepath (for "
                "example 'checkpoints/best.keras') before model.fit, or pass filepath=."
            )
        super()._save_model(epoch, batch, logs)
