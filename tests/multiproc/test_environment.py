"""Horovod's environment on real jobs: what hora does not act on is named once per host,
HOROVOD_CONTROLLER chooses the Gloo or the MPI path as it does in Horovod, and
HOROVOD_TIMELINE=DYNAMIC waits for hvd.start_timeline()."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .jobs import error_of, run_job

UNHEEDED_ENV = {"HOROVOD_TORUS_ALLREDUCE": "1", "HORA_CYCLE_TIM": "2"}


def _warnings_of_two_starts() -> dict[str, Any]:
    import logging

    import torch

    import hora.torch as hvd

    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("hora").addHandler(Collect())
    for _ in range(2):  # named at the first start only
        hvd.init()
        hvd.allreduce(torch.ones(1), name="x")
        local_rank = hvd.local_rank()
        hvd.shutdown()
    return {"local_rank": local_rank, "warnings": warnings}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("np", [2, 3])
def test_what_hora_does_not_act_on_is_named_once_per_host(np: int) -> None:
    ranks = run_job(_warnings_of_two_starts, np, env=UNHEEDED_ENV)

    named = {
        rank: [w for w in seen["warnings"] if w.startswith("hora does not act on")]
        for rank, seen in enumerate(ranks)
    }
    # One host: only its local rank 0 speaks, once.
    assert [seen["local_rank"] for seen in ranks] == list(range(np))
    assert len(named[0]) == 1, named
    assert all(not named[rank] for rank in range(1, np)), named
    text = named[0][0]
    assert "  HOROVOD_TORUS_ALLREDUCE=1 has no effect: hora has no torus allreduce" in text
    assert "  HORA_CYCLE_TIM is not a variable hora reads; did you mean HORA_CYCLE_TIME?" in text


def _the_path_horovod_controller_chooses(first: str, then: str) -> dict[str, Any]:
    import os

    import torch

    import hora.torch as hvd

    os.environ.pop("HORA_CPU_OPERATIONS", None)
    os.environ["HOROVOD_CONTROLLER"] = first
    refused = error_of(hvd.init)
    os.environ["HOROVOD_CONTROLLER"] = then
    hvd.init()
    seen = {
        "refused": refused,
        "mpi": hvd.mpi_enabled(),
        "gloo": hvd.gloo_enabled(),
        "sum": hvd.allreduce(torch.ones(2), op=hvd.Sum, name="sum").tolist(),
    }
    hvd.shutdown()
    return seen


@pytest.mark.timeout(90)
@pytest.mark.parametrize("np", [2, 3])
def test_horovod_controller_mpi_needs_mpirun_and_gloo_selects_gloo(np: int) -> None:
    # Under hora.run (not MPI's launcher), HOROVOD_CONTROLLER=mpi asks for MPI: refused, naming
    # the variable; HOROVOD_CONTROLLER=gloo then runs over Gloo.
    for seen in run_job(_the_path_horovod_controller_chooses, np, "MPI", "gloo"):
        refused = seen.pop("refused")
        assert refused is not None and "ValueError" in refused["types"], refused
        assert refused["message"].startswith("HOROVOD_CONTROLLER=mpi needs a job started by MPI")
        assert seen == {"mpi": False, "gloo": True, "sum": [float(np)] * 2}


def _mpi_path_by_controller() -> dict[str, Any]:
    import os

    import torch

    import hora.torch as hvd

    os.environ.pop("HORA_CPU_OPERATIONS", None)
    os.environ["HOROVOD_CONTROLLER"] = "mpi"
    hvd.init()
    seen = {
        "mpi": hvd.mpi_enabled(),
        "gloo": hvd.gloo_enabled(),
        "sum": hvd.allreduce(torch.ones(2), op=hvd.Sum, name="sum").tolist(),
    }
    hvd.shutdown()
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np", [2, 3])
def test_horovod_controller_mpi_selects_the_mpi_path_under_mpirun(np: int) -> None:
    for seen in run_job(_mpi_path_by_controller, np, mpi=True):
        assert seen == {"mpi": True, "gloo": False, "sum": [float(np)] * 2}


def _dynamic_timeline(folder: str) -> dict[str, Any]:
    import os

    import torch

    import hora.torch as hvd

    os.chdir(folder)
    hvd.init()
    hvd.allreduce(torch.ones(1), name="before")
    written_at_init = sorted(os.listdir(folder))
    hvd.barrier()  # every rank has looked before any starts the timeline in the shared folder
    hvd.start_timeline(os.path.join(folder, "timeline.json"))
    hvd.allreduce(torch.ones(1), name="during")
    hvd.stop_timeline()
    hvd.shutdown()
    return {"written_at_init": written_at_init}


@pytest.mark.timeout(90)
def test_horovods_dynamic_timeline_waits_for_start_timeline(tmp_path: Path) -> None:
    ranks = run_job(_dynamic_timeline, 2, str(tmp_path), env={"HOROVOD_TIMELINE": "DYNAMIC"})

    assert [seen["written_at_init"] for seen in ranks] == [[], []]
    assert "allreduce.during" in (tmp_path / "timeline.json").read_text()


def _threads() -> dict[str, Any]:
    import os

    import torch

    return {"env": os.environ.get("OMP_NUM_THREADS"), "torch": torch.get_num_threads()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np", [2, 3])
def test_workers_share_the_hosts_cores_unless_omp_num_threads_is_set(np: int) -> None:
    """As torchrun does: each of a host's workers gets its share of the cores for PyTorch's
    intra-op threads (at least one), unless the job's environment says otherwise."""
    import os

    import hora

    cores = len(os.sched_getaffinity(0))
    share = str(max(1, cores // np))
    shared = hora.run(_threads, np=np, env={"OMP_NUM_THREADS": None}, timeout_s=80)
    assert shared == [{"env": share, "torch": int(share)}] * np
    chosen = run_job(_threads, np, env={"OMP_NUM_THREADS": "2"})
    assert chosen == [{"env": "2", "torch": 2}] * np
