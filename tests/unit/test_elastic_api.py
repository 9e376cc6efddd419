"""``hvd.elastic`` in one process: state save/restore/commit, the handlers, reset callbacks,
``ElasticSampler``'s arithmetic, and the ``run`` loop with the elastic job simulated.

Tests that need collectives start a job of one in this process (``hvd.init()`` with
``HORA_LAUNCHER=none``); the elastic ones put a simulated job in the runtime
(``Runtime.elastic_job``: rounds, host-change notices, resets), so the loop's decisions are
checked without a driver (end-to-end runs live elsewhere).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import hora.torch as hvd
from hora.common.job import rounds as common_elastic
from hora.common.runtime import runtime
from hora.common.vocabulary import errors

ElasticSampler = hvd.elastic.ElasticSampler


class SimulatedJob:
    """An elastic job without a driver (an ``ElasticJob``): its round, its host-change notice
    and what a reset does are the test's."""

    def __init__(self, log: list[str] | None = None) -> None:
        self.log = log if log is not None else []
        self.plan: common_elastic.RoundPlan | None = None
        self.notice = (0, 0)
        self.reads = 0
        # What rejoin() does after logging "reset" (raises, or nothing).
        self.on_rejoin: Callable[[], None] = lambda: None

    def active(self) -> bool:
        return True

    def current_round(self) -> common_elastic.RoundPlan | None:
        return self.plan

    def host_update(self) -> tuple[int, int]:
        self.reads += 1
        return self.notice

    def request_reset(self) -> None:
        self.log.append("request_reset")

    def rejoin(self) -> None:
        self.log.append("reset")
        self.on_rejoin()


@pytest.fixture
def simulated(monkeypatch: pytest.MonkeyPatch) -> SimulatedJob:
    """The process's elastic job is a simulated one for this test."""
    job = SimulatedJob()
    monkeypatch.setattr(runtime(), "elastic_job", job)
    return job


