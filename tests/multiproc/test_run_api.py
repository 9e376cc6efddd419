"""``hora.run`` with ``horovod.run``'s arguments, on real processes.

Static jobs sized by ``num_proc`` (and hora's ``np``), placed by ``hosts`` or a ``hostfile``;
loopback addresses (127.0.0.2, ...) stand in for other hosts, as in the elastic tests, so ranks
really get different hosts, local and cross ranks without SSH (tests/multihost covers SSH).
Elastic jobs from the Python API: a discovery script, a worker that dies, the final round's
results. The workers' environment, their Python, per-rank log files, ``verbose``, MPI, timeouts,
and a clear error for each argument that cannot be used.
"""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path
from typing import Any

import pytest

import hora
import hora.runner
from hora.runner import mpi_launch
from hora.runner.api import HoraRunError

from .jobs import JOB_TIMEOUT_S

# horovod.run's parameters, in its order (horovod/runner/__init__.py).
HOROVOD_RUN_PARAMETERS = [
    "func",
    "args",
    "kwargs",
    "num_proc",
    "min_num_proc",
    "max_num_proc",
    "slots",
    "reset_limit",
    "cooldown_range",
    "hosts",
    "hostfile",
    "host_discovery_script",
    "start_timeout",
    "ssh_port",
    "ssh_identity_file",
    "disable_cache",
    "output_filename",
    "verbose",
    "use_gloo",
    "use_mpi",
    "mpi_args",
    "network_interface",
    "network_interfaces",
    "executable",
    "np",
    "min_np",
    "max_np",
]


def _place(tag: str = "") -> dict[str, Any]:
    """Where this rank runs, by hvd's account and the launcher's, and an allreduce's sum."""
    import torch

    import hora.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum, name="total")
    place = {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(),
        "cross_rank": hvd.cross_rank(),
        "cross_size": hvd.cross_size(),
        "host": os.environ.get("HORA_HOSTNAME"),
        "total": total.item(),
        "tag": tag,
    }
    hvd.shutdown()
    return place


def test_hora_run_takes_horovod_runs_parameters_in_order() -> None:
    names = list(inspect.signature(hora.run).parameters)
    assert names[: len(HOROVOD_RUN_PARAMETERS)] == HOROVOD_RUN_PARAMETERS
    # hora's own keywords follow, keyword-only.
    extra = {n: p.kind for n, p in inspect.signature(hora.run).parameters.items()}
    for name in ("env", "timeout_s", "prefix_output", "ssh_options"):
        assert extra[name] is inspect.Parameter.KEYWORD_ONLY
    assert hora.runner.run is hora.run


# ---------------------------------------------------------------- static jobs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np", [2, 3])
def test_num_proc_starts_that_many_ranks(np: int) -> None:
    places = hora.run(_place, args=("x",), num_proc=np, timeout_s=JOB_TIMEOUT_S)
    total = float(sum(range(1, np + 1)))
    assert [p["rank"] for p in places] == list(range(np))
    assert all(p["size"] == np and p["total"] == total and p["tag"] == "x" for p in places)
    assert [p["local_rank"] for p in places] == list(range(np))


@pytest.mark.timeout(120)
def test_positional_num_proc_and_the_old_names_agree() -> None:
    # horovod.run(func, args, kwargs, num_proc): the fourth positional argument is num_proc;
    # np (hora's keyword, Horovod's deprecated one) may be given too when it says the same.
    places = hora.runner.run(_place, (), {"tag": "kw"}, 2, np=2, timeout_s=JOB_TIMEOUT_S)
    assert [(p["rank"], p["size"], p["tag"]) for p in places] == [(0, 2, "kw"), (1, 2, "kw")]


@pytest.mark.timeout(120)
def test_hosts_localhost_two_slots() -> None:
    places = hora.run(_place, hosts="localhost:2", num_proc=2, timeout_s=JOB_TIMEOUT_S)
    assert [(p["host"], p["local_rank"], p["local_size"]) for p in places] == [
        ("localhost", 0, 2),
        ("localhost", 1, 2),
    ]
    assert all(p["cross_size"] == 1 for p in places)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np", [2, 3])
