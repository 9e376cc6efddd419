"""Another local user against a running job's store: it learns nothing, changes nothing, and
cannot use up the store's file descriptors; the job computes the right result.

The attacker is a plain Python process running as uid ``nobody`` (so the test needs root); it
knows the store's port, as anyone can from ``ss -tln``, but not the secret.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import hora
from hora.common.job import store_protocol, store_service
from tests.processes import as_nobody, needs_root, nobody_python

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
# A guessed proof: refused, then closed.
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
@needs_root
def test_another_user_learns_nothing_and_cannot_exhaust_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    python = nobody_python()
    # hora.run's store runs in this process: its limits can be shortened here.
    monkeypatch.setattr(store_service, "HANDSHAKE_S", 2.0)
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
    attacker = as_nobody(
        [python, "-c", ATTACKER, port, str(flood), str(hold_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    # While the flood is held: this process keeps at most MAX_UNPROVEN of its connections.
    peak = before
    while attacker.poll() is None:
        peak = max(peak, _own_descriptors())
        time.sleep(0.05)
    said, complained = attacker.communicate()
    (tmp_path / "go").write_text("")
    job.join(timeout=120)
    assert attacker.returncode == 0 and said, f"the attacking process failed:\n{complained}"
    report = json.loads(said)

    assert report["unproven_bytes"] == len(store_protocol.GREETING) + store_protocol.NONCE_BYTES
    assert report["closed_after_s"] < 2.0 + 3.0
    # A guess is refused in so many words; that tells the guesser only what it knew.
    refused = store_protocol.REFUSED.hex()
    assert report["guess_answer"] == refused and report["tcpstore_answer"] == refused
    assert report["flood_opened"] > store_service.MAX_UNPROVEN
    assert peak - before <= store_service.MAX_UNPROVEN + 8, (before, peak)
    (ranks,) = results
    assert [r["total"] for r in ranks] == [3.0, 3.0]
    assert ranks[0]["gathered"] == [{"rank": 0}, {"rank": 1}]


TORCHRUN_WORKER = r"""
import json, os, sys, time
from pathlib import Path

import torch

import hora.torch as hvd

control = Path(sys.argv[1])
hvd.init()
if hvd.rank() == 0:
    (control / "port").write_text(os.environ["MASTER_PORT"])
deadline = time.monotonic() + 60
while not (control / "go").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
result = {"rank": hvd.rank(), "error": None, "total": None}
try:
    for _ in range(400):
        result["total"] = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
        time.sleep(0.01)
except Exception as exc:
    result["error"] = str(exc)
# One file per rank: both ranks share torchrun's stdout, where lines can interleave.
(control / f"result-{hvd.rank()}.json").write_text(json.dumps(result))
sys.exit(1 if result["error"] else 0)
"""

FORGER = r"""
import sys
from datetime import timedelta

import torch.distributed as dist

store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), None, False, timedelta(seconds=10),
                      wait_for_workers=False)
# torchrun's agent store lists its keys to anyone; the job's namespace shows in them.
names = [k for k in store.list_keys() if k.endswith("/parked")]
namespace = names[0].rsplit("/", 1)[0]
store.set(namespace + "/failure", b"rank 1: FORGED failure")
print("forged", namespace + "/failure", flush=True)
"""


@pytest.mark.timeout(180)
def test_a_failure_forged_in_torchruns_store_stops_the_job_naming_tampering(
    tmp_path: Path,
) -> None:
    """torchrun's agent store is a plain ``TCPStore``: any process that reaches its port can
    list, read and write it, whoever runs it. What such a process writes there is not believed.

    The forger runs without the job's secret (and with torch, which uid ``nobody`` cannot load
    from this checkout's environment; the store cannot tell users apart anyway).
    """
    from tests.multiproc.test_launchers import base_env, torchrun, without_secret

    control = tmp_path / "control"
    control.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(TORCHRUN_WORKER)
    job = subprocess.Popen(
        torchrun("--standalone", "--nproc-per-node", "2", str(script), str(control)),
        env=base_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not (control / "port").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        port = (control / "port").read_text()
        forger = subprocess.run(
            [sys.executable, "-c", FORGER, port],
            capture_output=True,
            text=True,
            cwd="/",
            env=without_secret(base_env()),
            timeout=60,
        )
        assert forger.returncode == 0, forger.stderr
        (control / "go").write_text("")
        output, _ = job.communicate(timeout=120)
    finally:
        job.kill()
    reports = [json.loads(path.read_text()) for path in sorted(control.glob("result-*.json"))]
    assert job.returncode != 0, output
    assert reports, output
    for report in reports:
        assert report["error"] is not None, output
        assert "tampering" in report["error"], output
        assert report["total"] in (None, 2.0), output


GLOO_FLOOD = r"""
import json, socket, sys, time

ports = [int(p) for p in sys.argv[1].split(",")]
held, refused = [], 0
for port in ports:
    for n in range(int(sys.argv[2])):
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            # Garbage where Gloo expects its pairing handshake.
            sock.sendall(n.to_bytes(8, "little") + b"\xff" * 56)
            held.append(sock)
        except OSError:
            refused += 1
