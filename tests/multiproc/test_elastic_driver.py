"""Elastic horarun through real processes: rounds, failures, host changes and the limits.

Distinct loopback addresses (127.0.0.2, 127.0.0.3, ...) stand for distinct hosts: horarun starts
their workers on this machine, but the driver treats each address as a host of its own (its own
worker ids, blacklisting). The worker scripts use only ``hvd.init()``, collectives and
``hvd.shutdown()``, plus ``hora.common.job.rounds``'s round bookkeeping, not the ``hvd.elastic`` API.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.processes import job_processes, kill_all, survivors

HORARUN = [sys.executable, "-m", "hora.runner.launch"]

# Each worker prints one line when it is done; a worker named by FAIL_ID exits 1 in round 0.
# Survivors of a failed collective ask for a new round (as hvd.elastic.run does), shut down and
# init again: they join the next round.
WORKER = """
import os, sys
import torch
import hora.torch as hvd
from hora.common.job import rounds as elastic

hvd.init()
me = os.environ["HORA_ELASTIC_ID"]
while True:
    number = elastic.progress().plan.number
    if me == os.environ.get("FAIL_ID") and number == 0:
        print(f"{me} fails on purpose", file=sys.stderr)
        sys.exit(1)
    try:
        total = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="sum").item()
        break
    except hvd.HoraInternalError as exc:
        print(f"{me} lost round {number}: {exc}", file=sys.stderr)
        elastic.request_reset()  # as hvd.elastic.run does: the driver may not know yet
        hvd.shutdown()
        hvd.init()
print(f"{me} rank={hvd.rank()} size={hvd.size()} round={number} total={total}")
hvd.shutdown()
"""

# Trains in steps; every step rank 0 says whether the driver posted a host change, and all reset
# when it did (what hvd.elastic's State.commit() does). Rank 0 edits the hosts file the discovery
# script prints: a host is added after round 0's third step and removed after round 1's.
GROWING_WORKER = """
import os, time
import torch
import hora.torch as hvd
from hora.common.job import rounds as elastic

HOSTS = os.environ["TEST_HOSTS_FILE"]
hvd.init()
store = elastic.base_store()
seen, steps = None, 0
while True:
    plan = elastic.progress().plan
    if plan.number != seen:
        seen, steps = plan.number, 0
    try:
        news = 0.0
        if hvd.rank() == 0:
            news = float(elastic.read_host_update(store)[0] > plan.updates)
        if hvd.allreduce(torch.tensor([news]), op=hvd.Sum, name="news").item() > 0:
            hvd.shutdown()
            hvd.init()
            continue
        total = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="step").item()
    except hvd.HoraInternalError:
        elastic.request_reset()
        hvd.shutdown()
        hvd.init()
        continue
    steps += 1
    if hvd.rank() == 0 and steps == 3 and plan.number < 2:
        with open(HOSTS + ".new", "w") as f:
            f.write("127.0.0.2\\n127.0.0.3\\n" if plan.number == 0 else "127.0.0.2\\n")
        os.replace(HOSTS + ".new", HOSTS)
    if plan.number == 2 and steps >= 3:
        break
    time.sleep(0.05)
print(f"{os.environ['HORA_ELASTIC_ID']} round={plan.number} size={hvd.size()} total={total}")
hvd.shutdown()
"""


# The worker named by KILL_ID is killed inside its first hvd.init(): once it has joined round 0
# (it is past the round's barrier, connecting to the others), after KILL_DELAY_S more. It
# notes in KILL_MARK whether hvd.init() was still running. The script is a usual elastic one:
# hvd.init() at the top, then the training function under hvd.elastic.run.
INIT_KILLED_WORKER = """
import os, signal, threading, time
import torch
import hora.torch as hvd
from hora.common.job import rounds

me = os.environ["HORA_ELASTIC_ID"]


def die_inside_init():
    while rounds.progress().plan is None:
        time.sleep(0.0005)
    time.sleep(float(os.environ["KILL_DELAY_S"]))
    with open(os.environ["KILL_MARK"], "w") as mark:
        mark.write("after" if hvd.is_initialized() else "inside")
    os.kill(os.getpid(), signal.SIGKILL)


