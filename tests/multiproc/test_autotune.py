"""Autotune on real processes: every rank tries the same settings, keeps the same one, and
training gives the same parameters as without autotune."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hora.common.engine.autotune import candidates

from .jobs import run_job

STEPS = 40


def _train(steps: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    import hora.torch as hvd
    from hora.common import basics

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 512),
        torch.nn.Linear(512, 4),
    )
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters()
    )
    generator = torch.Generator().manual_seed(hvd.rank())
    x, y = torch.randn(8, 64, generator=generator), torch.randint(0, 4, (8,), generator=generator)
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    engine = basics.engine()
    tuner = engine.autotuner
    result = {
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
        "chosen": None if tuner is None else tuner.current,
        "done": tuner is not None and tuner.done,
        "trials": 0 if tuner is None else len(tuner.trials),
        "left": engine.steady_stats["left"],
    }
    hvd.shutdown()
    return result


def _tuning(log: Path) -> dict[str, str]:
    """Autotune on, logging to ``log``, with short trials (one warm-up step, two measured)."""
    return {
        "HORA_AUTOTUNE": "1",
        "HORA_AUTOTUNE_LOG": str(log),
        "HORA_AUTOTUNE_WARMUP_SAMPLES": "1",
        "HORA_AUTOTUNE_STEPS_PER_SAMPLE": "2",
    }


@pytest.mark.timeout(150)
def test_autotune_agrees_across_ranks_and_changes_no_result(tmp_path: Path) -> None:
    np = 3
    log = tmp_path / "autotune.csv"
    env = _tuning(log)
    tuned = run_job(_train, np, STEPS, env=env)
    plain = run_job(_train, np, STEPS)
    tried = len(candidates(128 * 1024 * 1024))
    for result in tuned:
        assert result["done"] and result["trials"] == tried
        assert result["chosen"] == tuned[0]["chosen"]
        assert result["left"] == 0  # changing the batches never leaves the steady state
    for a, b in zip(tuned, plain):
        torch.testing.assert_close(a["params"], b["params"], rtol=1e-5, atol=1e-6)
    rows = log.read_text().splitlines()
    assert len(rows) == 1 + tried + 1 and rows[-1].endswith(",chosen")


@pytest.mark.timeout(150)
def test_a_job_that_ends_before_the_search_says_what_it_found(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "autotune.csv"
    env = _tuning(log)
    results = run_job(_train, 2, 12, env=env)
    assert all(not r["done"] and 0 < r["trials"] < len(candidates(128 << 20)) for r in results)
    rows = log.read_text().splitlines()
    assert rows[-1].endswith(",best-so-far"), rows
    err = capfd.readouterr().err
    assert "autotune did not finish" in err and "settings were tried" in err, err[-2000:]
