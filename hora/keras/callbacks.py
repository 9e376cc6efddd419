"""``hora.keras.callbacks``: the callbacks of :mod:`hora.tensorflow.keras.callbacks`."""

from __future__ import annotations

from hora.tensorflow.keras.callbacks import (
    BestModelCheckpoint,
    BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
)

__all__ = [
    "BestModelCheckpoint",
    "BroadcastGlobalVariablesCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
]
