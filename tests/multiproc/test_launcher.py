"""horarun and plain `python script.py` launches, checked through real processes."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tests.processes import job_processes, kill_all, survivors

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


@pytest.mark.timeout(120)
def test_a_rank_that_left_early_with_status_0_is_in_the_report(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import sys
        import torch
        import hora.torch as hvd
        hvd.init()
        hvd.allreduce(torch.ones(1), name="first")
        if hvd.rank() == 2:
            sys.exit(0)  # leaves one step early
        hvd.allreduce(torch.ones(1), name="second")
        """,
    )
    result = _run([*HORARUN, "-np", "3", sys.executable, script])
    assert result.returncode == 1, result.stderr
    assert "horarun: the job failed." in result.stderr
    assert "Ranks [2] exited with code 0. If they left before the other ranks were done" in (
        result.stderr
    ), result.stderr


@pytest.mark.timeout(120)
def test_an_uncaught_exception_in_the_steady_state_is_named_to_the_others(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import sys
        import torch
        import hora.torch as hvd
        from hora.common import basics
        hvd.init()
        grads = [torch.ones(n) for n in (1000, 300_000, 10)]
        try:
            for step in range(40):
                if hvd.rank() == 1 and step == 12:
                    entered = basics.engine().steady_stats["entered"]
                    print(f"rank 1 in the steady state: {entered == 1}", file=sys.stderr)
                    raise ValueError(f"corrupt batch at step {step}")
                handles = [
                    hvd.allreduce_async_(g, name=f"grad.{i}") for i, g in enumerate(grads)
                ]
                for handle in handles:
                    hvd.synchronize(handle)
        except hvd.HorovodInternalError as exc:
            print(f"survivor saw: {exc}", file=sys.stderr)
            sys.exit(1)
        """,
    )
    result = _run([*HORARUN, "-np", "3", sys.executable, script])
    assert result.returncode == 1
    assert "[1]<stderr>:rank 1 in the steady state: True" in result.stderr
    assert "ValueError: corrupt batch at step 12" in result.stderr
    for survivor in (0, 2):
        expected = "survivor saw: rank 1 is exiting after an uncaught ValueError: corrupt batch"
        assert f"[{survivor}]<stderr>:{expected}" in result.stderr, result.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-np", "3", "-H", "localhost:2"], "-np 3 needs 3 slots but the hosts provide 2"),
        (["-np", "2", "-H", "localhost:x"], "slots must be an integer"),
        (
            ["-np", "2", "-H", "node-that-does-not-exist.invalid:2"],
            "cannot reach host 'node-that-does-not-exist.invalid' over SSH",
        ),
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


# A worker that starts two helpers (one in its own session, as a daemon would), writes a file
# saying it is up, and waits; the token in every command line finds them all.
_STUBBORN = """
import os, subprocess, sys, time
token = sys.argv[1]
helpers = [
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", token]),
    subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)", token], start_new_session=True
    ),
]
open(os.path.join(token, "up.%s" % os.environ["HORA_RANK"]), "w").close()
time.sleep(120)
"""


def _start_stubborn_job(tmp_path: Path, np: int) -> subprocess.Popen[str]:
    script = _script(tmp_path, _STUBBORN)
    launcher = subprocess.Popen(
        [*HORARUN, "-np", str(np), sys.executable, script, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("up.*"))) < np:
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline, "the workers did not start within 60 s"
        time.sleep(0.1)
    return launcher


@pytest.mark.timeout(90)
def test_sigkilled_launcher_leaves_no_process_behind(tmp_path: Path) -> None:
    launcher = _start_stubborn_job(tmp_path, np=2)
    try:
        procs = job_processes(str(tmp_path), launcher.pid)
        # two workers, each with two helpers and a watchdog
        assert len(procs) == 2 * 4, [p.cmdline() for p in procs]
        launcher.kill()
        launcher.wait()
        assert survivors(procs, timeout_s=15) == []
    finally:
        kill_all(str(tmp_path))


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_or_term_stops_every_worker(tmp_path: Path, sig: int, status: int) -> None:
    launcher = _start_stubborn_job(tmp_path, np=2)
    try:
        procs = job_processes(str(tmp_path), launcher.pid)
        start = time.monotonic()
        launcher.send_signal(sig)
        launcher.wait(timeout=30)
        assert launcher.returncode == status
        # Nothing survives the launcher's own exit, and it took no more than the grace period.
        assert survivors(procs, timeout_s=0.5) == []
        assert time.monotonic() - start < 15
    finally:
        kill_all(str(tmp_path))


@pytest.mark.timeout(90)
def test_killed_worker_is_reported_with_its_own_pid(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import os, signal, sys, time
        if os.environ["HORA_RANK"] == "1":
            print(f"my pid is {os.getpid()}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
        """,
    )
    result = _run([*HORARUN, "-np", "2", sys.executable, script])
    assert result.returncode == 1
    pid = re.search(r"my pid is (\d+)", result.stderr)
    assert pid, result.stderr
    assert f"rank 1 (host localhost, pid {pid.group(1)}) was killed by SIGKILL." in result.stderr


