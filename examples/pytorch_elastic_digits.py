"""Elastic training of the digits CNN: workers may die or join, and training goes on.

Run it on this machine, with three loopback addresses playing three hosts::

    horarun -np 3 --min-np 2 --max-np 3 \\
        --host-discovery-script examples/elastic_hosts.sh \\
        python examples/pytorch_elastic_digits.py --demo-failure

``--demo-failure`` makes the worker of the last rank (rank 2 of 3 here) kill itself (SIGKILL) in
the middle of epoch 2 (of epoch 1 with ``--epochs 1``), whatever the number of workers. The others
roll back to the last commit, go on without it, and finish; ``horarun`` names the lost worker and
blacklists its host. A job that starts with one worker has nobody to go on, and says so instead.
Without it, edit the hosts the discovery script prints (``HORA_EXAMPLE_HOSTS``, see
examples/elastic_hosts.sh) while the job runs to remove or add hosts.

``--commit-dir DIR`` also writes every commit to ``DIR/commit.pt`` (atomically, fsynced). Stop the
whole job (Ctrl-C, or kill every worker) and run the same command again: it resumes from the last
commit instead of starting over.

What makes it elastic, compared with examples/pytorch_digits.py:

* the training loop is a function decorated with ``hvd.elastic.run``, taking a ``state``;
* ``hvd.elastic.TorchState`` holds the model, the optimizer, the sampler and the counters, and
  ``state.commit()`` (every ``--commit-every`` batches) is the point a failure rolls back to;
* ``hvd.elastic.ElasticSampler`` shards the training set and, when the world changes, shards
  only what this epoch has not yet processed, so no sample is skipped (as Horovod's, it repeats
  a few samples so that every worker gets as many);
* a reset callback scales the learning rate to the new number of workers;
* optionally, ``commit_dir`` makes the commits durable, so even losing every worker loses only the
  steps since the last commit.
"""

from __future__ import annotations

import argparse
import os
import signal
from typing import Any

import torch
import torch.nn.functional as F

# The model, data and evaluation are those of the plain example, beside this file (Python puts
# the script's folder on the path).
from pytorch_digits import DigitsNet, evaluate, load_data
from torch.utils.data import DataLoader

import hora.torch as hvd


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="hora example: elastic training on digits")
    parser.add_argument("--epochs", type=int, default=6, help="epochs to train")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per worker")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate of one worker")
    parser.add_argument("--commit-every", type=int, default=5, help="batches between commits")
    parser.add_argument("--seed", type=int, default=42, help="seed of the split and the model")
    parser.add_argument(
        "--demo-failure",
        action="store_true",
        help="the last rank of the first round kills itself (SIGKILL) in the middle of epoch 2",
    )
    parser.add_argument(
        "--commit-dir",
        default=None,
        help="write every commit to this directory too, and resume from it when it holds one "
        "(default: $HORA_ELASTIC_COMMIT_DIR, or no durable commits)",
    )
    return parser.parse_args()


def demo_failure(args: argparse.Namespace) -> tuple[int, int] | None:
    """With ``--demo-failure``: the rank that will kill itself and the epoch it dies in (the
    second, or the only one), said once by rank 0; ``None`` (and why) in a job of one worker."""
    if not args.demo_failure:
        return None
    if hvd.size() < 2:
        if hvd.rank() == 0:
            print(
                "--demo-failure: the job starts with 1 worker, and losing it would leave nobody "
                "to go on; start 2 or more (-np) to see a failure survived",
                flush=True,
            )
        return None
    rank, epoch = hvd.size() - 1, min(1, args.epochs - 1)
    if hvd.rank() == 0:
        print(f"--demo-failure: rank {rank} will kill itself in epoch {epoch + 1}", flush=True)
    return rank, epoch


def train_epoch(
    state: hvd.elastic.TorchState,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    train_set: Any,
    args: argparse.Namespace,
    failure: tuple[int, int] | None,
) -> None:
    """Train on this rank's shard of the epoch, from the batch the state is at; ``failure``:
    the rank and epoch of ``--demo-failure``'s death (in the first round, half-way through)."""
    model.train()
    # The sampler gives every rank the same number of samples (it repeats a few to make the
    # epoch divide by the number of workers), so every rank runs the same number of steps.
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=state.sampler)
    for step, (images, labels) in enumerate(loader):
        dies = failure == (hvd.rank(), state.epoch) and state.batch == len(loader) // 2
        if dies and hvd.elastic.round_number() == 0:
            print(f"rank {hvd.rank()}: killing myself (--demo-failure)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
        state.sampler.record_batch(step, args.batch_size)
        state.batch += 1
        if state.batch % args.commit_every == 0:
            state.commit()


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    train_set, test_set = load_data(args.seed)
    model = DigitsNet()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9),
        named_parameters=model.named_parameters(),
    )
    sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=args.seed)
    state = hvd.elastic.TorchState(
        model=model,
        optimizer=optimizer,
        sampler=sampler,
        commit_dir=args.commit_dir,
        epoch=0,
        batch=0,
    )

    def rescale_learning_rate() -> None:
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()
        if hvd.rank() == 0:
            print(f"the job now has {hvd.size()} workers; learning rate {args.lr * hvd.size()}")

    state.register_reset_callbacks([rescale_learning_rate])
    failure = demo_failure(args)

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        if hvd.rank() == 0 and (state.epoch, state.batch) != (0, 0):
            print(f"resuming at epoch {state.epoch + 1}, batch {state.batch}", flush=True)
        while state.epoch < args.epochs:
            train_epoch(state, model, optimizer, train_set, args, failure)
            accuracy = evaluate(model, test_set)
            if hvd.rank() == 0:
                print(
                    f"epoch {state.epoch + 1}/{args.epochs} on {hvd.size()} workers: "
                    f"test accuracy {accuracy:.4f}",
                    flush=True,
                )
            state.epoch += 1
            state.batch = 0
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    accuracy = evaluate(model, test_set)
    if hvd.rank() == 0:
        print(f"final test accuracy: {accuracy:.4f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
