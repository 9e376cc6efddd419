"""Bad input to the real ``horarun`` command: it must stop at once, non-zero, with one clear
message (no traceback) and leave no process behind.

Each case runs ``python -m hora.runner.launch`` as a user would, in a static job and, where it
applies, an elastic one (``--min-np``/``--host-discovery-script``). The command it is given
carries the test's temporary directory, so that any process started for the job can be found
afterwards by its command line.
"""

from __future__ import annotations

import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.multiproc.test_launchers import base_env
from tests.processes import job_processes, kill_all

HORARUN = [sys.executable, "-m", "hora.runner.launch"]
# A bad input is refused before anything runs: well within this, on a loaded 2-core machine.
QUICK_S = 15.0
ELASTIC = ["--min-np", "1", "--elastic-timeout", "5"]


def _horarun(
    tmp_path: Path, args: list[str], env: dict[str, str] | None = None, timeout_s: float = 60
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``horarun ARGS python -c <sleep> TOKEN``; returns the result and how long it took,
    after checking that nothing carrying the token outlived it."""
    command = [sys.executable, "-c", "import time; time.sleep(120)", str(tmp_path)]
    start = time.monotonic()
    try:
        result = subprocess.run(
            [*HORARUN, *args, *command],
            env=env or base_env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=tmp_path,
        )
    except subprocess.TimeoutExpired as exc:
        kill_all(str(tmp_path))
        pytest.fail(f"horarun {' '.join(args)} hung for {timeout_s} s.\nstderr:\n{exc.stderr}")
    took = time.monotonic() - start
    left = [" ".join(p.cmdline()) for p in job_processes(str(tmp_path))]
    kill_all(str(tmp_path))
    assert left == [], f"processes left behind: {left}"
    return result, took


def _refused(
    tmp_path: Path,
    args: list[str],
    message: str,
    status: int = 2,
    env: dict[str, str] | None = None,
    within_s: float = QUICK_S,
) -> str:
    """Assert that horarun refused ``args`` with ``status`` and ``message``, in time, with no
    traceback; returns its stderr."""
    result, took = _horarun(tmp_path, args, env)
    shown = f"exit status {result.returncode}\nstderr:\n{result.stderr}"
    assert result.returncode == status, shown
    assert message in result.stderr, shown
    assert "Traceback" not in result.stderr, shown
    if status == 2:  # nothing was started: horarun's message is all there is
        assert result.stderr.startswith("horarun: "), shown
    assert took < within_s, f"took {took:.1f} s\n{shown}"
    return result.stderr


def _hostfile(tmp_path: Path, text: str) -> str:
    path = tmp_path / "hosts.txt"
    path.write_text(text)
    return str(path)


def _script(tmp_path: Path, body: str, name: str = "discover.sh") -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


# ---------------------------------------------------------------- process counts


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-np", "0"], "-np must be >= 1, got 0."),
        (["-np", "-1"], "-np must be >= 1, got -1."),
        (["-np", "0", "--min-np", "1"], "-np must be >= 1, got 0."),
        (["--min-np", "0"], "--min-np must be >= 1, got 0."),
        (["-np", "1", "--max-np", "-1"], "--max-np must be >= 1, got -1."),
    ],
)
def test_process_counts_below_one_are_refused(
    tmp_path: Path, args: list[str], message: str
) -> None:
    _refused(tmp_path, args, message)


# ---------------------------------------------------------------- slots


@pytest.mark.timeout(60)
@pytest.mark.parametrize("elastic", [False, True], ids=["static", "elastic"])
@pytest.mark.parametrize(
    ("hosts", "message"),
    [
        ("localhost:-1", "host list entry 'localhost:-1': slots must be >= 1"),
        ("localhost:0", "host list entry 'localhost:0': slots must be >= 1"),
        ("localhost:two", "slots must be an integer (host:slots), got 'two'"),
        ("localhost:", "no slot count after ':'"),
    ],
)
def test_bad_slot_counts_in_a_host_list(
    tmp_path: Path, hosts: str, message: str, elastic: bool
) -> None:
    _refused(tmp_path, ["-np", "1", "-H", hosts, *(ELASTIC if elastic else [])], message)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("elastic", [False, True], ids=["static", "elastic"])
@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("localhost slots=-2\n", "line 1: 'localhost slots=-2': slots must be >= 1"),
        ("# hosts\nlocalhost slots=0\n", "line 2: 'localhost slots=0': slots must be >= 1"),
        ("localhost slots=x\n", "line 1: 'localhost slots=x': slots must be an integer"),
        ("localhost:-1\n", "line 1: 'localhost:-1': slots must be >= 1"),
    ],
)
def test_bad_slot_counts_in_a_hostfile(
    tmp_path: Path, text: str, message: str, elastic: bool
) -> None:
    hostfile = _hostfile(tmp_path, text)
    stderr = _refused(
        tmp_path, ["-np", "1", "--hostfile", hostfile, *(ELASTIC if elastic else [])], message
    )
    assert hostfile in stderr


# ---------------------------------------------------------------- duplicate hosts


@pytest.mark.timeout(60)
@pytest.mark.parametrize("elastic", [False, True], ids=["static", "elastic"])
def test_a_host_listed_twice_is_an_error_that_shows_the_merged_entry(
    tmp_path: Path, elastic: bool
) -> None:
    extra = ELASTIC if elastic else []
    _refused(
        tmp_path,
        ["-np", "2", "-H", "localhost:1,localhost:1", *extra],
        "host 'localhost' appears twice in host list 'localhost:1,localhost:1'. List each host "
        "once, with all its slots (localhost:2).",
    )
    hostfile = _hostfile(tmp_path, "localhost slots=1\n\nLOCALHOST slots=2\n")
    _refused(
        tmp_path,
        ["-np", "2", "--hostfile", hostfile, *extra],
        f"{hostfile}, line 3: host 'LOCALHOST' appears twice (first on line 1). List each host "
        "once, with all its slots (`localhost slots=3`).",
    )


# ---------------------------------------------------------------- IPv6


_ALLREDUCE = """
import torch
import hora.torch as hvd
hvd.init()
total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum, name="total")
print(f"rank {hvd.rank()} host {hvd.local_rank()}/{hvd.local_size()} total {total.item()}")
hvd.shutdown()
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["-H", "--hostfile"])
def test_ipv6_loopback_in_brackets_is_this_machine(tmp_path: Path, how: str) -> None:
    script = tmp_path / "job.py"
    script.write_text(_ALLREDUCE)
    hosts = ["-H", "[::1]:2"] if how == "-H" else ["--hostfile", _hostfile(tmp_path, "::1 slots=2")]
    result = subprocess.run(
        [*HORARUN, "-np", "2", *hosts, "--verbose", sys.executable, str(script)],
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert result.returncode == 0, result.stderr
    assert "starting rank 1 on ::1 on this machine" in result.stderr  # no ssh
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:rank {rank} host {rank}/2 total 3.0" in result.stdout


@pytest.mark.timeout(60)
def test_ipv6_loopback_works_in_an_elastic_job(tmp_path: Path) -> None:
    discover = _script(tmp_path, 'echo "[::1]:2"\n')
    result = subprocess.run(
        [*HORARUN, "-np", "2", "--host-discovery-script", discover, "--verbose"]
        + [sys.executable, "-c", "import os; print(os.environ['HORA_ELASTIC_ID'])"],
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(line.split(":", 1)[1] for line in result.stdout.splitlines()) == [
        "::1:0",
        "::1:1",
    ]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("elastic", [False, True], ids=["static", "elastic"])
@pytest.mark.parametrize(
    ("hosts", "message"),
    [
        ("::1:2", "host list: '::1:2': an IPv6 address goes in brackets, as in [::1]:2"),
        ("::1", "host list: '::1': an IPv6 address goes in brackets"),
        ("[::1:2", "'[::1:2': write an IPv6 address in brackets, then the slots: [::1]:2"),
        ("[node1]:2", "'node1' is not an IPv6 address"),
    ],
)
def test_ipv6_without_brackets_is_refused(
    tmp_path: Path, hosts: str, message: str, elastic: bool
) -> None:
    _refused(tmp_path, ["-np", "1", "-H", hosts, *(ELASTIC if elastic else [])], message)


# ---------------------------------------------------------------- hosts that cannot be reached


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("host", "message"),
    [
        # TEST-NET-1: never a real machine; the connection fails or times out (--start-timeout
        # caps ssh's ConnectTimeout at 2 s).
        ("192.0.2.1", "horarun: cannot reach host '192.0.2.1' over SSH (exit 255: "),
        ("no-such-host.invalid", "horarun: cannot reach host 'no-such-host.invalid' over SSH"),
    ],
)
def test_an_unreachable_or_unknown_host_is_named_quickly(
    tmp_path: Path, host: str, message: str
) -> None:
    stderr = _refused(
        tmp_path, ["-np", "1", "-H", f"{host}:1", "--start-timeout", "2"], message, within_s=30
    )
    if host.endswith(".invalid"):
        assert f"The name '{host}' does not resolve." in stderr


@pytest.mark.timeout(60)
def test_an_unknown_host_in_an_elastic_job_is_named_before_anything_starts(
    tmp_path: Path,
) -> None:
    _refused(
        tmp_path,
        ["-np", "1", "-H", "no-such-host.invalid:1", *ELASTIC],
        "horarun: host 'no-such-host.invalid' does not resolve to an IPv4 address",
    )


@pytest.mark.timeout(60)
def test_an_unreachable_host_in_an_elastic_job_ends_it_naming_the_host(tmp_path: Path) -> None:
    stderr = _refused(
        tmp_path,
        ["-np", "1", "-H", "192.0.2.1:1", "--start-timeout", "2", *ELASTIC],
        "every host is blacklisted after its workers failed (192.0.2.1)",
        status=1,
        within_s=30,
    )
    assert "could not be started: ssh to host 192.0.2.1 failed (ssh exit status 255)" in stderr


# ---------------------------------------------------------------- host discovery scripts


@pytest.mark.timeout(60)
def test_a_hanging_discovery_script_times_out_and_is_stopped_with_its_children(
    tmp_path: Path,
) -> None:
    # The script's child carries the token; it must not outlive horarun (checked by _horarun).
    discover = _script(
        tmp_path,
        f"""
        echo "looking for hosts" >&2
        {sys.executable} -c "import time; time.sleep(300)" {tmp_path}
        echo localhost:1
        """,
    )
    env = base_env(HORA_HOST_DISCOVERY_TIMEOUT="2")
    stderr = _refused(
        tmp_path,
        ["-np", "1", "--host-discovery-script", discover],
        f"horarun: the host discovery script {discover} did not finish within 2 s "
        "(HORA_HOST_DISCOVERY_TIMEOUT, at most --elastic-timeout) and was stopped; its stderr: "
        "looking for hosts. "
        "The job cannot start.",
        status=1,
        env=env,
    )
    assert stderr.count("\n") == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            'echo "localhost:2"\necho "no hosts free yet"\n',
            "printed something unreadable, line 2: 'no hosts free yet' is not a host name or "
            "address",
        ),
        (
            'echo "Error: quota exceeded"\n',
            "line 1: 'Error: quota exceeded': slots must be an integer (host:slots)",
        ),
        ("printf 'node1:2\\nno\\377de2:2\\n'\n", "line 2: byte 0xff is not UTF-8 text"),
        ('echo "localhost:-3"\n', "line 1: 'localhost:-3': slots must be >= 1"),
        ('echo "localhost:1"\necho "localhost:2"\n', "line 2: host 'localhost' is listed twice"),
        (
            'echo "cannot reach the cloud API" >&2\nexit 3\n',
            "failed with exit status 3: cannot reach the cloud API. The job cannot start.",
        ),
        ("exit 4\n", "failed with exit status 4 (it wrote nothing to stderr)"),
        ("kill -9 $$\n", "was killed by signal 9"),
    ],
    ids=[
        "garbage",
        "error-text",
        "not-utf8",
        "negative-slots",
        "duplicate",
        "exit-3",
        "silent",
        "killed",
    ],
)
def test_a_failing_discovery_script_is_named_with_what_it_printed(
    tmp_path: Path, body: str, message: str
) -> None:
    discover = _script(tmp_path, body)
    stderr = _refused(
        tmp_path, ["-np", "1", "--host-discovery-script", discover], message, status=1
    )
    assert f"the host discovery script {discover}" in stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("HORA_HOST_DISCOVERY_TIMEOUT", "0", "HORA_HOST_DISCOVERY_TIMEOUT must be > 0 seconds"),
        (
            "HORA_LAUNCHER_TIMEOUT_SECONDS",
            "soon",
            "HORA_LAUNCHER_TIMEOUT_SECONDS must be a number, got 'soon'.",
        ),
    ],
)
def test_bad_launcher_settings_are_refused_by_name(
    tmp_path: Path, name: str, value: str, message: str
) -> None:
    _refused(tmp_path, ["-np", "1"], message, env=base_env(**{name: value}))
