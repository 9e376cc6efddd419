"""An elastic job with a sharded optimizer (``shard_optimizer_state=True``, ZeRO stage 2, Adam)
whose every committed step can be replayed on one process.

A small regression network trains on ``SAMPLES`` fixed samples with ``hvd.elastic.TorchState``
and ``hvd.elastic.ElasticSampler``, committing every ``COMMIT_EVERY`` batches. Every step appends
to the committed state which samples each rank used; rank 0 writes the committed history and the
final weights to ``$ZERO_RESULT`` (JSON). :func:`replay` runs the same steps with a plain
``torch.optim.Adam`` on one process: if a shard of Adam's moments were lost or stale when the
number of workers changed, the weights would differ.

Events, driven by variables:
    ZERO_KILL: ``worker_id,epoch,batch``: that worker SIGKILLs itself before that batch of its
        first round.
    ZERO_MARK: a file rank 0 creates once it has finished epoch 0 (the test then adds a host).
    ZERO_STEP_DELAY: seconds to sleep per step (so that a host change lands mid-run).
"""

from __future__ import annotations

import json
import os
import signal
import time

import torch

import hora.torch as hvd
from hora.common.job import rounds as protocol

SAMPLES = 36
FEATURES = 4
BATCH = 2
EPOCHS = 3
COMMIT_EVERY = 2
LR = 0.02


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = (x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])).tanh() + 0.1
    return x, y


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _round() -> int:
    return protocol.progress().plan.number if protocol.progress().plan else 0


def main() -> None:
    hvd.init()
    x, y = data()
    net = model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.Adam(net.parameters(), lr=LR),
        named_parameters=net.named_parameters(),
        shard_optimizer_state=True,
        shard_gradients=True,
    )
    sampler = hvd.elastic.ElasticSampler(list(range(SAMPLES)), shuffle=True, seed=3, pad=False)
    state = hvd.elastic.TorchState(
        model=net, optimizer=optimizer, sampler=sampler, epoch=0, batch=0, history=[]
    )
    kill = os.environ.get("ZERO_KILL", "")
    delay = float(os.environ.get("ZERO_STEP_DELAY", "0"))
    me = os.environ.get(protocol.WORKER_ID_VAR, "")
    first_round = _round()

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.epoch < EPOCHS:
            mine = list(iter(state.sampler))
            longest = hvd.allreduce(torch.tensor([float(len(mine))]), op=hvd.Max, name="longest")
            steps = -(-int(longest.item()) // BATCH)
            for step in range(steps):
                if kill:
                    who, epoch, batch = kill.split(",")
                    if (
                        who == me
                        and _round() == first_round
                        and (state.epoch, state.batch) == (int(epoch), int(batch))
                    ):
                        os.kill(os.getpid(), signal.SIGKILL)
                batch = mine[step * BATCH : (step + 1) * BATCH]
                optimizer.zero_grad()
                if batch:
                    ((net(x[batch]) - y[batch]) ** 2).mean().backward()
                optimizer.step()
                state.history.append([state.epoch, hvd.allgather_object(batch)])
                state.sampler.record_batch(step, BATCH)
                state.batch += 1
                if delay:
                    time.sleep(delay)
                if state.batch % COMMIT_EVERY == 0:
                    state.commit()
            state.epoch += 1
            state.batch = 0
            state.sampler.set_epoch(state.epoch)
            state.commit()
            mark = os.environ.get("ZERO_MARK")
            if mark and hvd.rank() == 0 and not os.path.exists(mark):
                open(mark, "w").close()

    train(state)
    whole = optimizer.state_dict()  # every rank takes part
    if hvd.rank() == 0:
        result = {
            "history": state.history,
            "params": [p.detach().reshape(-1).tolist() for p in net.parameters()],
            "exp_avg_sq": [
                whole["state"][n]["exp_avg_sq"].reshape(-1).tolist()
                for n in range(len(list(net.parameters())))
            ],
            "size": hvd.size(),
            "round": _round(),
        }
        with open(os.environ["ZERO_RESULT"], "w") as f:
            json.dump(result, f)
    hvd.shutdown()


def replay(history: list[list[object]]) -> tuple[list[list[float]], list[list[float]]]:
    """The weights (and Adam's second moments) the committed steps imply, on one process."""
    x, y = data()
    net = model()
    optimizer = torch.optim.Adam(net.parameters(), lr=LR)
    for _epoch, batches in history:
        assert isinstance(batches, list)
        grads = [torch.zeros_like(p) for p in net.parameters()]
        for batch in batches:
            if not batch:
                continue
            net.zero_grad()
            ((net(x[batch]) - y[batch]) ** 2).mean().backward()
            for g, p in zip(grads, net.parameters()):
                assert p.grad is not None
                g += p.grad
        for g, p in zip(grads, net.parameters()):
            p.grad = g / len(batches)
        optimizer.step()
    params = [p.detach().reshape(-1).tolist() for p in net.parameters()]
    moments = [optimizer.state[p]["exp_avg_sq"].reshape(-1).tolist() for p in net.parameters()]
    return params, moments


if __name__ == "__main__":
    main()
