"""Horovod's synthetic benchmark for hora: training throughput of small models on random data.

This module owns the benchmark's models, its training loop and its report: rank 0's lines on
stdout and, with ``--json PATH``, the same figures in a file for tools. It is what
``examples/pytorch_synthetic_benchmark.py`` runs, and what ``hora bench scaling`` starts at each
world size (``python -m hora.tools.synthetic_benchmark``, so that an installed hora needs no
checkout). It knows nothing of scaling studies or timelines.

Each step is a full training step (forward, backward with gradients averaged across the workers
by ``hvd.DistributedOptimizer``, optimizer update) on one batch of random data made once, so the
figures measure compute and communication, not data loading. The models are small ones so that
the benchmark runs on CPUs in seconds (on GPUs when they are visible: one per worker, as in
Horovod's benchmark; ``--no-cuda`` keeps it on the CPU):

- ``mlp``: three linear layers on 1,024 features;
- ``resnet``: a ResNet of six basic blocks for 3x32x32 images (CIFAR-sized);
- ``transformer``: a two-layer transformer encoder classifying sequences of 64 tokens.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hora.common.vocabulary import safe_files

# Imported by name, as hora.tools.doctor does, so that type-checking hora/tools (strict) does not
# pull in hora.torch, which is checked under its own, looser settings.
hvd: Any = importlib.import_module("hora.torch")

NUM_CLASSES = 10
# Version of the --json file's layout; tools refuse a file whose version they do not know.
RESULT_FORMAT = 1


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="hora synthetic benchmark: training throughput on random data"
    )
    parser.add_argument(
        "--model", choices=sorted(MODELS), default="resnet", help="model to train (default resnet)"
    )
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per worker")
    parser.add_argument(
        "--num-warmup-batches", type=int, default=5, help="batches run before timing starts"
    )
    parser.add_argument(
        "--num-batches-per-iter", type=int, default=8, help="batches in one timed iteration"
    )
    parser.add_argument("--num-iters", type=int, default=10, help="timed iterations")
    parser.add_argument(
        "--fp16-allreduce", action="store_true", help="send gradients as float16 (fp16 compression)"
    )
    parser.add_argument(
        "--no-cuda", action="store_true", help="run on the CPU even when a GPU is visible"
    )
    parser.add_argument(
        "--use-adasum",
        action="store_true",
        help="combine gradients with Adasum (op=hvd.Adasum) instead of averaging them; "
        "a power-of-two number of workers",
    )
    parser.add_argument(
        "--threads-per-worker",
        type=int,
        default=None,
        metavar="N",
        help="torch threads in each worker (default: this host's cores shared among its workers)",
    )
    parser.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="rank 0 also writes the results to PATH as JSON (for tools such as hora bench)",
    )
    args = parser.parse_args(argv)
    for flag in ("batch_size", "num_batches_per_iter", "num_iters"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.threads_per_worker is not None and args.threads_per_worker < 1:
        parser.error("--threads-per-worker must be at least 1")
    if args.num_warmup_batches < 0:
        parser.error("--num-warmup-batches must not be negative")
    return args


class MLP(nn.Module):
    """Three linear layers on flat feature vectors."""

    features = 1024

    def __init__(self, hidden: int = 1024) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(self.features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, NUM_CLASSES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layers(x)
        return out


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a shortcut (He et al., https://arxiv.org/abs/1512.03385)."""

    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False),
                nn.BatchNorm2d(channels_out),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A CIFAR-style ResNet: a 3x3 stem, three stages of two blocks (16, 32, 64 channels)."""

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64), blocks_per_stage: int = 2) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        blocks: list[nn.Module] = []
        channels = widths[0]
        for stage, width in enumerate(widths):
            for index in range(blocks_per_stage):
                stride = 2 if stage > 0 and index == 0 else 1
                blocks.append(BasicBlock(channels, width, stride))
                channels = width
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(channels, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        out: torch.Tensor = self.fc(x.mean(dim=(2, 3)))
        return out


class TransformerClassifier(nn.Module):
    """Token and position embeddings, a transformer encoder, mean pooling, a linear head."""

    vocab = 1000
    sequence = 64

    def __init__(self, dim: int = 128, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tokens = nn.Embedding(self.vocab, dim)
        self.positions = nn.Parameter(torch.zeros(self.sequence, dim))
        layer = nn.TransformerEncoderLayer(
            dim, heads, dim_feedforward=4 * dim, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, NUM_CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.encoder(self.tokens(tokens) + self.positions)
        out: torch.Tensor = self.head(x.mean(dim=1))
        return out


# name -> (model class, random batch of a given size, unit of the throughput)
MODELS: dict[str, tuple[type[nn.Module], Callable[[int], torch.Tensor], str]] = {
    "mlp": (MLP, lambda n: torch.randn(n, MLP.features), "samples"),
    "resnet": (ResNet, lambda n: torch.randn(n, 3, 32, 32), "img"),
    "transformer": (
        TransformerClassifier,
        lambda n: torch.randint(
            0, TransformerClassifier.vocab, (n, TransformerClassifier.sequence)
        ),
        "samples",
    ),
}


def threads_per_worker() -> int:
    """The cores of this machine shared among its workers, at least one each."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // int(hvd.local_size()))


