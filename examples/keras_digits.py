"""Data-parallel training with Keras's ``model.fit``, the Horovod way.

Run it on two workers::

    horarun -np 2 python examples/keras_digits.py
    TF_USE_LEGACY_KERAS=1 horarun -np 2 python examples/keras_digits.py   # under tf_keras

The digits (1,797 images of 8x8 pixels, 10 classes) ship inside scikit-learn, so nothing is
downloaded. The recipe: ``hvd.init()``; each worker fits its own shard of the training set; the
learning rate scaled by the number of workers and reached by a warmup;
``hvd.DistributedOptimizer`` averages the gradients; ``BroadcastGlobalVariablesCallback(0)``
starts every rank from rank 0's weights; ``MetricAverageCallback`` averages the logged metrics;
only rank 0 prints. The same script runs under Keras 3 and under tf_keras (Keras 2).
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

import hora.tensorflow.keras as hvd


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="hora example: Keras model.fit on the digits")
    parser.add_argument("--epochs", type=int, default=15, help="epochs to train")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per worker")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate of one worker")
    parser.add_argument("--warmup-epochs", type=int, default=2, help="epochs of warmup")
    parser.add_argument("--seed", type=int, default=42, help="seed of the split and the model")
    return parser.parse_args()


def load_data(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """This rank's shard of the training set and of the test set.

    Every training shard is cut to the same length, so every rank runs the same number of
    batches per epoch (a rank with one batch more would wait forever for the others).
    """
    digits = load_digits()
    x = (digits.images / 16.0).reshape(-1, 64).astype("float32")
    y = digits.target.astype("int64")
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=seed)
    rank, size = hvd.rank(), hvd.size()
    per_rank = len(x_train) // size
    train = slice(rank * per_rank, (rank + 1) * per_rank)
    test = slice(rank, None, size)  # every size-th test image, from this rank's
    return x_train[train], y_train[train], x_test[test], y_test[test]


def main() -> None:
    args = parse_args()
    hvd.init()
    # Different seeds give different initial weights: BroadcastGlobalVariablesCallback(0) below
    # replaces them with rank 0's. Each rank also shuffles its shard in its own order.
    tf.keras.utils.set_random_seed(args.seed + hvd.rank())
    x_train, y_train, x_test, y_test = load_data(args.seed)

    model = tf.keras.Sequential(
        [
            tf.keras.Input((64,)),
            tf.keras.layers.Dense(64, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )
    # N workers take N batches per step: scale the learning rate by N. DistributedOptimizer
    # averages the gradients over the workers before every update.
    scaled_lr = args.lr * hvd.size()
    optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(scaled_lr, momentum=0.9))
    model.compile(
        optimizer=optimizer,
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=False,  # hora's collectives cannot run inside XLA (Keras 3 uses it on GPUs)
    )

    callbacks = [
        # Every rank starts from rank 0's weights and optimizer state.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # The epoch's loss and accuracy, averaged over the ranks (before anything reads them).
        hvd.callbacks.MetricAverageCallback(),
        # Start at the one-worker rate and reach the scaled rate after --warmup-epochs: a large
        # rate from the first step can diverge. Momentum correction needs run_eagerly=True.
        hvd.callbacks.LearningRateWarmupCallback(
            initial_lr=scaled_lr, warmup_epochs=args.warmup_epochs, momentum_correction=False
        ),
    ]
    model.fit(
        x_train,
        y_train,
        batch_size=args.batch_size,
        epochs=args.epochs,
        callbacks=callbacks,
        verbose=2 if hvd.rank() == 0 else 0,  # one line per epoch, from rank 0 only
    )

    # Each rank scores its shard of the test set; the counts are summed over the ranks.
    predicted = np.argmax(model.predict(x_test, verbose=0), axis=1)
    counts = np.array([np.sum(predicted == y_test), len(y_test)], dtype=np.float64)
    correct, seen = hvd.allreduce(counts, op=hvd.Sum, name="test_counts")
    if hvd.rank() == 0:
        print(f"final test accuracy {correct / seen:.4f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