@pytest.fixture
def job_of_one(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("HORA_LAUNCHER", "none")
    monkeypatch.delenv("HORA_ELASTIC", raising=False)
    hvd.init()
    try:
        yield
    finally:
        hvd.shutdown()


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 4, generator=generator)
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    optimizer.step()


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_weights(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for param_id, entries in optimizer.state_dict()["state"].items():
        for key, value in entries.items():
            out[f"{param_id}.{key}"] = torch.as_tensor(value).clone()
    return out


# ---------------------------------------------------------------- exports


@pytest.mark.timeout(30)
def test_exports_are_horovods_names_and_the_common_exception_classes() -> None:
    for name in ("run", "State", "ObjectState", "TorchState", "ElasticSampler"):
        assert hasattr(hvd.elastic, name), name
    assert hvd.elastic.HoraInternalError is errors.HoraInternalError
    assert hvd.elastic.HorovodInternalError is errors.HoraInternalError
    assert hvd.elastic.HostsUpdatedInterrupt is errors.HostsUpdatedInterrupt
    assert issubclass(ElasticSampler, torch.utils.data.Sampler)


# ---------------------------------------------------------------- ObjectState


@pytest.mark.timeout(30)
def test_object_state_restores_the_last_commit_as_deep_copies() -> None:
    state = hvd.elastic.ObjectState(epoch=0, seen=[1])
    state.epoch = 3
    state.seen.append(2)
    state.restore()  # the constructor saved
    assert (state.epoch, state.seen) == (0, [1])

    state.epoch = 5
    state.seen.append(7)
    state.save()
    state.seen.append(8)  # in place: the snapshot must not change with it
    state.epoch = 6
    state.restore()
    assert (state.epoch, state.seen) == (5, [1, 7])
    state.seen.append(9)  # and restoring twice gives the same again
    state.restore()
    assert state.seen == [1, 7]


@pytest.mark.timeout(30)
def test_commit_saves_and_check_host_updates_is_a_no_op_outside_an_elastic_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("HORA_ELASTIC", raising=False)
    state = hvd.elastic.ObjectState(batch=0)
    state.batch = 4
    state.commit()  # no job at all: check_host_updates must not touch hora
    state.batch = 9
    state.restore()
    assert state.batch == 4


@pytest.mark.timeout(30)
def test_object_state_rejects_names_that_would_shadow_its_methods() -> None:
    with pytest.raises(ValueError, match="'commit' cannot be a state attribute"):
        hvd.elastic.ObjectState(commit=1)
    with pytest.raises(ValueError, match="'_x' cannot be a state attribute"):
        hvd.elastic.TorchState(_x=1)


@pytest.mark.timeout(30)
def test_object_state_sync_takes_the_saved_values_through_bcast_object() -> None:
    sent: list[Any] = []

    def bcast(obj: Any) -> Any:
        sent.append(obj)
        return {"epoch": 7, "lr": 0.5}  # what "rank 0" has

    state = hvd.elastic.ObjectState(bcast_object=bcast, get_rank=lambda: 1, epoch=1, lr=0.1)
    state.epoch = 2  # not committed: sync sends the saved values
    state.sync()
    assert sent == [{"epoch": 1, "lr": 0.1}]
    assert (state.epoch, state.lr) == (7, 0.5)
    state.epoch = 0
    state.restore()
    assert state.epoch == 7


@pytest.mark.timeout(30)
def test_reset_callbacks_run_after_the_reset_hook_in_order() -> None:
    calls: list[str] = []

    class Tracked(hvd.elastic.ObjectState):
        def reset(self) -> None:
            calls.append("reset")

    state = Tracked(epoch=0)
    state.register_reset_callbacks([lambda: calls.append("a")])
    state.register_reset_callbacks([lambda: calls.append("b"), lambda: calls.append("c")])
    state.on_hosts_updated(123, 1)  # Horovod's hook: accepted, nothing happens
    state.on_reset()
    assert calls == ["reset", "a", "b", "c"]


@pytest.mark.timeout(30)
def test_state_base_class_leaves_save_restore_sync_abstract() -> None:
    state = hvd.elastic.State()
    for method in (state.save, state.restore, state.sync):
        with pytest.raises(NotImplementedError):
            method()
    state.reset()  # the hook does nothing by default


# ---------------------------------------------------------------- TorchState


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["sgd_momentum", "adam"])
def test_torch_state_rolls_model_optimizer_sampler_and_values_back_to_the_commit(
    job_of_one: None, kind: str
) -> None:
    model = _model()
    if kind == "adam":
        optimizer: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = ElasticSampler(list(range(20)), seed=3)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)
    assert state.model is model and state.optimizer is optimizer and state.sampler is sampler
    initial = _weights(model)

    _step(model, optimizer, 1)
    state.restore()  # back to the constructor's save: fresh weights, no optimizer state
    _assert_weights(model, initial)
    assert optimizer.state_dict()["state"] == {}

    _step(model, optimizer, 2)
    sampler.record_batch(0, 4)
    state.epoch = 1
    state.commit()
    committed = _weights(model)
    committed_optimizer = _optimizer_tensors(optimizer)
    for round_ in range(2):  # twice: steps after a restore must not alter the snapshot
        _step(model, optimizer, 10 + round_)
        sampler.record_batch(1, 4)
        state.epoch = 5
        state.restore()
        _assert_weights(model, committed)
        restored = _optimizer_tensors(optimizer)
        assert restored.keys() == committed_optimizer.keys()
        for key, value in committed_optimizer.items():
            torch.testing.assert_close(restored[key], value, rtol=0, atol=0, msg=key)
        assert sampler.state_dict() == {"epoch": 0, "processed_num": 4}
        assert state.epoch == 1


@pytest.mark.timeout(60)
def test_torch_state_sync_in_a_job_of_one_keeps_the_current_objects(job_of_one: None) -> None:
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    sampler = ElasticSampler(list(range(10)), seed=0)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=2)
    _step(model, optimizer, 1)
    sampler.record_batch(0, 3)
    weights = _weights(model)
    state.sync()
    _assert_weights(model, weights)
    assert sampler.state_dict() == {"epoch": 0, "processed_num": 3}
    assert len(sampler) == 7
    assert state.epoch == 2


