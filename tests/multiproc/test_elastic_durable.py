"""Durable commits end to end: an elastic job that loses every worker resumes from its last commit.

The workers run tests/multiproc/elastic_train.py under an elastic ``horarun`` (loopback
addresses playing hosts), with ``HORA_ELASTIC_COMMIT_DIR`` set. The test stops the job at a
commit (every rank holds there), then SIGKILLs ``horarun`` and every process under it at once:
nothing survives but the directory. The same job started again must go on from the last commit
that reached the directory: rank 0's log of steps shows each step of the job once, in order,
across both runs (the steps after that commit ran in the first run and again in the second, but
were never committed), and the committed history used every sample of every epoch once and
replays to the final weights.

Two places to stop: just after a commit returned, and inside rank 0's commit, after the
temporary file was written and fsynced but before its rename (the commit before stays the
durable one, and the temporary file is never read).
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import psutil
import pytest

import hora.torch as hvd
from tests.multiproc import elastic_train
from tests.multiproc.test_elastic import _check_history, _discovery, _finish, _start
from tests.processes import kill_tree, survivors

HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]


def _uninterrupted_steps(np: int) -> list[tuple[int, int]]:
    """``(epoch, batch)`` of every step of the whole job, in order."""
    shares = [len(range(rank, elastic_train.SAMPLES, np)) for rank in range(np)]
    batches = -(-max(shares) // elastic_train.BATCH)
    return [(e, b) for e in range(elastic_train.EPOCHS) for b in range(1, batches + 1)]


def _commits_in(steps: list[tuple[int, int]]) -> int:
    """How many commits an uninterrupted job makes: every COMMIT_EVERY batches, and per epoch."""
    return sum(b % elastic_train.COMMIT_EVERY == 0 for _, b in steps) + elastic_train.EPOCHS


def _log(path: Path) -> list[tuple[int, int]]:
    lines = path.read_text().split() if path.exists() else []
    return [(int(e), int(b)) for e, b in zip(lines[0::2], lines[1::2])]


def _run_until_held(tmp_path: Path, np: int, env: dict[str, str]) -> None:
    """Start the job; once every rank holds at the commit, kill all of it."""
    script, _ = _discovery(tmp_path, HOSTS[:np])
    mark = tmp_path / "held"
    job = _start(
        tmp_path,
        script,
        ["-np", str(np), "--min-np", str(np)],
        {**env, "ELASTIC_HOLD_MARK": str(mark)},
    )
    procs: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 60
        while not mark.exists():
            if job.poll() is not None or time.monotonic() > deadline:
                out, err = job.communicate(timeout=30) if job.poll() is not None else ("", "")
                raise AssertionError(f"the job did not reach the hold:\n{out}\n{err[-3000:]}")
            time.sleep(0.05)
        time.sleep(0.2)  # every other rank is at the commit too (waiting for rank 0, or held)
        procs = kill_tree(job.pid)
        job.communicate(timeout=30)
        assert job.returncode == -signal.SIGKILL
    finally:
        if job.poll() is None:
            procs = kill_tree(job.pid)
            job.communicate(timeout=30)
    assert survivors(procs, timeout_s=10) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("np", "where"),
    [(2, "after"), (2, "inside"), (3, "inside")],
)
def test_a_job_that_lost_every_worker_resumes_from_its_last_durable_commit(
    tmp_path: Path, np: int, where: str
) -> None:
    commit_dir = tmp_path / "commits"
    expected = _uninterrupted_steps(np)
    hold_at = 8  # a commit in epoch 1 (np=2: its first; np=3: its third)
    first_log, second_log = tmp_path / "run1.log", tmp_path / "run2.log"
    env = {"HORA_ELASTIC_COMMIT_DIR": str(commit_dir)}

    hold = "ELASTIC_HOLD_AFTER_COMMIT" if where == "after" else "ELASTIC_HOLD_IN_COMMIT"
    _run_until_held(tmp_path, np, {**env, hold: str(hold_at), "ELASTIC_STEP_LOG": str(first_log)})

    first = _log(first_log)
    record = hvd.elastic.read_commit(commit_dir)
    assert record is not None
    leftovers = sorted(p.name for p in commit_dir.iterdir() if p.name != "commit.pt")
    if where == "after":
        assert record["commit"] == hold_at and leftovers == []
    else:
        # Killed between the temporary file and its rename: the commit before stays.
        assert record["commit"] == hold_at - 1
        assert len(leftovers) == 1 and leftovers[0].endswith(".tmp"), leftovers
    durable_step = (record["values"]["epoch"], record["values"]["batch"])
    # The step the durable commit is at: the end of an epoch is (epoch + 1, 0).
    done = (
        expected.index((durable_step[0] - 1, expected[-1][1])) + 1
        if durable_step[1] == 0
        else expected.index(durable_step) + 1
    )
    assert first == expected[: len(first)], first
    if where == "after":
        assert len(first) == done, (done, first)
    else:  # the steps up to the commit being written ran, but their commit never landed
        assert len(first) > done, (done, first)

    script, _ = _discovery(tmp_path, HOSTS[:np])
    job = _start(
        tmp_path,
        script,
        ["-np", str(np), "--min-np", str(np)],
        {**env, "ELASTIC_STEP_LOG": str(second_log)},
    )
    code, out, err = _finish(job, timeout=90)
    assert code == 0, err[-3000:]

    second = _log(second_log)
    # The second run starts right after the durable commit and goes to the end: with the first
    # run's steps up to that commit, every step once.
    assert first[:done] + second == expected, (done, first, second)
    result = json.loads((tmp_path / "result.json").read_text())
    _check_history(result)
    assert len(result["history"]) == len(expected)
    final = hvd.elastic.read_commit(commit_dir)
    assert final is not None and final["commit"] == _commits_in(expected)
    assert sorted(p.name for p in commit_dir.iterdir()) == ["commit.pt"]
