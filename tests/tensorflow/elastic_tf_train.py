"""An elastic TensorFlow job whose every committed step can be checked afterwards.

Linear regression on ``SAMPLES`` fixed samples: a Keras ``Dense(1)`` trained with plain SGD in a
``tf.function`` step through ``hvd.DistributedGradientTape``, under ``hvd.elastic.run`` with a
``TensorFlowKerasState`` that commits every ``COMMIT_EVERY`` batches. Each step, every rank takes
the next ``BATCH`` samples of the epoch's not yet processed ones (so the split follows the number
of ranks after a reset), and the committed state records which samples each rank used. Rank 0
writes that history and the final weights to ``$ELASTIC_RESULT``; :func:`replay` recomputes the
weights from the history on one process.

``ELASTIC_KILL=worker_id,epoch,batch`` makes that worker SIGKILL itself before that batch of its
first round.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import numpy as np

SAMPLES = 36
FEATURES = 4
BATCH = 2
EPOCHS = 3
COMMIT_EVERY = 2
LR = 0.05


def data() -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((SAMPLES, FEATURES)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32) + 0.1).astype(np.float32)
    return x, y


def order(epoch: int) -> list[int]:
    """The epoch's sample order (the same on every rank)."""
    return [int(i) for i in np.random.default_rng(100 + epoch).permutation(SAMPLES)]


def main() -> None:
    import tensorflow as tf

    import hora.tensorflow as hvd
    from hora.common.job import rounds as protocol

    hvd.init()
    x, y = data()
    model = tf.keras.Sequential([tf.keras.Input((FEATURES,)), tf.keras.layers.Dense(1)])
    model.set_weights([np.zeros((FEATURES, 1), np.float32), np.zeros((1,), np.float32)])
    optimizer = tf.keras.optimizers.SGD(LR)
    state = hvd.elastic.TensorFlowKerasState(
        model, optimizer, epoch=0, batch=0, processed=[], history=[]
    )
    kill = os.environ.get("ELASTIC_KILL", "")
    me = os.environ.get(protocol.WORKER_ID_VAR, "")
    first_round = protocol.progress().plan.number if protocol.progress().plan else 0

    @tf.function(reduce_retracing=True)
    def step(xb: Any, yb: Any) -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum((model(xb) - yb) ** 2) / BATCH
        grads = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    def maybe_die() -> None:
        if not kill:
            return
        who, epoch, batch = kill.split(",")
        current = protocol.progress().plan.number if protocol.progress().plan else 0
        if (
            who == me
            and current == first_round
            and (state.epoch, state.batch)
            == (
                int(epoch),
                int(batch),
            )
        ):
            os.kill(os.getpid(), signal.SIGKILL)

    @hvd.elastic.run
    def train(state: Any) -> None:
        while state.epoch < EPOCHS:
            while True:
                done = set(state.processed)
                left = [i for i in order(state.epoch) if i not in done]
                if not left:
                    break
                maybe_die()
                mine = left[hvd.rank() * BATCH : (hvd.rank() + 1) * BATCH]
                step(x[mine].reshape(-1, FEATURES), y[mine].reshape(-1, 1))
                everyone = hvd.allgather_object(mine)
                state.history.append([state.epoch, everyone])
                state.processed.extend(i for batch in everyone for i in batch)
                state.batch += 1
                if state.batch % COMMIT_EVERY == 0:
                    state.commit()
            state.epoch += 1
            state.batch = 0
            state.processed = []
            state.commit()

    train(state)
    if hvd.rank() == 0:
        kernel, bias = model.get_weights()
        result = {
            "history": state.history,
            "weight": kernel.reshape(-1).tolist(),
            "bias": bias.tolist(),
            "size": hvd.size(),
            "round": protocol.progress().plan.number if protocol.progress().plan else 0,
        }
        with open(os.environ["ELASTIC_RESULT"], "w") as f:
            json.dump(result, f)
    hvd.shutdown()


def replay(history: list[Any]) -> tuple[list[float], list[float]]:
    """The final weights the committed steps imply, computed on one process."""
    x, y = data()
    w = np.zeros((FEATURES, 1), np.float64)
    b = np.zeros((1,), np.float64)
    for _epoch, batches in history:
        gw, gb = np.zeros_like(w), np.zeros_like(b)
        for batch in batches:
            if batch:
                residual = x[batch] @ w + b - y[batch]
                gw += 2.0 / BATCH * x[batch].T @ residual
                gb += 2.0 / BATCH * residual.sum(axis=0)
        w -= LR * gw / len(batches)
        b -= LR * gb / len(batches)
    return w.reshape(-1).tolist(), b.tolist()


if __name__ == "__main__":
    main()
