"""Batch normalization whose batch statistics cover every rank's batch, for Keras 3 and tf_keras.

In training, each rank sums its inputs, their squares and their count over the normalized axes;
one allreduce adds these up across ranks, and every rank normalizes with the mean and variance
of the combined batch. The allreduce is differentiable, so the backward pass flows through the
combined statistics too. Outside training, and in a job of one, it is Keras's own layer.
"""

from __future__ import annotations

import inspect
from typing import Any

import tensorflow as tf

from hora.common import api
from hora.common.process_sets import ProcessSet
from hora.tensorflow import ops

_LOW_PRECISION = (tf.float16, tf.bfloat16)


def _synced_moments(
    inputs: tf.Tensor,
    axes: list[int],
    keepdims: bool,
    weights: tf.Tensor | None,
    name: str,
    process_set: ProcessSet,
) -> tuple[tf.Tensor, tf.Tensor]:
    """Mean and variance over ``axes`` of the inputs of every rank of ``process_set``."""
    values = tf.cast(inputs, tf.float32) if inputs.dtype in _LOW_PRECISION else inputs
    if weights is None:
        weights = tf.ones_like(values)
    weights = tf.cast(weights, values.dtype)
    total = tf.reduce_sum(values * weights, axes, keepdims=True)
    squares = tf.reduce_sum(tf.square(values) * weights, axes, keepdims=True)
    count = tf.reduce_sum(weights, axes, keepdims=True)
    shape = tf.shape(total)
    packed = tf.concat(
        [tf.reshape(total, [-1]), tf.reshape(squares, [-1]), tf.reshape(count, [-1])], 0
    )
    summed = ops.allreduce(packed, op=ops.Sum, name=name, process_set=process_set)
    total, squares, count = tf.split(summed, 3)
    count = tf.maximum(count, tf.cast(1e-12, values.dtype))
    mean = total / count
    variance = tf.maximum(squares / count - tf.square(mean), 0)
    mean, variance = tf.reshape(mean, shape), tf.reshape(variance, shape)
    if not keepdims:
        mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
    return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)


class SyncBatchNormalization(tf.keras.layers.BatchNormalization):  # type: ignore[misc]
    """``tf.keras.layers.BatchNormalization`` with batch statistics over all ranks.

    Args:
        fused: must be ``False`` (Horovod's default): a fused kernel computes the statistics of
            the local batch only, so ``True`` and ``None`` are refused, as Horovod refuses them.
        process_set: the ranks whose batches are combined (default: all); keyword-only.
        **kwargs: ``BatchNormalization``'s arguments (``axis``, ``momentum``, ``epsilon``, ...).

    Raises:
        ValueError: ``fused`` is ``True`` or ``None``.

    Example:
        >>> model = tf.keras.Sequential([tf.keras.layers.Dense(32),
        ...                              hvd.SyncBatchNormalization(), tf.keras.layers.ReLU()])
    """

    def __init__(
        self,
        fused: bool | None = False,
        *,
        process_set: ProcessSet = ops.global_process_set,
        **kwargs: Any,
    ) -> None:
        if fused is None or fused:
            raise ValueError(
                f"SyncBatchNormalization does not support fused={fused!r}: a fused kernel "
                "normalizes with the local batch's statistics only. Leave fused=False (the "
                "default); pass a process set as process_set=..."
            )
        if "fused" in inspect.signature(tf.keras.layers.BatchNormalization.__init__).parameters:
            kwargs["fused"] = False  # tf_keras: its fused kernel computes local statistics
        super().__init__(**kwargs)
        self._hora_process_set = process_set

    def _hora_synced(self) -> bool:
        process_set = self._hora_process_set
        if process_set is ops.global_process_set:
            return bool(api.is_initialized() and api.size() > 1)
        members = process_set.size()  # None: not registered, and the allreduce says so
        return members is None or members > 1

    def _hora_axes(self, inputs: tf.Tensor) -> list[int]:
        axis = self.axis if isinstance(self.axis, (list, tuple)) else [self.axis]
        rank = inputs.shape.rank
        kept = {a % rank for a in axis}
        return [i for i in range(rank) if i not in kept]

    def _moments(self, inputs: tf.Tensor, *args: Any, **kwargs: Any) -> tuple[tf.Tensor, tf.Tensor]:
        # tf_keras calls _moments(inputs, reduction_axes, keep_dims), which computes through
        # _calculate_mean_and_var (below); Keras 3 calls _moments(inputs, mask).
        if len(args) + len(kwargs) >= 2 or not self._hora_synced():
            return super()._moments(inputs, *args, **kwargs)  # type: ignore[no-any-return]
        mask = args[0] if args else kwargs.get("mask")
        weights = None
        if mask is not None:
            weights = tf.broadcast_to(tf.expand_dims(tf.cast(mask, inputs.dtype), -1),
                                      tf.shape(inputs))  # fmt: skip
        return _synced_moments(
            inputs,
            self._hora_axes(inputs),
            False,
            weights,
            f"hora.sync_batch_norm.{self.name}",
            self._hora_process_set,
        )

    # tf_keras (Keras 2)
    def _calculate_mean_and_var(
        self, inputs: tf.Tensor, reduction_axes: Any, keep_dims: bool, mask: Any = None
    ) -> tuple[tf.Tensor, tf.Tensor]:
        if not self._hora_synced():
            return super()._calculate_mean_and_var(  # type: ignore[no-any-return]
                inputs, reduction_axes, keep_dims, mask=mask
            )
        weights = None
        if mask is not None:
            weights = tf.broadcast_to(tf.cast(mask, inputs.dtype), tf.shape(inputs))
        return _synced_moments(
            inputs,
            list(reduction_axes),
            keep_dims,
            weights,
            f"hora.sync_batch_norm.{self.name}",
            self._hora_process_set,
        )

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config.pop("fused", None)
        return config
