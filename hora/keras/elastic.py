"""``hora.keras.elastic``: Horovod's ``horovod.keras.elastic`` import path for the elastic Keras
API of :mod:`hora.tensorflow.keras.elastic` (the same objects).

Example:
    >>> import hora.keras as hvd
    >>> state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    >>> callbacks = [hvd.elastic.CommitStateCallback(state, batches_per_commit=10),
    ...              hvd.elastic.UpdateBatchStateCallback(state),
    ...              hvd.elastic.UpdateEpochStateCallback(state)]
"""

from __future__ import annotations

from hora.tensorflow.keras.elastic import *  # noqa: F403 - the alias re-exports everything
from hora.tensorflow.keras.elastic import __all__ as _all

__all__ = list(_all)