def test_hosts_fill_in_order_across_hosts(np: int) -> None:
    # Two hosts (both this machine, under two loopback names), filled in order, as Horovod does.
    places = hora.run(
        _place, hosts=["127.0.0.1:2", "127.0.0.2:2"], num_proc=np, timeout_s=JOB_TIMEOUT_S
    )
    expected = [("127.0.0.1", 0, 0), ("127.0.0.1", 1, 0), ("127.0.0.2", 0, 1)][:np]
    assert [(p["host"], p["local_rank"], p["cross_rank"]) for p in places] == expected
    assert all(p["total"] == float(sum(range(1, np + 1))) for p in places)


@pytest.mark.timeout(120)
def test_hostfile_names_the_hosts(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("# two hosts\n127.0.0.1 slots=1\n127.0.0.2 slots=2\n")
    places = hora.run(_place, hostfile=hostfile, num_proc=3, timeout_s=JOB_TIMEOUT_S)
    assert [(p["host"], p["local_rank"], p["local_size"]) for p in places] == [
        ("127.0.0.1", 0, 1),
        ("127.0.0.2", 0, 2),
        ("127.0.0.2", 1, 2),
    ]
    assert [p["cross_size"] for p in places] == [2, 2, 1]


def _environment(names: list[str]) -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in names}


@pytest.mark.timeout(120)
def test_env_sets_and_removes_the_workers_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HORA_TEST_INHERITED", "from the caller")
    monkeypatch.setenv("HORA_TEST_REMOVED", "must not reach the workers")
    monkeypatch.setenv("HORA_TEST_REPLACED", "old")
    names = ["HORA_TEST_INHERITED", "HORA_TEST_REMOVED", "HORA_TEST_REPLACED", "HORA_TEST_ADDED"]
    seen = hora.run(
        _environment,
        args=(names,),
        num_proc=2,
        env={"HORA_TEST_REMOVED": None, "HORA_TEST_REPLACED": "new", "HORA_TEST_ADDED": "yes"},
        timeout_s=JOB_TIMEOUT_S,
    )
    expected = {
        "HORA_TEST_INHERITED": "from the caller",
        "HORA_TEST_REMOVED": None,
        "HORA_TEST_REPLACED": "new",
        "HORA_TEST_ADDED": "yes",
    }
    assert seen == [expected, expected]


def _interpreter() -> tuple[str | None, str]:
    return os.environ.get("HORA_TEST_WRAPPER"), sys.version


