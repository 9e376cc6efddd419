"""Deterministic mode end to end: the same bits at every world size, across elastic changes and
across a restart from a durable commit; and what it refuses.

The jobs run tests/multiproc/deterministic_train.py with ``horarun``, as a user would: a small
classifier with batch norm and dropout, Adam, ``K`` micro-batches per step. Every comparison is
``torch.equal`` on every parameter, every optimizer state tensor and batch norm's running
statistics: one bit off fails it.

Elastic jobs run on loopback addresses playing hosts (127.0.0.1, 127.0.0.2, ...), as in
tests/multiproc/test_elastic.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from tests.multiproc import deterministic_train
from tests.multiproc.jobs import assert_raised, error_of, run_job
from tests.multiproc.test_elastic import _discovery, _finish, _rewrite_when
from tests.processes import kill_tree, survivors

HORARUN = [sys.executable, "-m", "hora.runner.launch"]
WORKER = str(Path(deterministic_train.__file__))
ROOT = str(Path(__file__).resolve().parents[2])
STEPS = 24  # more than an epoch at K=12 (10 steps of 48 samples), so set_epoch runs too
HOSTS = [f"127.0.0.{n}" for n in range(1, 6)]

# Final states by (K, np), for the tests of this file that compare with an uninterrupted run.
_REFERENCES: dict[tuple[int, int], dict[str, Any]] = {}


def _environment(tmp_path: Path, leaves: int, extra: dict[str, str]) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "DET_K": str(leaves),
        "DET_STEPS": str(STEPS),
        "DET_RESULT": str(tmp_path / "result.pt"),
        "HORA_ELASTIC_TIMEOUT": "60",
        **extra,
    }


def _start(
    tmp_path: Path, leaves: int, flags: list[str], extra: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    command = [*HORARUN, *flags, sys.executable, WORKER]
    return subprocess.Popen(
        command,
        env=_environment(tmp_path, leaves, extra or {}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(tmp_path: Path) -> dict[str, Any]:
    result: dict[str, Any] = torch.load(tmp_path / "result.pt")
    return result


def _train(tmp_path: Path, leaves: int, np: int) -> dict[str, Any]:
    """An uninterrupted job of ``np`` workers; its final state."""
    job = _start(tmp_path, leaves, ["-np", str(np)])
    code, _, err = _finish(job, timeout=150)
    assert code == 0, err[-3000:]
    return _result(tmp_path)


def _reference(tmp_path_factory: pytest.TempPathFactory, leaves: int, np: int) -> dict[str, Any]:
    key = (leaves, np)
    if key not in _REFERENCES:
        _REFERENCES[key] = _train(tmp_path_factory.mktemp(f"k{leaves}np{np}"), leaves, np)
    return _REFERENCES[key]


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Each tensor that differs, by position, with its largest difference ([]: bitwise equal)."""
    first, second = a["tensors"], b["tensors"]
    # 6 parameters, Adam's 3 state tensors each, batch norm's 3 buffers.
    assert len(first) == len(second) == 27, (len(first), len(second))
    return [
        f"tensor {i}: max |diff| {float((x.double() - y.double()).abs().max()):.3e}"
        for i, (x, y) in enumerate(zip(first, second))
        if not torch.equal(x, y)
    ]


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize(("leaves", "sizes"), [(12, (1, 2, 3, 4)), (4, (1, 2, 4))])
def test_every_world_size_that_divides_k_ends_with_the_same_bits(
    tmp_path_factory: pytest.TempPathFactory, leaves: int, sizes: tuple[int, ...]
) -> None:
    results = {np: _reference(tmp_path_factory, leaves, np) for np in sizes}
    for np in sizes[1:]:
        assert _differences(results[sizes[0]], results[np]) == [], (leaves, np)
        assert results[np]["sizes"] == [np] * STEPS


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_an_elastic_job_that_loses_two_workers_and_gains_one_ends_with_the_same_bits(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """np 4, two workers killed before step 6, a host added after step 12: the job runs on 4,
    then 2, then 3 workers, and ends bitwise equal to the uninterrupted job of 4."""
    reference = _reference(tmp_path_factory, 12, 4)
    script, listing = _discovery(tmp_path, HOSTS[:4])
    mark = tmp_path / "grow"
    extra = {
        "DET_KILL": "127.0.0.3:0,127.0.0.4:0@6",
        "DET_MARK": f"{mark}@12",
        "DET_STEP_DELAY": "0.3",
    }
    flags = ["--host-discovery-script", str(script), "-np", "4", "--min-np", "2", "--max-np", "4"]
    job = _start(tmp_path, 12, flags, extra)
    adder, added = _rewrite_when(
        mark, listing, "".join(f"{h}\n" for h in HOSTS[:2] + HOSTS[4:]), 240
    )
    code, _, err = _finish(job, timeout=300)
    adder.join(timeout=5)
    assert code == 0, err[-3000:]
    assert added.is_set()
    result = _result(tmp_path)
    sizes = result["sizes"]
    # Committed steps ran on 4 workers, then on the 2 survivors, then on 3.
    assert sizes[0] == 4 and 2 in sizes and sizes[-1] == 3, sizes
    assert sizes.index(2) <= 6 < sizes.index(3), sizes
    assert _differences(reference, result) == []


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_job_killed_entirely_resumes_from_its_durable_commit_with_the_same_bits(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Killed (every process, at once) at its commit of step 10 on 4 workers, started again
    from the commit directory on 3: it ends bitwise equal to the uninterrupted job of 4."""
    reference = _reference(tmp_path_factory, 12, 4)
    commits = {"HORA_ELASTIC_COMMIT_DIR": str(tmp_path / "commits")}
    mark = tmp_path / "held"
    job = _start(
        tmp_path, 12, ["-np", "4"], {**commits, "DET_HOLD": "10", "DET_HOLD_MARK": str(mark)}
    )
    procs: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 150
        while not mark.exists():
            if job.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"the job did not reach the hold: {job.communicate()[1][-3000:]}"
                )
            time.sleep(0.05)
        time.sleep(0.3)  # the other ranks reach the hold too
    finally:
        procs = kill_tree(job.pid)
        job.communicate(timeout=30)
    assert survivors(procs, timeout_s=10) == []
    assert not (tmp_path / "result.pt").exists()

    job = _start(tmp_path, 12, ["-np", "3"], commits)
    code, _, err = _finish(job, timeout=150)
    assert code == 0, err[-3000:]
    result = _result(tmp_path)
    assert result["sizes"] == [4] * 10 + [3] * (STEPS - 10), result["sizes"]
    assert _differences(reference, result) == []


EXAMPLE = str(Path(ROOT) / "examples" / "deterministic_digits.py")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_example_prints_the_same_fingerprint_at_one_and_three_workers() -> None:
    fingerprints = []
    for np in (1, 3):
        command = [*HORARUN, "-np", str(np), sys.executable, EXAMPLE, "--epochs", "1"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-3000:]
        lines = [line for line in done.stdout.splitlines() if "fingerprint" in line]
        assert len(lines) == 1, done.stdout
        fingerprints.append(lines[0].split("fingerprint ")[1])
    assert fingerprints[0] == fingerprints[1]


# ---------------------------------------------------------------- what it refuses


def _refusals() -> dict[str, Any]:
    """Each configuration deterministic mode refuses, tried on every rank of a job of 2."""
    import torch
    import torch.nn.functional as F

    import hora.torch as hvd
    from hora.torch import deterministic

    hvd.init()
    net = torch.nn.Linear(4, 2)

    def make(**kwargs: Any) -> Any:
        sgd = torch.optim.SGD(net.parameters(), lr=0.1)
        return hvd.DistributedOptimizer(sgd, named_parameters=net.named_parameters(), **kwargs)

    def det(**kwargs: Any) -> Any:
        return make(deterministic=True, microbatches=4, **kwargs)

    x = torch.randn(8, 4)
    found: dict[str, Any] = {
        "no_k": error_of(lambda: make(deterministic=True)),
        "k_without_mode": error_of(lambda: make(microbatches=4)),
        "adasum": error_of(lambda: det(op=hvd.Adasum)),
        "zero": error_of(lambda: det(shard_optimizer_state=True)),
        "groups": error_of(lambda: det(groups=2)),
        "world": error_of(lambda: make(deterministic=True, microbatches=3).local_microbatches()),
        "sampler_world": error_of(lambda: deterministic.DeterministicSampler(range(30), 3, 2)),
    }

    optimizer = det()
    mine = list(optimizer.local_microbatches())
    found["local"] = mine
    other = 2 if hvd.rank() == 0 else 0

    def outside() -> None:
        optimizer.zero_grad()
        net(x).sum().backward()
        optimizer.step()

    def not_mine() -> None:
        optimizer.zero_grad()
        with optimizer.microbatch(other):
            net(x).sum().backward()

    def missing() -> None:
        optimizer.zero_grad()
        with optimizer.microbatch(mine[0]):
            net(x).sum().backward()
        optimizer.step()

    def sync_bn() -> None:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), hvd.SyncBatchNorm(4))
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        opt = hvd.DistributedOptimizer(sgd, deterministic=True, microbatches=4)
        with opt.microbatch(mine[0]):
            model(x).sum().backward()

    def closure() -> None:
        optimizer.step(lambda: F.mse_loss(net(x), torch.zeros(8, 2)))

    def threads() -> None:
        torch.set_num_threads(1 + hvd.rank())
        opt = det()
        opt.zero_grad()
        for index in opt.local_microbatches():
            with opt.microbatch(index):
                net(x).sum().backward()
        opt.step()

    found["threads"] = error_of(threads)
    torch.set_num_threads(1)
    found["outside"] = error_of(outside)
    found["not_mine"] = error_of(not_mine)
    found["missing"] = error_of(missing)
    found["sync_bn"] = error_of(sync_bn)
    found["closure"] = error_of(closure)
    hvd.shutdown()
    return found


@pytest.mark.timeout(120)
def test_what_deterministic_mode_cannot_honour_is_refused_with_the_reason() -> None:
    results = run_job(_refusals, 2)
    assert [found["local"] for found in results] == [[0, 1], [2, 3]]
    for found in results:
        assert_raised(found["no_k"], ValueError, "needs K", "HORA_DETERMINISTIC_MICROBATCHES")
        assert_raised(found["k_without_mode"], ValueError, "deterministic=True")
        assert_raised(found["adasum"], ValueError, "Adasum", "number of ranks")
        assert_raised(found["zero"], ValueError, "shard_optimizer_state", "reduce-scatter")
        assert_raised(found["groups"], ValueError, "groups")
        for key in ("world", "sampler_world"):
            assert_raised(found[key], ValueError, "K=3", "2 ranks", "divides K (1, 3)")
        assert_raised(found["outside"], ValueError, "outside optimizer.microbatch()")
        assert_raised(found["not_mine"], ValueError, "is not this rank's")
        assert_raised(found["missing"], ValueError, "did not run in this one")
        assert_raised(found["sync_bn"], ValueError, "SyncBatchNorm", "number of ranks")
        assert_raised(found["closure"], ValueError, "closure")
        assert_raised(found["threads"], ValueError, "intra-op threads", "set_num_threads")
