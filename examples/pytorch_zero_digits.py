"""Sharded optimizer state (ZeRO stages 1 and 2) with hora, on scikit-learn's bundled digits.

Run it on two workers::

    horarun -np 2 python examples/pytorch_zero_digits.py                   # ZeRO stage 2
    horarun -np 2 python examples/pytorch_zero_digits.py --stage 1 --amp    # stage 1, float16
    horarun -np 2 python examples/pytorch_zero_digits.py --checkpoint-dir ckpt --epochs 4
    horarun -np 3 python examples/pytorch_zero_digits.py --checkpoint-dir ckpt --resume

The model and data are those of examples/pytorch_digits.py; what changes is the optimizer.
``hvd.DistributedOptimizer(AdamW, ..., shard_optimizer_state=True)`` keeps on each rank only its
shard of AdamW's two moments (``shard_gradients=True`` also frees each gradient once it has been
sent); gradients are reduce-scattered, each rank updates its shard, and the shards of the
parameters are gathered back. The script also shows:

* clipping by the global gradient norm, computed over every rank's shard
  (``optimizer.clip_grad_norm_``);
* mixed precision with a ``GradScaler`` (``--amp``): ``optimizer.synchronize()`` before
  ``scaler.unscale_``, so the scaler sees the reduced shards and every rank skips the same steps;
* checkpoints (``--checkpoint-dir``): one file of optimizer state per rank
  (``sharded_state_dict()``), and on ``--resume`` with another number of workers the files
  combined with ``consolidate_sharded_state_dicts`` and re-sharded by ``load_state_dict``.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

# From hora's extras: when one is missing, one line says what to install, not a traceback.
try:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
except ModuleNotFoundError as missing:
    sys.exit(
        f"{os.path.basename(__file__)} needs {missing.name}, which is not installed: "
        "pip install 'hora[examples]'"
    )

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import hora.torch as hvd
from hora.torch.zero_state import consolidate_sharded_state_dicts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="hora example: ZeRO on the digits data set")
    parser.add_argument("--stage", type=int, choices=(1, 2), default=2, help="ZeRO stage")
    parser.add_argument("--epochs", type=int, default=8, help="epochs to train (in total)")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per worker")
    parser.add_argument("--lr", type=float, default=2e-3, help="learning rate")
    parser.add_argument("--clip", type=float, default=1.0, help="largest global gradient norm")
    parser.add_argument("--amp", action="store_true", help="float16 autocast and a GradScaler")
    parser.add_argument("--checkpoint-dir", default=None, help="save state here every epoch")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir")
    args = parser.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir")
    return args


class DigitsNet(nn.Module):
    """Two 3x3 convolutions, one 2x2 pooling, two linear layers: about 40k parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def load_data() -> tuple[TensorDataset, TensorDataset]:
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    train_idx, test_idx = train_test_split(
        torch.arange(len(labels)).numpy(), test_size=0.2, random_state=42, stratify=digits.target
    )
    return (
        TensorDataset(images[train_idx], labels[train_idx]),
        TensorDataset(images[test_idx], labels[test_idx]),
    )


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of optimizer state this rank holds (its shard)."""
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def save(folder: str, model: nn.Module, optimizer: torch.optim.Optimizer, epoch: int) -> None:
    """Each rank writes its shard of the optimizer state; rank 0 the model and the epoch."""
    os.makedirs(folder, exist_ok=True)
    torch.save(optimizer.sharded_state_dict(), os.path.join(folder, f"optimizer.{hvd.rank()}.pt"))
    if hvd.rank() == 0:
        torch.save({"model": model.state_dict(), "epoch": epoch}, os.path.join(folder, "model.pt"))
        for path in glob.glob(os.path.join(folder, "optimizer.*.pt")):
            if int(path.rsplit(".", 2)[1]) >= hvd.size():  # left by a larger job
                os.remove(path)
    hvd.barrier()  # every file is written before anyone reads them


def resume(folder: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load the checkpoint; returns the epochs done. The per-rank files load as they are when
    the number of workers is the same, else they are combined and re-sharded."""
    saved = torch.load(os.path.join(folder, "model.pt"))
    model.load_state_dict(saved["model"])
    files = sorted(glob.glob(os.path.join(folder, "optimizer.*.pt")))
    if len(files) == hvd.size():
        optimizer.load_state_dict(torch.load(os.path.join(folder, f"optimizer.{hvd.rank()}.pt")))
    else:
        shards = [torch.load(path) for path in files]
        optimizer.load_state_dict(consolidate_sharded_state_dicts(shards))
    return int(saved["epoch"])


def train_epoch(
    args: argparse.Namespace,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader,
    scaler: torch.amp.GradScaler | None,
) -> float:
    model.train()
    total = torch.zeros(())
    for images, labels in loader:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
            loss = F.cross_entropy(model(images), labels)
        if scaler is not None:
            scaler.scale(loss).backward()
            optimizer.synchronize()  # this rank's shard of the reduced gradients
            scaler.unscale_(optimizer)  # unscales the shards; every rank finds the same infs
            optimizer.clip_grad_norm_(args.clip)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.clip_grad_norm_(args.clip)  # the norm over every rank's shard
            optimizer.step()
        total += loss.detach().float()
    return hvd.allreduce(total / len(loader), name="train_loss").item()


@torch.no_grad()
def evaluate(model: nn.Module, test_set: TensorDataset) -> float:
    model.eval()
    shard = Subset(test_set, range(hvd.rank(), len(test_set), hvd.size()))
    correct = torch.zeros((), dtype=torch.int64)
    for images, labels in DataLoader(shard, batch_size=256):
        correct += (model(images).argmax(dim=1) == labels).sum()
    total = hvd.allreduce(correct, op=hvd.Sum, name="correct").item()
    return total / len(test_set)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    train_set, test_set = load_data()
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    model = DigitsNet()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=args.lr),
        named_parameters=model.named_parameters(),
        shard_optimizer_state=True,
        shard_gradients=args.stage == 2,
    )
    start = resume(args.checkpoint_dir, model, optimizer) if args.resume else 0
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    scaler = torch.amp.GradScaler("cpu") if args.amp else None
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        loss = train_epoch(args, model, optimizer, loader, scaler)
        accuracy = evaluate(model, test_set)
        shards = hvd.allgather_object(state_bytes(optimizer), name="state_bytes")
        if hvd.rank() == 0:
            print(
                f"epoch {epoch + 1}/{args.epochs}: train loss {loss:.4f}, test accuracy "
                f"{accuracy:.4f}, optimizer state per rank {shards} bytes (stage {args.stage})",
                flush=True,
            )
        if args.checkpoint_dir:
            save(args.checkpoint_dir, model, optimizer, epoch + 1)
    final = evaluate(model, test_set)
    # The whole state, gathered on every rank: it loads into a plain torch.optim.AdamW too.
    whole = optimizer.state_dict()
    if hvd.rank() == 0:
        print(f"final test accuracy: {final:.4f}", flush=True)
        if args.checkpoint_dir:
            torch.save(whole, os.path.join(args.checkpoint_dir, "optimizer-consolidated.pt"))
    hvd.shutdown()


if __name__ == "__main__":
    main()
