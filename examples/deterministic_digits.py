"""Deterministic training of a digits CNN: the same bits at every world size that divides K.

Run it at several world sizes and compare the fingerprint rank 0 prints at the end::

    horarun -np 1 python examples/deterministic_digits.py
    horarun -np 2 python examples/deterministic_digits.py
    horarun -np 3 python examples/deterministic_digits.py

Every run prints the same ``fingerprint`` (a SHA-256 of every parameter, optimizer state tensor
and batch norm statistic) and the same test accuracy, digit for digit: each step's 96 samples are cut into
``--microbatches`` (K, 12 by default) micro-batches of ``--microbatch-size`` samples, and their
gradients are summed along one fixed tree, whichever rank computed them. A world size that does
not divide K (5, say) is refused with a message naming those that do.

It is an elastic script too (``hvd.elastic.run``, a ``TorchState`` with the model, the
optimizer and the ``DeterministicSampler``), so it keeps the same bits when workers are lost or
added mid-run::

    horarun -np 3 --min-np 2 --max-np 3 \\
        --host-discovery-script examples/elastic_hosts.sh \\
        python examples/deterministic_digits.py --demo-failure

``--demo-failure`` makes the last rank kill itself in the middle of the first epoch; the others
roll back to the last commit and finish on two workers, with the fingerprint of the runs above.
``--commit-dir DIR`` writes every commit to disk: a job killed entirely and started again
resumes there, and still ends with that fingerprint.

What makes it deterministic, compared with examples/pytorch_elastic_digits.py:

* ``hvd.DistributedOptimizer(..., deterministic=True, microbatches=K)``;
* a ``hvd.deterministic.DeterministicSampler``, which hands every rank its micro-batches by
  global position, the same samples whatever the world size;
* the backward passes of a step run inside ``with optimizer.microbatch(mb):``, which also seeds
  the dropout of that micro-batch (the same on whichever rank runs it);
* ``optimizer.track_running_stats(model)``: batch norm's running statistics, which the
  evaluation uses, become the same on every rank and at every world size;
* one intra-op thread on every rank (``torch.set_num_threads(1)``): kernels split their work by
  thread, and a different split can round differently;
* no learning rate scaled by the number of workers: the global batch is fixed (K micro-batches),
  whatever the world size.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal

import torch
import torch.nn.functional as F

# The data and the evaluation are those of the plain example, beside this file (Python puts the
# script's folder on the path).
from pytorch_digits import evaluate, load_data
from torch import nn

import hora.torch as hvd
from hora.torch import deterministic


class DigitsNet(nn.Module):
    """Two 3x3 convolutions with batch norm, a pooling, dropout and two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.norm = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.drop = nn.Dropout(0.2)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.drop(F.relu(self.fc1(x.flatten(1))))
        return self.fc2(x)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="hora example: deterministic training on digits")
    parser.add_argument("--epochs", type=int, default=4, help="epochs to train")
    parser.add_argument("--microbatches", type=int, default=12, help="K: micro-batches per step")
    parser.add_argument("--microbatch-size", type=int, default=8, help="samples per micro-batch")
    parser.add_argument("--lr", type=float, default=0.1, help="learning rate")
    parser.add_argument("--seed", type=int, default=42, help="seed of the split and the model")
    parser.add_argument("--commit-every", type=int, default=4, help="steps between commits")
    parser.add_argument(
        "--demo-failure",
        action="store_true",
        help="the last rank of the first round kills itself (SIGKILL) in the middle of epoch 1",
    )
    parser.add_argument(
        "--commit-dir",
        default=None,
        help="write every commit to this directory too, and resume from it when it holds one",
    )
    return parser.parse_args()


def fingerprint(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """A SHA-256 of every parameter, optimizer state tensor and buffer, in a fixed order."""
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
        for key in sorted(optimizer.state[p]):
            value = optimizer.state[p][key]
            if isinstance(value, torch.Tensor):
                digest.update(value.numpy().tobytes())
    for buffer in model.buffers():
        digest.update(buffer.numpy().tobytes())
    return digest.hexdigest()[:16]


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)  # the same on every rank
    torch.manual_seed(args.seed)
    train_set, test_set = load_data(args.seed)
    images, labels = train_set.tensors
    model = DigitsNet()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        named_parameters=model.named_parameters(),
        deterministic=True,
        microbatches=args.microbatches,
    )
    # Batch norm's running statistics (used by the evaluation) the same on every rank too.
    optimizer.track_running_stats(model)
    sampler = deterministic.DeterministicSampler(
        train_set, args.microbatches, args.microbatch_size, seed=args.seed
    )
    state = hvd.elastic.TorchState(
        model, optimizer, commit_dir=args.commit_dir, sampler=sampler, epoch=0, loss=0.0
    )
    doomed = hvd.size() - 1 if args.demo_failure and hvd.size() > 1 else None

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.epoch < args.epochs:
            for step in sampler.steps():
                where = (hvd.elastic.round_number(), state.epoch, step.number)
                if doomed == hvd.rank() and where == (0, 0, sampler.steps_per_epoch // 2):
                    os.kill(os.getpid(), signal.SIGKILL)  # --demo-failure
                model.train()
                optimizer.zero_grad()
                for mb in step:  # this rank's micro-batches
                    with optimizer.microbatch(mb):  # seeds dropout by (step, micro-batch)
                        rows = list(mb.indices)
                        loss = F.cross_entropy(model(images[rows]), labels[rows])
                        loss.backward()
                optimizer.step()
                sampler.record_step()
                if sampler.step % args.commit_every == 0:
                    state.commit()
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()
            accuracy = evaluate(model, test_set)
            if hvd.rank() == 0:
                print(
                    f"epoch {state.epoch}/{args.epochs}: test accuracy {accuracy:.4f}", flush=True
                )

    train(state)
    if hvd.rank() == 0:
        print(
            f"{hvd.size()} worker(s), K={args.microbatches}: fingerprint "
            f"{fingerprint(model, optimizer)}",
            flush=True,
        )
    hvd.shutdown()


if __name__ == "__main__":
    main()