if me == os.environ["KILL_ID"]:
    threading.Thread(target=die_inside_init, daemon=True).start()
    if os.environ.get("KILL_HOLD_GLOO_S"):
        # Held before its Gloo set-up, so that the kill lands inside init (while the other
        # ranks connect to it) however fast the machine is.
        from hora.common.transport import gloo

        connect = gloo.GlooCommunicator.__init__

        def held(self, *args, **kwargs):
            time.sleep(float(os.environ["KILL_HOLD_GLOO_S"]))
            connect(self, *args, **kwargs)

        gloo.GlooCommunicator.__init__ = held
hvd.init()
state = hvd.elastic.TorchState(model=torch.nn.Linear(2, 1), step=0)


@hvd.elastic.run
def train(state):
    while state.step < 5:
        hvd.allreduce(torch.ones(1), name="step")
        state.step += 1
        state.commit()


train(state)
print(f"{me} size={hvd.size()} round={hvd.elastic.round_number()} steps={state.step}")
hvd.shutdown()
"""


def _write(tmp_path: Path, name: str, body: str, executable: bool = False) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    if executable:
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _discovery(tmp_path: Path, *hosts: str) -> str:
    lines = "".join(f"echo {host}\n" for host in hosts)
    return _write(tmp_path, "discover.sh", "#!/bin/sh\n" + lines, executable=True)


def _horarun(
    tmp_path: Path, flags: list[str], script: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run horarun to its end; afterwards, none of the job's processes may be left."""
    # Gloo between "hosts" that are all this machine: the loopback interface.
    command = [*HORARUN, "--network-interface", "lo", *flags, sys.executable, script]
    try:
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=80,
            env={**os.environ, **(env or {})},
        )
        assert survivors(job_processes(str(tmp_path)), timeout_s=10) == []
    finally:
        kill_all(str(tmp_path))
    return result


@pytest.mark.timeout(100)
def test_discovered_hosts_form_round_zero_and_the_job_succeeds(tmp_path: Path) -> None:
    script = _write(tmp_path, "job.py", WORKER)
    discover = _discovery(tmp_path, "127.0.0.2", "127.0.0.3")
    result = _horarun(tmp_path, ["-np", "2", "--host-discovery-script", discover], script)
    assert result.returncode == 0, result.stderr
    assert "[0]<stdout>:127.0.0.2:0 rank=0 size=2 round=0 total=2.0" in result.stdout
    assert "[1]<stdout>:127.0.0.3:0 rank=1 size=2 round=0 total=2.0" in result.stdout
    assert "horarun:" not in result.stderr  # no round change, nothing to say without -v


@pytest.mark.timeout(100)
def test_a_failed_worker_is_blacklisted_and_the_survivors_finish_in_round_1(
    tmp_path: Path,
) -> None:
    script = _write(tmp_path, "job.py", WORKER)
    discover = _discovery(tmp_path, "127.0.0.2", "127.0.0.3", "127.0.0.4")
    result = _horarun(
        tmp_path,
        ["--verbose", "-np", "3", "--min-np", "2", "--host-discovery-script", discover],
        script,
        env={"FAIL_ID": "127.0.0.3:0"},
    )
    assert result.returncode == 0, result.stderr
    err = result.stderr
    assert "horarun: blacklisted host 127.0.0.3 for good: its worker 127.0.0.3:0 exited" in err
    # Usually round 1 follows at once. On a loaded machine the survivors' requests for a new
    # round can reach the driver before the failed worker's exit does, which costs one more
    # round (of the same survivors): the job still ends the same way.
    rounds = re.findall(
        r"horarun: round (\d+): 2 workers on 2 hosts \(rank 0 127\.0\.0\.2:0, rank 1 "
        r"127\.0\.0\.4:0\), reason: (.*)",
        err,
    )
    assert rounds, err
    assert any(
        "rank 1 (127.0.0.3:0) exited with code 1; host 127.0.0.3 blacklisted" in r
        for _, r in rounds
    ) or ("127.0.0.3:0) exited with code 1" in err), err
    last = rounds[-1][0]
    # The survivors' collective failed naming the lost worker; they finished without it.
    assert "[1]<stderr>:127.0.0.3:0 fails on purpose" in err
    for number in (0, 2):
        assert f"[{number}]<stderr>:127.0.0.{number + 2}:0 lost round 0: " in err
    assert f"[0]<stdout>:127.0.0.2:0 rank=0 size=2 round={last} total=2.0" in result.stdout
    assert f"[2]<stdout>:127.0.0.4:0 rank=1 size=2 round={last} total=2.0" in result.stdout