def pick_device(no_cuda: bool) -> torch.device:
    """This worker's GPU (local rank ``i`` takes GPU ``i``, round-robin when a host has fewer
    GPUs than workers), or the CPU."""
    if no_cuda or not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(int(hvd.local_rank()) % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def log(text: str) -> None:
    if hvd.rank() == 0:
        print(text, flush=True)


def write_result(path: str, result: dict[str, Any]) -> None:
    """Write ``result`` to ``path`` whole or not at all: a reader never sees half a file."""
    safe_files.write(path, json.dumps(result, indent=2) + "\n")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    hvd.init()
    torch.set_num_threads(args.threads_per_worker or threads_per_worker())
    torch.manual_seed(0)
    device = pick_device(args.no_cuda)

    model_class, make_batch, unit = MODELS[args.model]
    model = model_class().to(device)
    optimizer = distributed_optimizer(model, args)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # One batch, made once: the benchmark measures training steps, not data loading.
    data = make_batch(args.batch_size).to(device)
    target = torch.randint(0, NUM_CLASSES, (args.batch_size,)).to(device)
    step = training_step(model, optimizer, data, target)

    parameters = sum(p.numel() for p in model.parameters())
    log_setup(args, parameters, device)

    log("Running warmup...")
    timed_batches(step, args.num_warmup_batches, device)

    log("Running benchmark...")
    seconds_per_iter, rates = timed_iterations(step, args, device, unit)
    mean, interval = mean_and_interval(rates)
    label = unit.capitalize()
    log(f"{label}/sec per worker: {mean:.1f} +-{interval:.1f}")
    log(
        f"Total {unit}/sec on {hvd.size()} worker(s): "
        f"{hvd.size() * mean:.1f} +-{hvd.size() * interval:.1f}"
    )
    if args.json is not None and hvd.rank() == 0:
        figures = {
            "parameters": parameters,
            "unit": unit,
            "workers": hvd.size(),
            "threads_per_worker": torch.get_num_threads(),
            "device": device.type,
            "host": socket.gethostname(),
        }
        write_result(args.json, json_result(args, figures, seconds_per_iter, rates))
    hvd.shutdown()


def distributed_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """SGD wrapped in ``hvd.DistributedOptimizer``, with the flags' compression and reduction."""
    # Horovod's benchmark scales the learning rate by the number of workers, as training would;
    # Adasum combines gradients without that scaling.
    lr_scaler = 1 if args.use_adasum else hvd.size()
    optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
    )
    return optimizer


def training_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, data: torch.Tensor, target: torch.Tensor
) -> Callable[[], None]:
    """One full training step on the batch: forward, backward, optimizer update."""

    def benchmark_step() -> None:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()

    return benchmark_step


def timed_batches(step: Callable[[], None], count: int, device: torch.device) -> float:
    """Seconds for ``count`` steps, the GPU's queued work included."""
    start = time.perf_counter()
    for _ in range(count):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def log_setup(args: argparse.Namespace, parameters: int, device: torch.device) -> None:
    """Rank 0's lines on what is measured: the model, batch, workers, device and gradients."""
    log(f"Model: {args.model} ({parameters / 1e6:.2f}M parameters)")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of workers: {hvd.size()} ({torch.get_num_threads()} thread(s) each)")
    log(f"Device of rank 0: {describe(device)}")
    log(f"Gradient compression: {'fp16' if args.fp16_allreduce else 'none'}")
    log(f"Gradient reduction: {'Adasum' if args.use_adasum else 'average'}")


def timed_iterations(
    step: Callable[[], None], args: argparse.Namespace, device: torch.device, unit: str
) -> tuple[list[float], list[float]]:
    """The timed iterations: the seconds of each, and its rate per worker (logged as it ends)."""
    seconds_per_iter = []
    rates = []
    for iteration in range(args.num_iters):
        seconds = timed_batches(step, args.num_batches_per_iter, device)
        rate = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{iteration}: {rate:.1f} {unit}/sec per worker")
        seconds_per_iter.append(seconds)
        rates.append(rate)
    return seconds_per_iter, rates


def mean_and_interval(rates: list[float]) -> tuple[float, float]:
    """The mean rate and the half-width of its 95% interval (1.96 standard deviations)."""
    return statistics.mean(rates), 1.96 * statistics.pstdev(rates)


def json_result(
    args: argparse.Namespace,
    figures: dict[str, Any],
    seconds_per_iter: list[float],
    rates: list[float],
) -> dict[str, Any]:
    """The ``--json`` file's content: the flags, ``figures`` (the model's size, the unit, where
    it ran) and the measurements, in the file's layout (:data:`RESULT_FORMAT`)."""
    mean, interval = mean_and_interval(rates)
    return {
        "format": RESULT_FORMAT,
        "model": args.model,
        **figures,
        "batch_size": args.batch_size,
        "num_warmup_batches": args.num_warmup_batches,
        "num_batches_per_iter": args.num_batches_per_iter,
        "num_iters": args.num_iters,
        "fp16_allreduce": args.fp16_allreduce,
        "use_adasum": args.use_adasum,
        "seconds_per_iter": seconds_per_iter,
        "rate_per_worker": rates,
        "rate_per_worker_mean": mean,
        "rate_per_worker_interval": interval,
        "rate_total_mean": figures["workers"] * mean,
        "rate_total_interval": figures["workers"] * interval,
    }


if __name__ == "__main__":
    main()
