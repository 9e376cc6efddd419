"""The digits CNN of pytorch_digits.py, trained with hora on Ray Train (``HoraTrainer``).

Run it (it starts a local Ray with as many CPUs as workers, or joins ``--address``)::

    pip install 'hora[examples,ray]'
    python examples/ray_digits.py                                  # 2 workers, 6 epochs
    python examples/ray_digits.py --num-workers 4 --address auto   # an existing Ray cluster
    python examples/ray_digits.py --num-workers 4 --min-workers 2  # elastic: 2 to 4 workers

The training function is the Horovod recipe of pytorch_digits.py (``hvd.init()``,
``hvd.DistributedOptimizer``, rank 0's weights broadcast, a ``DistributedSampler`` shard per
rank, metrics averaged with ``hvd.allreduce``); Ray Train starts the workers, and every epoch
ends with ``ray.train.report`` of the metrics and a checkpoint written by rank 0. When a worker
dies, ``FailureConfig(max_failures=...)`` lets Ray start a new worker group, which resumes from
the latest checkpoint (``ray.train.get_checkpoint()``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

# From hora's extras: when one is missing, one line says what to install, not a traceback.
try:
    import ray
    import ray.cloudpickle
    import ray.train
except ModuleNotFoundError as missing:
    sys.exit(
        f"{os.path.basename(__file__)} needs {missing.name}, which is not installed: "
        "pip install 'hora[examples,ray]'"
    )

import torch

import hora.torch as hvd
from hora.ray import HoraConfig, HoraTrainer

# pytorch_digits.py sits next to this file; Python finds it when this script is run directly.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pytorch_digits
from pytorch_digits import DigitsNet, evaluate, load_data, train_epoch

# The Ray workers do not have examples/ on their path: send pytorch_digits' functions and
# classes with the training function, by value, instead of by module name. This works on any
# cluster, without copying files to the nodes (hora, torch and scikit-learn must be installed
# there, as for any Ray job).
ray.cloudpickle.register_pickle_by_value(pytorch_digits)

CHECKPOINT_FILE = "digits.pt"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="hora on Ray Train: a small CNN on the digits")
    parser.add_argument("--num-workers", type=int, default=2, help="training workers")
    parser.add_argument(
        "--min-workers",
        type=int,
        default=None,
        help="train elastically with MIN..--num-workers workers (Ray restarts from the latest "
        "checkpoint when the number changes)",
    )
    parser.add_argument("--epochs", type=int, default=6, help="epochs to train")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per worker")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate of one worker")
    parser.add_argument("--seed", type=int, default=42, help="seed of the split, model and order")
    parser.add_argument("--max-failures", type=int, default=1, help="worker-group restarts allowed")
    parser.add_argument(
        "--storage-path", default=None, help="where Ray keeps checkpoints (default ~/ray_results)"
    )
    parser.add_argument("--name", default=None, help="the run's name (its folder in storage)")
    parser.add_argument(
        "--address", default=None, help="an existing Ray cluster (default: start a local one)"
    )
    return parser.parse_args(argv)


def train_func(config: dict[str, Any]) -> None:
    """Runs on every Ray worker: pytorch_digits.py's training, reporting to Ray Train."""
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(config["seed"])
    # pytorch_digits' helpers read their settings from its command-line arguments.
    args = pytorch_digits.parse_args(
        [
            f"--epochs={config['epochs']}",
            f"--batch-size={config['batch_size']}",
            f"--lr={config['lr']}",
            f"--seed={config['seed']}",
            "--no-progress",
        ]
    )
    train_set, test_set = load_data(args.seed)
    sampler = torch.utils.data.distributed.DistributedSampler(
        train_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=args.seed
    )
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    model = DigitsNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    # Resume from the latest checkpoint after a restart: rank 0 reads it, every rank gets it.
    start_epoch = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None and hvd.rank() == 0:
        with checkpoint.as_directory() as directory:
            state = torch.load(os.path.join(directory, CHECKPOINT_FILE), map_location="cpu")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = int(state["epoch"])
    start_epoch = hvd.broadcast_object(start_epoch, root_rank=0, name="start_epoch")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    if hvd.rank() == 0:
        print(
            f"training on {hvd.size()} Ray worker(s), epochs {start_epoch + 1} to {args.epochs}",
            flush=True,
        )

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        loss = train_epoch(args, model, optimizer, loader, epoch, show_progress=False)
        accuracy = evaluate(model, test_set)
        metrics = {"epoch": epoch + 1, "train_loss": loss, "test_accuracy": accuracy}
        # Every rank reports (ray.train.report is a barrier); only rank 0 attaches a checkpoint.
        with tempfile.TemporaryDirectory() as directory:
            reported = None
            if hvd.rank() == 0:
                state = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "epoch": epoch + 1,
                }
                torch.save(state, os.path.join(directory, CHECKPOINT_FILE))
                reported = ray.train.Checkpoint.from_directory(directory)
            ray.train.report(metrics, checkpoint=reported)
    hvd.shutdown()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.address:
        ray.init(address=args.address)
    elif not ray.is_initialized():
        ray.init(num_cpus=args.num_workers, include_dashboard=False)
    workers: int | tuple[int, int] = args.num_workers
    if args.min_workers is not None:
        workers = (args.min_workers, args.num_workers)
    trainer = HoraTrainer(
        train_func,
        train_loop_config={
            "epochs": args.epochs,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "seed": args.seed,
        },
        hora_config=HoraConfig(timeout_s=120),
        scaling_config=ray.train.ScalingConfig(num_workers=workers),
        run_config=ray.train.RunConfig(
            name=args.name,
            storage_path=args.storage_path,
            failure_config=ray.train.FailureConfig(max_failures=args.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
        ),
    )
    result = trainer.fit()
    metrics = result.metrics or {}
    print(
        f"epochs: {metrics.get('epoch')}, train loss {metrics.get('train_loss', float('nan')):.4f}",
        flush=True,
    )
    print(f"final test accuracy: {metrics.get('test_accuracy', float('nan')):.4f}", flush=True)
    print(f"checkpoint: {result.checkpoint.path if result.checkpoint else None}", flush=True)


if __name__ == "__main__":
    main()
