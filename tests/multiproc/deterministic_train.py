"""A deterministic-mode training job whose final state a test compares bit for bit.

A small classifier (a linear layer, batch norm, dropout, a linear layer) trains with
``hvd.DistributedOptimizer(deterministic=True)`` (Adam) for ``DET_STEPS`` steps of ``DET_K``
micro-batches of ``MICROBATCH`` samples, drawn by a ``DeterministicSampler`` over a fixed
generated data set, inside ``hvd.elastic.run`` with a ``TorchState``. Rank 0 writes the final
parameters and optimizer state tensors, and the world size of every committed step, to
``$DET_RESULT`` (``torch.save``). Batch norm's running statistics are tracked
(``track_running_stats``), so they are compared too.

Events, driven by variables:
    DET_KILL: ``worker_id[,worker_id...]@step``: those workers SIGKILL themselves before that
        step (counted from 0) of their first round.
    DET_MARK: ``path@step``: rank 0 creates ``path`` once that many steps are done (a test
        then adds a host).
    DET_STEP_DELAY: seconds to sleep after each step once the mark exists (so that a host
        change lands mid-run).
    DET_HOLD: ``n``: once ``n`` steps are committed, every rank stops and waits (rank 0 first
        creates ``$DET_HOLD_MARK``), for a test to kill the whole job there.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.nn.functional as F

import hora.torch as hvd
from hora.common.job import rounds as protocol
from hora.torch import deterministic

FEATURES = 16
CLASSES = 5
SAMPLES = 480
MICROBATCH = 4
COMMIT_EVERY = 2


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=generator)
    return x, y


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 32),
        torch.nn.BatchNorm1d(32),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.25),
        torch.nn.Linear(32, CLASSES),
    )


def state_tensors(net: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter, every optimizer state tensor, then every buffer (batch norm's running
    statistics), in a fixed order."""
    tensors = [p.detach().clone() for p in net.parameters()]
    for p in net.parameters():
        for key in sorted(optimizer.state[p]):
            tensors.append(optimizer.state[p][key].clone())
    return tensors + [b.clone() for b in net.buffers()]


def _kill_if_asked(done: int) -> None:
    spec = os.environ.get("DET_KILL")
    if not spec or hvd.elastic.round_number() != 0:
        return
    who, step = spec.split("@")
    if int(step) == done and os.environ.get(protocol.WORKER_ID_VAR) in who.split(","):
        os.kill(os.getpid(), signal.SIGKILL)


def _after_step(done: int) -> None:
    spec = os.environ.get("DET_MARK")
    if not spec:
        return
    path, step = spec.split("@")
    if done >= int(step):
        if hvd.rank() == 0 and not os.path.exists(path):
            open(path, "w").close()
        time.sleep(float(os.environ.get("DET_STEP_DELAY", "0")))


def _hold_if_asked(done: int) -> None:
    if done != int(os.environ.get("DET_HOLD", "-1")):
        return
    if hvd.rank() == 0:
        with open(os.environ["DET_HOLD_MARK"], "w") as f:
            f.write(str(done))
    time.sleep(600)


def main() -> None:
    hvd.init()
    torch.set_num_threads(1)
    leaves = int(os.environ.get("DET_K", "12"))
    steps = int(os.environ["DET_STEPS"])
    x, y = data()
    net = model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.Adam(net.parameters(), lr=0.01),
        named_parameters=net.named_parameters(),
        deterministic=True,
        microbatches=leaves,
    )
    optimizer.track_running_stats(net)
    sampler = deterministic.DeterministicSampler(range(SAMPLES), leaves, MICROBATCH, seed=5)
    state = hvd.elastic.TorchState(net, optimizer, sampler=sampler, done=0, sizes=[])

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.done < steps:
            if sampler.step == sampler.steps_per_epoch:
                sampler.set_epoch(sampler.epoch + 1)
            step = next(sampler.steps())
            _kill_if_asked(state.done)
            optimizer.zero_grad()
            for microbatch in step:
                with optimizer.microbatch(microbatch):
                    rows = list(microbatch.indices)
                    F.cross_entropy(net(x[rows]), y[rows]).backward()
            optimizer.step()
            sampler.record_step()
            state.done += 1
            state.sizes.append(hvd.size())
            if state.done % COMMIT_EVERY == 0 or state.done == steps:
                state.commit()
                _hold_if_asked(state.done)
            else:
                state.check_host_updates()
            _after_step(state.done)

    train(state)
    if hvd.rank() == 0:
        result = {
            "tensors": state_tensors(net, optimizer),
            "sizes": list(state.sizes),
            "size": hvd.size(),
        }
        torch.save(result, os.environ["DET_RESULT"])
    hvd.shutdown()


if __name__ == "__main__":
    main()