@pytest.mark.timeout(90)
def test_the_store_listens_on_loopback_only(tmp_path: Path) -> None:
    launcher = _start_stubborn_job(tmp_path, np=1)
    try:
        listening = [
            c.laddr
            for c in psutil.Process(launcher.pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        ]
        assert listening, "the launcher has no listening socket"
        assert {addr.ip for addr in listening} == {"127.0.0.1"}
    finally:
        launcher.kill()
        launcher.wait()
        kill_all(str(tmp_path))


@pytest.mark.timeout(60)
def test_output_files_prefixes_timestamps_and_progress_bars(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import os, sys, time
        rank = os.environ["HORA_RANK"]
        print(f"out {rank}")
        print(f"err {rank}", file=sys.stderr)
        if rank == "0":
            for step in range(40):  # a progress bar redrawn 40 times in about 0.4 s
                print(f"\\rstep {step}", end="", file=sys.stderr, flush=True)
                time.sleep(0.01)
            print(file=sys.stderr)
        """,
    )
    logs = tmp_path / "logs"
    args = ["-np", "11", "-H", "localhost:11", "--output-filename", str(logs)]
    result = _run([*HORARUN, *args, "-prefix-timestamp", sys.executable, script])
    assert result.returncode == 0, result.stderr
    # Horovod's layout: ranks padded to the width of the largest.
    assert sorted(p.name for p in logs.iterdir()) == [f"rank.{r:02d}" for r in range(11)]
    assert (logs / "rank.07" / "stdout").read_text() == "out 7\n"
    assert (logs / "rank.07" / "stderr").read_text() == "err 7\n"
    stamp = r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}:"
    for rank in range(11):
        assert re.search(rf"^{stamp}\[{rank}\]<stdout>:out {rank}$", result.stdout, re.M)
    # The log keeps every redraw; the console shows a few states, and always the last one.
    assert (logs / "rank.00" / "stderr").read_bytes().count(b"\r") == 40
    shown = re.findall(r"\[0\]<stderr>:step (\d+)$", result.stderr, re.M)
    assert 1 <= len(shown) <= 3 and shown[-1] == "39", result.stderr


@pytest.mark.timeout(60)
def test_config_file_and_flags_reach_the_workers(tmp_path: Path) -> None:
    config = tmp_path / "horovod.yaml"
    config.write_text(
        "params:\n  fusion_threshold_mb: 8\n  cycle_time_ms: 2\n  torus_allreduce: true\n"
        "stall_check:\n  enabled: false\nlogging:\n  level: info\n"
    )
    show = "import os; print(*(os.environ.get(k) for k in __import__('sys').argv[1:]))"
    names = ["HORA_FUSION_THRESHOLD", "HORA_CYCLE_TIME", "HORA_STALL_CHECK_DISABLE"]
    names += ["HORA_LOG_LEVEL", "HORA_CACHE_CAPACITY", "PYTHONUNBUFFERED"]
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# this machine only\nlocalhost slots=1\n")
    args = ["-np", "1", "--config-file", str(config), "--cycle-time-ms", "7", "--verbose"]
    args += ["--cache-capacity", "16", "--hostfile", str(hostfile)]
    result = _run([*HORARUN, *args, sys.executable, "-c", show, *names], timeout=30)
    assert result.returncode == 0, result.stderr
    assert f"[0]<stdout>:{8 * 1024 * 1024} 7 1 INFO 16 1" in result.stdout
    assert "horarun: --torus-allreduce has no effect" in result.stderr
    assert "horarun: rendezvous store listening on 127.0.0.1:" in result.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mpi", "--min-np", "1"], "--mpi cannot run an elastic job"),
        (["--min-np", "3"], "-np 2 is less than --min-np 3"),
        (["--fusion-threshold-mb", "-4"], "fusion_threshold_mb=-4 must be >= 0"),
        (["--hostfile", "/nonexistent/hosts"], "cannot read hostfile"),
        (["--config-file", "/nonexistent/horovod.yaml"], "cannot read config file"),
    ],
)
def test_flags_that_cannot_be_honoured_stop_before_anything_starts(
    args: list[str], message: str
) -> None:
    result = _run([*HORARUN, "-np", "2", *args, sys.executable, "-c", "pass"], timeout=30)
    assert result.returncode == 2
    assert message in result.stderr


@pytest.mark.timeout(60)
def test_check_build_prints_horovods_table() -> None:
    result = _run([*HORARUN, "--check-build"], timeout=50)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert re.fullmatch(r"hora v\d+\.\d+\.\d+:", lines[0])
    tensorflow = "[X]" if importlib.util.find_spec("tensorflow") else "[ ]"
    assert lines[1:6] == [
        "",
        "Available Frameworks:",
        f"    {tensorflow} TensorFlow",
        "    [X] PyTorch",
        "    [ ] MXNet",
    ]
    assert "Available Controllers:" in lines and "Available Tensor Operations:" in lines
    assert lines[-1] == "    [X] Gloo"


@pytest.mark.timeout(120)
def test_hora_doctor_runs_a_two_process_allreduce() -> None:
    result = _run([sys.executable, "-m", "hora", "doctor"], timeout=110)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Available Tensor Operations:" in result.stdout
    assert re.search(r"torch +\d+\.\d+", result.stdout)
    assert re.search(r"PASS in \d+\.\d s: every rank got 3", result.stdout), result.stdout


@pytest.mark.timeout(60)
def test_watchdog_reports_a_missing_working_directory_or_command(tmp_path: Path) -> None:
    from hora.runner.hosts import assign_slots, parse_hosts
    from hora.runner.supervisor import Supervisor

    slots = assign_slots(parse_hosts("localhost:2"), 2)
    supervisor = Supervisor()
    supervisor.spawn(slots[0], ["/no/such/program"], dict(os.environ))
    supervisor.spawn(slots[1], ["true"], dict(os.environ), cwd=str(tmp_path / "gone"))
    assert supervisor.wait(timeout_s=30) == {0: 127, 1: 126}
    first, second = ("\n".join(w.stderr_tail) for w in supervisor.workers)
    assert "cannot start '/no/such/program' on host localhost" in first
    assert f"cannot enter the working directory {str(tmp_path / 'gone')!r} on host" in second
