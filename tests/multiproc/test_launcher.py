"""horarun and plain `python script.py` launches, checked through real processes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HORARUN = [sys.executable, "-m", "hora.runner.launch"]


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def _run(args: list[str], timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np", [2, 3])
def test_horarun_runs_every_rank_with_prefixed_output(tmp_path: Path, np: int) -> None:
    script = _script(
        tmp_path,
        """
        import torch
        import hora.torch as hvd
        hvd.init()
        total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum, name="r")
        print(f"rank={hvd.rank()} size={hvd.size()} local={hvd.local_rank()} total={total.item()}")
        hvd.shutdown()
        """,
    )
    result = _run([*HORARUN, "-np", str(np), sys.executable, script])
    assert result.returncode == 0, result.stderr
    expected = float(sum(range(np)))
    for rank in range(np):
        line = f"[{rank}]<stdout>:rank={rank} size={np} local={rank} total={expected}"
        assert line in result.stdout


@pytest.mark.timeout(120)
def test_failed_rank_is_reported_and_others_are_stopped(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import sys, time
        import torch
        import hora.torch as hvd
        hvd.init()
        hvd.allreduce(torch.ones(1), name="first")
        if hvd.rank() == 1:
            print("bad input on rank 1", file=sys.stderr)
            sys.exit(3)
        try:
            hvd.allreduce(torch.ones(1), name="second")
        except hvd.HorovodInternalError as exc:
            print(f"survivor saw: {exc}", file=sys.stderr)
            sys.exit(1)
        time.sleep(60)
        """,
    )
    result = _run([*HORARUN, "-np", "3", sys.executable, script])
    assert result.returncode == 1
    assert "horarun: the job failed.\nrank 1 (host localhost" in result.stderr
    assert "exited with code 3" in result.stderr
    assert "bad input on rank 1" in result.stderr
    # Survivors learn which rank ended the job rather than hanging.
    for survivor in (0, 2):
        assert f"[{survivor}]<stderr>:survivor saw: rank 1 is exiting" in result.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-np", "3", "-H", "localhost:2"], "-np 3 needs 3 slots but the hosts provide 2"),
        (["-np", "2", "-H", "localhost:x"], "slots must be an integer"),
        (["-np", "2", "-H", "node-that-does-not-exist:2"], "is not this machine"),
    ],
)
def test_bad_host_arguments_fail_fast(args: list[str], message: str) -> None:
    result = _run([*HORARUN, *args, sys.executable, "-c", "pass"], timeout=30)
    assert result.returncode == 2
    assert message in result.stderr


@pytest.mark.timeout(60)
def test_script_without_launcher_is_a_job_of_one(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import torch
        import hora.torch as hvd
        hvd.init()
        out = hvd.allreduce(torch.tensor([2.0, 4.0]), name="solo")
        gathered = hvd.allgather(torch.ones(2, 1))
        print(hvd.rank(), hvd.size(), out.tolist(), tuple(gathered.shape))
        hvd.shutdown()
        """,
    )
    env = {
        k: v for k, v in __import__("os").environ.items() if not k.startswith(("HORA_", "HOROVOD_"))
    }
    result = subprocess.run(
        [sys.executable, script], capture_output=True, text=True, timeout=50, env=env
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0 1 [2.0, 4.0] (2, 1)"
