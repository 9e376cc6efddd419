"""Elastic training end to end: ``horarun`` with a discovery script, real workers, real failures.

Each "host" is a loopback address of this machine (127.0.0.1, 127.0.0.2, ...), so one machine
plays several hosts and a failed host can be blacklisted without ending the job. The workers run
tests/multiproc/elastic_train.py, whose committed history lets the test check that every sample
of every epoch was used exactly once and that the final weights are what the committed steps
imply.
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

from tests.multiproc import elastic_train

HORARUN = [sys.executable, "-m", "hora.runner.launch"]
WORKER = str(Path(elastic_train.__file__))
ROOT = str(Path(__file__).resolve().parents[2])


def _discovery(tmp_path: Path, hosts: list[str]) -> tuple[Path, Path]:
    """A discovery script printing the lines of a hosts file the test may rewrite."""
    listing = tmp_path / "hosts.txt"
    listing.write_text("".join(f"{h}\n" for h in hosts))
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {listing}\n")
    script.chmod(0o755)
    return script, listing


def _rewrite_when(
    mark: Path, listing: Path, text: str, timeout_s: float
) -> tuple[threading.Thread, threading.Event]:
    """Start a thread that rewrites the discovery ``listing`` with ``text`` once ``mark`` exists
    (the workers create it when epoch 0 ends); the event is set once it has, within
    ``timeout_s``."""
    done = threading.Event()

    def rewrite() -> None:
        deadline = time.monotonic() + timeout_s
        while not mark.exists():
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        listing.write_text(text)
        done.set()

    thread = threading.Thread(target=rewrite, daemon=True)
    thread.start()
    return thread, done


def _start(
    tmp_path: Path, script: Path, flags: list[str], env: dict[str, str]
) -> subprocess.Popen[str]:
    environment = {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "ELASTIC_RESULT": str(tmp_path / "result.json"),
        "HORA_ELASTIC_TIMEOUT": "60",
        **env,
    }
    command = [*HORARUN, "--verbose", "--host-discovery-script", str(script), *flags]
    command += [sys.executable, WORKER]
    return subprocess.Popen(
        command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finish(job: subprocess.Popen[str], timeout: float = 150) -> tuple[int, str, str]:
    try:
        out, err = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        job.kill()
        out, err = job.communicate()
        raise AssertionError(f"the elastic job did not finish:\n{out}\n{err}") from None
    return job.returncode, out, err


def _check_history(result: dict[str, Any]) -> None:
    history = result["history"]
    # Every epoch used every sample exactly once (in the committed trajectory).
    for epoch in range(elastic_train.EPOCHS):
        used = [i for e, batches in history if e == epoch for batch in batches for i in batch]
        assert sorted(used) == list(range(elastic_train.SAMPLES)), (epoch, sorted(used))
    weight, bias = elastic_train.replay(history)
    assert result["weight"] == pytest.approx(weight, abs=1e-5)
    assert result["bias"] == pytest.approx(bias, abs=1e-5)


@pytest.mark.timeout(180)
def test_a_killed_worker_is_survived_and_nothing_is_lost_or_repeated(tmp_path: Path) -> None:
    script, _ = _discovery(tmp_path, ["127.0.0.1", "127.0.0.2", "127.0.0.3"])
    env = {"ELASTIC_KILL": "127.0.0.3:0,1,3"}
    job = _start(tmp_path, script, ["-np", "3", "--min-np", "2"], env)
    code, out, err = _finish(job)
    assert code == 0, err[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["size"] == 2 and result["round"] >= 1, result
    # The "hosts" are addresses of one machine: the ranks exchange through shared memory, and
    # the segments were made anew for the second round.
    assert result["path"] == "shm", result["path"]
    _check_history(result)
    # The steps of epoch 1 ran on 3 workers, then on 2 after the rollback.
    sizes = [len(batches) for epoch, batches in result["history"] if epoch == 1]
    assert sizes[0] == 3 and sizes[-1] == 2, sizes
    assert "127.0.0.3" in err and "blacklist" in err.lower(), err[-3000:]


@pytest.mark.timeout(180)
def test_a_host_added_mid_run_grows_the_world(tmp_path: Path) -> None:
    script, listing = _discovery(tmp_path, ["127.0.0.1", "127.0.0.2"])
    mark = tmp_path / "epoch0.done"
    env = {"ELASTIC_MARK": str(mark), "ELASTIC_STEP_DELAY": "0.05"}
    job = _start(tmp_path, script, ["-np", "2", "--min-np", "2", "--max-np", "3"], env)
    adder, _ = _rewrite_when(mark, listing, "127.0.0.1\n127.0.0.2\n127.0.0.3\n", 120)
    code, out, err = _finish(job)
    adder.join(timeout=5)
    assert code == 0, err[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["size"] == 3, result
    _check_history(result)
    sizes = {len(batches) for _, batches in result["history"]}
    assert sizes == {2, 3}, sizes


# An elastic loop as Horovod's examples write it: a DataLoader over the ElasticSampler, iterated
# to its end on every rank, on a data set whose length does not divide by the number of workers.
HOROVOD_STYLE = """
import json, os, signal, sys
import torch
import hora.torch as hvd
from hora.common.job import rounds

