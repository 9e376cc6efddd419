"""``import hora.keras as hvd``: the same API as :mod:`hora.tensorflow.keras`.

Keras 3 runs on TensorFlow here, as ``tf.keras`` does, so the two modules are one; this name is
kept for scripts written for ``horovod.keras``.

Example:
    >>> import hora.keras as hvd
    >>> hvd.init()
    >>> opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
"""

from __future__ import annotations

from hora.tensorflow.keras import *  # noqa: F403 - the alias re-exports everything
from hora.tensorflow.keras import __all__ as _all

__all__ = list(_all)


def __getattr__(name: str) -> object:
    # Names the Keras module loads on first use (hvd.elastic).
    import hora.tensorflow.keras as _keras

    return getattr(_keras, name)
