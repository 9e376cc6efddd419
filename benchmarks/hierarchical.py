"""The hierarchical allreduce against one flat Gloo group, on two hosts of two ranks each, over
a link shaped to a given rate.

The two "hosts" are Linux network namespaces of this machine, joined by veth pairs to a bridge
whose links are shaped with ``tc`` (a token bucket at ``--rate``, 1 Gbit/s by default, on
every link's egress): the bytes that cross hosts go through a 1 Gbit/s network, while the ranks
of one host share memory as on a real node. Each run starts four workers (two per namespace)
through the ``env://`` variables, and times allreduces of float32 buffers:

- hierarchical (hora's default here): reduce-scatter within each host through shared memory,
  allreduce of each local rank's shard across hosts over Gloo, allgather within the host;
- flat (``HORA_HIERARCHICAL_ALLREDUCE=0``): one Gloo group of every rank.

Runs alternate (flat, hierarchical, hierarchical, flat, ...) ``--repeats`` times each; the table
shows, per size, the median time of each and their ratio, with the range over runs. It needs
root (namespaces and ``tc``)::

    sudo .venv/bin/python benchmarks/hierarchical.py [--rate 1gbit] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness

MIB = 1 << 20
SIZES = {4 * MIB: 8, 16 * MIB: 5, 64 * MIB: 3}
PREFIX = "10.79.3"
NETNS_DIR = Path("/etc/netns")


def worker() -> None:
    """One rank: time allreduces of each size; rank 0 prints the slowest rank's medians."""
    import torch

    import hora.torch as hvd
    from hora.common import basics

    hvd.init()
    results: dict[str, Any] = {"path": basics.data_path(), "seconds": {}}
    for nbytes, reps in SIZES.items():
        tensor = torch.ones(nbytes // 4)
        name = f"h{nbytes}"
        hvd.allreduce_(tensor, op=hvd.Sum, name=name)
        times = []
        for _ in range(reps):
            hvd.barrier()
            start = time.perf_counter()
            hvd.allreduce_(tensor, op=hvd.Sum, name=name)
            times.append(time.perf_counter() - start)
        slowest = hvd.allreduce(torch.tensor(times, dtype=torch.float64), op=hvd.Max)
        results["seconds"][str(nbytes)] = statistics.median(slowest.tolist())
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(results), flush=True)
    hvd.shutdown()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _shape(device: str, rate: str, namespace: str | None = None) -> None:
    command = ["tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", rate]
    command += ["burst", "256kb", "latency", "100ms"]
    if namespace:
        command = ["ip", "netns", "exec", namespace, *command]
    subprocess.run(command, check=True, capture_output=True, timeout=30)


class Hosts:
    """Two namespaces ``a`` and ``b`` on a bridge, every link shaped to ``rate``."""

    def __init__(self, rate: str) -> None:
        tag = os.getpid() % 10000
        self.bridge = f"hbb{tag}"
        self.namespaces = [f"hora-bench-{tag}{letter}" for letter in "ab"]
        self.addresses = [f"{PREFIX}.2", f"{PREFIX}.3"]
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{PREFIX}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for letter, namespace, address in zip("ab", self.namespaces, self.addresses):
            (NETNS_DIR / namespace).mkdir(parents=True, exist_ok=True)
            (NETNS_DIR / namespace / "hosts").write_text(f"127.0.0.1 localhost\n{address} me\n")
            _ip("netns", "add", namespace)
            veth = f"hb{tag}{letter}"
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            _shape(veth, rate)
            _shape("eth0", rate, namespace)

    def close(self) -> None:
        for namespace in self.namespaces:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
            shutil.rmtree(NETNS_DIR / namespace, ignore_errors=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)


def run_job(hosts: Hosts, hierarchical: bool, port: int) -> dict[str, Any]:
    """Four workers, two per namespace; rank 0's results."""
    secret = secrets.token_hex(32)
    procs = []
    for rank in range(4):
        host = rank // 2
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "4",
            "LOCAL_RANK": str(rank % 2),
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": hosts.addresses[0],
            "MASTER_PORT": str(port),
            "HORA_SECRET_KEY": secret,
            "GLOO_SOCKET_IFNAME": "eth0",
            "HORA_HIERARCHICAL_ALLREDUCE": "1" if hierarchical else "0",
            "OMP_NUM_THREADS": "1",
        }
        command = ["ip", "netns", "exec", hosts.namespaces[host], sys.executable]
        command += [os.path.abspath(__file__), "--worker"]
        procs.append(
            subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        )
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        if p.returncode != 0:
            raise SystemExit(f"a worker failed ({p.returncode}):\n{err.decode()[-3000:]}")
    for line in outputs[0][0].decode().splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return result
    raise SystemExit("rank 0 printed no result")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rate", default="1gbit", help="tc rate of every link (default 1gbit)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode (default 3)")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write results here")
    args = parser.parse_args()
    if args.worker:
        worker()
        return 0
    if os.geteuid() != 0 or shutil.which("tc") is None or shutil.which("ip") is None:
        print("benchmarks/hierarchical.py needs root, ip and tc (iproute2)", file=sys.stderr)
        return 2
    hosts = Hosts(args.rate)
    runs: dict[str, list[dict[str, Any]]] = {"flat": [], "hierarchical": []}
    try:
        port = 29600
        for index in range(args.repeats):
            order = ("flat", "hierarchical") if index % 2 == 0 else ("hierarchical", "flat")
            for mode in order:
                port += 1
                runs[mode].append(run_job(hosts, mode == "hierarchical", port))
    finally:
        hosts.close()
    paths = {mode: sorted({r["path"] for r in results}) for mode, results in runs.items()}
    header = ("allreduce", "flat gloo", "hierarchical", "flat/hierarchical time", "range")
    rows = []
    for nbytes in SIZES:
        flat = [r["seconds"][str(nbytes)] for r in runs["flat"]]
        hier = [r["seconds"][str(nbytes)] for r in runs["hierarchical"]]
        ratios = [f / h for f, h in zip(flat, hier)]
        rows.append(
            (
                f"{nbytes // MIB} MiB",
                f"{statistics.median(flat) * 1e3:.1f} ms",
                f"{statistics.median(hier) * 1e3:.1f} ms",
                f"{statistics.median(ratios):.2f}x",
                f"{min(ratios):.2f}-{max(ratios):.2f}",
            )
        )
    print(
        f"2 hosts x 2 ranks, links shaped to {args.rate}; paths {paths}; "
        f"{args.repeats} interleaved runs each, medians of the slowest rank"
    )
    print("\n".join(harness.table(header, rows)))
    if args.json:
        harness.write_json(args.json, {"rate": args.rate, "runs": runs, "paths": paths})
    return 0


if __name__ == "__main__":
    sys.exit(main())
