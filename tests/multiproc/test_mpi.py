"""hora over MPI (``HORA_CPU_OPERATIONS=mpi``) under a real ``mpirun``: what the job reports,
``hvd.init(comm=...)`` and process sets from mpi4py communicators, the transport's own edges
(abort, timeouts, uneven buffers), and failures (mismatched input, a dead peer) that must end in
clear errors rather than hangs.

The collectives, process sets and optimizer tests also run over MPI (their ``-mpi`` variants);
``jobs.run_job(..., mpi=True)`` starts them with the venv's Open MPI ``mpirun``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from .jobs import JOB_TIMEOUT_S, assert_raised, error_of, mpi_env, run_failing_job, run_job
from .jobs import mpirun_command as mpirun


def _what_the_job_reports() -> dict[str, Any]:
    import hora.torch as hvd

    hvd.init()
    out = {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "mpi_built": hvd.mpi_built(),
        "mpi_enabled": hvd.mpi_enabled(),
        "gloo_enabled": hvd.gloo_enabled(),
        "threads": hvd.mpi_threads_supported(),
        "sum": hvd.allreduce(torch.ones(3) * (hvd.rank() + 1), op=hvd.Sum, name="sum").tolist(),
        "mismatch": error_of(lambda: hvd.allreduce(torch.ones(4 + hvd.rank()), name="x")),
    }
    hvd.shutdown()
    out["mpi_enabled_after_shutdown"] = hvd.mpi_enabled()
    out["threads_after_shutdown"] = error_of(hvd.mpi_threads_supported)
    return out


def _over_mpi() -> dict[str, Any]:
    """One job for several tests: what hora reports, then the transport on its own."""
    return {"reports": _what_the_job_reports(), "transport": _transport_edges()}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda np: f"np{np}")
def over_mpi(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    return request.param, run_job(_over_mpi, request.param, mpi=True)


@pytest.mark.timeout(120)
def test_the_job_says_it_runs_over_mpi(over_mpi: tuple[int, list[dict[str, Any]]]) -> None:
    np, results = over_mpi
    total = float(sum(range(1, np + 1)))
    for rank, seen in enumerate(r["reports"] for r in results):
        mismatch = seen.pop("mismatch")
        assert_raised(
            mismatch, RuntimeError, "Mismatched allreduce tensor shapes for 'allreduce.x'"
        )
        assert f"rank {np - 1}" in mismatch["message"]
        error = seen.pop("threads_after_shutdown")
        assert_raised(error, ValueError, "MPI is not enabled")
        assert seen == {
            "rank": rank,
            "size": np,
            "mpi_built": True,
            "mpi_enabled": True,
            "gloo_enabled": False,
            "threads": True,
            "sum": [total] * 3,
            "mpi_enabled_after_shutdown": False,
        }


def _communicators() -> dict[str, Any]:
    """Process sets made from mpi4py communicators, and jobs made of a communicator."""
    from mpi4py import MPI

    import hora.torch as hvd

    world = MPI.COMM_WORLD
    me = world.Get_rank()
    evens = world.Split(color=me % 2, key=me)
    out: dict[str, Any] = {}
    # One set from init, one added later: both from communicators (every rank passes its own).
    static = hvd.ProcessSet(evens)
    hvd.init(process_sets=[static], comm=None)
    out["static"] = (static.ranks, static.rank(), static.size())
    out["static_sum"] = hvd.allreduce(
        torch.tensor([float(me)] * 600), op=hvd.Sum, process_set=static, name="evens"
    )[0].item()
    hvd.shutdown()

    # Two jobs inside one MPI job: the first two processes, and the rest.
    first = world.Split(color=int(me >= 2), key=me)
    hvd.init(comm=first)
    out["split"] = (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size())
    out["split_sum"] = hvd.allreduce(torch.tensor([me + 1.0] * 600), op=hvd.Sum, name="split")[
        0
    ].item()
    hvd.shutdown()

    # A list of MPI_COMM_WORLD ranks, as Horovod takes: only those ranks call init.
    if me in (0, 1):
        hvd.init(comm=[0, 1])
        out["listed"] = (hvd.rank(), hvd.size())
        hvd.shutdown()
    else:
        out["not_listed"] = error_of(lambda: hvd.init(comm=[0, 1]))
    return out


@pytest.mark.timeout(120)
def test_jobs_and_process_sets_from_mpi_communicators() -> None:
    results = run_job(_communicators, 3, mpi=True)
    assert [r["static"] for r in results] == [([0, 2], 0, 2), ([1], 0, 1), ([0, 2], 1, 2)]
    assert [r["static_sum"] for r in results] == [2.0, 1.0, 2.0]
    assert [r["split"] for r in results] == [(0, 2, 0, 2), (1, 2, 1, 2), (0, 1, 0, 1)]
    assert [r["split_sum"] for r in results] == [3.0, 3.0, 3.0]
    assert [r.get("listed") for r in results] == [(0, 2), (1, 2), None]
    assert_raised(results[2]["not_listed"], ValueError, "is not one of the listed ranks")


def _transport_edges() -> dict[str, Any]:
    """The MPI communicator itself: uneven and scattered buffers, 16-bit reductions, sendrecv,
    and an abort or a timeout ending a wait for a peer that never comes."""
    import threading

    from hora.common.transport import allgather_bytes
    from hora.common.transport.mpi import MPICommunicator, import_mpi
    from hora.common.vocabulary.message import ReduceOp

    mpi = import_mpi()
    world = mpi.COMM_WORLD
    comm = MPICommunicator.of(world, None, 30.0, mpi)
    aborted = MPICommunicator.of(world, None, 30.0, mpi)
    timed = MPICommunicator.of(world, None, 1.0, mpi)
    rank, size = comm.rank, comm.size
    out: dict[str, Any] = {}
    out["headers"] = allgather_bytes(comm, bytes([rank]) * 5)
    # Outputs that are not consecutive pieces of one tensor go through a staging buffer.
    outputs = [torch.empty(2, dtype=torch.uint8) for _ in range(size)]
    comm.allgather(outputs, torch.tensor([rank, 7], dtype=torch.uint8))
    out["gathered"] = [o.tolist() for o in outputs]
    halves = torch.full((1000,), 1.5 + rank, dtype=torch.bfloat16)
    comm.allreduce(halves, ReduceOp.PRODUCT)
    out["bf16_product"] = halves[0].item()
    chunks = [torch.full((r + 1,), float(rank), dtype=torch.float16) for r in range(size)]
    mine = torch.empty(rank + 1, dtype=torch.float16)
    comm.reducescatter(mine, chunks, ReduceOp.MAX)
    out["scattered"] = mine.tolist()
    rows = torch.arange(sum(range(size)), dtype=torch.int64) + 100 * rank
    received = torch.empty(rank * size, dtype=torch.int64)
    comm.alltoall(received, rows, [rank] * size, list(range(size)))
    out["alltoall"] = received.tolist()
    if size == 2:
        got = torch.empty(3)
        comm.sendrecv(torch.full((3,), float(rank)), got, 1 - rank)
        out["sendrecv"] = got.tolist()
    comm.barrier()
    if rank == 0:
        # Member 1 never starts these: only the abort, or the timeout, ends the wait.
        threading.Timer(0.5, aborted.abort).start()
        start = time.monotonic()
        out["aborted"] = error_of(lambda: aborted.allreduce(torch.ones(4), ReduceOp.SUM))
        out["aborted_after_s"] = time.monotonic() - start
        start = time.monotonic()
        out["timed_out"] = error_of(lambda: timed.broadcast(torch.ones(4), 1))
        out["timed_out_after_s"] = time.monotonic() - start
        out["after_abort"] = error_of(aborted.barrier)
    comm.close()
    return out


@pytest.mark.timeout(120)
def test_the_mpi_transport(over_mpi: tuple[int, list[dict[str, Any]]]) -> None:
    np, jobs = over_mpi
    results = [r["transport"] for r in jobs]
    for rank, seen in enumerate(results):
        assert seen["headers"] == [bytes([r]) * 5 for r in range(np)]
        assert seen["gathered"] == [[r, 7] for r in range(np)]
        expected = torch.tensor(1.0, dtype=torch.bfloat16)
        for r in range(np):
            expected = expected * torch.tensor(1.5 + r, dtype=torch.bfloat16)
        assert seen["bf16_product"] == expected.item()
        assert seen["scattered"] == [float(np - 1)] * (rank + 1)
        assert seen["alltoall"] == [
            100 * r + sum(range(rank)) + i for r in range(np) for i in range(rank)
        ]
        if np == 2:
            assert seen["sendrecv"] == [float(1 - rank)] * 3
    first = results[0]
    assert_raised(first["aborted"], RuntimeError, "aborted")
    assert first["aborted_after_s"] < 5
    assert_raised(first["timed_out"], RuntimeError, "timed out after 1 s")
    assert first["timed_out_after_s"] < 5
    assert_raised(first["after_abort"], RuntimeError, "aborted")


def _dies_after_one_allreduce() -> None:
    import os

    import hora.torch as hvd

    hvd.init()
    hvd.allreduce(torch.ones(2000), name="warm")
    if hvd.rank() == 1:
        os._exit(3)
    for step in range(1000):
        hvd.allreduce(torch.ones(2000), name=f"after.{step}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np", [2, 3])
def test_a_dead_peer_ends_the_job_without_a_hang(np: int) -> None:
    start = time.monotonic()
    failure = run_failing_job(_dies_after_one_allreduce, np, mpi=True, timeout_s=JOB_TIMEOUT_S)
    took = time.monotonic() - start
    assert took < JOB_TIMEOUT_S
    # Open MPI's mpirun ends every rank once one dies, and names the one that died first.
    assert set(failure.errors) == set(range(np))
    for text in failure.errors.values():
        assert "mpirun exit status 3" in text
        assert re.search(r"Process name: *\[\S+@1,1\]\s+Exit code: *3", text), text


def _ask_for_mpi_without_mpirun() -> None:
    import hora.torch as hvd

    hvd.init()


@pytest.mark.timeout(120)
def test_mpi_without_mpirun_says_how_to_launch() -> None:
    failure = run_failing_job(_ask_for_mpi_without_mpirun, 2, env={"HORA_CPU_OPERATIONS": "mpi"})
    for text in failure.errors.values():
        assert "HORA_CPU_OPERATIONS=mpi needs a job started by MPI's launcher" in text
        assert "horarun --mpi" in text


@pytest.mark.timeout(150)
def test_horarun_mpi_starts_the_job_with_mpirun() -> None:
    mpirun(2)  # skips without mpi4py or the venv's mpirun
    script = (
        "import torch, hora.torch as hvd; hvd.init(); "
        "t = hvd.allreduce(torch.ones(2000), op=hvd.Sum, name='t'); "
        "print('RESULT', hvd.rank(), hvd.size(), hvd.mpi_enabled(), t[0].item(), flush=True)"
    )
    command = [sys.executable, "-m", "hora.runner.launch", "--mpi", "--verbose", "-np", "2"]
    env = {k: v for k, v in mpi_env().items() if k != "HORA_CPU_OPERATIONS"}
    done = subprocess.run(
        [*command, sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.returncode == 0, output
    assert "starting the job with openmpi's launcher" in done.stderr, output
    lines = sorted(
        line.split("RESULT ", 1)[1] for line in done.stdout.splitlines() if "RESULT" in line
    )
    assert lines == ["0 2 True 2.0", "1 2 True 2.0"], output
    # Open MPI's own output tags, not horarun's.
    assert "<stdout>:" in done.stdout and "[0]<stdout>:" not in done.stdout, output
