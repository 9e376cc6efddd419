"""A small data-parallel training job to check a deployment end to end.

Every launcher in this folder runs it unchanged: ``srun`` (slurm-cpu.sbatch, slurm-gpu.sbatch),
``mpirun`` (mpijob.yaml), ``torchrun`` and ``horarun``. ``hvd.init()`` reads the launcher's
variables (docs/deployment.md). It trains a linear model on random data for a few steps, with
gradients averaged across the workers, on the GPU given by the local rank when there is one.

    python examples/deploy/train.py --steps 50
"""

from __future__ import annotations

import argparse
import socket

import torch

import hora.torch as hvd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="training steps")
    parser.add_argument("--batch-size", type=int, default=64, help="batch size per worker")
    args = parser.parse_args()

    hvd.init()
    if torch.cuda.is_available():
        # One GPU per process. The modulo covers both ways SLURM can expose GPUs: every GPU of
        # the node to every task (pick the local rank's), or one per task (--gpus-per-task=1).
        gpu = hvd.local_rank() % torch.cuda.device_count()
        torch.cuda.set_device(gpu)
        device = torch.device("cuda", gpu)
    else:
        device = torch.device("cpu")
    print(
        f"rank {hvd.rank()} of {hvd.size()} on {socket.gethostname()}: local rank "
        f"{hvd.local_rank()} of {hvd.local_size()}, cross rank {hvd.cross_rank()} of "
        f"{hvd.cross_size()}, device {device}",
        flush=True,
    )

    torch.manual_seed(1234 + hvd.rank())  # each rank draws different data
    target = torch.arange(1.0, 17.0, device=device)
    model = torch.nn.Linear(16, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    losses = []
    for _step in range(args.steps):
        x = torch.randn(args.batch_size, 16, device=device)
        y = (x @ target).unsqueeze(1)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())

    first, last = (hvd.allreduce(losses[i], name=f"loss.{i}").item() for i in (0, -1))
    if hvd.rank() == 0:
        print(f"loss (average over {hvd.size()} ranks): {first:.2f} -> {last:.4f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
