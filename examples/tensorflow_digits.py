"""Data-parallel training with TensorFlow 2 and a custom ``tf.GradientTape`` loop, the Horovod way.

Run it on two workers::

    horarun -np 2 python examples/tensorflow_digits.py

The digits (1,797 images of 8x8 pixels, 10 classes) ship inside scikit-learn, so nothing is
downloaded. The recipe: ``hvd.init()``; the learning rate scaled by the number of workers; each
worker trains on its own shard; ``hvd.DistributedGradientTape`` averages the gradients inside a
``tf.function`` step; every rank starts from rank 0's weights (``hvd.broadcast_variables`` after
the first step, once the optimizer's variables exist); the test accuracy is averaged with
``hvd.allreduce``.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # TensorFlow's start-up messages

# From hora's extras: when one is missing, one line says what to install, not a traceback.
try:
    import tensorflow as tf
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
except ModuleNotFoundError as missing:
    sys.exit(
        f"{os.path.basename(__file__)} needs {missing.name}, which is not installed: "
        "pip install 'hora[examples,tensorflow]'"
    )

import numpy as np

import hora.tensorflow as hvd


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="hora example: TensorFlow on the digits data")
    parser.add_argument("--epochs", type=int, default=15, help="epochs to train")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per worker")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate of one worker")
    parser.add_argument("--seed", type=int, default=42, help="seed of the split and the model")
    return parser.parse_args()


def load_shard(seed: int) -> tuple[tf.data.Dataset, int, np.ndarray, np.ndarray]:
    """This rank's shard of the training set, the smallest shard's size, and the test set."""
    digits = load_digits()
    x = (digits.images / 16.0).reshape(-1, 64).astype("float32")
    y = digits.target.astype("int64")
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=seed)
    shard = slice(hvd.rank(), None, hvd.size())  # every size-th sample, from this rank's
    train = tf.data.Dataset.from_tensor_slices((x_train[shard], y_train[shard]))
    return train, len(x_train) // hvd.size(), x_test, y_test


def main() -> None:
    args = parse_args()
    hvd.init()
    tf.keras.utils.set_random_seed(
        args.seed + hvd.rank()
    )  # different inits: the broadcast fixes it
    train, smallest, x_test, y_test = load_shard(args.seed)
    model = tf.keras.Sequential(
        [
            tf.keras.Input((64,)),
            tf.keras.layers.Dense(64, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )
    optimizer = tf.keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    first = True
    for epoch in range(args.epochs):
        # Every rank takes the same number of steps (the shards differ by at most one sample).
        batches = train.shuffle(2048, seed=args.seed + epoch).batch(args.batch_size)
        for x, y in batches.take(smallest // args.batch_size):
            loss = step(x, y)
            if first:
                # The optimizer's variables exist after its first step: start everyone from
                # rank 0's model and optimizer state.
                hvd.broadcast_variables(model.variables, root_rank=0)
                hvd.broadcast_variables(optimizer.variables, root_rank=0)
                first = False
        predictions = tf.argmax(model(x_test), axis=1)
        accuracy = float(np.mean(predictions.numpy() == y_test))
        mean = float(hvd.allreduce(tf.constant(accuracy), name="accuracy"))
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1}: loss {float(loss):.4f}, test accuracy {mean:.4f}")
    if hvd.rank() == 0:
        print(f"final test accuracy {mean:.4f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