@pytest.mark.timeout(120)
def test_executable_is_the_python_the_workers_run(tmp_path: Path) -> None:
    wrapper = tmp_path / "python-wrapper"
    wrapper.write_text(f'#!/bin/sh\nHORA_TEST_WRAPPER="$0" exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    seen = hora.run(_interpreter, num_proc=2, executable=str(wrapper), timeout_s=JOB_TIMEOUT_S)
    assert seen == [(str(wrapper), sys.version)] * 2


def _greet() -> int:
    import hora.torch as hvd

    hvd.init()
    print(f"hello from rank {hvd.rank()}", flush=True)
    print(f"complaint of rank {hvd.rank()}", file=sys.stderr, flush=True)
    rank = hvd.rank()
    hvd.shutdown()
    return rank


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np", [2, 3])
def test_output_filename_writes_each_ranks_output(tmp_path: Path, np: int) -> None:
    logs = tmp_path / "logs"
    assert hora.run(_greet, num_proc=np, output_filename=logs, timeout_s=JOB_TIMEOUT_S) == list(
        range(np)
    )
    for rank in range(np):
        assert f"hello from rank {rank}" in (logs / f"rank.{rank}" / "stdout").read_text()
        assert f"complaint of rank {rank}" in (logs / f"rank.{rank}" / "stderr").read_text()


@pytest.mark.timeout(120)
def test_verbose_says_what_the_launch_does_and_notes_inert_arguments(
    capfd: pytest.CaptureFixture[str],
) -> None:
    assert hora.run(_greet, num_proc=2, verbose=True, disable_cache=True, prefix_output=False) == [
        0,
        1,
    ]
    out, err = capfd.readouterr()
    assert "hora.run: disable_cache has no effect: horarun keeps no cache" in err
    assert "hora.run: rendezvous store listening on 127.0.0.1:" in err
    assert "hora.run: starting rank 1 on localhost on this machine" in err
    # prefix_output=False forwards the workers' lines bare.
    assert "hello from rank 1\n" in out and "[1]<stdout>" not in out
    # Not verbose: the launch is quiet again.
    hora.run(_greet, num_proc=2, timeout_s=JOB_TIMEOUT_S)
    out, err = capfd.readouterr()
    assert "hora.run:" not in err
    assert "[1]<stdout>:hello from rank 1" in out


def _sleep() -> None:
    import time

    time.sleep(60)


@pytest.mark.timeout(60)
def test_timeout_stops_a_static_job() -> None:
    with pytest.raises(TimeoutError, match="did not finish within 2 s"):
        hora.run(_sleep, num_proc=2, timeout_s=2)


# ---------------------------------------------------------------- elastic jobs


def _discovery(tmp_path: Path, hosts: list[str]) -> Path:
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\n" + "".join(f"echo {h}\n" for h in hosts))
    script.chmod(0o755)
    return script


def _elastic_training(epochs: int, doomed_host: str) -> dict[str, Any]:
    """Count epochs with an allreduce per epoch; the worker on ``doomed_host`` dies in epoch 1.
    Returns where this worker ended and how many workers each committed epoch had."""
    import torch

    import hora.torch as hvd

    hvd.init()
    state = hvd.elastic.ObjectState(epoch=0, sizes=[])

    @hvd.elastic.run
    def train(state: Any) -> dict[str, Any]:
        while state.epoch < epochs:
            if state.epoch == 1 and os.environ.get("HORA_HOSTNAME") == doomed_host:
                os._exit(3)
            workers = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="workers").item()
            state.sizes = [*state.sizes, int(workers)]
            state.epoch += 1
            state.commit()
        return {
            "rank": hvd.rank(),
            "size": hvd.size(),
            "host": os.environ.get("HORA_HOSTNAME"),
            "sizes": state.sizes,
        }

    return train(state)


ELASTIC_ENV = {"HORA_ELASTIC_TIMEOUT": "30"}