@pytest.mark.timeout(30)
def test_assigning_a_handled_attribute_replaces_the_object_and_saves_it(
    job_of_one: None,
) -> None:
    state = hvd.elastic.TorchState(_model(0), None, epoch=0)
    assert state.optimizer is None  # None has no handler: a plain attribute
    replacement = _model(1)
    state.model = replacement
    assert state.model is replacement
    saved = _weights(replacement)
    with torch.no_grad():
        for p in replacement.parameters():
            p.add_(1.0)
    state.restore()
    _assert_weights(replacement, saved)  # the assignment saved the new model


@pytest.mark.timeout(30)
def test_handler_registry_can_be_extended(job_of_one: None) -> None:
    class Counter:
        def __init__(self) -> None:
            self.value = 0

    class CounterHandler(hvd.elastic.StateHandler):
        def __init__(self, value: Counter) -> None:
            super().__init__(value)
            self.saved = value.value

        def save(self) -> None:
            self.saved = self.value.value

        def restore(self) -> None:
            self.value.value = self.saved

        def sync(self) -> None:
            pass

    original = hvd.elastic.get_handler_registry()
    hvd.elastic.set_handler_registry([(Counter, CounterHandler)] + original)
    try:
        counter = Counter()
        state = hvd.elastic.TorchState(counter=counter)
        counter.value = 5
        state.commit()
        counter.value = 9
        state.restore()
        assert counter.value == 5
        assert "counter" not in state._saved_state  # kept by the handler, not as a value
    finally:
        hvd.elastic.set_handler_registry(original)
    assert hvd.elastic.get_handler_registry() == original


@pytest.mark.timeout(30)
def test_torch_state_reset_reshards_its_samplers(job_of_one: None) -> None:
    sampler = ElasticSampler(list(range(9)), shuffle=False)
    state = hvd.elastic.TorchState(sampler=sampler)
    sampler.processed_num = 4  # as a load_state_dict from rank 0 would leave it
    state.on_reset()
    assert list(sampler) == [4, 5, 6, 7, 8]


# ---------------------------------------------------------------- check_host_updates


@pytest.mark.timeout(30)
def test_check_host_updates_raises_once_per_newer_notice(
    job_of_one: None, simulated: SimulatedJob
) -> None:
    simulated.plan = common_elastic.RoundPlan(number=0, updates=0)
    state = hvd.elastic.ObjectState(batch=0)

    state.check_host_updates()  # no notice
    simulated.notice = (1, common_elastic.HOSTS_ADDED)
    with pytest.raises(hvd.elastic.HostsUpdatedInterrupt) as info:
        state.commit()
    assert info.value.skip_sync is False
    state.check_host_updates()  # the same notice again: already handled

    simulated.notice = (2, common_elastic.HOSTS_REMOVED)
    with pytest.raises(hvd.elastic.HostsUpdatedInterrupt) as info:
        state.check_host_updates()
    assert info.value.skip_sync is True

    # The next round already reflects notice 2: nothing to do. One that reflects only notice 1
    # leaves notice 2 pending.
    simulated.plan = common_elastic.RoundPlan(number=1, updates=2)
    state.check_host_updates()
    simulated.plan = common_elastic.RoundPlan(number=2, updates=1)
    with pytest.raises(hvd.elastic.HostsUpdatedInterrupt):
        state.check_host_updates()
    assert simulated.reads == 6  # rank 0 reads the notice at every check


@pytest.mark.timeout(30)
def test_only_rank_0_reads_the_notice(job_of_one: None, simulated: SimulatedJob) -> None:
    simulated.plan = common_elastic.RoundPlan(number=0, updates=0)
    simulated.notice = (5, common_elastic.HOSTS_ADDED)
    # A state that believes it is rank 1 contributes zeros (in a real job rank 0's values win).
    state = hvd.elastic.ObjectState(get_rank=lambda: 1, batch=0)
    state.check_host_updates()
    assert simulated.reads == 0


