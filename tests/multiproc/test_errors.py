"""Errors on real processes: calls before ``init``, requests that do not match across ranks,
duplicate names in flight, calls after ``shutdown``, and recovery (the engine keeps working after
a mismatch; ``init`` works again after ``shutdown``).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from .jobs import assert_raised, error_of, run_job


def _mismatches(hvd: Any, rank: int) -> dict[str, Any]:
    """Calls whose requests differ between ranks; each must fail on every rank."""
    return {
        "shape": error_of(lambda: hvd.allreduce(torch.ones(4 + rank), name="bad_shape")),
        "dtype": error_of(
            lambda: hvd.allreduce(
                torch.ones(4, dtype=torch.float64 if rank % 2 else torch.float32), name="bad_dtype"
            )
        ),
        "op": error_of(
            lambda: hvd.allreduce(torch.ones(4), name="bad_op", op=hvd.Max if rank else hvd.Sum)
        ),
        "scale": error_of(
            lambda: hvd.allreduce(torch.ones(4), name="bad_scale", prescale_factor=1.0 + rank)
        ),
        "root": error_of(
            lambda: hvd.broadcast(torch.ones(4), root_rank=min(rank, 1), name="bad_root")
        ),
        "allgather_shape": error_of(
            lambda: hvd.allgather(torch.ones(2, 3 + rank), name="bad_allgather")
        ),
    }


def _refused_calls(hvd: Any) -> dict[str, Any]:
    """Calls hora refuses before they run (Horovod raises ValueError or RuntimeError for them)."""
    return {
        "reducescatter_max": error_of(lambda: hvd.reducescatter(torch.ones(4), op=hvd.Max)),
        "reducescatter_scalar": error_of(lambda: hvd.reducescatter(torch.tensor(1.0))),
        "allgather_scalar": error_of(lambda: hvd.allgather(torch.tensor(1.0))),
        "not_contiguous": error_of(lambda: hvd.allreduce_async_(torch.ones(4, 2).t())),
        "bad_op": error_of(lambda: hvd.allreduce(torch.ones(2), op=17)),
    }


def _duplicate_names(hvd: Any, rank: int, size: int) -> list[dict[str, Any] | None]:
    """Each rank in turn submits a name twice while the first is surely still pending.

    The others submit the name only after a barrier that the checking rank enters after its
    second attempt, so the first request cannot have completed yet.
    """
    errors = []
    for checker in range(size):
        name = f"dup.{checker}"
        if rank == checker:
            handle = hvd.allreduce_async(torch.ones(2), name=name)
            errors.append(error_of(lambda n=name: hvd.allreduce_async(torch.ones(2), name=n)))
            hvd.barrier()
        else:
            hvd.barrier()
            handle = hvd.allreduce_async(torch.ones(2), name=name)
        hvd.synchronize(handle)
    return errors


def _duplicates_after_a_fast_first(hvd: Any, rank: int, size: int) -> dict[str, Any]:
    """A name submitted twice in a row is refused even when its first call can finish at once
    (the other ranks submitted theirs before); a name whose result nobody took is free again
    once a later call of this rank is done."""
    checker = size - 1
    if rank != checker:
        kept = hvd.allreduce_async(torch.ones(2), name="fast")
        hvd.barrier()
    else:
        hvd.barrier()
        kept = hvd.allreduce_async(torch.ones(2), name="fast")
        # Every other rank submitted "fast" already: the first call is done well before this.
        time.sleep(0.3)
    second = error_of(lambda: hvd.allreduce_async(torch.ones(2), name="fast"))
    hvd.barrier()
    # "fast" was never waited for, but the barrier after it is done: the name may be used again.
    again = hvd.allreduce(torch.ones(2), name="fast", op=hvd.Sum)
    return {
        "second": second,
        "first": hvd.synchronize(kept).tolist(),
        "again": again.tolist(),
    }


def _errors_worker() -> dict[str, Any]:
    import torch

    import hora.torch as hvd

    out: dict[str, Any] = {
        "before_init": error_of(lambda: hvd.allreduce(torch.ones(2))),
        "rank_before_init": error_of(hvd.rank),
        "initialized_before": hvd.is_initialized(),
    }
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out["mismatch"] = _mismatches(hvd, rank)
    out["after_mismatch"] = hvd.allreduce(torch.full((3,), float(rank)), op=hvd.Sum, name="ok")
    out["duplicates"] = _duplicate_names(hvd, rank, size)
    out["duplicates_fast"] = _duplicates_after_a_fast_first(hvd, rank, size)
    out["refused"] = _refused_calls(hvd)
    out["add_process_set_without_env"] = error_of(lambda: hvd.add_process_set(hvd.ProcessSet([0])))
    hvd.shutdown()
    out["initialized_after_shutdown"] = hvd.is_initialized()
    out["after_shutdown"] = error_of(lambda: hvd.allreduce(torch.ones(2), name="late"))
    hvd.init()
    out["initialized_again"] = hvd.is_initialized()
    out["after_reinit"] = hvd.allreduce(torch.full((3,), float(rank)), op=hvd.Sum, name="again")
    out["rank_after_reinit"] = (hvd.rank(), hvd.size())
    hvd.shutdown()
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda np: f"np{np}")
def job(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    np = request.param
    return np, run_job(_errors_worker, np)


@pytest.mark.timeout(120)
def test_ops_before_init_raise_value_error(job: Any) -> None:
    _, ranks = job
    for observed in ranks:
        assert observed["initialized_before"] is False
        assert_raised(observed["before_init"], ValueError, "not been initialized", "hvd.init()")
        assert_raised(observed["rank_before_init"], ValueError, "not been initialized")


@pytest.mark.timeout(120)
def test_mismatched_shapes_fail_on_every_rank_naming_tensor_and_ranks(job: Any) -> None:
    np, ranks = job
    for observed in ranks:
        error = observed["mismatch"]["shape"]
        assert_raised(error, RuntimeError, "bad_shape", "rank 0", "rank 1", "shape")
        assert "HoraInternalError" in error["types"]
        if np == 3:
            assert "rank 2" in error["message"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("case", "fragments"),
    [
        ("dtype", ("bad_dtype", "data types", "float32", "float64")),
        ("op", ("bad_op", "reduction", "Sum", "Max")),
        ("scale", ("bad_scale", "prescale")),
        ("root", ("bad_root", "root ranks", "rank 0", "root=0", "root=1")),
        ("allgather_shape", ("bad_allgather", "shape")),
    ],
)
def test_other_mismatches_fail_on_every_rank(
    job: Any, case: str, fragments: tuple[str, ...]
) -> None:
    _, ranks = job
    for observed in ranks:
        error = observed["mismatch"][case]
        assert_raised(error, RuntimeError, *fragments)
        assert "HoraInternalError" in error["types"]


@pytest.mark.timeout(120)
def test_engine_keeps_working_after_a_mismatch(job: Any) -> None:
    np, ranks = job
    expected = torch.full((3,), float(sum(range(np))))
    for observed in ranks:
        assert torch.equal(observed["after_mismatch"], expected)


@pytest.mark.timeout(120)
def test_duplicate_name_in_flight_raises_value_error_at_once(job: Any) -> None:
    _, ranks = job
    for observed in ranks:
        for error in observed["duplicates"]:
            assert_raised(
                error, ValueError, "same name", "currently being processed", "'allreduce.dup."
            )


@pytest.mark.timeout(120)
def test_duplicate_name_raises_even_when_the_first_call_already_ran(job: Any) -> None:
    np, ranks = job
    for observed in ranks:
        fast = observed["duplicates_fast"]
        # The checker's first call could finish at once; the others' was still pending.
        assert_raised(fast["second"], ValueError, "same name", "'allreduce.fast'")
        # Every first call, and the later one under the freed name, reduced.
        assert fast["first"] == [1.0, 1.0]
        assert fast["again"] == [float(np)] * 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("case", "fragment"),
    [
        ("reducescatter_max", "only supports AVERAGE and SUM"),
        ("reducescatter_scalar", "at least one dimension"),
        ("allgather_scalar", "rank-zero tensor"),
        ("not_contiguous", "contiguous"),
        ("bad_op", "unknown reduction op"),
    ],
)
def test_refused_calls_are_value_and_runtime_errors(job: Any, case: str, fragment: str) -> None:
    # Scripts written for Horovod catch one or the other; neither triggers an elastic reset.
    _, ranks = job
    for observed in ranks:
        error = observed["refused"][case]
        assert_raised(error, ValueError, fragment)
        assert_raised(error, RuntimeError, fragment)
        assert "HoraInternalError" not in error["types"]


@pytest.mark.timeout(120)
def test_add_process_set_without_dynamic_setting_raises(job: Any) -> None:
    _, ranks = job
    for observed in ranks:
        assert_raised(observed["add_process_set_without_env"], ValueError, "DYNAMIC_PROCESS_SETS")


@pytest.mark.timeout(120)
def test_ops_after_shutdown_raise(job: Any) -> None:
    _, ranks = job
    for observed in ranks:
        assert observed["initialized_after_shutdown"] is False
        error = observed["after_shutdown"]
        assert error is not None
        assert "ValueError" in error["types"] or "RuntimeError" in error["types"], error


@pytest.mark.timeout(120)
def test_init_again_after_shutdown_works(job: Any) -> None:
    np, ranks = job
    for rank, observed in enumerate(ranks):
        assert observed["initialized_again"] is True
        assert observed["rank_after_reinit"] == (rank, np)
        assert torch.equal(observed["after_reinit"], torch.full((3,), float(sum(range(np)))))
