"""hora for PyTorch Lightning: ``Trainer(strategy="hora")``.

Importing this module registers the ``"hora"`` strategy name with Lightning's
``StrategyRegistry`` (Lightning has no entry point through which a package could register a
strategy by itself, so the import is needed before ``Trainer(strategy="hora")``; passing
``strategy=HoraStrategy()`` needs it anyway). ``import hora`` and ``import hora.torch`` never
import Lightning. Install with ``pip install 'hora[lightning]'``.

Example::

    import lightning as L
    import hora.lightning  # registers strategy="hora"

    trainer = L.Trainer(strategy="hora", max_epochs=5)
    trainer.fit(model, train_dataloaders=loader)

Launch the script with ``horarun -np 4 python train.py``. See docs/lightning.md.
"""

from __future__ import annotations

from hora.lightning._compat import PACKAGE, StrategyRegistry
from hora.lightning.environment import HoraEnvironment
from hora.lightning.strategy import HoraStrategy

HoraStrategy.register_strategies(StrategyRegistry)

__all__ = ["PACKAGE", "HoraEnvironment", "HoraStrategy"]
