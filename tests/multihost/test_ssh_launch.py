"""horarun across hosts over real SSH: network namespaces stand in for machines (see conftest).

Each test names what a user would see: a training run across two hosts, a job that mixes this
machine with remote hosts, a remote rank failing, an unreachable host, and a launcher that is
killed or interrupted, after which no process of the job may remain on any host.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.multihost.conftest import Cluster
from tests.processes import job_processes, kill_all, survivors

ROOT = Path(__file__).resolve().parents[2]
HORARUN = [sys.executable, "-m", "hora.runner.launch"]


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def _horarun(
    cluster: Cluster, args: list[str], timeout: float = 90, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    command = [*HORARUN, *cluster.ssh_flags, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def _shown(result: subprocess.CompletedProcess[str]) -> str:
    return f"exit status {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"


@pytest.mark.timeout(120)
def test_training_across_two_hosts(cluster: Cluster) -> None:
    a, b = cluster.hosts
    args = ["-np", "2", "-H", f"{a}:1,{b}:1", "--verbose", sys.executable]
    args += ["examples/pytorch_digits.py", "--epochs", "3", "--no-progress"]
    result = _horarun(cluster, args, timeout=110, cwd=ROOT)
    assert result.returncode == 0, _shown(result)
    assert f"rendezvous store listening on {cluster.launcher}:" in result.stderr
    assert f"starting rank 0 on {a} over ssh" in result.stderr
    assert f"starting rank 1 on {b} over ssh" in result.stderr
    final = re.search(r"^\[0\]<stdout>:final test accuracy: (\d\.\d+)$", result.stdout, re.M)
    assert final, _shown(result)
    assert float(final.group(1)) > 0.8, _shown(result)


@pytest.mark.timeout(90)
def test_mixed_job_carries_environment_and_working_directory(
    cluster: Cluster, tmp_path: Path
) -> None:
    script = _script(
        tmp_path,
        """
        import os
        import psutil
        import torch
        import hora.torch as hvd

        hvd.init()
        total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum, name="total")
        secret = os.environ["HORA_SECRET_KEY"]
        # The namespaces share this machine's process table: every ssh, sshd and watchdog of
        # the job is visible here.
        exposed = [
            p.pid for p in psutil.process_iter(["cmdline"])
            if secret in " ".join(p.info["cmdline"] or [])
        ]
        print(
            f"rank={hvd.rank()} host={os.environ['HORA_HOSTNAME']} cwd={os.getcwd()} "
            f"mark={os.environ.get('HORA_TEST_MARK')} iface={os.environ.get('HORA_GLOO_IFACE')} "
            f"cross={hvd.cross_rank()}/{hvd.cross_size()} total={total.item():g} "
            f"exposed={exposed}"
        )
        hvd.shutdown()
        """,
    )
    a, b = cluster.hosts
    command = [*HORARUN, *cluster.ssh_flags, "-np", "3", "-H", f"localhost:1,{a}:1,{b}:1"]
    result = subprocess.run(
        [*command, sys.executable, script],
        capture_output=True,
        text=True,
        timeout=80,
        cwd=tmp_path,
        env={**os.environ, "HORA_TEST_MARK": "carried"},
    )
    assert result.returncode == 0, _shown(result)
    # Gloo uses the interface that reaches the launcher: the bridge here, eth0 on each host.
    interfaces = [cluster.bridge, "eth0", "eth0"]
    for rank, host in enumerate(["localhost", a, b]):
        line = (
            f"[{rank}]<stdout>:rank={rank} host={host} cwd={tmp_path} mark=carried "
            f"iface={interfaces[rank]} cross={rank}/3 total=6 exposed=[]"
        )
        assert line in result.stdout, _shown(result)


@pytest.mark.timeout(90)
def test_a_failing_remote_rank_is_reported_with_its_host(cluster: Cluster, tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import sys, time
        import torch
        import hora.torch as hvd

        hvd.init()
        hvd.allreduce(torch.ones(1), name="warmup")
        if hvd.rank() == 1:
            print("rank 1 found a corrupt shard", file=sys.stderr, flush=True)
            sys.exit(3)
        hvd.allreduce(torch.ones(1), name="next")  # fails: the launcher reports rank 1's exit
        time.sleep(60)
        """,
    )
    a, b = cluster.hosts
    start = time.monotonic()
    result = _horarun(cluster, ["-np", "2", "-H", f"{a}:1,{b}:1", sys.executable, script])
    assert result.returncode == 1, _shown(result)
    assert re.search(
        rf"horarun: the job failed\.\nrank 1 \(host {re.escape(b)}, pid \d+\) exited with code 3\.",
        result.stderr,
    ), _shown(result)
    assert "    rank 1 found a corrupt shard" in result.stderr
    assert time.monotonic() - start < 60
    assert survivors(job_processes(str(tmp_path)), timeout_s=5) == []


@pytest.mark.timeout(60)
def test_an_unreachable_host_fails_fast_and_starts_nothing(
    cluster: Cluster, tmp_path: Path
) -> None:
    marker = tmp_path / "started"
    code = f"open({str(marker)!r}, 'w').close()"
    start = time.monotonic()
    hosts = f"{cluster.hosts[0]}:1,{cluster.unreachable}:1"
    result = _horarun(cluster, ["-np", "2", "-H", hosts, sys.executable, "-c", code], timeout=50)
    assert result.returncode == 2, _shown(result)
    assert f"horarun: cannot reach host '{cluster.unreachable}' over SSH" in result.stderr
    assert f"-i {cluster.ssh_flags[1]}" in result.stderr  # the command to try by hand
    assert cluster.hosts[0] not in result.stderr  # the reachable host is not blamed
    assert time.monotonic() - start < 20
    assert not marker.exists()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_no_process_survives_the_launcher_on_any_host(
    cluster: Cluster, tmp_path: Path, sig: int
) -> None:
    script = _script(
        tmp_path,
        """
        import os, subprocess, sys, time
        token = sys.argv[1]
        helpers = [
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", token]),
            subprocess.Popen(
                [sys.executable, "-c", "import time; time.sleep(120)", token],
                start_new_session=True,
            ),
        ]
        open(os.path.join(token, "up.%s" % os.environ["HORA_RANK"]), "w").close()
        time.sleep(120)
        """,
    )
    a, b = cluster.hosts
    command = [*HORARUN, *cluster.ssh_flags, "-np", "2", "-H", f"{a}:1,{b}:1"]
    launcher = subprocess.Popen(
        [*command, sys.executable, script, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("up.*"))) < 2:
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "the workers did not start within 60 s"
            time.sleep(0.1)
        procs = job_processes(str(tmp_path), launcher.pid)
        assert len(procs) == 2 * 4, [p.cmdline() for p in procs]  # worker, 2 helpers, watchdog
        launcher.send_signal(sig)
        launcher.wait(timeout=30)
        assert survivors(procs, timeout_s=15) == []
    finally:
        launcher.kill()
        kill_all(str(tmp_path))
