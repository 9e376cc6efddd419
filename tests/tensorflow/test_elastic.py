"""Elastic TensorFlow training end to end: ``horarun --min-np`` with a discovery script, real
workers, and one of them killed mid-epoch.

As in tests/multiproc/test_elastic.py, each "host" is a loopback address of this machine. The
workers run tests/tensorflow/elastic_tf_train.py, whose committed history shows whether every
sample of every epoch was used exactly once and whether the final weights are what the
committed steps imply.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tensorflow import elastic_tf_train

from .conftest import HAS_TENSORFLOW, NO_TENSORFLOW

ROOT = str(Path(__file__).resolve().parents[2])
pytestmark = pytest.mark.skipif(not HAS_TENSORFLOW, reason=NO_TENSORFLOW)


@pytest.mark.timeout(240)
def test_a_killed_tensorflow_worker_is_survived_and_nothing_is_lost(tmp_path: Path) -> None:
    listing = tmp_path / "hosts.txt"
    listing.write_text("127.0.0.1\n127.0.0.2\n127.0.0.3\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {listing}\n")
    script.chmod(0o755)
    env = {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "ELASTIC_RESULT": str(tmp_path / "result.json"),
        "ELASTIC_KILL": "127.0.0.3:0,1,3",
        "HORA_ELASTIC_TIMEOUT": "90",
        "TF_CPP_MIN_LOG_LEVEL": "3",
    }
    command = [sys.executable, "-m", "hora.runner.launch", "--verbose"]
    command += ["--host-discovery-script", str(script), "-np", "3", "--min-np", "2"]
    command += [sys.executable, elastic_tf_train.__file__]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["size"] == 2 and result["round"] >= 1, result
    history = result["history"]
    for epoch in range(elastic_tf_train.EPOCHS):
        used = [i for e, batches in history if e == epoch for batch in batches for i in batch]
        assert sorted(used) == list(range(elastic_tf_train.SAMPLES)), (epoch, sorted(used))
    # Epoch 1 ran on three workers until the kill, then on two from the last commit.
    sizes = [len(batches) for epoch, batches in history if epoch == 1]
    assert sizes[0] == 3 and sizes[-1] == 2, sizes
    weight, bias = elastic_tf_train.replay(history)
    assert result["weight"] == pytest.approx(weight, abs=1e-4)
    assert result["bias"] == pytest.approx(bias, abs=1e-4)
    assert "127.0.0.3" in done.stderr and "blacklist" in done.stderr.lower(), done.stderr[-3000:]
