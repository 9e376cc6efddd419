"""``import hora.keras as hvd``: the same API as :mod:`hora.tensorflow.keras`.

Keras 3 runs on TensorFlow here, as ``tf.keras`` does, so the two modules are one; this name is
kept for scripts written for ``horovod.keras``. Where ``horovod.keras`` orders a function's
parameters differently from ``horovod.tensorflow.keras`` (``DistributedOptimizer`` here,
``callbacks.BestModelCheckpoint``), this module follows ``horovod.keras``.

Example:
    >>> import hora.keras as hvd
    >>> hvd.init()
    >>> opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
"""

from __future__ import annotations

import importlib
from typing import Any

from hora.common.process_sets import ProcessSet, global_process_set
from hora.tensorflow.compression import Compression
from hora.tensorflow.keras import *  # noqa: F403 - the alias re-exports everything
from hora.tensorflow.keras import Average
from hora.tensorflow.keras import DistributedOptimizer as _DistributedOptimizer
from hora.tensorflow.keras import __all__ as _all

__all__ = list(_all)

# The star import bound hora.tensorflow.keras's callbacks here; this package's own module
# (horovod.keras's parameter order) takes the name.
callbacks = importlib.import_module("hora.keras.callbacks")


def DistributedOptimizer(  # type: ignore[no-redef]  # Horovod's name, horovod.keras's order
    optimizer: Any,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: Any = Average,
    num_groups: int = 0,
    groups: Any = None,
    *,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> Any:
    """:func:`hora.tensorflow.keras.DistributedOptimizer` with ``horovod.keras``'s parameter
    order: ``num_groups`` and ``groups`` follow ``op``; the options that ``horovod.keras`` does
    not have are keyword-only.

    Example:
        >>> import hora.keras as hvd
        >>> opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    """
    return _DistributedOptimizer(**locals())  # every argument, by name


def __getattr__(name: str) -> object:
    # Names the Keras module loads on first use (hvd.elastic: this package's own module, which
    # `import hora.keras.elastic` also gives, with the same objects).
    if name == "elastic":
        return importlib.import_module("hora.keras.elastic")
    return getattr(importlib.import_module("hora.tensorflow.keras"), name)
