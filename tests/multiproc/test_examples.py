"""The example scripts, run end to end through horarun on two workers."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .jobs import mpi_env, mpirun_command

ROOT = Path(__file__).resolve().parents[2]
DIGITS = str(ROOT / "examples" / "pytorch_digits.py")
BENCHMARK = str(ROOT / "examples" / "pytorch_synthetic_benchmark.py")
HORARUN = [sys.executable, "-m", "hora.runner.launch"]

FINAL = re.compile(r"^\[0\]<stdout>:final test accuracy: (\d\.\d{4})$", re.MULTILINE)
EPOCH = re.compile(r"^\[0\]<stdout>:epoch (\d+)/(\d+): train loss (\S+), ", re.MULTILINE)


def _run(script: str, *args: str, np: int = 2, timeout: float = 120) -> str:
    """Run ``script`` on ``np`` workers; returns its output, or fails showing all of it."""
    command = [*HORARUN, "-np", str(np), sys.executable, script, *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert result.returncode == 0, (
        f"{' '.join(command)} exited with {result.returncode}\n"
        f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )
    return result.stdout


def _epoch_losses(output: str) -> dict[int, str]:
    """Rank 0's epoch summaries: epoch number -> train loss as printed."""
    return {int(m.group(1)): m.group(3) for m in EPOCH.finditer(output)}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """One training of the default 10 epochs with a checkpoint: (rank 0's output, checkpoint)."""
    checkpoint = tmp_path_factory.mktemp("full") / "digits.pt"
    return _run(DIGITS, "--no-progress", "--checkpoint", str(checkpoint)), checkpoint


@pytest.mark.timeout(150)
def test_digits_reaches_95_percent_and_writes_a_checkpoint(full_run: tuple[str, Path]) -> None:
    output, checkpoint = full_run
    finals = FINAL.findall(output)
    assert len(finals) == 1, output
    assert float(finals[0]) >= 0.95, output
    assert sorted(_epoch_losses(output)) == list(range(1, 11)), output
    state = torch.load(checkpoint, map_location="cpu")
    assert state["epoch"] == 10
    assert {"model", "optimizer"} <= state.keys()
    assert not Path(f"{checkpoint}.tmp").exists()


@pytest.mark.timeout(180)
def test_digits_resume_continues_after_the_checkpoint(
    full_run: tuple[str, Path], tmp_path: Path
) -> None:
    checkpoint = str(tmp_path / "digits.pt")
    first = _run(DIGITS, "--no-progress", "--epochs", "1", "--checkpoint", checkpoint)
    assert sorted(_epoch_losses(first)) == [1], first
    assert torch.load(checkpoint, map_location="cpu")["epoch"] == 1

    resumed = _run(
        DIGITS, "--no-progress", "--epochs", "10", "--checkpoint", checkpoint, "--resume"
    )
    assert sorted(_epoch_losses(resumed)) == list(range(2, 11)), resumed
    assert torch.load(checkpoint, map_location="cpu")["epoch"] == 10

    # The first epoch is all warmup, so its schedule does not depend on --epochs: the
    # uninterrupted run must print the same losses and accuracy, which it does only if the
    # weights and the momentum buffers came back from the checkpoint on every rank.
    straight = _epoch_losses(full_run[0])
    assert straight[1] == _epoch_losses(first)[1]
    assert {e: straight[e] for e in range(2, 11)} == _epoch_losses(resumed), (full_run, resumed)
    assert FINAL.findall(resumed) == FINAL.findall(full_run[0])


# Open MPI's tags on rank 0's lines: ``[jobid,0]<stdout>: text``.
MPI_RANK0 = re.compile(r"^\[\d+,0\]<stdout>: ?(.*)$", re.MULTILINE)


@pytest.mark.timeout(180)
def test_digits_over_mpi_trains_exactly_as_over_gloo(full_run: tuple[str, Path]) -> None:
    # horarun --mpi starts the job with the venv's Open MPI mpirun, and the workers reduce
    # over MPI. With two ranks every sum is a + b in either library, so the losses printed
    # (and the accuracy) must be those of the Gloo run.
    mpirun_command(2)  # skips without mpi4py or the venv's Open MPI
    command = [*HORARUN, "--mpi", "-np", "2", sys.executable, DIGITS, "--no-progress"]
    env = {k: v for k, v in mpi_env().items() if k != "HORA_CPU_OPERATIONS"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=160, cwd=ROOT, env=env)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    rank0 = "\n".join(f"[0]<stdout>:{line}" for line in MPI_RANK0.findall(result.stdout))
    assert _epoch_losses(rank0) == _epoch_losses(full_run[0]), (rank0, full_run[0])
    assert FINAL.findall(rank0) == FINAL.findall(full_run[0])


