"""The emulated cluster (hora.tools.cluster): it starts and tears down quickly, shapes each
host's link to the rate asked for, runs a hora job of two hosts of two ranks over a shaped link,
and leaves nothing behind, even when the process that made it is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hora.tools import cluster as emulated
from hora.tools.cluster import Cluster

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _needs_root_and_tc() -> None:
    reason = emulated.unavailable()
    if reason:
        pytest.skip(reason)
    probe = subprocess.run(
        ["ip", "netns", "add", f"hora-{os.getpid()}-probe"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot create network namespaces here: {probe.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", f"hora-{os.getpid()}-probe"], check=False)


def _leftovers(cluster: Cluster) -> list[str]:
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    found = [name for name in cluster.namespaces if name in namespaces]
    return found + ([cluster.bridge] if f" {cluster.bridge}:" in links else [])


@pytest.mark.timeout(60)
def test_links_are_shaped_to_the_rate_and_nothing_is_left() -> None:
    started = time.monotonic()
    with Cluster.start(hosts=2, rate="500mbit") as cluster:
        up_s = time.monotonic() - started
        assert all("tbf" in line and "500Mbit" in line for line in cluster.qdiscs()), (
            cluster.qdiscs()
        )
        goodput_bits = emulated.measure_rate(cluster, 0, 1, seconds=1.5) * 8
        closing = time.monotonic()
    down_s = time.monotonic() - closing
    # TCP's payload is 1448 of each 1514 bytes that tbf counts: 95.6% of the rate at most.
    assert 0.80 * 500e6 < goodput_bits < 0.97 * 500e6
    assert up_s + down_s < 10, f"up {up_s:.1f} s, down {down_s:.1f} s"
    assert _leftovers(cluster) == []


CLUSTER_SCRIPT = """
import sys, time
from hora.tools.cluster import Cluster
cluster = Cluster.start(hosts=2, rate="1gbit")
print(" ".join([cluster.bridge, *cluster.namespaces, str(cluster.keys)]), flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(60)
def test_a_killed_makers_cluster_is_removed_by_the_next_one() -> None:
    maker = subprocess.Popen(
        [sys.executable, "-c", CLUSTER_SCRIPT],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert maker.stdout is not None
    *names, keys = maker.stdout.readline().split()
    assert len(names) == 3, names
    assert Path(keys).is_dir()
    maker.send_signal(signal.SIGKILL)
    maker.wait()
    stale = Cluster(rate=None, bridge=names[0], launcher="", namespaces=names[1:])
    assert sorted(_leftovers(stale)) == sorted(names)
    removed = emulated.remove_stale()
    assert set(names) <= set(removed)
    assert _leftovers(stale) == []
    assert not Path(keys).exists()


WORKER = """
import json
import torch
import hora.torch as hvd
from hora.common import basics

hvd.init()
rank, size = hvd.rank(), hvd.size()
# 24 MiB: the hierarchical allreduce pipelines it in chunks.
base = torch.arange(3_000_017, dtype=torch.float64)
total = hvd.allreduce(base * (rank + 1), op=hvd.Sum, name="big")
average = hvd.allreduce(base * (rank + 1), name="average")
report = {
    "rank": rank,
    "local_rank": hvd.local_rank(),
    "path": basics.data_path(),
    "sum": bool(torch.equal(total, base * (size * (size + 1) / 2))),
    "average": bool(torch.allclose(average, base * ((size + 1) / 2))),
}
print("REPORT " + json.dumps(report), flush=True)
hvd.shutdown()
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("hierarchical", ["1", "0"])
def test_two_hosts_of_two_ranks_over_a_shaped_link(tmp_path: Path, hierarchical: str) -> None:
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    before = set(os.listdir("/dev/shm"))
    with Cluster.start(hosts=2, rate="1gbit") as cluster:
        done = subprocess.run(
            [*cluster.horarun(slots=2), sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=150,
            cwd=ROOT,
            env={
                **os.environ,
                "PYTHONPATH": str(ROOT),
                "HORA_HIERARCHICAL_ALLREDUCE": hierarchical,
            },
        )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    reports = sorted(
        (
            json.loads(line.split("REPORT ", 1)[1])
            for line in done.stdout.splitlines()
            if "REPORT " in line
        ),
        key=lambda r: r["rank"],
    )
    assert [r["local_rank"] for r in reports] == [0, 1, 0, 1]
    path = "hierarchical" if hierarchical == "1" else "gloo"
    assert all(r["path"] == path and r["sum"] and r["average"] for r in reports), reports
    assert _leftovers(cluster) == []
    left = [name for name in set(os.listdir("/dev/shm")) - before if name.startswith("hora-")]
    assert left == []