print(json.dumps({"held": len(held), "refused": refused}), flush=True)
time.sleep(float(sys.argv[3]))
"""


def _flooded_job(control: str) -> dict[str, Any]:
    import os
    import time
    from pathlib import Path

    import torch

    import hora.torch as hvd

    hvd.init(process_sets="dynamic")
    folder = Path(control)
    (folder / f"pid.{hvd.rank()}").write_text(str(os.getpid()))
    deadline = time.monotonic() + 120
    while not (folder / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    totals = [
        hvd.allreduce(torch.full((1000,), float(hvd.rank() + step)), op=hvd.Sum).sum().item()
        for step in range(20)
    ]
    # A new process set builds new Gloo pairs after the flood.
    subset = hvd.add_process_set([0, 2])
    late = None
    if hvd.rank() in (0, 2):
        late = hvd.allreduce(torch.ones(3), op=hvd.Sum, process_set=subset).tolist()
    # Rank 1 must not shut the job down while the others' call is still on its way.
    hvd.barrier()
    hvd.shutdown()
    return {"totals": totals, "late": late}


@pytest.mark.timeout(180)
@needs_root
def test_another_user_flooding_gloo_ports_cannot_change_results(tmp_path: Path) -> None:
    """Gloo accepts every connection to its listening ports; hora cannot refuse them. Stray
    connections with garbage handshakes must at worst fail the job, never change a result."""
    import psutil

    python = nobody_python()
    results: list[Any] = []
    errors: list[BaseException] = []

    def job() -> None:
        try:
            results.append(hora.run(_flooded_job, args=(str(tmp_path),), np=3))
        except BaseException as exc:  # examined below
            errors.append(exc)

    runner = threading.Thread(target=job)
    runner.start()
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("pid.*"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [int(p.read_text()) for p in sorted(tmp_path.glob("pid.*"))]
    ports = sorted(
        {
            c.laddr.port
            for pid in pids
            for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN
        }
    )
    assert ports, "the workers listen on no TCP port"
    attacker = as_nobody(
        [python, "-c", GLOO_FLOOD, ",".join(map(str, ports)), "50", "4"], stdout=subprocess.PIPE
    )
    assert attacker.stdout is not None
    flood = json.loads(attacker.stdout.readline())
    (tmp_path / "go").write_text("")
    runner.join(timeout=150)
    attacker.wait(timeout=30)

    assert flood["held"] > 0, flood
    if errors:
        # Stray connections may fail the job (Gloo hands them to new pairs), with an error that
        # says so: through the peer proof, or when a new group cannot connect. Never a wrong
        # number.
        text = str(errors[0])
        assert "did not prove the job secret" in text or (
            "could not connect to the other ranks" in text
            and "other processes connecting to them" in text
        ), text
        return
    (ranks,) = results
    expected = [sum(1000.0 * (r + step) for r in range(3)) for step in range(20)]
    assert [r["totals"] for r in ranks] == [expected] * 3
    assert [r["late"] for r in ranks] == [[2.0, 2.0, 2.0], None, [2.0, 2.0, 2.0]]


STORE_FLOOD = r"""
import collections, json, socket, sys, time

# As fast as it can: a new connection, then its oldest closed once it holds `held`.
port, held, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
socks, opened, announced = collections.deque(), 0, False
end = time.monotonic() + seconds
while time.monotonic() < end:
    try:
        socks.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        opened += 1
    except OSError:
        time.sleep(0.01)
    while len(socks) > held:
        socks.popleft().close()
    if not announced and opened >= held:
        print(json.dumps({"opened": opened}), flush=True)
        announced = True
print(json.dumps({"opened": opened}), flush=True)
"""


def _store_flooded_job() -> list[float]:
    import torch

    import hora.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    names = hvd.allgather_object(hvd.rank())
    hvd.shutdown()
    return [total, float(sum(names))]


@pytest.mark.timeout(240)
@needs_root
@pytest.mark.parametrize("np", [2, 3])
def test_another_user_flooding_the_store_as_workers_connect_never_fails_the_job(
    monkeypatch: pytest.MonkeyPatch, np: int
) -> None:
    """300 connections from uid nobody, replaced as fast as the store closes them, race the
    workers' own connections to the store: the workers wait their turn and the job succeeds."""
    from hora.runner import store_server

    python = nobody_python()
    floods: list[subprocess.Popen[str]] = []
    original = store_server.start_store_server

    def start_and_flood(bind: str, port: int, secret: str) -> Any:
        server, bound = original(bind, port, secret)
        attacker = as_nobody(
            [python, "-c", STORE_FLOOD, str(bound), "300", "10"], stdout=subprocess.PIPE
        )
        floods.append(attacker)
        assert attacker.stdout is not None
        json.loads(attacker.stdout.readline())  # the flood is under way before any worker
        return server, bound

    monkeypatch.setattr(store_server, "start_store_server", start_and_flood)
    results = hora.run(_store_flooded_job, np=np, env={"HORA_START_TIMEOUT": "120"})
    (attacker,) = floods
    attacker.wait(timeout=60)
    assert attacker.stdout is not None
    report = json.loads(attacker.stdout.read().strip().splitlines()[-1])

    total = float(sum(range(1, np + 1)))
    assert results == [[total, float(sum(range(np)))]] * np
    # It opened more connections than the store keeps unproven, while the workers connected.
    assert report["opened"] >= 300, report
