"""Another user plants links where a real job writes its files: nothing is written through them.

The job writes into a directory like ``/tmp`` (mode 1777): a timeline, TensorBoard event files,
an autotune log, and ``horarun --output-filename`` logs. Before it starts, uid ``nobody`` plants
symbolic links at those names, pointing at a file of the job's user. The job's user here is
root (CI), which may replace another user's link in a sticky directory, so the job runs and the
links are replaced; what an ordinary user is told instead is checked in
tests/unit/test_safe_files.py.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.processes import NOBODY, needs_root, run_as_nobody

from .jobs import run_job

HORARUN = [sys.executable, "-m", "hora.runner.launch"]

pytestmark = needs_root


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory like /tmp that uid nobody can reach and write."""
    base = Path(tempfile.mkdtemp(prefix="hora-planted-"))
    base.chmod(0o755)
    directory = base / "shared"
    directory.mkdir()
    directory.chmod(0o1777)
    yield directory
    shutil.rmtree(base, ignore_errors=True)


def _as_nobody(commands: str) -> None:
    run_as_nobody(["/bin/sh", "-c", commands], check=True, timeout=30)


def _plant(shared: Path, names: list[str], target: Path) -> None:
    """uid nobody makes each name a link to ``target``."""
    _as_nobody("; ".join(f"ln -s {target} {shared / name}" for name in names))
    for name in names:
        assert os.lstat(shared / name).st_uid == NOBODY


def _train() -> int:
    import torch
    import torch.nn.functional as F

    import hora.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    for _ in range(12):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        hvd.metrics.log_step(batch_size=4)
    rank = hvd.rank()
    hvd.shutdown()
    return rank


def _mine_and_private(path: Path) -> bool:
    info = os.lstat(path)
    return (
        stat.S_ISREG(info.st_mode)
        and info.st_uid == os.geteuid()
        and stat.S_IMODE(info.st_mode) == 0o600
    )


@pytest.mark.timeout(180)
@pytest.mark.parametrize("np", [2, 3])
def test_a_jobs_files_replace_planted_links(shared: Path, np: int) -> None:
    pytest.importorskip("tensorboard")
    pytest.importorskip("google_crc32c")
    precious = shared.parent / "precious"
    precious.write_text("keep me\n")
    timeline = shared / "timeline.json"
    names = ["timeline.json", *(f"timeline.rank{r}.json" for r in range(1, np)), "autotune.csv"]
    _plant(shared, names, precious)
    env = {
        "HOROVOD_TIMELINE": str(timeline),
        "HORA_METRICS": f"tensorboard:{shared / 'metrics'}",
        "HORA_AUTOTUNE": "1",
        "HORA_AUTOTUNE_LOG": str(shared / "autotune.csv"),
    }
    run_job(_train, np, env=env)
    assert precious.read_text() == "keep me\n"
    assert _mine_and_private(timeline)  # rank 0 merged the ranks' files into it
    assert _mine_and_private(shared / "autotune.csv")
    assert (shared / "autotune.csv").read_text().startswith("trial,")
    events = list((shared / "metrics").rglob("events.out.tfevents.*"))
    assert len(events) == np and all(_mine_and_private(e) for e in events)
    assert stat.S_IMODE(os.stat(shared / "metrics").st_mode) == 0o700


def _horarun(args: list[str], script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*HORARUN, *args, sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=90,
    )


@pytest.mark.timeout(120)
def test_output_filename_logs_are_private_and_a_planted_directory_is_refused(
    shared: Path,
) -> None:
    script = "import os; print('out', os.environ['HORA_RANK'])"
    logs = shared / "logs"
    done = _horarun(["-np", "2", "--output-filename", str(logs)], script)
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(os.stat(logs).st_mode) == 0o700
    assert (logs / "rank.1" / "stdout").read_text() == "out 1\n"
    assert _mine_and_private(logs / "rank.1" / "stdout")

    # Another user's link where the log directory would go: refused before any worker starts.
    elsewhere = shared.parent / "elsewhere"
    elsewhere.mkdir()
    _plant(shared, ["planted"], elsewhere)
    done = _horarun(["-np", "2", "--output-filename", str(shared / "planted")], script)
    assert done.returncode != 0
    assert "--output-filename" in done.stderr and "symbolic link that belongs to uid 65534" in (
        done.stderr
    ), done.stderr
    assert list(elsewhere.iterdir()) == []
    assert "out 0" not in done.stdout


