"""``hora timeline`` on timelines written by real jobs: a rank that is slow to reach backward is
named as the straggler, and the files of a job that lost a rank can still be read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hora.tools import timeline as tl

from .jobs import run_failing_job, run_job

ROOT = Path(__file__).resolve().parents[2]
STEPS = 40
SLEEP_S = 0.02


def _train(steps: int, slow_rank: int, sleep_s: float, die_at: int = -1) -> str:
    """Train a small MLP; ``slow_rank`` sleeps before every backward, ``die_at`` kills the last
    rank at that step (the others report the error they get)."""
    import os
    import signal
    import time

    import torch
    import torch.nn.functional as F

    import hora.torch as hvd

    torch.set_num_threads(1)  # on a busy machine, more threads per rank only add noise
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(rank)
    layers = [torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(64, 10))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    try:
        for step in range(steps):
            if step == die_at and rank == size - 1:
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            if rank == slow_rank:
                time.sleep(sleep_s)
            loss.backward()
            optimizer.step()
    except hvd.HoraInternalError as exc:
        return f"failed: {exc}"
    return "done"


def _hora(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "hora.cli", "timeline", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, f"{command}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("np", "slow"), [(2, 0), (3, 1)])
def test_the_rank_that_sleeps_before_backward_is_the_straggler(
    tmp_path: Path, np: int, slow: int
) -> None:
    path = tmp_path / "timeline.json"
    results = run_job(_train, np, STEPS, slow, SLEEP_S, env={"HORA_TIMELINE": str(path)})
    assert results == ["done"] * np

    summary = tl.summarize(tl.load(path))
    assert summary.ranks == list(range(np))
    assert [r.steps for r in summary.per_rank] == [STEPS - 1] * np, summary.per_rank
    straggler = summary.straggler
    assert straggler is not None, summary
    assert straggler.rank == slow, straggler
    assert straggler.clear, straggler  # last in at least 75% (2 ranks) or 67% (3 ranks)
    # The others wait about the sleep each time (other work adds a little).
    assert 0.6 * SLEEP_S * 1000 < straggler.wait_ms_mean < 10 * SLEEP_S * 1000, straggler
    for r in summary.per_rank:
        # Medians: the first collectives compare ranks that started seconds apart.
        assert r.calls >= 6 * STEPS and r.wait_ms_median is not None, r
        if r.rank == slow:
            assert r.wait_ms_median < 0.25 * SLEEP_S * 1000, r
        else:
            assert r.wait_ms_median > 0.6 * SLEEP_S * 1000, r
    assert summary.step_ms_median is not None and summary.step_ms_median > SLEEP_S * 1000
    assert summary.comm_share is not None and 0 < summary.comm_share < 1
    assert summary.overlap_share is not None and 0 <= summary.overlap_share <= 1
    assert {t.name.rsplit(".", 1)[-1] for t in summary.tensors} >= {"weight", "bias"}
    assert summary.fusion is not None and summary.fusion.batches >= STEPS

    text = _hora("summarize", str(path)).stdout
    assert f"Rank {slow} is the straggler" in text, text
    data = json.loads(_hora("summarize", str(path), "--json", "--top", "3").stdout)
    assert data["straggler"]["rank"] == slow
    assert len(data["tensors"]) == 3


def _lose_a_rank(tmp_path: Path, np: int) -> Path:
    path = tmp_path / "timeline.json"
    # The slow steps keep the last rank alive past the writer's first flush before it dies.
    error = run_failing_job(
        _train, np, 40, np - 1, 0.05, 30, env={"HORA_TIMELINE": str(path)}, timeout_s=80
    )
    # The survivors either report the lost rank or are stopped by the launcher: either way
    # their files may be closed or not, and the reader must take them as they are.
    assert "SIGKILL" in error.errors.get(np - 1, ""), error.errors
    return path


@pytest.mark.timeout(150)
def test_the_files_of_a_job_that_lost_a_rank_can_be_read(tmp_path: Path) -> None:
    path = _lose_a_rank(tmp_path, 3)
    assert [p.name for p in tl.rank_files(path)] == [
        "timeline.json",
        "timeline.rank1.json",
        "timeline.rank2.json",
    ]

    timeline = tl.load(path)
    assert timeline.ranks == [0, 1, 2]
    killed = next(f for f in timeline.files if f.path.endswith("rank2.json"))
    assert not killed.closed
    assert any("timeline.rank2.json' was cut short" in w for w in timeline.warnings)
    summary = tl.summarize(timeline)
    # Each file holds what its writer had flushed (at least once a second) when it stopped.
    assert all(r.steps >= 5 for r in summary.per_rank), summary.per_rank
    assert all(r.calls >= 6 * 5 for r in summary.per_rank), summary.per_rank
    assert summary.straggler is not None and summary.straggler.rank == 2

    text = _hora("summarize", str(path)).stdout
    assert "was cut short" in text, text
    merged = tmp_path / "merged.json"
    _hora("merge", str(path), "-o", str(merged))
    events: list[dict[str, Any]] = json.loads(merged.read_text())
    assert {e["pid"] for e in events} == {0, 1, 2}