SAMPLES, BATCH, EPOCHS = 97, 4, 2
hvd.init()
torch.manual_seed(0)
x = torch.randn(SAMPLES, 3)
y = x.sum(dim=1, keepdim=True)
model = torch.nn.Linear(3, 1)
optimizer = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
)
sampler = hvd.elastic.ElasticSampler(range(SAMPLES), shuffle=True, seed=1)
loader = torch.utils.data.DataLoader(range(SAMPLES), batch_size=BATCH, sampler=sampler)
state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, seen=[])
kill = os.environ.get("KILL_WORKER", "")
me = os.environ.get(rounds.WORKER_ID_VAR, "")


@hvd.elastic.run
def train(state):
    for state.epoch in range(state.epoch, EPOCHS):
        for step, indices in enumerate(loader):
            first_round = hvd.elastic.round_number() == 0
            if kill == me and first_round and (state.epoch, step) == (0, 5):
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x[indices]), y[indices]).backward()
            optimizer.step()
            state.seen.append(sorted(set(sum(hvd.allgather_object(indices.tolist()), []))))
            state.sampler.record_batch(step, BATCH)
            if step % 3 == 0:
                state.commit()
        state.sampler.set_epoch(state.epoch + 1)
        state.commit()


train(state)
if hvd.rank() == 0:
    with open(os.environ["RESULT"], "w") as out:
        json.dump({"size": hvd.size(), "seen": state.seen}, out)
hvd.shutdown()
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("lose_a_worker", [False, True])
def test_horovods_elastic_loop_over_an_uneven_data_set_runs_to_the_end(
    tmp_path: Path, lose_a_worker: bool
) -> None:
    worker = tmp_path / "horovod_style.py"
    worker.write_text(HOROVOD_STYLE)
    hosts = ["127.0.0.1", "127.0.0.2", "127.0.0.3"] if lose_a_worker else ["127.0.0.1:2"]
    script, _ = _discovery(tmp_path, hosts)
    np = "3" if lose_a_worker else "2"
    env = {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "RESULT": str(tmp_path / "result.json"),
        "HORA_ELASTIC_TIMEOUT": "60",
        "KILL_WORKER": "127.0.0.3:0" if lose_a_worker else "",
    }
    command = [*HORARUN, "--host-discovery-script", str(script), "-np", np, "--min-np", "2"]
    job = subprocess.Popen(
        [*command, sys.executable, str(worker)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    code, _out, err = _finish(job, timeout=200)
    assert code == 0, err[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["size"] == 2
    # Every committed step saw every rank's batch; each epoch covered the whole data set.
    covered = set().union(*(set(step) for step in result["seen"]))
    assert covered == set(range(97))