def _merge_cli(source: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hora", "timeline", "merge", str(source), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.timeout(60)
def test_a_timeline_tool_output_replaces_a_planted_link(shared: Path) -> None:
    from hora.common.vocabulary.timeline_writer import Timeline

    source = shared.parent / "source.json"
    Timeline(source, 0).close()
    precious = shared.parent / "precious"
    precious.write_text("keep me\n")
    _plant(shared, ["merged.json"], precious)
    done = _merge_cli(source, shared / "merged.json")
    assert done.returncode == 0, done.stderr
    assert precious.read_text() == "keep me\n"
    assert _mine_and_private(shared / "merged.json")


# Rank 0 of a job started as `srun` would, four seconds late: the other rank looks for the
# store's port file before it is published.
_LATE_RANK_0 = """
import os, time, torch
import hora.torch as hvd
if os.environ["SLURM_PROCID"] == "0":
    time.sleep(4)
hvd.init()
total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum, name="x")
print("rank", hvd.rank(), "sum", total.item(), flush=True)
hvd.shutdown()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["link", "FIFO"])
def test_a_secret_file_reached_through_a_link_in_tmp_keeps_its_port_file_private(
    shared: Path, what: str
) -> None:
    """HORA_SECRET_FILE names a link in a directory like /tmp to the real secret in a private
    directory. uid nobody plants a link or a FIFO where the store's port file would go if it
    were put beside the link; rank 0 starts late. The port file goes beside the real secret,
    so the job runs as if nothing were planted: no rank blocks on the FIFO, none reports
    tampering."""
    private = shared.parent / "private"
    private.mkdir(mode=0o700)
    secret_file = private / "secret"
    secret_file.write_text(secrets.token_hex(32) + "\n")
    secret_file.chmod(0o600)
    link = shared / "hora_secret"
    link.symlink_to(secret_file)
    job, step = str(secrets.randbelow(10**9)), "0"
    planted = f"hora_secret.slurm-{job}.{step}.port"
    if what == "FIFO":
        _as_nobody(f"mkfifo -m 666 {shared / planted}")
    else:
        _plant(shared, [planted], secret_file)
    prefixes = ("HORA_", "HOROVOD_", "OMPI_", "PMIX_", "PMI_", "SLURM_", "TORCHELASTIC_", "MV2_")
    names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    base = {k: v for k, v in os.environ.items() if not k.startswith(prefixes) and k not in names}
    base |= {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HORA_SECRET_FILE": str(link)}
    ranks = []
    for rank in range(2):
        slurm = {
            "SLURM_JOB_ID": job,
            "SLURM_STEP_ID": step,
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0",
            "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_STEP_TASKS_PER_NODE": "2",
            "SLURM_STEP_NODELIST": "localhost",
        }
        ranks.append(
            subprocess.Popen(
                [sys.executable, "-c", _LATE_RANK_0],
                env=base | slurm,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = []
    for process in ranks:
        try:
            outputs.append(process.communicate(timeout=60))
        except subprocess.TimeoutExpired:
            for other in ranks:
                other.kill()
            pytest.fail(f"a rank did not finish in 60 s: {[p.communicate() for p in ranks]}")
    for rank, (process, (out, err)) in enumerate(zip(ranks, outputs, strict=True)):
        assert process.returncode == 0, f"rank {rank}:\n{err}"
        assert f"rank {rank} sum 3.0" in out, f"rank {rank}:\n{out}\n{err}"
    assert os.lstat(shared / planted).st_uid == NOBODY  # left alone
    assert sorted(p.name for p in shared.iterdir()) == sorted(["hora_secret", planted])
    assert [p.name for p in private.iterdir()] == ["secret"]  # rank 0 removed its port file
