"""An elastic training job whose every step can be checked afterwards.

Linear regression on ``SAMPLES`` fixed samples with ``hvd.DistributedOptimizer`` (plain SGD),
``hvd.elastic.TorchState`` and ``hvd.elastic.ElasticSampler``, committing every ``COMMIT_EVERY``
batches. Every step appends, to the committed state, which samples each rank used; rank 0 writes
the committed history and the final weights to ``$ELASTIC_RESULT`` (JSON). From the history a
test checks that each epoch used every sample exactly once, and replays the steps on one process
to check the final weights.

Events, driven by variables:
    ELASTIC_KILL: ``worker_id,epoch,batch``: that worker SIGKILLs itself before that batch of
        its first round (a ``kill -9`` at a known point).
    ELASTIC_MARK: a file rank 0 creates once it has finished epoch 0 (a test waits for it
        before changing the hosts).
    ELASTIC_STEP_DELAY: seconds to sleep per step (so that a host change lands mid-run).
    ELASTIC_EVENTS: a file every worker appends ``time event`` lines to (for benchmarks).
    ELASTIC_STEP_LOG: a file rank 0 appends ``epoch batch`` to after every step.
    ELASTIC_HOLD_AFTER_COMMIT: ``n``: after this run's n-th commit every rank stops and waits
        (rank 0 first creates ``$ELASTIC_HOLD_MARK``), for a test to kill the whole job there.
    ELASTIC_HOLD_IN_COMMIT: ``n``: the same, but inside rank 0's n-th durable commit, between
        the fsynced temporary file and its rename (``HORA_ELASTIC_COMMIT_DIR`` must be set).
"""

from __future__ import annotations

import json
import os
import signal
import time

import torch

import hora.torch as hvd
from hora.common import basics
from hora.common.job import rounds as protocol

SAMPLES = 48
FEATURES = 4
BATCH = 2
EPOCHS = 3
COMMIT_EVERY = 2
LR = 0.05


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1
    return x, y


def model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, 1)


def _event(text: str) -> None:
    path = os.environ.get("ELASTIC_EVENTS")
    if path:
        with open(path, "a") as f:
            f.write(f"{time.time():.6f} {os.environ.get(protocol.WORKER_ID_VAR)} {text}\n")


def _hold(why: str) -> None:
    """Stop here until killed; rank 0 first tells the test, through ``$ELASTIC_HOLD_MARK``."""
    if hvd.rank() == 0:
        with open(os.environ["ELASTIC_HOLD_MARK"], "w") as f:
            f.write(why)
    time.sleep(600)


def _hold_in_commit(number: int) -> None:
    """Make rank 0's ``number``-th durable write hold before its rename."""
    from hora.common.elastic import durable

    publish = durable.CommitDirectory._publish
    writes = [0]

    def held(self: durable.CommitDirectory, temp: str) -> None:
        writes[0] += 1
        if writes[0] == number:
            _hold(f"inside commit {number}")
        publish(self, temp)

    durable.CommitDirectory._publish = held  # type: ignore[method-assign]


def _log_step(epoch: int, batch: int) -> None:
    path = os.environ.get("ELASTIC_STEP_LOG")
    if path and hvd.rank() == 0:
        with open(path, "a") as f:
            f.write(f"{epoch} {batch}\n")


def main() -> None:
    hvd.init()
    if os.environ.get("ELASTIC_HOLD_IN_COMMIT"):
        _hold_in_commit(int(os.environ["ELASTIC_HOLD_IN_COMMIT"]))
    hold_after = int(os.environ.get("ELASTIC_HOLD_AFTER_COMMIT", "0"))
    commits = [0]
    x, y = data()
    net = model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=LR), named_parameters=net.named_parameters()
    )
    # Exact shares (no sample repeated), in lockstep: the history checks every sample once.
    sampler = hvd.elastic.ElasticSampler(list(range(SAMPLES)), shuffle=True, seed=3, pad=False)
    state = hvd.elastic.TorchState(
        model=net, optimizer=optimizer, sampler=sampler, epoch=0, batch=0, history=[]
    )
    kill = os.environ.get("ELASTIC_KILL", "")
    delay = float(os.environ.get("ELASTIC_STEP_DELAY", "0"))
    me = os.environ.get(protocol.WORKER_ID_VAR, "")
    first_round = protocol.progress().plan.number if protocol.progress().plan else 0

    def commit() -> None:
        state.commit()
        commits[0] += 1
        if commits[0] == hold_after:
            _hold(f"after commit {hold_after}")

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        _event(
            f"resumed round={protocol.progress().plan.number if protocol.progress().plan else 0}"
        )
        while state.epoch < EPOCHS:
            mine = list(iter(state.sampler))
            longest = hvd.allreduce(torch.tensor([float(len(mine))]), op=hvd.Max, name="longest")
            steps = -(-int(longest.item()) // BATCH)
            for step in range(steps):
                if kill:
                    who, epoch, batch = kill.split(",")
                    current = protocol.progress().plan.number if protocol.progress().plan else 0
                    if (
                        who == me
                        and current == first_round
                        and (state.epoch, state.batch) == (int(epoch), int(batch))
                    ):
                        _event("killed")
                        os.kill(os.getpid(), signal.SIGKILL)
                batch = mine[step * BATCH : (step + 1) * BATCH]
                optimizer.zero_grad()
                if batch:
                    loss = ((net(x[batch]) - y[batch]) ** 2).mean()
                    loss.backward()
                optimizer.step()
                everyone = hvd.allgather_object(batch)
                state.history.append([state.epoch, everyone])
                state.sampler.record_batch(step, BATCH)
                state.batch += 1
                _event(f"step epoch={state.epoch} batch={state.batch} size={hvd.size()}")
                _log_step(state.epoch, state.batch)
                if delay:
                    time.sleep(delay)
                if state.batch % COMMIT_EVERY == 0:
                    commit()
            state.epoch += 1
            state.batch = 0
            state.sampler.set_epoch(state.epoch)
            commit()
            mark = os.environ.get("ELASTIC_MARK")
            if mark and hvd.rank() == 0 and not os.path.exists(mark):
                open(mark, "w").close()

    train(state)
    if hvd.rank() == 0:
        result = {
            "history": state.history,
            "weight": net.weight.detach().reshape(-1).tolist(),
            "bias": net.bias.detach().tolist(),
            "size": hvd.size(),
            "path": basics.data_path(),
            "round": protocol.progress().plan.number if protocol.progress().plan else 0,
        }
        with open(os.environ["ELASTIC_RESULT"], "w") as f:
            json.dump(result, f)
    hvd.shutdown()


def replay(history: list[list[object]]) -> tuple[list[float], list[float]]:
    """The final weights the committed steps imply, computed on one process."""
    x, y = data()
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
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
    return net.weight.detach().reshape(-1).tolist(), net.bias.detach().tolist()


if __name__ == "__main__":
    main()
