"""The PyTorch Lightning names hora.lightning uses, from ``lightning`` or ``pytorch_lightning``.

``pip install 'hora[lightning]'`` installs the unified ``lightning`` package, whose trainer lives
in ``lightning.pytorch``; the standalone ``pytorch_lightning`` package (same code, other import
names) is used only when ``lightning`` is not installed. A strategy built on one is rejected by
the other's ``Trainer``, so with both installed hora.lightning serves ``lightning.pytorch``.
"""

from __future__ import annotations

from importlib.util import find_spec
from typing import TYPE_CHECKING

_MISSING = (
    "hora.lightning needs PyTorch Lightning 2.x, which is not installed. "
    "Install it with: pip install 'hora[lightning]'"
)

# mypy reads the first branch only.
if TYPE_CHECKING or find_spec("lightning") is not None:
    PACKAGE = "lightning.pytorch"
    from lightning.fabric.plugins import ClusterEnvironment
    from lightning.fabric.plugins.environments.lightning import find_free_network_port
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.plugins.layer_sync import LayerSync
    from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning_utilities.core.rank_zero import rank_zero_only
elif find_spec("pytorch_lightning") is not None:  # pragma: no cover - only without `lightning`
    PACKAGE = "pytorch_lightning"
    from lightning_fabric.plugins import ClusterEnvironment
    from lightning_fabric.plugins.environments.lightning import (
        find_free_network_port,
    )
    from lightning_utilities.core.rank_zero import rank_zero_only
    from pytorch_lightning import LightningModule, Trainer
    from pytorch_lightning.core.optimizer import LightningOptimizer
    from pytorch_lightning.plugins.layer_sync import LayerSync
    from pytorch_lightning.strategies import (
        ParallelStrategy,
        StrategyRegistry,
    )
    from pytorch_lightning.trainer.states import TrainerFn
else:
    raise ModuleNotFoundError(_MISSING, name="lightning")

__all__ = [
    "PACKAGE",
    "ClusterEnvironment",
    "LayerSync",
    "LightningModule",
    "LightningOptimizer",
    "ParallelStrategy",
    "StrategyRegistry",
    "Trainer",
    "TrainerFn",
    "find_free_network_port",
    "rank_zero_only",
]
