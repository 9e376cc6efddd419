"""Timelines written by real jobs: every rank's phases, the optimizer's markers, the merge at
the end, start/stop at run time, horarun's flag, and a job that loses a rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from hora.common.vocabulary.timeline_writer import rank_files, read_events

from .jobs import run_failing_job, run_job

STEPS = 8


def _train(steps: int, window: tuple[int, int] | None = None, path: str = "", die: int = -1) -> int:
    import os

    import torch
    import torch.nn.functional as F

    import hora.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    for step in range(steps):
        if window is not None and step == window[0]:
            hvd.start_timeline(path)
        if window is not None and step == window[1]:
            hvd.stop_timeline()
        if step == 3 and hvd.rank() == die:
            os._exit(5)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    hvd.broadcast(torch.zeros(2), root_rank=0, name="after.training")
    hvd.shutdown()
    return 0


def _by_rank(events: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    ranks: dict[int, list[dict[str, Any]]] = {}
    for event in events:
        ranks.setdefault(event["pid"], []).append(event)
    return ranks


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np", [2, 3])
def test_a_job_writes_one_merged_timeline_with_every_ranks_phases(tmp_path: Path, np: int) -> None:
    path = tmp_path / "timeline.json"
    run_job(_train, np, STEPS, env={"HORA_TIMELINE": str(path)})
    assert [rank for rank, _ in rank_files(path)] == [0], "the rank files were not merged"
    events = json.loads(path.read_text())  # valid JSON as a whole
    ranks = _by_rank(events)
    assert sorted(ranks) == list(range(np))
    for rank, mine in ranks.items():
        counts = Counter(e["name"] for e in mine)
        assert counts["BACKWARD"] == STEPS and counts["OPTIMIZER_STEP"] == STEPS, counts
        assert counts["STEADY_STATE_ENTER"] == 1, counts
        rows = {e["tid"]: e["args"]["name"] for e in mine if e["name"] == "thread_name"}
        grads = {tid for tid, name in rows.items() if name.startswith("allreduce.")}
        assert len(grads) == 4, rows  # two weights, two biases
        for tid in grads:
            phases = [e["name"] for e in mine if e.get("tid") == tid and e["ph"] == "X"]
            waits = [p for p in phases if p in ("NEGOTIATE_ALLREDUCE", "WAIT_FOR_BATCH")]
            assert len(waits) == STEPS and phases.count("ALLREDUCE") == STEPS, (rank, phases)
            assert "WAIT_FOR_BATCH" in waits and "NEGOTIATE_ALLREDUCE" in waits
        collectives = [e for e in mine if e["name"] == "ALLREDUCE"]
        assert all(e["args"]["bytes"] > 0 and e["args"]["tensors"] >= 1 for e in collectives)
        assert counts["BROADCAST"] == 1
        for event in mine:
            if event["ph"] == "X":
                assert event["dur"] >= 0 and event["ts"] > 1.6e15  # microseconds since 1970


@pytest.mark.timeout(120)
def test_start_and_stop_timeline_at_run_time(tmp_path: Path) -> None:
    path = tmp_path / "window.json"
    run_job(_train, 2, STEPS, (2, 5), str(path))
    events = json.loads(path.read_text())
    steps = [e for e in events if e["name"] == "OPTIMIZER_STEP"]
    assert Counter(e["pid"] for e in steps) == {0: 3, 1: 3}
    assert not any(e["name"] == "BROADCAST" for e in events)


@pytest.mark.timeout(120)
def test_horarun_timeline_flag(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\nimport hora.torch as hvd\nhvd.init()\n"
        "for i in range(3):\n    hvd.allreduce(torch.ones(4), name='x')\n"
    )
    path = tmp_path / "out" / "flag.json"
    command = [sys.executable, "-m", "hora.runner.launch", "-np", "2"]
    command += ["--timeline-filename", str(path), "--timeline-mark-cycles"]
    result = subprocess.run(
        [*command, sys.executable, str(script)], capture_output=True, text=True, timeout=90
    )
    assert result.returncode == 0, result.stderr
    events = json.loads(path.read_text())
    assert {e["pid"] for e in events if e["name"] == "ALLREDUCE"} == {0, 1}
    assert any(e["name"] == "CYCLE_START" for e in events)


@pytest.mark.timeout(120)
def test_the_files_of_a_job_that_lost_a_rank_stay_readable(tmp_path: Path) -> None:
    path = tmp_path / "lost.json"
    run_failing_job(_train, 2, STEPS, None, "", 1, env={"HORA_TIMELINE": str(path)})
    files = dict(rank_files(path))
    assert sorted(files) == [0, 1], "no merge after a failure: both parts stay"
    survivor = read_events(files[0])
    lost = read_events(files[1])
    assert any(e["name"] == "OPTIMIZER_STEP" for e in survivor)
    assert sum(e["name"] == "OPTIMIZER_STEP" for e in lost) == 3
    assert os.path.getsize(files[1]) > 0


def _init_only() -> int:
    import hora.torch as hvd

    hvd.init()
    hvd.shutdown()
    return 0


@pytest.mark.timeout(120)
def test_a_timeline_that_cannot_be_written_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    path = blocker / "timeline.json"
    error = run_failing_job(_init_only, 2, env={"HORA_TIMELINE": str(path)})
    text = str(error) + " ".join(str(e) for e in error.errors.values())
    assert "cannot write the timeline file" in text and "HORA_TIMELINE" in text, text
    assert "rank 0" in text or "rank 1" in text


def _read_while_running() -> str:
    import time

    import torch

    import hora.torch as hvd

    hvd.init()
    hvd.allreduce(torch.ones(3), name="while_running")
    time.sleep(0.3)  # the engine goes idle meanwhile
    text = Path(os.environ["HORA_TIMELINE"]).read_text() if hvd.rank() == 0 else ""
    hvd.shutdown()
    return text


@pytest.mark.timeout(120)
def test_the_file_shows_a_finished_call_while_the_job_runs(tmp_path: Path) -> None:
    # As Horovod's own timeline test reads it: names as Horovod writes them, before the end.
    path = tmp_path / "live.json"
    env = {"HORA_TIMELINE": str(path), "HORA_TIMELINE_MARK_CYCLES": "1"}
    text = run_job(_read_while_running, 2, env=env)[0]
    for expected in ("allreduce.while_running", "NEGOTIATE_ALLREDUCE", "ALLREDUCE", "CYCLE_START"):
        assert expected in text, text[:2000]
