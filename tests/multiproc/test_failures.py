"""Failures on real processes: a peer killed mid-job, a rank that never submits a tensor (the
stall inspector shuts the job down when a shutdown time is set), and a deadlock. In each case
every survivor's pending op fails with an error that says why, instead of hanging; a rank that is
only busy, by default, is waited for.
"""

from __future__ import annotations

from typing import Any

import pytest

from .jobs import run_failing_job, run_job

# How long a survivor keeps trying before it gives up and reports that nothing failed.
GIVE_UP_S = 40.0


def _killed_peer_worker() -> dict[str, Any]:
    import os
    import signal
    import time

    import torch

    import hora.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    hvd.allreduce(torch.ones(2), name="first")
    if rank == size - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    step = 0
    while time.monotonic() - start < GIVE_UP_S:
        try:
            hvd.allreduce(torch.ones(2), name=f"step.{step}")
        except hvd.HoraInternalError as exc:
            return {"message": str(exc), "elapsed_s": time.monotonic() - start}
        step += 1
    return {"message": None, "elapsed_s": time.monotonic() - start}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("np", [2, 3])
def test_killed_peer_fails_every_survivor_naming_the_lost_rank(np: int) -> None:
    lost = np - 1
    error = run_failing_job(_killed_peer_worker, np, timeout_s=60)

    assert set(error.errors) == {lost}, error.errors
    assert "SIGKILL" in error.errors[lost]
    assert sorted(error.results) == list(range(lost))
    for rank, observed in error.results.items():
        assert observed["message"] is not None, f"rank {rank} never saw an error"
        assert f"rank {lost}" in observed["message"], observed["message"]
        assert observed["elapsed_s"] < 15, observed


STALL_ENV = {"HORA_STALL_CHECK_TIME_SECONDS": "1", "HORA_STALL_SHUTDOWN_TIME_SECONDS": "3"}


def _stalled_worker() -> dict[str, Any]:
    import time

    import torch

    import hora.torch as hvd

    hvd.init()
    rank = hvd.rank()
    # Rank 1 never submits "x"; it waits on "y", which nobody else submits.
    name = "y" if rank == 1 else "x"
    start = time.monotonic()
    try:
        hvd.allreduce(torch.ones(2), name=name)
    except hvd.HoraInternalError as exc:
        return {"message": str(exc), "elapsed_s": time.monotonic() - start}
    return {"message": None, "elapsed_s": time.monotonic() - start}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("np", [2, 3])
def test_stall_inspector_shuts_a_stalled_job_down(np: int) -> None:
    ranks = run_job(_stalled_worker, np, env=STALL_ENV, timeout_s=60)

    for rank, observed in enumerate(ranks):
        assert observed["message"] is not None, f"rank {rank}'s op completed"
        assert observed["elapsed_s"] < 20, observed
        assert "shut down" in observed["message"], observed["message"]
        # Every rank learns why: the inspector's report travels with the shutdown.
        assert "stalled for longer than 3 seconds" in observed["message"]
        assert "1!: [allreduce.x]" in observed["message"]


# Deadlocks are recognised after HORA_GLOO_TIMEOUT_SECONDS; the stall limits stay at their
# defaults (a warning after 60 s, far beyond this test; no shutdown).
DEADLOCK_ENV = {"HORA_GLOO_TIMEOUT_SECONDS": "3"}


def _half_way_worker() -> dict[str, Any]:
    import time

    import torch

    import hora.torch as hvd

    from .jobs import error_of

    hvd.init()
    rank = hvd.rank()
    hvd.allreduce(torch.ones(2), name="before")
    # Rank 0 stops half-way through a sequence of calls (a test whose assertion failed, say)
    # and goes on to its clean-up barrier; the others make their next call of the sequence.
    start = time.monotonic()
    if rank == 0:
        failed = error_of(hvd.barrier)
    else:
        failed = error_of(lambda: hvd.allgather(torch.ones(1, 2)))
    elapsed_s = time.monotonic() - start
    # The next collective raises (the job was shut down), and a new init works again.
    after = error_of(lambda: hvd.allreduce(torch.ones(1), name="after"))
    hvd.init()
    again = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="again")
    hvd.shutdown()
    return {"failed": failed, "elapsed_s": elapsed_s, "after": after, "again": again}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("np", [2, 3])