@pytest.mark.timeout(60)
def test_digits_resume_without_a_checkpoint_is_refused(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.pt")
    command = [*HORARUN, "-np", "2", sys.executable, DIGITS, "--checkpoint", missing, "--resume"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=50, cwd=ROOT)
    assert result.returncode != 0
    for rank in (0, 1):
        assert f"[{rank}]<stderr>:--resume: no checkpoint at '{missing}'" in result.stderr


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("model", "unit"), [("mlp", "samples"), ("resnet", "img"), ("transformer", "samples")]
)
def test_synthetic_benchmark_prints_total_throughput(model: str, unit: str) -> None:
    output = _run(
        BENCHMARK,
        *("--model", model, "--batch-size", "8", "--num-warmup-batches", "1"),
        *("--num-batches-per-iter", "2", "--num-iters", "3"),
        timeout=80,
    )
    iterations = re.findall(
        rf"^\[0\]<stdout>:Iter #\d+: [\d.]+ {unit}/sec per worker$", output, re.M
    )
    assert len(iterations) == 3, output
    per_worker = re.search(
        rf"^\[0\]<stdout>:{unit.capitalize()}/sec per worker: ([\d.]+) \+-([\d.]+)$", output, re.M
    )
    total = re.search(
        rf"^\[0\]<stdout>:Total {unit}/sec on 2 worker\(s\): ([\d.]+) \+-([\d.]+)$", output, re.M
    )
    assert per_worker is not None and total is not None, output
    assert float(total.group(1)) == pytest.approx(2 * float(per_worker.group(1)), abs=0.11)
    assert float(total.group(1)) > 0
    assert "[1]<stdout>:" not in output  # only rank 0 reports


@pytest.mark.timeout(60)
def test_synthetic_benchmark_reduces_with_adasum() -> None:
    output = _run(
        BENCHMARK,
        *("--use-adasum", "--batch-size", "8", "--num-warmup-batches", "1"),
        *("--num-batches-per-iter", "2", "--num-iters", "2"),
        timeout=50,
    )
    assert "[0]<stdout>:Gradient reduction: Adasum" in output, output
    assert re.search(r"^\[0\]<stdout>:Total img/sec on 2 worker\(s\): [\d.]+", output, re.M)


@pytest.mark.timeout(150)
def test_elastic_digits_survives_the_demo_failure_and_still_learns() -> None:
    command = [*HORARUN, "-np", "3", "--min-np", "2", "--max-np", "3"]
    command += ["--host-discovery-script", str(ROOT / "examples" / "elastic_hosts.sh")]
    command += [sys.executable, str(ROOT / "examples" / "pytorch_elastic_digits.py")]
    command += ["--demo-failure"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=140, cwd=ROOT)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "rank 2: killing myself" in result.stdout
    assert "the job now has 2 workers" in result.stdout
    assert "127.0.0.3 blacklisted" in result.stderr, result.stderr
    finals = FINAL.findall(result.stdout)
    assert len(finals) == 1 and float(finals[0]) >= 0.9, result.stdout


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np", [1, 2])
def test_the_demo_failure_happens_at_any_size_or_says_why_not(np: int) -> None:
    """Two workers: the last rank dies and the survivor goes on (here with a worker started on
    the third host the script offers). One worker: a line at the start says why nobody dies."""
    command = [*HORARUN, "-np", str(np), "--min-np", "1", "--max-np", str(np)]
    command += ["--host-discovery-script", str(ROOT / "examples" / "elastic_hosts.sh")]
    command += [sys.executable, str(ROOT / "examples" / "pytorch_elastic_digits.py")]
    command += ["--demo-failure", "--epochs", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=140, cwd=ROOT)
    said = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, said
    assert len(FINAL.findall(result.stdout)) == 1, said
    if np == 1:
        first = result.stdout.splitlines()[0]
        assert first == (
            "[0]<stdout>:--demo-failure: the job starts with 1 worker, and losing it would leave "
            "nobody to go on; start 2 or more (-np) to see a failure survived"
        ), said
        assert "killing myself" not in result.stdout, said
        return
    assert "[0]<stdout>:--demo-failure: rank 1 will kill itself in epoch 2" in result.stdout
    assert "[1]<stdout>:rank 1: killing myself (--demo-failure)" in result.stdout, said
    assert "reason: rank 1 (127.0.0.2:0) was killed by SIGKILL" in result.stderr, said


@pytest.mark.timeout(90)
def test_digits_shows_progress_lines_under_horarun() -> None:
    # horarun's workers write to pipes, where a bar cannot draw: rank 0 prints lines instead.
    output = _run(DIGITS, "--epochs", "1", "--progress-every", "0", timeout=80)
    lines = re.findall(
        r"^\[(\d)\]<stdout>:epoch 1/1: batch (\d+)/(\d+), loss [\d.]+$", output, re.M
    )
    assert lines and {rank for rank, _, _ in lines} == {"0"}, output
    assert lines[-1][1] == lines[-1][2]  # up to the epoch's last batch
