"""Settings that differ across ranks, and shared-memory sizes a user may mistype, on real jobs.

A setting that chooses the data path (``HORA_SHARED_MEMORY``, the shared-memory sizes,
``HORA_CPU_OPERATIONS``) set differently on some ranks stops ``hvd.init()`` on every rank at
once, naming it; before, the ranks went different ways and met an unrelated timeout (~39 s) or
none at all (under ``mpirun``). Each worker sets its own environment before ``hvd.init()``, as
a per-rank wrapper script would.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from .jobs import assert_raised, error_of, run_job

ADVICE = "Set it the same on every rank: horarun passes the launcher's environment to every rank"


def _starts(variable: str, values: list[str]) -> dict[str, Any]:
    """A first start with ``variable`` alike everywhere, then one with ``values[rank]``."""
    import os

    import torch

    import hora.torch as hvd

    os.environ[variable] = values[0]
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    total = hvd.allreduce(torch.ones(3), op=hvd.Sum, name="alike").tolist()
    hvd.shutdown()
    os.environ[variable] = values[rank]
    started = time.monotonic()
    error = error_of(hvd.init)
    return {"total": total, "size": size, "error": error, "init_s": time.monotonic() - started}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np", [2, 3])
def test_shared_memory_set_differently_is_named_on_every_rank_at_once(np: int) -> None:
    values = ["1"] * (np - 1) + ["0"]
    started = time.monotonic()
    ranks = run_job(_starts, np, "HORA_SHARED_MEMORY", values)
    took_s = time.monotonic() - started

    # Well under the ~39 s the ranks took to fail apart, on an unrelated timeout.
    assert took_s < 15.0, took_s
    expected = f"HORA_SHARED_MEMORY differs across ranks: rank 0 has 1, rank {np - 1} has 0. "
    for seen in ranks:
        assert seen["total"] == [float(np)] * 3  # the first start agreed
        assert_raised(seen["error"], ValueError, expected + ADVICE)
        assert "SettingError" in seen["error"]["types"]
        assert seen["init_s"] < 5.0, seen


@pytest.mark.timeout(120)
def test_slot_sizes_set_differently_are_named_with_each_value() -> None:
    values = ["65536", "131072", "65536"]
    ranks = run_job(_starts, 3, "HORA_SHM_SLOT_BYTES", values)
    for seen in ranks:
        assert_raised(
            seen["error"],
            ValueError,
            "HORA_SHM_SLOT_BYTES differs across ranks: rank 0 has 65536, rank 1 has 131072.",
        )


@pytest.mark.timeout(120)
def test_deterministic_mode_on_some_ranks_only_is_named() -> None:
    # A rank in deterministic mode sums in another order and with other collectives than one
    # that is not: its first step would wait for collectives the others never submit.
    ranks = run_job(_starts, 2, "HORA_DETERMINISTIC", ["1", "0"])
    for seen in ranks:
        assert_raised(
            seen["error"],
            ValueError,
            "HORA_DETERMINISTIC differs across ranks: rank 0 has 1, rank 1 has 0.",
        )


def _reduce_through_shared_memory() -> dict[str, Any]:
    import torch

    import hora.torch as hvd
    from hora.common import basics

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    sums = {}
    for dtype in (torch.uint8, torch.float32, torch.float64, torch.int64):
        # Larger than a slot: the collective runs in slot-sized chunks, as half-slots for two.
        data = (torch.arange(50_000) % 7 + rank).to(dtype)
        sums[str(dtype)] = hvd.allreduce(data, op=hvd.Sum, name=str(dtype)).tolist()
    gathered = hvd.allgather(torch.full((3,), float(rank)), name="gathered").tolist()
    path = basics.data_path()
    hvd.shutdown()
    return {"sums": sums, "gathered": gathered, "path": path, "size": size}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np", [2, 3])
def test_a_slot_size_off_the_page_reduces_through_shared_memory(np: int) -> None:
    import torch

    # No arena: the data goes through the slots, which used to be viewed in pieces of 32769 (two
    # ranks) or 65538 bytes, and no dtype wider than a byte divides those.
    env = {"HORA_SHM_SLOT_BYTES": "65538", "HORA_SHM_ARENA_BYTES": "0"}
    ranks = run_job(_reduce_through_shared_memory, np, env=env)

    for seen in ranks:
        assert seen["path"] == "shm"
        for name, got in seen["sums"].items():
            dtype = getattr(torch, name.removeprefix("torch."))
            inputs = [(torch.arange(50_000) % 7 + r).to(dtype) for r in range(np)]
            assert got == torch.stack(inputs).sum(0).to(dtype).tolist(), name
        assert seen["gathered"] == [float(r) for r in range(np) for _ in range(3)]


def _init_error() -> dict[str, Any] | None:
    import hora.torch as hvd

    return error_of(hvd.init)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {"HORA_SHM_ARENA_BYTES": "1e16"},
            "HORA_SHM_ARENA_BYTES must be between 0 and 1099511627776 bytes, got "
            "10000000000000000.",
        ),
        ({"HORA_SHM_SLOT_BYTES": "inf"}, "HORA_SHM_SLOT_BYTES must be an integer, got 'inf'."),
    ],
)
def test_impossible_sizes_are_refused_at_init_on_every_rank(
    env: dict[str, str], expected: str
) -> None:
    for error in run_job(_init_error, 2, env=env):
        assert_raised(error, ValueError, expected)
        assert error is not None and "SettingError" in error["types"]


def _cpu_operations_of_rank() -> dict[str, Any] | None:
    import os

    import hora.torch as hvd

    if os.environ.get("OMPI_COMM_WORLD_RANK") == "1":
        os.environ["HORA_CPU_OPERATIONS"] = "gloo"
    return error_of(hvd.init)


@pytest.mark.timeout(120)
def test_mpi_on_some_ranks_and_gloo_on_others_is_named_under_mpirun() -> None:
    # Rank 0 used to wait in MPI_Comm_dup for a rank that never called it: no error at all.
    started = time.monotonic()
    errors = run_job(_cpu_operations_of_rank, 2, mpi=True, timeout_s=60)
    assert time.monotonic() - started < 45.0
    for error in errors:
        assert_raised(
            error,
            ValueError,
            "HORA_CPU_OPERATIONS (or HOROVOD_CPU_OPERATIONS) differs across ranks: rank 0 has "
            "mpi, rank 1 has gloo.",
        )
