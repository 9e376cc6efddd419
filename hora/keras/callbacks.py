"""``hora.keras.callbacks``: the callbacks of :mod:`hora.tensorflow.keras.callbacks`, with
``horovod.keras``'s parameter order where it differs (``BestModelCheckpoint``)."""

from __future__ import annotations

from hora.tensorflow.keras import callbacks as _callbacks
from hora.tensorflow.keras.callbacks import *  # noqa: F403 - the alias re-exports everything
from hora.tensorflow.keras.callbacks import __all__ as _all


class BestModelCheckpoint(_callbacks.BestModelCheckpoint):  # type: ignore[no-redef]
    """:class:`hora.tensorflow.keras.callbacks.BestModelCheckpoint` with ``horovod.keras``'s
    parameter order: ``(monitor, verbose, mode, save_freq)``; ``save_weights_only`` and
    ``filepath`` are keyword-only.

    Example:
        >>> best = hvd.callbacks.BestModelCheckpoint("val_loss", 0, "min")
        >>> best.filepath = "checkpoints/best.keras"
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        verbose: int = 0,
        mode: str = "auto",
        save_freq: str | int = "epoch",
        *,
        save_weights_only: bool = False,
        filepath: str | None = None,
    ) -> None:
        super().__init__(monitor, verbose, save_weights_only, mode, save_freq, filepath)


__all__ = list(_all)
