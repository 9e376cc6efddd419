"""Data paths across hosts (network namespaces, see conftest): ranks of one host share memory,
only what crosses hosts goes over Gloo.

- two hosts with two ranks each: the hierarchical allreduce (or, with
  ``HORA_HIERARCHICAL_ALLREDUCE=0``, one Gloo group), the same results either way;
- two ranks on one host and one on another: one Gloo group;
- every other collective on both layouts, checked against what each rank computes itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.multihost.conftest import Cluster

ROOT = Path(__file__).resolve().parents[2]
HORARUN = [sys.executable, "-m", "hora.runner.launch"]

WORKER = """
import json, sys
import torch
import hora.torch as hvd
from hora.common import basics

hvd.init()
rank, size = hvd.rank(), hvd.size()
base = torch.arange(300_001, dtype=torch.float64)
total = hvd.allreduce(base * (rank + 1), op=hvd.Sum, name="big")
expected = base * (size * (size + 1) / 2)
ints = hvd.allreduce(torch.arange(1000) + rank, op=hvd.Sum, name="ints")
grouped = hvd.grouped_allreduce([torch.full((n,), float(rank)) for n in (3, 50_000)], op=hvd.Sum)
gathered = hvd.allgather(torch.full((rank + 1, 2), float(rank)), name="g")
sent = hvd.broadcast(torch.arange(10.0) + rank, root_rank=size - 1, name="b")
scattered = hvd.reducescatter(torch.arange(size * 3, dtype=torch.float32) + rank, op=hvd.Sum)
swapped = hvd.alltoall(torch.arange(size, dtype=torch.float32) + 10 * rank)
objects = hvd.allgather_object(rank)
report = {
    "rank": rank,
    "path": basics.data_path(),
    "big": bool(torch.equal(total, expected)),
    "ints": bool(torch.equal(ints, (torch.arange(1000) * size + size * (size - 1) // 2))),
    "grouped": [t.sum().item() for t in grouped],
    "gathered": gathered[:, 0].tolist(),
    "sent": sent.tolist(),
    "scattered": scattered.tolist(),
    "swapped": swapped.tolist(),
    "objects": objects,
}
print("REPORT " + json.dumps(report), flush=True)
hvd.shutdown()
"""


def _run(cluster: Cluster, hosts: str, np: int, tmp_path: Path, env: dict[str, str]) -> list[dict]:
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    command = [*HORARUN, *cluster.ssh_flags, "-np", str(np), "-H", hosts]
    # horarun hands its own environment to every worker, on every host.
    done = subprocess.run(
        [*command, sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=ROOT,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    reports = [
        json.loads(line.split("REPORT ", 1)[1])
        for line in done.stdout.splitlines()
        if "REPORT " in line
    ]
    return sorted(reports, key=lambda r: r["rank"])


def _check(reports: list[dict], size: int) -> None:
    for report in reports:
        rank = report["rank"]
        assert report["big"] and report["ints"], report
        assert report["grouped"] == [3.0 * sum(range(size)), 50_000.0 * sum(range(size))]
        assert report["gathered"] == [float(r) for r in range(size) for _ in range(r + 1)]
        assert report["sent"] == [float(i + size - 1) for i in range(10)]
        whole = [float(i * size + sum(range(size))) for i in range(size * 3)]
        assert report["scattered"] == whole[rank * 3 : rank * 3 + 3]
        assert report["swapped"] == [float(10 * r + rank) for r in range(size)]
        assert report["objects"] == list(range(size))


@pytest.mark.timeout(360)
def test_two_hosts_of_two_ranks_reduce_hierarchically_or_flat(
    cluster: Cluster, tmp_path: Path
) -> None:
    a, b = cluster.hosts
    hierarchical = _run(cluster, f"{a}:2,{b}:2", 4, tmp_path, {})
    assert {r["path"] for r in hierarchical} == {"hierarchical"}
    _check(hierarchical, 4)
    flat = _run(cluster, f"{a}:2,{b}:2", 4, tmp_path, {"HORA_HIERARCHICAL_ALLREDUCE": "0"})
    assert {r["path"] for r in flat} == {"gloo"}
    _check(flat, 4)


@pytest.mark.timeout(240)
def test_uneven_hosts_reduce_over_one_gloo_group(cluster: Cluster, tmp_path: Path) -> None:
    a, b = cluster.hosts
    reports = _run(cluster, f"{a}:2,{b}:1", 3, tmp_path, {})
    assert {r["path"] for r in reports} == {"gloo"}
    _check(reports, 3)