@pytest.mark.timeout(100)
def test_hosts_added_and_removed_by_discovery_change_the_rounds(tmp_path: Path) -> None:
    script = _write(tmp_path, "grow.py", GROWING_WORKER)
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("127.0.0.2\n")
    discover = _write(tmp_path, "discover.sh", f"#!/bin/sh\ncat {hosts}\n", executable=True)
    result = _horarun(
        tmp_path,
        ["-np", "1", "--max-np", "2", "--host-discovery-script", discover],
        script,
        env={"TEST_HOSTS_FILE": str(hosts)},
    )
    said = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, said
    # Without -v: one line per round change.
    assert (
        "horarun: round 1: 2 workers on 2 hosts, reason: hosts changed: added 127.0.0.3:0; "
        "started worker 1 (127.0.0.3:0)" in result.stderr
    ), said
    assert (
        "horarun: round 2: 1 worker on 1 host, reason: hosts changed: removed 127.0.0.3:0"
        in result.stderr
    ), said
    assert "[0]<stdout>:127.0.0.2:0 round=2 size=1 total=1.0" in result.stdout, said
    # The removed host's worker left quietly (status 0, not counted as a failure).
    assert "127.0.0.3:0 round=" not in result.stdout, said
    assert "the job failed" not in result.stderr, said


@pytest.mark.timeout(100)
def test_too_few_slots_stop_the_job_after_the_elastic_timeout(tmp_path: Path) -> None:
    script = _write(tmp_path, "job.py", WORKER)
    # At the start: the hosts cannot give -np slots.
    discover = _discovery(tmp_path, "127.0.0.2")
    result = _horarun(
        tmp_path,
        ["-np", "2", "--elastic-timeout", "1", "--host-discovery-script", discover],
        script,
    )
    assert result.returncode == 1
    assert (
        "horarun: timed out after 1 s waiting for 2 slots to start the job (-np 2): the hosts "
        "found offer 1 (127.0.0.2:1; blacklisted hosts: none)" in result.stderr
    )
    # After a failure: fewer than --min-np slots are left.
    hosts = ["-H", "127.0.0.2:1,127.0.0.3:1"]
    result = _horarun(
        tmp_path,
        ["-np", "2", "--min-np", "2", "--elastic-timeout", "2", *hosts],
        script,
        env={"FAIL_ID": "127.0.0.3:0"},
    )
    assert result.returncode == 1
    assert (
        "horarun: fewer than --min-np 2 slots were available for 2 s (--elastic-timeout): "
        "1 usable (127.0.0.2:1); blacklisted hosts: 127.0.0.3. Stopping the job." in result.stderr
    )
    assert "last worker failure: rank 1 of round 0 (127.0.0.3:0, worker 1" in result.stderr
    assert "    127.0.0.3:0 fails on purpose" in result.stderr