def test_a_deadlock_ends_the_job_naming_who_waits_for_what(np: int) -> None:
    ranks = run_job(_half_way_worker, np, env=DEADLOCK_ENV, timeout_s=60)

    for rank, observed in enumerate(ranks):
        failed = observed["failed"]
        assert failed is not None, f"rank {rank}'s call completed"
        assert "HoraInternalError" in failed["types"]
        message = failed["message"]
        assert "Deadlock: every rank waits" in message, message
        others = "rank 1" if np == 2 else "ranks 1, 2"
        assert f"rank 0 waits for barrier.noname.0, which {others}" in message
        for other in range(1, np):
            assert f"rank {other} waits for allgather.noname." in message
            assert "which rank 0 has not submitted" in message
        assert 3 <= observed["elapsed_s"] < 20, observed
        assert "shut down" in observed["after"]["message"]
        assert observed["again"].tolist() == [float(np)]


# HORA_STALL_SHUTDOWN_TIME_SECONDS keeps its default (0, as Horovod's): the busy rank outlasts
# the stall check time and the collective timeout, and the job goes on.
BUSY_ENV = {"HORA_STALL_CHECK_TIME_SECONDS": "1", "HORA_GLOO_TIMEOUT_SECONDS": "2"}
BUSY_S = 5.0


def _busy_then_deadlocked_worker() -> dict[str, Any]:
    import logging
    import time

    import torch

    import hora.torch as hvd

    from .jobs import error_of

    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("hora").addHandler(Collect())
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    hvd.allreduce(torch.ones(1), name="before")
    # The last rank evaluates alone while the others wait in their next collective.
    start = time.monotonic()
    if rank == size - 1:
        time.sleep(BUSY_S)
    busy = error_of(lambda: hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after_busy"))
    busy_s = time.monotonic() - start
    # Then a real deadlock: rank 0 skips the allgather that the others make.
    start = time.monotonic()
    if rank == 0:
        deadlock = error_of(hvd.barrier)
    else:
        deadlock = error_of(lambda: hvd.allgather(torch.ones(1, 2)))
    deadlock_s = time.monotonic() - start
    hvd.shutdown()
    return {
        "busy": busy,
        "busy_s": busy_s,
        "deadlock": deadlock,
        "deadlock_s": deadlock_s,
        "warnings": warnings,
    }


@pytest.mark.timeout(90)
@pytest.mark.parametrize("np", [2, 3])
def test_by_default_a_busy_rank_is_waited_for_and_a_deadlock_still_ends_the_job(np: int) -> None:
    ranks = run_job(_busy_then_deadlocked_worker, np, env=BUSY_ENV, timeout_s=60)

    busy = np - 1
    for rank, observed in enumerate(ranks):
        assert observed["busy"] is None, f"rank {rank}: {observed['busy']}"
        if rank != busy:
            assert observed["busy_s"] >= BUSY_S - 0.5, observed
        deadlock = observed["deadlock"]
        assert deadlock is not None, f"rank {rank}'s call completed"
        assert "Deadlock: every rank waits" in deadlock["message"], deadlock
        assert observed["deadlock_s"] < 20, observed
    # The stall was reported (the warning stays), but did not end the job.
    reports = [w for w in ranks[0]["warnings"] if "Missing ranks:" in w]
    assert any(f"\n{busy}: [allreduce.after_busy]" in w for w in reports), ranks[0]["warnings"]
    assert not any("Will shutdown" in w for w in ranks[0]["warnings"])


def _left_by_a_peer_worker() -> dict[str, Any]:
    import torch

    import hora.torch as hvd

    from .jobs import error_of

    hvd.init()
    rank = hvd.rank()
    hvd.allreduce(torch.ones(1), name="together")
    if rank > 0:
        hvd.shutdown()  # done: the others' engines end with it
        return {}
    # Rank 0's call fails once the others' shutdown reached it; a helper that calls
    # hvd.init() again must then not start a session the others will never join.
    pending = error_of(lambda: hvd.allreduce(torch.ones(1), name="alone"))
    hvd.init()
    after = error_of(lambda: hvd.allreduce(torch.ones(1), name="after"))
    initialized = hvd.is_initialized()
    hvd.shutdown()
    return {"pending": pending, "after": after, "initialized": initialized}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("np", [2, 3])
def test_init_after_a_peers_shutdown_does_nothing(np: int) -> None:
    observed = run_job(_left_by_a_peer_worker, np, timeout_s=60)[0]

    for call in ("pending", "after"):
        assert observed[call] is not None, f"rank 0's {call} call completed"
        message = observed[call]["message"]
        assert "called hvd.shutdown()" in message and "shut down" in message, message
    assert observed["initialized"] is True
