"""Data-parallel training of a small CNN on scikit-learn's bundled digits, the Horovod way.

Run it on two workers::

    horarun -np 2 python examples/pytorch_digits.py
    horarun -np 2 python examples/pytorch_digits.py --checkpoint digits.pt          # save
    horarun -np 2 python examples/pytorch_digits.py --checkpoint digits.pt --resume --epochs 12

The digits (1,797 images of 8x8 pixels, 10 classes) ship inside scikit-learn, so nothing is
downloaded. The script shows each step of Horovod's recipe: the learning rate scaled by the
number of workers with a warmup, gradients averaged by ``hvd.DistributedOptimizer``, every rank
starting from rank 0's weights, the training set sharded with a ``DistributedSampler``, metrics
averaged with ``hvd.allreduce``, and a checkpoint written by rank 0 only and broadcast on resume.

With GPUs it trains on them, one per worker (``--no-cuda`` keeps it on the CPU).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any

# From hora's extras: when one is missing, one line says what to install, not a traceback.
try:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from tqdm import tqdm
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="hora example: a small CNN on the digits data set")
    parser.add_argument("--epochs", type=int, default=10, help="epochs to train (in total)")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per worker")
    parser.add_argument(
        "--lr", type=float, default=0.05, help="learning rate of one worker (scaled by size)"
    )
    parser.add_argument(
        "--warmup-epochs",
        type=float,
        default=1.0,
        help="epochs over which the learning rate rises from --lr to --lr * size; "
        "a cosine decay to zero follows",
    )
    parser.add_argument("--seed", type=int, default=42, help="seed of the split, model and order")
    parser.add_argument(
        "--checkpoint", default=None, metavar="PATH", help="rank 0 saves here after every epoch"
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue from the checkpoint at --checkpoint"
    )
    parser.add_argument(
        "--fp16-allreduce", action="store_true", help="send gradients as float16 (fp16 compression)"
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="never show progress within an epoch"
    )
    parser.add_argument(
        "--progress-every",
        type=float,
        default=10.0,
        metavar="S",
        help="when rank 0's output is not a terminal (under horarun): a progress line at most "
        "every S seconds within an epoch (default 10)",
    )
    parser.add_argument(
        "--no-cuda", action="store_true", help="train on the CPU even when a GPU is visible"
    )
    args = parser.parse_args(argv)
    if args.resume and not args.checkpoint:
        parser.error("--resume needs --checkpoint PATH")
    if args.epochs < 1 or args.batch_size < 1:
        parser.error("--epochs and --batch-size must be positive")
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


def load_data(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """The same stratified 80/20 split on every rank: images scaled to [0, 1], shape [N, 1, 8, 8]."""
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    train_idx, test_idx = train_test_split(
        torch.arange(len(labels)).numpy(), test_size=0.2, random_state=seed, stratify=digits.target
    )
    train_idx, test_idx = torch.from_numpy(train_idx), torch.from_numpy(test_idx)
    return (
        TensorDataset(images[train_idx], labels[train_idx]),
        TensorDataset(images[test_idx], labels[test_idx]),
    )


def learning_rate(args: argparse.Namespace, epoch: int, batch: int, batches: int) -> float:
    """Horovod's warmup, then a cosine decay to zero at the last epoch.

    The rate rises linearly from ``lr`` to ``lr * size`` over the warmup epochs: a large
    effective batch diverges when it starts at the full scaled rate (Goyal et al.,
    https://arxiv.org/abs/1706.02677). The decay makes the last epochs settle instead of
    bouncing. ``epoch`` counts from 0.
    """
    progress = epoch + batch / batches
    peak = args.lr * hvd.size()
    if progress < args.warmup_epochs:
        return args.lr * (1 + (hvd.size() - 1) * progress / args.warmup_epochs)
    decay = (progress - args.warmup_epochs) / max(args.epochs - args.warmup_epochs, 1e-9)
    return peak * 0.5 * (1 + math.cos(math.pi * min(decay, 1.0)))


def load_checkpoint(args: argparse.Namespace, model: nn.Module, optimizer: Any) -> int:
    """Load the checkpoint on rank 0 and give its state to every rank; returns the epochs done.

    Only rank 0 reads the file (other hosts need not see it). A missing file ends every rank
    with the same message instead of leaving the others waiting for a broadcast.
    """
    epochs_done: int | str = 0
    if hvd.rank() == 0:
        if os.path.exists(args.checkpoint):
            state = torch.load(args.checkpoint, map_location="cpu")
            model.load_state_dict(state["model"])
            # The distributed optimizer must exist before its state is loaded (hora's docs).
            optimizer.load_state_dict(state["optimizer"])
            epochs_done = int(state["epoch"])
        else:
            epochs_done = (
                f"--resume: no checkpoint at {args.checkpoint!r}; train without --resume first."
            )
    epochs_done = hvd.broadcast_object(epochs_done, root_rank=0, name="resume_epoch")
    if isinstance(epochs_done, str):
        hvd.shutdown()
        raise SystemExit(epochs_done)
    return epochs_done


def save_checkpoint(path: str, model: nn.Module, optimizer: Any, epoch: int) -> None:
    """Rank 0 writes to a temporary file, flushes it to disk and renames it, so a crash (or a
    power loss) leaves either the previous checkpoint or the new one, never half a file."""
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    folder = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(folder)  # the rename itself reaches the disk
    finally:
        os.close(folder)


def pick_device(args: argparse.Namespace) -> torch.device:
    """This worker's GPU (local rank ``i`` takes GPU ``i``), or the CPU.

    A host with fewer GPUs than workers shares them round-robin; that is slower than one GPU
    per worker, but runs.
    """
    if args.no_cuda or not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def train_epoch(
    args: argparse.Namespace,
    model: nn.Module,
    optimizer: Any,
    loader: DataLoader,
    epoch: int,
    show_progress: bool,
) -> float:
    """One pass over this rank's shard; returns the mean training loss over every rank."""
    model.train()
    device = next(model.parameters()).device
    total, batches = torch.zeros((), device=device), len(loader)
    # A bar where rank 0's stderr is a terminal; under horarun (whose workers write to pipes)
    # a line at most every --progress-every seconds, so long epochs still show progress.
    on_terminal = show_progress and sys.stderr.isatty()
    bar = tqdm(
        loader, desc=f"epoch {epoch + 1}/{args.epochs}", disable=not on_terminal, leave=False
    )
    last_line = time.monotonic()
    for batch, (images, labels) in enumerate(bar):
        images, labels = images.to(device), labels.to(device)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(args, epoch, batch, batches)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        # With HORA_METRICS set, adds samples/s and these values to the step's live metrics.
        hvd.metrics.log_step(
            batch_size=len(images), loss=loss.detach(), lr=optimizer.param_groups[0]["lr"]
        )
        total += loss.detach()
        if on_terminal:
            bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
        elif show_progress and time.monotonic() - last_line >= args.progress_every:
            last_line = time.monotonic()
            print(
                f"epoch {epoch + 1}/{args.epochs}: batch {batch + 1}/{batches}, "
                f"loss {loss.item():.4f}",
                flush=True,
            )
    # Every rank has the same number of batches (the sampler pads the shards to equal length).
    return hvd.allreduce(total / batches, name="train_loss").item()


@torch.no_grad()
def evaluate(model: nn.Module, test_set: TensorDataset) -> float:
    """Accuracy over the whole test set: each rank scores every size-th image, then sums."""
    model.eval()
    device = next(model.parameters()).device
    shard = Subset(test_set, range(hvd.rank(), len(test_set), hvd.size()))
    correct = torch.zeros((), dtype=torch.int64, device=device)
    for images, labels in DataLoader(shard, batch_size=256):
        predicted = model(images.to(device)).argmax(dim=1)
        correct += (predicted == labels.to(device)).sum()
    counts = torch.stack([correct, torch.tensor(len(shard), device=device)])
    correct, seen = hvd.allreduce(counts, op=hvd.Sum, name="test_counts").tolist()
    if seen != len(test_set):
        raise RuntimeError(f"evaluated {seen} test images, expected {len(test_set)}")
    return correct / seen


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    hvd.init()
    # Workers share the cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    device = pick_device(args)

    train_set, test_set = load_data(args.seed)
    sampler = DistributedSampler(
        train_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=args.seed
    )
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    model = DigitsNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=compression
    )

    start_epoch = load_checkpoint(args, model, optimizer) if args.resume else 0
    # Every rank starts from rank 0's weights and optimizer state (fresh or from the checkpoint).
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    show_progress = hvd.rank() == 0 and not args.no_progress
    if hvd.rank() == 0:
        print(
            f"training on {hvd.size()} worker(s) ({device.type}): {len(train_set)} train / {len(test_set)} test "
            f"images, epochs {start_epoch + 1} to {args.epochs}",
            flush=True,
        )
        if start_epoch >= args.epochs:
            print(
                f"the checkpoint has {start_epoch} epoch(s) done; nothing to train "
                f"(raise --epochs to continue)",
                flush=True,
            )
    accuracy = math.nan
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        loss = train_epoch(args, model, optimizer, loader, epoch, show_progress)
        accuracy = evaluate(model, test_set)
        if hvd.rank() == 0:
            print(
                f"epoch {epoch + 1}/{args.epochs}: train loss {loss:.4f}, "
                f"test accuracy {accuracy:.4f}",
                flush=True,
            )
            if args.checkpoint:
                save_checkpoint(args.checkpoint, model, optimizer, epoch + 1)
    if math.isnan(accuracy):  # resumed at or past --epochs: nothing was trained
        accuracy = evaluate(model, test_set)
    if hvd.rank() == 0:
        print(f"final test accuracy: {accuracy:.4f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
