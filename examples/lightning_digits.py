"""PyTorch Lightning with hora: the digits CNN of pytorch_digits.py, trained by a ``Trainer``.

Run it on two workers::

    horarun -np 2 python examples/lightning_digits.py
    horarun -np 2 python examples/lightning_digits.py --epochs 5 --precision bf16-mixed

Needs ``pip install 'hora[examples,lightning]'``. ``import hora.lightning`` registers
``Trainer(strategy="hora")``; everything else is plain Lightning: the ``Trainer`` shards the
training set with a ``DistributedSampler`` (each rank sees 1/N of every epoch), the strategy
averages gradients across the ranks while backward runs and starts every rank from rank 0's
weights, and ``self.log(..., sync_dist=True)`` averages metrics over the ranks. As in Horovod's
recipe, the learning rate is scaled by the number of workers (the batch is N times larger).
The model and the data (scikit-learn's bundled digits, nothing to download) come from
pytorch_digits.py next to this file.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

# From hora's extras: when one is missing, one line says what to install, not a traceback.
try:
    import lightning as L
except ModuleNotFoundError as missing:
    sys.exit(
        f"{os.path.basename(__file__)} needs {missing.name}, which is not installed: "
        "pip install 'hora[examples,lightning]'"
    )

import torch
import torch.nn.functional as F
from pytorch_digits import DigitsNet, load_data
from torch.utils.data import DataLoader

import hora.lightning  # noqa: F401 - registers strategy="hora"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="hora + Lightning: a small CNN on the digits")
    parser.add_argument("--epochs", type=int, default=10, help="epochs to train")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per worker")
    parser.add_argument(
        "--lr", type=float, default=0.05, help="learning rate of one worker (scaled by size)"
    )
    parser.add_argument("--seed", type=int, default=42, help="seed of the split, model and order")
    parser.add_argument(
        "--precision", default="32-true", help="Trainer(precision=...), e.g. bf16-mixed"
    )
    parser.add_argument("--progress", action="store_true", help="show Lightning's progress bar")
    return parser.parse_args(argv)


class LitDigits(L.LightningModule):
    def __init__(self, lr: float, epochs: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = DigitsNet()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def _accuracy(self, batch: Any, name: str) -> None:
        images, labels = batch
        accuracy = (self(images).argmax(dim=1) == labels).float().mean()
        # Averaged over every rank's images (weighted by batch size): the whole test set.
        self.log(name, accuracy, sync_dist=True, batch_size=len(labels))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._accuracy(batch, "val_accuracy")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._accuracy(batch, "test_accuracy")

    def configure_optimizers(self) -> Any:
        # Horovod's rule: N workers take N times larger steps. (HoraStrategy(scale_lr=True)
        # would do this multiplication for you.)
        lr = self.hparams.lr * self.trainer.world_size
        optimizer = torch.optim.SGD(self.parameters(), lr=lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, self.hparams.epochs)
        return [optimizer], [scheduler]


class PrintEpochs(L.Callback):
    """One line per epoch on rank 0 (progress bars make poor logs under a launcher)."""

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        metrics = trainer.callback_metrics
        if trainer.is_global_zero and "val_accuracy" in metrics:
            print(
                f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs}: "
                f"train loss {metrics['train_loss']:.4f}, "
                f"test accuracy {metrics['val_accuracy']:.4f}",
                flush=True,
            )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # Workers share the cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    L.seed_everything(args.seed, verbose=False)
    train_set, test_set = load_data(args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=256)

    trainer = L.Trainer(
        strategy="hora",
        accelerator="auto",
        devices=1,  # per process: horarun starts one process per device
        max_epochs=args.epochs,
        precision=args.precision,
        callbacks=[PrintEpochs()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=args.progress,
        enable_model_summary=False,
    )
    if trainer.is_global_zero:
        print(
            f"training on {trainer.world_size} worker(s): {len(train_set)} train / "
            f"{len(test_set)} test images, {args.epochs} epochs",
            flush=True,
        )
    model = LitDigits(lr=args.lr, epochs=args.epochs)
    trainer.fit(model, train_dataloaders=train_loader, val_dataloaders=test_loader)
    (result,) = trainer.test(model, dataloaders=test_loader, verbose=False)
    if trainer.is_global_zero:
        print(f"final test accuracy: {result['test_accuracy']:.4f}", flush=True)


if __name__ == "__main__":
    main()