# ---------------------------------------------------------------- run


class _Recorder(hvd.elastic.ObjectState):
    def __init__(self, log: list[str], **kwargs: Any) -> None:
        self._log = log
        super().__init__(bcast_object=lambda obj: obj, **kwargs)

    def save(self) -> None:
        self._log.append("save")
        super().save()

    def restore(self) -> None:
        self._log.append("restore")
        super().restore()

    def sync(self) -> None:
        self._log.append("sync")
        super().sync()

    def reset(self) -> None:
        self._log.append("on_reset")


@pytest.mark.timeout(30)
def test_run_outside_an_elastic_job_syncs_once_calls_once_and_lets_errors_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("HORA_ELASTIC", raising=False)
    log: list[str] = []
    state = _Recorder(log, epoch=0)

    @hvd.elastic.run
    def train(state: Any, factor: int, offset: int = 0) -> int:
        log.append("train")
        return factor * 10 + offset

    assert train(state, 4, offset=2) == 42
    assert log == ["sync", "train"]
    assert train.__name__ == "train"

    @hvd.elastic.run
    def failing(state: Any) -> None:
        raise hvd.HorovodInternalError("lost a peer")

    log.clear()
    with pytest.raises(hvd.HorovodInternalError, match="lost a peer"):
        failing(state)
    assert log == ["sync"]


@pytest.mark.timeout(30)
def test_run_in_an_elastic_job_restores_on_failure_and_always_syncs_after_a_reset(
    simulated: SimulatedJob,
) -> None:
    log = simulated.log
    state = _Recorder(log, epoch=0)
    before = hvd.elastic.reset_count()
    outcomes: list[BaseException | None] = [
        hvd.HorovodInternalError("peer lost"),
        hvd.HostsUpdatedInterrupt(skip_sync=True),  # hora syncs anyway (Horovod #3494)
        None,
    ]

    @hvd.elastic.run
    def train(state: Any) -> str:
        log.append("train")
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome
        return "done"

    assert train(state) == "done"
    assert log == [
        "sync",
        "train",
        "restore",
        "request_reset",
        "reset",
        "on_reset",
        "sync",
        "train",
        "save",  # the progress made since the commit survives a host change
        "reset",
        "on_reset",
        "sync",
        "train",
    ]
    assert hvd.elastic.reset_count() == before + 2


@pytest.mark.timeout(30)
def test_run_retries_a_reset_that_fails_and_lets_worker_removed_exit(
    simulated: SimulatedJob,
) -> None:
    log = simulated.log
    resets: list[BaseException | None] = [
        hvd.HorovodInternalError("a worker of the new round was lost"),
        None,
        common_elastic.WorkerRemoved("host-b:0", 3),
    ]

    def reset() -> None:
        outcome = resets.pop(0)
        if outcome is not None:
            raise outcome

    simulated.on_rejoin = reset
    state = _Recorder(log, epoch=0)

    @hvd.elastic.run
    def train(state: Any) -> None:
        log.append("train")
        raise hvd.HostsUpdatedInterrupt()

    with pytest.raises(SystemExit) as info:
        train(state)
    assert info.value.code == 0
    assert log == [
        "sync",
        "train",
        "save",
        # Fails: hora is down, and the state was saved just before: no restore. Ask for a new
        # round and try again.
        "reset",
        "request_reset",
        "reset",
        "on_reset",
        "sync",
        "train",
        "save",
        "reset",  # this worker is not in the next round
    ]


