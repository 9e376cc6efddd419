"""Process sets on real processes: static sets from ``hvd.init``, dynamic ones added and removed
later, collectives restricted to members, and errors for ranks outside a set.

The static set holds every rank but the last (``[0]`` at np=2, ``[0, 1]`` at np=3); the dynamic
set holds every rank but the first, so its global root rank differs from its rank in the set.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from .jobs import assert_raised, error_of, run_job
from .references import all_inputs, assert_same, expected_allreduce, rank_input


def _set_ops(
    hvd: Any, rank: int, process_set: Any, prefix: str, root: int, outsider: int
) -> dict[str, Any]:
    """Run collectives inside ``process_set`` (the caller is a member)."""
    x = rank_input(rank, f"{prefix}.x", (4,))
    return {
        "sum": hvd.allreduce(x, op=hvd.Sum, name=f"{prefix}.sum", process_set=process_set),
        "average": hvd.allreduce(x, name=f"{prefix}.average", process_set=process_set),
        "allgather": hvd.allgather(
            x.reshape(2, 2), name=f"{prefix}.allgather", process_set=process_set
        ),
        "broadcast": hvd.broadcast(
            x, root_rank=root, name=f"{prefix}.broadcast", process_set=process_set
        ),
        "outside_root": error_of(
            lambda: hvd.broadcast(
                x, root_rank=outsider, name=f"{prefix}.outside_root", process_set=process_set
            )
        ),
    }


def _describe(process_set: Any) -> dict[str, Any]:
    """The set's answers; a non-member's ``rank()`` raises, and gives its error instead."""
    rank: Any = error_of(process_set.rank)
    if rank is None:
        rank = process_set.rank()
    return {
        "id": process_set.process_set_id,
        "size": process_set.size(),
        "rank": rank,
        "included": process_set.included(),
    }


def _process_sets_worker(size: int) -> dict[str, Any]:
    import torch

    import hora.torch as hvd
    from hora.common.ops.repeated import RepeatedAllreduce

    static = hvd.ProcessSet(range(size - 1))
    # Horovod's queries before registration: size and rank are None; included needs init.
    out: dict[str, Any] = {
        "before_init": {
            "id": static.process_set_id,
            "size": static.size(),
            "rank": static.rank(),
            "included": error_of(static.included),
        }
    }
    never_added = hvd.ProcessSet(ranks_or_comm=[0])  # Horovod's keyword
    hvd.init(process_sets=[static])
    rank = hvd.rank()
    x = torch.ones(4)
    out["static"] = _describe(static)
    out["never_added"] = _describe(never_added)
    if static.included():
        out["static_ops"] = _set_ops(hvd, rank, static, "static", root=size - 2, outsider=size - 1)
    else:
        out["static_outsider"] = error_of(lambda: hvd.allreduce(x, process_set=static))
    out["global_sum"] = hvd.allreduce(rank_input(rank, "global"), op=hvd.Sum, name="global")

    # Dynamic: needs HORA_DYNAMIC_PROCESS_SETS=1; every rank adds and removes in the same order.
    dynamic = hvd.add_process_set(hvd.ProcessSet(range(1, size)))
    out["dynamic"] = _describe(dynamic)
    if dynamic.included():
        out["dynamic_ops"] = _set_ops(hvd, rank, dynamic, "dynamic", root=size - 1, outsider=0)
    else:
        out["dynamic_outsider"] = error_of(lambda: hvd.allreduce(x, process_set=dynamic))
    out["duplicate_add"] = error_of(lambda: hvd.add_process_set(hvd.ProcessSet(range(1, size))))
    # A gradient's repeated allreduce (DistributedOptimizer's) follows the set's removal and
    # its return under another id.
    reducer = RepeatedAllreduce("repeated", hvd.Sum, 1.0, 1.0, dynamic)

    def repeat() -> list[float]:
        return hvd.synchronize(reducer.submit(torch.ones(2))).tolist()

    if dynamic.included():
        out["repeated"] = [repeat(), repeat()]
    out["removed"] = hvd.remove_process_set(dynamic)
    out["removed_again"] = hvd.remove_process_set(dynamic)
    out["after_remove"] = error_of(lambda: hvd.allreduce(x, process_set=dynamic))
    out["removed_describe"] = _describe(dynamic)
    out["repeated_after_remove"] = error_of(repeat)
    hvd.add_process_set(dynamic)
    out["readded_id"] = dynamic.process_set_id
    if dynamic.included():
        out["repeated_readded"] = repeat()
    hvd.remove_process_set(dynamic)
    out["remove_global"] = error_of(lambda: hvd.remove_process_set(hvd.global_process_set))
    out["global_after_remove"] = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after")

    # Horovod's add_process_set also takes a plain list of ranks.
    by_ranks = error_of(lambda: out.update(by_ranks_set=hvd.add_process_set([size - 1])))
    out["add_by_ranks"] = by_ranks
    if by_ranks is None:
        members = out.pop("by_ranks_set")
        out["by_ranks"] = _describe(members)
        if members.included():
            out["by_ranks_sum"] = hvd.allreduce(
                torch.ones(1), op=hvd.Sum, process_set=members, name="by_ranks"
            )
        hvd.remove_process_set(members)
    hvd.shutdown()
    # As Horovod's: the global set's queries raise once hora is shut down.
    out["global_after_shutdown"] = [
        error_of(query)
        for query in (
            hvd.global_process_set.size,
            hvd.global_process_set.rank,
            hvd.global_process_set.included,
        )
    ]
    out["global_id_after_shutdown"] = hvd.global_process_set.process_set_id
    return out


@pytest.fixture(
    scope="module",
    params=[(2, False), (3, False), (2, True), (3, True)],
    ids=lambda p: f"np{p[0]}" + ("-mpi" if p[1] else ""),
)
def job(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    np, mpi = request.param
    env = {"HORA_DYNAMIC_PROCESS_SETS": "1"}
    return np, run_job(_process_sets_worker, np, np, env=env, mpi=mpi)


def _check_set_ops(
    np: int, ranks: list[dict[str, Any]], key: str, members: list[int], root: int
) -> None:
    prefix = key.removesuffix("_ops")
    inputs = [rank_input(r, f"{prefix}.x", (4,)) for r in members]
    for rank in members:
        ops = ranks[rank][key]
        assert_same(ops["sum"], expected_allreduce(inputs, "Sum"), f"rank {rank} sum")
        # Average divides by the size of the set, not of the job.
        assert_same(ops["average"], expected_allreduce(inputs, "Average"), f"rank {rank} avg")
        assert_same(ops["allgather"], torch.cat([t.reshape(2, 2) for t in inputs]))
        assert_same(ops["broadcast"], rank_input(root, f"{prefix}.x", (4,)))
        assert_raised(ops["outside_root"], RuntimeError, "is not a member of process set")
    for rank in range(np):
        if rank not in members:
            assert key not in ranks[rank]


@pytest.mark.timeout(120)
def test_static_set_runs_collectives_among_its_members(job: Any) -> None:
    np, ranks = job
    members = list(range(np - 1))
    for rank, observed in enumerate(ranks):
        described = dict(observed["static"])
        if rank in members:
            assert described.pop("rank") == rank
        else:
            assert_raised(described.pop("rank"), ValueError, f"Rank {rank} is not a member")
        assert described == {"id": 1, "size": np - 1, "included": rank in members}
    _check_set_ops(np, ranks, "static_ops", members, root=members[-1])


@pytest.mark.timeout(120)
def test_unregistered_sets_answer_none_as_horovods_do(job: Any) -> None:
    np, ranks = job
    for rank, observed in enumerate(ranks):
        before = observed["before_init"]
        assert (before["id"], before["size"], before["rank"]) == (None, None, None)
        assert_raised(before["included"], ValueError, "hvd.init()")
        # Made after init but never added: no id, no size or rank; membership by its ranks.
        assert observed["never_added"] == {
            "id": None,
            "size": None,
            "rank": None,
            "included": rank == 0,
        }
        assert observed["removed_describe"] == {
            "id": None,
            "size": None,
            "rank": None,
            "included": rank != 0,
        }


@pytest.mark.timeout(120)
def test_non_member_gets_value_error_naming_its_rank(job: Any) -> None:
    np, ranks = job
    assert_raised(ranks[np - 1]["static_outsider"], ValueError, f"Rank {np - 1} is not a member")
    assert_raised(ranks[0]["dynamic_outsider"], ValueError, "Rank 0 is not a member")


@pytest.mark.timeout(120)
def test_global_set_queries_raise_after_shutdown(job: Any) -> None:
    _, ranks = job
    for observed in ranks:
        for error in observed["global_after_shutdown"]:
            assert_raised(error, ValueError, "hvd.init()")
        assert observed["global_id_after_shutdown"] == 0


@pytest.mark.timeout(120)
def test_global_set_still_works_alongside_sets(job: Any) -> None:
    np, ranks = job
    for observed in ranks:
        assert_same(observed["global_sum"], expected_allreduce(all_inputs(np, "global"), "Sum"))
        assert_same(observed["global_after_remove"], torch.full((2,), float(np)))


@pytest.mark.timeout(120)
def test_dynamic_set_takes_a_global_root_rank(job: Any) -> None:
    np, ranks = job
    members = list(range(1, np))
    for rank, observed in enumerate(ranks):
        assert observed["dynamic"]["size"] == np - 1
        if rank:
            assert observed["dynamic"]["rank"] == rank - 1
        else:
            assert_raised(observed["dynamic"]["rank"], ValueError, "Rank 0 is not a member of")
    _check_set_ops(np, ranks, "dynamic_ops", members, root=np - 1)


@pytest.mark.timeout(120)
def test_dynamic_set_add_and_remove(job: Any) -> None:
    _, ranks = job
    for observed in ranks:
        assert_raised(observed["duplicate_add"], ValueError, "duplicate process set")
        assert observed["removed"] is True
        assert observed["removed_again"] is False
        assert_raised(observed["after_remove"], ValueError, "not registered")
        assert_raised(observed["remove_global"], ValueError, "global process set")


@pytest.mark.timeout(120)
def test_a_repeated_allreduce_follows_its_set_being_removed_and_added_again(job: Any) -> None:
    np, ranks = job
    for rank, observed in enumerate(ranks):
        assert_raised(observed["repeated_after_remove"], ValueError, "not registered")
        first_id = observed["dynamic"]["id"]
        assert observed["readded_id"] not in (None, 0, first_id)
        if rank == 0:
            assert "repeated" not in observed and "repeated_readded" not in observed
        else:
            expected = [float(np - 1)] * 2
            assert observed["repeated"] == [expected, expected]
            assert observed["repeated_readded"] == expected


@pytest.mark.timeout(120)
def test_add_process_set_accepts_a_list_of_ranks(job: Any) -> None:
    np, ranks = job
    for rank, observed in enumerate(ranks):
        assert observed["add_by_ranks"] is None, observed["add_by_ranks"]
        assert observed["by_ranks"]["size"] == 1
        if rank == np - 1:
            assert_same(observed["by_ranks_sum"], torch.ones(1))
