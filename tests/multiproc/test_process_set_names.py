"""Names belong to their process set, as in Horovod: two or three sets with operations in flight
at once, under the same names (unnamed ops of disjoint sets are numbered alike), beside an op of
the global set under that name too.

Sets: ``evens`` and ``odds`` split the job; from 3 ranks on, ``low`` ([0, 1]) overlaps both, so a
rank may have the same name in flight in two sets and in the global set at once.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from .jobs import assert_raised, error_of, run_job
from .references import assert_same, expected_allreduce, rank_input

SHARED = "shared"


def _sets(size: int) -> dict[str, list[int]]:
    sets = {
        "evens": list(range(0, size, 2)),
        "odds": list(range(1, size, 2)),
    }
    if size >= 3:
        sets["low"] = [0, 1]
    return sets


def _names_worker(size: int) -> dict[str, Any]:
    import torch

    import hora.torch as hvd

    specs = _sets(size)
    sets = {label: hvd.ProcessSet(ranks) for label, ranks in specs.items()}
    hvd.init(process_sets=list(sets.values()))
    rank = hvd.rank()
    mine = {label: s for label, s in sets.items() if s.included()}
    out: dict[str, Any] = {"sets": sorted(mine)}

    # Everything below is in flight together before anything is waited for.
    handles: dict[str, int] = {}
    for label, process_set in mine.items():
        # Unnamed: every rank has made the same calls so far, so disjoint sets pick the same
        # automatic name (allreduce.noname.<n>) at the same moment.
        handles[f"{label}.noname"] = hvd.allreduce_async(
            rank_input(rank, f"{label}.noname"), op=hvd.Sum, process_set=process_set
        )
        handles[f"{label}.shared"] = hvd.allreduce_async(
            rank_input(rank, f"{label}.shared"), name=SHARED, op=hvd.Sum, process_set=process_set
        )
        handles[f"{label}.allgather"] = hvd.allgather_async(
            rank_input(rank, f"{label}.allgather", (rank + 1, 2)),
            name=SHARED,
            process_set=process_set,
        )
        handles[f"{label}.grouped"] = hvd.grouped_allreduce_async(
            [rank_input(rank, f"{label}.g{i}", (i + 1,)) for i in range(3)],
            name=SHARED,
            op=hvd.Sum,
            process_set=process_set,
        )
    handles["global.shared"] = hvd.allreduce_async(
        rank_input(rank, "global.shared"), name=SHARED, op=hvd.Sum
    )
    # The same name twice in one set is still refused, at once.
    first = next(iter(mine.values()))
    out["duplicate"] = error_of(
        lambda: hvd.allreduce_async(torch.ones(1), name=SHARED, process_set=first)
    )
    for key, handle in handles.items():
        out[key] = hvd.synchronize(handle)
    # Afterwards the names are free again in every set, and the caches serve them.
    for label, process_set in mine.items():
        out[f"{label}.again"] = hvd.allreduce(
            rank_input(rank, f"{label}.shared"), name=SHARED, op=hvd.Sum, process_set=process_set
        )
    # A rank that shuts down ends the job: the ranks of two sets may not be done yet.
    hvd.barrier()
    hvd.shutdown()
    return out


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda np: f"np{np}")
def job(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    np = request.param
    return np, run_job(_names_worker, np, np)


def _sum_over(members: list[int], name: str, shape: tuple[int, ...] = (3, 4)) -> torch.Tensor:
    return expected_allreduce([rank_input(r, name, shape) for r in members], "Sum")


@pytest.mark.timeout(180)
def test_each_set_runs_its_own_op_under_a_shared_name(job: Any) -> None:
    np, ranks = job
    for label, members in _sets(np).items():
        for rank in members:
            observed = ranks[rank]
            assert label in observed["sets"]
            for op in ("noname", "shared"):
                expected = _sum_over(members, f"{label}.{op}")
                assert_same(observed[f"{label}.{op}"], expected, f"rank {rank} {label}.{op}")
            assert_same(observed[f"{label}.again"], _sum_over(members, f"{label}.shared"))
            gathered = [rank_input(r, f"{label}.allgather", (r + 1, 2)) for r in members]
            assert_same(observed[f"{label}.allgather"], torch.cat(gathered))
            for i, result in enumerate(observed[f"{label}.grouped"]):
                assert_same(result, _sum_over(members, f"{label}.g{i}", (i + 1,)))


@pytest.mark.timeout(180)
def test_the_global_set_shares_the_name_too(job: Any) -> None:
    np, ranks = job
    expected = _sum_over(list(range(np)), "global.shared")
    for observed in ranks:
        assert_same(observed["global.shared"], expected)


@pytest.mark.timeout(180)
def test_a_name_in_flight_is_still_unique_within_its_set(job: Any) -> None:
    _, ranks = job
    for observed in ranks:
        assert_raised(observed["duplicate"], ValueError, "same name", "currently being processed")


def _unnamed_after_a_subset_worker(size: int) -> dict[str, Any]:
    import hora.torch as hvd

    low = hvd.ProcessSet([0, 1])
    hvd.init(process_sets=[low])
    rank = hvd.rank()
    out: dict[str, Any] = {}
    # Only ranks 0 and 1 make these unnamed calls ...
    if low.included():
        out["low"] = [
            hvd.allreduce(rank_input(rank, f"low{i}"), op=hvd.Sum, process_set=low)
            for i in range(2)
        ]
    # ... and the next unnamed call of the whole job still gets the same name on every rank.
    out["global"] = hvd.allreduce(rank_input(rank, "global"), op=hvd.Sum)
    hvd.shutdown()
    return out


@pytest.mark.timeout(120)
def test_unnamed_calls_of_a_subset_do_not_shift_the_job_s_names() -> None:
    np = 3
    ranks = run_job(_unnamed_after_a_subset_worker, np, np)
    for rank, observed in enumerate(ranks):
        assert_same(observed["global"], _sum_over(list(range(np)), "global"))
        if rank < 2:
            for i, result in enumerate(observed["low"]):
                assert_same(result, _sum_over([0, 1], f"low{i}"))
