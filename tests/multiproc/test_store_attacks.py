"""Another local user against a running job's store: it learns nothing, changes nothing, and
cannot use up the store's file descriptors; the job computes the right result.

The attacker is a plain Python process running as uid ``nobody`` (so the test needs root); it
knows the store's port, as anyone can from ``ss -tln``, but not the secret.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import hora
from hora.common.job import secure_store

NOBODY = 65534

ATTACKER = r"""
import json, socket, sys, time

port = int(sys.argv[1])
out = {}


def connect():
    return socket.create_connection(("127.0.0.1", port), timeout=15)


def read_all(sock):
    data = b""
    while True:
        try:
            chunk = sock.recv(4096)
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    return data


# Connect and wait: the store sends its greeting, then closes the connection.
sock = connect()
started = time.monotonic()
out["unproven_bytes"] = len(read_all(sock))
out["closed_after_s"] = time.monotonic() - started
# A guessed proof: closed without an answer.
sock = connect()
sock.recv(64)
sock.sendall(bytes(64))
out["guess_answer"] = read_all(sock).hex()
# TCPStore's protocol (a query for the number of keys, then for their list): nothing back.
sock = connect()
sock.recv(64)
sock.sendall(bytes([10]) + bytes(63) + bytes([11]) * 64)
out["tcpstore_answer"] = read_all(sock).hex()
# A flood of connections held open.
held = []
for _ in range(int(sys.argv[2])):
    try:
        held.append(connect())
    except OSError:
        break
out["flood_opened"] = len(held)
time.sleep(float(sys.argv[3]))
print(json.dumps(out), flush=True)
"""


def _job(control: str) -> dict[str, Any]:
    import time
    from pathlib import Path

    import torch

    import hora.torch as hvd

    hvd.init()
    folder = Path(control)
    if hvd.rank() == 0:
        (folder / "port").write_text(os.environ["HORA_RENDEZVOUS_PORT"])
    deadline = time.monotonic() + 120
    while not (folder / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
    gathered = hvd.allgather_object({"rank": hvd.rank()})
    hvd.shutdown()
    return {"total": total.item(), "gathered": gathered}


def _own_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(180)
@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
def test_another_user_learns_nothing_and_cannot_exhaust_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("no system python3 for the attacking user")
    # hora.run's store runs in this process: its limits can be shortened here.
    monkeypatch.setattr(secure_store, "HANDSHAKE_S", 2.0)
    results: list[Any] = []
    job = threading.Thread(
        target=lambda: results.append(hora.run(_job, args=(str(tmp_path),), np=2))
    )
    job.start()
    port_file = tmp_path / "port"
    deadline = time.monotonic() + 60
    while not port_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    port = port_file.read_text()
    before = _own_descriptors()
    flood, hold_s = 400, 3.0
    attacker = subprocess.Popen(
        [python, "-c", ATTACKER, port, str(flood), str(hold_s)],
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
    )
    # While the flood is held: this process keeps at most MAX_UNPROVEN of its connections.
    peak = before
    while attacker.poll() is None:
        peak = max(peak, _own_descriptors())
        time.sleep(0.05)
    report = json.loads(attacker.stdout.read() if attacker.stdout else "{}")
    (tmp_path / "go").write_text("")
    job.join(timeout=120)

    assert report["unproven_bytes"] == len(secure_store.GREETING) + secure_store.NONCE_BYTES
    assert report["closed_after_s"] < 2.0 + 3.0
    assert report["guess_answer"] == "" and report["tcpstore_answer"] == ""
    assert report["flood_opened"] > secure_store.MAX_UNPROVEN
    assert peak - before <= secure_store.MAX_UNPROVEN + 8, (before, peak)
    (ranks,) = results
    assert [r["total"] for r in ranks] == [3.0, 3.0]
    assert ranks[0]["gathered"] == [{"rank": 0}, {"rank": 1}]
