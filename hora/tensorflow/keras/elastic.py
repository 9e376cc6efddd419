"""Elastic training with Keras ``model.fit``: ``hvd.elastic.KerasState`` and its callbacks.

Usage::

    import hora.tensorflow.keras as hvd

    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(opt), loss=...)
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    @hvd.elastic.run
    def train(state):
        model.fit(dataset, steps_per_epoch=steps, epochs=epochs - state.epoch, callbacks=[
            hvd.elastic.CommitStateCallback(state, batches_per_commit=10),
            hvd.elastic.UpdateBatchStateCallback(state),
            hvd.elastic.UpdateEpochStateCallback(state),
        ])

    train(state)

After a reset, ``run`` restores the last commit and calls ``train`` again, and the epoch count
goes on from ``state.epoch``. ``state.batch`` says how many batches of that epoch the commit had
done; Keras cannot start an epoch in its middle (``steps_per_epoch`` is fixed when ``fit``
starts), so to skip them, give the first ``fit`` after a reset a dataset that skips them (for a
``tf.data`` dataset, ``.skip(state.batch)`` on the batched dataset) with ``steps_per_epoch``
reduced by as many; otherwise the first epoch runs whole again.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hora.tensorflow.elastic import (
    HoraInternalError,
    HostsUpdatedInterrupt,
    ObjectState,
    TensorFlowKerasState,
    TensorFlowState,
    run,
)

_keras: Any = tf.keras

KerasState = TensorFlowKerasState

__all__ = [
    "CommitStateCallback",
    "HoraInternalError",
    "HostsUpdatedInterrupt",
    "KerasState",
    "ObjectState",
    "TensorFlowKerasState",
    "TensorFlowState",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "run",
]


class CommitStateCallback(_keras.callbacks.Callback):  # type: ignore[misc]
    """Commit ``state`` every ``batches_per_commit`` batches and at the end of every epoch.

    A commit falls due at the end of such a batch (or epoch) and is made when the next batch or
    epoch begins, or training ends: by then every callback has seen the batch's end, so the
    commit holds the ``state.batch`` and ``state.epoch`` that the update callbacks set, in
    whatever order the callbacks are listed.
    """

    def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
        super().__init__()
        if batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be 1 or more, got {batches_per_commit}.")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self._left = batches_per_commit
        self._due = False

    def on_train_begin(self, logs: Any = None) -> None:
        self._left = self.batches_per_commit  # every rank counts from the same point
        self._due = False

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self._left -= 1
        if self._left == 0:
            self._due = True
            self._left = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self._due = True

    def _commit_if_due(self) -> None:
        if self._due:
            self._due = False
            self.state.commit()

    def on_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._commit_if_due()

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._commit_if_due()

    def on_train_end(self, logs: Any = None) -> None:
        self._commit_if_due()


class UpdateBatchStateCallback(_keras.callbacks.Callback):  # type: ignore[misc]
    """Keep ``state.batch`` at the number of batches done in the current epoch (0 between
    epochs). Resuming in the middle of an epoch is the training function's part (see the
    module's description): ``state.batch`` holds where to resume; its first batch counts from
    there."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self._offset = 0

    def on_train_begin(self, logs: Any = None) -> None:
        self._offset = int(self.state.batch)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = 0
        self._offset = 0

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self.state.batch = self._offset + int(batch) + 1


class UpdateEpochStateCallback(_keras.callbacks.Callback):  # type: ignore[misc]
    """Keep ``state.epoch`` at the number of epochs done, across resets (Keras counts each
    ``fit`` from 0)."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self._start = int(state.epoch)

    def on_train_begin(self, logs: Any = None) -> None:
        self._start = int(self.state.epoch)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.epoch = self._start + int(epoch) + 1
