"""``hvd.elastic`` commits in one process: all-or-nothing, and durable in a ``commit_dir``.

* A commit that fails part-way (a handler's snapshot, a value's copy, the durable write) leaves
  the previous commit whole: ``restore()`` gives its values, and the file on disk is unchanged.
* ``restore()`` checks every snapshot before it changes any object.
* The durable file: written through a temporary file, fsynced, renamed, the directory fsynced;
  read back at the first ``sync()``; a leftover temporary file is never read; a damaged file, a
  directory or file another user could write, a state of another layout: clear errors.

TorchState tests start a job of one in this process (``hvd.init()`` with
``HORA_LAUNCHER=none``); ObjectState tests use ``bcast_object``/``get_rank`` stand-ins.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hora.torch as hvd
from hora.common.elastic import durable

ElasticSampler = hvd.elastic.ElasticSampler


@pytest.fixture(autouse=True)
def no_commit_dir_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HORA_ELASTIC_COMMIT_DIR", raising=False)


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
    optimizer.zero_grad()
    model(torch.randn(5, 4, generator=generator)).pow(2).mean().backward()
    optimizer.step()


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {
        f"{param_id}.{key}": torch.as_tensor(value).clone()
        for param_id, entries in optimizer.state_dict()["state"].items()
        for key, value in entries.items()
    }


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)


class Flaky:
    """An object whose handler's snapshot fails on demand."""

    def __init__(self) -> None:
        self.value = 0
        self.fail = False


class FlakyHandler(hvd.elastic.StateHandler):
    def capture(self) -> Any:
        if self.value.fail:
            raise RuntimeError("flaky snapshot failed")
        return self.value.value

    def apply(self, snapshot: Any) -> None:
        self.value.value = snapshot

    def sync(self) -> None:
        pass


class Counter:
    def __init__(self) -> None:
        self.count = 0


class CounterHandler(hvd.elastic.StateHandler):
    """A handler in Horovod's style: its own save() and restore(), saving in place."""

    def __init__(self, value: Counter) -> None:
        super().__init__(value)
        self.saved = value.count

    def save(self) -> None:
        self.saved = self.value.count

    def restore(self) -> None:
        self.value.count = self.saved

    def sync(self) -> None:
        pass


class Uncopyable:
    """A value whose deep copy fails on demand."""

    fail = False

    def __deepcopy__(self, memo: dict[int, Any]) -> Uncopyable:
        if Uncopyable.fail:
            raise RuntimeError("cannot copy this value")
        return Uncopyable()


class Point:
    """A value of the user's own class: a durable commit holding it needs full unpickling."""

    def __init__(self, x: int) -> None:
        self.x = x


@pytest.fixture
def extra_handlers() -> Iterator[None]:
    original = hvd.elastic.get_handler_registry()
    hvd.elastic.set_handler_registry([(Flaky, FlakyHandler), (Counter, CounterHandler)] + original)
    try:
        yield
    finally:
        hvd.elastic.set_handler_registry(original)


# ---------------------------------------------------------------- all-or-nothing commits


@pytest.mark.timeout(60)
@pytest.mark.parametrize("failing", ["handler", "value"])
def test_a_commit_that_fails_part_way_leaves_the_previous_commit_whole(
    job_of_one: None, extra_handlers: None, failing: str
) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = ElasticSampler(list(range(20)), seed=3)
    counter, flaky = Counter(), Flaky()
    # Model, optimizer, sampler and the Horovod-style counter come before the failing part.
    state = hvd.elastic.TorchState(
        model, optimizer, sampler=sampler, counter=counter, flaky=flaky, other=Uncopyable(), epoch=0
    )
    _step(model, optimizer, 1)
    sampler.record_batch(0, 4)
    counter.count, flaky.value, state.epoch = 1, 1, 1
    state.commit()
    committed = (_weights(model), _optimizer_tensors(optimizer))

    _step(model, optimizer, 2)
    sampler.record_batch(1, 4)
    counter.count, flaky.value, state.epoch = 2, 2, 2
    if failing == "handler":
        flaky.fail = True
        match = "flaky snapshot failed"
    else:
        Uncopyable.fail = True
        match = "cannot copy this value"
    try:
        with pytest.raises(RuntimeError, match=match):
            state.commit()
    finally:
        flaky.fail = Uncopyable.fail = False
    state.restore()
    _assert_same(_weights(model), committed[0])
    _assert_same(_optimizer_tensors(optimizer), committed[1])
    assert sampler.state_dict() == {"epoch": 0, "processed_num": 4}
    assert (counter.count, flaky.value, state.epoch) == (1, 1, 1)
    assert state._commits == 1  # the constructor's save is not counted; the failed one neither


