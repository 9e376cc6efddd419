"""The ssh command line and what a worker's watchdog is sent (no ssh connection is made here)."""

from __future__ import annotations

import io
import os
import sys

from hora.runner import watchdog
from hora.runner.remote import LOADER, SshSettings, remote_command, stdin_payload
from hora.runner.watchdog import read_job


def test_batch_mode_comes_first_and_user_options_before_the_defaults() -> None:
    ssh = SshSettings(port=2222, identity_file="/k", options=("StrictHostKeyChecking=yes",))
    argv = ssh.argv("node1")
    # ssh keeps the first value it gets for an option: BatchMode cannot be turned off, and the
    # user's StrictHostKeyChecking wins over hora's accept-new.
    assert argv[:3] == ["ssh", "-o", "BatchMode=yes"]
    assert argv.index("StrictHostKeyChecking=yes") < argv.index("StrictHostKeyChecking=accept-new")
    assert argv[-5:] == ["-p", "2222", "-i", "/k", "node1"]
    assert "ConnectTimeout=10" in argv
    assert ssh.display("node1") == "ssh -p 2222 -i /k -o StrictHostKeyChecking=yes node1 true"


def test_the_secret_travels_on_stdin_not_on_the_command_line() -> None:
    env = {"HORA_SECRET_KEY": "s3cr3t" * 10, "PATH": "/usr/bin"}
    payload = stdin_payload(["python", "train.py"], env, "/work", "node1", 5.0)
    assert "s3cr3t" not in remote_command()
    assert sys.executable in remote_command() and "python3" in remote_command()
    stream = io.BytesIO(payload)
    size = int(stream.readline())
    source = stream.read(size)
    assert b"def read_job" in source  # the watchdog's own source comes first
    job = read_job(stream)
    assert job == {
        "argv": ["python", "train.py"],
        "env": env,
        "cwd": "/work",
        "host": "node1",
        "grace_s": 5.0,
        # The watchdog runs without hora: what it needs of hora's variables travels along.
        "label": "the worker",
        "interface": {
            "towards": "",
            "set": "HORA_GLOO_IFACE",
            "unless": ["HORA_GLOO_IFACE", "HOROVOD_GLOO_IFACE", "GLOO_SOCKET_IFNAME"],
        },
        # No HORA_LOCAL_SIZE in env: the watchdog cannot share the cores, and leaves them.
        "threads": {"set": "OMP_NUM_THREADS", "local_size": 0},
    }
    assert "exec(compile(" in LOADER


def test_the_watchdog_shares_the_hosts_cores_unless_the_job_chose() -> None:
    cores = len(os.sched_getaffinity(0))
    rule = {"set": "OMP_NUM_THREADS", "local_size": 2}
    env: dict[str, str] = {}
    watchdog._share_cores(env, rule)
    assert env == {"OMP_NUM_THREADS": str(max(1, cores // 2))}
    many = {"set": "OMP_NUM_THREADS", "local_size": cores * 4}
    env = {}
    watchdog._share_cores(env, many)
    assert env == {"OMP_NUM_THREADS": "1"}  # at least one thread each
    chosen = {"OMP_NUM_THREADS": "6"}
    watchdog._share_cores(chosen, rule)
    assert chosen == {"OMP_NUM_THREADS": "6"}
    unknown: dict[str, str] = {}
    watchdog._share_cores(unknown, {"set": "OMP_NUM_THREADS", "local_size": 0})
    assert unknown == {}
