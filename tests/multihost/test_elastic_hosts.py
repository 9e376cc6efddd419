"""Elastic horarun across hosts over real SSH: network namespaces stand in for machines.

The hosts are the namespaces ``a`` and ``b`` of the ``cluster`` fixture (see conftest), named by a
host discovery script that prints the lines of a file the test may rewrite. The store listens
on the launcher's address on the bridge (the address that reaches the hosts); each remote worker's
watchdog points Gloo at its own ``eth0``. The workers run tests/multiproc/elastic_train.py, whose
committed history is checked as in tests/multiproc/test_elastic.py: every sample of every epoch
used exactly once, and final weights equal to a replay of the committed steps.

Each test names what a user would see: a host lost mid-epoch is blacklisted and the job finishes
on the hosts that are left; a host added to the discovery output mid-run joins the job; a host
added mid-run whose worker fails before the new round connects is blacklisted and the job goes
on. Every process of
the job carries the test's temporary directory in its command line, so the tests also check that
none outlives the job, on any host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.multihost.conftest import Cluster
from tests.multiproc import elastic_train
from tests.multiproc.test_elastic import _check_history, _discovery, _rewrite_when
from tests.processes import job_processes, kill_all, survivors

ROOT = Path(__file__).resolve().parents[2]
HORARUN = [sys.executable, "-m", "hora.runner.launch"]
WORKER = str(Path(elastic_train.__file__))


def _start(
    cluster: Cluster,
    tmp_path: Path,
    script: Path,
    flags: list[str],
    env: dict[str, str],
    command: list[str] | None = None,
) -> subprocess.Popen[str]:
    environment = {
        **os.environ,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "ELASTIC_RESULT": str(tmp_path / "result.json"),
        "HORA_ELASTIC_TIMEOUT": "30",
        **env,
    }
    worker = command or [sys.executable, WORKER]
    horarun = [*HORARUN, *cluster.ssh_flags, "--verbose", "--host-discovery-script", str(script)]
    # The temporary directory, an argument the worker ignores, marks every process of the job.
    horarun += [*flags, *worker, str(tmp_path)]
    return subprocess.Popen(
        horarun,
        env=environment,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(job: subprocess.Popen[str], tmp_path: Path, timeout: float) -> tuple[int, str, str]:
    """Wait for the job; its output is also kept in ``tmp_path/horarun.log``."""
    try:
        out, err = job.communicate(timeout=timeout)
        finished = True
    except subprocess.TimeoutExpired:
        job.kill()
        out, err = job.communicate()
        finished = False
    (tmp_path / "horarun.log").write_text(f"stdout:\n{out}\nstderr:\n{err}")
    if not finished:
        raise AssertionError(f"the elastic job did not finish:\n{out}\n{err}")
    return job.returncode, out, err


def _shown(code: int, out: str, err: str) -> str:
    return f"exit status {code}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-6000:]}"


def _result(tmp_path: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((tmp_path / "result.json").read_text())
    return result


@pytest.mark.timeout(90)
def test_a_host_lost_mid_epoch_is_blacklisted_and_the_job_finishes_on_the_others(
    cluster: Cluster, tmp_path: Path
) -> None:
    a, b = cluster.hosts
    script, _ = _discovery(tmp_path, [f"{a}:2", f"{b}:1"])
    env = {"ELASTIC_KILL": f"{b}:0,1,3"}  # b's worker: SIGKILL before batch 3 of epoch 1
    try:
        job = _start(cluster, tmp_path, script, ["-np", "3", "--min-np", "2"], env)
        code, out, err = _finish(job, tmp_path, timeout=75)
        shown = _shown(code, out, err)
        assert code == 0, shown
        assert f"rendezvous store listening on {cluster.launcher}:" in err, shown
        for number, worker_id in enumerate([f"{a}:0", f"{a}:1", f"{b}:0"]):
            assert f"starting worker {number} ({worker_id}) over ssh" in err, shown
        assert f"round 0: 3 workers on 2 hosts (rank 0 {a}:0, rank 1 {a}:1, rank 2 {b}:0)" in err, (
            shown
        )
        assert f"blacklisted host {b} for good: its worker {b}:0 was killed by SIGKILL" in err, (
            shown
        )
        assert f"round 1: 2 workers on 1 host (rank 0 {a}:0, rank 1 {a}:1)" in err, shown

        result = _result(tmp_path)
        assert result["size"] == 2 and result["round"] == 1, result
        _check_history(result)
        # Epoch 1 began on 3 workers and, after the rollback to its last commit, ended on 2.
        sizes = [len(batches) for epoch, batches in result["history"] if epoch == 1]
        assert sizes[0] == 3 and sizes[-1] == 2, sizes
        assert {len(batches) for epoch, batches in result["history"] if epoch == 2} == {2}
        # No process of the job is left on any host (the namespaces share the process table).
        assert survivors(job_processes(str(tmp_path)), timeout_s=10) == []
    finally:
        kill_all(str(tmp_path))


@pytest.mark.timeout(90)
def test_a_host_added_to_discovery_mid_run_joins_the_job(cluster: Cluster, tmp_path: Path) -> None:
    a, b = cluster.hosts
    script, listing = _discovery(tmp_path, [f"{a}:2"])
    mark = tmp_path / "epoch0.done"
    env = {"ELASTIC_MARK": str(mark), "ELASTIC_STEP_DELAY": "0.1"}
    try:
        flags = ["-np", "2", "--min-np", "2", "--max-np", "3"]
        job = _start(cluster, tmp_path, script, flags, env)
        adder, added = _rewrite_when(mark, listing, f"{a}:2\n{b}:1\n", 40)
        code, out, err = _finish(job, tmp_path, timeout=75)
        adder.join(timeout=5)
        shown = _shown(code, out, err)
        assert code == 0, shown
        assert added.is_set(), shown
        assert f"rendezvous store listening on {cluster.launcher}:" in err, shown
        assert f"starting worker 2 ({b}:0) over ssh" in err, shown
        assert (
            f"round 1: 3 workers on 2 hosts (rank 0 {a}:0, rank 1 {a}:1, rank 2 {b}:0), "
            f"reason: hosts changed: added {b}:0"
        ) in err, shown

        result = _result(tmp_path)
        assert result["size"] == 3 and result["round"] == 1, result
        _check_history(result)
        sizes = [len(batches) for _, batches in result["history"]]
        assert set(sizes) == {2, 3} and sizes[0] == 2 and sizes[-1] == 3, sizes
        assert survivors(job_processes(str(tmp_path)), timeout_s=10) == []
    finally:
        kill_all(str(tmp_path))


@pytest.mark.timeout(90)
def test_a_joining_host_that_fails_to_connect_is_blacklisted_and_the_job_goes_on(
    cluster: Cluster, tmp_path: Path
) -> None:
    a, b = cluster.hosts
    script, listing = _discovery(tmp_path, [f"{a}:1"])
    # Host b is misconfigured: its worker names a network interface that does not exist there,
    # so it passes the round's barrier and then fails in hvd.init() before Gloo connects.
    wrapper = tmp_path / "worker.sh"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'[ "$HORA_ELASTIC_ID" = "{b}:0" ] && export HORA_GLOO_IFACE=nosuchif0\n'
        f'exec {sys.executable} {WORKER} "$@"\n'
    )
    wrapper.chmod(0o755)
    mark = tmp_path / "epoch0.done"
    # The survivors wait for the joiner in the Gloo connection for the whole Gloo timeout.
    env = {
        "ELASTIC_MARK": str(mark),
        "ELASTIC_STEP_DELAY": "0.1",
        "HORA_GLOO_TIMEOUT_SECONDS": "5",
    }
    try:
        flags = ["-np", "1", "--min-np", "1", "--max-np", "2"]
        job = _start(cluster, tmp_path, script, flags, env, command=[str(wrapper)])
        _rewrite_when(mark, listing, f"{a}:1\n{b}:1\n", 40)
        code, out, err = _finish(job, tmp_path, timeout=75)
        shown = _shown(code, out, err)
        assert f"blacklisted host {b} for good: its worker {b}:0 exited with code 1" in err, shown
        assert code == 0, shown
        assert f"round 2: 1 worker on 1 host (rank 0 {a}:0)" in err, shown
        result = _result(tmp_path)
        assert result["size"] == 1 and result["round"] == 2, result
        _check_history(result)
        assert survivors(job_processes(str(tmp_path)), timeout_s=10) == []
    finally:
        kill_all(str(tmp_path))