@pytest.mark.timeout(60)
def test_restore_checks_every_snapshot_before_it_changes_any_object(job_of_one: None) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = hvd.elastic.TorchState(model, optimizer, epoch=0)
    _step(model, optimizer, 1)
    state.epoch = 4
    moved = _weights(model)
    # The optimizer's snapshot is checked after the model's: a model restored before the
    # check would be half of a restore.
    state._handlers["optimizer"].committed = {"state": {}, "param_groups": [{"params": [0]}]}
    with pytest.raises(ValueError, match=r"parameters per group are \[1\] in the snapshot, \[4\]"):
        state.restore()
    _assert_same(_weights(model), moved)
    assert state.epoch == 4


@pytest.mark.timeout(60)
def test_a_failed_durable_write_keeps_the_previous_commit_in_memory_and_on_disk(
    job_of_one: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()
    state = hvd.elastic.TorchState(model, None, commit_dir=tmp_path, step=0)
    state.step = 1
    state.commit()
    before = (tmp_path / "commit.pt").read_bytes()
    committed = _weights(model)

    def disk_full(self: durable.CommitDirectory, temp: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(durable.CommitDirectory, "_publish", disk_full)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    state.step = 2
    with pytest.raises(hvd.elastic.DurableCommitError, match="No space left on device") as err:
        state.commit()
    assert str(tmp_path / "commit.pt") in str(err.value)
    assert "The commit was not made" in str(err.value)
    assert (tmp_path / "commit.pt").read_bytes() == before
    assert os.listdir(tmp_path) == ["commit.pt"]  # the temporary file was removed
    state.restore()
    _assert_same(_weights(model), committed)
    assert state.step == 1


# ---------------------------------------------------------------- the durable file


@pytest.mark.timeout(60)
def test_a_commit_is_written_through_a_fsynced_temporary_file_and_a_rename(
    job_of_one: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commit_dir = tmp_path / "commits"  # created by the first commit
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    state = hvd.elastic.TorchState(model, optimizer, commit_dir=commit_dir, epoch=0, batch=0)
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        kind = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        events.append(f"fsync {kind}")
        real_fsync(fd)

    def replace(src: str, dst: str) -> None:
        name = Path(src).name
        assert name.startswith(".commit.pt.") and name.endswith(".tmp"), name
        assert Path(src).parent == commit_dir
        events.append(f"replace -> {Path(dst).name}")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    for batch in (1, 2):
        _step(model, optimizer, batch)
        state.batch = batch
        state.commit()
    monkeypatch.undo()
    assert events == ["fsync file", "replace -> commit.pt", "fsync dir"] * 2
    assert os.listdir(commit_dir) == ["commit.pt"]
    assert stat.S_IMODE(os.stat(commit_dir).st_mode) == 0o700

    record = hvd.elastic.read_commit(commit_dir)
    assert record is not None
    assert (record["format"], record["version"], record["commit"]) == ("hora.elastic.commit", 1, 2)
    assert record["values"] == {"epoch": 0, "batch": 2}
    assert sorted(record["handlers"]) == ["model", "optimizer"]
    _assert_same(record["handlers"]["model"], _weights(model))
    assert hvd.elastic.read_commit(tmp_path / "empty") is None


@pytest.mark.timeout(60)
def test_a_new_state_resumes_from_the_durable_commit_at_its_first_sync(
    job_of_one: None, tmp_path: Path
) -> None:
    model = _model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = ElasticSampler(list(range(20)), seed=3)
    state = hvd.elastic.TorchState(model, optimizer, commit_dir=tmp_path, sampler=sampler, step=0)
    for step in (1, 2, 3):
        _step(model, optimizer, step)
        sampler.record_batch(step - 1, 2)
        state.step = step
        if step == 2:
            state.commit()
            committed = (_weights(model), _optimizer_tensors(optimizer))
    # Step 3 was not committed; every worker is lost. A new job, same directory:
    (tmp_path / ".commit.pt.crashed.tmp").write_bytes(b"half a commit")  # never read
    model2 = _model(1)
    optimizer2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    sampler2 = ElasticSampler(list(range(20)), seed=3)
    resumed = hvd.elastic.TorchState(
        model2, optimizer2, commit_dir=tmp_path, sampler=sampler2, step=0
    )
    assert resumed.step == 0  # not before the sync
    calls: list[int] = []

    @hvd.elastic.run
    def train(state: Any) -> None:
        calls.append(state.step)

    train(resumed)
    assert calls == [2]
    _assert_same(_weights(model2), committed[0])
    _assert_same(_optimizer_tensors(optimizer2), committed[1])
    assert sampler2.state_dict() == {"epoch": 0, "processed_num": 4}
    assert resumed._commits == 1
    assert os.listdir(tmp_path) == ["commit.pt"]  # the leftover was removed
    # A failure now rolls back to the resumed commit, not to the constructor's state.
    _step(model2, optimizer2, 9)
    resumed.step = 9
    resumed.restore()
    _assert_same(_weights(model2), committed[0])
    assert resumed.step == 2
    # Only the first sync reads the file.
    (tmp_path / "commit.pt").write_bytes(b"damaged later")
    resumed.sync()
    resumed.step = 3
    resumed.commit()
    assert hvd.elastic.read_commit(tmp_path)["values"] == {"step": 3}  # type: ignore[index]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "not a commit"])
def test_a_damaged_commit_file_is_a_clear_error(
    job_of_one: None, tmp_path: Path, damage: str
) -> None:
    model = _model()
    state = hvd.elastic.TorchState(model, None, commit_dir=tmp_path, step=0)
    state.step = 1
    state.commit()
    path = tmp_path / "commit.pt"
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
        why = "not a whole torch.save archive"
    elif damage == "flipped byte":  # in the stored weights: only the checksum can tell
        weights = model[0].weight.detach().numpy().tobytes()
        data[data.index(weights) + 5] ^= 0xFF
        path.write_bytes(data)
        why = "fails its checksum"
    else:
        torch.save({"model": 1}, path)
        why = "not a hora elastic commit"
    fresh = hvd.elastic.TorchState(_model(), None, commit_dir=tmp_path, step=0)
    with pytest.raises(hvd.elastic.DurableCommitError) as err:
        fresh.sync()
    message = str(err.value)
    assert f"rank 0 cannot read the durable commit {path}: " in message
    assert why in message
    assert "Move the file away" in message


@pytest.mark.timeout(60)
def test_a_directory_or_file_other_users_can_write_is_refused(
    job_of_one: None, tmp_path: Path
) -> None:
    commit_dir = tmp_path / "commits"
    commit_dir.mkdir()
    commit_dir.chmod(0o777)
    state = hvd.elastic.TorchState(_model(), None, commit_dir=commit_dir, step=0)
    with pytest.raises(hvd.elastic.DurableCommitError) as err:
        state.sync()
    assert f"the elastic commit directory {commit_dir} is writable by other users" in str(err.value)
    assert f"chmod go-w {commit_dir}" in str(err.value)
    with pytest.raises(hvd.elastic.DurableCommitError, match="writable by other users"):
        state.commit()

    commit_dir.chmod(0o755)
    state.commit()
    (commit_dir / "commit.pt").chmod(0o666)
    fresh = hvd.elastic.TorchState(_model(), None, commit_dir=commit_dir, step=0)
    with pytest.raises(hvd.elastic.DurableCommitError, match="commit file .* is writable by"):
        fresh.sync()


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.getuid() != 0, reason="only root can give a directory to another user")
def test_a_directory_of_another_user_is_refused(job_of_one: None, tmp_path: Path) -> None:
    commit_dir = tmp_path / "commits"
    commit_dir.mkdir(mode=0o700)
    os.chown(commit_dir, 4321, -1)
    state = hvd.elastic.TorchState(_model(), None, commit_dir=commit_dir, step=0)
    with pytest.raises(hvd.elastic.DurableCommitError, match="belongs to uid 4321") as info:
        state.sync()
    assert "loaded with pickle" in str(info.value)


@pytest.mark.timeout(60)
def test_a_commit_of_another_layout_is_refused(job_of_one: None, tmp_path: Path) -> None:
    state = hvd.elastic.TorchState(_model(), None, commit_dir=tmp_path, epoch=0)
    state.commit()
    other_values = hvd.elastic.TorchState(_model(), None, commit_dir=tmp_path, step=0)
    with pytest.raises(hvd.elastic.DurableCommitError) as err:
        other_values.sync()
    assert "holds objects ['model'] and values ['epoch', 'optimizer']" in str(err.value)
    assert "values ['optimizer', 'step']" in str(err.value)

    wider = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    before = _weights(wider)
    other_shapes = hvd.elastic.TorchState(wider, None, commit_dir=tmp_path, epoch=0)
    with pytest.raises(hvd.elastic.DurableCommitError, match=r"'0.weight' has shape \(3, 4\)"):
        other_shapes.sync()
    _assert_same(_weights(wider), before)  # checked before anything was applied


@pytest.mark.timeout(60)
def test_values_of_the_users_own_classes_load_from_a_trusted_directory(tmp_path: Path) -> None:
    def make() -> hvd.elastic.ObjectState:
        return hvd.elastic.ObjectState(
            bcast_object=lambda obj: obj, get_rank=lambda: 0, commit_dir=tmp_path, where=None
        )

    state = make()
    state.where = Point(7)
    state.commit()
    fresh = make()
    fresh.sync()
    assert isinstance(fresh.where, Point) and fresh.where.x == 7


@pytest.mark.timeout(60)
def test_the_environment_variable_turns_durable_commits_on_for_object_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HORA_ELASTIC_COMMIT_DIR", str(tmp_path))
    rank = [1]
    state = hvd.elastic.ObjectState(bcast_object=lambda o: o, get_rank=lambda: rank[0], step=0)
    state.step = 5
    state.commit()
    assert os.listdir(tmp_path) == []  # only rank 0 writes
    rank[0] = 0
    state.commit()
    assert hvd.elastic.read_commit(tmp_path)["values"] == {"step": 5}  # type: ignore[index]


@pytest.mark.timeout(60)
def test_every_rank_raises_when_rank_0_cannot_resume(tmp_path: Path) -> None:
    sent: list[Any] = []

    def from_rank_0(obj: Any) -> Any:  # what rank 1 receives from a rank 0 that failed
        sent.append(obj)
        return {"commits": 0, "error": "rank 0 cannot read the durable commit X: ..."}

    state = hvd.elastic.ObjectState(
        bcast_object=from_rank_0, get_rank=lambda: 1, commit_dir=tmp_path, step=0
    )
    with pytest.raises(hvd.elastic.DurableCommitError) as err:
        state.sync()
    assert sent == [None]
    assert str(err.value).startswith("rank 1: rank 0 could not resume from the durable commit")
    assert "cannot read the durable commit X" in str(err.value)


@pytest.mark.timeout(60)
def test_a_first_sync_that_failed_does_not_keep_the_next_rank_0_from_resuming(
    tmp_path: Path,
) -> None:
    writer = hvd.elastic.ObjectState(
        bcast_object=lambda obj: obj, get_rank=lambda: 0, commit_dir=tmp_path, step=0
    )
    writer.step = 4
    writer.commit()
    rank, lost = [1], [True]

    def bcast(obj: Any) -> Any:
        if lost[0]:
            raise hvd.HorovodInternalError("rank 0 was lost")
        return obj

    # This process is rank 1 of the restarted job; rank 0 dies during the first sync, and in
    # the next round this process is rank 0: it must resume from the file, not start afresh.
    state = hvd.elastic.ObjectState(
        bcast_object=bcast, get_rank=lambda: rank[0], commit_dir=tmp_path, step=0
    )
    with pytest.raises(hvd.HorovodInternalError):
        state.sync()
    rank[0], lost[0] = 0, False
    state.sync()
    assert state.step == 4
    state.step = 5
    state.commit()
    state.sync()  # no longer the first: the commit in memory stays (the file has it too)
    assert state.step == 5


@pytest.mark.timeout(60)
def test_a_horovod_style_handler_cannot_be_made_durable(
    job_of_one: None, extra_handlers: None, tmp_path: Path
) -> None:
    with pytest.raises(TypeError, match=r"counter \(CounterHandler\) override save\(\)/restore"):
        hvd.elastic.TorchState(counter=Counter(), commit_dir=tmp_path)
    hvd.elastic.TorchState(counter=Counter())  # in memory it works as before
