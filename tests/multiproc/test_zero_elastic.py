"""A sharded optimizer in an elastic job: ``horarun`` with a discovery script, a worker killed
and a host added, end to end.

Each "host" is a loopback address of this machine. The workers run
tests/multiproc/zero_elastic_train.py (Adam with ``shard_optimizer_state=True`` and
``shard_gradients=True``), whose committed history the test replays on one process with plain
Adam: the weights and Adam's moments must match, so no shard of the state was lost or went stale
while the job shrank from 3 workers to 2 and grew back to 3.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.multiproc import zero_elastic_train

HORARUN = [sys.executable, "-m", "hora.runner.launch"]
WORKER = str(Path(zero_elastic_train.__file__))
ROOT = str(Path(__file__).resolve().parents[2])


def _add_host_when(mark: Path, listing: Path, text: str, timeout_s: float) -> threading.Thread:
    """Rewrite the discovery listing with ``text`` once ``mark`` exists."""

    def rewrite() -> None:
        deadline = time.monotonic() + timeout_s
        while not mark.exists():
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        listing.write_text(text)

    thread = threading.Thread(target=rewrite, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(240)
def test_a_sharded_job_loses_a_worker_gains_one_and_matches_the_replay(tmp_path: Path) -> None:
    listing = tmp_path / "hosts.txt"
    listing.write_text("127.0.0.1\n127.0.0.2\n127.0.0.3\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {listing}\n")
    script.chmod(0o755)
    mark = tmp_path / "epoch0.done"
    env = {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "ZERO_RESULT": str(tmp_path / "result.json"),
        "ZERO_KILL": "127.0.0.3:0,0,3",
        "ZERO_MARK": str(mark),
        "ZERO_STEP_DELAY": "0.05",
        "HORA_ELASTIC_TIMEOUT": "60",
    }
    adder = _add_host_when(mark, listing, "127.0.0.1\n127.0.0.2\n127.0.0.4\n", 150)
    command = [*HORARUN, "--verbose", "--host-discovery-script", str(script)]
    command += ["-np", "3", "--min-np", "2", "--max-np", "3", sys.executable, WORKER]
    job = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _, err = job.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        job.kill()
        _, err = job.communicate()
        raise AssertionError(f"the elastic job did not finish:\n{err[-4000:]}") from None
    adder.join(timeout=5)
    assert job.returncode == 0, err[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    history = result["history"]
    # Every epoch used every sample once, on 3 workers, then 2, then 3 again.
    for epoch in range(zero_elastic_train.EPOCHS):
        used = [i for e, batches in history if e == epoch for batch in batches for i in batch]
        assert sorted(used) == list(range(zero_elastic_train.SAMPLES)), (epoch, sorted(used))
    sizes = [len(batches) for _, batches in history]
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3, sizes
    assert result["size"] == 3 and result["round"] >= 2, result["round"]
    params, moments = zero_elastic_train.replay(history)
    for got, want in zip(result["params"], params):
        assert got == pytest.approx(want, abs=1e-5)
    for got, want in zip(result["exp_avg_sq"], moments):
        assert got == pytest.approx(want, rel=1e-4, abs=1e-9)