@pytest.mark.timeout(150)
def test_elastic_job_survives_a_lost_host_and_returns_the_final_rounds_results(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = _discovery(tmp_path, ["127.0.0.1", "127.0.0.2", "127.0.0.3"])
    results = hora.run(
        _elastic_training,
        args=(3, "127.0.0.3"),
        num_proc=3,
        min_num_proc=2,
        host_discovery_script=str(script),
        env=ELASTIC_ENV,
        timeout_s=120,
    )
    # As Horovod: the results of ranks 0 .. min_num_proc - 1, here those of the final round,
    # which the two surviving hosts form.
    assert [(r["rank"], r["size"], r["host"]) for r in results] == [
        (0, 2, "127.0.0.1"),
        (1, 2, "127.0.0.2"),
    ]
    # Epoch 0 was committed by three workers, the rest after the rollback by two.
    assert all(r["sizes"] == [3, 2, 2] for r in results)
    assert "127.0.0.3" in capfd.readouterr().err


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np", [2, 3])
def test_elastic_job_on_fixed_hosts(np: int) -> None:
    hosts = ",".join(f"127.0.0.{i + 1}:1" for i in range(np))
    results = hora.run(
        _elastic_training,
        args=(2, "no such host"),
        min_num_proc=np,
        max_num_proc=np,
        hosts=hosts,
        env=ELASTIC_ENV,
        timeout_s=120,
    )
    assert [(r["rank"], r["size"]) for r in results] == [(rank, np) for rank in range(np)]
    assert all(r["sizes"] == [np, np] for r in results)


@pytest.mark.timeout(150)
def test_elastic_job_that_cannot_reform_raises_with_the_drivers_report(tmp_path: Path) -> None:
    script = _discovery(tmp_path, ["127.0.0.1", "127.0.0.2"])
    with pytest.raises(HoraRunError, match="the elastic job failed") as info:
        hora.run(
            _elastic_training,
            args=(3, "127.0.0.2"),
            num_proc=2,
            min_num_proc=2,
            host_discovery_script=script,
            env=ELASTIC_ENV,
            timeout_s=120,
        )
    # The survivor cannot train alone (min_num_proc=2): the driver says why it stopped.
    assert "127.0.0.2" in str(info.value)


@pytest.mark.timeout(60)
def test_timeout_stops_an_elastic_job(tmp_path: Path) -> None:
    script = _discovery(tmp_path, ["127.0.0.1", "127.0.0.2"])
    with pytest.raises(TimeoutError, match="did not finish within 3 s"):
        hora.run(_sleep, min_num_proc=2, host_discovery_script=script, env=ELASTIC_ENV, timeout_s=3)


# ---------------------------------------------------------------- MPI


def _over_mpi() -> tuple[int, int, bool]:
    import torch

    import hora.torch as hvd

    hvd.init()
    hvd.allreduce(torch.ones(1), name="warmup")
    return hvd.rank(), hvd.size(), hvd.mpi_enabled()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np", [2, 3])
def test_use_mpi_starts_the_job_with_mpirun(np: int) -> None:
    pytest.importorskip("mpi4py", reason="mpi4py is not installed: pip install -e '.[dev]'")
    try:
        mpi_launch.find_mpirun()
    except mpi_launch.MPILaunchError as exc:
        pytest.skip(str(exc))
    results = hora.run(_over_mpi, num_proc=np, use_mpi=True, timeout_s=JOB_TIMEOUT_S)
    assert results == [(rank, np, True) for rank in range(np)]


def test_use_mpi_without_mpi4py_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # what find_spec sees when it is missing
    with pytest.raises(ValueError, match=r"use_mpi needs mpi4py \(pip install"):
        hora.run(_over_mpi, num_proc=2, use_mpi=True)


# ---------------------------------------------------------------- bad arguments


def _not_run() -> None:
    raise AssertionError("no worker may start")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("arguments", "kind", "message"),
    [
        ({"np": 2, "num_proc": 3}, ValueError, "np=2 and num_proc=3 disagree"),
        ({"min_np": 2, "min_num_proc": 3}, ValueError, "min_np=2 and min_num_proc=3 disagree"),
        ({"num_proc": 0}, ValueError, "num_proc must be >= 1"),
        ({"num_proc": "2"}, TypeError, "num_proc must be a whole number, got '2'"),
        (
            {"hosts": "localhost:1", "hostfile": "hosts.txt"},
            ValueError,
            "hosts and hostfile cannot be given together",
        ),
        ({"hostfile": "/no/such/hostfile"}, ValueError, "cannot read hostfile '/no/such/"),
        (
            {"num_proc": 2, "hosts": "nosuchhost.invalid:2"},
            ValueError,
            "cannot reach host 'nosuchhost.invalid' over SSH",
        ),
        ({"num_proc": 3, "hosts": "localhost:2"}, ValueError, "num_proc 3 needs 3 slots"),
        ({"num_proc": 3, "max_num_proc": 2}, ValueError, "num_proc 3 is more than max_num_proc"),
        (
            {"min_num_proc": 2, "cooldown_range": (10, 1)},
            ValueError,
            "cooldown_range 10 1: need 1 <= MIN <= MAX <= 3600",
        ),
        ({"cooldown_range": 5}, TypeError, "cooldown_range must be (low, high)"),
        (
            {"host_discovery_script": "/no/such/script"},
            ValueError,
            "host_discovery_script '/no/such/script': no such file",
        ),
        ({"use_gloo": True, "use_mpi": True}, ValueError, "use_gloo and use_mpi cannot be"),
        ({"use_mpi": True, "min_num_proc": 2}, ValueError, "use_mpi cannot run an elastic job"),
        ({"ssh_options": ["-oFoo"]}, ValueError, "ssh_options '-oFoo' must look like Key=Value"),
        ({"env": {"A": 1}}, TypeError, "env must map names to strings"),
        (
            {"executable": "/no/such/python"},
            ValueError,
            "executable '/no/such/python' is not an executable file here",
        ),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(
    arguments: dict[str, Any], kind: type[Exception], message: str
) -> None:
    with pytest.raises(kind, match=f"^hora.run: .*{_escaped(message)}"):
        hora.run(_not_run, **arguments)


def _escaped(text: str) -> str:
    import re

    return re.escape(text)


def test_func_must_be_callable() -> None:
    with pytest.raises(TypeError, match="func must be callable, got int"):
        hora.run(3)  # type: ignore[arg-type]
