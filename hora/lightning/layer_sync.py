"""``Trainer(sync_batchnorm=True)`` under :class:`~hora.lightning.HoraStrategy`: the layer sync
that turns a model's batch norm layers into :class:`hora.torch.SyncBatchNorm` for ``fit``, and
back afterwards.

Lightning's own layer sync makes ``torch.nn.SyncBatchNorm`` layers, which need
``torch.distributed``; this one gives the statistics to hora's collectives instead. It knows
modules and their layers; not the trainer, the optimizers or the strategy that calls it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

import hora.torch as hvd
from hora.lightning._compat import LayerSync


class HoraSyncBatchNorm(LayerSync):
    """``Trainer(sync_batchnorm=True)`` for hora: batch norm layers become
    :class:`hora.torch.SyncBatchNorm` (``torch.nn.SyncBatchNorm`` needs ``torch.distributed``);
    :meth:`revert` turns back only the layers :meth:`apply` converted."""

    def __init__(self) -> None:
        self._converted: set[int] = set()

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        return self._convert(model, to_sync=True)

    def revert(self, model: torch.nn.Module) -> torch.nn.Module:
        model = self._convert(model, to_sync=False)
        self._converted.clear()
        return model

    def _convert(self, module: torch.nn.Module, to_sync: bool) -> torch.nn.Module:
        converted = module
        if to_sync:
            wanted = isinstance(module, _BatchNorm) and not isinstance(module, hvd.SyncBatchNorm)
        else:
            wanted = id(module) in self._converted
        if wanted:
            assert isinstance(module, _BatchNorm)
            cls: Any = hvd.SyncBatchNorm if to_sync else _BatchNormXd
            converted = cls(
                module.num_features, module.eps, module.momentum, module.affine,
                module.track_running_stats,
            )  # fmt: skip
            if module.affine:
                converted.weight = module.weight
                converted.bias = module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.train(module.training)
            if to_sync:
                self._converted.add(id(converted))
        for name, child in module.named_children():
            converted.add_module(name, self._convert(child, to_sync))
        return converted


class _BatchNormXd(_BatchNorm):
    """A batch norm for any input rank (what a synchronised layer reverts to)."""

    def _check_input_dim(self, input: Tensor) -> None:
        return