@pytest.mark.timeout(30)
def test_run_warns_about_collectives_before_the_first_elastic_function(
    job_of_one: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(runtime(), "elastic_entered", False)
    hvd.allreduce(torch.ones(1), name="too.early")
    monkeypatch.setattr(runtime(), "elastic_job", SimulatedJob())
    hora_logger = logging.getLogger("hora")
    hora_logger.addHandler(caplog.handler)  # hora's logger does not propagate
    try:

        @hvd.elastic.run
        def train(state: Any) -> int:
            return 1

        assert train(hvd.elastic.ObjectState(epoch=0)) == 1
        assert train(hvd.elastic.ObjectState(epoch=0)) == 1
    finally:
        hora_logger.removeHandler(caplog.handler)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # once per process
    assert "ran before the first hvd.elastic.run function" in warnings[0]


# ---------------------------------------------------------------- ElasticSampler


def _consume(indices: list[int], batches: int, batch_size: int) -> list[int]:
    return indices[: batches * batch_size]


@pytest.mark.timeout(30)
def test_sampler_shuffles_by_epoch_and_seed_the_same_on_every_rank() -> None:
    data = list(range(50))

    def shards(epoch: int, seed: int = 0, shuffle: bool = True) -> list[list[int]]:
        out = []
        for rank in range(3):
            sampler = ElasticSampler(
                data, shuffle=shuffle, seed=seed, pad=False, num_replicas=3, rank=rank
            )
            sampler.set_epoch(epoch)
            out.append(list(sampler))
        return out

    epoch0, epoch1 = shards(0), shards(1)
    for ranks in (epoch0, epoch1):
        flat = sorted(i for shard in ranks for i in shard)
        assert flat == data  # a partition: every sample once
    assert epoch0 != epoch1
    assert shards(0) == epoch0  # deterministic
    assert shards(0, seed=1) != epoch0
    assert shards(1, seed=0) == shards(0, seed=1)  # the seed is seed + epoch
    assert shards(0, shuffle=False) == [data[0::3], data[1::3], data[2::3]]


@pytest.mark.timeout(30)
def test_sampler_gives_every_rank_as_many_samples_as_horovods_does() -> None:
    # 97 samples on 2 ranks: 49 each, one sample repeated (the first of the permutation).
    samplers = [ElasticSampler(range(97), seed=2, num_replicas=2, rank=r) for r in range(2)]
    shares = [list(s) for s in samplers]
    assert [len(s) for s in samplers] == [49, 49] and [len(s) for s in shares] == [49, 49]
    assert all(s.num_samples == 49 and s.total_size == 98 for s in samplers)
    together = shares[0] + shares[1]
    assert sorted(set(together)) == list(range(97))
    assert len(together) - len(set(together)) == 1
    # Batches of 4: 13 on each rank, so a plain `for batch in loader` stays in step.
    assert {s.num_batches(4) for s in samplers} == {13}
    # At most n - 1 repeats, even when fewer samples are left than ranks.
    tiny = [list(ElasticSampler(range(2), num_replicas=3, rank=r)) for r in range(3)]
    assert [len(t) for t in tiny] == [1, 1, 1] and sorted(sum(tiny, [])) in ([0, 0, 1], [0, 1, 1])
    samplers[0].record_batch(0, 4)
    assert samplers[0].processed_indices == set(samplers[0]._order[:8])


@pytest.mark.timeout(30)
def test_sampler_len_is_this_ranks_share_without_padding() -> None:
    def exact(size: int, replicas: int, rank: int) -> ElasticSampler:
        return ElasticSampler(range(size), pad=False, num_replicas=replicas, rank=rank)

    lengths = [len(exact(10, 4, r)) for r in range(4)]
    assert lengths == [3, 3, 2, 2]
    sampler = exact(10, 4, 0)
    sampler.record_batch(0, 2)  # 8 of 10 done
    assert len(sampler) == 3  # __len__ changes only at a reset
    sampler.reset()
    assert len(sampler) == 1
    assert [len(exact(2, 3, r)) for r in range(3)] == [1, 1, 0]


@pytest.mark.timeout(30)
def test_sampler_num_batches_is_the_largest_shares_count_on_every_rank() -> None:
    # 10 samples on 4 ranks, exact shares: 3, 3, 2, 2; rank 0's is a largest.
    for batch_size, expected in [(1, 3), (2, 2), (3, 1), (4, 1)]:
        counts = {
            ElasticSampler(range(10), pad=False, num_replicas=4, rank=r).num_batches(batch_size)
            for r in range(4)
        }
        assert counts == {expected}, batch_size
    sampler = ElasticSampler(range(10), pad=False, num_replicas=4, rank=3)
    sampler.record_batch(0, 2)
    sampler.reset()
    assert sampler.num_batches(2) == 1  # 2 samples left: one batch on ranks 0 and 1
    sampler.record_batch(1, 2)
    sampler.reset()
    assert (len(sampler), sampler.num_batches(2)) == (0, 0)
    with pytest.raises(ValueError, match="batch_size"):
        sampler.num_batches(0)


@pytest.mark.timeout(30)
def test_sampler_rejects_an_impossible_sharding() -> None:
    with pytest.raises(ValueError, match="num_replicas"):
        ElasticSampler(range(4), num_replicas=0, rank=0)
    with pytest.raises(ValueError, match="out of range"):
        ElasticSampler(range(4), num_replicas=2, rank=2)


@pytest.mark.timeout(30)
def test_sampler_state_dict_round_trip_and_set_epoch_starts_over() -> None:
    sampler = ElasticSampler(range(30), seed=5, num_replicas=2, rank=1)
    sampler.set_epoch(3)
    sampler.record_batch(0, 4)
    sampler.record_indices([1, 2, 3])
    assert sampler.state_dict() == {"epoch": 3, "processed_num": 14}

    other = ElasticSampler(range(30), seed=5, num_replicas=2, rank=1)
    other.load_state_dict(sampler.state_dict())
    sampler.reset()
    assert list(other) == list(sampler)
    assert len(other) == 8

    sampler.record_batch(1, 100)  # the last batch: capped at the data set's size
    assert sampler.processed_num == 30
    sampler.set_epoch(4)
    assert sampler.state_dict() == {"epoch": 4, "processed_num": 0}
    assert len(sampler) == 15


@pytest.mark.timeout(30)
def test_sampler_works_with_a_data_loader() -> None:
    data = torch.arange(11)
    sampler = ElasticSampler(data, seed=1, num_replicas=2, rank=0)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)
    batches = [b.tolist() for b in loader]
    assert [len(b) for b in batches] == [4, 2]
    assert [i for b in batches for i in b] == list(sampler)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "changes",
    [
        # (world size, full batches every rank consumes before the next change; None: the rest)
        [(3, 2), (2, None)],
        [(2, 1), (3, 3), (1, None)],
        [(4, 0), (2, 2), (5, 1), (3, None)],
        [(1, 5), (4, None)],
    ],
)
@pytest.mark.parametrize("dataset_size", [37, 48])
def test_sampler_processes_every_sample_exactly_once_when_the_world_changes_mid_epoch(
    changes: list[tuple[int, int | None]], dataset_size: int
) -> None:
    data = list(range(dataset_size))
    batch_size = 3
    epoch_order = ElasticSampler(data, seed=9, pad=False, num_replicas=1, rank=0)
    epoch_order.set_epoch(2)
    permutation = list(epoch_order)
    consumed: list[int] = []
    committed = {"epoch": 2, "processed_num": 0}
    for size, batches in changes:
        samplers = []
        for rank in range(size):
            sampler = ElasticSampler(data, seed=9, pad=False, num_replicas=size, rank=rank)
            sampler.load_state_dict(committed)  # what TorchState.sync gives every rank
            samplers.append(sampler)
        shares = [list(s) for s in samplers]
        assert sorted(i for share in shares for i in share) == sorted(
            permutation[committed["processed_num"] :]
        )
        if batches is None:  # the rest of the epoch, the uneven last batches included
            batches = -(-len(shares[0]) // batch_size)  # rank 0 has the most batches
        for share in shares:
            consumed.extend(share[: batches * batch_size])
        for batch in range(batches):
            samplers[0].record_batch(batch, batch_size)
        committed = samplers[0].state_dict()  # rank 0's commit
        # What the job consumed is exactly the prefix the sampler counts.
        assert sorted(consumed) == sorted(permutation[: committed["processed_num"]])
    assert committed["processed_num"] == dataset_size
    assert len(consumed) == dataset_size  # nothing twice
    assert sorted(consumed) == data  # nothing skipped
