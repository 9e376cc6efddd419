"""``hvd.elastic`` on real processes (static jobs; end-to-end elastic runs live elsewhere).

* ``TorchState.sync`` gives every rank rank 0's model, optimizer state (also to optimizers that
  never stepped), sampler progress and values; ``run`` outside an elastic job syncs once and
  calls the function once; ``commit``/``check_host_updates`` are no collectives there.
* ``ElasticSampler``'s uneven shares with ``DistributedOptimizer``: in lockstep (empty steps)
  or with ``hvd.join()`` and a ``state.sync()``.
* The elastic loop itself, with the job's rounds simulated in a static job (``HORA_ELASTIC`` set
  after ``hvd.init()``, a reset that re-initializes hora in place, a replaced worker that
  forgets its state): a failure rolls back to the commit, a host change does not, and training
  ends with the weights of an uninterrupted run.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from .jobs import run_job


def _model(seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))


def _local_steps(model: Any, optimizer: Any, steps: int) -> None:
    import torch

    generator = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=generator)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()


def _optimizer_snapshot(optimizer: Any) -> dict[str, Any]:
    import torch

    state = optimizer.state_dict()
    tensors = {
        f"{param_id}.{key}": torch.as_tensor(value).clone()
        for param_id, entries in state["state"].items()
        for key, value in entries.items()
    }
    groups = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
    return {"tensors": tensors, "groups": groups}


# ---------------------------------------------------------------- sync and run, static job


def _sync_worker() -> dict[str, Any]:
    import torch

    import hora.torch as hvd

    hvd.init()
    rank = hvd.rank()
    model = _model(seed=100 + rank)  # every rank starts elsewhere
    adam = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1))
    if rank == 0:
        _local_steps(model, adam, 2)  # only rank 0's optimizer has state
    second = _model(seed=200 + rank)
    sgd = torch.optim.SGD(second.parameters(), lr=0.1, momentum=0.5 + 0.1 * rank)  # no state
    sampler = hvd.elastic.ElasticSampler(range(40), seed=0)
    if rank == 0:
        sampler.set_epoch(3)
        sampler.record_batch(0, 2)
    state = hvd.elastic.TorchState(
        model, adam, second=second, sgd=sgd, sampler=sampler, epoch=rank, note=f"rank {rank}"
    )
    if rank == 0:
        # No collectives outside an elastic job: rank 0 alone may call these.
        state.epoch = 7
        state.commit()
        for _ in range(3):
            state.check_host_updates()
    state.note = "not committed"  # sync sends the saved values
    calls: list[str] = []

    @hvd.elastic.run
    def train(state: Any, tag: str) -> dict[str, Any]:
        calls.append(tag)
        return {
            "weights": {k: v.clone() for k, v in state.model.state_dict().items()},
            "second": {k: v.clone() for k, v in state.second.state_dict().items()},
            "adam": _optimizer_snapshot(state.optimizer),
            "sgd": _optimizer_snapshot(state.sgd),
            "sampler": state.sampler.state_dict(),
            "share": list(state.sampler),
            "values": (state.epoch, state.note),
        }

    out = train(state, "once")
    out["calls"] = calls
    # The synced optimizer trains on: one more step with DistributedOptimizer keeps ranks equal.
    optimizer = hvd.DistributedOptimizer(adam, named_parameters=model.named_parameters())
    _local_steps(model, optimizer, 1)
    out["after_step"] = {k: v.clone() for k, v in model.state_dict().items()}
    hvd.shutdown()
    return out


def _assert_equal_tensors(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert got.keys() == want.keys(), what
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=f"{what} {key}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("np", [2, 3])
def test_torch_state_sync_gives_every_rank_rank_0s_state(np: int) -> None:
    ranks = run_job(_sync_worker, np)

    root = ranks[0]
    assert root["adam"]["tensors"], "rank 0's Adam should have state"
    assert root["adam"]["groups"][0]["lr"] == pytest.approx(0.01)
    assert root["sgd"]["tensors"] == {}
    assert root["sampler"] == {"epoch": 3, "processed_num": 2 * np}
    assert root["values"] == (7, "rank 0")
    for rank, observed in enumerate(ranks):
        assert observed["calls"] == ["once"], f"rank {rank}"
        _assert_equal_tensors(observed["weights"], root["weights"], f"rank {rank} model")
        _assert_equal_tensors(observed["second"], root["second"], f"rank {rank} second model")
        _assert_equal_tensors(observed["adam"]["tensors"], root["adam"]["tensors"], "adam")
        assert observed["adam"]["groups"] == root["adam"]["groups"]
        assert observed["sgd"] == {"tensors": {}, "groups": root["sgd"]["groups"]}
        assert observed["sampler"] == root["sampler"]
        assert observed["values"] == root["values"]
        _assert_equal_tensors(observed["after_step"], root["after_step"], f"rank {rank} step")
    shares = [i for observed in ranks for i in observed["share"]]
    # The 40 - 2 np samples left, padded to a multiple of np: every rank has as many.
    left = 40 - 2 * np
    assert len(shares) == -(-left // np) * np and len(set(shares)) == left


# ---------------------------------------------------------------- uneven shares


DATASET = 7
BATCH = 2
EPOCHS = 2


def _uneven_worker() -> dict[str, Any]:
    import hora.torch as hvd

    hvd.init()
    out = {mode: _uneven_training(mode) for mode in ("join", "lockstep")}
    hvd.shutdown()
    return out


def _uneven_training(mode: str) -> dict[str, Any]:
    """Train ``EPOCHS`` epochs on shares of unequal length, in one of the two documented ways."""
    import torch

    import hora.torch as hvd

    rank = hvd.rank()
    data = torch.linspace(-1.0, 1.0, DATASET * 4).reshape(DATASET, 4)
    model = _model(seed=100 + rank)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(),
    )
    sampler = hvd.elastic.ElasticSampler(range(DATASET), seed=1, pad=False)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)
    seen: dict[int, list[int]] = {}
    steps: dict[int, int] = {}
    synced: dict[int, bool] = {}

    def step(indices: Any, epoch: int) -> None:
        optimizer.zero_grad()
        if indices is not None:
            model(data[indices]).pow(2).mean().backward()
            seen.setdefault(epoch, []).extend(indices.tolist())
        optimizer.step()  # without a backward pass: zeros for every gradient
        steps[epoch] = steps.get(epoch, 0) + 1
        state.sampler.record_batch(state.batch, BATCH)
        state.batch += 1
        state.commit()

    @hvd.elastic.run
    def train(state: Any) -> None:
        for epoch in range(state.epoch, EPOCHS):
            loader = torch.utils.data.DataLoader(
                torch.arange(DATASET), batch_size=BATCH, sampler=state.sampler
            )
            if mode == "join":
                for indices in loader:
                    step(indices, epoch)
                hvd.join()  # ranks with fewer batches wait here, lending zeros
            else:
                batches = iter(loader)
                for _ in range(state.sampler.num_batches(BATCH)):
                    step(next(batches, None), epoch)
            before = [p.detach().clone() for p in model.parameters()]
            state.batch = 0
            state.sampler.set_epoch(epoch + 1)
            state.epoch = epoch + 1
            state.commit()
            if mode == "join":
                state.sync()  # the joined ranks did not step: they take rank 0's weights
            synced[epoch] = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))

    train(state)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    return {"seen": seen, "steps": steps, "synced": synced, "weights": weights}


@pytest.mark.timeout(60)
def test_uneven_shares_train_in_lockstep_or_with_join_and_sync() -> None:
    ranks = run_job(_uneven_worker, 3)

    for mode in ("join", "lockstep"):
        for epoch in range(EPOCHS):
            observed = [r[mode] for r in ranks]
            # 7 samples on 3 ranks in batches of 2: rank 0 has 3 samples (2 batches), the
            # others 2 (1 batch); in lockstep they take a second step without data.
            expected_steps = [2, 1, 1] if mode == "join" else [2, 2, 2]
            assert [o["steps"][epoch] for o in observed] == expected_steps, mode
            seen = [i for o in observed for i in o["seen"][epoch]]
            assert sorted(seen) == list(range(DATASET)), f"{mode} epoch {epoch}: {seen}"
            # After join, ranks 1 and 2 are a step behind until state.sync(); in lockstep
            # nobody ever differs.
            expected_synced = [False, True, True] if mode == "join" else [False] * 3
            assert [o["synced"][epoch] for o in observed] == expected_synced, mode
        for rank, observed in enumerate(ranks):
            _assert_equal_tensors(
                observed[mode]["weights"], ranks[0][mode]["weights"], f"{mode} rank {rank}"
            )
    # Both ways apply the same updates.
    for key, value in ranks[0]["join"]["weights"].items():
        torch.testing.assert_close(ranks[0]["lockstep"]["weights"][key], value, msg=key)


# ---------------------------------------------------------------- the elastic loop, simulated


SAMPLES = 48  # 8 batches of 2 per rank and epoch on 3 ranks
STEPS_PER_COMMIT = 2


def _simulated_elastic_worker() -> dict[str, Any]:
    """Train twice from the same start: without interruption, then in a simulated elastic job."""
    import hora.torch as hvd

    hvd.init()
    plain = _simulated_training(interrupt=False)
    elastic = _simulated_training(interrupt=True)
    hvd.shutdown()
    return {"plain": plain, "elastic": elastic}


def _simulated_training(interrupt: bool) -> dict[str, Any]:
    """Train 2 epochs; with ``interrupt``, one simulated failure and one host change."""
    import os

    import torch

    import hora.torch as hvd
    from hora.common.elastic.job import DriverJob
    from hora.common.job import rounds as common_elastic
    from hora.common.runtime import runtime

    rank = hvd.rank()
    data = torch.linspace(-2.0, 2.0, SAMPLES * 4).reshape(SAMPLES, 4)
    model = _model(seed=100 + rank)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(),
    )
    sampler = hvd.elastic.ElasticSampler(range(SAMPLES), seed=4, pad=False)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)
    events: list[str] = []

    class SimulatedJob(DriverJob):
        """A simulated elastic job: rounds, the host-change notice and the reset are stand-ins
        (the reset re-forms the static job in place)."""

        def __init__(self) -> None:
            self.plan = common_elastic.RoundPlan(number=0, updates=0)
            self.checks = 0

        def current_round(self) -> common_elastic.RoundPlan:
            return self.plan

        def host_update(self) -> tuple[int, int]:
            self.checks += 1  # rank 0 only; notice 1 appears at its 7th check
            return (1, common_elastic.HOSTS_ADDED) if self.checks >= 7 else (0, 0)

        def request_reset(self) -> None:
            events.append("request_reset")

        def rejoin(self) -> None:  # run()'s reset: hvd.shutdown(); hvd.init()
            events.append("reset")
            # A new session numbers unnamed collectives from scratch on every rank, as a
            # newcomer (rank 2 below, the first time) does in a new process.
            del os.environ["HORA_ELASTIC"]  # re-form the static job in place
            super().rejoin()
            os.environ["HORA_ELASTIC"] = "1"
            # The next round accounts for the notices seen so far (the same on every rank).
            self.plan = common_elastic.RoundPlan(self.plan.number + 1, state._updates_seen)
            if rank == 2 and events.count("reset") == 1:
                # The newcomer's state: fresh weights, no optimizer state, a sampler at the
                # start of epoch 0 (its constructor's save included).
                with torch.no_grad():
                    for p in model.parameters():
                        p.normal_()
                optimizer.state.clear()
                sampler.load_state_dict({"epoch": 0, "processed_num": 0})
                state.epoch, state.batch = 0, 0
                state.save()

    before = runtime().elastic_job
    if interrupt:
        os.environ["HORA_ELASTIC"] = "1"
        runtime().elastic_job = SimulatedJob()

    failed = [False]

    @hvd.elastic.run
    def train(state: Any) -> None:
        events.append(f"start epoch={state.epoch} batch={state.batch}")
        # Unnamed collectives: their names come from per-process counters.
        hvd.broadcast_object(state.epoch)
        for epoch in range(state.epoch, 2):
            for indices in torch.utils.data.DataLoader(
                torch.arange(SAMPLES), batch_size=2, sampler=state.sampler
            ):
                optimizer.zero_grad()
                model(data[indices]).pow(2).mean().backward()
                optimizer.step()
                hvd.allreduce(torch.ones(1), op=hvd.Sum)
                if interrupt and epoch == 0 and state.batch == 2 and not failed[0]:
                    # On every rank, as if a peer had died after this step's allreduce: the
                    # weights moved on, the sampler did not. Only a rollback avoids counting
                    # this batch twice.
                    failed[0] = True
                    raise hvd.HorovodInternalError("simulated: a peer was lost")
                state.sampler.record_batch(state.batch, 2)
                state.batch += 1
                if state.batch % STEPS_PER_COMMIT == 0:
                    state.commit()
                else:
                    state.check_host_updates()
            state.batch = 0
            state.sampler.set_epoch(epoch + 1)
            state.epoch = epoch + 1
            state.commit()

    train(state)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    os.environ.pop("HORA_ELASTIC", None)
    runtime().elastic_job = before
    return {"events": events, "weights": weights, "resets": hvd.elastic.reset_count()}


@pytest.mark.timeout(90)
def test_simulated_elastic_run_survives_a_failure_and_a_host_change() -> None:
    ranks = run_job(_simulated_elastic_worker, 3)
    plain = [observed["plain"] for observed in ranks]
    elastic = [observed["elastic"] for observed in ranks]

    for rank in range(3):
        assert plain[rank]["events"] == ["start epoch=0 batch=0"]
        assert plain[rank]["resets"] == 0
        assert elastic[rank]["resets"] == 2
        # The failure in batch 3 rolls back to the commit after batch 2. The host change is
        # seen at batch 7's check (rank 0's 7th: batches 1, 2, then 3 to 7 again); the state
        # is kept as it is there, attributes included.
        assert elastic[rank]["events"] == [
            "start epoch=0 batch=0",
            "request_reset",
            "reset",
            "start epoch=0 batch=2",
            "reset",
            "start epoch=0 batch=7",
        ]
    for rank in range(3):
        # The same batches, in the same order, on the same weights as the uninterrupted run.
        for key, value in plain[0]["weights"].items():
            torch.testing.assert_close(elastic[rank]["weights"][key], value, msg=f"rank {rank}")