@pytest.mark.timeout(100)
@pytest.mark.parametrize(
    ("np", "hosts", "killed", "delay_s", "env"),
    [
        # What users run on one machine: every worker on localhost. The killed worker's slot
        # goes, the host stays.
        (2, [], "localhost:1", 0.0, {}),
        (3, [], "localhost:1", 0.0, {}),
        # Two "hosts" over Gloo, killed a moment later: while the other rank's Gloo connects.
        (
            2,
            ["-H", "127.0.0.2:1,127.0.0.3:1"],
            "127.0.0.3:0",
            0.01,
            {"HORA_SHARED_MEMORY": "0", "KILL_HOLD_GLOO_S": "1"},
        ),
    ],
    ids=["np2-one-host", "np3-one-host", "np2-two-hosts-gloo"],
)
def test_a_worker_killed_inside_the_first_init_costs_a_round_not_the_job(
    tmp_path: Path, np: int, hosts: list[str], killed: str, delay_s: float, env: dict[str, str]
) -> None:
    script = _write(tmp_path, "job.py", INIT_KILLED_WORKER)
    mark = tmp_path / "killed"
    flags = ["-np", str(np), "--min-np", str(np - 1), *hosts]
    started = time.monotonic()
    result = _horarun(
        tmp_path,
        flags,
        script,
        env={"KILL_ID": killed, "KILL_MARK": str(mark), "KILL_DELAY_S": str(delay_s), **env},
    )
    took_s = time.monotonic() - started
    said = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, said
    assert mark.read_text() == "inside", said
    # The survivors went on at the smaller size, in a round after the first, without waiting
    # out a connection timeout (HORA_GLOO_TIMEOUT_SECONDS, 30 s).
    finished = re.findall(r"<stdout>:(\S+) size=(\d+) round=(\d+) steps=5$", result.stdout, re.M)
    assert len(finished) == np - 1, said
    assert all(size == str(np - 1) and int(number) >= 1 for _, size, number in finished), said
    assert killed not in [worker for worker, _, _ in finished]
    assert f"reason: rank 1 ({killed}) was killed by SIGKILL" in result.stderr, said
    if not hosts:
        assert f"slot {killed} taken out (blacklisting host localhost" in result.stderr, said
    assert "blacklisted" not in result.stderr or hosts, said
    assert "Traceback" not in result.stderr, said
    assert took_s < 30, said


@pytest.mark.timeout(100)
def test_waiting_for_slots_says_every_few_seconds_what_is_offered_and_missing(
    tmp_path: Path,
) -> None:
    script = _write(tmp_path, "job.py", WORKER)
    discover = _discovery(tmp_path, "127.0.0.2")
    started = time.monotonic()
    result = _horarun(
        tmp_path,
        ["--min-np", "2", "--elastic-timeout", "11", "--host-discovery-script", discover],
        script,
    )
    took_s = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    lines = [x for x in result.stderr.splitlines() if x.startswith("horarun: waiting for")]
    # One line at once, then one every 10 s: not one per look at the hosts.
    assert lines[0] == (
        "horarun: waiting for 1 more slot: the hosts found offer 1 (127.0.0.2:1), --min-np 2 "
        "needs 2; giving up in 11 s"
    ), result.stderr
    assert len(lines) == 2, result.stderr
    assert re.fullmatch(r"horarun: waiting for 1 more slot: .*; giving up in [12] s", lines[1])
    assert "timed out after 11 s waiting for 2 slots" in result.stderr
    assert took_s < 30


@pytest.mark.timeout(100)
def test_reset_limit_stops_the_job(tmp_path: Path) -> None:
    script = _write(tmp_path, "job.py", WORKER)
    result = _horarun(
        tmp_path,
        ["-np", "2", "--min-np", "1", "--reset-limit", "0", "-H", "127.0.0.2:1,127.0.0.3:1"],
        script,
        env={"FAIL_ID": "127.0.0.3:0"},
    )
    assert result.returncode == 1
    assert (
        "horarun: the job was reset 1 time, more than --reset-limit 0 allows (this reset: "
        "rank 1 (127.0.0.3:0) exited with code 1; host 127.0.0.3 blacklisted). Stopping the job."
        in result.stderr
    )


@pytest.mark.timeout(100)
def test_ctrl_c_stops_every_worker(tmp_path: Path) -> None:
    script = _write(
        tmp_path,
        "sleeper.py",
        f"""
        import os, time
        import torch
        import hora.torch as hvd
        hvd.init()
        hvd.allreduce(torch.ones(1), name="ready")
        open(os.path.join({str(tmp_path)!r}, "ready-" + str(hvd.rank())), "w").close()
        time.sleep(120)
        """,
    )
    command = [*HORARUN, "--network-interface", "lo", "--min-np", "2"]
    command += ["-H", "127.0.0.2:1,127.0.0.3:1", sys.executable, script]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready-{r}").exists() for r in (0, 1)):
            assert job.poll() is None, job.communicate()
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.1)
        workers = job_processes(str(tmp_path), launcher=job.pid)
        job.send_signal(signal.SIGINT)
        job.communicate(timeout=30)
        assert job.returncode == 128 + signal.SIGINT
        assert survivors(workers, timeout_s=10) == []
    finally:
        job.kill()
        kill_all(str(tmp_path))
