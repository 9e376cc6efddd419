"""``horarun`` runs whole jobs, static and elastic, without ever importing torch.

The launcher runs in a process that refuses torch: a finder first on ``sys.meta_path`` fails
every import of ``torch`` (or a submodule) and remembers it, so an import anywhere in the
launcher, even one whose ``ImportError`` is caught, is caught here. At its end the process checks
that torch is not in ``sys.modules``. The workers are processes of their own: they import torch
as usual, and their results show that the job really ran (the store served them, a failed
worker's end was recorded, rounds were formed).
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.processes import job_processes, kill_all, survivors

# Exit status of the launcher process when it imported torch, or tried to.
IMPORTED_TORCH = 99

# ``python -c LAUNCHER horarun-arguments...``: horarun, in a process where torch cannot load.
LAUNCHER = r"""
import runpy, sys, traceback

attempts = []


class RefuseTorch:
    # A meta path finder: asked first for every module this process imports.
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            attempts.append(f"import of {name!r} from:\n" + "".join(traceback.format_stack()))
            raise ImportError(f"horarun imported {name!r}: the launcher must not import torch")
        return None


sys.meta_path.insert(0, RefuseTorch())
try:
    runpy.run_module("hora.runner.launch", run_name="__main__", alter_sys=True)
    code = 0
except SystemExit as exc:
    code = exc.code
except BaseException:
    traceback.print_exc()
    code = 1
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
if attempts or loaded:
    print(f"LAUNCHER IMPORTED TORCH: loaded {loaded}", file=sys.stderr)
    for attempt in attempts:
        print(attempt, file=sys.stderr)
    sys.exit(99)
sys.exit(code)
"""

# A static job's worker: its rank's share of a sum, computed with torch.
STATIC_WORKER = """
import torch
import hora.torch as hvd

hvd.init()
total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum, name="ranks").item()
print(f"rank={hvd.rank()} size={hvd.size()} total={total}")
hvd.shutdown()
"""

# An elastic job's worker: the worker named by FAIL_ID exits in round 0, the others reset (as
# hvd.elastic.run does) and finish in the next round without it.
ELASTIC_WORKER = """
import os, sys
import torch
import hora.torch as hvd
from hora.common.job import rounds as elastic

hvd.init()
me = os.environ["HORA_ELASTIC_ID"]
while True:
    number = elastic.progress().plan.number
    if me == os.environ.get("FAIL_ID") and number == 0:
        sys.exit(1)
    try:
        total = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="sum").item()
        break
    except hvd.HoraInternalError:
        elastic.request_reset()
        hvd.shutdown()
        hvd.init()
print(f"{me} rank={hvd.rank()} size={hvd.size()} round={number} total={total}")
hvd.shutdown()
"""


def _write(tmp_path: Path, name: str, body: str, executable: bool = False) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    if executable:
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _horarun_without_torch(
    tmp_path: Path, flags: list[str], script: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run horarun to its end in a process that refuses torch; no job process may be left."""
    command = [sys.executable, "-c", LAUNCHER, *flags, sys.executable, script]
    try:
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=100,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        assert survivors(job_processes(str(tmp_path)), timeout_s=10) == []
    finally:
        kill_all(str(tmp_path))
    assert result.returncode != IMPORTED_TORCH, result.stderr
    assert "LAUNCHER IMPORTED TORCH" not in result.stderr, result.stderr
    return result


@pytest.mark.timeout(60)
def test_the_refusing_launcher_catches_an_import_of_torch(tmp_path: Path) -> None:
    """The check itself: a launcher process that imports torch is caught, even when the
    ImportError is swallowed."""
    code = LAUNCHER.replace(
        'runpy.run_module("hora.runner.launch", run_name="__main__", alter_sys=True)',
        "exec('try:\\n import torch.distributed\\nexcept ImportError:\\n pass')",
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == IMPORTED_TORCH, result.stderr
    assert "import of 'torch'" in result.stderr


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np", [2, 3])
def test_a_static_job_runs_without_torch_in_the_launcher(tmp_path: Path, np: int) -> None:
    script = _write(tmp_path, "job.py", STATIC_WORKER)
    result = _horarun_without_torch(tmp_path, ["-np", str(np)], script)
    assert result.returncode == 0, result.stderr
    expected = float(sum(range(1, np + 1)))
    for rank in range(np):
        assert f"[{rank}]<stdout>:rank={rank} size={np} total={expected}" in result.stdout


@pytest.mark.timeout(150)
def test_a_static_job_whose_rank_fails_is_reported_without_torch(tmp_path: Path) -> None:
    """The launcher records the failed rank's end in the store and names it."""
    script = _write(
        tmp_path,
        "job.py",
        """
        import sys
        import torch
        import hora.torch as hvd

        hvd.init()
        hvd.allreduce(torch.ones(1), name="first")
        if hvd.rank() == 1:
            sys.exit(3)
        hvd.allreduce(torch.ones(1), name="second")
        """,
    )
    result = _horarun_without_torch(tmp_path, ["-np", "2"], script)
    assert result.returncode == 1
    assert "horarun: the job failed.\nrank 1 (host localhost" in result.stderr
    assert "exited with code 3" in result.stderr


@pytest.mark.timeout(150)
def test_an_elastic_job_runs_without_torch_in_the_launcher(tmp_path: Path) -> None:
    script = _write(tmp_path, "job.py", ELASTIC_WORKER)
    result = _horarun_without_torch(
        tmp_path, ["-np", "3", "--min-np", "2", "--max-np", "3", "-H", "localhost:3"], script
    )
    assert result.returncode == 0, result.stderr
    for rank in range(3):
        assert re.search(
            rf"\[{rank}\]<stdout>:localhost:\d rank={rank} size=3 round=0 total=3.0",
            result.stdout,
        ), result.stdout


@pytest.mark.timeout(150)
def test_an_elastic_job_forms_a_new_round_without_torch_in_the_launcher(tmp_path: Path) -> None:
    """A worker fails: the driver records its end in the round's store space, blacklists its
    host and publishes the next round; the survivors finish in it."""
    script = _write(tmp_path, "job.py", ELASTIC_WORKER)
    discover = _write(
        tmp_path,
        "discover.sh",
        "#!/bin/sh\necho 127.0.0.2\necho 127.0.0.3\necho 127.0.0.4\n",
        executable=True,
    )
    result = _horarun_without_torch(
        tmp_path,
        [
            "--network-interface",
            "lo",
            "--verbose",
            "-np",
            "3",
            "--min-np",
            "2",
            "--host-discovery-script",
            discover,
        ],
        script,
        env={"FAIL_ID": "127.0.0.3:0"},
    )
    assert result.returncode == 0, result.stderr
    assert "horarun: blacklisted host 127.0.0.3 for good" in result.stderr
    finished = re.findall(
        r"127\.0\.0\.([24]):0 rank=\d size=2 round=(\d+) total=2\.0", result.stdout
    )
    assert sorted(host for host, _ in finished) == ["2", "4"], result.stdout
    assert all(int(number) >= 1 for _, number in finished), result.stdout
